"""One attention entry point for prefill, decode, verify and the cache-free forward; `impl` picks the kernel."""

from __future__ import annotations

import functools

import jax.numpy as jnp

from spec_jax.kernels.common import target_platform
from spec_jax.kernels.reference import attention_xla, layer_of, visibility
from spec_jax.kernels.sharded import per_shard

IMPLS = ("auto", "xla", "pallas_gpu", "pallas_tpu")
INTERPRET = ":interpret"  # "pallas_gpu:interpret" runs the kernel in Pallas interpret mode (CPU tests)


def resolve_impl(impl: str) -> str:
  if impl.removesuffix(INTERPRET) not in IMPLS or (impl.endswith(INTERPRET) and not impl.startswith("pallas")):
    raise ValueError(f"unknown attention impl {impl!r}; choose one of {IMPLS} (pallas ones may end in "
                     f"{INTERPRET!r})")
  if impl != "auto":
    return impl
  return {"gpu": "pallas_gpu", "tpu": "pallas_tpu"}.get(target_platform(), "xla")


def reads_pages(impl: str, block_size: int = 16) -> bool:
  """Whether the kernel `impl` reads a paged cache of `block_size`-token pages through its page table (the XLA
  reference reads each row's pages gathered into a logical cache, spec_jax/cache.py layer_view; so does the GPU
  kernel when a page is not a Triton tile: a power of two >= 16)."""
  impl = resolve_impl(impl).removesuffix(INTERPRET)
  return impl == "pallas_tpu" or (impl == "pallas_gpu" and block_size >= 16 and not block_size & (block_size - 1))


def check_attention_args(q, k_new, v_new, k_cache, v_cache, q_positions, lengths, window, tree_mask, layer,
                         pages=None):
  """Shape checks at trace time, with errors that say which argument disagrees."""
  if q.ndim != 4 or k_new.ndim != 4 or v_new.ndim != 4:
    raise ValueError(f"q, k_new, v_new must be 4-D, got {q.shape}, {k_new.shape}, {v_new.shape}")
  B, T, Hq, D = q.shape
  want_dims = 4 if layer is None else 5
  if k_cache.ndim != want_dims or v_cache.ndim != want_dims:
    raise ValueError(f"k_cache and v_cache must be [B, Hkv, S, D]" + (" (one layer)" if layer is None else
                     " stacked as [L, B, Hkv, S, D] with a layer index") + f", got {k_cache.shape}, {v_cache.shape}")
  if k_cache.shape != v_cache.shape:
    raise ValueError(f"k_cache {k_cache.shape} and v_cache {v_cache.shape} disagree")
  Bk, Hkv, S, Dk = k_cache.shape[-4:]
  if pages is not None:  # a pool of pages [L, N, Hkv, block, D]: the rows are the page table's
    if pages.ndim != 2 or pages.shape[0] != B:
      raise ValueError(f"pages must be [B, pages_per_seq] with B = {B}, got {pages.shape}")
    Bk = B
  if Bk != B or Dk != D:
    raise ValueError(f"q {q.shape} and k_cache {k_cache.shape} disagree on batch or head_dim")
  if Hq % Hkv:
    raise ValueError(f"query heads {Hq} are not a multiple of kv heads {Hkv}")
  if k_new.shape != (B, T, Hkv, D) or v_new.shape != (B, T, Hkv, D):
    raise ValueError(f"k_new and v_new must be [B, T, Hkv, D] = {(B, T, Hkv, D)}, got {k_new.shape}, {v_new.shape}")
  if q_positions.shape != (B, T):
    raise ValueError(f"q_positions must be [B, T] = {(B, T)}, got {q_positions.shape}")
  if lengths.shape != (B,):
    raise ValueError(f"lengths must be [B] = {(B,)}, got {lengths.shape}")
  if tree_mask is not None and tuple(tree_mask.shape) not in ((T, T), (B, T, T)):
    raise ValueError(f"tree_mask must be [T, T] = {(T, T)} or per row [B, T, T] = {(B, T, T)}, got "
                     f"{tuple(tree_mask.shape)}")
  # numpy ints count as static too (configs loaded from .npz/json often hold them); bools are not windows.
  if isinstance(window, bool):
    raise ValueError("window must be an int, a traced int32 scalar or None, not a bool")


def scale_layout(shape) -> tuple:
  """A cache's [..., X, Hkv, S, D] (X: pages of a pool, or rows) -> its scales' [..., Hkv, S, X]: X last, so that
  on TPU the tiled dims (S, X) pad nothing (spec_jax/cache.py)."""
  *lead, x, h, s, _ = shape
  return (*lead, h, s, x)


