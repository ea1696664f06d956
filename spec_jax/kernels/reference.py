"""The XLA reference for prefill/decode/verify attention: the ground truth every kernel is tested against.

One form everywhere: the T new tokens' keys and values come beside the cache (`k_new`, `v_new`), and the cache
holds only committed slots. Nothing writes the cache inside the layer scan (the model writes every layer's new
entries after it, in place): on XLA:CPU a cache slice updated and then read in the same scanned layer is copied,
and on TPU a Mosaic kernel would get a copy of the layer's cache as its operand.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from spec_jax.kernels.common import NEG_INF, per_row_tree


def layer_of(cache, layer):
  """[L, B, Hkv, S, D] with a (traced) layer index -> that layer's [B, Hkv, S, D]; a 4-D cache as it is."""
  if layer is None:
    return cache
  return lax.dynamic_index_in_dim(cache, layer, axis=0, keepdims=False)


def visibility(q_positions, lengths, seq_len: int, window=None, tree_mask=None):
  """-> (committed bool[B, T, S], new bool[B, T, T]): which cache slots and which new tokens each query reads.

  Row b's committed slots are j < lengths[b] (slot index == position). New token t sees new token t' when
  t' <= t, or tree_mask[(b,) t, t'] when a token tree is given. A window (int or traced scalar, <= 0: none)
  keeps both to keys whose position is within it.
  """
  B, T = q_positions.shape
  j = jnp.arange(seq_len, dtype=jnp.int32)[None, None, :]
  committed = j < lengths.astype(jnp.int32)[:, None, None]
  t = jnp.arange(T, dtype=jnp.int32)
  new = per_row_tree(t[None, :] <= t[:, None] if tree_mask is None else tree_mask, B)
  if window is not None:
    w = jnp.asarray(window, jnp.int32)
    on = w > 0
    pos = q_positions.astype(jnp.int32)
    committed = committed & jnp.where(on, (pos[:, :, None] - j) < w, True)
    new = new & jnp.where(on, (pos[:, :, None] - pos[:, None, :]) < w, True)
  return committed, new


def attention_xla(q, k_new, v_new, k_cache, v_cache, q_positions, lengths, *, scale, window=None, tree_mask=None,
                  layer=None):
  """q[B,T,Hq,D] and the new tokens' k_new/v_new[B,T,Hkv,D] against the committed cache -> [B,T,Hq,D].

  k_cache/v_cache: [B, Hkv, S, D], or [L, B, Hkv, S, D] with `layer` (traced) picking one. One softmax runs over
  the committed slots and the new tokens (see `visibility`). Slots at or past a row's length are stale and get
  weight exactly 0; they must hold finite values (the cache starts zeroed and is only ever written with K/V).
  """
  k_cache, v_cache = layer_of(k_cache, layer), layer_of(v_cache, layer)
  B, T, Hq, D = q.shape
  Hkv, S = k_cache.shape[1], k_cache.shape[2]
  G = Hq // Hkv
  # One batch axis (row x kv head) for every dot: a free reshape of the head-major cache. With two batch axes
  # XLA:CPU runs a bfloat16 dot with float32 results on a DotThunk that has no such kernel ("Unsupported element
  # type for DotThunk::Execute: BF16 x BF16 = F32"; any model with more than one KV head). The query group and
  # the tokens stay apart: merging them would merge a dimension split over `model` (the query heads) with one
  # that is not, and under a mesh XLA then reshards q with collectives on every layer.
  rows = lambda x: x.transpose(0, 2, 1, 3).reshape(B * Hkv, T, D)  # new tokens [B, T, Hkv, D] -> [B*Hkv, T, D]
  qg = q.reshape(B, T, Hkv, G, D).transpose(0, 2, 3, 1, 4).reshape(B * Hkv, G, T, D)
  kc, vc = k_cache.reshape(B * Hkv, S, D), v_cache.reshape(B * Hkv, S, D)
  kn, vn = rows(k_new), rows(v_new)
  s_old = jnp.einsum("ngtd,nsd->ngts", qg, kc, preferred_element_type=jnp.float32).reshape(B, Hkv, G, T, S) * scale
  s_new = jnp.einsum("ngtd,nud->ngtu", qg, kn, preferred_element_type=jnp.float32).reshape(B, Hkv, G, T, T) * scale
  committed, new_ok = visibility(q_positions, lengths, S, window, tree_mask)
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
  p_old = jnp.where(committed[:, None, None], p[..., :S], 0.0).reshape(B * Hkv, G, T, S)
  p_new = p[..., S:].reshape(B * Hkv, G, T, T)
  o = (jnp.einsum("ngts,nsd->ngtd", p_old.astype(v_cache.dtype), vc, preferred_element_type=jnp.float32)
       + jnp.einsum("ngtu,nud->ngtd", p_new.astype(v_new.dtype), vn, preferred_element_type=jnp.float32))
  return o.reshape(B, Hkv, G, T, D).transpose(0, 3, 1, 2, 4).reshape(B, T, Hq, D).astype(q.dtype)
