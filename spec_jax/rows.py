"""Row and feature helpers below the loop, prefill and the proposers: writing one slot's row into batched arrays,
and the target features a proposer reads."""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp


def feature_layers(proposer) -> tuple:
  """The target layers (0-based) whose outputs a proposer reads as its features, side by side: EAGLE-3's low,
  middle and high layers. () = the target's final-normed hidden state, what the other proposers read."""
  return tuple(getattr(proposer, "feature_layers", ()) or ())


def target_features(hidden: jax.Array, layer_outputs: Optional[jax.Array]) -> jax.Array:
  """What the loop hands a proposer as `hidden`: the final-normed hidden [B, T, D], or with feature layers the
  layer outputs [n, B, T, D] (forward's return_layers) side by side as [B, T, n * D], layer-major."""
  if layer_outputs is None:
    return hidden
  n, B, T, D = layer_outputs.shape
  return jnp.moveaxis(layer_outputs, 0, 2).reshape(B, T, n * D)


def write_row(full: jax.Array, row: jax.Array, slot, axis: int = 0) -> jax.Array:
  """full with row (size 1 on `axis`) written at index `slot` (traced) of `axis`."""
  return jax.lax.dynamic_update_index_in_dim(full, row.astype(full.dtype), slot, axis)


def write_rows_tree(full, row, slot, axis: int = 0):
  """write_row over matching pytrees whose leaves all carry the batch on `axis`."""
  return jax.tree.map(lambda f, r: write_row(f, r, slot, axis), full, row)
