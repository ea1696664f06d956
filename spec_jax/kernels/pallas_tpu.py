"""Prefill/decode/verify attention as a Pallas kernel for TPUs (Mosaic).

Grid (B, Hkv, row blocks, committed kv blocks + new-token blocks). All T tokens times the G query heads of one kv head are the rows of one
tile (a prefill-sized T is cut into row blocks), so each K/V block is DMA'd once per step and feeds all of them.
The kernel reads the whole stacked cache [L, B, Hkv, S, D] in place: the layer index, the lengths, the
per-(row, row block) committed block range and the window are scalar-prefetched, and the index_map walks only
the blocks in range of that layer (then repeats the last one, which is not fetched again; pl.when skips the
compute). Nothing is copied per layer: a cache slice handed to a custom call would be materialized (the earlier
version held one layer's K and V as temporaries, 268 MB at Llama-8B verify shapes). The new tokens' K/V come
beside the cache and are read after it, 128 at a time (lanes of the score tile; with one tile of 512, prefill
chunks of 385-512 tokens compiled, but the compiler lost its cost estimate of the whole program). m/l/acc live in
VMEM scratch across the "arbitrary" kv axis.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from spec_jax.kernels.common import (NEG_INF, block_bounds, committed_visible, cost_estimate, effective_window,
                                     from_rows, new_tokens, new_visible, require_backend, round_up, row_inputs,
                                     to_rows)

LANES = 128


def _kernel(layer_ref, pages_ref, lens_ref, lo_ref, hi_ref, win_ref, pos_ref, aux_ref, npos_ref, q_ref, k_ref,
            v_ref, *rest, scale: float, num_row_blocks: int, num_committed: int,
            num_steps: int, last_token: tuple, tree: bool, precision, quant: bool, paged: bool):
  del layer_ref  # used by the index maps only
  ks_ref, vs_ref = rest[:2] if quant else (None, None)
  kn_ref, vn_ref, o_ref, m_sc, l_sc, acc_sc = rest[2:] if quant else rest
  b = pl.program_id(0)
  r = pl.program_id(2)
  cell = b * num_row_blocks + r
  i = pl.program_id(3)
  blk = lo_ref[cell] + i
  win = win_ref[0]
  pos = pos_ref[...]

  @pl.when(i == 0)
  def _init():
    m_sc[...] = jnp.full(m_sc.shape, NEG_INF, jnp.float32)
    l_sc[...] = jnp.zeros(l_sc.shape, jnp.float32)
    acc_sc[...] = jnp.zeros(acc_sc.shape, jnp.float32)

  def update(s, mask, v):
    s = jnp.where(mask, s, NEG_INF)
    m_prev = m_sc[...]
    m_new = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))
    alpha = jnp.exp(m_prev - m_new)
    # Masked slots get exactly 0 even while m_new is still NEG_INF (nothing visible yet).
    p = jnp.where(mask, jnp.exp(s - m_new), 0.0)
    l_sc[...] = alpha * l_sc[...] + jnp.sum(p, axis=1, keepdims=True)
    pv = lax.dot_general(p.astype(v.dtype), v, (((1,), (0,)), ((), ())), precision=precision,
                         preferred_element_type=jnp.float32)
    acc_sc[...] = alpha * acc_sc[...] + pv
    m_sc[...] = m_new

  def scores(k):
    return lax.dot_general(q_ref[...], k, (((1,), (1,)), ((), ())), precision=precision,
                           preferred_element_type=jnp.float32) * scale

  @pl.when((i < num_committed) & (blk < hi_ref[cell]))
  def _committed():
    k, v = k_ref[...], v_ref[...]
    block_k = k.shape[0]
    j = blk * block_k + lax.broadcasted_iota(jnp.int32, (1, block_k), 1)
    # Slots at or past the length may hold anything (stale entries, or the garbage of a block hanging past S):
    # zero them, since 0 * NaN would poison p @ v.
    jv = blk * block_k + lax.broadcasted_iota(jnp.int32, (block_k, 1), 0)
    live = jv < lens_ref[b]
    if quant:
      # An 8-bit block, dequantized to the activation dtype as the XLA path does (never at a scale of 1.0). Its
      # scales' block holds the slots (sublanes) of a run of pages or rows (lanes): this block's column, picked by
      # a select (a stale slot's or another page's NaN never reaches the sum), then zeroed past the length.
      x = pages_ref[b * num_committed + blk] if paged else b
      lane = lax.broadcasted_iota(jnp.int32, (1, ks_ref.shape[1]), 1) == lax.rem(x, ks_ref.shape[1])  # ids >= 0
      column = lambda ref: jnp.where(live, jnp.sum(jnp.where(lane, ref[...], 0.0), axis=1, keepdims=True), 0.0)
      k = (k.astype(jnp.float32) * column(ks_ref)).astype(q_ref.dtype)
      v = (v.astype(jnp.float32) * column(vs_ref)).astype(q_ref.dtype)
    v = jnp.where(live, v, jnp.zeros_like(v))
    update(scores(k), committed_visible(j, pos, lens_ref[b], win), v)

  # New tokens, LANES per step; a chain's row block never sees tokens past its own last one.
  first_new = (i - num_committed) * LANES
  last = jnp.int32(last_token[0])
  for rb in range(1, num_row_blocks):
    last = jnp.where(r == rb, last_token[rb], last)

  @pl.when((i >= num_committed) & (tree | (first_new <= last)))
  def _new():
    kn, vn = kn_ref[...], vn_ref[...]
    tn = first_new + lax.broadcasted_iota(jnp.int32, (1, LANES), 1)
    aux = [aux_ref[:, w:w + 1] for w in range(aux_ref.shape[1])] if tree else aux_ref[...]
    update(scores(kn), new_visible(tn, pos, npos_ref[...], aux, win, tree), vn)

  @pl.when(i == num_steps - 1)
  def _finish():
    l = l_sc[...]
    # A row that saw nothing (only padding rows, for valid inputs) comes out as 0 instead of NaN.
    o_ref[...] = (acc_sc[...] / jnp.where(l == 0.0, 1.0, l)).astype(o_ref.dtype)


def attention_pallas_tpu(q, k_new, v_new, k_cache, v_cache, q_positions, lengths, *, scale, window=None,
                         tree_mask=None, layer=None, interpret=False, block_k: int = 512, max_rows: int = 256,
                         pages=None, k_scale=None, v_scale=None):
  """Same contract as spec_jax.kernels.attention (see reference.attention_xla).

  pages int32[B, P]: k_cache/v_cache are then page pools [L, N, Hkv, block, D] (spec_jax/cache.py), row b's
  slot s in page pages[b, s // block]: one grid step reads one page, found through the scalar-prefetched table
  (no gathered copy of the rows' caches).
  block_k: KV slots per grid step. max_rows: the most query rows (tokens x heads per kv head) one step
  holds; more (prefill) are cut into row blocks. k_scale/v_scale: an 8-bit cache's float32 scales [L, Hkv, S, X]
  (one per slot and KV head, pages or rows last: kernels.scale_layout), read block by block beside it. `interpret` may be True (generic Pallas interpreter) or a
  pltpu.InterpretParams (TPU-faithful interpreter: DMAs, NaN-filled uninitialized memory, bounds checks).
  """
  require_backend("attention_pallas_tpu", "tpu", interpret)
  quant = k_scale is not None
  if layer is None:  # one layer's cache: a stack of one (a free reshape)
    k_cache, v_cache, layer = k_cache[None], v_cache[None], 0
    k_scale, v_scale = (k_scale[None], v_scale[None]) if quant else (None, None)
  B, T, Hq, D = q.shape
  _, _, Hkv, S, _ = k_cache.shape
  if pages is not None:  # pools of pages: a block is a page
    block_k = S
    S = pages.shape[1] * block_k
    flat_pages = pages.astype(jnp.int32).reshape(-1)
  else:
    flat_pages = jnp.zeros((1,), jnp.int32)
  G = Hq // Hkv
  # Rows fill whole sublane tiles: 8 rows of 32-bit, 16 of 16-bit values.
  sublanes = 8 * max(1, 4 // q.dtype.itemsize)
  max_rows = round_up(max_rows, sublanes)
  block_rows = min(round_up(T * G, sublanes), max_rows)
  R = round_up(T * G, block_rows)
  num_row_blocks = R // block_rows
  # A block's last two dims must be multiples of (8, 128) or the full array dims: (block_k, D) with D whole, and
  # block_k a multiple of 16 (f32 and packed bf16 tiles) or the whole S.
  if pages is None:
    block_k = S if S <= block_k else round_up(block_k, 16)
  num_committed = -(-S // block_k)
  Tp = round_up(T, LANES)  # the new tokens lie along the lanes of the score tile
  num_steps = num_committed + Tp // LANES
  # The last token each row block holds (row r is token r // G).
  last_token = tuple(min((rb + 1) * block_rows - 1, T * G - 1) // G for rb in range(num_row_blocks))

  tree = tree_mask is not None
  win = effective_window(window)
  pos, aux = row_inputs(q_positions, tree_mask, win, G, R)
  lo, hi = block_bounds(pos, lengths, S, block_rows, block_k, win)
  # Row inputs go down the sublanes ([rows, 1] columns) to broadcast against [rows, keys] scores; the new tokens'
  # positions along the lanes (padding positions are never visible: their token index is past every row's).
  pos = pos[:, :, None]
  if not tree:
    aux = aux[:, :, None]
  npos = jnp.pad(q_positions.astype(jnp.int32), ((0, 0), (0, Tp - T)))[:, None, :]
  q_rows = to_rows(q, Hkv, R, D)
  # The new tokens stay in the activation dtype with an 8-bit cache (the model fake-quantizes them already).
  new_dtype = q.dtype if quant else k_cache.dtype
  kn, vn = new_tokens(k_new.astype(new_dtype), Tp, D), new_tokens(v_new.astype(new_dtype), Tp, D)

  def kv_map(b, h, r, i, layer_ref, pages_ref, lens_ref, lo_ref, hi_ref, win_ref):
    # Past the range (and at the new-token steps), repeat its last block: the same index is not fetched again.
    cell = b * num_row_blocks + r
    blk = jnp.maximum(jnp.minimum(lo_ref[cell] + i, hi_ref[cell] - 1), 0)
    if pages is None:
      return layer_ref[0], b, h, blk, 0
    return layer_ref[0], pages_ref[b * num_committed + blk], h, 0, 0

  # A block's scales ([L, Hkv, S, X], X the pages or rows: tiles (8, 128) with no padding): this head's slots of
  # the run of `lanes` pages (rows) that holds the block's; the kernel picks its column.
  X = k_scale.shape[-1] if quant else 1
  lanes = X if X <= LANES else LANES

  def scale_map(*a):
    layer_i, x, h, blk = kv_map(*a)[:4]
    return layer_i, h, 0 if pages is not None else blk, lax.div(x, lanes)  # ids >= 0
  new_block = lambda i: jnp.maximum(i - num_committed, 0)  # block 0 during the committed steps: fetched once
  row_map = lambda b, h, r, i, *_: (b, r, 0)
  head_rows = lambda b, h, r, i, *_: (b, h, r, 0)
  new_map = lambda b, h, r, i, *_: (b, h, new_block(i), 0)
  kernel = functools.partial(
      _kernel, scale=float(scale), num_row_blocks=num_row_blocks, num_committed=num_committed,
      num_steps=num_steps, last_token=last_token, tree=tree, quant=quant, paged=pages is not None,
      # Explicit for bfloat16 too: left to jax_default_matmul_precision ("highest" in this project's tests, or a
      # user's setting), a bfloat16 dot asks Mosaic for float32 passes and fails ("Bad lhs type").
      precision=lax.Precision.HIGHEST if q.dtype == jnp.float32 else lax.Precision.DEFAULT)
  grid_spec = pltpu.PrefetchScalarGridSpec(
      num_scalar_prefetch=6,
      grid=(B, Hkv, num_row_blocks, num_steps),
      in_specs=[
          pl.BlockSpec((None, block_rows, 1), row_map),
          pl.BlockSpec((None, block_rows, aux.shape[2]), row_map),
          pl.BlockSpec((None, 1, LANES), lambda b, h, r, i, *_: (b, 0, new_block(i))),
          pl.BlockSpec((None, None, block_rows, D), head_rows),
          pl.BlockSpec((None, None, None, block_k, D), kv_map),
          pl.BlockSpec((None, None, None, block_k, D), kv_map),
      ] + [pl.BlockSpec((None, None, block_k, lanes), scale_map)] * (2 if quant else 0) + [
          pl.BlockSpec((None, None, LANES, D), new_map),
          pl.BlockSpec((None, None, LANES, D), new_map),
      ],
      out_specs=pl.BlockSpec((None, None, block_rows, D), head_rows),
      scratch_shapes=[pltpu.VMEM((block_rows, 1), jnp.float32), pltpu.VMEM((block_rows, 1), jnp.float32),
                      pltpu.VMEM((block_rows, D), jnp.float32)],
  )
  flops, transcendentals, bytes_accessed = cost_estimate(q, k_new, (B, Hkv, S, D), k_cache.dtype, quant)
  out = pl.pallas_call(
      kernel,
      grid_spec=grid_spec,
      out_shape=jax.ShapeDtypeStruct((B, Hkv, R, D), q.dtype),
      compiler_params=pltpu.CompilerParams(
          dimension_semantics=("parallel", "parallel", "parallel", "arbitrary")),
      cost_estimate=pl.CostEstimate(flops=flops, transcendentals=transcendentals, bytes_accessed=bytes_accessed),
      interpret=interpret,
      name="spec_attention_tpu",
  )(jnp.asarray(layer, jnp.int32).reshape(1), flat_pages, lengths.astype(jnp.int32), lo, hi, win.reshape(1), pos,
    aux, npos, q_rows, k_cache, v_cache, *((k_scale, v_scale) if quant else ()), kn, vn)
  return from_rows(out, T, Hq, D)
