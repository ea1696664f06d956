"""A decoder-only transformer whose layers are stacked on a leading axis and scanned.

The parameters are a plain dict pytree (names below) and `forward` is the pure function that jitted code calls:
with a KV cache for prefill, decode and verify, without one (cache=None) for training's whole sequences.
Layer-varying settings (sliding window, RoPE base) are scanned inputs, so one compiled layer body serves Gemma 3's
local and global layers and compile time stays flat in depth.

Param names, shapes and logical axes are models/schema.py's rows (L = layers, D = d_model, H/K = query/kv heads,
d = head_dim, F = mlp_dim, V = vocab): embed [V, D], final_norm [D], lm_head [D, V] when embeddings are untied, and
under `layers` each layer's weights stacked on a leading axis, e.g. q [L, D, H, d], o [L, H, d, D], gate/up
[L, D, F], down [L, F, D], the norms [L, D] and what the flags add (qk_norm, qkv_bias, post_norms).
Norm weights are plain multipliers (Gemma's 1 + w is folded in at load time).
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from spec_jax import kernels, scopes
from spec_jax.kernels.common import gemm_rows
from spec_jax.quant import QTensor, qdot, take_rows
from spec_jax.cache import KVCache, fake_quant, key_channel_gain, smooths_keys
from spec_jax.config import ModelConfig
from spec_jax.models import schema


def param_shapes(config: ModelConfig) -> dict:
  """The expected shape of every parameter (models/schema.py's rows for this config): loaders check against this."""
  return schema.shapes(config)


def init_params(config: ModelConfig, key: jax.Array, dtype=jnp.float32) -> dict:
  """Random weights for tiny test models: fan-in scaled normals, norms near 1."""
  shapes = param_shapes(config)
  flat, treedef = jax.tree_util.tree_flatten_with_path(shapes, is_leaf=lambda x: isinstance(x, tuple))
  keys = jax.random.split(key, len(flat))
  leaves = []
  for (path, shape), k in zip(flat, keys):
    name = path[-1].key
    if "norm" in name:
      w = 1.0 + 0.1 * jax.random.normal(k, shape)
    elif "bias" in name:
      w = 0.1 * jax.random.normal(k, shape)
    elif name == "embed":
      w = jax.random.normal(k, shape) * (1.0 / math.sqrt(shape[-1]))
    else:
      fan_in = shape[1] if name != "o" else shape[1] * shape[2]
      w = jax.random.normal(k, shape) / math.sqrt(fan_in)
    leaves.append(w.astype(dtype))
  return jax.tree_util.tree_unflatten(treedef, leaves)


def rms_norm(x, w, eps):
  x32 = x.astype(jnp.float32)
  y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
  return (y * w.astype(jnp.float32)).astype(x.dtype)


def rope_frequencies(d: int, base, scaling=None):
  """The d/2 inverse frequencies of RoPE with base `base` (traced), with Llama 3.1's scaling when `scaling` is
  ("llama3", factor, low_freq_factor, high_freq_factor, original_max_position_embeddings): wavelengths longer
  than original / low are divided by factor, shorter than original / high kept, and the band between blended."""
  inv_freq = jnp.exp(-jnp.log(base) * (jnp.arange(0, d, 2, dtype=jnp.float32) / d))  # [d/2]
  if scaling is None:
    return inv_freq
  kind, factor, low, high, original = scaling
  if kind != "llama3":
    raise ValueError(f"unknown RoPE scaling {kind!r}")
  wavelen = 2 * math.pi / inv_freq
  scaled = jnp.where(wavelen > original / low, inv_freq / factor, inv_freq)
  smooth = (original / wavelen - low) / (high - low)
  blended = (1 - smooth) * scaled / factor + smooth * scaled
  medium = (wavelen >= original / high) & (wavelen <= original / low)
  return jnp.where(medium, blended, scaled)


def rope(x, positions, base, scaling=None):
  """Rotate-half RoPE. x [B, T, H, d]; positions [B, T]; base a (traced) scalar; scaling: rope_frequencies'."""
  d = x.shape[-1]
  inv_freq = rope_frequencies(d, base, scaling)
  ang = positions.astype(jnp.float32)[..., None] * inv_freq  # [B, T, d/2]
  cos, sin = jnp.cos(ang)[:, :, None, :], jnp.sin(ang)[:, :, None, :]
  x32 = x.astype(jnp.float32)
  x1, x2 = x32[..., : d // 2], x32[..., d // 2:]
  return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


def dot(eq, x, w):
  """einsum accumulating in float32, back in x's dtype. XLA:CPU runs a bfloat16 dot with bfloat16 output
  ~3x slower (and a 262k-wide one ~14x slower) than the same dot with float32 output. A quantized weight
  (QTensor, spec_jax/quant.py) is dequantized tile by tile inside the dot."""
  if isinstance(w, QTensor):
    return qdot(x, w).astype(x.dtype)
  return gemm_rows(lambda h: jnp.einsum(eq, h, w, preferred_element_type=jnp.float32), x,
                   x.shape[0] * x.shape[1]).astype(x.dtype)  # x [B, T, ...]: B x T rows


def _activation(name):
  if name == "gelu_tanh":
    return lambda x: jax.nn.gelu(x, approximate=True)
  return jax.nn.silu


def layer_qkv(c: ModelConfig, x, p, positions, base, attn_input=None):
  """A layer's attention inputs: q [B, T, H, d], k and v [B, T, K, d], RoPE applied. `attn_input`: what the
  projections read instead of rms_norm(x, attn_norm) (published EAGLE heads: no input norm, or a wider input)."""
  h = rms_norm(x, p["attn_norm"], c.norm_eps) if attn_input is None else attn_input
  q = dot("btd,dhk->bthk", h, p["q"])
  k = dot("btd,dhk->bthk", h, p["k"])
  v = dot("btd,dhk->bthk", h, p["v"])
  if c.qkv_bias:
    q, k, v = q + p["q_bias"], k + p["k_bias"], v + p["v_bias"]
  if c.qk_norm:
    q, k = rms_norm(q, p["q_norm"], c.norm_eps), rms_norm(k, p["k_norm"], c.norm_eps)
  return rope(q, positions, base, c.rope_scaling), rope(k, positions, base, c.rope_scaling), v


def layer_finish(c: ModelConfig, x, attn, p):
  """The rest of a layer after attention: output projection, residuals and the MLP."""
  o = dot("bthk,hkd->btd", attn, p["o"])
  if c.post_norms:
    o = rms_norm(o, p["post_attn_norm"], c.norm_eps)
  x = x + o
  h = rms_norm(x, p["mlp_norm"], c.norm_eps)
  m = _activation(c.activation)(dot("btd,df->btf", h, p["gate"])) * dot("btd,df->btf", h, p["up"])
  m = dot("btf,fd->btd", m, p["down"])
  if c.post_norms:
    m = rms_norm(m, p["post_mlp_norm"], c.norm_eps)
  return x + m


def decoder_layer(config: ModelConfig, x, p, k_cache, v_cache, layer, window, base, positions, lengths, *,
                  impl: str = "xla", tree_mask=None, mesh=None, attn_input=None, pages=None, kv_dtype: str = "auto",
                  kv_scales=None):
  """One decoder layer over x [B, T, D] at positions [B, T] -> (x, k_new, v_new [B, T, K, d]).

  It reads the committed slots (< lengths[b]) of k_cache/v_cache [B, K, S, d] (a row's logical cache,
  KVCache.layer_view; or a stack [L, B, K, S, d] with a traced `layer`), and does not write it: the caller writes
  k_new/v_new at slots lengths[b] .. (KVCache.write).
  With k_cache = v_cache = None it attends over the T tokens only (causal, windowed by position), as training's
  cache-free forward does. `tree_mask` bool [B, T, T] (or [T, T]) replaces the causal mask among the T new tokens
  (a token tree). `mesh`: the device mesh a Pallas kernel runs per shard on (kernels.attention). `attn_input`:
  what the Q/K/V projections read instead of the normed x (layer_qkv); the residual stays x.
  `kv_dtype`: the cache's --kv_cache_dtype; an 8-bit cache's readers see the new K/V quantized (cache.fake_quant)
  as every later forward reads them back, so chains, trees and plain decoding compute the same target.
  `kv_scales` (k_scale, v_scale): the 8-bit pools' scales, for a kernel that reads the pools (`pages`) itself.
  """
  c = config
  B, T = positions.shape
  if c.qk_norm and smooths_keys(kv_dtype):
    # int8 stores K over its channel gain and q carries it (q.k unchanged). The gain is equal within each RoPE
    # pair, so it commutes with RoPE and folds into the norms' [D] weights: no pass over q and k.
    gain = key_channel_gain(p["k_norm"])
    p = dict(p, q_norm=p["q_norm"].astype(jnp.float32) * gain, k_norm=p["k_norm"].astype(jnp.float32) / gain)
  q, k, v = layer_qkv(c, x, p, positions, base, attn_input)
  if k_cache is None:
    # An empty cache beside the new tokens; always the XLA form, the one training differentiates (the Pallas
    # kernels have no backward pass).
    k_cache = v_cache = jnp.zeros((B, k.shape[2], 0, k.shape[3]), k.dtype)
    impl, layer = "xla", None
  k_seen, v_seen = fake_quant(k, kv_dtype), fake_quant(v, kv_dtype)
  ks, vs = kv_scales if kv_scales is not None else (None, None)
  new_dtype = k_seen.dtype if kv_scales is not None else k_cache.dtype  # never cast the new tokens to 8 bits
  with scopes.scope(scopes.ATTENTION):
    attn = kernels.attention(q, k_seen.astype(new_dtype), v_seen.astype(new_dtype), k_cache, v_cache,
                             positions, lengths, scale=c.attn_scale, window=window, tree_mask=tree_mask, layer=layer,
                             impl=impl, mesh=mesh, pages=pages, k_scale=ks, v_scale=vs)
  return layer_finish(c, x, attn, p), k, v


_UNROLL_LAYERS = contextvars.ContextVar("unroll_layers", default=False)


@contextlib.contextmanager
def layers_unrolled():
  """Trace the layer scan unrolled. XLA's cost analysis counts a loop's body once, so a compiled program's
  estimate covers every layer only when they are unrolled (serve.aot --cost_table); serving keeps the scan."""
  token = _UNROLL_LAYERS.set(True)
  try:
    yield
  finally:
    _UNROLL_LAYERS.reset(token)


def embed(params, tokens, config: ModelConfig):
  """Activations take the layers' dtype (final_norm's), which may differ from the embedding table's."""
  dtype = params["final_norm"].dtype
  w = params["embed"]
  if isinstance(w, QTensor):
    x = take_rows(w, tokens, dtype)
  else:
    # XLA:CPU gathers bfloat16 by converting the whole table to float32 first; inside a loop (the decode loop,
    # the trainer's scan) that convert is loop-invariant and hoisted out, so every loop call materialized the
    # 262k-row table in float32 (670 MB, ~150 ms). Tying the table to the loop-variant tokens in one
    # optimization barrier keeps the convert in the loop, fused into the gather of the few rows it reads.
    w, tokens = jax.lax.optimization_barrier((w, tokens))
    x = jnp.take(w, tokens, axis=0).astype(dtype)
  if config.embed_scale:
    x = x * jnp.asarray(math.sqrt(config.d_model), x.dtype)
  return x


def lm_head(params, hidden):
  """hidden [..., D] (already final-normed) -> float32 logits [..., V]."""
  w = params.get("lm_head", params["embed"])
  if isinstance(w, QTensor):  # tied ([V, D], contracting D) or untied ([D, V]): both quantized output-major
    return qdot(hidden, w)
  w = params.get("lm_head")
  lead, d = hidden.shape[:-1], hidden.shape[-1]
  h = hidden.reshape(-1, d)
  # One row is computed as two: XLA:GPU turns a one-row bfloat16 product with a float32 output into a float32
  # copy of the whole head first (671 MB for Gemma 3 270M's, 2 GB for Llama-8B's, in every slot insert).
  rows = h.shape[0]
  if rows == 1:
    h = jnp.concatenate([h, h])
  # Cast the activations, never the weights: promoting a bfloat16 head would copy all 262k rows every step.
  if w is None:
    # The tied head as W[V, D] . h[M, D]^T -> [V, M], then a small transpose. Written as h . W^T, XLA:CPU's
    # loop-invariant code motion hoists a transpose of the whole 262k-row table out of a plain decode loop (a
    # 335 MB copy per loop call) and then runs the slower [M, D] x [D, V] product every step; inside
    # lax.switch branches (the speculative loop) it cannot hoist and keeps this form. Measured on Gemma 3
    # 270M shapes, bfloat16 head, 2 rows: 268 -> 195 ms/step under load, pairs 0.71-0.75 (benchmarks/decode.py
    # keeps plain decoding and the speculative loop at k = 0 within 3 %).
    w = params["embed"]
    out = jax.lax.dot_general(w, h.astype(w.dtype), (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32).T
  else:
    out = jnp.einsum("md,dv->mv", h.astype(w.dtype), w, preferred_element_type=jnp.float32)
  return out[:rows].reshape(*lead, out.shape[-1])


def pool_scales(cache: KVCache):
  """What a kernel that reads the pool itself gets beside it: an 8-bit pool's (k_scale, v_scale), else None."""
  return (cache.k_scale, cache.v_scale) if cache.quantized else None


def forward(params: dict, tokens, positions=None, cache: KVCache | None = None, *, config: ModelConfig,
            impl: str = "xla", compute_logits: bool = True, return_layers: Sequence[int] = (),
            tree_mask=None, mesh=None, write: bool = True):
  """tokens/positions [B, T] -> (logits [B, T, V] float32 | None, hidden [B, T, D], cache | None[, layer hiddens]).

  write=False: the cache is read but not written, and the new tokens' K/V come back in its place as
  (k_new, v_new) [L, B, T, Hkv, D] (a token tree writes only its accepted path, spec_jax/decode.py).

  With a cache, the new K/V land at slots cache.lengths[b] + t; `cache.lengths` is not advanced (the caller
  commits). With cache=None, the T tokens attend only to each other (causal, sliding-windowed by position), no
  cache is allocated and None comes back: training's whole-sequence forward. positions default to 0 .. T-1.
  `hidden` is the final-normed last hidden state (what the LM head reads). With `return_layers`, the outputs
  of those layers (0-based, before the final norm) come back too as [len(return_layers), B, T, D].
  `tree_mask` bool [B, T, T]: the T tokens are a token tree (spec_jax/tree.py): token t attends to the committed
  cache and to the new tokens t' with tree_mask[b, t, t'] (its ancestors and itself) instead of t' <= t; pass
  positions = the root's position + each node's depth. Written, the K/V land at slots lengths[b] + t (node
  order); the decode loop passes write=False and tree.write_accepted writes the accepted path alone. `mesh`:
  where a Pallas kernel runs per shard.
  """
  c = config
  impl = kernels.resolve_impl(impl)
  B, T = tokens.shape
  if positions is None:
    positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
  x = embed(params, tokens, c)
  windows = jnp.asarray(c.layer_windows())
  bases = jnp.asarray(c.layer_rope_bases())
  lengths = jnp.zeros((B,), jnp.int32) if cache is None else cache.lengths
  collect = bool(return_layers)

  def body(x, xs):
    p, window, base, layer = xs
    # A kernel that reads pages gets the pools and the table; the others read each row's pages gathered into a
    # logical [B, Hkv, S, D] cache (zero past each length).
    scales = None
    if cache is not None and kernels.reads_pages(impl, cache.block_size):
      kc, vc, at, pages, scales = cache.k, cache.v, layer, cache.pages, pool_scales(cache)
    else:
      with scopes.scope(scopes.PAGES):
        (kc, vc), at, pages = ((None, None) if cache is None else cache.layer_view(layer, mesh)), None, None
    x, k_new, v_new = decoder_layer(c, x, p, kc, vc, at, window, base, positions, lengths, impl=impl,
                                    tree_mask=tree_mask, mesh=mesh, pages=pages,
                                    kv_dtype="auto" if cache is None else cache.kv_dtype, kv_scales=scales)
    return x, ((k_new, v_new) if cache is not None else None, x if collect else None)

  # Nothing writes the pool inside the scan; all layers' new entries are written after it, in place, through
  # the page table.
  layer_ids = jnp.arange(c.num_layers, dtype=jnp.int32)
  with scopes.scope(scopes.TARGET_LAYERS):
    x, (new_kv, per_layer) = jax.lax.scan(body, x, (params["layers"], windows, bases, layer_ids),
                                          unroll=True if _UNROLL_LAYERS.get() else 1)
  new_cache = None
  if cache is not None:
    with scopes.scope(scopes.PAGES):
      new_cache = cache.write(new_kv[0], new_kv[1], mesh) if write else new_kv
  with scopes.scope(scopes.LM_HEAD):
    hidden = rms_norm(x, params["final_norm"], c.norm_eps)
    logits = lm_head(params, hidden) if compute_logits else None
  if collect:
    return logits, hidden, new_cache, per_layer[np.asarray(return_layers)]
  return logits, hidden, new_cache
