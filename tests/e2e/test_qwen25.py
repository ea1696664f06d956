"""Qwen2.5-Coder 1.5B-Instruct (target) and 0.5B-Instruct (draft) end to end: the packaged GGUFs assemble, the
byte-level BPE tokenizer and the chat template equal transformers' for the same file, both models' float32 logits
equal transformers', and the 0.5B draft (and n-gram lookup) leave the 1.5B's greedy output unchanged.

The fixtures come from tools/make_qwen_fixtures.py (transformers 5.24, float32). The models come from the `qwen`
extra (`make install` installs it)."""

from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from spec_jax.checkpoints import packages
from spec_jax.checkpoints.load import load_params, load_tokenizer
from spec_jax.batch import generate
from spec_jax.models.transformer import forward
from spec_jax.proposers.ngram import NgramProposer
from spec_jax.proposers.registry import Target, build_proposer
from spec_jax.spec_config import SpecConfig

pytestmark = pytest.mark.slow

TARGET, DRAFT = "qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct"
FIXTURES = os.path.join(os.path.dirname(__file__), "..", "fixtures")


@pytest.fixture(scope="module")
def paths():
  return {name: packages.assemble(name) for name in (TARGET, DRAFT)}


@pytest.fixture(scope="module")
def tok(paths):
  return load_tokenizer(paths[TARGET])


@pytest.fixture(scope="module")
def tok_fixture():
  with open(os.path.join(FIXTURES, "qwen25_tokenizer.json"), encoding="utf-8") as f:
    return json.load(f)


@pytest.fixture(scope="module")
def logits_fixture():
  return np.load(os.path.join(FIXTURES, "qwen25_logits.npz"))


@pytest.fixture(scope="module")
def target(paths):
  return load_params(paths[TARGET], "float32")


def test_assembled_files_are_the_pinned_ones(paths):
  for name, path in paths.items():
    assert os.path.getsize(path) == packages.PACKAGED[name].size
  assert packages.assemble(TARGET) == paths[TARGET]  # second call: verified, not joined again


def test_tokenizer_matches_transformers(tok, tok_fixture):
  samples = tok_fixture["samples"]
  assert len(samples) >= 20
  bad = [(s["text"], tok.encode(s["text"]), s["ids"]) for s in samples if tok.encode(s["text"]) != s["ids"]]
  assert not bad, "\n".join(f"{t!r}\n ours {a}\n hf   {b}" for t, a, b in bad[:3])
  for s in samples:
    assert tok.decode(s["ids"]) == s["decoded"], s["text"]
    assert tok.decode(s["ids"], skip_special=True) == s["decoded_skip_special"], s["text"]


def test_chat_template_matches_transformers(tok, tok_fixture):
  for chat in tok_fixture["chats"]:
    text = tok.apply_chat_template(chat["messages"], chat["add_generation_prompt"])
    assert text == chat["text"]
    assert tok.encode(text) == chat["ids"]
  # Plain strings alternate user and assistant, as for Gemma.
  assert tok.apply_chat_template(["Hi"]) == tok_fixture["chats"][0]["text"].replace(
      tok_fixture["chats"][0]["messages"][0]["content"], "Hi")


def test_streaming_equals_decode(tok, tok_fixture):
  for s in tok_fixture["samples"]:
    stream = tok.stream()
    pieces = [stream.add(t) for t in s["ids"]] + [stream.flush()]
    assert "".join(pieces) == s["decoded"], s["text"]


def test_draft_shares_the_target_vocabulary(paths, tok):
  assert load_tokenizer(paths[DRAFT]).vocab_digest() == tok.vocab_digest()
  assert tok.stop_ids == (tok.id_of("<|im_end|>"), tok.id_of("<|endoftext|>"))


def _check_logits(config, params, z, name):
  n = 0
  while f"ids_{name}_{n}" in z:
    ids, pos, cols = z[f"ids_{name}_{n}"], z[f"positions_{name}_{n}"], z[f"cols_{name}_{n}"]
    logits = jax.jit(lambda p, x: forward(p, x, config=config)[0])(params, jnp.asarray(ids)[None])
    ours = np.asarray(logits[0])[pos][:, cols]
    np.testing.assert_allclose(ours, z[f"logits_{name}_{n}"], atol=1e-3, rtol=0, err_msg=f"{name} prompt {n}")
    n += 1
  return n


def test_target_logits_match_transformers(target, logits_fixture):
  config, params = target
  assert config.qkv_bias and not config.tie_embeddings and config.rope_base == 1e6 and config.num_layers == 28
  assert _check_logits(config, params, logits_fixture, TARGET) == 2
  assert len(logits_fixture[f"ids_{TARGET}_1"]) > 300


def test_draft_logits_match_transformers(paths, logits_fixture):
  config, params = load_params(paths[DRAFT], "float32")
  assert config.num_layers == 24 and config.d_model == 896
  assert _check_logits(config, params, logits_fixture, DRAFT) == 1


CODING = ["Write a Python function that returns the n-th Fibonacci number.",
          "Explain what a Python list comprehension is, with one example.",
          "Write a SQL query that counts the orders per customer in a table `orders`."]


@pytest.mark.full  # 3 min; Gemma's lossless tests run the same loop in make test, Qwen's logits match there
def test_draft_and_ngram_are_lossless(paths, target, tok):
  config, params = target
  config = config.replace(eos_ids=())  # a fixed 32 tokens per prompt
  prompts = [tok.encode(tok.apply_chat_template([p])) for p in CODING]
  plain = generate(params, config, prompts, max_new_tokens=32)
  proposer, pparams = build_proposer(SpecConfig("draft", 4, model=DRAFT), Target(config, params, model_path=paths[TARGET], dtype="float32"))
  assert proposer.config.num_layers == 24
  draft = generate(params, config, prompts, max_new_tokens=32, proposer=proposer, proposer_params=pparams,
                   adaptive_k=False)
  assert draft.token_ids == plain.token_ids
  assert draft.stats["accepted_tokens"] > 32  # the 0.5B's drafts are mostly right on these
  ngram = generate(params, config, prompts[:1], max_new_tokens=32, proposer=NgramProposer(k=4), adaptive_k=False)
  assert ngram.token_ids == plain.token_ids[:1]


def test_draft_of_another_vocabulary_is_refused(paths, target):
  config, params = target
  from spec_jax.checkpoints.gguf_meta import default_model_path
  with pytest.raises(ValueError, match="vocabulary of 262144 ids and the target 151936"):
    build_proposer(SpecConfig("draft", 4, model=default_model_path()), Target(config, params, model_path=paths[TARGET]))
