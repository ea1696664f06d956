"""Prefill/decode/verify attention as a Pallas kernel for GPUs (Triton lowering).

One program handles one (batch row, kv head, row block, kv split). All T tokens times the G query heads that
share the kv head form the rows of one tile (a prefill-sized T is cut into row blocks), so every K/V block is
loaded once and used by all of them. The program reads the whole stacked cache [L, B, Hkv, S, D] in place, at
the layer given as a scalar input (a layer slice handed to a custom call would be copied), walks only the
committed KV blocks that can hold visible slots (bounds from the lengths and the window), then the new tokens'
K/V, which come beside the cache, with an online softmax in float32. Head sizes that are not a power of two are
loaded masked (the cache is never padded). When the grid has too few programs to fill the GPU (small-batch
decode), each row's block range is split across programs and the partial results are merged in XLA
(flash-decoding); the last split also reads the new tokens. The row layout and visibility helpers are in
common.py, shared with the TPU kernel.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from spec_jax.kernels.common import (NEG_INF, block_bounds, committed_visible, cost_estimate, effective_window,
                                     from_rows, new_tokens, new_visible, next_pow2, require_backend, round_up,
                                     row_inputs, to_rows)


def _kernel(layer_ref, pages_ref, lens_ref, lo_ref, hi_ref, win_ref, pos_ref, aux_ref, npos_ref, q_ref, k_ref,
            v_ref, *refs, scale: float, S: int, T: int, G: int, D: int, block_k: int,
            num_row_blocks: int, num_splits: int, tree: bool, precision, paged: bool, quant: bool):
  ks_ref, vs_ref = refs[:2] if quant else (None, None)
  kn_ref, vn_ref, *out_refs = refs[2:] if quant else refs
  b = pl.program_id(0)
  h = pl.program_id(1)
  cell = b * num_row_blocks + pl.program_id(2)
  layer = layer_ref[0]
  length = lens_ref[b]
  win = win_ref[0]
  lo = lo_ref[cell]
  hi = hi_ref[cell]
  last_split = True
  if num_splits > 1:
    # Split this row's own block range, so short rows do not leave splits idle while long ones queue.
    chunk = lax.div(hi - lo + (num_splits - 1), num_splits)
    lo = lo + pl.program_id(3) * chunk
    hi = jnp.minimum(hi, lo + chunk)
    last_split = pl.program_id(3) == num_splits - 1

  q = q_ref[...]
  R, Dp = q.shape
  pos = pos_ref[...][:, None]
  if tree:
    aux = [aux_ref[:, i][:, None] for i in range(aux_ref.shape[1])]
  else:
    aux = aux_ref[...][:, None]
  offs = jnp.arange(block_k, dtype=jnp.int32)
  d_ok = (jnp.arange(Dp, dtype=jnp.int32) < D)[None, :]

  def update(carry, s, mask, v, v_scale=None):
    acc, m, l = carry
    s = jnp.where(mask, s, NEG_INF)
    m_new = jnp.maximum(m, jnp.max(s, axis=1))
    alpha = jnp.exp(m - m_new)
    # Masked slots get exactly 0 even while m_new is still NEG_INF (nothing visible yet).
    p = jnp.where(mask, jnp.exp(s - m_new[:, None]), 0.0)
    l = alpha * l + jnp.sum(p, axis=1)
    if v_scale is not None:  # an 8-bit block: p @ (v * scale) = (p * scale) @ v
      p = p * v_scale[None, :]
    pv = lax.dot_general(p.astype(v.dtype), v, (((1,), (0,)), ((), ())), precision=precision,
                         preferred_element_type=jnp.float32)
    return acc * alpha[:, None] + pv, m_new, l

  def scores(k):
    return lax.dot_general(q, k, (((1,), (1,)), ((), ())), precision=precision,
                           preferred_element_type=jnp.float32) * scale

  def body(blk, carry):
    j = blk * block_k + offs
    # Masked loads: slots past the length (stale, or past S) and head-dim padding read as 0.
    ok = (j < length)[:, None] & d_ok
    x = pages_ref[b * (S // block_k) + blk] if paged else b  # a block is a page, found through the table
    slots = pl.ds(0, block_k) if paged else pl.ds(blk * block_k, block_k)
    at = (layer, x, h, slots, pl.ds(0, Dp))
    zero = 0.0 if quant and jnp.issubdtype(k_ref.dtype, jnp.floating) else 0  # Triton splats an fp8 0 from a float
    k = plgpu.load(k_ref.at[at], mask=ok, other=zero)
    v = plgpu.load(v_ref.at[at], mask=ok, other=zero)
    if not quant:
      return update(carry, scores(k), committed_visible(j[None, :], pos, length, win), v)
    # An 8-bit block: its values are exact in the activation dtype; a slot's scale multiplies its score and its
    # probability, never assumed 1. Stale slots load a scale of 0 (a poisoned page's NaN is never read).
    sat = (layer, h, slots, x)  # the scales' [L, Hkv, S, X] (spec_jax/kernels/__init__.py scale_layout)
    ks = plgpu.load(ks_ref.at[sat], mask=j < length, other=0)
    vs = plgpu.load(vs_ref.at[sat], mask=j < length, other=0)
    s = scores(k.astype(q.dtype)) * ks[None, :]
    return update(carry, s, committed_visible(j[None, :], pos, length, win), v.astype(q.dtype), vs)

  init = (jnp.zeros((R, Dp), jnp.float32), jnp.full((R,), NEG_INF, jnp.float32),
          jnp.zeros((R,), jnp.float32))
  carry = lax.fori_loop(lo, hi, body, init)

  # The new tokens, block_k at a time (one tile of a prefill chunk's 512 would not fit in shared memory); a
  # chain's row block never sees tokens past its own last one.
  block_rows = R
  last = jnp.minimum((pl.program_id(2) + 1) * block_rows - 1, T * G - 1) // G
  new_blocks = kn_ref.shape[0] // block_k if tree else last // block_k + 1

  def new_body(j, carry):
    at = pl.ds(j * block_k, block_k)
    kn, vn = kn_ref[at, :], vn_ref[at, :]
    tn = j * block_k + offs[None, :]
    return update(carry, scores(kn), new_visible(tn, pos, npos_ref[at][None, :], aux, win, tree), vn)

  def with_new(carry):
    return lax.fori_loop(0, new_blocks, new_body, carry)

  if num_splits > 1:
    carry = lax.cond(last_split, with_new, lambda c: c, carry)
  else:
    carry = with_new(carry)
  acc, m, l = carry

  if num_splits > 1:
    o_ref, m_ref, l_ref = out_refs
    o_ref[...] = acc
    m_ref[...] = m
    l_ref[...] = l
  else:
    (o_ref,) = out_refs
    # A row that saw nothing (only padding rows, for valid inputs) comes out as 0 instead of NaN.
    o_ref[...] = (acc / jnp.where(l == 0.0, 1.0, l)[:, None]).astype(o_ref.dtype)


def _default_splits(programs: int, num_blocks: int) -> int:
  # The device the program is built for: the default device when one is set (an AOT compile for a GPU target
  # from a CPU host sets it), else the first device.
  device = jax.config.jax_default_device
  try:
    if device is None or isinstance(device, str):
      device = jax.devices()[0]
    cores = int(getattr(device, "core_count", 0)) or 108
  except Exception:  # no device info: any sane guess works, splitting only changes speed
    cores = 108
  # Aim for ~2 programs per SM, but keep >= 4 blocks per split so the merge stays cheap.
  want = -(-2 * cores // programs)
  return max(1, min(want, num_blocks // 4))


def attention_pallas_gpu(q, k_new, v_new, k_cache, v_cache, q_positions, lengths, *, scale, window=None,
                         tree_mask=None, layer=None, interpret=False, block_k: int = 64, max_rows: int | None = None,
                         num_splits: int | None = None, num_warps: int | None = None, num_stages: int = 2,
                         pages=None, k_scale=None, v_scale=None):
  """Same contract as spec_jax.kernels.attention (see reference.attention_xla).

  pages int32[B, P]: k_cache/v_cache are page pools [L, N, Hkv, block, D] (spec_jax/cache.py; block a power of
  two >= 16, a Triton tile): each loop step reads one page, found through the table.
  block_k: KV slots per loop step. max_rows: the most query rows (tokens x heads per kv head) one program
  holds; more (prefill) are cut into row blocks. num_splits: programs per row along the KV axis (None: enough
  to fill the GPU). k_scale/v_scale: an 8-bit cache's float32 scales [L, Hkv, S, X] (one per slot and KV head,
  pages or rows last: kernels.scale_layout), loaded beside each block.
  """
  require_backend("attention_pallas_gpu", "gpu", interpret)
  quant = k_scale is not None
  if layer is None:  # one layer's cache: a stack of one (a free reshape)
    k_cache, v_cache, layer = k_cache[None], v_cache[None], 0
    k_scale, v_scale = (k_scale[None], v_scale[None]) if quant else (None, None)
  B, T, Hq, D = q.shape
  _, _, Hkv, S, _ = k_cache.shape
  flat_pages = jnp.zeros((1,), jnp.int32)
  if pages is not None:
    if S < 16 or S & (S - 1):
      raise ValueError(f"the GPU kernel reads pages of a power of two >= 16 tokens, got {S}")
    block_k, S = S, pages.shape[1] * S
    flat_pages = pages.astype(jnp.int32).reshape(-1)
  G = Hq // Hkv
  # Triton tiles must be powers of two, and tl.dot wants >= 16 per side.
  Dp = max(16, next_pow2(D))
  if max_rows is None:
    max_rows = 128 if Dp <= 128 else 64  # keeps the f32 accumulator tile in registers
  max_rows = max(16, next_pow2(max_rows))
  block_rows = min(max(16, next_pow2(T * G)), max_rows)
  R = round_up(T * G, block_rows)
  num_row_blocks = R // block_rows
  if pages is None:
    block_k = max(16, next_pow2(min(block_k, max(S, 16))))
  Tp = round_up(T, block_k)
  num_blocks = -(-S // block_k)
  if num_splits is None:
    num_splits = _default_splits(B * Hkv * num_row_blocks, num_blocks)
  num_splits = max(1, min(int(num_splits), max(num_blocks, 1)))
  if num_warps is None:
    num_warps = 4 if block_rows * Dp <= 64 * 128 else 8

  tree = tree_mask is not None
  win = effective_window(window)
  pos, aux = row_inputs(q_positions, tree_mask, win, G, R)
  lo, hi = block_bounds(pos, lengths, S, block_rows, block_k, win)
  q_rows = to_rows(q, Hkv, R, Dp)
  npos = jnp.pad(q_positions.astype(jnp.int32), ((0, 0), (0, Tp - T)))
  new_dtype = q.dtype if quant else k_cache.dtype  # an 8-bit cache's new tokens stay in the activation dtype
  kn, vn = new_tokens(k_new.astype(new_dtype), Tp, Dp), new_tokens(v_new.astype(new_dtype), Tp, Dp)

  kernel = functools.partial(_kernel, scale=float(scale), S=S, T=T, G=G, D=D, block_k=block_k,
                             num_row_blocks=num_row_blocks, num_splits=num_splits, tree=tree,
                             paged=pages is not None, quant=quant,
                             # explicit: not jax_default_matmul_precision's (see pallas_tpu)
                             precision=lax.Precision.HIGHEST if q.dtype == jnp.float32 else lax.Precision.DEFAULT)
  whole = lambda shape: pl.BlockSpec(shape, lambda b, h, r, s: (0,) * len(shape))
  if tree:
    aux_spec = pl.BlockSpec((None, block_rows, aux.shape[2]), lambda b, h, r, s: (b, r, 0))
  else:
    aux_spec = pl.BlockSpec((None, block_rows), lambda b, h, r, s: (b, r))
  in_specs = [
      whole((1,)), whole(flat_pages.shape), whole((B,)), whole(lo.shape), whole(hi.shape), whole((1,)),
      pl.BlockSpec((None, block_rows), lambda b, h, r, s: (b, r)),
      aux_spec,
      pl.BlockSpec((None, Tp), lambda b, h, r, s: (b, 0)),
      pl.BlockSpec((None, None, block_rows, Dp), lambda b, h, r, s: (b, h, r, 0)),
      whole(k_cache.shape),  # the whole stacked cache (or pool): the kernel indexes layer, row (page), head
      whole(v_cache.shape),
  ] + ([whole(k_scale.shape), whole(v_scale.shape)] if quant else []) + [
      pl.BlockSpec((None, None, Tp, Dp), lambda b, h, r, s: (b, h, 0, 0)),
      pl.BlockSpec((None, None, Tp, Dp), lambda b, h, r, s: (b, h, 0, 0)),
  ]
  if num_splits > 1:
    out_shape = (jax.ShapeDtypeStruct((B, Hkv, num_splits, R, Dp), jnp.float32),
                 jax.ShapeDtypeStruct((B, Hkv, num_splits, R), jnp.float32),
                 jax.ShapeDtypeStruct((B, Hkv, num_splits, R), jnp.float32))
    out_specs = (pl.BlockSpec((None, None, None, block_rows, Dp), lambda b, h, r, s: (b, h, s, r, 0)),
                 pl.BlockSpec((None, None, None, block_rows), lambda b, h, r, s: (b, h, s, r)),
                 pl.BlockSpec((None, None, None, block_rows), lambda b, h, r, s: (b, h, s, r)))
  else:
    out_shape = jax.ShapeDtypeStruct((B, Hkv, R, Dp), q.dtype)
    out_specs = pl.BlockSpec((None, None, block_rows, Dp), lambda b, h, r, s: (b, h, r, 0))

  flops, transcendentals, bytes_accessed = cost_estimate(q, k_new, (B, Hkv, S, D), k_cache.dtype, quant)
  out = pl.pallas_call(
      kernel,
      grid=(B, Hkv, num_row_blocks, num_splits),
      in_specs=in_specs,
      out_specs=out_specs,
      out_shape=out_shape,
      compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
      cost_estimate=pl.CostEstimate(flops=flops, transcendentals=transcendentals, bytes_accessed=bytes_accessed),
      interpret=interpret,
      name="spec_attention_gpu",
  )(jnp.asarray(layer, jnp.int32).reshape(1), flat_pages, lengths.astype(jnp.int32), lo, hi, win.reshape(1), pos,
    aux, npos,
    q_rows, k_cache, v_cache, *((k_scale, v_scale) if quant else ()), kn, vn)

  if num_splits > 1:
    acc, m, l = out
    m_all = jnp.max(m, axis=2, keepdims=True)
    wgt = jnp.exp(m - m_all)  # splits that saw nothing have l == 0 and acc == 0, so any weight is fine
    l_all = jnp.sum(wgt * l, axis=2)
    acc_all = jnp.sum(wgt[..., None] * acc, axis=2)
    out = (acc_all / jnp.where(l_all == 0.0, 1.0, l_all)[..., None]).astype(q.dtype)
  return from_rows(out, T, Hq, D)
