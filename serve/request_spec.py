"""A request body as the engine takes it: one frozen `RequestSpec` with named fields, built and checked once, here.

The route hands `request_spec` a validated body (serve/protocol.py's pydantic models: types and ranges), the
prompt's token ids, the server's defaults (`ServerDefaults`, from the flags) and what the engine allows
(`EngineLimits`, a value `Engine.limits()` returns). Every check that needs those values runs here, once, with a
400 that names the field; `Engine.make_request(spec)` then builds the device request (the checks it runs are the
library's own, kept for direct callers). Segments and the live A/B read the spec's named fields.
"""

from __future__ import annotations

import dataclasses
import secrets
from typing import Any, Callable, Optional

from serve.protocol import APIError
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
class ServerDefaults:
  """What a body leaves out (the server's flags)."""
  temperature: float = 0.0
  top_k: int = 0
  top_p: float = 1.0
  default_max_tokens: int = 0  # > 0 caps a request without max_tokens
  logprobs_mode: str = "raw_logprobs"

  @classmethod
  def of(cls, cfg: dict) -> "ServerDefaults":
    return cls(temperature=cfg["temperature"], top_k=cfg["top_k"], top_p=cfg["top_p"],
               default_max_tokens=cfg.get("default_max_tokens") or 0,
               logprobs_mode=cfg.get("logprobs_mode", "raw_logprobs"))


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
  tenant: str = ""  # whose shared history it may draft from (serve/tenants.py), the prefix cache's salt too
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


def budget(body, prompt_len: int, limits: EngineLimits, defaults: ServerDefaults) -> tuple[int, str]:
  """The output budget and the field it came from: the body's (a 400 when the context has no room for it), or up
  to the end of the context (capped by --default_max_tokens), as OpenAI and vLLM do."""
  max_tokens, field = body.token_budget()
  room = limits.capacity - prompt_len - limits.lookahead - 1
  if max_tokens is None:
    fits = limits.max_new_for(prompt_len)
    max_tokens = min(defaults.default_max_tokens, fits) if defaults.default_max_tokens > 0 else fits
    if max_tokens < 1:
      raise APIError(400, f"the prompt ({prompt_len} tokens) leaves no room in the context of "
                     f"{limits.capacity} tokens", "prompt")
  elif max_tokens > room:
    raise APIError(400, f"{field}={max_tokens} is over the limit: the prompt has {prompt_len} tokens, the context "
                   f"{limits.capacity} (speculation needs {limits.lookahead + 1} more), so at most {max(room, 0)}",
                   field)
  return max_tokens, field


def request_spec(body, prompt_ids: list, limits: EngineLimits, defaults: ServerDefaults, *, tenant: str,
                 sample: int = 0, top: int = -1, grammar=None) -> RequestSpec:
  """The body's choice number `sample` of the prompt -> its spec, checked (a 400 naming the field). top: the top
  logprobs it returns per token; grammar: the compiled automaton of the body's structured output, or None."""
  max_new, budget_field = budget(body, len(prompt_ids), limits, defaults)
  top_k = body.top_k if body.top_k is not None else defaults.top_k
  spec = RequestSpec(
      prompt_ids=tuple(prompt_ids), max_new=max_new,
      sampling=Sampling(temperature=body.temperature if body.temperature is not None else defaults.temperature,
                        top_k=0 if top_k == -1 else top_k,
                        top_p=body.top_p if body.top_p is not None else defaults.top_p,
                        seed=(body.seed + sample) % (1 << 31) if body.seed is not None else secrets.randbits(31)),
      controls=TokenControls(presence=body.presence_penalty or 0.0, frequency=body.frequency_penalty or 0.0,
                             repetition=body.repetition_penalty if body.repetition_penalty is not None else 1.0,
                             min_p=body.min_p or 0.0, min_tokens=body.min_tokens or 0,
                             ignore_eos=bool(body.ignore_eos), logit_bias=tuple((body.logit_bias or {}).items()),
                             stop_token_ids=tuple(body.stop_token_ids or ())),
      stop=tuple(body.stop_list()), logprobs=Logprobs(top, defaults.logprobs_mode), grammar=grammar,
      speculate=body.speculate is not False, tenant=tenant, cache_salt=body.cache_salt,
      tag=body.segment or ("structured" if grammar is not None else ""))  # the policy's "structured" segment
  try:
    check(spec, limits)
  except ValueError as e:
    raise as_400(e, budget_field)
  return spec


def as_400(e: ValueError, budget_field: str = "max_tokens") -> APIError:
  """A check's ValueError as the 400 that names its field (`e.field`; a budget error names the body's)."""
  field = getattr(e, "field", None)
  return APIError(400, str(e), budget_field if field == "max_tokens" else field)
