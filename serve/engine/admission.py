"""The engine's queue decisions at each iteration, as values: which requests end (aborted by their client, past
their deadline) and which slots that frees, which waiting requests stay, what becomes of the head of the queue once
the KV pool has answered (it waits for pages, is inserted, or fails), and where preempted requests go back in the
queue. Nothing here changes the engine: serve/engine/engine.py reads its queue and slot table into these functions and
applies what they return (serve/engine/kv_scheduler.py decides which request to preempt and when).

First come, first served: the head of the queue waits for pages and nobody overtakes it; a preempted request goes
back to the head, before the ones that never ran."""

from __future__ import annotations

import collections
import dataclasses
from typing import Any, Iterable, Mapping, Optional, Sequence

WAIT = "wait"  # the head of the queue waits for KV pages (serve/engine/kv_scheduler.py); nobody overtakes it


@dataclasses.dataclass(frozen=True)
class End:
  """End `req` now: finish it as "abort" (status None: its client is gone), else fail it with (status, kind,
  message), the HTTP error its client gets."""

  req: Any
  status: Optional[int] = None
  kind: str = ""
  message: str = ""


@dataclasses.dataclass(frozen=True)
class Reap:
  """ends: the requests to end now; free: the slots to free (their holders finished or end now); keep: the waiting
  queue after it, in order."""

  ends: tuple = ()
  free: tuple = ()
  keep: tuple = ()


@dataclasses.dataclass(frozen=True)
class Insert:
  """Insert the queue's head `req` with device request `dev` into `slot` (the KV pool's placement; None: the
  first free slot), after NaN into pages `poison` (test-only; None: none). resumed: it was preempted before, so
  its stream and counters go on."""

  req: Any
  dev: Any
  slot: Optional[int]
  resumed: bool
  poison: Any = None


def ending(req, now: float, timeout_s: float, queued: bool) -> Optional[End]:
  """How `req` ends now (aborted, timed out), or None: it goes on (or has ended already)."""
  if req.finished:
    return None
  if req.aborted:
    return End(req)
  if req.deadline is not None and now > req.deadline:
    where = " in the queue" if queued else ""
    return End(req, 504, "timeout", f"request timed out{where} after {timeout_s:g} s")
  return None


def reap_running(holders: Mapping[int, Any], now: float, timeout_s: float) -> Reap:
  """The slots' holders (slot -> request) -> the ones to end and the slots to free."""
  ends, free = [], []
  for slot, req in holders.items():
    end = ending(req, now, timeout_s, queued=False)
    if end is not None:
      ends.append(end)
    if end is not None or req.finished:
      free.append(slot)
  return Reap(ends=tuple(ends), free=tuple(free))


def reap_waiting(waiting: Iterable, now: float, timeout_s: float) -> Reap:
  """The waiting queue -> the ones to end and the queue without them (nor the finished ones: preempted, then
  finished by the call that was still in flight)."""
  ends, keep = [], []
  for req in waiting:
    if req.finished:
      continue
    end = ending(req, now, timeout_s, queued=True)
    if end is None:
      keep.append(req)
    else:
      ends.append(end)
  return Reap(ends=tuple(ends), keep=tuple(keep))


def place(req, placed) -> Any:
  """What becomes of the queue's head `req` once the KV pool answered `placed`: WAIT (None: no pages yet), an
  End (an Exception: the pool failed after taking pages, a bug) or an Insert (a kv_scheduler.Placement)."""
  if placed is None:
    return WAIT
  if isinstance(placed, Exception):
    return insert_failed(req, placed)
  return Insert(req, placed.dev, placed.slot, resumed=req.stream is not None, poison=placed.poison)


def insert_failed(req, err: Exception) -> End:
  return End(req, 500, "engine", f"insert failed: {err}")


def requeue(waiting: Sequence, preempted: Sequence) -> collections.deque:
  """The queue with the requests preempted (in the order the pool took them: the latest admitted first) back at
  its head: the earliest admitted of them first, so that they resume in their admission order."""
  return collections.deque([*reversed(preempted), *waiting])
