"""Gemma 3 270M end to end: greedy output equals transformers', batching changes nothing, and every proposer
is lossless against plain greedy (float32)."""

import json
import os

import pytest

from spec_jax.batch import generate
from spec_jax.proposers.draft import early_exit_proposer
from spec_jax.proposers.ngram import NgramProposer

pytestmark = pytest.mark.slow

FIXTURE = os.path.join(os.path.dirname(__file__), "..", "fixtures", "gemma3_greedy.json")


@pytest.fixture(scope="module")
def greedy_fixture():
  with open(FIXTURE) as f:
    return json.load(f)["records"]


@pytest.fixture(scope="module")
def batched_run(gemma3_f32, greedy_fixture):
  config, params = gemma3_f32
  prompts = [r["prompt_ids"] for r in greedy_fixture]
  # No stop tokens: transformers generated a fixed 64 tokens.
  return generate(params, config.replace(eos_ids=()), prompts, max_new_tokens=64)


def test_greedy_matches_transformers(gemma3_f32, greedy_fixture, batched_run):
  assert len(greedy_fixture) >= 5
  for rec, got in zip(greedy_fixture, batched_run.token_ids):
    assert got == rec["greedy_ids"], rec["prompt"][:60]


def test_batch_invariance(gemma3_f32, greedy_fixture, batched_run):
  config, params = gemma3_f32
  for i in (0, 3):
    alone = generate(params, config.replace(eos_ids=()), [greedy_fixture[i]["prompt_ids"]], max_new_tokens=64)
    assert alone.token_ids[0] == batched_run.token_ids[i]


# make test-full: the n-gram chain on Gemma runs in make test on an int8 cache (tests/test_kv_cache_8bit_gemma.py),
# the draft-model chain with the shipped draft (tests/proposers/test_medusa_eagle.py), the early-exit self-draft
# as a tree (tests/test_tree_decode.py); this case adds only the pairing on these six prompts.
@pytest.mark.full
def test_ngram_and_draft_are_lossless(gemma3_f32, greedy_fixture, batched_run):
  config, params = gemma3_f32
  config = config.replace(eos_ids=())
  prompts = [r["prompt_ids"] for r in greedy_fixture][:6]
  want = [t[:48] for t in batched_run.token_ids[:6]]
  ngram = generate(params, config, prompts, max_new_tokens=48, proposer=NgramProposer(k=4), adaptive_k=False)
  assert ngram.token_ids == want
  assert ngram.stats["accepted_tokens"] > 0
  proposer, pparams = early_exit_proposer(config, params, 6, k=3)
  draft = generate(params, config, prompts, max_new_tokens=48, proposer=proposer, proposer_params=pparams,
                   adaptive_k=False)
  assert draft.token_ids == want
  assert draft.stats["accepted_tokens"] > 0
