"""The XLA reference for verify/decode attention: the ground truth every kernel is tested against."""

from __future__ import annotations

import jax
import jax.numpy as jnp

NEG_INF = -1e30  # finite, so a row that sees nothing never makes NaN


def attention_mask(q_positions, kv_lengths, seq_len: int, window=None, tree_mask=None):
  """bool[B, T, S]: which cache slots each query may read.

  The T new tokens of row b sit in slots kv_lengths[b]-T .. kv_lengths[b]-1 (slot index == position for
  committed tokens). Query t sees committed slots j < kv_lengths[b]-T (within the window, if any) and new
  slots t' <= t, or tree_mask[t, t'] when a tree is given.
  """
  B, T = q_positions.shape
  j = jnp.arange(seq_len, dtype=jnp.int32)[None, None, :]  # [1,1,S]
  start = (kv_lengths - T)[:, None, None]  # [B,1,1] first new slot
  committed = j < start
  if window is not None:
    w = jnp.asarray(window, jnp.int32)
    in_window = (q_positions[:, :, None] - j) < w
    committed = committed & jnp.where(w > 0, in_window, True)
  new_idx = j - start  # t' for new slots
  is_new = (new_idx >= 0) & (new_idx < T)
  if tree_mask is None:
    t = jnp.arange(T, dtype=jnp.int32)[None, :, None]
    new_ok = new_idx <= t
  else:
    tm = jnp.asarray(tree_mask, bool)
    new_ok = jnp.take_along_axis(
        jnp.broadcast_to(tm[None], (B, T, T)),
        jnp.broadcast_to(jnp.clip(new_idx, 0, T - 1), (B, T, seq_len)), axis=2)
  return committed | (is_new & new_ok)


def attention_xla(q, k_cache, v_cache, q_positions, kv_lengths, *, scale, window=None, tree_mask=None):
  B, T, Hq, D = q.shape
  S, Hkv = k_cache.shape[1], k_cache.shape[2]
  G = Hq // Hkv
  qg = q.reshape(B, T, Hkv, G, D)
  s = jnp.einsum("btkgd,bskd->bkgts", qg, k_cache, preferred_element_type=jnp.float32) * scale
  mask = attention_mask(q_positions, kv_lengths, S, window, tree_mask)  # [B,T,S]
  s = jnp.where(mask[:, None, None], s, NEG_INF)
  p = jax.nn.softmax(s, axis=-1)
  o = jnp.einsum("bkgts,bskd->btkgd", p.astype(v_cache.dtype), v_cache, preferred_element_type=jnp.float32)
  return o.reshape(B, T, Hq, D).astype(q.dtype)