def check_kv_scales(k_cache, v_cache, k_scale, v_scale) -> None:
  """An 8-bit cache comes with its scales (no reader may take them as 1.0), laid out by `scale_layout`."""
  eight = lambda a: a.dtype.itemsize == 1
  if (k_scale is None) != (v_scale is None):
    raise ValueError("k_scale and v_scale come together")
  if k_scale is None:
    if eight(k_cache) or eight(v_cache):
      raise ValueError(f"an 8-bit cache ({k_cache.dtype}) needs its k_scale and v_scale: read without them, its "
                       f"values would be taken at scale 1.0")
    return
  want = scale_layout(k_cache.shape)
  if k_scale.shape != want or v_scale.shape != scale_layout(v_cache.shape):
    raise ValueError(f"k_scale/v_scale {k_scale.shape}, {v_scale.shape} must be the cache's [..., X, Hkv, S] without "
                     f"head_dim, slots first then X (pages or rows) last: {want}")


def attention(q, k_new, v_new, k_cache, v_cache, q_positions, lengths, *, scale, window=None, tree_mask=None,
              layer=None, impl: str = "auto", interpret: bool = False, mesh=None, pages=None, k_scale=None,
              v_scale=None):
  """q[B,T,Hq,D] of the T new tokens, their keys and values k_new/v_new[B,T,Hkv,D], against the committed
  cache -> [B,T,Hq,D].

  k_cache/v_cache: [B, Hkv, S, D] (one layer) or the whole stack [L, B, Hkv, S, D] with `layer` (a traced int32)
  picking one: the kernels read the stack in place. Row b's committed slots are j < lengths[b] (slot index ==
  position); q_positions [B, T] are the new tokens' positions. New token t sees the committed slots and the new
  tokens t' <= t, or those with tree_mask[(b,) t, t'] (bool [T, T] or per row [B, T, T]: a token tree, whose
  positions are the root's + depth). `window` is None, an int, or a traced int32 scalar (per scanned layer); a
  value <= 0 means none. With a `mesh`, a Pallas kernel runs per shard (`shard_map`): Mosaic and Triton calls
  cannot be partitioned automatically. `pages` int32[B, P]: k_cache/v_cache are page pools [L, N, Hkv, block, D]
  read through this table (kernels that `reads_pages` only). k_scale/v_scale: an 8-bit cache's float32 scales
  (spec_jax/cache.py: one per token and KV head, `scale_layout`: [..., Hkv, S, X]); every kernel dequantizes with them,
  and the new tokens come in the activation dtype.
  """
  check_attention_args(q, k_new, v_new, k_cache, v_cache, q_positions, lengths, window, tree_mask, layer, pages)
  check_kv_scales(k_cache, v_cache, k_scale, v_scale)
  if pages is not None and not reads_pages(impl, k_cache.shape[-2]):
    raise ValueError(f"attention impl {impl!r} reads gathered caches, not a page table")
  impl = resolve_impl(impl)
  if impl.endswith(INTERPRET):
    impl, interpret = impl.removesuffix(INTERPRET), True
  if impl == "xla":
    if k_scale is not None:  # one layer's cache, dequantized (what KVCache.layer_view hands the XLA path)
      deq = lambda c, sc: (layer_of(c, layer).astype(jnp.float32)
                           * jnp.moveaxis(layer_of(sc, layer), -1, 0)[..., None]).astype(q.dtype)
      k_cache, v_cache, layer = deq(k_cache, k_scale), deq(v_cache, v_scale), None
    return attention_xla(q, k_new, v_new, k_cache, v_cache, q_positions, lengths, scale=scale, window=window,
                         tree_mask=tree_mask, layer=layer)
  if impl == "pallas_gpu":
    from spec_jax.kernels.pallas_gpu import attention_pallas_gpu as kernel  # lazy: heavy, only this path (Triton)
  else:
    from spec_jax.kernels.pallas_tpu import attention_pallas_tpu as kernel  # lazy: heavy, only this path (Mosaic)
  kernel = functools.partial(kernel, scale=scale, interpret=interpret)
  if mesh is not None:
    return per_shard(kernel, mesh, q, k_new, v_new, k_cache, v_cache, q_positions, lengths, window, tree_mask,
                     layer, pages, k_scale, v_scale)
  extra = {} if pages is None else {"pages": pages}
  if k_scale is not None:
    extra.update(k_scale=k_scale, v_scale=v_scale)
  return kernel(q, k_new, v_new, k_cache, v_cache, q_positions, lengths, window=window, tree_mask=tree_mask,
                layer=layer, **extra)


__all__ = ["attention", "attention_xla", "visibility", "resolve_impl", "reads_pages", "IMPLS"]
