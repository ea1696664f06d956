"""A request as the engine sees it, and its hand-over: its row of each snapshot becomes tokens, text (cut at stop
strings, serve/engine/output_stream.py), metrics and, at the end, its finish or its error. Engine thread only, but for
`aborted`, which the HTTP layer sets when the client goes away. `RequestMaker` builds them from a `RequestSpec` (for
`Engine.make_request`) and says what a spec is checked against (`Engine.limits`)."""

from __future__ import annotations

import dataclasses
import functools
import itertools
import time
from typing import Any, Callable, Optional

import numpy as np

from serve.engine.metrics import Metrics
from serve.engine.output_stream import Output, TextStream, Usage
from serve.engine.request_spec import EngineLimits, RequestSpec
from spec_jax import slots
from spec_jax.controls import Controls
from spec_jax.decode import FINISH_NAMES

# the loop's finish reasons as OpenAI names them
FINISH_REASONS = {"stop": "stop", "length": "length", "capacity": "length", "abort": "abort"}


@dataclasses.dataclass(eq=False)
class EngineRequest:
  """A request as the engine sees it. The fields below `output` are the engine thread's own."""

  id: str
  prompt_ids: list
  device_req: slots.Request
  stop: tuple
  output: Output
  arrival: float
  deadline: Optional[float]
  speculate: bool = True
  tenant: str = ""  # whose shared history it may draft from (serve/engine/tenants.py)
  spec: Optional[RequestSpec] = None  # what it was made from: the policy and the canary read its fields
  segment: str = "default"  # its rule of the speculative config's policy (set at admission)
  policy_k: int = 0  # that rule's draft cap
  canary: Optional[bool] = None  # in the canary arm (None: no canary)
  canary_segment: str = ""  # the canary policy's rule for it, whichever arm it is in
  arms: set = dataclasses.field(default_factory=set)  # switchback arms its tokens came from
  failed: bool = False
  ended_counted: bool = False
  tenant_id: int = -1
  aborted: bool = False  # set by the HTTP layer (client gone)
  slot: int = -1
  finished: bool = False
  admitted_at: Optional[float] = None
  first_at: Optional[float] = None
  last_at: Optional[float] = None
  n_tokens: int = 0  # tokens taken from the row (stop token included)
  stream: Optional[TextStream] = None  # set when the request takes a slot
  drafted: int = 0
  accepted: int = 0
  drafts: int = 0
  steps: int = 0
  accepted_at: Optional[np.ndarray] = None
  accepted_from_history: int = 0
  logprobs: int = -1  # top logprobs per token it asked for (-1: none; spec_jax/logprobs.py)
  # The paged KV pool (serve/engine/kv_scheduler.py): a resume after preemption rebuilds the device request.
  remake: Optional[Callable] = None  # slots.make_request with this request's settings, but prompt and max_new
  max_new: int = 0
  cached_tokens: int = 0  # prompt tokens found in the prefix cache at its first admission (usage's cached_tokens)
  cache_salt: Optional[str] = None  # vLLM's: part of the prefix cache's salt, with the tenant
  out_ids: list = dataclasses.field(default_factory=list)  # the token ids handed over so far
  admissions: int = 0
  admit_seq: int = 0  # the engine's admission count when it was last admitted: the preemption order
  kv_key: Any = None  # its id in the block manager while it holds pages
  kv_slot: Any = None  # the free slot of the data shard its pages were placed on (serve/engine/kv_scheduler.py)
  kv_len: int = 0  # tokens with K/V at the last snapshot read
  inflight: list = dataclasses.field(default_factory=list)  # tokens of pages each dispatched, unread call needs
  prior: tuple = (0, 0, 0)  # (drafted, accepted, drafts) of its rows before the last preemption

  def advance(self, arr, slot: int, now: float, itl: list, m: Metrics) -> tuple[int, int, int, int]:
    """Take this request's new tokens from its row of snapshot `arr`, ITL samples appended to `itl` ->
    (drafted, accepted, tokens, verify steps) increments."""
    steps = int(arr.steps[slot])
    ds, self.steps = steps - self.steps, steps
    n0 = self.n_tokens
    drafted, accepted = int(arr.drafted[slot]), int(arr.accepted[slot])
    drafts = int(arr.drafted_at[slot, 0]) if arr.drafted_at.shape[1] else 0
    acc_at = np.asarray(arr.accepted_at[slot], np.int64)[:len(self.accepted_at)]
    dd, da = drafted - self.drafted, accepted - self.accepted  # the row's counters are cumulative
    m.observe_drafts(dd, da, drafts - self.drafts, acc_at - self.accepted_at)
    self.drafted, self.accepted, self.drafts, self.accepted_at = drafted, accepted, drafts, acc_at.copy()
    from_hist = int(arr.accepted_from_history[slot])
    if from_hist > self.accepted_from_history:
      m.accepted_from_history.inc(from_hist - self.accepted_from_history)
    self.accepted_from_history = from_hist

    start = int(arr.prompt_lens[slot]) + self.n_tokens
    new = arr.tokens[slot, start:int(arr.lengths[slot])].tolist()
    done = bool(arr.done[slot])
    reason = FINISH_REASONS.get(FINISH_NAMES.get(int(arr.finish[slot])), "stop") if done else None
    if new:
      lp = None
      if self.logprobs >= 0:  # (logprob, top ids, top values) per new token, from the same snapshot
        at = range(start, start + len(new))
        lp = [(float(arr.lp_chosen[slot, s]), arr.lp_top_ids[slot, s, :self.logprobs].tolist(),
               arr.lp_top_vals[slot, s, :self.logprobs].tolist()) for s in at]
      self._deliver(new, now, itl, m, ends_with_stop_token=(reason == "stop"), logprobs=lp)
    if done and not self.finished:
      self.finish(reason, now, m)
    return dd, da, self.n_tokens - n0, ds

  def _deliver(self, ids: list, now: float, itl: list, m: Metrics, ends_with_stop_token: bool,
               logprobs=None) -> None:
    n = len(ids)
    if self.first_at is None:
      self.first_at = now
      m.ttft.observe(now - self.arrival)
    else:
      gap = (now - self.last_at) / n
      for _ in range(n):
        m.itl.observe(gap)
      itl.extend([gap] * n)
    self.last_at = now
    m.generation_tokens.inc(n)
    text_ids = ids[:-1] if ends_with_stop_token else ids
    taken = self.stream.push(ids, text_ids, logprobs)
    self.n_tokens += taken
    self.out_ids.extend(ids[:taken])
    if taken < n:  # a stop string ended the text
      self.finish("stop", now, m, flush=False)

  def finish(self, reason: str, now: float, m: Metrics, flush: bool = True) -> None:
    if self.finished:
      return
    self.finished = True
    tail = self.stream.flush() if flush and self.stream is not None else ""
    m.finished.labels(finished_reason=reason).inc()
    m.observe_request_end(self, now)
    m.e2e.observe(now - self.arrival)
    if self.first_at is not None and self.n_tokens > 1:
      m.tpot.observe((self.last_at - self.first_at) / (self.n_tokens - 1))
    self.output.put(tail, (), finish_reason=reason, usage=self.usage())

  def fail(self, status: int, kind: str, message: str, m: Metrics) -> None:
    if self.finished:
      return
    self.finished = self.failed = True
    m.errors.labels(kind=kind).inc()
    self.output.put(error=(status, kind, message), usage=self.usage())

  def resumed(self) -> None:
    """Re-admitted after a preemption (its old row's last snapshot read): the new row's counters start from
    zero, so keep the old one's totals."""
    d, a, n = self.prior
    self.prior = (d + self.drafted, a + self.accepted, n + self.drafts)
    self.steps = self.drafted = self.accepted = self.drafts = self.accepted_from_history = 0
    self.accepted_at = np.zeros_like(self.accepted_at)

  def usage(self) -> Usage:
    d, a, n = self.prior
    return Usage(prompt_tokens=len(self.prompt_ids), completion_tokens=self.n_tokens,
                 drafted_tokens=d + self.drafted, accepted_tokens=a + self.accepted, drafts=n + self.drafts,
                 cached_tokens=self.cached_tokens)


