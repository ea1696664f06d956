"""A planted slow proposer for the live A/B tests (`--plugins=tests.proposers.toy_slow`): "slow_repeat" drafts as
"repeat" does (k copies of the last token: nearly all accepted on the tiny test model's greedy runs of one token,
nearly none on its sampled text) and burns a fixed amount of compute per draft, so speculation wins on greedy
traffic and loses on sampled traffic, and the live report must tell them apart."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from spec_jax.proposers.registry import Method, register
from tests.proposers.toy_repeat import RepeatProposer

BURN_MATMULS = 2  # 256 x 256 matmuls per propose(): about the tiny model's whole step on CPU


@dataclasses.dataclass(frozen=True)
class SlowRepeatProposer(RepeatProposer):
  name: str = "slow_repeat"

  def propose(self, params, state, ctx, k, key):
    draft, state = super().propose(params, state, ctx, k, key)
    seed = jnp.sum(ctx.lengths).astype(jnp.float32)  # depends on the state: XLA cannot fold the burn away
    m = jnp.full((256, 256), 1.0 / 256, jnp.float32) + seed * 1e-9
    burnt = jax.lax.fori_loop(0, BURN_MATMULS, lambda _, x: jnp.tanh(x @ m), m)
    bump = (jnp.sum(burnt) > 1e30).astype(jnp.int32)  # never true; keeps the burn live
    return draft.replace(tokens=draft.tokens + bump), state


register("slow_repeat", Method(lambda a: (SlowRepeatProposer(k=a.k), {})))
