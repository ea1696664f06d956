"""The Pallas kernels read an 8-bit KV cache with its scales (issue 46), in interpret mode: equal to the XLA path on
K/V of magnitude ~300 (int8 values reach 127 and e4m3 448, so a reader taking the scale as 1.0 is far off), pages
no row owns poisoned (NaN scales, NaN e4m3 data), chains and trees, paged pools and stacked caches; the model's
forward through a kernel on an 8-bit pool equal to its XLA forward. Tiny shapes: ~1 min in all."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from spec_jax.cache import KVCache, quantize, kv_storage_dtype
from spec_jax.kernels import attention
from tests.kernels.test_pallas_attention import make_inputs
from tests.paged import shuffled_table

MAG = 300.0


def _quantized_paged(kc, vc, lengths, block, kv, rng):
  """Logical caches [L, B, H, S, D] -> an 8-bit KVCache with a shuffled table, written through the pool's own
  quantizing write; pages no row owns poisoned: NaN scales (and NaN data where the dtype holds NaN)."""
  L, B, H, S, D = kc.shape
  table, n = shuffled_table(rng, B, S // block)
  cache = KVCache.init(_Cfg(L, H, D), B, S, jnp.float32, block_size=block, num_pages=n, pages=table, kv_dtype=kv)
  lens = jnp.asarray(lengths, jnp.int32)
  cache = cache.write(jnp.swapaxes(kc, 2, 3), jnp.swapaxes(vc, 2, 3)).replace(lengths=lens)
  free = np.setdiff1d(np.arange(n), table)
  nan_data = jnp.issubdtype(cache.k.dtype, jnp.floating)
  poison = lambda a, v: a.at[:, free].set(v)
  scales = lambda a: a.at[..., free].set(jnp.nan)  # [L, Hkv, block, N]: pages last
  return cache.replace(k_scale=scales(cache.k_scale), v_scale=scales(cache.v_scale),
                       **({"k": poison(cache.k, jnp.nan), "v": poison(cache.v, jnp.nan)} if nan_data else {}))


class _Cfg:  # what KVCache.init reads off a model config
  def __init__(self, L, H, D):
    self.num_layers, self.num_kv_heads, self.head_dim = L, H, D


@pytest.mark.parametrize("impl,kv,block,tree", [("pallas_tpu", "int8", 16, False), ("pallas_tpu", "fp8", 8, "rows"),
                                                ("pallas_gpu", "fp8", 16, True), ("pallas_gpu", "int8", 32, False)])
def test_kernels_read_an_8bit_pool_with_its_scales(impl, kv, block, tree):
  rng = np.random.default_rng(block)
  B, T, Hq, Hkv, D, S, L = 3, 5, 4, 2, 64, 64, 2
  lengths = [37, 5, S - T]
  q, kn, vn, kc, vc, pos, lens, mask = make_inputs(rng, B=B, T=T, Hq=Hq, Hkv=Hkv, D=D, S=S, lengths=lengths,
                                                   dtype=jnp.float32, tree=tree, L=L)
  kc, vc, kn, vn = kc * MAG, vc * MAG, kn * MAG, vn * MAG
  q = q / MAG  # scores of a sane size: K of magnitude 300 against small queries
  cache = _quantized_paged(kc, vc, lengths, block, kv, rng)
  assert float(jnp.nanmax(cache.k_scale)) > 1.5  # the scales are far from 1
  scale = 1.0 / np.sqrt(D)
  for layer in range(L):
    kview, vview = cache.layer_view(jnp.int32(layer))  # the XLA path: gathered and dequantized
    ref = attention(q, kn, vn, kview, vview, pos, lens, scale=scale, tree_mask=mask, impl="xla")
    out = jax.jit(lambda c: attention(q, kn, vn, c.k, c.v, pos, lens, scale=scale, tree_mask=mask,
                                      layer=jnp.int32(layer), impl=impl + ":interpret", pages=c.pages,
                                      k_scale=c.k_scale, v_scale=c.v_scale))(cache)
    assert not np.isnan(np.asarray(out)).any()
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), rtol=1e-4, atol=1e-3 * MAG)
    # A reader at scale 1.0 (the pool's raw values) is far from it.
    ones = jnp.ones_like(cache.k_scale)
    wrong = attention(q, kn, vn, *KVCache.layer_view(cache.replace(k_scale=ones, v_scale=ones), jnp.int32(layer)),
                      pos, lens, scale=scale, tree_mask=mask, impl="xla")
    assert float(jnp.max(jnp.abs(wrong - ref))) > 0.1 * MAG


@pytest.mark.parametrize("impl", ["pallas_tpu", "pallas_gpu"])
def test_kernels_read_a_stacked_8bit_cache_with_its_scales(impl):
  """A contiguous [L, B, Hkv, S, D] int8 cache with scales [L, Hkv, S, B] (no page table), and one layer's."""
  rng = np.random.default_rng(1)
  B, T, Hq, Hkv, D, S, L = 2, 3, 4, 1, 32, 48, 2
  lengths = [40, 9]
  q, kn, vn, kc, vc, pos, lens, _ = make_inputs(rng, B=B, T=T, Hq=Hq, Hkv=Hkv, D=D, S=S, lengths=lengths,
                                                dtype=jnp.float32, tree=False, L=L)
  (k8, ks), (v8, vs) = quantize(kc * MAG, jnp.int8), quantize(vc * MAG, jnp.int8)
  deq = lambda x, s: x.astype(jnp.float32) * s[..., None]
  q, kn, vn = q / MAG, kn * MAG, vn * MAG
  rows_last = lambda a: jnp.moveaxis(a, -3, -1)  # the scales' layout: [L, Hkv, S, B]
  for layer in range(L):
    ref = attention(q, kn, vn, deq(k8, ks)[layer], deq(v8, vs)[layer], pos, lens, scale=0.2, impl="xla")
    xla = attention(q, kn, vn, k8, v8, pos, lens, scale=0.2, impl="xla", layer=jnp.int32(layer),
                    k_scale=rows_last(ks), v_scale=rows_last(vs))
    out = attention(q, kn, vn, k8, v8, pos, lens, scale=0.2, impl=impl + ":interpret", layer=jnp.int32(layer),
                    k_scale=rows_last(ks), v_scale=rows_last(vs))
    one = attention(q, kn, vn, k8[layer], v8[layer], pos, lens, scale=0.2, impl=impl + ":interpret",
                    k_scale=rows_last(ks[layer]), v_scale=rows_last(vs[layer]))
    for got in (xla, out, one):
      np.testing.assert_allclose(np.asarray(got), np.asarray(ref), rtol=1e-4, atol=1e-3 * MAG)


