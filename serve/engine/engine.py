"""The host scheduler: B decode slots, a bounded waiting queue, and one thread that loops insert -> decode -> stream.

JetStream's orchestrator shape over `spec_jax.slots`. Each iteration of the engine thread:
1. frees the slots of requests that finished, were aborted (client gone) or timed out (`slots.release`);
2. inserts waiting requests into free slots (`slots.insert`: prefill plus a write of that row);
3. dispatches `decode_loop` for up to `steps_per_sync` steps (one right after an insert, for TTFT) and a
   `snapshot` of its result;
4. reads the previous iteration's snapshot (its loop is done; the one just dispatched runs meanwhile, since JAX
   dispatch is asynchronous), and hands each request its new tokens: detokenized incrementally, cut at `stop`
   strings, merged into the request's `Output`.
The HTTP layer talks to the engine only through `submit`, `abort` and each request's `Output`: a slow client cannot
stall the device loop. A snapshot remembers who held each slot, so a refilled slot never gets its old tokens.
The engine owns its state: serve/engine/admission.py (the queue) and serve/engine/kv_scheduler.py (the KV pool) return their
decisions as values, and only this file applies them (tests/serve/test_engine_owns_state.py). The waiting queue
itself is an object it owns (serve/engine/request_queue.py) whose methods change only the queue.

Speculation per request: at admission a request gets its segment and draft cap (serve/engine/segments.py). Before each
dispatch every row's cap is set: 0 where the admin switch, the segment's guardrails or a switchback "off" window
say so, and at most the per-concurrency k. Hand-overs are credited to (segment, arm of the dispatch's window).
An exception fails the requests it touched (HTTP 500) and the engine goes on: a failed insert fails its request,
a failed decode every running request, and the engine starts from a fresh state.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Optional

import jax
import numpy as np

from serve.engine import admission, kv_scheduler, live_ab, timing_probe
from serve.engine.guardrails import SpeculationSwitch
from serve.engine.segments import Segments
from serve.engine.metrics import Metrics
from serve.engine.engine_request import EngineRequest, RequestMaker
from serve.engine.output_stream import Output, TextStream
from serve.engine.request_queue import RequestQueue
from serve.engine.request_spec import EngineLimits, RequestSpec
from serve.engine.tenants import TenantTable
from spec_jax import slots
from spec_jax.cache import DEFAULT_BLOCK_SIZE
from spec_jax.slot_table import SlotTable

log = logging.getLogger("spec_jax.engine")


class Engine:
  """The scheduler thread over one `DecodeState` of `max_num_seqs` slots of `capacity` tokens."""

  def __init__(self, params, spec, tokenizer, *, max_num_seqs: int, capacity: int, max_queue: int = 64,
               steps_per_sync: int = 8, costs=None, spec_config=None, guardrails=None,
               request_timeout_s: float = 600.0, seed: int = 0, metrics: Optional[Metrics] = None,
               timing_probe_s: float = 10.0, switchback=None, grammar_capacity=None, kv_pool=None,
               table_class=None):
    """kv_pool: the paged KV pool's flags (serve/engine/kv_scheduler.py plan); None: fixed slots. table_class: the slot
    table's class (multi-host hook: serve/many_hosts/multihost.py's, which mirrors every device call; None: SlotTable)."""
    if max_num_seqs < 1 or max_queue < 0 or steps_per_sync < 1:
      raise ValueError("max_num_seqs and steps_per_sync must be >= 1, max_queue >= 0")
    pool = kv_scheduler.plan(params, spec, kv_pool, rows=SlotTable.rows(params, spec, max_num_seqs),
                             max_num_seqs=max_num_seqs, capacity=capacity, grammar_capacity=grammar_capacity)
    self.block_size = pool["block_size"] if pool else DEFAULT_BLOCK_SIZE
    table = table_class or SlotTable  # multi-host hook (serve/many_hosts/multihost.py)
    self.table = table(params, spec, num_slots=max_num_seqs, capacity=capacity, costs=costs, seed=seed,
                           grammar_capacity=grammar_capacity, block_size=self.block_size,
                           num_pages=pool["num_pages"] if pool else None)
    self.tenants = TenantTable(num_slots=max_num_seqs)
    self.params, self.tokenizer = params, tokenizer
    self.B, self.capacity, self.max_queue, self.steps = max_num_seqs, capacity, max_queue, steps_per_sync
    self.request_timeout_s = request_timeout_s
    self.metrics = metrics or Metrics(spec.k_max, timing_probe.device_memory() is not None)
    self.probe = timing_probe.StepProbe(self.metrics, timing_probe_s)  # every_s 0: never probe the step split
    self.metrics.slots_total.set(max_num_seqs)
    now = time.monotonic()
    self.segments = Segments(spec_config, switchback, self.metrics, now)  # policy, canary, switchback, live A/B
    self.switch = SpeculationSwitch(guardrails, spec_config, spec.k_max, self.metrics, self.segments.names, now,
                                    kv_cache_dtype=spec.kv_cache_dtype)
    self._applied_caps: Optional[np.ndarray] = None
    self._lock = threading.Condition()  # the engine thread sleeps on it; the queue and the admin switch share it
    self.queue = RequestQueue(self._lock, max_queue=max_queue, num_slots=max_num_seqs, metrics=self.metrics)
    self.iteration_tokens = 0  # this iteration's prompt tokens inserted and tokens handed over (metrics)
    self._applied_on: Optional[bool] = None  # the flag the device state holds
    self._pending = None  # (snapshot, {slot: request}, (window, arm)) of the loop dispatched last iteration
    self._last_uses = np.zeros(len(spec.ks), np.int64)
    self._thread: Optional[threading.Thread] = None
    self.iterations = 0
    self.kv = kv_scheduler.KVScheduler(spec_of=lambda: self.spec, capacity=capacity,
                                       rows=self.table.state.tokens.shape[0], metrics=self.metrics,
                                       **pool) if pool else None
    if self.kv is not None:
      log.info(self.kv.describe())
    self.requests = RequestMaker(spec_of=lambda: self.spec, capacity=capacity, block_size=self.block_size,
                                 grammar_capacity=self.table.grammar_capacity, kv=self.kv,
                                 request_timeout_s=request_timeout_s)

  @property
  def spec(self):
    """The loop's LoopSpec: the slot table's, the one place it is held."""
    return self.table.spec

  @spec.setter
  def spec(self, value) -> None:
    self.table.spec = value

  # ------------------------------------------------------------------------------------------ HTTP-facing side

  def make_request(self, spec: RequestSpec, output: Output | None = None) -> EngineRequest:
    """The engine's request for a spec (serve/engine/engine_request.py RequestMaker); output: where its tokens go."""
    return self.requests.make_request(spec, output)

  def limits(self) -> EngineLimits:
    """What a request is checked against (serve/engine/request_spec.py)."""
    return self.requests.limits()

  def prompt_logprobs(self, prompt_ids: list, top: int):
    """The prompt's raw logprobs, (logprob, rank, top ids, top values) per token (None for the first): one forward
    of the prompt beside the engine's loop (spec_jax/logprobs.py), through the table: mirrored on many hosts."""
    return self.table.prompt_logprobs(prompt_ids, top)

  def submit(self, req: EngineRequest) -> None:
    """Onto the waiting queue (serve/engine/request_queue.py: QueueFull, EngineStopped)."""
    self.queue.submit(req, self.table.free)

  def abort(self, req: EngineRequest) -> None:
    """The client is gone: the request's slot is freed at the next iteration."""
    req.aborted = True
    self.queue.wake()

  def set_speculation(self, enabled: bool) -> None:
    """The admin switch (serve/engine/guardrails.py SpeculationSwitch)."""
    with self._lock:
      if self.switch.set_admin(enabled, time.monotonic()):
        self._lock.notify()

  def status(self) -> dict:
    return {**self.switch.status(len(self.table.holders)), "method": self.spec.proposer.name,
            **self.segments.to_json(), **(self.kv.to_json() if self.kv else {}),
            "k_max": self.spec.k_max, "ks": list(self.spec.ks)}

  def live_report(self) -> dict:
    """GET /admin/speculation/report (serve/engine/segments.py)."""
    return self.segments.report(self.switch, self.spec.proposer.name, self.spec.k_max)

  @property
  def draining(self) -> bool:
    return self.queue.draining

  @property
  def alive(self) -> bool:
    return self._thread is not None and self._thread.is_alive()

  def counts(self) -> tuple[int, int]:
    """(running, waiting)."""
    with self._lock:
      return len(self.table.holders), len(self.queue)

  # ---------------------------------------------------------------------------------------------- lifecycle

  def start(self, warmup_prompt_lens=(1,)) -> None:
    """Compile insert (one prompt bucket per length given), the loop, snapshot, release and the switch, then
    start the thread on a fresh state."""
    t = self.table
    lens = list(warmup_prompt_lens) or [1]
    for i, n in enumerate(lens):
      req = slots.make_request([self.spec.config.bos_id] * n, max_new=2, spec=self.spec, capacity=self.capacity,
                               block_size=self.block_size)
      slot = t.insert(None, req)
      if i < len(lens) - 1:
        t.release(slot)
    t.set_speculation(False)
    t.set_speculation(True)
    probing = self.probe.every_s > 0 and self.spec.k_max > 0  # the probe's propose compiled now, not under traffic
    snap, held = t.run(self.steps, timing_probe.untimed_loop if probing else None)
    for slot in held:
      t.release(slot)
    jax.block_until_ready((jax.device_get(snap), t.state))
    self._fresh_state()
    self._thread = threading.Thread(target=self._run, name="spec_jax-engine", daemon=True)
    self._thread.start()

  def begin_drain(self) -> None:
    """Refuse new requests from now on; running and waiting ones go on."""
    self.queue.begin_drain()

  def cut_all(self, message: str) -> None:
    """The drain's deadline (serve/engine/request_queue.py): every request ends with a 503 at the next iteration."""
    self.queue.cut_all(message)

  def _fail_all(self) -> None:
    """cut_all's work, on the engine thread (reap then frees the slots and pages)."""
    with self._lock:
      message, waiting = self.queue.take_cut()
      running = [r for r in self.table.holders.values() if not r.finished]
    for r in running + waiting:
      r.fail(503, "shutdown", message, self.metrics)
    log.warning("drain deadline: cut %d running and %d waiting request(s) with a 503", len(running), len(waiting))

  def shutdown(self, grace_s: float = 30.0) -> None:
    """Drain (up to `grace_s`), abort what is left, stop the thread."""
    self.begin_drain()
    end = time.monotonic() + grace_s
    while time.monotonic() < end and any(self.counts()):
      time.sleep(0.02)
    with self._lock:
      left = self.queue.requests() + list(self.table.holders.values())
    for r in left:
      r.aborted = True
    self.queue.stop()
    if self._thread is not None:
      self._thread.join(timeout=30)

  def _fresh_state(self) -> None:
    self.table.reset()
    self.tenants.reset()
    if self.kv is not None:
      self.kv.reset()
    self._applied_on = None
    self._applied_caps = None
    self._last_uses = np.zeros(len(self.spec.ks), np.int64)

  # ------------------------------------------------------------------------------------------- engine thread

  def _run(self) -> None:
    while True:
      with self._lock:
        if self.queue.stopping and not self.table.holders and self._pending is None:
          for r in self.queue.take_all():
            r.finish("abort", time.monotonic(), self.metrics)
          break
        if not self.queue and not self.table.holders and self._pending is None and not self.queue.stopping:
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
    self.segments.tick(now)
    with self._lock:  # the admin switch resets the guardrails from the HTTP thread
      events = self.switch.tick(now, self.segments.verdict_of)
    self.segments.restart(seg for seg, _, _ in events)  # switched off or probing: measured afresh
    if self.queue.cut_pending:
      self._fail_all()
    self._reap(now)
    admitted = self._admit(now)
    snap = None
    if self.table.holders:
      dispatched = self.segments.now()
      caps = self._speculation_caps(dispatched[1])
      # Right after an insert, one step: the new request's first tokens go out after its prefill plus one step
      # rather than plus steps_per_sync steps (TTFT).
      steps = 1 if admitted else self.steps
      try:
        if self.kv is not None:  # pages for the call; fewer steps, caps or rows when the pool is short
          steps, caps = self._reserve(steps, caps)
        self._set_caps(caps)
        drafting = bool(self._applied_on) and any(r.speculate for r in self.table.holders.values())
        snap = (*self.table.run(steps, self.probe.timed_loop if self.probe.due(now, drafting) else None),
                dispatched)
      except Exception as e:
        log.exception("decode failed")
        self._device_failure(e)
    host = time.perf_counter() - t0
    pending, self._pending = self._pending, snap
    if pending is not None:
      host += self._process(*pending)
    self.metrics.host_time.observe(host)
    if self.iteration_tokens:  # vLLM's iteration_tokens_total: prompt tokens inserted and tokens handed over
      self.metrics.iteration_tokens.observe(self.iteration_tokens)
      self.iteration_tokens = 0
    self.probe.sample_memory(now)
    self.metrics.observe_occupancy(*self.counts())

  # The queue and the KV pool decide (serve/engine/admission.py, serve/engine/kv_scheduler.py); only these apply what they return.

  def _reap(self, now: float) -> None:
    """Free slots of finished, aborted and timed-out requests; drop aborted and timed-out waiting ones."""
    reap = admission.reap_running(self.table.holders, now, self.request_timeout_s)
    for end in reap.ends:
      self._end(end, now)
    for slot in reap.free:
      req = self.table.holders[slot]
      self.segments.credit(req, self.segments.now(), now)  # an end no hand-over saw (abort, timeout)
      self.table.release(slot)
      self.tenants.release(req.tenant_id)
      if self.kv is not None:
        self.kv.release(req)
        self.kv.metrics_update()  # kv_cache_usage_perc drops now, not at the next loop call (there may be none)
    for end in self.queue.reap(now, self.request_timeout_s):
      self._end(end, now)

  def _end(self, end: admission.End, now: float) -> None:
    if end.status is None:
      end.req.finish("abort", now, self.metrics)
    else:
      end.req.fail(end.status, end.kind, end.message, self.metrics)

  def _admit(self, now: float) -> int:
    """Insert waiting requests into free slots, first come first served -> how many were inserted."""
    n = 0
    while self.table.free:
      req = self.queue.head()
      if req is None:
        return n
      step = admission.place(req, self._place(req))
      if step is admission.WAIT:
        return n
      self.queue.pop_head()
      n += self._insert(step, now)
    return n

  def _place(self, req: EngineRequest):
    """The KV pool's answer for the queue's head (a Placement, None: no pages yet, or the pool's exception)."""
    if self.kv is None:
      return kv_scheduler.Placement(req.device_req)
    try:
      return self.kv.admit(req, self.table.free_slots(), self.table.holders)
    except Exception as err:  # failed after taking its pages (a bug): the request fails, its pages go back
      log.exception("KV admission failed for %s", req.id)
      return err

  def _insert(self, step, now: float) -> bool:
    """Apply admission's decision for the queue's head, already off the queue -> whether it took a slot."""
    req = step.req
    if isinstance(step, admission.End):
      if self.kv is not None:
        self.kv.release(req)
      self._end(step, now)
      return False
    if step.resumed:
      req.resumed()  # its new row's counters start from zero
    else:
      req.stream = TextStream(req.output, self.tokenizer.stream(skip_special=True), req.stop)
      req.accepted_at = np.zeros(max(self.spec.k_max, 1), np.int64)
    try:
      if step.poison is not None:
        self.table.fill_pages(step.poison)
      if not step.resumed:
        self.segments.classify(req, len(self.table.holders) + 1, self.spec.k_max)
      req.device_req = self._with_tenant(req, step.dev)
      req.slot = self.table.insert(req, req.device_req, slot=step.slot)
      if self.kv is not None:
        self.kv.admitted(req)
    except Exception as err:
      if self.kv is not None:
        self.kv.release(req)
      self.tenants.release(req.tenant_id)
      log.exception("insert failed for %s", req.id)
      self._end(admission.insert_failed(req, err), now)
      if self.table.lost():  # the donated state is gone: start again from a fresh one
        self._device_failure(err)
      return False
    self._applied_caps = None  # the insert wrote the row's own cap: set them all again before the dispatch
    if not step.resumed:
      req.admitted_at = now
      self.metrics.queue_time.observe(now - req.arrival)
      self.metrics.prompt_tokens.inc(len(req.prompt_ids))
      self.iteration_tokens += len(req.prompt_ids)
    return True

  def _with_tenant(self, req: EngineRequest, dev):
    """The device request with its tenant's id (a request field a proposer may keep per row); an id taken from
    another tenant has that tenant's history dropped first."""
    tid, evicted = self.tenants.acquire(req.tenant)
    if evicted is not None:
      self.table.forget_tenant(evicted)
    req.tenant_id = tid
    return dev.replace(tenant=np.int32(tid))

  def _reserve(self, steps: int, caps: np.ndarray) -> tuple:
    """The KV pool's pages for the next call -> (steps, caps) it may run; preempted requests go back to the head
    of the queue, their tokens of a call still in flight still reach them, and they resume after them."""
    r = self.kv.reserve(steps, caps, self.table.holders)
    for req in r.preempted:
      self.table.release(req.slot)
      self.tenants.release(req.tenant_id)
      req.tenant_id = -1
    self.queue.requeue(r.preempted)
    if r.poison is not None:
      self.table.fill_pages(r.poison)
    self.table.set_page_tables(r.table)
    return r.steps, r.caps

  def _speculation_caps(self, arm: str) -> np.ndarray:
    """Every row's draft cap for the next dispatch, which runs in switchback arm `arm`."""
    busy = len(self.table.holders)
    k_busy = self.switch.k_at(busy)
    caps = np.zeros((self.table.num_slots,), np.int32)
    if arm == live_ab.ON and self.switch.allowed():
      for slot, req in self.table.holders.items():
        if req.speculate and self.switch.segment_on(req.segment):
          caps[slot] = min(req.policy_k, k_busy)
    return caps

  def _set_caps(self, caps: np.ndarray) -> None:
    if self._applied_caps is None or not np.array_equal(caps, self._applied_caps):
      self.table.set_draft_caps(caps)
      self._applied_caps = caps
    on = bool(caps.any())
    if on != self._applied_on:  # no row drafts: the loop runs k = 0 steps (no proposer cost)
      self.table.set_speculation(on)
      self._applied_on = on
    # on: the admin switch and the guardrails of at least one segment allow it
    self.metrics.speculation_enabled.set(1.0 if any(map(self.switch.segment_on, self.segments.names)) else 0.0)

  def _device_failure(self, e: Exception) -> None:
    """The state may be lost: fail every request holding a slot (500) and start again from a fresh state."""
    for req in set(self.table.holders.values()) | (set(self._pending[1].values()) if self._pending else set()):
      if not req.finished:
        req.fail(500, "engine", f"engine error: {type(e).__name__}: {e}", self.metrics)
        self.segments.credit(req, self.segments.now(), time.monotonic())
    self._pending = None
    try:
      self._fresh_state()
    except Exception:
      log.exception("could not rebuild the decode state")
      raise

  def _process(self, snap, holders: dict, dispatched: tuple) -> float:
    """Hand each request of the snapshot its new tokens; -> host seconds spent (the device wait excluded).
    dispatched: (switchback window, arm) the loop ran in."""
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
    by_segment: dict = {}  # segment -> [drafted, accepted, itl, drafts] for its guardrails
    for slot, req in holders.items():
      if req.finished or req.aborted:
        continue
      itl: list = []
      first, drafts0 = req.first_at is None, req.drafts
      try:
        d, a, n, steps = req.advance(arr, slot, now, itl, self.metrics)
      except Exception as e:
        log.exception("streaming failed for %s", req.id)
        req.fail(500, "engine", f"engine error: {type(e).__name__}: {e}", self.metrics)
        d = a = n = steps = 0
      ttft = req.first_at - req.arrival if first and req.first_at is not None else None
      self.segments.credit(req, dispatched, now, tokens=n, itl=itl, steps=steps, drafted=d, accepted=a, ttft=ttft)
      self.iteration_tokens += n
      acc = by_segment.setdefault(req.segment, [0, 0, [], 0])
      acc[0] += d
      acc[1] += a
      acc[2].extend(itl)
      acc[3] += req.drafts - drafts0  # verify steps that drafted (tau, the KV-dtype guardrail)
      if self.kv is not None:
        self.kv.observe(arr, slot, req)
    if self.kv is not None:
      self.kv.metrics_update()
    arm = dispatched[1]
    with self._lock:
      for seg, (d, a, itl, drafts) in by_segment.items():
        g = self.switch.guards.get(seg)
        # k = 0 samples of an "off" window are not the segment speculating (its own baseline windows are)
        if g is not None and (arm == live_ab.ON or g.mode == "baseline_window"):
          g.observe(now, d, a, itl, drafts)
    return time.perf_counter() - t1
