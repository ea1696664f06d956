"""Gemma 3 270M in our JAX code against transformers' float32 logits (fixture made by
tools/make_reference_fixtures.py in a separate torch environment; CI never installs torch)."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from spec_jax.cache import KVCache
from spec_jax.models.transformer import forward

FIXTURE = os.path.join(os.path.dirname(__file__), "..", "fixtures", "gemma3_logits.npz")

pytestmark = pytest.mark.slow


def test_logits_match_transformers(gemma3_f32):
  config, params = gemma3_f32
  fx = np.load(FIXTURE)
  assert int(fx["num_prompts"]) >= 3
  fwd = jax.jit(lambda p, t, pos, c: forward(p, t, pos, c, config=config, compute_logits=False)[1])
  longest = 0
  for i in range(int(fx["num_prompts"])):
    ids = fx[f"ids_{i}"].astype(np.int32)
    positions, cols, want = fx[f"positions_{i}"], fx[f"cols_{i}"], fx[f"logits_{i}"]
    T = len(ids)
    longest = max(longest, T)
    cache = KVCache.init(config, 1, T)
    hidden = fwd(params, jnp.asarray(ids)[None], jnp.arange(T, dtype=jnp.int32)[None], cache)[0]
    h = hidden[jnp.asarray(positions)]  # [n, D]
    got = np.asarray(jnp.einsum("nd,vd->nv", h, params["embed"][jnp.asarray(cols)],
                                precision=jax.lax.Precision.HIGHEST))
    err = np.abs(got - want).max()
    assert err < 1e-3, f"prompt {i} ({T} tokens): max |logit error| {err}"
    # The same argmax as transformers over the sampled columns.
    np.testing.assert_array_equal(got.argmax(-1), want.argmax(-1))
  assert longest > 600  # the sliding window (512) is exercised
