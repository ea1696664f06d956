"""The engine owns its state (issue 49): no module but serve/engine/engine.py changes an Engine's attributes, and the
queue's and the KV pool's decisions are values checked here without an engine or a model (serve/engine/admission.py,
serve/engine/kv_scheduler.py)."""

from __future__ import annotations

import pathlib

import numpy as np
import pytest

from serve.engine import admission, kv_scheduler
from serve.engine.engine_request import EngineRequest
from serve.engine.metrics import Metrics
from serve.engine.output_stream import Output
from spec_jax import slots
from spec_jax.decode import make_spec
from spec_jax.proposers.ngram import NgramProposer
from tests.conftest import tiny_gemma_config
from tests.serve.engine_refs import find

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_no_module_but_the_engine_changes_engine_state():
  found = []
  for folder in ("serve", "train", "spec_jax", "tools", "benchmarks"):
    for path in sorted((ROOT / folder).rglob("*.py")):
      rel = path.relative_to(ROOT)
      if path.name == "engine.py" and rel.parts[0] == "serve":
        continue
      found += find(str(rel), path.read_text())
  assert not found, "only serve/engine/engine.py may change the engine's state:\n" + "\n".join(found)


BAD = {  # what serve/engine/admission.py and serve/engine/kv_scheduler.py did before the engine owned its state
    "def reap(e, now):\n  e._waiting = keep\n": "assigns",
    "def admit(e, now):\n  e._applied_caps = None\n": "assigns",
    "def admit(e, req):\n  e.iteration_tokens += len(req.prompt_ids)\n": "assigns",
    "def f(e, t):\n  e.table.state = forget(e.table.state, t)\n": "assigns",
    "class K:\n  def reserve(self, table):\n    self.e.table.state = set_page_tables(self.e.table.state, table)\n":
        "assigns",
    "def f(engine):\n  engine.queue[0] = None\n": "assigns",
    "def f(engine):\n  del engine.kv\n": "assigns",
    "def f(x: 'Engine'):\n  x.kv, y = None, 1\n": "assigns",
    "def f(engine):\n  setattr(engine, 'kv', None)\n": "setattr",
    "def admit(e, err):\n  e._device_failure(err)\n": "private",
    "def admit(e):\n  with e._lock:\n    pass\n": "private",
    "def outer(engine):\n  def inner():\n    engine.x = 1\n  return inner\n": "assigns",
}
GOOD = [
    "def check(n):\n  e = ValueError('x')\n  e.field = 'max_tokens'\n  raise e\n",  # an exception, not the engine
    "def f(engine):\n  try:\n    pass\n  except Exception as engine:\n    engine.note = 1\n",
    "class K:\n  def __init__(self, engine):\n    self.e = engine\n    self.rows = engine.rows\n",
    "def f(engine, req):\n  req.slot = engine.table.insert(req)\n  n = engine.counts()\n",
]


@pytest.mark.parametrize("source", list(BAD))
def test_the_scan_finds_each_way_of_changing_engine_state(source):
  found = find("x.py", source)
  assert found and BAD[source] in found[0], found


@pytest.mark.parametrize("source", GOOD)
def test_the_scan_leaves_other_objects_alone(source):
  assert find("x.py", source) == []


# ---- the queue's decisions (serve/engine/admission.py)

def _req(i: int, deadline=None, **kw) -> EngineRequest:
  return EngineRequest(id=f"r{i}", prompt_ids=[2, 5, 7], device_req=None, stop=(), output=Output(), arrival=0.0,
                       deadline=deadline, **kw)


def test_reap_says_who_ends_and_which_slots_free_and_changes_nothing():
  ok, gone, late, done = _req(0, deadline=50.0), _req(1, aborted=True), _req(2, deadline=5.0), _req(3, finished=True)
  r = admission.reap_running({0: ok, 1: gone, 2: late, 3: done}, now=10.0, timeout_s=600)
  assert r.ends == (admission.End(gone), admission.End(late, 504, "timeout", "request timed out after 600 s"))
  assert r.free == (1, 2, 3) and r.keep == ()
  assert not any(q.finished for q in (ok, gone, late))  # a decision: the engine ends them

  w_done, w_gone, w_late, w1, w2 = _req(4, finished=True), _req(5, aborted=True), _req(6, 5.0), _req(7), _req(8, 50.)
  r = admission.reap_waiting([w_done, w_gone, w_late, w1, w2], now=10.0, timeout_s=7.5)
  assert r.ends == (admission.End(w_gone), admission.End(w_late, 504, "timeout",
                                                          "request timed out in the queue after 7.5 s"))
  assert r.keep == (w1, w2) and r.free == ()


