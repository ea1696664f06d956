"""One attention entry point for prefill, decode and verify; `impl` picks the kernel."""

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


def check_attention_args(q, k_cache, v_cache, q_positions, kv_lengths, window, tree_mask):
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
  if T > S:
    raise ValueError(f"T={T} new tokens do not fit in a cache of {S} slots")
  # numpy ints count as static too (configs loaded from .npz/json often hold them); bools are not windows.
  if isinstance(window, (int, np.integer)) and not isinstance(window, bool) and window > 0 and T > window:
    raise ValueError(f"T={T} new tokens exceed the sliding window {window}")
  if tree_mask is not None and tuple(tree_mask.shape) != (T, T):
    raise ValueError(f"tree_mask must be [T, T] = {(T, T)}, got {tuple(tree_mask.shape)}")


def attention(q, k_cache, v_cache, q_positions, kv_lengths, *, scale, window=None, tree_mask=None,
              impl: str = "auto", interpret: bool = False):
  """q[B,T,Hq,D] against k/v_cache[B,S,Hkv,D] -> [B,T,Hq,D].

  `window` is None, an int, or a traced int32 scalar (per scanned layer); a value <= 0 means no window.
  """
  check_attention_args(q, k_cache, v_cache, q_positions, kv_lengths, window, tree_mask)
  impl = resolve_impl(impl)
  if impl.endswith(INTERPRET):
    impl, interpret = impl.removesuffix(INTERPRET), True
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


__all__ = ["attention", "attention_xla", "attention_xla_split", "attention_mask", "resolve_impl", "IMPLS"]