def test_an_8bit_cache_without_its_scales_is_refused():
  rng = np.random.default_rng(0)
  q, kn, vn, kc, vc, pos, lens, _ = make_inputs(rng, B=1, T=2, Hq=2, Hkv=1, D=16, S=16, lengths=[4],
                                                dtype=jnp.float32, tree=False)
  k8, ks = quantize(kc[0], jnp.int8)
  for impl in ("xla", "pallas_tpu:interpret", "pallas_gpu:interpret"):
    with pytest.raises(ValueError, match="needs its k_scale and v_scale"):
      attention(q, kn, vn, k8, k8, pos, lens, scale=0.1, impl=impl)
  with pytest.raises(ValueError, match="without head_dim"):
    attention(q, kn, vn, k8, k8, pos, lens, scale=0.1, impl="xla", k_scale=ks[..., :3], v_scale=ks[..., :3])


@pytest.mark.parametrize("impl,kv", [("pallas_tpu", "int8"), ("pallas_gpu", "fp8")])
def test_the_model_forward_through_a_kernel_on_an_8bit_pool_equals_xla(impl, kv):
  """A prefill and a 3-token chain through the kernel reading the 8-bit pool (scales beside it) give the XLA
  path's logits and pool."""
  from spec_jax.models.transformer import forward, init_params
  from tests.conftest import tiny_llama_config
  cfg = tiny_llama_config()
  params = init_params(cfg, jax.random.PRNGKey(0))
  toks = jnp.asarray(np.random.default_rng(3).integers(3, cfg.vocab_size, (2, 11)), jnp.int32)
  table, n = shuffled_table(np.random.default_rng(4), 2, 2)
  outs = {}
  for which in ("xla", impl + ":interpret"):
    cache = KVCache.init(cfg, 2, 32, jnp.float32, block_size=16, num_pages=n, pages=table, kv_dtype=kv)
    assert cache.k.dtype == kv_storage_dtype(kv)
    _, _, cache = forward(params, toks[:, :8], cache=cache, config=cfg, impl="xla")
    cache = cache.advance(jnp.full((2,), 8))
    pos = 8 + jnp.broadcast_to(jnp.arange(3, dtype=jnp.int32), (2, 3))
    logits, _, cache = forward(params, toks[:, 8:], pos, cache=cache, config=cfg, impl=which)
    outs[which] = (logits, cache)
  (a, ca), (b, cb) = outs.values()
  np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=2e-4, atol=2e-4)
  # Layer 1's K/V come from layer 0's output, equal to float rounding: the scales agree to it, an 8-bit value to a
  # step of its grid (a value at a rounding boundary may land on either side).
  for x, y in zip(ca.pools()[2:], cb.pools()[2:]):
    np.testing.assert_allclose(np.asarray(y), np.asarray(x), rtol=1e-5)
  for x, y in zip(ca.pools()[:2], cb.pools()[:2]):
    np.testing.assert_allclose(np.asarray(y.astype(jnp.float32)), np.asarray(x.astype(jnp.float32)), rtol=2 ** -3,
                               atol=1.0)