def test_the_head_of_the_queue_waits_is_inserted_or_fails_by_the_pools_answer():
  req = _req(0)
  assert admission.place(req, None) is admission.WAIT
  failed = admission.place(req, RuntimeError("no page"))
  assert failed == admission.End(req, 500, "engine", "insert failed: no page")
  poison = np.array([3, 4], np.int32)
  first = admission.place(req, kv_scheduler.Placement("dev", slot=2, poison=poison))
  assert isinstance(first, admission.Insert) and (first.dev, first.slot, first.resumed) == ("dev", 2, False)
  assert first.poison is poison
  req.stream = object()  # it ran before (preempted): its stream goes on
  assert admission.place(req, kv_scheduler.Placement("dev")).resumed


def test_preempted_requests_go_back_to_the_head_in_admission_order():
  w1, w2, late, early = _req(1), _req(2), _req(3), _req(4)
  # the pool preempts the latest admitted first: `late`, then `early`
  assert list(admission.requeue([w1, w2], [late, early])) == [early, late, w1, w2]
  assert list(admission.requeue([], [])) == []


# ---- the KV pool's decisions (serve/engine/kv_scheduler.py)

def _running(slot: int, seq: int, segment: str = "default", drafted: int = 0, accepted: int = 0):
  r = _req(slot, segment=segment, drafted=drafted, accepted=accepted, admit_seq=seq)
  r.slot = slot
  return r


def test_a_short_pool_shrinks_steps_then_speculation_then_preempts_the_latest_admitted():
  a, b, c = _running(0, 1, "chat", 10, 9), _running(1, 3, "code", 10, 2), _running(2, 2, "code", 10, 2)
  rows = [(0, a), (2, c), (1, b)]  # admission order
  caps = np.array([4, 4, 4, 0])
  one = lambda slot: 0
  assert kv_scheduler.shortage(4, [5], [5], rows, caps, one, True) is None  # fits
  assert kv_scheduler.shortage(4, [6], [5], rows, caps, one, True) == kv_scheduler.FewerSteps(1)
  # one step already: the drafting segment that gains least (code: 4 of 20 accepted) stops drafting
  assert kv_scheduler.shortage(1, [6], [5], rows, caps, one, True) == kv_scheduler.CutSpeculation((2, 1))
  # nobody drafts: the latest admitted (b) goes back to the queue
  none = np.zeros(4, int)
  assert kv_scheduler.shortage(1, [6], [5], rows, none, one, True) == kv_scheduler.Preempt(b)
  # speculation does not yield: preemption at once
  assert kv_scheduler.shortage(4, [6], [5], rows, caps, one, False) == kv_scheduler.Preempt(b)


def test_a_short_data_shard_preempts_among_its_own_rows_only():
  a, b, c = _running(0, 1), _running(1, 3), _running(2, 2)
  rows = [(0, a), (2, c), (1, b)]
  shard = lambda slot: slot // 2  # slots 0, 1: shard 0; slots 2, 3: shard 1
  move = kv_scheduler.shortage(1, [1, 4], [9, 3], rows, np.zeros(4, int), shard, True)
  assert move == kv_scheduler.Preempt(c)  # b was admitted later, but its shard has pages


def test_reserve_returns_the_preemption_and_the_page_table_for_the_engine_to_apply():
  spec = make_spec(tiny_gemma_config(), NgramProposer(k=4), adaptive_k=False)
  kv = kv_scheduler.KVScheduler(spec_of=lambda: spec, capacity=64, rows=4, metrics=Metrics(spec.k_max),
                                num_pages=13, block_size=4)
  holders = {}
  for slot in range(3):
    req = _req(slot)
    req.prompt_ids = [2] + [10 + slot] * 10
    req.max_new = 40
    req.device_req = slots.make_request(req.prompt_ids, max_new=40, spec=spec, capacity=64, block_size=4)
    placed = kv.admit(req, [s for s in range(4) if s not in holders], holders)
    assert placed is not None and placed.slot == slot
    req.slot, holders[slot] = slot, req
    kv.admitted(req)
  given = dict(holders)
  # 12 usable pages, 4 a row: one step of 5 tokens fits in what the admissions took, four do not
  r = kv.reserve(4, np.array([4, 4, 4, 0], np.int32), holders)
  assert (r.steps, r.caps.tolist(), r.preempted) == (1, [4, 4, 4, 0], ())
  # that call still in flight, the next one does not fit even without drafts: the latest admitted goes
  r = kv.reserve(4, r.caps, holders)
  assert holders == given  # the engine frees the slots: nothing here changes the slot table's view
  assert r.steps == 1 and r.caps.tolist() == [0, 0, 0, 0] and r.preempted == (holders[2],)
  assert all(q.kv_key is None for q in r.preempted) and kv.preemptions == len(r.preempted)
  for q in r.preempted:
    assert (r.table[q.slot] == kv.bm.null_row(0)).all()  # its row reads the null page
  for slot, q in holders.items():
    if q not in r.preempted:
      assert (r.table[slot] == kv.bm.table(q.kv_key)).all()
  assert r.poison is None  # not poisoning: no page ids to fill
