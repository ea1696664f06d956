"""The host side of `spec_jax.slots`: which slots are free, who holds each, and the insert -> loop -> snapshot ->
release cycle over one DecodeState. The server's engine (serve/engine/engine.py, with its threads, queue and deadlines)
and the distillation generator (train/distill.py) both schedule through it.

A snapshot is taken with the holders of that moment (`run` returns both), so a slot released and refilled before
the snapshot is read is never confused with its previous holder.
"""

from __future__ import annotations

import collections
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from spec_jax import backend, sharding, slots
from spec_jax.cache import DEFAULT_BLOCK_SIZE
from spec_jax.decode import LoopSpec, decode_loop
from spec_jax.proposers.base import without_tenant
from spec_jax.logprobs import prompt_logprobs


class SlotTable:
  """`num_slots` decode slots of `capacity` tokens. `holders` maps a busy slot to whatever its caller keeps there
  (a request); the state's rows are the slots, plus a never-used one for a bfloat16 batch of one on CPU and
  padding to the mesh's data axis."""

  def __init__(self, params, spec: LoopSpec, *, num_slots: int, capacity: int, costs=None, seed: int = 0,
               grammar_capacity=None, block_size: int = DEFAULT_BLOCK_SIZE, num_pages=None):
    """num_pages: a pool of that many pages of block_size tokens that requests bring pages of (their Request's
    table row: serve/engine/kv_scheduler.py); None: each slot owns its contiguous pages."""
    self.params, self.spec = params, spec
    self.block_size, self.num_pages = block_size, num_pages
    self.grammar_capacity = grammar_capacity  # (states, token classes) a slot's grammar may have; None: none
    self.num_slots, self.capacity, self.costs, self.seed = num_slots, capacity, costs, seed
    self.reset()

  def reset(self) -> None:
    """A fresh state with every slot free (after start-up, or when a failed call may have lost the state)."""
    self.holders: dict[int, Any] = {}
    self._free = collections.deque(range(self.num_slots))
    # On XLA:CPU a bfloat16 state of one row takes the slow 1-row dot path: it gets a second, never-used row.
    rows = self.rows(self.params, self.spec, self.num_slots)
    self.state = slots.empty_state(self.params, self.spec, batch=rows, capacity=self.capacity, costs=self.costs,
                                   seed=self.seed, grammar_capacity=self.grammar_capacity,
                                   block_size=self.block_size, num_pages=self.num_pages)

  @staticmethod
  def rows(params, spec: LoopSpec, num_slots: int) -> int:
    """The state's rows for num_slots slots."""
    return sharding.pad_rows(backend.batch_rows(params["target"], num_slots), spec.mesh)

  @property
  def free(self) -> int:
    return len(self._free)

  def free_slots(self) -> list:
    return list(self._free)

  def insert(self, holder, request: slots.Request, slot=None) -> int:
    """Prefill `request` into free slot `slot` (None: the first free one) held by `holder` -> the slot. If the
    insert raises, the slot stays free (see `lost`)."""
    if slot is None:
      slot = self._free[0]
    self._free.remove(slot)  # ValueError if it is not free
    try:
      self.state = slots.insert(self.params, self.state, np.int32(slot), request, self.spec)
    except Exception:
      self._free.appendleft(slot)
      raise
    self.holders[slot] = holder
    return slot

  def run(self, steps: int, loop=None) -> tuple:
    """Dispatch `steps` decode steps (`loop(params, state, spec, steps)`, decode_loop by default) and a snapshot
    -> (snapshot, the holders it belongs to). Asynchronous: jax.device_get(snapshot) waits for the device."""
    self.state = (loop or decode_loop)(self.params, self.state, self.spec, np.int32(steps))
    return slots.snapshot(self.state), dict(self.holders)

  def release(self, slot: int) -> None:
    self.state = slots.release(self.state, np.int32(slot))
    del self.holders[slot]
    self._free.append(slot)

  def set_speculation(self, enabled: bool) -> None:
    self.state = slots.set_speculation(self.state, enabled)

  def set_draft_caps(self, caps) -> None:
    """int32[num_slots]: each slot's draft-length cap (free slots' caps do not matter; padding rows get 0)."""
    rows = self.state.draft_cap.shape[0]
    full = np.zeros((rows,), np.int32)
    full[:len(caps)] = np.asarray(caps, np.int32)
    self.state = slots.set_draft_caps(self.state, full)

  # The block manager's and the tenants' writes go through the table, so a multi-host leader mirrors every device
  # call of the engine (serve/many_hosts/multihost.py).
  def set_page_tables(self, table) -> None:
    """int32[rows, pages_per_seq]: every KV cache's page table (the block manager's, between loop calls)."""
    self.state = slots.set_page_tables(self.state, table)

  def fill_pages(self, ids) -> None:
    """int32[n] page ids of every KV cache set to NaN (the test-only poison of freed pages)."""
    self.state = slots.fill_pages(self.state, jnp.asarray(ids))

  def forget_tenant(self, tenant: int) -> None:
    """The proposer's shared history of tenant id `tenant` dropped, before the id goes to another tenant (a
    proposer without per-tenant state keeps its state: spec_jax/proposers/base.py)."""
    self.state = without_tenant(self.spec.proposer, self.state, tenant)

  def prompt_logprobs(self, prompt_ids, top: int) -> list:
    """The prompt's raw logprobs (spec_jax/logprobs.py prompt_logprobs): one forward beside the loop."""
    return prompt_logprobs(self.params["target"], self.spec.config, list(prompt_ids), top)

  def lost(self) -> bool:
    """Whether the donated state is gone (a call failed after donating it): then only `reset` helps."""
    try:
      return any(x.is_deleted() for x in jax.tree.leaves(self.state))
    except Exception:
      return True
