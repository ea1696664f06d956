"""The KV pool as the device holds it: one block manager (serve/engine/block_manager.py) per data shard of the mesh.

With a `data` axis of d, the pool's page axis is split in d equal shares and the decode state's rows in d equal
runs; inside the loop each shard reads and writes only its own share (spec_jax/cache.py), so a row's pages must
come from its shard's share, whose first page is that shard's null page. Each share is therefore a block manager
of its own (local ids 0 .. per - 1, global id = shard * per + local), with its own free list, LRU and prefix cache:
a prefix cached on one shard cannot serve a request placed on another. The scheduler places each request on a shard
(serve/engine/kv_scheduler.py: the longest prefix hit, then the most free pages) and preempts within the shard that is
short. Without a data axis, d = 1 and this is the one block manager.
"""

from __future__ import annotations

from typing import Optional, Sequence

import numpy as np

from serve.engine.block_manager import BlockManager, PrefixHit


class ShardedPool:
  """`num_pages` pages (every shard's null page included) over `shards` block managers; requests are named by
  hashable ids and live on one shard each, chosen at `allocate`."""

  def __init__(self, num_pages: int, block_size: int, capacity: int, *, shards: int = 1,
               enable_prefix_caching: bool = True):
    if shards < 1 or num_pages // shards < 2:
      raise ValueError(f"a pool of {num_pages} pages cannot give each of {shards} data shards a null page and a "
                       f"usable one")
    self.shards, self.per_shard = shards, num_pages // shards
    self.num_pages = self.per_shard * shards  # a remainder would fit no shard's share
    self.block_size, self.enable_prefix_caching = block_size, enable_prefix_caching
    self.managers = [BlockManager(self.per_shard, block_size, capacity, enable_prefix_caching=enable_prefix_caching)
                     for _ in range(shards)]
    self.pages_per_seq = self.managers[0].pages_per_seq
    self._shard: dict = {}  # req_id -> its shard

  def reset(self) -> None:
    for m in self.managers:
      m.reset()
    self._shard.clear()

  # ---- sizes, over every shard (`usable`: pages that are not a null page) ----
  @property
  def usable(self) -> int:
    return self.num_pages - self.shards

  # Counts over every shard (the managers' own, summed).
  num_free = property(lambda self: sum(m.num_free for m in self.managers))
  num_cached = property(lambda self: sum(m.num_cached for m in self.managers))
  num_used = property(lambda self: sum(m.num_used for m in self.managers))
  prefix_queries = property(lambda self: sum(m.prefix_queries for m in self.managers))
  prefix_hits = property(lambda self: sum(m.prefix_hits for m in self.managers))

  def usage(self) -> float:
    return self.num_used / self.usable

  def pages_for(self, n_tokens: int) -> int:
    return -(-n_tokens // self.block_size)

  def fits_ever(self, n_tokens: int) -> bool:
    """Whether a request of n_tokens fits one shard's share when nothing else runs there."""
    return self.managers[0].fits_ever(n_tokens)

  def available(self, shard: int) -> int:
    return self.managers[shard].num_available

  # ---- per request ----
  def __contains__(self, req_id) -> bool:
    return req_id in self._shard

  def shard_of(self, req_id) -> int:
    return self._shard[req_id]

  def _m(self, req_id) -> BlockManager:
    return self.managers[self._shard[req_id]]

  def pages_of(self, req_id) -> list:
    return self._m(req_id).pages_of(req_id)

  def committed(self, req_id) -> int:
    return self._m(req_id).committed(req_id)

  def table(self, req_id) -> np.ndarray:
    """The request's page table in global ids: its pages, then its shard's null page."""
    return self.null_row(self._shard[req_id]) + self._m(req_id).table(req_id)

  def null_row(self, shard: int) -> np.ndarray:
    """A page table pointing only at `shard`'s null page (a row with no request)."""
    return np.full(self.pages_per_seq, shard * self.per_shard, np.int32)

  def lookup(self, token_ids: Sequence[int], salt: str, shard: int) -> PrefixHit:
    return self.managers[shard].lookup(token_ids, salt)

  def allocate(self, req_id, n_tokens: int, *, shard: int, salt: str = "",
               prefix: Optional[PrefixHit] = None) -> bool:
    if req_id in self._shard:
      raise ValueError(f"request {req_id!r} already holds pages")
    ok = self.managers[shard].allocate(req_id, n_tokens, salt=salt, prefix=prefix)
    if ok:
      self._shard[req_id] = shard
    return ok

  def reserve(self, req_id, upto_tokens: int) -> bool:
    return self._m(req_id).reserve(req_id, upto_tokens)

  def trim(self, req_id, committed_len: int) -> list:
    return self._m(req_id).trim(req_id, committed_len)

  def commit(self, req_id, token_ids: Sequence[int], committed_len: int) -> None:
    self._m(req_id).commit(req_id, token_ids, committed_len)

  def free(self, req_id) -> None:
    self._m(req_id).free(req_id)
    del self._shard[req_id]

  def take_freed(self) -> list:
    """Global ids of the pages whose contents became garbage since the last call (every shard)."""
    return [s * self.per_shard + p for s, m in enumerate(self.managers) for p in m.take_freed()]

  def check_invariants(self) -> None:
    for m in self.managers:
      m.check_invariants()
    held = {r for m in self.managers for r in m._pages}
    assert held == set(self._shard), "a request's shard and its pages disagree"
    for r, s in self._shard.items():
      assert r in self.managers[s], f"{r!r} is placed on shard {s} but holds no pages there"
