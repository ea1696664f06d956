"""The engine's waiting queue, where the HTTP side and the engine thread meet: `submit` appends (429 when full, 503
while draining), and the drain, cut and stop flags the HTTP side sets for the engine thread live here too.

An object the engine owns (serve/engine/engine.py): its methods change only the queue's own state, under the
engine's one lock (a Condition the engine thread sleeps on, shared with the admin switch), and give back the
requests that end for the engine to end. Which waiting requests end and where preempted ones go back are
serve/engine/admission.py's decisions.
"""

from __future__ import annotations

import collections
import threading
from typing import Optional

from serve.engine import admission


class QueueFull(Exception):
  """The waiting queue is full: answer 429 with Retry-After."""


class EngineStopped(Exception):
  """The engine is draining or stopped: answer 503."""


class RequestQueue:
  """First come, first served, at most `max_queue` requests beyond the free slots of `num_slots`."""

  def __init__(self, lock: threading.Condition, *, max_queue: int, num_slots: int, metrics):
    self._lock = lock
    self.max_queue, self.B, self.metrics = max_queue, num_slots, metrics
    self._waiting: collections.deque = collections.deque()
    self._draining = False
    self._stop = False
    self._cut: Optional[str] = None  # set by cut_all: fail every request with this message at the next iteration

  def __len__(self) -> int:
    return len(self._waiting)

  def requests(self) -> list:
    with self._lock:
      return list(self._waiting)

  @property
  def draining(self) -> bool:
    return self._draining

  @property
  def stopping(self) -> bool:
    return self._stop

  @property
  def cut_pending(self) -> bool:
    return self._cut is not None

  # ------------------------------------------------------------------------------------------ HTTP-facing side

  def submit(self, req, free: int) -> None:
    """free: the slots free now (max_queue requests wait beyond them)."""
    with self._lock:
      if self._draining or self._stop:
        raise EngineStopped("the server is shutting down")
      if len(self._waiting) >= self.max_queue + free:  # max_queue waits beyond the free slots
        self.metrics.errors.labels(kind="overloaded").inc()
        raise QueueFull(f"all {self.B} slots are busy and the waiting queue is full ({self.max_queue} requests)")
      self._waiting.append(req)
      self.metrics.waiting.set(len(self._waiting))
      self._lock.notify()

  def wake(self) -> None:
    """Wake the engine thread (an abort, the admin switch)."""
    with self._lock:
      self._lock.notify()

  def begin_drain(self) -> None:
    """Refuse new requests from now on; running and waiting ones go on."""
    with self._lock:
      self._draining = True
      self._lock.notify()

  def cut_all(self, message: str) -> None:
    """The drain's deadline: every running and waiting request ends with a 503 (`message`) at the next iteration,
    so that each client gets an error (a stream: an error event and [DONE]) rather than a cut connection."""
    with self._lock:
      self._cut = message
      self._lock.notify()

  def stop(self) -> None:
    """The engine thread ends once nothing runs (serve/engine/engine.py shutdown)."""
    with self._lock:
      self._stop = True
      self._lock.notify()

  # ------------------------------------------------------------------------------------------- engine thread

  def take_cut(self) -> tuple:
    """cut_all's message (cleared) and the waiting requests it fails."""
    with self._lock:
      message, self._cut = self._cut, None
      return message, [r for r in self._waiting if not r.finished]

  def take_all(self) -> list:
    """Empty the queue (the engine stops) -> what waited."""
    with self._lock:
      left = list(self._waiting)
      self._waiting.clear()
      return left

  def reap(self, now: float, timeout_s: float) -> tuple:
    """Drop aborted, timed-out and finished waiting requests -> the admission.End of each that ends now."""
    with self._lock:
      reap = admission.reap_waiting(self._waiting, now, timeout_s)
      self._waiting = collections.deque(reap.keep)
      return reap.ends

  def head(self):
    """The first waiting request (None: none), past the finished ones (preempted, then finished by the call in
    flight)."""
    with self._lock:
      while self._waiting and self._waiting[0].finished:
        self._waiting.popleft()
      return self._waiting[0] if self._waiting else None

  def pop_head(self) -> None:
    """The head goes to a slot (or fails); only the engine thread takes from the head."""
    with self._lock:
      self._waiting.popleft()

  def requeue(self, preempted) -> None:
    """Preempted requests go back to the head (admission.requeue)."""
    if preempted:
      with self._lock:
        self._waiting = admission.requeue(self._waiting, preempted)
