"""One attention entry point for prefill, decode, verify and the cache-free forward; `impl` picks the kernel."""

from __future__ import annotations

import jax
import numpy as np

from spec_jax.kernels.reference import attention_mask, attention_xla, attention_xla_split

IMPLS = ("auto", "xla", "pallas_gpu", "pallas_tpu")
INTERPRET = ":interpret"  # "pallas_gpu:interpret" runs the kernel in Pallas interpret mode (CPU tests)


def resolve_impl(impl: str) -> str:
  if impl.removesuffix(INTERPRET) not in IMPLS or (impl.endswith(INTERPRET) and not impl.startswith("pallas")):
    raise ValueError(f"unknown attention impl {impl!r}; choose one of {IMPLS} (pallas ones may end in "
                     f"{INTERPRET!r})")
  if impl != "auto":
    return impl
  backend = jax.default_backend()
  return {"gpu": "pallas_gpu", "tpu": "pallas_tpu"}.get(backend, "xla")


def check_attention_args(q, k_cache, v_cache, q_positions, kv_lengths, window, tree_mask, k_new=None, v_new=None):
  """Shape checks at trace time, with errors that say which argument disagrees."""
  if q.ndim != 4 or k_cache.ndim != 4 or v_cache.ndim != 4:
    raise ValueError(f"q, k_cache, v_cache must be 4-D, got {q.shape}, {k_cache.shape}, {v_cache.shape}")
  B, T, Hq, D = q.shape
  if k_cache.shape != v_cache.shape:
    raise ValueError(f"k_cache {k_cache.shape} and v_cache {v_cache.shape} disagree")
  Bk, S, Hkv, Dk = k_cache.shape
  if Bk != B or Dk != D:
    raise ValueError(f"q {q.shape} and k_cache {k_cache.shape} disagree on batch or head_dim")
  if Hq % Hkv:
    raise ValueError(f"query heads {Hq} are not a multiple of kv heads {Hkv}")
  if q_positions.shape != (B, T):
    raise ValueError(f"q_positions must be [B, T] = {(B, T)}, got {q_positions.shape}")
  if kv_lengths.shape != (B,):
    raise ValueError(f"kv_lengths must be [B] = {(B,)}, got {kv_lengths.shape}")
  if tree_mask is not None and tuple(tree_mask.shape) not in ((T, T), (B, T, T)):
    raise ValueError(f"tree_mask must be [T, T] = {(T, T)} or per row [B, T, T] = {(B, T, T)}, got "
                     f"{tuple(tree_mask.shape)}")
  if (k_new is None) != (v_new is None):
    raise ValueError("k_new and v_new come together: pass both or neither")
  if k_new is not None:
    # Split form: the new tokens sit beside the cache (S may be 0) and are masked by their own positions.
    if k_new.shape != (B, T, Hkv, D) or v_new.shape != (B, T, Hkv, D):
      raise ValueError(f"k_new and v_new must be [B, T, Hkv, D] = {(B, T, Hkv, D)}, got {k_new.shape}, "
                       f"{v_new.shape}")
    return
  if T > S:
    raise ValueError(f"T={T} new tokens do not fit in a cache of {S} slots")
  # numpy ints count as static too (configs loaded from .npz/json often hold them); bools are not windows.
  if isinstance(window, (int, np.integer)) and not isinstance(window, bool) and window > 0 and T > window:
    raise ValueError(f"T={T} new tokens exceed the sliding window {window}")


def attention(q, k_cache, v_cache, q_positions, kv_lengths, *, scale, window=None, tree_mask=None, k_new=None,
              v_new=None, impl: str = "auto", interpret: bool = False):
  """q[B,T,Hq,D] against k/v_cache[B,S,Hkv,D] -> [B,T,Hq,D].

  `window` is None, an int, or a traced int32 scalar (per scanned layer); a value <= 0 means no window.
  `tree_mask` bool [T, T] or per row [B, T, T]: new token t sees new token t' iff tree_mask[(b,) t, t'] (the
  ancestors-or-self of a tree node; its q_position is then the root's position + its depth).
  Contract form: the T new tokens are already in the cache, at slots kv_lengths[b]-T ... Split form, with
  k_new/v_new [B,T,Hkv,D]: they are passed beside the cache instead, whose committed slots are < kv_lengths[b]-T
  (see reference.attention_xla_split); only the XLA implementation has it.
  """
  check_attention_args(q, k_cache, v_cache, q_positions, kv_lengths, window, tree_mask, k_new, v_new)
  impl = resolve_impl(impl)
  if impl.endswith(INTERPRET):
    impl, interpret = impl.removesuffix(INTERPRET), True
  if k_new is not None:
    if impl != "xla":
      raise ValueError(f"the split form (k_new/v_new) has only the 'xla' implementation, not {impl!r}")
    return attention_xla_split(q, k_cache, v_cache, k_new, v_new, q_positions, kv_lengths, scale=scale,
                               window=window, tree_mask=tree_mask)
  if impl == "xla":
    return attention_xla(q, k_cache, v_cache, q_positions, kv_lengths, scale=scale, window=window,
                         tree_mask=tree_mask)
  if impl == "pallas_gpu":
    from spec_jax.kernels.pallas_gpu import attention_pallas_gpu
    return attention_pallas_gpu(q, k_cache, v_cache, q_positions, kv_lengths, scale=scale, window=window,
                                tree_mask=tree_mask, interpret=interpret)
  from spec_jax.kernels.pallas_tpu import attention_pallas_tpu
  return attention_pallas_tpu(q, k_cache, v_cache, q_positions, kv_lengths, scale=scale, window=window,
                              tree_mask=tree_mask, interpret=interpret)


__all__ = ["attention", "attention_xla", "attention_mask", "resolve_impl", "IMPLS"]
