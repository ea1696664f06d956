"""Build a proposer (and its params) from a method name."""

from __future__ import annotations

from spec_jax.proposers.base import NoneProposer
from spec_jax.proposers.ngram import NgramProposer

METHODS = ("none", "ngram", "draft")


def build_proposer(method: str, *, target_config, target_params, k: int = 4, ngram_min: int = 1,
                   ngram_max: int = 3, draft_layers: int = 6, impl: str = "xla"):
  """-> (proposer, proposer_params)."""
  if method not in METHODS:
    raise ValueError(f"unknown method {method!r}; choose one of {METHODS}")
  if method == "none":
    return NoneProposer(), {}
  if k < 1:
    raise ValueError(f"num_speculative_tokens must be >= 1 for method {method!r}, got {k}")
  if method == "ngram":
    return NgramProposer(k=k, ngram_min=ngram_min, ngram_max=ngram_max), {}
  from spec_jax.proposers.draft import early_exit_proposer
  return early_exit_proposer(target_config, target_params, draft_layers, k, impl)
