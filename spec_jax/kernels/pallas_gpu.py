"""Verify/decode attention as a Pallas kernel for GPUs (Triton lowering).

One program handles one (batch row, kv head, row block, kv split). All T tokens times the G query heads that
share the kv head form the rows of one tile (a prefill-sized T is cut into row blocks), so every K/V block is
loaded once and used by all of them. The program walks only the KV blocks that can hold visible slots (bounds
from kv_lengths, causality and the window), with an online softmax in float32. When the grid has too few
programs to fill the GPU (small-batch decode), each row's block range is split across programs and the
partial results are merged in XLA (flash-decoding). The row layout and visibility helpers are in common.py,
shared with the TPU kernel.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from spec_jax.kernels.common import (NEG_INF, block_bounds, effective_window, from_rows, next_pow2, require_backend,
                                     round_up, row_inputs, to_rows, visible)


def _kernel(lens_ref, lo_ref, hi_ref, win_ref, pos_ref, aux_ref, q_ref, k_ref, v_ref, *out_refs,
            scale: float, T: int, S: int, block_k: int, num_row_blocks: int, num_splits: int, tree: bool):
  b = pl.program_id(0)
  cell = b * num_row_blocks + pl.program_id(2)
  length = lens_ref[b]
  win = win_ref[0]
  lo = lo_ref[cell]
  hi = hi_ref[cell]
  if num_splits > 1:
    # Split this row's own block range, so short rows do not leave splits idle while long ones queue.
    chunk = lax.div(hi - lo + (num_splits - 1), num_splits)
    lo = lo + pl.program_id(3) * chunk
    hi = jnp.minimum(hi, lo + chunk)

  q = q_ref[...]
  R, Dp = q.shape
  pos = pos_ref[...][:, None]
  if tree:
    aux = [aux_ref[:, i][:, None] for i in range(aux_ref.shape[1])]
  else:
    aux = aux_ref[...][:, None]
  offs = jnp.arange(block_k, dtype=jnp.int32)
  ragged = S % block_k != 0

  def body(blk, carry):
    acc, m, l = carry
    j0 = blk * block_k
    kv_slice = pl.ds(j0, block_k)
    if ragged:
      # The last block runs past S: masked loads keep it in bounds, and zero V keeps p*V finite.
      in_bounds = ((j0 + offs) < S)[:, None]
      k = plgpu.load(k_ref.at[kv_slice, :], mask=in_bounds, other=0)
      v = plgpu.load(v_ref.at[kv_slice, :], mask=in_bounds, other=0)
    else:
      k = k_ref[kv_slice, :]
      v = v_ref[kv_slice, :]
    s = lax.dot_general(q, k, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32) * scale
    mask = visible((j0 + offs)[None, :], pos, aux, length, win, T, tree)
    s = jnp.where(mask, s, NEG_INF)
    m_new = jnp.maximum(m, jnp.max(s, axis=1))
    alpha = jnp.exp(m - m_new)
    # Masked slots get exactly 0 even while m_new is still NEG_INF (nothing visible yet).
    p = jnp.where(mask, jnp.exp(s - m_new[:, None]), 0.0)
    l = alpha * l + jnp.sum(p, axis=1)
    pv = lax.dot_general(p.astype(v.dtype), v, (((1,), (0,)), ((), ())),
                         preferred_element_type=jnp.float32)
    acc = acc * alpha[:, None] + pv
    return acc, m_new, l

  init = (jnp.zeros((R, Dp), jnp.float32), jnp.full((R,), NEG_INF, jnp.float32),
          jnp.zeros((R,), jnp.float32))
  acc, m, l = lax.fori_loop(lo, hi, body, init)

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
  try:
    cores = int(getattr(jax.devices()[0], "core_count", 0)) or 108
  except Exception:  # no device info: any sane guess works, splitting only changes speed
    cores = 108
  # Aim for ~2 programs per SM, but keep >= 4 blocks per split so the merge stays cheap.
  want = -(-2 * cores // programs)
  return max(1, min(want, num_blocks // 4))


def attention_pallas_gpu(q, k_cache, v_cache, q_positions, kv_lengths, *, scale, window=None, tree_mask=None,
                         interpret=False, block_k: int = 64, max_rows: int | None = None,
                         num_splits: int | None = None, num_warps: int | None = None, num_stages: int = 2):
  """Same contract as spec_jax.kernels.attention (see reference.attention_xla).

  block_k: KV slots per loop step. max_rows: the most query rows (tokens x heads per kv head) one program
  holds; more (prefill) are cut into row blocks. num_splits: programs per row along the KV axis (None: enough
  to fill the GPU).
  """
  require_backend("attention_pallas_gpu", "gpu", interpret)
  B, T, Hq, D = q.shape
  S, Hkv = k_cache.shape[1], k_cache.shape[2]
  G = Hq // Hkv
  # Triton tiles must be powers of two, and tl.dot wants >= 16 per side.
  Dp = max(16, next_pow2(D))
  if max_rows is None:
    max_rows = 128 if Dp <= 128 else 64  # keeps the f32 accumulator tile in registers
  max_rows = max(16, next_pow2(max_rows))
  block_rows = min(max(16, next_pow2(T * G)), max_rows)
  R = round_up(T * G, block_rows)
  num_row_blocks = R // block_rows
  block_k = max(16, next_pow2(min(block_k, max(S, 16))))
  if Dp != D:
    # Rare head sizes (e.g. 80, 96): padding copies the cache, but keeps the kernel simple.
    pad = ((0, 0), (0, 0), (0, 0), (0, Dp - D))
    k_cache, v_cache = jnp.pad(k_cache, pad), jnp.pad(v_cache, pad)
  num_blocks = -(-S // block_k)
  if num_splits is None:
    num_splits = _default_splits(B * Hkv * num_row_blocks, num_blocks)
  num_splits = max(1, min(int(num_splits), num_blocks))
  if num_warps is None:
    num_warps = 4 if block_rows * Dp <= 64 * 128 else 8

  tree = tree_mask is not None
  win = effective_window(window)
  pos, aux = row_inputs(q_positions, kv_lengths, tree_mask, win, G, R)
  lo, hi = block_bounds(pos, None if tree else aux, kv_lengths, T, S, block_rows, block_k, win, tree)
  lengths = kv_lengths.astype(jnp.int32)
  q_rows = to_rows(q, Hkv, R, Dp)

  kernel = functools.partial(_kernel, scale=float(scale), T=T, S=S, block_k=block_k,
                             num_row_blocks=num_row_blocks, num_splits=num_splits, tree=tree)
  whole = lambda shape: pl.BlockSpec(shape, lambda b, h, r, s: (0,) * len(shape))
  if tree:
    aux_spec = pl.BlockSpec((None, block_rows, aux.shape[2]), lambda b, h, r, s: (b, r, 0))
  else:
    aux_spec = pl.BlockSpec((None, block_rows), lambda b, h, r, s: (b, r))
  in_specs = [
      whole((B,)), whole(lo.shape), whole(hi.shape), whole((1,)),
      pl.BlockSpec((None, block_rows), lambda b, h, r, s: (b, r)),
      aux_spec,
      pl.BlockSpec((None, None, block_rows, Dp), lambda b, h, r, s: (b, h, r, 0)),
      pl.BlockSpec((None, S, None, Dp), lambda b, h, r, s: (b, 0, h, 0)),
      pl.BlockSpec((None, S, None, Dp), lambda b, h, r, s: (b, 0, h, 0)),
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

  out = pl.pallas_call(
      kernel,
      grid=(B, Hkv, num_row_blocks, num_splits),
      in_specs=in_specs,
      out_specs=out_specs,
      out_shape=out_shape,
      compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
      interpret=interpret,
      name="spec_attention_gpu",
  )(lengths, lo, hi, win.reshape(1), pos, aux, q_rows, k_cache, v_cache)

  if num_splits > 1:
    acc, m, l = out
    m_all = jnp.max(m, axis=2, keepdims=True)
    wgt = jnp.exp(m - m_all)  # splits that saw nothing have l == 0 and acc == 0, so any weight is fine
    l_all = jnp.sum(wgt * l, axis=2)
    acc_all = jnp.sum(wgt[..., None] * acc, axis=2)
    out = (acc_all / jnp.where(l_all == 0.0, 1.0, l_all)[..., None]).astype(q.dtype)
  return from_rows(out, T, Hq, D)
