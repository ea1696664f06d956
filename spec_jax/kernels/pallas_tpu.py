"""Verify/decode attention as a Pallas kernel for TPUs (Mosaic).

Grid (B, Hkv, row blocks, kv blocks). All T tokens times the G query heads of one kv head are the rows of one
tile (a prefill-sized T is cut into row blocks), so each K/V block is DMA'd once per step and feeds all of
them. kv_lengths, the per-(row, row block) block range and the window are scalar-prefetched: the index_map
walks only the blocks in range and then repeats the last one (a repeated block index is not fetched again),
and pl.when skips the compute for those steps. m/l/acc live in VMEM scratch across the "arbitrary" kv axis.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from spec_jax.kernels.common import (NEG_INF, block_bounds, effective_window, from_rows, require_backend, round_up,
                                     row_inputs, to_rows, visible)


def _kernel(lens_ref, lo_ref, hi_ref, win_ref, pos_ref, aux_ref, q_ref, k_ref, v_ref, o_ref,
            m_sc, l_sc, acc_sc, *, scale: float, T: int, S: int, block_k: int, num_row_blocks: int,
            num_blocks: int, tree: bool, precision):
  b = pl.program_id(0)
  cell = b * num_row_blocks + pl.program_id(2)
  i = pl.program_id(3)
  blk = lo_ref[cell] + i

  @pl.when(i == 0)
  def _init():
    m_sc[...] = jnp.full(m_sc.shape, NEG_INF, jnp.float32)
    l_sc[...] = jnp.zeros(l_sc.shape, jnp.float32)
    acc_sc[...] = jnp.zeros(acc_sc.shape, jnp.float32)

  @pl.when(blk < hi_ref[cell])
  def _step():
    q = q_ref[...]
    k = k_ref[...]
    v = v_ref[...]
    R = q.shape[0]
    j = blk * block_k + lax.broadcasted_iota(jnp.int32, (R, block_k), 1)
    if S % block_k:
      # The last block hangs past S and holds garbage (maybe NaN); 0 * NaN would poison p @ v.
      jv = blk * block_k + lax.broadcasted_iota(jnp.int32, (block_k, 1), 0)
      v = jnp.where(jv < S, v, jnp.zeros_like(v))
    s = lax.dot_general(q, k, (((1,), (1,)), ((), ())), precision=precision,
                        preferred_element_type=jnp.float32) * scale
    if tree:
      aux = [aux_ref[:, w:w + 1] for w in range(aux_ref.shape[1])]
    else:
      aux = aux_ref[...]
    mask = visible(j, pos_ref[...], aux, lens_ref[b], win_ref[0], T, tree)
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

  @pl.when(i == num_blocks - 1)
  def _finish():
    l = l_sc[...]
    # A row that saw nothing (only padding rows, for valid inputs) comes out as 0 instead of NaN.
    o_ref[...] = (acc_sc[...] / jnp.where(l == 0.0, 1.0, l)).astype(o_ref.dtype)


def attention_pallas_tpu(q, k_cache, v_cache, q_positions, kv_lengths, *, scale, window=None, tree_mask=None,
                         interpret=False, block_k: int = 512, max_rows: int = 256):
  """Same contract as spec_jax.kernels.attention (see reference.attention_xla).

  block_k: KV slots per grid step. max_rows: the most query rows (tokens x heads per kv head) one step
  holds; more (prefill) are cut into row blocks. `interpret` may be True (generic Pallas interpreter) or a
  pltpu.InterpretParams (TPU-faithful interpreter: DMAs, NaN-filled uninitialized memory, bounds checks).
  """
  require_backend("attention_pallas_tpu", "tpu", interpret)
  B, T, Hq, D = q.shape
  S, Hkv = k_cache.shape[1], k_cache.shape[2]
  G = Hq // Hkv
  # Rows fill whole sublane tiles: 8 rows of 32-bit, 16 of 16-bit values.
  sublanes = 8 * max(1, 4 // q.dtype.itemsize)
  max_rows = round_up(max_rows, sublanes)
  block_rows = min(round_up(T * G, sublanes), max_rows)
  R = round_up(T * G, block_rows)
  num_row_blocks = R // block_rows
  # A block's last two dims must be (multiple of 8, multiple of 128) or the full array dims. Viewing the
  # cache as [B, S, Hkv*D] (a free reshape) lets a (block_k, D) window pick one head when D % 128 == 0.
  Dp = D if (Hkv == 1 or D % 128 == 0) else round_up(D, 128)
  if Dp != D:
    # Rare head sizes with Hkv > 1: padding copies the cache, but keeps every block legal.
    pad = ((0, 0), (0, 0), (0, 0), (0, Dp - D))
    k_cache, v_cache = jnp.pad(k_cache, pad), jnp.pad(v_cache, pad)
  # A full-S block is always legal; otherwise a multiple of 16 suits both f32 and packed bf16 tiles.
  block_k = S if S <= block_k else round_up(block_k, 16)
  num_blocks = -(-S // block_k)

  tree = tree_mask is not None
  win = effective_window(window)
  pos, aux = row_inputs(q_positions, kv_lengths, tree_mask, win, G, R)
  lo, hi = block_bounds(pos, None if tree else aux, kv_lengths, T, S, block_rows, block_k, win, tree)
  lengths = kv_lengths.astype(jnp.int32)
  # Row inputs go down the sublanes ([rows, 1] columns) to broadcast against [rows, block_k] scores.
  pos = pos[:, :, None]
  if not tree:
    aux = aux[:, :, None]
  q_rows = to_rows(q, Hkv, R, Dp)
  k2 = k_cache.reshape(B, S, Hkv * Dp)
  v2 = v_cache.reshape(B, S, Hkv * Dp)

  def kv_map(b, h, r, i, lens_ref, lo_ref, hi_ref, win_ref):
    # Past the range, repeat its last block: the same block index is not fetched again.
    cell = b * num_row_blocks + r
    return b, jnp.maximum(jnp.minimum(lo_ref[cell] + i, hi_ref[cell] - 1), 0), h

  row_map = lambda b, h, r, i, *_: (b, r, 0)
  kernel = functools.partial(
      _kernel, scale=float(scale), T=T, S=S, block_k=block_k, num_row_blocks=num_row_blocks,
      num_blocks=num_blocks, tree=tree, precision=lax.Precision.HIGHEST if q.dtype == jnp.float32 else None)
  grid_spec = pltpu.PrefetchScalarGridSpec(
      num_scalar_prefetch=4,
      grid=(B, Hkv, num_row_blocks, num_blocks),
      in_specs=[
          pl.BlockSpec((None, block_rows, 1), row_map),
          pl.BlockSpec((None, block_rows, aux.shape[2]), row_map),
          pl.BlockSpec((None, None, block_rows, Dp), lambda b, h, r, i, *_: (b, h, r, 0)),
          pl.BlockSpec((None, block_k, Dp), kv_map),
          pl.BlockSpec((None, block_k, Dp), kv_map),
      ],
      out_specs=pl.BlockSpec((None, None, block_rows, Dp), lambda b, h, r, i, *_: (b, h, r, 0)),
      scratch_shapes=[pltpu.VMEM((block_rows, 1), jnp.float32), pltpu.VMEM((block_rows, 1), jnp.float32),
                      pltpu.VMEM((block_rows, Dp), jnp.float32)],
  )
  out = pl.pallas_call(
      kernel,
      grid_spec=grid_spec,
      out_shape=jax.ShapeDtypeStruct((B, Hkv, R, Dp), q.dtype),
      compiler_params=pltpu.CompilerParams(
          dimension_semantics=("parallel", "parallel", "parallel", "arbitrary")),
      interpret=interpret,
      name="spec_attention_tpu",
  )(lengths, lo, hi, win.reshape(1), pos, aux, q_rows, k2, v2)
  return from_rows(out, T, Hq, D)
