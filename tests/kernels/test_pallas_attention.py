"""The Pallas verify/decode attention kernels, run in interpret mode on CPU, against the XLA reference."""

from __future__ import annotations

import functools
import importlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from spec_jax.kernels import attention, attention_xla, resolve_impl
from spec_jax.kernels.pallas_gpu import attention_pallas_gpu
from spec_jax.kernels.pallas_tpu import attention_pallas_tpu
from jax.experimental.pallas import tpu as pltpu

KERNELS = {"pallas_gpu": attention_pallas_gpu, "pallas_tpu": attention_pallas_tpu}
# Small blocks so that short caches still span several blocks (and block edges land inside them).
BLOCKS = {"pallas_gpu": (16, 32, 64), "pallas_tpu": (16, 32, 128)}
# bf16: the kernel rounds unnormalised p to bf16 where the reference rounds normalised p, ~1 ulp of output.
TOL = {jnp.float32: dict(rtol=2e-5, atol=2e-5), jnp.bfloat16: dict(rtol=2e-2, atol=8e-3)}

# Interpret mode compiles one program per shape (~1 s each on 2 cores), so the example count sets the
# runtime of this file.
SETTINGS = settings(max_examples=35, deadline=None, database=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


def random_tree(rng, T):
  """bool[T,T] ancestor-or-self mask of a random tree (parent of t is some t' < t) and each node's depth."""
  parent = [-1] + [int(rng.integers(0, t)) for t in range(1, T)]
  mask = np.zeros((T, T), bool)
  depth = np.zeros(T, np.int32)
  for t in range(T):
    a = t
    while a >= 0:
      mask[t, a] = True
      a = parent[a]
    depth[t] = 0 if t == 0 else depth[parent[t]] + 1
  return mask, depth


def make_inputs(rng, *, B, T, Hq, Hkv, D, S, lengths, dtype, tree, L=1):
  """q [B,T,Hq,D], the new tokens' k/v [B,T,Hkv,D], a stacked cache k/v [L,B,Hkv,S,D] (committed slots <
  lengths[b]; the rest random, as stale entries are), the new tokens' positions and the tree mask."""
  q = rng.standard_normal((B, T, Hq, D), np.float32)
  kn = rng.standard_normal((B, T, Hkv, D), np.float32)
  vn = rng.standard_normal((B, T, Hkv, D), np.float32)
  kc = rng.standard_normal((L, B, Hkv, S, D), np.float32)
  vc = rng.standard_normal((L, B, Hkv, S, D), np.float32)
  lengths = np.asarray(lengths, np.int32)
  if tree == "rows":  # a different tree per row, as EAGLE-2's dynamic trees are
    mask, depth = (np.stack(x) for x in zip(*(random_tree(rng, T) for _ in range(B))))
    positions = lengths[:, None] + depth
  elif tree:
    mask, depth = random_tree(rng, T)
    positions = lengths[:, None] + depth[None, :]
  else:
    mask = None
    positions = lengths[:, None] + np.arange(T, dtype=np.int32)[None, :]
  a = lambda x: jnp.asarray(x, dtype)
  return (a(q), a(kn), a(vn), a(kc), a(vc), jnp.asarray(positions, jnp.int32), jnp.asarray(lengths),
          None if mask is None else jnp.asarray(mask))


@functools.partial(jax.jit, static_argnames=("fn", "scale", "static_window", "kwargs"))
def _run(q, kn, vn, kc, vc, pos, lens, tree, traced_window, layer, *, fn, scale, static_window, kwargs):
  window = traced_window if traced_window is not None else static_window
  return fn(q, kn, vn, kc, vc, pos, lens, scale=scale, window=window, tree_mask=tree, layer=layer, **dict(kwargs))


def run_both(impl, q, kn, vn, kc, vc, pos, lens, tree, window, traced, layer=0, **kwargs):
  scale = 1.0 / np.sqrt(q.shape[-1])
  tw = jnp.int32(window) if traced else None
  sw = None if traced else window
  kw = tuple(sorted(dict(kwargs, interpret=kwargs.get("interpret", True)).items()))
  layer = jnp.int32(layer)
  out = _run(q, kn, vn, kc, vc, pos, lens, tree, tw, layer, fn=KERNELS[impl], scale=scale, static_window=sw,
             kwargs=kw)
  ref = _run(q, kn, vn, kc, vc, pos, lens, tree, tw, layer, fn=attention_xla, scale=scale, static_window=sw,
             kwargs=())
  return out, ref


def assert_close(out, ref, dtype):
  assert out.shape == ref.shape and out.dtype == ref.dtype
  out, ref = np.asarray(out, np.float32), np.asarray(ref, np.float32)
  assert np.all(np.isfinite(out))
  np.testing.assert_allclose(out, ref, **TOL[dtype])


@st.composite
def cases(draw, impl):
  T = draw(st.sampled_from([1, 2, 5, 9, 17]))
  G = draw(st.sampled_from([1, 4, 8]))
  Hkv = draw(st.sampled_from([1, 2]))
  D = draw(st.sampled_from([32, 64, 128]))
  block_k = draw(st.sampled_from(BLOCKS[impl]))
  # Mostly short caches (interpret mode is slow), now and then a long one.
  S = draw(st.one_of(st.integers(1, 160), st.integers(1, 160), st.integers(1, 160), st.integers(161, 2048)))
  B = draw(st.integers(1, 3))
  edges = [e for m in range(block_k, S + 1, block_k) for e in (m - 1, m, m + 1)]

  def length():
    choice = draw(st.sampled_from(["full", "edge", "any"]))
    if choice == "full" or (choice == "edge" and not edges):
      return S
    if choice == "edge":
      return int(np.clip(draw(st.sampled_from(edges)), 0, S))
    return draw(st.integers(0, S))

  lengths = [length() for _ in range(B)]
  kind = draw(st.sampled_from(["none", "off", "small", "large", "traced_small"]))
  traced = kind == "traced_small" or draw(st.booleans())
  if kind == "none":
    window, traced = None, False
  elif kind == "off":
    window = draw(st.sampled_from([0, -1]))
  elif kind == "small":
    window = draw(st.integers(T, max(T, S // 2)))
  elif kind == "large":
    window = draw(st.integers(S, 2 * S + 5))
  else:
    window = draw(st.integers(1, max(1, S // 2)))  # traced: may even be narrower than T
  # A small max_rows cuts the rows into several row blocks, as a prefill chunk would be.
  max_rows = draw(st.sampled_from([None, None, 16, 32]))
  L = draw(st.sampled_from([1, 1, 3]))
  return dict(B=B, T=T, Hq=G * Hkv, Hkv=Hkv, D=D, S=S, L=L, layer=draw(st.integers(0, L - 1)), lengths=lengths,
              window=window, traced=traced, block_k=block_k, max_rows=max_rows,
              tree=draw(st.sampled_from([False, True, "rows"])) if T > 1 else False,
              dtype=draw(st.sampled_from([jnp.float32, jnp.float32, jnp.bfloat16])), seed=draw(st.integers(0, 2**16)))


def check_case(impl, c, **kwargs):
  rng = np.random.default_rng(c["seed"])
  inputs = make_inputs(rng, B=c["B"], T=c["T"], Hq=c["Hq"], Hkv=c["Hkv"], D=c["D"], S=c["S"], L=c.get("L", 1),
                       lengths=c["lengths"], dtype=c["dtype"], tree=c["tree"])
  if c.get("max_rows"):
    kwargs["max_rows"] = c["max_rows"]
  out, ref = run_both(impl, *inputs, c["window"], c["traced"], layer=c.get("layer", 0), block_k=c["block_k"],
                      **kwargs)
  assert_close(out, ref, c["dtype"])


@SETTINGS
@given(cases("pallas_gpu"), st.sampled_from([1, 3, None]))
def test_gpu_kernel_matches_reference(c, num_splits):
  check_case("pallas_gpu", c, num_splits=num_splits)


@SETTINGS
@given(cases("pallas_tpu"))
def test_tpu_kernel_matches_reference(c):
  check_case("pallas_tpu", c)


def _case(T, G, S, lengths, window=None, *, traced=False, tree=False, Hkv=1, D=64, block_k=32, max_rows=None,
          dtype=jnp.float32, seed=0, L=1, layer=0):
  return dict(B=len(lengths), T=T, Hq=G * Hkv, Hkv=Hkv, D=D, S=S, L=L, layer=layer, lengths=lengths,
              window=window, traced=traced, block_k=block_k, max_rows=max_rows, tree=tree, dtype=dtype, seed=seed)


# Cases the random search may take long to hit, pinned so each run checks them. Lengths are committed slots.
EDGE_CASES = {
    "window_cuts_committed": _case(5, 4, 150, [145, 92, 59], 20),
    "traced_window_cuts_committed": _case(5, 4, 150, [145, 92, 59], 20, traced=True),
    "traced_window_narrower_than_T": _case(9, 1, 90, [81, 31], 3, traced=True),
    "tree_inside_window": _case(9, 8, 120, [111, 24], 16, tree=True, Hkv=2),
    "tree_T17_gqa8": _case(17, 8, 100, [83, 47, 0], tree=True, seed=3),
    "decode_block_edges": _case(1, 8, 200, [31, 32, 33, 200], block_k=32, Hkv=2, D=128),
    "window_equals_T_and_full_rows": _case(17, 1, 70, [70, 53], 17),
    "tree_T40_two_mask_words": _case(40, 1, 120, [80, 17], tree=True, seed=11),
    # The window also spans the new tokens: between a tree node and its ancestors by position (depth).
    "tree_deeper_than_traced_window": _case(17, 2, 80, [63, 13], 4, traced=True, tree=True, seed=2),
    "prefill_chunk_row_blocks": _case(100, 4, 160, [60, 0, 30], 30, traced=True, Hkv=2, seed=4),
    "prefill_chunk_no_window": _case(64, 1, 96, [32, 0], max_rows=16, seed=6),
    "bf16_window_tree": _case(9, 4, 130, [121, 68], 25, tree=True, dtype=jnp.bfloat16, seed=5),
    "tree_per_row": _case(9, 4, 120, [111, 41, 11], tree="rows", Hkv=2, seed=8),
    "tree_per_row_two_mask_words": _case(40, 1, 120, [80, 17], 16, traced=True, tree="rows", seed=12),
    "empty_cache": _case(7, 2, 64, [0, 0], seed=13),
    "stacked_layers_pick_one": _case(5, 4, 96, [90, 33], 24, traced=True, L=4, layer=2, Hkv=2, seed=14),
    "head_dim_not_a_power_of_two": _case(5, 2, 70, [64, 9], Hkv=2, D=80, seed=15),
}


@pytest.mark.parametrize("impl", sorted(KERNELS))
@pytest.mark.parametrize("name", sorted(EDGE_CASES))
def test_edge_cases(impl, name):
  check_case(impl, EDGE_CASES[name])


@pytest.mark.parametrize("impl", sorted(KERNELS))
@pytest.mark.parametrize("G", [1, 4, 8])
def test_long_full_cache_default_blocks(impl, G):
  """S = 2048 with the production block sizes, rows at and beside a block edge, and a full row."""
  block = 64 if impl == "pallas_gpu" else 512
  c = _case(5, G, 2048, [2048, 2 * block, 2 * block + 1], seed=G, block_k=block)
  rng = np.random.default_rng(c["seed"])
  inputs = make_inputs(rng, **{n: c[n] for n in ("B", "T", "Hq", "Hkv", "D", "S", "lengths", "dtype", "tree")})
  out, ref = run_both(impl, *inputs, None, False)
  assert_close(out, ref, jnp.float32)


def test_tpu_kernel_with_tpu_interpreter():
  """The TPU-faithful interpreter fills unwritten memory with NaN: the ragged last block must not leak."""
  c = _case(9, 4, 100, [91, 38], 40, traced=True, tree=True, Hkv=2, D=128, seed=7, L=2, layer=1)
  check_case("pallas_tpu", c, interpret=pltpu.InterpretParams())


@pytest.mark.parametrize("impl", sorted(KERNELS))
def test_window_scanned_over_layers(impl):
  """The model scans layers with a per-layer window and layer index; the kernel takes both as traced scalars and
  reads the stacked cache in place."""
  rng = np.random.default_rng(0)
  q, kn, vn, kc, vc, pos, lens, _ = make_inputs(rng, B=2, T=2, Hq=4, Hkv=1, D=32, S=80, lengths=[78, 31], L=3,
                                                dtype=jnp.float32, tree=False)
  windows = jnp.array([16, 0, 5], jnp.int32)

  def scan(fn):
    def body(carry, xs):
      w, layer = xs
      return carry, fn(q, kn, vn, kc, vc, pos, lens, scale=0.2, window=w, layer=layer)
    return jax.lax.scan(body, None, (windows, jnp.arange(3, dtype=jnp.int32)))[1]

  out = jax.jit(lambda: scan(functools.partial(KERNELS[impl], interpret=True, block_k=16)))()
  ref = jax.jit(lambda: scan(attention_xla))()
  assert_close(out, ref, jnp.float32)
  assert not np.allclose(np.asarray(ref[0]), np.asarray(ref[2]))  # the layers differ: each read its own


@pytest.mark.parametrize("impl,platform", [("pallas_gpu", "cuda"), ("pallas_tpu", "tpu")])
@pytest.mark.parametrize("shape", [
    dict(T=17, Hq=32, Hkv=8, D=128, S=700, tree=True),  # verify, llama layout, ragged last block
    dict(T=1, Hq=4, Hkv=1, D=256, S=4096, tree=False),  # decode, gemma layout
    dict(T=300, Hq=8, Hkv=2, D=64, S=1000, tree=False),  # prefill chunk: row blocks
    dict(T=5, Hq=8, Hkv=2, D=80, S=512, tree=False),  # a head size that is not a power of two
])
def test_kernels_lower_for_their_platform(impl, platform, shape, monkeypatch):
  """Lowering to Triton / Mosaic MLIR runs in Python, so even without the device it catches block shapes
  and ops the real backend rejects (not what its compiler does later)."""
  module = importlib.import_module(f"spec_jax.kernels.{impl}")
  monkeypatch.setattr(module, "require_backend", lambda *a: None)
  B, T, S, D, Hkv = 2, shape["T"], shape["S"], shape["D"], shape["Hkv"]
  sds = jax.ShapeDtypeStruct
  args = (sds((B, T, shape["Hq"], D), jnp.bfloat16), sds((B, T, Hkv, D), jnp.bfloat16),
          sds((B, T, Hkv, D), jnp.bfloat16), sds((4, B, Hkv, S, D), jnp.bfloat16),
          sds((4, B, Hkv, S, D), jnp.bfloat16), sds((B, T), jnp.int32), sds((B,), jnp.int32),
          sds((), jnp.int32), sds((T, T), jnp.bool_) if shape["tree"] else None, sds((), jnp.int32))
  fn = jax.jit(lambda q, kn, vn, kc, vc, p, l, w, t, layer: KERNELS[impl](q, kn, vn, kc, vc, p, l, scale=0.1,
                                                                          window=w, tree_mask=t, layer=layer))
  text = fn.trace(*args).lower(lowering_platforms=(platform,)).as_text()
  assert ("tpu_custom_call" if platform == "tpu" else "triton") in text.lower()


def test_resolve_impl_auto_is_xla_on_cpu():
  assert jax.default_backend() == "cpu"
  assert resolve_impl("auto") == "xla"
  with pytest.raises(ValueError, match="unknown attention impl"):
    resolve_impl("cuda")


@pytest.mark.parametrize("impl", sorted(KERNELS))
def test_kernels_refuse_cpu_without_interpret(impl):
  q, kn, vn, kc, vc, pos, lens, _ = make_inputs(np.random.default_rng(0), B=1, T=1, Hq=1, Hkv=1, D=16, S=16,
                                                lengths=[15], dtype=jnp.float32, tree=False)
  with pytest.raises(RuntimeError, match="interpret=True"):
    attention(q, kn, vn, kc[0], vc[0], pos, lens, scale=1.0, impl=impl)


def _bad_args():
  f32 = jnp.float32
  z = lambda *s: jnp.zeros(s, f32)
  i = lambda *s: jnp.zeros(s, jnp.int32)
  ok = dict(q=z(2, 3, 4, 16), kn=z(2, 3, 2, 16), vn=z(2, 3, 2, 16), k=z(2, 2, 32, 16), v=z(2, 2, 32, 16),
            pos=i(2, 3), lens=i(2))
  return {
      "k_v_disagree": (dict(ok, v=z(2, 2, 31, 16)), {}, "disagree"),
      "batch": (dict(ok, k=z(3, 2, 32, 16), v=z(3, 2, 32, 16)), {}, "batch or head_dim"),
      "head_dim": (dict(ok, k=z(2, 2, 32, 8), v=z(2, 2, 32, 8)), {}, "batch or head_dim"),
      "gqa": (dict(ok, k=z(2, 3, 32, 16), v=z(2, 3, 32, 16)), {}, "multiple of kv heads"),
      "rank": (dict(ok, q=z(2, 3, 64)), {}, "4-D"),
      "cache_rank": (dict(ok, k=z(2, 32, 16), v=z(2, 32, 16)), {}, r"\[B, Hkv, S, D\]"),
      "stacked_without_layer": (dict(ok, k=z(1, 2, 2, 32, 16), v=z(1, 2, 2, 32, 16)), {}, "one layer"),
      "layer_without_stack": (ok, dict(layer=jnp.int32(0)), "stacked"),
      "new_tokens": (dict(ok, kn=z(2, 4, 2, 16)), {}, "k_new and v_new"),
      "positions": (dict(ok, pos=i(2, 4)), {}, "q_positions"),
      "lengths": (dict(ok, lens=i(3)), {}, "lengths must be"),
      "bool_window": (ok, dict(window=True), "not a bool"),
      "tree_not_TxT": (ok, dict(tree_mask=jnp.ones((3, 4), bool)), "tree_mask"),
      "tree_flat": (ok, dict(tree_mask=jnp.ones((9,), bool)), "tree_mask"),
  }


@pytest.mark.parametrize("impl", ["xla", "pallas_gpu", "pallas_tpu", "auto"])
@pytest.mark.parametrize("name", sorted(_bad_args()))
def test_bad_arguments_are_named(impl, name):
  args, kwargs, message = _bad_args()[name]
  with pytest.raises(ValueError, match=message):
    attention(args["q"], args["kn"], args["vn"], args["k"], args["v"], args["pos"], args["lens"], scale=1.0,
              impl=impl, interpret=True, **kwargs)


@pytest.mark.parametrize("window", [None, 4])
def test_reference_per_row_tree_is_each_row_alone(window):
  """attention_xla with a tree per row [B, T, T] equals each row run alone with its own [T, T] tree."""
  rng = np.random.default_rng(1)
  q, kn, vn, kc, vc, pos, lens, tree = make_inputs(rng, B=3, T=7, Hq=4, Hkv=1, D=16, S=40, lengths=[33, 16, 0],
                                                   dtype=jnp.float32, tree="rows")
  kc, vc = kc[0], vc[0]
  assert tree.shape == (3, 7, 7) and not np.all(tree[0] == tree[1])
  got = attention_xla(q, kn, vn, kc, vc, pos, lens, scale=0.3, window=window, tree_mask=tree)
  for b in range(3):
    row = lambda x: x[b:b + 1]
    one = attention_xla(row(q), row(kn), row(vn), row(kc), row(vc), row(pos), row(lens), scale=0.3, window=window,
                        tree_mask=tree[b])
    np.testing.assert_allclose(np.asarray(got[b:b + 1]), np.asarray(one), rtol=1e-6, atol=1e-6)
  shared = attention_xla(q, kn, vn, kc, vc, pos, lens, scale=0.3, window=window, tree_mask=tree[0])
  assert not np.allclose(np.asarray(shared[1:]), np.asarray(got[1:]))  # the rows' own trees were used


@pytest.mark.parametrize("impl,block,tree,window", [("pallas_tpu", 16, False, None), ("pallas_tpu", 8, "rows", 12),
                                                    ("pallas_tpu", 32, True, None), ("pallas_gpu", 16, "rows", 12),
                                                    ("pallas_gpu", 32, False, None)])
def test_kernels_read_pages_through_the_table(impl, block, tree, window):
  """Page pools with shuffled tables (no row's pages contiguous), every page no row owns NaN: the kernel reading
  pages through the table equals the reference on the rows' logical caches, for chains and tree masks."""
  from spec_jax.cache import KVCache
  from tests.paged import to_paged
  rng = np.random.default_rng(block)
  B, T, Hq, Hkv, D, S, L = 3, 5, 4, 2, 128, 64, 2
  lengths = [37, 5, 60 - T]
  q, kn, vn, kc, vc, pos, lens, mask = make_inputs(rng, B=B, T=T, Hq=Hq, Hkv=Hkv, D=D, S=S, lengths=lengths,
                                                   dtype=jnp.float32, tree=tree, L=L)
  cache = to_paged(np.asarray(kc), np.asarray(vc), lengths, block, rng, fill=np.nan)
  scale = 1.0 / np.sqrt(D)
  for layer in range(L):
    kview, vview = KVCache.layer_view(cache, jnp.int32(layer))
    ref = attention_xla(q, kn, vn, kview, vview, pos, lens, scale=scale, window=window, tree_mask=mask)
    out = jax.jit(lambda p: attention(q, kn, vn, cache.k, cache.v, pos, lens, scale=scale, window=window,
                                      tree_mask=mask, layer=jnp.int32(layer), impl=impl + ":interpret",
                                      pages=p))(cache.pages)
    assert not np.isnan(np.asarray(out)).any()
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), rtol=2e-5, atol=2e-5)
  with pytest.raises(ValueError, match="page table"):
    attention(q, kn, vn, cache.k, cache.v, pos, lens, scale=scale, impl="xla", layer=jnp.int32(0), pages=cache.pages)
