"""The shipped Gemma 3 270M head in the published EAGLE-3 layout (heads/eagle3L_gemma3_270m, issue 28): exported
to each published format it can be written in (EAGLE-3's, vLLM speculators') and loaded back, it holds the same
weights and drafts the same tokens: greedy output equals plain decoding and tau and the acceptance per position
are identical to the shipped checkpoint's, on the same prompts."""

import os

import jax
import numpy as np
import pytest

from spec_jax.batch import generate
from spec_jax.proposers.registry import Target, build_proposer
from spec_jax.spec_config import SpecConfig
from train import export

pytestmark = pytest.mark.slow

STEM = os.path.join(os.path.dirname(__file__), "..", "..", "heads", "eagle3L_gemma3_270m")
TEXTS = ("Write a Python function that reverses a string.", "Explain why the sky is blue in two sentences.",
         "List three uses of a hash map.")


def test_the_shipped_eagle3_layout_head_round_trips_through_each_published_format(gemma3_f32, gemma3_tokenizer,
                                                                                   tmp_path):
  config, params = gemma3_f32
  target = Target(config, params)
  prompts = [gemma3_tokenizer.encode(gemma3_tokenizer.apply_chat_template([t])) for t in TEXTS]  # as it was trained
  prop, pp = build_proposer(SpecConfig("eagle3", 3, model=STEM), target)
  run = lambda p, q: generate(params, config, prompts, max_new_tokens=24, proposer=p, proposer_params=q,
                              adaptive_k=False)
  shipped = run(prop, pp)
  assert shipped.token_ids == generate(params, config, prompts, max_new_tokens=24).token_ids
  assert shipped.stats["mean_acceptance_length"] > 1.2  # it drafts (1.43 measured): a broken head accepts ~nothing
  for fmt in ("eagle3", "speculators"):
    out = str(tmp_path / fmt)
    export.export(STEM, fmt, out, config, params, gemma3_tokenizer, target_name="google/gemma-3-270m-it")
    back, back_p = build_proposer(SpecConfig("eagle3", 3, model=out), target)
    assert back == prop
    for a, b in zip(jax.tree.leaves(pp), jax.tree.leaves(back_p)):
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    again = run(back, back_p)
    assert again.token_ids == shipped.token_ids
    assert again.stats["mean_acceptance_length"] == shipped.stats["mean_acceptance_length"]
    assert again.stats["per_position_acceptance"] == shipped.stats["per_position_acceptance"]
