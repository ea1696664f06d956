"""The engine's queue at each iteration (serve/engine.py, engine thread): free the slots (and KV pages) of
requests that ended, drop ended waiting ones, insert waiting requests into free slots while the KV pool gives them
pages (first come, first served: the head waits for pages, nobody overtakes it), and preempt a running request
back to the head of the queue (serve/kv_scheduler.py decides which and when)."""

from __future__ import annotations

import collections
import logging

import numpy as np

from serve.engine_request import EngineRequest
from serve.output_stream import TextStream

log = logging.getLogger("spec_jax.engine")


def reap(e, now: float) -> None:
  """Free slots of finished, aborted and timed-out requests; drop aborted and timed-out waiting ones."""
  for slot, req in list(e.table.holders.items()):
    if not req.finished:
      if req.aborted:
        req.finish("abort", now, e.metrics)
      elif req.deadline is not None and now > req.deadline:
        req.fail(504, "timeout", f"request timed out after {e.request_timeout_s:g} s", e.metrics)
    if req.finished:
      e.segments.credit(req, e.segments.now(), now)  # an end no hand-over saw (abort, timeout)
      e.table.release(slot)
      e.tenants.release(req.tenant_id)
      if e.kv is not None:
        e.kv.release(req)
        e.kv.metrics_update()  # kv_cache_usage_perc drops now, not at the next loop call (there may be none)
  with e._lock:
    keep = collections.deque()
    for req in e._waiting:
      if req.finished:  # preempted, then finished by the call that was still in flight
        continue
      if req.aborted:
        req.finish("abort", now, e.metrics)
      elif req.deadline is not None and now > req.deadline:
        req.fail(504, "timeout", f"request timed out in the queue after {e.request_timeout_s:g} s", e.metrics)
      else:
        keep.append(req)
    e._waiting = keep


def admit(e, now: float) -> int:
  """Insert waiting requests into free slots -> how many were inserted."""
  n = 0
  while e.table.free:
    with e._lock:
      if not e._waiting:
        return n
      req = e._waiting[0]
      if req.finished:
        e._waiting.popleft()
        continue
    resumed = req.stream is not None  # preempted before: its stream and counters go on
    try:
      dev = e.kv.admit(req) if e.kv is not None else req.device_req
    except Exception as err:  # failed after taking its pages (a bug): fail it below, pages back
      dev = err
    if dev is None:  # no pages yet: the head of the queue waits for them
      return n
    with e._lock:
      e._waiting.popleft()
    if resumed:
      req.resumed()  # its new row's counters start from zero
    else:
      req.stream = TextStream(req.output, e.tokenizer.stream(skip_special=True), req.stop)
      req.accepted_at = np.zeros(max(e.spec.k_max, 1), np.int64)
    try:
      if isinstance(dev, Exception):
        raise dev
      req.device_req = dev
      if not resumed:
        e.segments.classify(req, len(e.table.holders) + 1, e.spec.k_max)
      assign_tenant(e, req)
      req.slot = e.table.insert(req, req.device_req, slot=req.kv_slot if e.kv is not None else None)
      if e.kv is not None:
        e.kv.admitted(req)
    except Exception as err:
      if e.kv is not None:
        e.kv.release(req)
      e.tenants.release(req.tenant_id)
      log.exception("insert failed for %s", req.id)
      req.fail(500, "engine", f"insert failed: {err}", e.metrics)
      if e.table.lost():  # the donated state is gone: start again from a fresh one
        e._device_failure(err)
      continue
    e._applied_caps = None  # the insert wrote the row's own cap: set them all again before the dispatch
    n += 1
    if not resumed:
      req.admitted_at = now
      e.metrics.queue_time.observe(now - req.arrival)
      e.metrics.prompt_tokens.inc(len(req.prompt_ids))
      e.iteration_tokens += len(req.prompt_ids)
  return n


def preempt(e, req: EngineRequest) -> None:
  """Free the request's slot and put it back at the head of the queue (its pages: serve/kv_scheduler.py); the
  tokens of a call still in flight still reach it, and it resumes after them."""
  e.table.release(req.slot)
  e.tenants.release(req.tenant_id)
  req.tenant_id = -1
  with e._lock:
    e._waiting.appendleft(req)


def assign_tenant(e, req: EngineRequest) -> None:
  """The request's tenant id in its device request; an id taken from another tenant loses its history first."""
  tid, evicted = e.tenants.acquire(req.tenant)
  if evicted is not None and getattr(e.spec.proposer, "forget_tenant", None) is not None:
    e.table.forget_tenant(evicted)
  req.tenant_id = tid
  req.device_req = req.device_req.replace(tenant=np.int32(tid))
