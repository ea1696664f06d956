"""The XLA reference against a naive attention written query by query in numpy (the obviously correct twin), the
cache-free case (an empty cache: causal attention over the new tokens), and the kernels' shared helpers."""

import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from spec_jax.kernels import attention, attention_xla
from tests.kernels.test_pallas_attention import make_inputs


def naive(q, kn, vn, kc, vc, pos, lens, scale, window, tree):
  """One query at a time: the keys it may read (committed slots, then new tokens), a softmax, a weighted sum."""
  q, kn, vn, kc, vc = (np.asarray(x, np.float64) for x in (q, kn, vn, kc, vc))
  B, T, Hq, D = q.shape
  Hkv = kc.shape[1]
  G = Hq // Hkv
  out = np.zeros_like(q)
  for b in range(B):
    for t in range(T):
      p_t = pos[b, t]
      keys = [("c", j) for j in range(lens[b]) if not window or window <= 0 or p_t - j < window]
      for u in range(T):
        ok = (u <= t) if tree is None else bool(np.asarray(tree)[..., t, u] if np.ndim(tree) == 2 else tree[b, t, u])
        if ok and (not window or window <= 0 or p_t - pos[b, u] < window):
          keys.append(("n", u))
      for h in range(Hq):
        kh = h // G
        ks = np.stack([kc[b, kh, i] if w == "c" else kn[b, i, kh] for w, i in keys])
        vs = np.stack([vc[b, kh, i] if w == "c" else vn[b, i, kh] for w, i in keys])
        s = ks @ q[b, t, h] * scale
        p = np.exp(s - s.max())
        out[b, t, h] = (p / p.sum()) @ vs
  return out


@pytest.mark.parametrize("seed", range(10))
def test_reference_equals_the_naive_loop(seed):
  rng = np.random.default_rng(seed)
  T = int(rng.choice([1, 3, 6]))
  B, S, Hkv, G, D = 3, 24, int(rng.choice([1, 2])), int(rng.choice([1, 3])), 8
  window = [None, 0, 4, 9, 100][seed % 5]
  tree = [False, True, "rows"][seed % 3] if T > 1 else False
  lengths = rng.integers(0, S + 1, B)
  q, kn, vn, kc, vc, pos, lens, mask = make_inputs(rng, B=B, T=T, Hq=Hkv * G, Hkv=Hkv, D=D, S=S, lengths=lengths,
                                                   dtype=jnp.float32, tree=tree, L=2)
  got = attention_xla(q, kn, vn, kc, vc, pos, lens, scale=0.3, window=window, tree_mask=mask, layer=jnp.int32(1))
  want = naive(q, kn, vn, kc[1], vc[1], np.asarray(pos), np.asarray(lens), 0.3, window,
               None if mask is None else np.asarray(mask))
  np.testing.assert_allclose(np.asarray(got), want, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("window", [None, 3])
def test_empty_cache_is_causal_attention_over_the_new_tokens(window):
  """S = 0: what the cache-free forward attends with; T may exceed the window (a whole training sequence)."""
  rng = np.random.default_rng(0)
  q, kn, vn, kc, vc, pos, lens, _ = make_inputs(rng, B=2, T=7, Hq=4, Hkv=1, D=16, S=0, lengths=[0, 0],
                                                dtype=jnp.float32, tree=False)
  got = attention(q, kn, vn, kc[0], vc[0], pos, lens, scale=0.25, window=window, impl="xla")
  want = naive(q, kn, vn, kc[0], vc[0], np.asarray(pos), np.asarray(lens), 0.25, window, None)
  np.testing.assert_allclose(np.asarray(got), want, atol=2e-5, rtol=2e-5)
  if window is not None:  # the window did cut: a query far down the sequence sees fewer keys
    full = attention(q, kn, vn, kc[0], vc[0], pos, lens, scale=0.25, impl="xla")
    assert not np.allclose(np.asarray(got[:, -1]), np.asarray(full[:, -1]), atol=1e-3)


def test_stale_slots_past_the_length_are_never_read():
  """Whatever finite values sit at or past a row's length (stale drafts) change nothing. (The reference's softmax
  weights there are exactly 0, and 0 * x is 0 for finite x; the cache starts zeroed, so stale entries are always
  finite. The kernels also zero what they load there: the TPU interpreter test fills unwritten memory with NaN.)"""
  rng = np.random.default_rng(3)
  q, kn, vn, kc, vc, pos, lens, _ = make_inputs(rng, B=2, T=3, Hq=2, Hkv=1, D=8, S=16, lengths=[5, 16],
                                                dtype=jnp.float32, tree=False)
  a = attention(q, kn, vn, kc[0], vc[0], pos, lens, scale=0.3, impl="xla")
  poisoned = kc[0].at[0, :, 5:].set(1e6), vc[0].at[0, :, 5:].set(-1e6)
  b = attention(q, kn, vn, *poisoned, pos, lens, scale=0.3, impl="xla")
  np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


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


@pytest.mark.parametrize("Hkv", [1, 2])
def test_bfloat16_reference_runs_and_matches_float32(Hkv):
  """bfloat16 inputs, float32 accumulation, more than one KV head: the form XLA:CPU once had no dot kernel for
  (two batch axes, bf16 x bf16 = f32), which failed every bf16 model with grouped heads (Qwen2.5, Llama)."""
  rng = np.random.default_rng(9)
  args = make_inputs(rng, B=3, T=5, Hq=4 * Hkv, Hkv=Hkv, D=32, S=40, lengths=[35, 12, 0], dtype=jnp.float32,
                     tree=False, L=1)
  q, kn, vn, kc, vc, pos, lens, _ = args
  want = attention(q, kn, vn, kc[0], vc[0], pos, lens, scale=0.2, impl="xla")
  bf = lambda x: x.astype(jnp.bfloat16)
  got = jax.jit(lambda *a: attention(*a, scale=0.2, impl="xla"))(bf(q), bf(kn), bf(vn), bf(kc[0]), bf(vc[0]), pos,
                                                                  lens)
  assert got.dtype == jnp.bfloat16
  np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want), atol=3e-2, rtol=3e-2)
