"""`--method=draft --speculative_model=PATH`: an independent draft model, GGUF or HF safetensors, with its own config
and KV cache. It stays lossless, and a draft whose vocabulary differs from the target's is refused (another
size, or the same size with other pieces) before its weights load."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from spec_jax.checkpoints.load import load_model
from spec_jax.batch import generate
from spec_jax.models.transformer import init_params
from spec_jax.proposers.registry import Target, build_proposer
from spec_jax.spec_config import SpecConfig
from tests.checkpoints.gguf_writer import write_tiny_gguf
from tests.checkpoints.hf_writer import write_hf
from tests.checkpoints.tiny_qwen2 import CONFIG, MERGES, TEMPLATE, TOKENS, TYPES, write_tiny_qwen2


@pytest.fixture(scope="module")
def target(tmp_path_factory):
  path, _ = write_tiny_qwen2(tmp_path_factory.mktemp("target") / "target.gguf", never_stop=True)
  config, params, tok = load_model(path, "float32")
  return path, config, params, tok


def _build(target, draft_model, **kw):
  path, config, params, _ = target
  return build_proposer(SpecConfig("draft", 3, model=draft_model, **kw),
                        Target(config, params, model_path=path, dtype="float32"))


def test_safetensors_draft_is_lossless(target, tmp_path):
  path, config, params, tok = target
  # Another model of the same family: the target's shape with other weights, as an HF directory.
  other = jax.tree.map(np.asarray, init_params(CONFIG, jax.random.key(7)))
  write_hf(tmp_path / "draft_hf", CONFIG, other, "qwen2")
  proposer, pparams = _build(target, str(tmp_path / "draft_hf"))
  assert proposer.name == "draft" and proposer.config.num_layers == CONFIG.num_layers
  prompts = [tok.encode("hello world"), tok.encode("<|im_start|>user\nheld<|im_end|>\n")]
  plain = generate(params, config, prompts, max_new_tokens=12)
  spec = generate(params, config, prompts, max_new_tokens=12, proposer=proposer, proposer_params=pparams,
                  adaptive_k=False)
  assert spec.token_ids == plain.token_ids
  assert spec.stats["drafted_tokens"] > 0


def test_gguf_draft_of_a_smaller_model_is_lossless(target, tmp_path):
  path, config, params, tok = target
  small = CONFIG.replace(num_layers=1, d_model=16, num_heads=2, num_kv_heads=1, mlp_dim=32)
  sp = jax.tree.map(np.asarray, init_params(small, jax.random.key(3)))
  from tests.checkpoints.tiny_qwen2 import tokenizer_metadata
  write_tiny_gguf(tmp_path / "small.gguf", small, sp, arch="qwen2", extra=tokenizer_metadata())
  proposer, pparams = _build(target, str(tmp_path / "small.gguf"))
  assert proposer.config.d_model == 16 and proposer.config.num_layers == 1
  prompts = [tok.encode("hello world")]
  plain = generate(params, config, prompts, max_new_tokens=10)
  spec = generate(params, config, prompts, max_new_tokens=10, proposer=proposer, proposer_params=pparams,
                  adaptive_k=False)
  assert spec.token_ids == plain.token_ids


def test_the_target_drafting_for_itself_accepts_everything(target):
  path, config, params, tok = target
  proposer, pparams = _build(target, path)
  res = generate(params, config, [tok.encode("hello")], max_new_tokens=12, proposer=proposer,
                 proposer_params=pparams, adaptive_k=False)
  assert res.stats["accepted_tokens"] == res.stats["drafted_tokens"] > 0


def test_other_vocabularies_are_refused(target, tmp_path):
  from tests.serve.test_server import write_tiny_model  # a tiny Gemma 3 with a SentencePiece vocabulary
  gemma = write_tiny_model(tmp_path / "gemma.gguf")
  with pytest.raises(ValueError, match=r"vocabulary of \d+ ids and the target \d+"):
    _build(target, gemma)
  # Same size, two pieces swapped: the ids mean other things.
  tokens = list(TOKENS)
  a, b = tokens.index("he"), tokens.index("ll")
  tokens[a], tokens[b] = tokens[b], tokens[a]

  def swapped(w):
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(tokens)
    w.add_token_types(TYPES)
    w.add_token_merges(MERGES)
    w.add_chat_template(TEMPLATE)
  params = jax.tree.map(np.asarray, init_params(CONFIG, jax.random.key(0)))
  write_tiny_gguf(tmp_path / "swapped.gguf", CONFIG, params, arch="qwen2", extra=swapped)
  with pytest.raises(ValueError, match="maps them to other pieces"):
    _build(target, str(tmp_path / "swapped.gguf"))
  with pytest.raises(ValueError, match="give one"):
    _build(target, target[0], draft_layers=1)
  with pytest.raises(FileNotFoundError, match="packaged model"):
    _build(target, "no-such-draft")
