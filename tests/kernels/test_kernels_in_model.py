"""Through the model: greedy generation with each Pallas kernel (interpret mode) equals the XLA path."""

import jax
import numpy as np
import pytest

from spec_jax.batch import generate
from spec_jax.models.transformer import init_params
from spec_jax.proposers.ngram import NgramProposer
from tests.conftest import tiny_gemma_config

CONFIG = tiny_gemma_config(num_layers=2, global_every=2, sliding_window=16, eos_ids=(1,))


@pytest.mark.parametrize("impl", ["pallas_gpu:interpret", "pallas_tpu:interpret"])
def test_greedy_generation_identical_to_xla(impl):
  params = init_params(CONFIG, jax.random.PRNGKey(0))
  rng = np.random.default_rng(0)
  span = rng.integers(3, CONFIG.vocab_size, 5).tolist()
  prompts = [[2] + span * 3, [2] + rng.integers(3, CONFIG.vocab_size, 9).tolist()]
  want = generate(params, CONFIG, prompts, max_new_tokens=12, impl="xla")
  got = generate(params, CONFIG, prompts, max_new_tokens=12, impl=impl)
  assert got.token_ids == want.token_ids
  spec = generate(params, CONFIG, prompts, max_new_tokens=12, impl=impl, proposer=NgramProposer(k=3),
                  adaptive_k=False)
  assert spec.token_ids == want.token_ids


def test_unknown_impl_is_rejected():
  from spec_jax.kernels import resolve_impl
  with pytest.raises(ValueError, match="unknown attention impl"):
    resolve_impl("cuda")
  with pytest.raises(ValueError, match="unknown attention impl"):
    resolve_impl("xla:interpret")
