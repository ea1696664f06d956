"""The XLA reference for verify/decode attention: the ground truth every kernel is tested against."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from spec_jax.kernels.common import NEG_INF, per_row_tree


def attention_mask(q_positions, kv_lengths, seq_len: int, window=None, tree_mask=None):
  """bool[B, T, S]: which cache slots each query may read.

  The T new tokens of row b sit in slots kv_lengths[b]-T .. kv_lengths[b]-1 (slot index == position for
  committed tokens). Query t sees committed slots j < kv_lengths[b]-T (within the window, if any) and new
  slots t' <= t, or tree_mask[t, t'] when a tree is given (tree_mask[b, t, t'] when it is given per row).
  """
  B, T = q_positions.shape
  j = jnp.arange(seq_len, dtype=jnp.int32)[None, None, :]  # [1,1,S]
  start = (kv_lengths - T)[:, None, None]  # [B,1,1] first new slot
  committed = j < start
  new_idx = j - start  # t' for new slots
  is_new = (new_idx >= 0) & (new_idx < T)
  t_new = jnp.clip(new_idx, 0, T - 1)
  if tree_mask is None:
    t = jnp.arange(T, dtype=jnp.int32)[None, :, None]
    new_ok = new_idx <= t
  else:
    new_ok = jnp.take_along_axis(per_row_tree(tree_mask, B), jnp.broadcast_to(t_new, (B, T, seq_len)), axis=2)
  if window is not None:
    # Committed slot j holds position j; a new slot holds its own token's position. The window matters for new
    # slots only when T exceeds it (a long prefill chunk), never for verify.
    w = jnp.asarray(window, jnp.int32)
    new_pos = jnp.take_along_axis(q_positions, t_new[:, 0, :], axis=1)[:, None, :]  # [B,1,S]
    key_pos = jnp.where(committed, j, new_pos)
    in_window = (q_positions[:, :, None] - key_pos) < w
    committed = committed & jnp.where(w > 0, in_window, True)
    new_ok = new_ok & jnp.where(w > 0, in_window, True)
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


def attention_xla_split(q, k_cache, v_cache, k_new, v_new, q_positions, kv_lengths, *, scale, window=None,
                        tree_mask=None):
  """The same attention as `attention_xla`, with the T new keys/values passed beside the cache instead of in it.

  Row b's committed slots are j < kv_lengths[b] - T of k_cache/v_cache[B, S, Hkv, D]; the new tokens are
  k_new/v_new[B, T, Hkv, D]. One softmax runs over both. XLA:CPU cannot update a cache slice in place and then
  read it in the same scanned layer without copying the cache, so the model's XLA path writes the cache after
  the layer scan and attends through this form.
  """
  B, T, Hq, D = q.shape
  S, Hkv = k_cache.shape[1], k_cache.shape[2]
  G = Hq // Hkv
  qg = q.reshape(B, T, Hkv, G, D)
  s_old = jnp.einsum("btkgd,bskd->bkgts", qg, k_cache, preferred_element_type=jnp.float32) * scale
  s_new = jnp.einsum("btkgd,bukd->bkgtu", qg, k_new, preferred_element_type=jnp.float32) * scale
  j = jnp.arange(S, dtype=jnp.int32)[None, None, :]
  committed = j < (kv_lengths - T)[:, None, None]
  t = jnp.arange(T, dtype=jnp.int32)
  new_ok = per_row_tree(t[None, :] <= t[:, None] if tree_mask is None else tree_mask, B)
  if window is not None:
    w = jnp.asarray(window, jnp.int32)
    on = w > 0
    committed = committed & jnp.where(on, (q_positions[:, :, None] - j) < w, True)
    new_ok = new_ok & jnp.where(on, (q_positions[:, :, None] - q_positions[:, None, :]) < w, True)
  s_old = jnp.where(committed[:, None, None], s_old, NEG_INF)
  s_new = jnp.where(new_ok[:, None, None], s_new, NEG_INF)
  p = jax.nn.softmax(jnp.concatenate([s_old, s_new], axis=-1), axis=-1)
  # Masked slots already have p == 0; the select keeps them out of the backward pass too. Without it, the softmax
  # backward's row sum, sum_s p[s] * (g_o . v_cache[s]), reads g_o . v_cache at masked slots, and XLA:CPU (jaxlib
  # 0.10) computes that dot as garbage, NaN at times, when v_cache is a broadcast zero (a cache made inside the
  # jitted function by KVCache.init) and the dot, the broadcast and the sum land in one YNNPACK fusion
  # (`__ynn_fusion`), which XLA picks at shapes like B = 8, T = 128 (Gemma 3 270M training: T = 192), not at
  # tiny ones. 0 * NaN then reached every score of the row, so dq, dk and all gradients upstream were NaN.
  # Minimal reproduction, which returns garbage instead of 0:
  #   jax.jit(lambda a, z: jnp.einsum("bij,bjk->bik", a, jnp.broadcast_to(z, (1, 64, 64))).sum(-1))(
  #       jnp.ones((1, 64, 64)), 0.0)
  p_old = jnp.where(committed[:, None, None], p[..., :S], 0.0)
  o = (jnp.einsum("bkgts,bskd->btkgd", p_old.astype(v_cache.dtype), v_cache,
                  preferred_element_type=jnp.float32)
       + jnp.einsum("bkgtu,bukd->btkgd", p[..., S:].astype(v_new.dtype), v_new,
                    preferred_element_type=jnp.float32))
  return o.reshape(B, T, Hq, D).astype(q.dtype)
