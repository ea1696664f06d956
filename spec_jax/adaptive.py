"""Adaptive speculation: pick how many tokens to draft this step from a small static set.

Each row keeps a smoothed per-token acceptance estimate alpha. Drafting k tokens yields, in expectation,
E_k = 1 + alpha + ... + alpha^k tokens per step and costs c_k (a k-draft step's time over a plain 1-token
step at the current occupancy). The step drafts the k that maximizes mean_rows(E_k) / c_k. When that is 0, no
acceptance is observed, so every `probe_every` steps a step drafts anyway (the smallest non-zero k): when the
text turns copy-heavy again, speculation comes back.

The costs are an input, never measured here: a table [occupancy, option] that `python -m serve.calibrate`
measures and writes to a file (row a - 1 is the cost with a busy slots). Drafting pays less as the batch fills
(the target step becomes compute-bound), so with a measured table the controller lowers k at high occupancy.
The default model (1 + 0.25 k at every occupancy) keeps runs reproducible without a calibration file.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

EMA = 0.3  # weight of the newest observation
PRIOR_ALPHA = 0.5


@struct.dataclass
class AdaptState:
  """alpha float32[B] smoothed per-token acceptance; costs float32[B, n] relative step cost per option at each
  occupancy (row a - 1: a busy slots; costs[:, 0] for the smallest k); since_probe int32[] steps since a drafting
  step; uses int32[n] steps taken with each option."""

  alpha: jax.Array
  costs: jax.Array
  since_probe: jax.Array
  uses: jax.Array

  @classmethod
  def init(cls, batch: int, costs) -> "AdaptState":
    """costs: [n] (the same at every occupancy) or [batch, n]."""
    costs = jnp.asarray(costs, jnp.float32)
    costs = jnp.broadcast_to(costs if costs.ndim == 2 else costs[None], (batch, costs.shape[-1]))
    return cls(jnp.full((batch,), PRIOR_ALPHA, jnp.float32), costs, jnp.zeros((), jnp.int32),
               jnp.zeros(costs.shape[-1:], jnp.int32))

  def reset_row(self, slot) -> "AdaptState":
    """A new request in slot `slot` starts from the prior."""
    return self.replace(alpha=self.alpha.at[slot].set(PRIOR_ALPHA))


def default_costs(ks: tuple) -> list:
  """The cost model without a calibration: each drafted token costs a quarter of a plain step."""
  return [1.0 + 0.25 * k for k in ks]


def expected_tokens(alpha, k: int):
  """1 + alpha + ... + alpha^k, stable at alpha = 1."""
  return sum(alpha ** j for j in range(k + 1))


def choose(adapt: AdaptState, active, drafting, ks: tuple, probe_every: int):
  """-> index into ks. active bool[B]: rows that step; drafting bool[B]: the active rows that may be drafted for
  (speculation on for the request and globally). Rows that may not draft gain nothing from a draft."""
  n_active = jnp.maximum(active.sum(), 1)
  costs = adapt.costs[jnp.clip(n_active - 1, 0, adapt.costs.shape[0] - 1)]
  w = drafting.astype(jnp.float32)
  gains = jnp.stack([((expected_tokens(adapt.alpha, k) - 1.0) * w).sum() / n_active + 1.0 for k in ks]) / costs
  best = jnp.argmax(gains).astype(jnp.int32)
  if ks[0] != 0:  # no k = 0 option to fall back to
    return best
  probe = (best == 0) & (adapt.since_probe >= probe_every)
  return jnp.where(drafting.any(), jnp.where(probe, 1, best), 0).astype(jnp.int32)


def observe(adapt: AdaptState, option: int, k: int, active, num_accepted) -> AdaptState:
  """Fold one step's outcome in: option index used, k drafted, accepted count per row; only `active` rows
  (those that were drafted for) learn."""
  uses = adapt.uses.at[option].add(1)
  if k == 0:
    return adapt.replace(since_probe=adapt.since_probe + 1, uses=uses)
  n = num_accepted.astype(jnp.float32)
  rejected = (num_accepted < k).astype(jnp.float32)
  obs = n / jnp.maximum(n + rejected, 1.0)  # all k accepted: no rejection seen, obs = 1
  alpha = jnp.where(active, (1 - EMA) * adapt.alpha + EMA * obs, adapt.alpha)
  return adapt.replace(alpha=alpha, since_probe=jnp.zeros((), jnp.int32), uses=uses)


def option_set(k: int, adaptive: bool, tree=None) -> tuple:
  """The static k choices: {0, k/2, k} when adaptive, else {k}. A tree proposer's k is its tree's depth, and
  the choice is the tree or plain decoding: {0, k}."""
  if k == 0:
    return (0,)
  if not adaptive:
    return (k,)
  if tree is not None:
    return (0, k)
  return tuple(sorted({0, max(1, k // 2), k}))
