"""The model's XLA path (new keys beside the cache) equals the contract form (new keys inside the cache)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from spec_jax.kernels import attention_xla, attention_xla_split
from tests.kernels.test_pallas_attention import random_tree


@pytest.mark.parametrize("seed", range(12))
def test_split_equals_contract_form(seed):
  rng = np.random.default_rng(seed)
  B, T, S, Hkv, G, D = 3, int(rng.choice([1, 3, 6])), 40, int(rng.choice([1, 2])), int(rng.choice([1, 4])), 16
  window = [None, 0, 5, 12, 100][seed % 5]
  use_tree = seed % 3 == 2 and T > 1
  committed = rng.integers(0, S - T, B)
  kv_lengths = committed + T
  if use_tree:
    tree, depth = random_tree(rng, T)
    pos = committed[:, None] + depth[None, :]
  else:
    tree = None
    pos = committed[:, None] + np.arange(T)[None, :]
  ks = jax.random.split(jax.random.PRNGKey(seed), 5)
  q = jax.random.normal(ks[0], (B, T, Hkv * G, D))
  kc = jax.random.normal(ks[1], (B, S, Hkv, D))
  vc = jax.random.normal(ks[2], (B, S, Hkv, D))
  kn = jax.random.normal(ks[3], (B, T, Hkv, D))
  vn = jax.random.normal(ks[4], (B, T, Hkv, D))
  k_full, v_full = np.array(kc), np.array(vc)
  for b in range(B):
    k_full[b, committed[b]:committed[b] + T] = kn[b]
    v_full[b, committed[b]:committed[b] + T] = vn[b]
  args = dict(scale=0.25, window=window, tree_mask=None if tree is None else jnp.asarray(tree))
  want = attention_xla(q, jnp.asarray(k_full), jnp.asarray(v_full), jnp.asarray(pos, jnp.int32),
                       jnp.asarray(kv_lengths, jnp.int32), **args)
  got = attention_xla_split(q, kc, vc, kn, vn, jnp.asarray(pos, jnp.int32), jnp.asarray(kv_lengths, jnp.int32),
                            **args)
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-5, rtol=2e-5)
