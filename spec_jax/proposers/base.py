"""The proposer protocol. Proposers are frozen dataclasses (static under jit); their state is a pytree.

  init(params, ctx)            -> state          after prefill
  propose(params, state, ctx, k, key) -> (Draft, state)
  update(params, state, result) -> state         after verify/commit

`params` is the proposer's own weights (an empty dict for model-free proposers). A draft token < 0 means
"nothing proposed here": the verifier never accepts it nor anything after it.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional, Protocol

import jax
from flax import struct


@struct.dataclass
class Draft:
  tokens: jax.Array  # int32[B, k]; < 0 where there is no proposal
  probs: Optional[jax.Array] = None  # float32[B, k, V] the drafter's sampling distribution; None: deterministic


@struct.dataclass
class ProposeContext:
  tokens: jax.Array  # int32[B, S] token buffer; row b's committed tokens are tokens[b, :lengths[b]]
  lengths: jax.Array  # int32[B]
  sampling: Any  # SamplingParams (drafters that sample use the target's settings)
  last_hidden: jax.Array  # [B, D] target's final hidden at the last token fed (predicts tokens[b, lengths-1])


@struct.dataclass
class VerifyResult:
  tokens: jax.Array  # int32[B, k+1] verifier output; the first `emitted[b]` were committed
  num_accepted: jax.Array  # int32[B] drafts accepted before cuts
  emitted: jax.Array  # int32[B] tokens committed this step (after EOS / max-token cuts; 0 for done rows)
  new_lengths: jax.Array  # int32[B] buffer lengths after commit
  hidden: jax.Array  # [B, k+1, D] target hidden states of the fed tokens (last committed + drafts)


class Proposer(Protocol):
  name: str
  k: int  # the largest number of tokens it drafts per step

  def init(self, params, ctx: ProposeContext): ...
  def propose(self, params, state, ctx: ProposeContext, k: int, key: jax.Array) -> tuple[Draft, Any]: ...
  def update(self, params, state, result: VerifyResult): ...


@dataclasses.dataclass(frozen=True)
class NoneProposer:
  """k = 0: plain decoding through the same loop."""

  name: str = "none"
  k: int = 0

  def init(self, params, ctx):
    return ()

  def propose(self, params, state, ctx, k, key):
    raise AssertionError("the none proposer is never asked for drafts")

  def update(self, params, state, result):
    return state
