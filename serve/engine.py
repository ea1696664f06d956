"""The host scheduler: B decode slots, a bounded waiting queue, and one thread that loops insert -> decode -> stream.

JetStream's orchestrator shape over `spec_jax.slots`. Each iteration of the engine thread:
1. frees the slots of requests that finished, were aborted (client gone) or timed out (`slots.release`);
2. inserts waiting requests into free slots (`slots.insert`: prefill plus a write of that row);
3. dispatches `decode_loop` for up to `steps_per_sync` steps (one right after an insert, for TTFT) and a
   `snapshot` of its result;
4. reads the previous iteration's snapshot (its loop is done; the one just dispatched runs meanwhile, since JAX
   dispatch is asynchronous), and hands each request its new tokens: detokenized incrementally, cut at `stop`
   strings, merged into the request's `Output`.
The HTTP layer talks to the engine only through `submit`, `abort` and each request's `Output`; the engine never
waits for a client, so a slow client cannot stall the device loop. A snapshot remembers which request held each
slot when it was taken, so a slot refilled meanwhile is never confused with its previous request.

An exception in the engine fails the requests it touched (their outputs get an error; HTTP answers 500) and the
engine goes on: a failed insert fails its request, a failed decode fails every running request and starts from
a fresh state.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import logging
import threading
import time
from typing import Optional

import jax
import numpy as np

from serve.guardrails import Guardrails
from serve import timing_probe
from serve.metrics import Metrics
from serve.output_stream import Output, TextStream, Usage
from spec_jax import backend, sharding, slots
from spec_jax.decode import FINISH_NAMES, decode_loop
log = logging.getLogger("spec_jax.engine")
_FINISH = {"stop": "stop", "length": "length", "capacity": "length", "abort": "abort"}


class QueueFull(Exception):
  """The waiting queue is full: answer 429 with Retry-After."""


class EngineStopped(Exception):
  """The engine is draining or stopped: answer 503."""


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
  accepted_at: Optional[np.ndarray] = None


class Engine:
  """The scheduler thread over one `DecodeState` of `max_num_seqs` slots of `capacity` tokens."""

  def __init__(self, params, spec, tokenizer, *, max_num_seqs: int, capacity: int, max_queue: int = 64,
               steps_per_sync: int = 8, costs=None, spec_config=None, guardrails=None,
               request_timeout_s: float = 600.0, seed: int = 0, metrics: Optional[Metrics] = None,
               timing_probe_s: float = 10.0):
    if max_num_seqs < 1 or max_queue < 0 or steps_per_sync < 1:
      raise ValueError("max_num_seqs and steps_per_sync must be >= 1, max_queue >= 0")
    self.params, self.spec, self.tokenizer = params, spec, tokenizer
    self.B, self.capacity, self.max_queue, self.steps = max_num_seqs, capacity, max_queue, steps_per_sync
    self.costs, self.spec_config, self.seed = costs, spec_config, seed
    self.request_timeout_s = request_timeout_s
    self.metrics = metrics or Metrics(spec.k_max, timing_probe.device_memory() is not None)
    self.timing_probe_s = timing_probe_s  # 0: never probe the step time split
    self._next_probe = 0.0
    self._next_memory = 0.0
    self.metrics.slots_total.set(max_num_seqs)
    self.guard = Guardrails(guardrails, time.monotonic()) if guardrails is not None else None
    self._lock = threading.Condition()
    self._waiting: collections.deque = collections.deque()
    self._draining = False
    self._stop = False
    self._admin_on = True
    self._applied_on: Optional[bool] = None  # the flag the device state holds
    self._free: collections.deque = collections.deque(range(max_num_seqs))
    self._slot_req: dict = {}
    self._pending = None  # (snapshot, {slot: request}) of the loop dispatched last iteration
    self._last_uses = np.zeros(len(spec.ks), np.int64)
    self._ids = itertools.count()
    self._thread: Optional[threading.Thread] = None
    self.state = None
    self.iterations = 0

  # ------------------------------------------------------------------------------------------ HTTP-facing side

  def make_request(self, prompt_ids, *, max_new: int, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
                   speculate: bool = True, seed: int = 0, stop=(), output: Output | None = None,
                   timeout_s: Optional[float] = None) -> EngineRequest:
    """Validate and pad a request (ValueError with the reason: the server answers 400)."""
    dev = slots.make_request(list(prompt_ids), max_new=max_new, spec=self.spec, capacity=self.capacity,
                             temperature=temperature, top_k=top_k, top_p=top_p, speculate=speculate, seed=seed)
    now = time.monotonic()
    timeout = self.request_timeout_s if timeout_s is None else timeout_s
    return EngineRequest(id=f"req-{next(self._ids)}", prompt_ids=list(prompt_ids), device_req=dev,
                         stop=tuple(s for s in stop if s), output=output or Output(), arrival=now,
                         speculate=bool(speculate),
                         deadline=now + timeout if timeout else None)

  def submit(self, req: EngineRequest) -> None:
    with self._lock:
      if self._draining or self._stop:
        raise EngineStopped("the server is shutting down")
      if len(self._waiting) >= self.max_queue + len(self._free):  # max_queue waits beyond the free slots
        self.metrics.errors.labels(kind="overloaded").inc()
        raise QueueFull(f"all {self.B} slots are busy and the waiting queue is full ({self.max_queue} requests)")
      self._waiting.append(req)
      self.metrics.waiting.set(len(self._waiting))
      self._lock.notify()

  def abort(self, req: EngineRequest) -> None:
    """The client is gone: the request's slot is freed at the next iteration."""
    req.aborted = True
    with self._lock:
      self._lock.notify()

  def set_speculation(self, enabled: bool) -> None:
    """The admin switch. Off is sticky (guardrails cannot turn it back on); on hands control back to them."""
    with self._lock:
      if enabled == self._admin_on:
        return
      self._admin_on = enabled
      if enabled and self.guard is not None:
        self.guard.reset(time.monotonic())
      log.info("speculation %s (admin)", "on" if enabled else "off")
      self.metrics.speculation_switches.labels(enabled=str(enabled).lower(), reason="admin").inc()
      self._lock.notify()

  def status(self) -> dict:
    g = self.guard
    return {"admin_enabled": self._admin_on, "enabled": self._speculation_on(), "method": self.spec.proposer.name,
            "k_max": self.spec.k_max, "ks": list(self.spec.ks),
            "guardrails": None if g is None else {"mode": g.mode, "baseline_itl_p95_s": g.baseline_p95}}

  @property
  def draining(self) -> bool:
    return self._draining

  @property
  def alive(self) -> bool:
    return self._thread is not None and self._thread.is_alive()

  def counts(self) -> tuple[int, int]:
    """(running, waiting)."""
    with self._lock:
      return len(self._slot_req), len(self._waiting)

  # ---------------------------------------------------------------------------------------------- lifecycle

  def start(self, warmup_prompt_lens=(1,)) -> None:
    """Compile insert (one prompt bucket per length given), the loop, snapshot, release and the switch, then
    start the thread on a fresh state."""
    self.state = self._fresh_state()
    for n in warmup_prompt_lens:
      req = slots.make_request([self.spec.config.bos_id] * n, max_new=2, spec=self.spec, capacity=self.capacity)
      self.state = slots.insert(self.params, self.state, np.int32(0), req, self.spec)
    self.state = slots.set_speculation(self.state, False)
    self.state = slots.set_speculation(self.state, True)
    self.state = decode_loop(self.params, self.state, self.spec, np.int32(self.steps))
    if self.timing_probe_s > 0 and self.spec.k_max > 0:
      timing_probe.time_propose(self.params, self.state, self.spec)  # compile now, not under traffic
    snap = slots.snapshot(self.state)
    self.state = slots.release(self.state, np.int32(0))
    jax.block_until_ready((jax.device_get(snap), self.state))
    self.state = self._fresh_state()
    self._thread = threading.Thread(target=self._run, name="spec_jax-engine", daemon=True)
    self._thread.start()

  def begin_drain(self) -> None:
    """Refuse new requests from now on; running and waiting ones go on."""
    with self._lock:
      self._draining = True
      self._lock.notify()

  def shutdown(self, grace_s: float = 30.0) -> None:
    """Drain (up to `grace_s`), abort what is left, stop the thread."""
    self.begin_drain()
    end = time.monotonic() + grace_s
    while time.monotonic() < end and any(self.counts()):
      time.sleep(0.02)
    with self._lock:
      left = list(self._waiting) + list(self._slot_req.values())
    for r in left:
      r.aborted = True
    with self._lock:
      self._stop = True
      self._lock.notify()
    if self._thread is not None:
      self._thread.join(timeout=30)

  def _fresh_state(self):
    # On XLA:CPU a bfloat16 state of one row takes the slow 1-row dot path: it gets a second, never-used row.
    rows = sharding.pad_rows(backend.batch_rows(self.params["target"], self.B), self.spec.mesh)
    state = slots.empty_state(self.params, self.spec, batch=rows, capacity=self.capacity, costs=self.costs,
                              seed=self.seed)
    self._applied_on = None
    self._last_uses = np.zeros(len(self.spec.ks), np.int64)
    return state

  # ------------------------------------------------------------------------------------------- engine thread

  def _run(self) -> None:
    while True:
      with self._lock:
        if self._stop and not self._slot_req and self._pending is None:
          for r in self._waiting:
            self._finish(r, "abort", time.monotonic())
          self._waiting.clear()
          break
        if not self._waiting and not self._slot_req and self._pending is None and not self._stop:
          self._lock.wait(timeout=0.25)  # idle; wake now and then for guardrail timers
      try:
        self._iteration()
      except Exception as e:  # a bug in the scheduler itself: fail what is running, keep serving
        log.exception("engine iteration failed")
        self._device_failure(e)
      self.iterations += 1

  def _iteration(self) -> None:
    t0 = time.perf_counter()
    now = time.monotonic()
    self._tick_guardrails(now)
    self._reap(now)
    admitted = self._admit(now)
    snap = None
    if self._slot_req:
      self._apply_speculation()
      # Right after an insert, one step: the new request's first tokens go out after its prefill plus one step
      # rather than plus steps_per_sync steps (TTFT).
      steps = 1 if admitted else self.steps
      try:
        if self._probe_due(now):
          self._timed_loop(steps)
        else:
          self.state = decode_loop(self.params, self.state, self.spec, np.int32(steps))
        snap = (slots.snapshot(self.state), dict(self._slot_req))
      except Exception as e:
        log.exception("decode failed")
        self._device_failure(e)
    host = time.perf_counter() - t0
    pending, self._pending = self._pending, snap
    if pending is not None:
      host += self._process(*pending)
    self.metrics.host_time.observe(host)
    if self.metrics.device_memory is not None and now >= self._next_memory:
      self._next_memory = now + 1.0
      mem = timing_probe.device_memory()
      if mem is not None:
        self.metrics.device_memory.set(mem[0])
        self.metrics.device_memory_peak.set(mem[1])
    self.metrics.observe_occupancy(*self.counts())

  def _probe_due(self, now: float) -> bool:
    """Time this iteration? Only while some running request drafts (a k = 0 batch has no proposer time)."""
    if self.timing_probe_s <= 0 or now < self._next_probe or not self._applied_on:
      return False
    return any(r.speculate for r in self._slot_req.values())

  def _timed_loop(self, steps: int) -> None:
    """The iteration's loop call, timed alone, after one timed `propose` on the same state (timing_probe.py)."""
    jax.block_until_ready(self.state)  # the loop in flight
    step0 = int(self.state.step)
    t_prop = timing_probe.time_propose(self.params, self.state, self.spec)
    t0 = time.perf_counter()
    self.state = decode_loop(self.params, self.state, self.spec, np.int32(steps))
    ran = int(jax.block_until_ready(self.state).step) - step0
    t_step = (time.perf_counter() - t0) / max(ran, 1)
    self._next_probe = time.monotonic() + self.timing_probe_s
    if ran > 0:
      m = self.metrics
      m.proposer_time.inc(t_prop)
      m.step_time.inc(t_step)
      m.timing_probes.inc()

  def _speculation_on(self) -> bool:
    """Admin switch, guardrails and the per-concurrency band for the current occupancy."""
    on = self._admin_on and (self.guard is None or self.guard.speculation_on)
    if on and self.spec_config is not None and self._slot_req:
      on = self.spec_config.k_at(len(self._slot_req)) > 0
    return on and self.spec.k_max > 0

  def _apply_speculation(self) -> None:
    on = self._speculation_on()
    if on != self._applied_on:
      self.state = slots.set_speculation(self.state, on)
      self._applied_on = on
    self.metrics.speculation_enabled.set(1.0 if (self._admin_on and (self.guard is None or
                                                                     self.guard.speculation_on)) else 0.0)

  def _tick_guardrails(self, now: float) -> None:
    if self.guard is None or not self._admin_on or self.spec.k_max == 0:
      return
    with self._lock:  # the admin switch resets the guardrails from the HTTP thread
      event = self.guard.decide(now)
    if event is None:
      return
    enabled, reason = event
    if reason == "probe_passed":
      log.info("guardrails: probe passed, speculation stays on")
      return
    log.info("guardrails: speculation %s (%s)%s", "on" if enabled else "off", reason,
             f", baseline p95 ITL {self.guard.baseline_p95 * 1e3:.1f} ms" if self.guard.baseline_p95 else "")
    self.metrics.speculation_switches.labels(enabled=str(enabled).lower(), reason=reason).inc()
    if self.guard.baseline_p95 is not None:
      self.metrics.baseline_itl_p95.set(self.guard.baseline_p95)

  def _reap(self, now: float) -> None:
    """Free slots of finished, aborted and timed-out requests; drop aborted and timed-out waiting ones."""
    for slot, req in list(self._slot_req.items()):
      if not req.finished:
        if req.aborted:
          self._finish(req, "abort", now)
        elif req.deadline is not None and now > req.deadline:
          self._fail(req, 504, "timeout", f"request timed out after {self.request_timeout_s:g} s")
      if req.finished:
        self.state = slots.release(self.state, np.int32(slot))
        del self._slot_req[slot]
        self._free.append(slot)
    with self._lock:
      keep = collections.deque()
      for req in self._waiting:
        if req.aborted:
          self._finish(req, "abort", now)
        elif req.deadline is not None and now > req.deadline:
          self._fail(req, 504, "timeout", f"request timed out in the queue after {self.request_timeout_s:g} s")
        else:
          keep.append(req)
      self._waiting = keep

  def _admit(self, now: float) -> int:
    """-> how many requests were inserted."""
    n = 0
    while self._free:
      with self._lock:
        if not self._waiting:
          return n
        req = self._waiting.popleft()
      slot = self._free.popleft()
      try:
        self.state = slots.insert(self.params, self.state, np.int32(slot), req.device_req, self.spec)
      except Exception as e:
        log.exception("insert failed for %s", req.id)
        self._fail(req, 500, "engine", f"insert failed: {e}")
        self._free.appendleft(slot)
        if _deleted(self.state):  # the donated state is gone: start again from a fresh one
          self._device_failure(e)
        continue
      req.slot, req.admitted_at = slot, now
      req.stream = TextStream(req.output, self.tokenizer.stream(skip_special=True), req.stop)
      req.accepted_at = np.zeros(max(self.spec.k_max, 1), np.int64)
      self._slot_req[slot] = req
      self.metrics.queue_time.observe(now - req.arrival)
      self.metrics.prompt_tokens.inc(len(req.prompt_ids))
      n += 1
    return n

  def _device_failure(self, e: Exception) -> None:
    """The state may be lost: fail every request holding a slot (500) and start again from a fresh state."""
    for req in set(self._slot_req.values()) | (set(self._pending[1].values()) if self._pending else set()):
      if not req.finished:
        self._fail(req, 500, "engine", f"engine error: {type(e).__name__}: {e}")
    self._slot_req.clear()
    self._pending = None
    self._free = collections.deque(range(self.B))
    try:
      self.state = self._fresh_state()
    except Exception:
      log.exception("could not rebuild the decode state")
      raise

  def _process(self, snap, holders: dict) -> float:
    """Hand each request of the snapshot its new tokens; -> host seconds spent (the device wait excluded)."""
    try:
      arr = jax.device_get(snap)
    except Exception as e:
      log.exception("decode failed")
      self._device_failure(e)
      return 0.0
    t1 = time.perf_counter()
    now = time.monotonic()
    uses = np.asarray(arr.option_uses, np.int64)
    self.metrics.observe_steps(self.spec.ks, uses - self._last_uses)
    self._last_uses = uses
    drafted = accepted = 0
    itl: list = []
    for slot, req in holders.items():
      if req.finished or req.aborted:
        continue
      try:
        d, a = self._advance(req, slot, arr, now, itl)
        drafted += d
        accepted += a
      except Exception as e:
        log.exception("streaming failed for %s", req.id)
        self._fail(req, 500, "engine", f"engine error: {type(e).__name__}: {e}")
    if self.guard is not None:
      with self._lock:
        self.guard.observe(now, drafted, accepted, itl)
    return time.perf_counter() - t1

  def _advance(self, req: EngineRequest, slot: int, arr, now: float, itl: list) -> tuple[int, int]:
    drafted, accepted = int(arr.drafted[slot]), int(arr.accepted[slot])
    drafts = int(arr.drafted_at[slot, 0]) if arr.drafted_at.shape[1] else 0
    acc_at = np.asarray(arr.accepted_at[slot], np.int64)[:len(req.accepted_at)]
    dd, da = drafted - req.drafted, accepted - req.accepted  # the row's counters are cumulative
    self.metrics.observe_drafts(dd, da, drafts - req.drafts, acc_at - req.accepted_at)
    req.drafted, req.accepted, req.drafts, req.accepted_at = drafted, accepted, drafts, acc_at.copy()

    start = int(arr.prompt_lens[slot]) + req.n_tokens
    new = arr.tokens[slot, start:int(arr.lengths[slot])].tolist()
    done = bool(arr.done[slot])
    reason = _FINISH.get(FINISH_NAMES.get(int(arr.finish[slot])), "stop") if done else None
    if new:
      self._deliver(req, new, now, itl, ends_with_stop_token=(reason == "stop"))
    if done and not req.finished:
      self._finish(req, reason, now)
    return dd, da

  def _deliver(self, req: EngineRequest, ids: list, now: float, itl: list, ends_with_stop_token: bool) -> None:
    n = len(ids)
    m = self.metrics
    if req.first_at is None:
      req.first_at = now
      m.ttft.observe(now - req.arrival)
    else:
      gap = (now - req.last_at) / n
      for _ in range(n):
        m.itl.observe(gap)
      itl.extend([gap] * n)
    req.last_at = now
    m.generation_tokens.inc(n)
    text_ids = ids[:-1] if ends_with_stop_token else ids
    taken = req.stream.push(ids, text_ids)
    req.n_tokens += taken
    if taken < n:  # a stop string ended the text
      self._finish(req, "stop", now, flush=False)

  def _finish(self, req: EngineRequest, reason: str, now: float, flush: bool = True) -> None:
    if req.finished:
      return
    req.finished = True
    tail = req.stream.flush() if flush and req.stream is not None else ""
    m = self.metrics
    m.finished.labels(finished_reason=reason).inc()
    m.e2e.observe(now - req.arrival)
    if req.first_at is not None and req.n_tokens > 1:
      m.tpot.observe((req.last_at - req.first_at) / (req.n_tokens - 1))
    req.output.put(tail, (), finish_reason=reason, usage=self._usage(req))

  def _fail(self, req: EngineRequest, status: int, kind: str, message: str) -> None:
    if req.finished:
      return
    req.finished = True
    self.metrics.errors.labels(kind=kind).inc()
    req.output.put(error=(status, kind, message), usage=self._usage(req))

  def _usage(self, req: EngineRequest) -> Usage:
    return Usage(prompt_tokens=len(req.prompt_ids), completion_tokens=req.n_tokens, drafted_tokens=req.drafted,
                 accepted_tokens=req.accepted, drafts=req.drafts)


def _deleted(state) -> bool:
  try:
    return any(x.is_deleted() for x in jax.tree.leaves(state))
  except Exception:
    return True
