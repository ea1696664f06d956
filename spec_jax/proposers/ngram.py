"""Prompt lookup: draft the continuation of the latest earlier match of the buffer's trailing n-gram."""

from __future__ import annotations

import dataclasses

from spec_jax.proposers.base import Draft, Stateless
from spec_jax.proposers.ngram_lookup import ngram_draft


@dataclasses.dataclass(frozen=True)
class NgramProposer(Stateless):
  k: int = 4
  ngram_min: int = 1
  ngram_max: int = 3
  name: str = "ngram"

  def __post_init__(self):
    if self.k < 1 or not (1 <= self.ngram_min <= self.ngram_max):
      raise ValueError(f"ngram needs k >= 1 and 1 <= ngram_min <= ngram_max, got k={self.k}, "
                       f"ngram_min={self.ngram_min}, ngram_max={self.ngram_max}")

  def propose(self, params, state, ctx, k, key):
    toks = ngram_draft(ctx.tokens, ctx.lengths, k=k, ngram_min=self.ngram_min, ngram_max=self.ngram_max)
    return Draft(tokens=toks), state
