"""The engine's paged KV pool (issue 35): admission by pages, reservation before each loop call, trim after each
snapshot, preemption, prefix reuse, and the pool's metrics, over serve/engine/block_manager.py.

Pages are reserved after the target's K/V length (Snapshot.lengths - 1); pages are hashed only up to
Snapshot.kv_lengths, the tokens whose K/V every cache of the row holds (a proposer's cache may lag). A loop call of s steps with draft cap c commits at most c + 1
tokens a step and, in a tree, reads K/V up to `lookahead` past its last commit, so it needs T = s (c + 1) tokens of
pages (trees: (s - 1)(k + 1) + lookahead + 1), capped at the request's end (prompt + max_tokens + lookahead + 1,
within capacity). Writes past a row's pages land on the null page, which nothing committed reads.

Pipelining: the engine dispatches call i before it reads snapshot i - 1, so a row holds L + T(i - 1) + T(i) tokens
of pages while both are in flight (L: the K/V length of the last snapshot read), and is trimmed back to L + T(i)
when snapshot i - 1 is read: over-reservation per row is at most ceil(T(i - 1) + T(i)) / block_size pages while
calls run. Pages freed while a call that may still write them is in flight are safe: device work runs in dispatch
order, so a new owner's writes (and the test-only NaN poison) come after it.

When the pool is short before a call: first fewer steps (1), then draft cap 0 for the running rows of the segment
whose drafts are accepted least, then preemption of the most recently admitted request (vLLM V1's rule): its pages
are freed, it goes back to the front of the queue, and it resumes later by recompute from its prompt plus what it
has already streamed (`shortage` decides each move).

The scheduler owns the block manager and the requests' page bookkeeping; it never changes the engine. It reads the
slot table's view (free slots, holders) and the loop's spec as arguments, and returns decisions as values: a
`Placement` for an admission and a `Reservation` for a loop call (the steps and caps it may run, the requests it
preempted, the page table, the pages to poison), which serve/engine/engine.py applies.

On a mesh with a `data` axis the pool is one block manager per data shard (serve/engine/sharded_pool.py): a request is
placed on the shard of a free slot with the longest prefix hit, then the most pages to spare, and a shard that is
short cuts speculation and preempts among its own rows only.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np

from serve.engine.block_manager import BlockManager, PrefixHit, make_salt
from serve.engine.sharded_pool import ShardedPool
from spec_jax import sharding, slots
from spec_jax.cache import pool_bytes

log = logging.getLogger("spec_jax.engine")


def page_bytes(params, spec, *, rows: int, capacity: int, block_size: int, grammar_capacity=None) -> tuple:
  """-> (bytes one page holds in every KV cache of the decode state, of which the proposer's): traced only."""
  state = jax.eval_shape(lambda p: slots.empty_state(p, spec, batch=rows, capacity=capacity, block_size=block_size,
                                                     num_pages=2 * max(1, rows), grammar_capacity=grammar_capacity),
                         params)
  def per_page(tree):
    nbytes, pages = pool_bytes(tree)
    return nbytes // pages if pages else 0
  return per_page(state), per_page(state.pstate)


def pool_pages(*, num_kv_blocks: int, kv_cache_memory_bytes: int, bytes_per_page: int, max_num_seqs: int,
               capacity: int, block_size: int, shards: int = 1) -> int:
  """The pool in pages (each data shard's null page included): from bytes, else pages, else fixed slots' worth;
  a multiple of the data shards (each holds an equal share)."""
  if num_kv_blocks < 0 or kv_cache_memory_bytes < 0 or block_size < 1:
    raise ValueError("--num_kv_blocks and --kv_cache_memory_bytes must be >= 0, --block_size >= 1")
  if kv_cache_memory_bytes:
    n = kv_cache_memory_bytes // bytes_per_page
    what = f"--kv_cache_memory_bytes={kv_cache_memory_bytes} ({bytes_per_page} bytes a page)"
  elif num_kv_blocks:
    n, what = num_kv_blocks, f"--num_kv_blocks={num_kv_blocks}"
  else:
    return shards * (1 + -(-max_num_seqs // shards) * -(-capacity // block_size))
  if n // shards < 2:
    raise ValueError(f"{what} is {n} pages: the pool needs at least 2 per data shard ({shards}; page 0 of each "
                     f"share is its null page)")
  return n // shards * shards


def plan(params, spec, flags, *, rows: int, max_num_seqs: int, capacity: int, grammar_capacity=None):
  """The pool from the flags (dict: block_size, num_kv_blocks, kv_cache_memory_bytes, enable_prefix_caching,
  poison_freed_pages) -> KVScheduler's keyword arguments, or None for fixed slots (flags None)."""
  if flags is None:
    return None
  bs = int(flags.get("block_size", 16))
  if bs < 1:
    raise ValueError(f"--block_size must be >= 1, got {bs}")
  total, proposer = page_bytes(params, spec, rows=rows, capacity=capacity, block_size=bs,
                               grammar_capacity=grammar_capacity)
  n = pool_pages(num_kv_blocks=int(flags.get("num_kv_blocks") or 0),
                 kv_cache_memory_bytes=int(flags.get("kv_cache_memory_bytes") or 0), bytes_per_page=total,
                 max_num_seqs=max_num_seqs, capacity=capacity, block_size=bs,
                 shards=sharding.axis_size(spec.mesh, "data"))
  return dict(num_pages=n, block_size=bs, enable_prefix_caching=bool(flags.get("enable_prefix_caching", True)),
              poison_freed_pages=bool(flags.get("poison_freed_pages", False)), bytes_per_page=total,
              speculation_yields=bool(flags.get("kv_speculation_yields", True)),
              proposer_bytes_per_page=proposer)


@dataclasses.dataclass(frozen=True)
class Placement:
  """An admission's pages: insert device request `dev` into `slot` (a free slot of the data shard the pages are
  on; None: any), after NaN into pages `poison` (test-only; None: none)."""

  dev: Any
  slot: Optional[int] = None
  poison: Optional[np.ndarray] = None


@dataclasses.dataclass(frozen=True)
class Reservation:
  """The pages of a loop call: run `steps` steps with draft caps `caps`, after freeing the slots of `preempted`
  (their pages are back; they go to the head of the queue, in this order: the latest admitted first), NaN into
  pages `poison` (test-only; None: none) and the page table `table` int32[rows, pages_per_seq] set."""

  steps: int
  caps: np.ndarray
  preempted: tuple
  table: np.ndarray
  poison: Optional[np.ndarray] = None


@dataclasses.dataclass(frozen=True)
class FewerSteps:
  steps: int


@dataclasses.dataclass(frozen=True)
class CutSpeculation:
  """Draft cap 0 for these slots (the running rows of the short shard's segment that gains least)."""

  slots: tuple


@dataclasses.dataclass(frozen=True)
class Preempt:
  req: Any


def shortage(steps: int, need, available, rows, caps, shard_of: Callable, yields: bool):
  """The next move when the pool may be short before a call -> None (every shard has the pages), FewerSteps,
  CutSpeculation or Preempt. need, available: pages per data shard; rows: (slot, request) running, in admission
  order; caps: their draft caps; yields: speculation gives way (fewer steps, no drafts) before a preemption."""
  short = [sh for sh in range(len(need)) if need[sh] > available[sh]]
  if not short:
    return None
  if steps > 1 and yields:
    return FewerSteps(1)
  mine = [(slot, r) for slot, r in rows if shard_of(slot) == short[0]]
  cut = cut_speculation(mine, caps) if yields else ()
  if cut:
    return CutSpeculation(cut)
  return Preempt(BlockManager.victim([r for _, r in mine]))


def cut_speculation(rows, caps) -> tuple:
  """The slots of `rows` ((slot, request)) in the drafting segment that gains least (its rows' accepted /
  drafted), or () when no row drafts."""
  gain: dict = {}
  for slot, r in rows:
    if caps[slot] > 0:
      d, a = gain.get(r.segment, (0, 0))
      gain[r.segment] = (d + r.drafted, a + r.accepted)
  if not gain:
    return ()
  worst = min(gain, key=lambda seg: gain[seg][1] / max(gain[seg][0], 1))
  return tuple(slot for slot, r in rows if r.segment == worst)


class KVScheduler:
  """The block manager, driven by the engine thread. spec_of: the loop's spec as the engine holds it now; rows:
  the decode state's rows; metrics: where the pool's gauges and counters go."""

  def __init__(self, *, spec_of: Callable, capacity: int, rows: int, metrics, num_pages: int, block_size: int,
               enable_prefix_caching: bool = True, poison_freed_pages: bool = False, bytes_per_page: int = 0,
               proposer_bytes_per_page: int = 0, speculation_yields: bool = True):
    self.spec_of, self.capacity, self.metrics = spec_of, capacity, metrics
    self.shards = sharding.axis_size(spec_of().mesh, "data")
    self.rows = int(rows)  # the state's rows: `shards` equal runs
    self.bm = ShardedPool(num_pages, block_size, capacity, shards=self.shards,
                          enable_prefix_caching=enable_prefix_caching)
    self.block_size, self.poison = block_size, poison_freed_pages
    self.bytes_per_page, self.proposer_bytes_per_page = bytes_per_page, proposer_bytes_per_page
    self.preemptions = 0
    self.speculation_yields = speculation_yields
    # Pages held past each row's committed K/V (the reservation for calls in flight), summed over rows, at each
    # reserve: the over-reservation the module docstring bounds, measured.
    self.over = {"calls": 0, "sum": 0, "max": 0, "held_sum": 0}
    self.shrunk_steps = self.shrunk_caps = 0  # calls run with fewer steps, segments set to draft cap 0, for pages
    self.peak_rows = 0  # the most rows one call ran (the tests read it)
    self._counted = (0, 0)  # the manager's prefix counters already added to the metrics
    self._seq = 0  # admissions so far: the preemption order
    m = metrics
    m.kv_pages.set(self.bm.usable)
    m.cache_config.labels(block_size=str(block_size), num_gpu_blocks=str(num_pages),
                          enable_prefix_caching=str(bool(enable_prefix_caching))).set(1)
    m.kv_page_bytes.labels(holder="all").set(bytes_per_page)
    m.kv_page_bytes.labels(holder="proposer").set(proposer_bytes_per_page)

  def describe(self) -> str:
    n = self.bm.usable
    full = self.shards * ((self.bm.per_shard - 1) // self.bm.pages_per_seq)
    shards = f" in {self.shards} data shards' shares" if self.shards > 1 else ""
    return (f"KV pool: {n} pages of {self.block_size} tokens = {n * self.block_size} tokens{shards}, "
            f"{n * self.bytes_per_page / 2**20:.1f} MiB ({self.proposer_bytes_per_page}/{self.bytes_per_page} bytes "
            f"a page are the proposer's); holds {full} request(s) of {self.capacity} tokens; prefix caching "
            f"{'on' if self.bm.enable_prefix_caching else 'off'}")

  def reset(self) -> None:
    self.bm.reset()

  # ---- sizes
  def shard_of_slot(self, slot: int) -> int:
    return slot * self.shards // self.rows

  def end(self, req) -> int:
    """The most tokens of pages the request can ever use."""
    return min(len(req.prompt_ids) + req.max_new + self.spec_of().lookahead + 1, self.capacity)

  def tokens_per_call(self, steps: int, cap: int) -> int:
    spec = self.spec_of()
    if spec.proposer.tree is not None and cap > 0:
      return (steps - 1) * (spec.k_max + 1) + spec.lookahead + 1
    return steps * (cap + 1)

  def check_fits(self, prompt_len: int, max_new: int) -> None:
    """ValueError naming max_tokens when the request could not fit even in an empty pool (the server's 400)."""
    need = min(prompt_len + max_new + self.spec_of().lookahead + 1, self.capacity)
    if not self.bm.fits_ever(need):
      e = ValueError(f"the prompt ({prompt_len} tokens) plus max_tokens={max_new} needs {self.bm.pages_for(need)} "
                     f"KV pages of {self.block_size} tokens; "
                     + ("the whole pool" if self.shards == 1 else "a data shard's share of the pool")
                     + f" has {self.bm.per_shard - 1}")
      e.field = "max_tokens"
      raise e

  def max_new_ever(self, prompt_len: int) -> int:
    """The most tokens a request of prompt_len could ask for and still fit in an empty pool (its shard's share)."""
    return (self.bm.per_shard - 1) * self.block_size - prompt_len - self.spec_of().lookahead - 1

  # ---- admission
  def admit(self, req, free_slots, holders) -> Optional[Placement]:
    """Pages for the request's prompt (plus its streamed tokens on a resume) and one call, on the data shard of one
    of `free_slots` (the slot table's; holders: its running requests by slot) -> its Placement (req.kv_slot: the
    slot), or None when the pool cannot give them (it waits, first in line)."""
    spec = self.spec_of()
    tokens = list(req.prompt_ids) + list(req.out_ids)
    prefill = len(tokens) - (1 if req.out_ids else 0)  # a resume feeds its last streamed token next
    salt = make_salt(req.tenant, req.cache_salt)
    first = min(self.end(req), len(tokens) + self.tokens_per_call(1, spec.k_max))
    best = None
    for slot in self._one_free_slot_per_shard(free_slots):
      shard = self.shard_of_slot(slot)
      hit = self.bm.lookup(tokens[:prefill], salt, shard)  # leaves at least one position to prefill
      keep = slots.usable_prefix(spec, hit[1], self.block_size) // self.block_size
      # Leave the shard's running rows pages for one step without drafts: an admission should not force a
      # preemption.
      spare = self.bm.available(shard) - self._headroom(shard, holders) - (self.bm.pages_for(first) - keep)
      score = (spare >= 0, keep, spare)
      if best is None or score > best[0]:
        best = (score, slot, shard, PrefixHit(hit[0][:keep], keep * self.block_size, hit.hashes[:keep],
                                              hit.n_query))
    if best is None or not best[0][0]:
      return None
    _, slot, shard, hit = best
    key = (req.id, req.admissions)
    if not self.bm.allocate(key, first, shard=shard, salt=salt, prefix=hit):
      return None
    req.kv_slot = slot
    poison = self._freed()
    pages = self.bm.table(key)
    req.kv_key, req.kv_len, req.inflight = key, prefill, []
    if not req.out_ids:  # the first admission: what the prompt found cached (a resume's hit is not the client's)
      req.cached_tokens = hit[1]
    req.admissions += 1
    self._seq += 1
    req.admit_seq = self._seq
    self.metrics_update()
    if not req.out_ids and not hit[1]:
      return Placement(req.device_req.replace(pages=jnp.asarray(pages)), slot, poison)
    return Placement(req.remake(req.prompt_ids, max_new=req.max_new, pages=pages, output_ids=list(req.out_ids),
                                cached=hit[1]), slot, poison)

  def _one_free_slot_per_shard(self, free_slots) -> list:
    by_shard = {}
    for slot in free_slots:
      by_shard.setdefault(self.shard_of_slot(slot), slot)
    return list(by_shard.values())

  def _headroom(self, shard: int, holders) -> int:
    """Pages the shard's running rows need for their next call at one step without drafts."""
    need = 0
    for slot, r in holders.items():
      if self.shard_of_slot(slot) == shard and r.kv_key is not None and r.kv_key in self.bm:
        n = min(self.end(r), r.kv_len + sum(r.inflight) + self.tokens_per_call(1, 0))
        need += max(0, self.bm.pages_for(n) - len(self.bm.pages_of(r.kv_key)))
    return need

  def admitted(self, req) -> None:
    """The insert is done: the prompt's full pages go into the prefix cache (EAGLE's last position is written by
    the first step: the next snapshot's kv_lengths commits it)."""
    tokens = list(req.prompt_ids) + list(req.out_ids)
    self.bm.commit(req.kv_key, tokens, max(req.kv_len - 1, self.bm.committed(req.kv_key)))

  def release(self, req) -> None:
    """The request's pages go back (finished, aborted, failed or preempted)."""
    if getattr(req, "kv_key", None) is not None and req.kv_key in self.bm:
      self.bm.free(req.kv_key)
    req.kv_key, req.inflight = None, []

  # ---- before each loop call
  def reserve(self, steps: int, caps: np.ndarray, holders) -> Reservation:
    """Pages for the call about to be dispatched, for every running row (holders: slot -> request; caps: their
    draft caps) -> the Reservation: fewer steps, lower caps or preempted requests when the pool is short."""
    caps, holders, preempted = np.array(caps), dict(holders), []
    while True:
      rows = sorted(holders.items(), key=lambda it: it[1].admit_seq)
      want = [(r, min(self.end(r), r.kv_len + sum(r.inflight) + self.tokens_per_call(steps, int(caps[s]))))
              for s, r in rows]
      need = [0] * self.shards
      for (slot, _), (r, n) in zip(rows, want):
        need[self.shard_of_slot(slot)] += max(0, self.bm.pages_for(n) - len(self.bm.pages_of(r.kv_key)))
      move = shortage(steps, need, [self.bm.available(sh) for sh in range(self.shards)], rows, caps,
                      self.shard_of_slot, self.speculation_yields)
      if move is None:
        break
      if isinstance(move, FewerSteps):
        steps = move.steps
        self.shrunk_steps += 1
      elif isinstance(move, CutSpeculation):
        caps[list(move.slots)] = 0
        self.shrunk_caps += 1
      else:
        self._preempt(move.req)
        del holders[move.req.slot]
        preempted.append(move.req)
    self.peak_rows = max(self.peak_rows, len(rows))
    for (slot, r), (_, n) in zip(rows, want):
      assert self.bm.reserve(r.kv_key, n)
      r.inflight.append(self.tokens_per_call(steps, int(caps[slot])))
    poison = self._freed()
    over = sum(len(self.bm.pages_of(r.kv_key)) - self.bm.pages_for(r.kv_len) for _, r in rows)
    o = self.over
    o["calls"], o["sum"], o["max"] = o["calls"] + 1, o["sum"] + over, max(o["max"], over)
    o["held_sum"] += sum(len(self.bm.pages_of(r.kv_key)) for _, r in rows)
    table = np.stack([self.bm.null_row(self.shard_of_slot(i)) for i in range(self.rows)])
    for slot, r in rows:
      table[slot] = self.bm.table(r.kv_key)
    self.metrics_update()
    return Reservation(steps, caps, tuple(preempted), table, poison)

  def _preempt(self, req) -> None:
    """Its pages go back now (the engine frees its slot and queues it again: the Reservation's `preempted`)."""
    log.info("preempting %s (KV pool short: %d pages free or cached)", req.id, self.bm.num_free + self.bm.num_cached)
    self.release(req)
    self.preemptions += 1
    self.metrics.num_preemptions.inc()

  # ---- after each snapshot
  def observe(self, arr, slot: int, req) -> None:
    """Snapshot `arr` is read: commit (and hash) the row's K/V, give back pages past the calls still in flight."""
    if req.finished or req.kv_key is None or req.kv_key not in self.bm or not req.inflight:
      return
    req.inflight.pop(0)
    n = int(arr.kv_lengths[slot])  # K/V in every cache: what may be hashed and shared
    self.bm.commit(req.kv_key, arr.tokens[slot, :n].tolist(), n)
    # The target's K/V: the next calls write after it (a draft model's or EAGLE's cache may lag behind)
    req.kv_len = max(n, int(arr.lengths[slot]) - 1)
    self.bm.trim(req.kv_key, min(self.capacity, req.kv_len + sum(req.inflight)))

  def _freed(self) -> Optional[np.ndarray]:
    """Test-only: the pages freed since the last device write, to fill with NaN before the next one (padded to a
    power of two of ids, so the fill compiles a few times only); None when not poisoning (the list is dropped)."""
    freed = self.bm.take_freed()
    if not (self.poison and freed):
      return None
    ids = np.full((1 << (len(freed) - 1).bit_length(),), freed[0], np.int32)
    ids[:len(freed)] = freed
    return ids

  def metrics_update(self) -> None:
    m, bm = self.metrics, self.bm
    m.kv_cache_usage.set(bm.usage())
    q, h = bm.prefix_queries, bm.prefix_hits
    m.prefix_cache_queries.inc(q - self._counted[0])
    m.prefix_cache_hits.inc(h - self._counted[1])
    self._counted = (q, h)
    m.kv_proposer_bytes.set(bm.num_used * self.proposer_bytes_per_page)

  def to_json(self) -> dict:
    bm = self.bm
    return {"kv_pages": bm.usable, "kv_data_shards": self.shards, "kv_block_size": self.block_size,
            "kv_pages_used": bm.num_used,
            "kv_pages_cached": bm.num_cached, "kv_cache_usage_perc": round(bm.usage(), 4),
            "kv_bytes_per_page": self.bytes_per_page, "kv_proposer_bytes_per_page": self.proposer_bytes_per_page,
            "num_preemptions": self.preemptions, "kv_shrunk_steps": self.shrunk_steps,
            "kv_shrunk_caps": self.shrunk_caps, "prefix_cache_queries": bm.prefix_queries,
            "prefix_cache_hits": bm.prefix_hits,
            "kv_over_reserved_pages_mean": round(self.over["sum"] / max(self.over["calls"], 1), 2),
            "kv_over_reserved_pages_max": self.over["max"],
            "kv_over_reserved_frac": round(self.over["sum"] / max(self.over["held_sum"], 1), 4)}
