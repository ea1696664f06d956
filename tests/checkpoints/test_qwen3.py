"""A dense Qwen3 from a Hugging Face directory (tests/fixtures/qwen3, written by transformers; see its
make_fixture.py): the family's config (QK norms, no QKV bias, head_dim wider than hidden / heads, tied
embeddings), transformers' float32 logits and its greedy continuation through our cached decode loop; the
directory's tokenizer.json (byte-level BPE, chat template in chat_template.jinja) against transformers' ids and
renderings."""

from __future__ import annotations

import functools
import json
import os
import shutil

import jax.numpy as jnp
import numpy as np
import pytest

from spec_jax.batch import generate
from spec_jax.checkpoints.load import load_tokenizer
from spec_jax.checkpoints.safetensors_loader import load_hf
from spec_jax.models.transformer import forward

HERE = os.path.join(os.path.dirname(__file__), "..", "fixtures", "qwen3")
TARGET = os.path.join(HERE, "target")


@functools.lru_cache(maxsize=None)
def _model():
  return load_hf(TARGET)


@functools.lru_cache(maxsize=None)
def _ref():
  return dict(np.load(os.path.join(HERE, "reference.npz")))


def test_config_is_the_qwen3_family():
  config, params = _model()
  assert config.qk_norm and not config.qkv_bias and not config.post_norms and config.tie_embeddings
  assert (config.head_dim, config.d_model // config.num_heads) == (16, 8)
  assert config.sliding_window is None and config.rope_base == 1e6
  assert params["layers"]["q_norm"].shape == (3, 16) and "q_bias" not in params["layers"]
  assert config.vocab_size == 300 and config.eos_ids == (2,)


def test_logits_match_transformers():
  config, params = _model()
  worst = 0.0
  for i in range(3):
    prompt = _ref()[f"prompt_p{i}"]
    logits, _, _ = forward(params, jnp.asarray(prompt[None]), config=config)
    worst = max(worst, float(np.abs(np.asarray(logits[0]) - _ref()[f"logits_p{i}"]).max()))
  print(f"qwen3 logits: max abs error {worst:.2e}")
  assert worst < 1e-4


def test_without_qk_norms_the_logits_differ():
  """The negative control: the same weights read as a Qwen2-style model (no QK norms) miss the reference."""
  config, params = _model()
  plain = {**params, "layers": {k: v for k, v in params["layers"].items() if k not in ("q_norm", "k_norm")}}
  logits, _, _ = forward(plain, jnp.asarray(_ref()["prompt_p0"][None]), config=config.replace(qk_norm=False))
  assert float(np.abs(np.asarray(logits[0]) - _ref()["logits_p0"]).max()) > 1e-2


def test_greedy_decode_matches_transformers():
  config, params = _model()
  config = config.replace(eos_ids=())
  prompts = [_ref()[f"prompt_p{i}"].tolist() for i in range(3)]
  res = generate(params, config, prompts, max_new_tokens=8)
  assert res.token_ids == [_ref()[f"greedy_p{i}"].tolist() for i in range(3)]


@pytest.mark.parametrize("edit,match", [({"use_sliding_window": True}, "use_sliding_window"),
                                        ({"layer_types": ["sliding_attention"] * 3}, "layer_types")])
def test_sliding_windows_are_refused(tmp_path, edit, match):
  d = tmp_path / "q3"
  shutil.copytree(TARGET, d)
  cfg = json.loads((d / "config.json").read_text())
  (d / "config.json").write_text(json.dumps({**cfg, **edit}))
  with pytest.raises(ValueError, match=match):
    load_hf(str(d))


def test_tokenizer_json_matches_transformers():
  ref = json.loads(open(os.path.join(HERE, "tokenizer_reference.json"), encoding="utf-8").read())
  tok = load_tokenizer(TARGET)
  assert type(tok).__name__ == "BPETokenizer"
  for text, ids in ref["texts"].items():
    assert tok.encode(text) == ids, text
    assert tok.decode(ids) == text
  for chat, want in zip(([{"role": "user", "content": "hi there"}],
                         [{"role": "system", "content": "be brief"}, {"role": "user", "content": "2+2?"},
                          {"role": "assistant", "content": "4"}, {"role": "user", "content": "and 3+3?"}]),
                        ref["chats"]):
    assert tok.apply_chat_template(chat) == want
  assert tok.id_of("<|im_end|>") == 2


def test_tokenizer_config_bos_and_errors(tmp_path):
  d = tmp_path / "q3"
  shutil.copytree(TARGET, d)
  cfg_path = d / "tokenizer_config.json"
  cfg = json.loads(cfg_path.read_text())
  cfg_path.write_text(json.dumps({**cfg, "bos_token": {"content": "<|endoftext|>"}, "add_bos_token": True}))
  assert load_tokenizer(str(d)).encode("hello")[:1] == [0]
  cfg_path.write_text(json.dumps({**cfg, "eos_token": "<nope>"}))
  with pytest.raises(ValueError, match="eos_token '<nope>' is not in"):
    load_tokenizer(str(d))
  (d / "tokenizer.json").write_text("{not json")
  with pytest.raises(ValueError, match="not a valid tokenizers pipeline"):
    load_tokenizer(str(d))
  (d / "tokenizer.json").unlink()
  with pytest.raises(FileNotFoundError, match="neither tokenizer.model"):
    load_tokenizer(str(d))