class RequestMaker:
  """The engine's requests from specs, and the limits a spec is checked against. spec_of: the loop's current
  LoopSpec; kv: the KV scheduler (serve/engine/kv_scheduler.py), None: fixed slots. Owns the request ids."""

  def __init__(self, *, spec_of: Callable, capacity: int, block_size: int, grammar_capacity, kv,
               request_timeout_s: float):
    self.spec_of, self.capacity, self.block_size = spec_of, capacity, block_size
    self.grammar_capacity = grammar_capacity
    self.kv, self.request_timeout_s = kv, request_timeout_s
    self._ids = itertools.count()

  @property
  def spec(self):
    return self.spec_of()

  def make_request(self, spec: RequestSpec, output: Output | None = None) -> EngineRequest:
    """The engine's request for a spec (serve/engine/request_spec.py, which checked it against `limits()`); output: where
    its tokens go. The checks below are spec_jax's and the pool's own, for direct callers (a ValueError)."""
    s = spec.sampling
    make = functools.partial(slots.make_request, spec=self.spec, capacity=self.capacity, temperature=s.temperature,
                             top_k=s.top_k, top_p=s.top_p, draft_cap=None if spec.speculate else 0, seed=s.seed,
                             controls=Controls.make(1, vocab_size=self.spec.config.vocab_size,
                                                    **spec.controls.kwargs()),
                             logprobs=spec.logprobs.top, logprobs_mode=spec.logprobs.mode,
                             block_size=self.block_size, grammar=(spec.grammar, self.grammar_capacity))
    dev = make(list(spec.prompt_ids), max_new=spec.max_new)
    if self.kv is not None:
      self.kv.check_fits(len(spec.prompt_ids), spec.max_new)
    now, timeout = time.monotonic(), self.request_timeout_s
    return EngineRequest(id=f"req-{next(self._ids)}", prompt_ids=list(spec.prompt_ids), device_req=dev,
                         stop=tuple(x for x in spec.stop if x), output=output or Output(), arrival=now,
                         speculate=bool(spec.speculate), tenant=spec.tenant, logprobs=int(spec.logprobs.top),
                         spec=spec, deadline=now + timeout if timeout else None, remake=make,
                         max_new=int(spec.max_new), cache_salt=spec.cache_salt)

  def limits(self) -> EngineLimits:
    """What a request is checked against (serve/engine/request_spec.py)."""
    return EngineLimits(vocab_size=self.spec.config.vocab_size, capacity=self.capacity,
                        lookahead=self.spec.lookahead, max_logprobs=self.spec.max_logprobs,
                        stop_ids=tuple(self.spec.stop_ids), structured=self.grammar_capacity is not None,
                        pool_room=self.kv.max_new_ever if self.kv is not None else None,
                        pool_check=self.kv.check_fits if self.kv is not None else None)
