"""Tenant names -> the small ids a request carries to the device (slots.Request.tenant), where a proposer that keeps
per-tenant state reads them (the suffix proposer tags its shared history with them: spec_jax/proposers/suffix.py).

A bounded table: a new tenant takes a free id; when every id is taken, the least recently used tenant with no
request in a slot gives its id up, and the caller clears that id's history on the device first, so that one id
never holds two tenants' text. The table is at least one larger than the slots, so such a tenant always exists.
"""

from __future__ import annotations

import collections
from typing import Optional


IDS = 256  # tenants kept apart at once (the suffix proposer's histories)


class TenantTable:
  def __init__(self, size: int = IDS, num_slots: int = 1):
    self.size = max(size, num_slots + 1)
    self.reset()

  def reset(self) -> None:
    """Every id free (a fresh decode state holds no history)."""
    self._ids: collections.OrderedDict[str, int] = collections.OrderedDict()  # least recently used first
    self._running: collections.Counter = collections.Counter()
    self._free = list(range(self.size - 1, -1, -1))

  def acquire(self, name: str) -> tuple[int, Optional[int]]:
    """The id of `name` for a request about to take a slot -> (id, an id to clear on the device first, or None)."""
    evicted = None
    if name in self._ids:
      self._ids.move_to_end(name)
    else:
      if not self._free:
        old = next(n for n in self._ids if not self._running[self._ids[n]])
        evicted = self._ids.pop(old)
        self._free.append(evicted)
      self._ids[name] = self._free.pop()
    tid = self._ids[name]
    self._running[tid] += 1
    return tid, evicted

  def release(self, tid: int) -> None:
    """A request of tenant id `tid` left its slot."""
    if self._running[tid] > 0:
      self._running[tid] -= 1
