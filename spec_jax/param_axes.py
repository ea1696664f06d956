"""Each parameter's logical axes, by its leaf name and rank: what the sharding table splits (spec_jax/sharding.py)
and what the placement lays out heads-major (spec_jax/layouts.py)."""

import re

from spec_jax.models import schema

# Parameter name -> logical axes of one layer's (or an unstacked) array; a stacked layer array has one more leading
# axis, "layers". The target's come from models/schema.py; the draft model and EAGLE's layer reuse those names.
# The proposers' own parameters:
_PROPOSER_AXES = {
    "rows": ("vocab", "embed"),  # a draft's output rows (d2t's), as the head's
    # EAGLE's input projection [2D, D] and EAGLE-3's feature fusion [3D, D]: split on their output features, each
    # chip computing whole dot products for its share (replicated, every chip read both whole: 431 MB a chip a
    # step on Llama-3 8B v5e-8, more than the head's layer). Their products are gathered back to the state
    # table's layout at once (eagle.layer_step), so no split reaches the loop's carry.
    "fc": ("embed", "features"), "fuse": ("embed", "features"),
    # Medusa's heads [K, D, D], [K, D] (K stacked like layers), split the same way (their bias stays whole): replicated,
    # every chip read all K each step (134 MB a chip on Llama-3 8B v5e-8, against 17 MB split). A published Medusa-1 head's
    # [K, NL, D, D] has another rank: it stays whole.
    "w": ("embed", "features"), "b": ("embed",),
}
PARAM_AXES = {**schema.AXES, **_PROPOSER_AXES}
_NORM = re.compile(r"norm$")  # the proposers' own norms (EAGLE's feat_norm, ...): ("embed",)


def param_axes(name: str, ndim: int) -> tuple:
  """Logical axes of a parameter from its leaf name and rank (unknown names: replicated)."""
  axes = PARAM_AXES.get(name, ("embed",) if _NORM.search(name) else None)
  if axes is None:
    return (None,) * ndim
  if ndim == len(axes) + 1:
    return ("layers",) + axes
  if ndim != len(axes):
    return (None,) * ndim
  return axes


def leaf_name(path) -> str:
  last = path[-1] if path else None
  return str(getattr(last, "key", getattr(last, "name", getattr(last, "idx", ""))))
