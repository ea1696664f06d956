"""A body -> its `RequestSpec` (serve/engine/request_spec.py): the server's defaults for what the body leaves out,
the output budget, and the engine's checks, run once, each failure a 400 naming the body's field.

The route hands `request_spec` a validated body (serve/http/protocol.py's pydantic models: types and ranges), the
prompt's token ids, the server's defaults (`ServerDefaults`, from the flags) and what the engine allows
(`EngineLimits`, from `Engine.limits()`).
"""

from __future__ import annotations

import dataclasses
import secrets

from serve.engine.request_spec import EngineLimits, Logprobs, RequestSpec, Sampling, TokenControls, check
from serve.http.protocol import APIError


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
