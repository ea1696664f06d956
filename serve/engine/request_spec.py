"""A request as the engine takes it: one frozen `RequestSpec` with named fields, and `check`, the checks that need
what the engine allows (`EngineLimits`, a value `Engine.limits()` returns), each a ValueError naming its field.

The HTTP layer builds the spec from a body and runs `check` once (serve/http/body_to_spec.py: a 400 naming the
field); `Engine.make_request(spec)` then builds the device request (the checks it runs are the library's own, kept
for direct callers). Segments and the live A/B read the spec's named fields.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional

from spec_jax import controls as token_controls
from spec_jax import logprobs as lps
from spec_jax.config import validate_sampling


@dataclasses.dataclass(frozen=True)
class EngineLimits:
  """What a request is checked against, from the engine (Engine.limits())."""
  vocab_size: int
  capacity: int  # tokens per slot: the context
  lookahead: int  # cache writes a verify step makes past the committed tokens
  max_logprobs: int  # --max_logprobs
  stop_ids: tuple  # the model's stop tokens (the grammar compiler ends a match on them)
  structured: bool  # the slots hold grammar rows (--grammar_capacity)
  pool_room: Optional[Callable[[int], int]] = None  # prompt length -> the most new tokens the KV pool ever holds
  pool_check: Optional[Callable[[int, int], None]] = None  # (prompt length, max_new) -> ValueError if it never fits

  def max_new_for(self, prompt_len: int) -> int:
    """The most tokens a request of prompt_len may generate: the context's room after the prompt and the
    speculative lookahead, and what the KV pool could ever give it."""
    room = self.capacity - prompt_len - self.lookahead - 1
    return min(room, self.pool_room(prompt_len)) if self.pool_room is not None else room


@dataclasses.dataclass(frozen=True)
class Sampling:
  temperature: float = 0.0  # 0: greedy
  top_k: int = 0  # 0: off
  top_p: float = 1.0  # 1: off
  seed: int = 0


@dataclasses.dataclass(frozen=True)
class TokenControls:
  """Penalties and token constraints (spec_jax/controls.py). logit_bias: (token id as sent, bias) pairs."""
  presence: float = 0.0
  frequency: float = 0.0
  repetition: float = 1.0
  min_p: float = 0.0
  min_tokens: int = 0
  ignore_eos: bool = False
  logit_bias: tuple = ()
  stop_token_ids: tuple = ()

  def kwargs(self) -> dict:
    """Controls.make's and controls.validate's keyword arguments."""
    return dict(presence=self.presence, frequency=self.frequency, repetition=self.repetition, min_p=self.min_p,
                min_tokens=self.min_tokens, ignore_eos=self.ignore_eos, logit_bias=dict(self.logit_bias) or None,
                stop_token_ids=self.stop_token_ids)


@dataclasses.dataclass(frozen=True)
class Logprobs:
  top: int = -1  # top logprobs per generated token (-1: none, 0: the token's own only)
  mode: str = "raw_logprobs"  # or processed_logprobs (spec_jax/logprobs.py)


@dataclasses.dataclass(frozen=True)
class RequestSpec:
  """One choice's request, as the engine takes it."""
  prompt_ids: tuple
  max_new: int  # the output budget (max_tokens, max_completion_tokens or the default)
  sampling: Sampling = Sampling()
  controls: TokenControls = TokenControls()
  stop: tuple = ()  # stop strings
  logprobs: Logprobs = Logprobs()
  grammar: Any = None  # a compiled automaton (spec_jax/grammar) the output must match, or None
  speculate: bool = True  # extra_body speculate: false drafts nothing
  tenant: str = ""  # whose shared history it may draft from (serve/engine/tenants.py), the prefix cache's salt too
  tag: str = ""  # the traffic tag a speculative policy rule matches (extra_body segment, or "structured")
  cache_salt: Optional[str] = None  # vLLM's: part of the prefix cache's salt


def check(spec: RequestSpec, limits: EngineLimits) -> None:
  """The checks that need the engine's limits (ValueError naming the field: a 400). spec_jax's constructors
  (Controls.make, slots.make_request) and Engine.make_request keep theirs for direct callers."""
  ctl = {k: v for k, v in spec.controls.kwargs().items() if k != "ignore_eos"}  # a bool: nothing to check
  token_controls.validate(**ctl, vocab_size=limits.vocab_size)
  if spec.controls.min_tokens > spec.max_new:
    raise ValueError(f"min_tokens ({spec.controls.min_tokens}) is over the output budget ({spec.max_new})")
  validate_sampling(spec.sampling.temperature, spec.sampling.top_k, spec.sampling.top_p)
  lps.check(spec.logprobs.top, spec.logprobs.mode, limits.max_logprobs)
  if limits.pool_check is not None:
    limits.pool_check(len(spec.prompt_ids), spec.max_new)
