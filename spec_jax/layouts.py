"""Physical layouts of parameters on the accelerator: the attention projections stored heads-major.

The Q/K/V projections are [..., embed, heads, head_dim] (models/schema.py), by default laid out row-major. A
verify (T > 1 positions) or a prefill reads each head's [embed, head_dim] matrix on XLA:TPU's matrix unit, which
wants that matrix contiguous: heads major to embed. Given the row-major weight, XLA re-lays out the whole
stacked weight once per program call, outside the decode loop (issue 48: `copy` of bf16[32, 4096, 4, 128], 268 MB a
chip, 0.66 ms of the Llama-3 8B k = 4 step on v5e-8 `model:8`). Placed heads-major once, at load, no program
copies it: the layout is the array's, and jit compiles for the layout of the committed arrays it is given.
Values and shapes are unchanged, so every program computes the same numbers.

Only on TPU, where the copy was seen; CPU and GPU keep the row-major placement their timings were taken with.
"""

from __future__ import annotations

from typing import Optional, Sequence

import jax
import jax.numpy as jnp
from jax.experimental.layout import Format, Layout

from spec_jax.param_axes import leaf_name, param_axes

HEADS_MAJOR_PLATFORMS = ("tpu",)
_HEADS = ("heads", "kv_heads")


def heads_major(name: str, ndim: int) -> Optional[tuple]:
  """major_to_minor of a [..., embed, heads, head_dim] parameter placed heads-major (its heads before its embed
  axis); None for every other parameter (default layout)."""
  axes = param_axes(name, ndim)
  if ndim < 3 or axes[-3] != "embed" or axes[-2] not in _HEADS or axes[-1] != "head_dim":
    return None
  return tuple(range(ndim - 3)) + (ndim - 2, ndim - 3, ndim - 1)


def _platform(x) -> str:
  sharding = getattr(x, "sharding", None)
  devices = getattr(sharding, "device_set", None) if sharding is not None else None
  return next(iter(devices)).platform if devices else ""


def _wanted(path, x, platforms):
  """The heads-major Layout for one leaf, or None (other parameters, other platforms, quantized weights)."""
  if not hasattr(x, "shape") or not hasattr(x, "dtype") or not jnp.issubdtype(x.dtype, jnp.floating):
    return None
  order = heads_major(leaf_name(path), len(x.shape))
  if order is None or _platform(x) not in platforms:
    return None
  return Layout(major_to_minor=order)


def lay_out(params, platforms: Sequence[str] = HEADS_MAJOR_PLATFORMS):
  """Placed parameters -> the same values with the attention projections heads-major on the given platforms
  (an on-device relayout, once). A leaf already so laid out is kept; abstract leaves (jax.ShapeDtypeStruct with a
  sharding) get the layout in their sharding, as serve.aot compiles them."""

  def one(path, x):
    layout = _wanted(path, x, platforms)
    if layout is None:
      return x
    if isinstance(x, jax.ShapeDtypeStruct):
      return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=Format(layout, x.sharding))
    if getattr(getattr(getattr(x, "format", None), "layout", None), "major_to_minor", None) == \
        layout.major_to_minor:
      return x
    return jax.device_put(x, Format(layout, x.sharding))

  return jax.tree_util.tree_map_with_path(one, params)
