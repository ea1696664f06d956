"""The split form (new keys beside the cache, the model's XLA path) through kernels.attention: equal to the
contract form (new keys inside the cache), with an empty cache too (the cache-free forward), and checked like
every other implementation."""

import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from spec_jax.kernels import attention, attention_xla
from tests.kernels.test_pallas_attention import random_tree


@pytest.mark.parametrize("seed", range(12))
def test_split_equals_contract_form(seed):
  rng = np.random.default_rng(seed)
  B, T, S, Hkv, G, D = 3, int(rng.choice([1, 3, 6])), 40, int(rng.choice([1, 2])), int(rng.choice([1, 4])), 16
  window = [None, 0, 5, 12, 100][seed % 5]
  use_tree = seed % 3 == 2 and T > 1
  committed = rng.integers(0, S - T, B)
  kv_lengths = committed + T
  if use_tree and seed % 2:  # one tree per row
    tree, depth = (np.stack(x) for x in zip(*(random_tree(rng, T) for _ in range(B))))
    pos = committed[:, None] + depth
  elif use_tree:
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
  got = attention(q, kc, vc, jnp.asarray(pos, jnp.int32), jnp.asarray(kv_lengths, jnp.int32), k_new=kn, v_new=vn,
                  impl="xla", **args)
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("window", [None, 3])
def test_empty_cache_is_causal_attention_over_the_new_tokens(window):
  """S = 0: what the cache-free forward attends with; T may exceed the window (a whole training sequence)."""
  B, T, Hkv, G, D = 2, 7, 1, 4, 16
  ks = jax.random.split(jax.random.PRNGKey(0), 3)
  q = jax.random.normal(ks[0], (B, T, Hkv * G, D))
  kn = jax.random.normal(ks[1], (B, T, Hkv, D))
  vn = jax.random.normal(ks[2], (B, T, Hkv, D))
  pos = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
  empty = jnp.zeros((B, 0, Hkv, D))
  lengths = jnp.full((B,), T, jnp.int32)
  got = attention(q, empty, empty, pos, lengths, scale=0.25, window=window, k_new=kn, v_new=vn, impl="xla")
  # The same tokens as a full cache of T slots, window traced so the contract form's T > window check allows it.
  want = attention_xla(q, kn, vn, pos, lengths, scale=0.25, window=None if window is None else jnp.int32(window))
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-5, rtol=2e-5)
  if window is not None:  # the window did cut: a query far down the sequence sees fewer keys
    full = attention(q, empty, empty, pos, lengths, scale=0.25, k_new=kn, v_new=vn, impl="xla")
    assert not np.allclose(np.asarray(got[:, -1]), np.asarray(full[:, -1]), atol=1e-3)


def test_split_form_arguments_are_checked():
  B, T, S, Hkv, D = 2, 3, 8, 1, 16
  q = jnp.zeros((B, T, 4, D))
  kc = jnp.zeros((B, S, Hkv, D))
  pos = jnp.zeros((B, T), jnp.int32)
  lens = jnp.full((B,), T, jnp.int32)
  kn = jnp.zeros((B, T, Hkv, D))
  with pytest.raises(ValueError, match="come together"):
    attention(q, kc, kc, pos, lens, scale=1.0, k_new=kn, impl="xla")
  with pytest.raises(ValueError, match=r"k_new and v_new must be \[B, T, Hkv, D\]"):
    attention(q, kc, kc, pos, lens, scale=1.0, k_new=kn, v_new=jnp.zeros((B, T + 1, Hkv, D)), impl="xla")
  with pytest.raises(ValueError, match="only the 'xla' implementation"):
    attention(q, kc, kc, pos, lens, scale=1.0, k_new=kn, v_new=kn, impl="pallas_gpu:interpret")
  with pytest.raises(ValueError, match="q_positions must be"):  # the shared checks apply to it too
    attention(q, kc, kc, pos[:, :1], lens, scale=1.0, k_new=kn, v_new=kn, impl="xla")


def test_shared_kernel_helpers_import_neither_triton_nor_mosaic():
  """common.py holds what both Pallas kernels share; it loads on machines without either backend's Pallas."""
  code = ("import sys, spec_jax.kernels.common, spec_jax.kernels.reference; "
          "print([m for m in sys.modules if m.startswith('jax.experimental.pallas')])")
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
  assert out.stdout.strip() == "[]", out.stdout
  # And the check can fail: the GPU kernel's module does load Pallas' Triton front end.
  code = code.replace("spec_jax.kernels.common", "spec_jax.kernels.pallas_gpu")
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
  assert "jax.experimental.pallas.triton" in out.stdout
