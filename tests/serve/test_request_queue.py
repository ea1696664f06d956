"""The engine's waiting queue (serve/engine/request_queue.py) without an engine or a model: who is refused, which
waiting requests end, what the head is, where preempted requests go back."""

from __future__ import annotations

import threading

import pytest

from serve.engine import admission
from serve.engine.engine_request import EngineRequest
from serve.engine.metrics import Metrics
from serve.engine.output_stream import Output
from serve.engine.request_queue import EngineStopped, QueueFull, RequestQueue


def _req(i: int, deadline=None, **kw) -> EngineRequest:
  return EngineRequest(id=f"r{i}", prompt_ids=[2], device_req=None, stop=(), output=Output(), arrival=0.0,
                       deadline=deadline, **kw)


def _queue(max_queue: int = 1) -> RequestQueue:
  return RequestQueue(threading.Condition(), max_queue=max_queue, num_slots=2, metrics=Metrics(2))


def test_max_queue_waits_beyond_the_free_slots_and_a_draining_queue_refuses():
  q = _queue(max_queue=1)
  q.submit(_req(0), free=1)
  q.submit(_req(1), free=1)  # one free slot plus one waiting
  with pytest.raises(QueueFull, match="all 2 slots are busy"):
    q.submit(_req(2), free=1)
  assert len(q) == 2
  q.begin_drain()
  with pytest.raises(EngineStopped):
    q.submit(_req(3), free=5)
  assert q.draining and not q.stopping


def test_reap_keeps_the_order_and_hands_back_who_ends():
  q = _queue(max_queue=9)
  ok, gone, late, done, ok2 = _req(0), _req(1, aborted=True), _req(2, deadline=5.0), _req(3), _req(4)
  for r in (ok, gone, late, done, ok2):
    q.submit(r, free=0)
  done.finished = True
  ends = q.reap(now=10.0, timeout_s=3)
  assert [e.req for e in ends] == [gone, late] and ends[1].status == 504
  assert q.requests() == [ok, ok2] and not gone.finished  # the engine ends them


def test_the_head_skips_finished_requests_and_preempted_ones_go_back_first():
  q = _queue(max_queue=9)
  a, b, c = _req(0), _req(1), _req(2)
  for r in (a, b, c):
    q.submit(r, free=0)
  a.finished = True  # preempted, then finished by the call in flight
  assert q.head() is b and len(q) == 2
  q.pop_head()
  late, early = _req(3), _req(4)
  q.requeue([late, early])  # the pool preempts the latest admitted first
  assert q.requests() == [early, late, c] == list(admission.requeue([c], [late, early]))
  q.cut_all("bye")
  assert q.cut_pending and q.take_cut() == ("bye", [early, late, c]) and not q.cut_pending
  assert q.take_all() == [early, late, c] and len(q) == 0 and q.head() is None
