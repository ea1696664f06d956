"""Grammar-forced drafts alone: a proposer that proposes nothing itself, so the only drafts are the tokens a row's
grammar forces (spec_jax/grammar/rows.py `forced_chain` fills them in before verification). Rows without a grammar
draft nothing. Registered as method "grammar" when imported (`--plugins=spec_jax.proposers.grammar_only`): the
structured-outputs benchmark's arm (benchmarks/structured.py), not a built-in method."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from spec_jax.proposers.base import Draft, Stateless
from spec_jax.proposers.registry import METHODS, Method, register


@dataclasses.dataclass(frozen=True)
class GrammarOnlyProposer(Stateless):
  k: int = 4
  name: str = "grammar"

  def propose(self, params, state, ctx, k, key):
    return Draft(tokens=jnp.full((ctx.tokens.shape[0], k), -1, jnp.int32)), state


if "grammar" not in METHODS:
  register("grammar", Method(lambda a: (GrammarOnlyProposer(k=a.k), {})))
