"""A proposer as a user adds one: this file alone, registered when imported (`--plugins=tests.proposers.toy_repeat`).

"repeat" drafts k copies of the last committed token: right on runs of one token, wrong elsewhere, so a test sees
both accepted and rejected drafts, and speculation must stay lossless either way."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from spec_jax.proposers.base import Draft, Stateless
from spec_jax.proposers.registry import Method, register


@dataclasses.dataclass(frozen=True)
class RepeatProposer(Stateless):
  k: int = 4
  name: str = "repeat"

  def propose(self, params, state, ctx, k, key):
    last = jnp.take_along_axis(ctx.tokens, (ctx.lengths - 1)[:, None], axis=1)  # [B, 1]
    return Draft(tokens=jnp.broadcast_to(last, (last.shape[0], k)).astype(jnp.int32)), state


register("repeat", Method(lambda a: (RepeatProposer(k=a.k), {})))
