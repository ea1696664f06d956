"""Adaptive speculation: pick how many tokens to draft this step from a small static set.

Each row keeps a smoothed per-token acceptance estimate alpha. Drafting k tokens yields, in expectation,
E_k = 1 + alpha + ... + alpha^k tokens per step and costs c_k (a k-draft step's time over a plain 1-token
step, measured at start-up). The step drafts the k that maximizes mean_rows(E_k) / c_k. When that is 0, no
acceptance is observed, so every `probe_every` steps a step drafts anyway (the smallest non-zero k): when the
text turns copy-heavy again, speculation comes back.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

EMA = 0.3  # weight of the newest observation
PRIOR_ALPHA = 0.5


@struct.dataclass
class AdaptState:
  alpha: jax.Array  # float32[B] smoothed per-token acceptance
  costs: jax.Array  # float32[n] relative step cost per option (costs[0] for the smallest k)
  since_probe: jax.Array  # int32 scalar: steps since a drafting step
  uses: jax.Array  # int32[n] steps taken with each option

  @classmethod
  def init(cls, batch: int, costs) -> "AdaptState":
    costs = jnp.asarray(costs, jnp.float32)
    return cls(jnp.full((batch,), PRIOR_ALPHA, jnp.float32), costs, jnp.zeros((), jnp.int32),
               jnp.zeros(costs.shape, jnp.int32))


def expected_tokens(alpha, k: int):
  """1 + alpha + ... + alpha^k, stable at alpha = 1."""
  return sum(alpha ** j for j in range(k + 1))


def choose(adapt: AdaptState, active, ks: tuple, probe_every: int):
  """-> index into ks."""
  w = active.astype(jnp.float32)
  n_active = jnp.maximum(w.sum(), 1.0)
  gains = jnp.stack([(expected_tokens(adapt.alpha, k) * w).sum() / n_active for k in ks]) / adapt.costs
  best = jnp.argmax(gains).astype(jnp.int32)
  if ks[0] != 0 or len(ks) == 1:
    return best
  probe = (best == 0) & (adapt.since_probe >= probe_every)
  return jnp.where(probe, 1, best).astype(jnp.int32)


def observe(adapt: AdaptState, option: int, k: int, active, num_accepted) -> AdaptState:
  """Fold one step's outcome in: option index used, k drafted, accepted count per row."""
  uses = adapt.uses.at[option].add(1)
  if k == 0:
    return adapt.replace(since_probe=adapt.since_probe + 1, uses=uses)
  n = num_accepted.astype(jnp.float32)
  rejected = (num_accepted < k).astype(jnp.float32)
  obs = n / jnp.maximum(n + rejected, 1.0)  # all k accepted: no rejection seen, obs = 1
  alpha = jnp.where(active, (1 - EMA) * adapt.alpha + EMA * obs, adapt.alpha)
  return adapt.replace(alpha=alpha, since_probe=jnp.zeros((), jnp.int32), uses=uses)


def option_set(k: int, adaptive: bool) -> tuple:
  """The static k choices: {0, k/2, k} when adaptive, else {k}."""
  if k == 0:
    return (0,)
  if not adaptive:
    return (k,)
  return tuple(sorted({0, max(1, k // 2), k}))