@pytest.mark.parametrize("impl,platform", [("pallas_gpu", "cuda"), ("pallas_tpu", "tpu")])
@pytest.mark.parametrize("dtype", [jnp.int8, jnp.float8_e4m3fn, jnp.float8_e5m2])
def test_kernels_lower_an_8bit_pool_for_their_platform(impl, platform, dtype, monkeypatch):
  """Mosaic / Triton lowering (Python, no device) of a Llama-layout 8-bit pool with its scales: catches the block
  shapes and casts the real backends reject (a block of one KV head's scales; a masked fp8 load's int fill)."""
  import importlib
  module = importlib.import_module(f"spec_jax.kernels.{impl}")
  monkeypatch.setattr(module, "require_backend", lambda *a: None)
  fn = getattr(module, f"attention_{impl}")
  B, T, Hq, Hkv, D, N, bs, P = 2, 5, 32, 8, 128, 64, 16, 8
  sds = jax.ShapeDtypeStruct
  args = (sds((B, T, Hq, D), jnp.bfloat16), sds((B, T, Hkv, D), jnp.bfloat16), sds((B, T, Hkv, D), jnp.bfloat16),
          sds((4, N, Hkv, bs, D), dtype), sds((4, N, Hkv, bs, D), dtype), sds((B, T), jnp.int32), sds((B,), jnp.int32),
          sds((4, Hkv, bs, N), jnp.float32), sds((4, Hkv, bs, N), jnp.float32), sds((B, P), jnp.int32),
          sds((), jnp.int32))
  f = jax.jit(lambda q, kn, vn, kc, vc, p, l, ks, vs, pg, layer: fn(q, kn, vn, kc, vc, p, l, scale=0.1, layer=layer,
                                                                    pages=pg, k_scale=ks, v_scale=vs))
  text = f.trace(*args).lower(lowering_platforms=(platform,)).as_text()
  assert ("tpu_custom_call" if platform == "tpu" else "triton") in text.lower()
