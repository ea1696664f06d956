"""The host side of the paged KV cache: which pages of the pool each request holds, and the prefix cache.

The pool has `num_pages` pages of `block_size` tokens. Page 0 is the null page: never allocated, never cached; the
device sends writes of free rows and of positions past a row's reservation there. Pages 1 .. num_pages-1 are usable.
A request's page table (`table`) is an int32 row of `pages_per_seq = ceil(capacity / block_size)` entries; entry j
holds the page of positions j*block_size .. (j+1)*block_size - 1, and unassigned entries are 0.

Every usable page is in exactly one of three states:
- free: no owner, no hash (`_free`, a FIFO);
- used: reference count >= 1, held by that many requests (more than one only when shared through the prefix cache);
- cached: no owner but a hash, kept in LRU order (`_lru`) and evicted only when a page is needed and none is free.

Prefix caching follows vLLM V1's scheme: a page whose block_size tokens are all committed gets the hash
sha256(parent hash, salt, its tokens), so a hash names the whole prefix up to the page's end under one salt; a new
request shares the pages of its longest cached prefix (never the whole prompt: its last position is prefilled so its
logits exist). Only committed tokens are hashed, never drafts.

Over-reservation bound: with T = the tokens one loop call can commit for a row (steps per call x (lookahead + 1),
capped by its budget), a row reserved for `reserve(L + T)` holds ceil((L + T) / block_size) pages, at most
ceil(T / block_size) more than its committed L needs (the pages a call may fill); after `trim(L')` it holds
ceil(L' / block_size) pages, i.e. at most block_size - 1 token slots of slack in its last page and no wholly unused
page. So while calls run, R running rows over-reserve at most R x ceil(T / block_size) pages, and between calls none.
An engine that dispatches a call before reading the previous one's result has two calls in flight per row: T is then
both calls' tokens, and it may trim only past L + (the in-flight call's T), never into pages that call may commit.
Committed lengths here count tokens whose K/V are written (the decode state's cache.lengths = lengths - 1): a page
is hashed, and so shared, only when all its K/V are final.
"""

from __future__ import annotations

import collections
import hashlib
import json
from typing import Iterable, Optional, Sequence

import numpy as np

_ROOT = hashlib.sha256(b"spec_jax prefix cache v1").digest()  # the parent of every salt's first page


def make_salt(tenant: str, cache_salt: Optional[str] = None) -> str:
  """The prefix-cache salt of a request: its tenant plus vLLM's `cache_salt`, joined so no two pairs collide."""
  return json.dumps([tenant, cache_salt or ""])


def page_hash(parent: bytes, salt: str, tokens) -> bytes:
  """sha256 over a stable encoding of (parent hash, salt, a page's token ids); never Python's `hash` (salted)."""
  s = salt.encode("utf-8")
  toks = np.asarray(tokens, dtype="<i8")
  return hashlib.sha256(parent + len(s).to_bytes(8, "little") + s + toks.tobytes()).digest()


class PrefixHit(tuple):
  """`(pages, n_tokens)` from `lookup`; also carries the pages' hashes (so `allocate` can check the pages are
  still the ones found) and the number of prompt tokens queried (the prefix counters count it on admission)."""

  def __new__(cls, pages: list, n_tokens: int, hashes: list, n_query: int):
    hit = super().__new__(cls, (pages, n_tokens))
    hit.hashes, hit.n_query = hashes, n_query
    return hit


class BlockManager:
  """Pages of one pool for requests named by hashable ids. Pure host code: numpy and Python, no JAX."""

  def __init__(self, num_pages: int, block_size: int, capacity: int, *, enable_prefix_caching: bool = True,
               shuffle_seed: Optional[int] = None):
    """`capacity`: the most tokens one request holds (max_model_len). `shuffle_seed`: start the free list in a
    seeded random order, so no request's pages are contiguous (tests of kernels that must not assume it)."""
    if num_pages < 2 or block_size < 1 or capacity < 1:
      raise ValueError(f"need num_pages >= 2 (page 0 is the null page), block_size >= 1 and capacity >= 1; got "
                       f"num_pages={num_pages}, block_size={block_size}, capacity={capacity}")
    self.num_pages, self.block_size, self.capacity = num_pages, block_size, capacity
    self.pages_per_seq = -(-capacity // block_size)
    self.enable_prefix_caching, self.shuffle_seed = enable_prefix_caching, shuffle_seed
    self.prefix_queries = 0  # tokens looked up at admission (vLLM's prefix_cache_queries)
    self.prefix_hits = 0  # of which found cached (prefix_cache_hits)
    self.reset()

  def reset(self) -> None:
    """Every page free and nothing cached (a fresh pool: after a device failure its contents are gone). The
    prefix counters go on: they are monotonic metrics."""
    order = np.arange(1, self.num_pages)
    if self.shuffle_seed is not None:
      order = np.random.default_rng(self.shuffle_seed).permutation(order)
    self._free: collections.deque = collections.deque(int(p) for p in order)
    self._ref = np.zeros(self.num_pages, np.int32)
    self._lru: collections.OrderedDict = collections.OrderedDict()  # cached, unreferenced; oldest first
    self._hash_of_page: dict = {}  # every cached page, used or not
    self._page_of_hash: dict = {}
    self._pages: dict = {}  # req_id -> its pages, in position order
    self._hashes: dict = {}  # req_id -> the hashes of its full committed pages, in order (the chain goes on)
    self._salt: dict = {}
    self._committed: dict = {}
    self._freed: list = []  # pages whose contents became garbage since the last take_freed

  # ---- sizes ----
  def pages_for(self, n_tokens: int) -> int:
    return -(-n_tokens // self.block_size)

  @property
  def num_free(self) -> int:
    return len(self._free)

  @property
  def num_cached(self) -> int:
    """Cached pages no request holds: evictable."""
    return len(self._lru)

  @property
  def num_used(self) -> int:
    return self.num_pages - 1 - len(self._free) - len(self._lru)

  @property
  def num_available(self) -> int:
    """Pages an allocation can take: free ones, then cached ones by eviction."""
    return len(self._free) + len(self._lru)

  def usage(self) -> float:
    """The fraction of usable pages that requests hold (vLLM's kv_cache_usage_perc; cached-unreferenced is free)."""
    return self.num_used / (self.num_pages - 1)

  def fits_ever(self, n_tokens: int) -> bool:
    """Whether a request of n_tokens (prompt + max_tokens) fits in an otherwise empty pool and in one page table."""
    return 0 <= n_tokens <= self.capacity and self.pages_for(n_tokens) <= self.num_pages - 1

  # ---- per request ----
  def __contains__(self, req_id) -> bool:
    return req_id in self._pages

  def pages_of(self, req_id) -> list:
    return list(self._pages[req_id])

  def committed(self, req_id) -> int:
    return self._committed[req_id]

  def table(self, req_id) -> np.ndarray:
    """The request's page table: int32[pages_per_seq], its pages in position order, then 0 (the null page)."""
    row = np.zeros(self.pages_per_seq, np.int32)
    pages = self._pages[req_id]
    row[:len(pages)] = pages
    return row

  def _check_tokens(self, n_tokens: int, what: str) -> None:
    if n_tokens < 0 or n_tokens > self.capacity:
      raise ValueError(f"{what}={n_tokens} is outside 0..capacity={self.capacity}")

  def _take(self, n: int) -> list:
    """n pages for a new owner: free ones first, then the least recently used cached ones (their hashes dropped)."""
    out = []
    for _ in range(n):
      if self._free:
        p = self._free.popleft()
      else:
        p, _ = self._lru.popitem(last=False)
        del self._page_of_hash[self._hash_of_page.pop(p)]
        self._freed.append(p)  # its K/V is another prefix's: garbage to the new owner
      self._ref[p] = 1
      out.append(p)
    return out

  def _release(self, pages: Iterable[int]) -> None:
    """Drop one reference to each page; a page nobody holds goes to the LRU if cached, else to the free list."""
    for p in pages:
      self._ref[p] -= 1
      if self._ref[p] == 0:
        if p in self._hash_of_page:
          self._lru[p] = None
        else:
          self._free.append(p)
          self._freed.append(p)

  def allocate(self, req_id, n_tokens: int, *, salt: str = "", prefix: Optional[PrefixHit] = None) -> bool:
    """Admit `req_id` with pages for positions < n_tokens (its prompt plus one iteration's lookahead), sharing the
    pages of `prefix` (what `lookup` just returned for its prompt and this salt: the caller prefills only from
    prefix's n_tokens on). False, with nothing allocated, when the pool cannot give the rest."""
    if req_id in self._pages:
      raise ValueError(f"request {req_id!r} already holds pages")
    self._check_tokens(n_tokens, "n_tokens")
    shared, hashes = [], []
    if prefix is not None and prefix[1] > 0:
      shared, n_hit = list(prefix[0]), prefix[1]
      hashes = list(prefix.hashes)
      if n_hit != len(shared) * self.block_size or len(hashes) != len(shared) or n_hit >= max(n_tokens, 1):
        raise ValueError(f"prefix of {n_hit} tokens in {len(shared)} pages does not fit a {n_tokens}-token request")
      if any(self._page_of_hash.get(h) != p for p, h in zip(shared, hashes)):
        raise ValueError("prefix pages were evicted since lookup: look up again right before allocate")
    need = self.pages_for(n_tokens) - len(shared)
    revived = sum(1 for p in shared if self._ref[p] == 0)  # cached pages this takes out of the LRU
    if need > self.num_available - revived:
      return False
    for p in shared:
      self._ref[p] += 1
      self._lru.pop(p, None)
    self._pages[req_id] = shared + self._take(need)
    self._hashes[req_id] = hashes
    self._salt[req_id] = salt
    self._committed[req_id] = len(shared) * self.block_size
    if self.enable_prefix_caching and prefix is not None:
      self.prefix_queries += prefix.n_query
      self.prefix_hits += prefix[1]
    return True

  def reserve(self, req_id, upto_tokens: int) -> bool:
    """Extend the request's pages to cover positions < upto_tokens (what the next loop call can write; a call may
    cross several page boundaries). False, with nothing allocated, when the pool is short."""
    self._check_tokens(upto_tokens, "upto_tokens")
    pages = self._pages[req_id]
    need = self.pages_for(upto_tokens) - len(pages)
    if need <= 0:
      return True
    if need > self.num_available:
      return False
    pages.extend(self._take(need))
    return True

  def trim(self, req_id, committed_len: int) -> list:
    """Give back the request's pages wholly past committed_len (reserved for drafts a call did not commit) and
    return them; the page holding the last committed token stays."""
    self._check_tokens(committed_len, "committed_len")
    pages = self._pages[req_id]
    keep = self.pages_for(committed_len)
    if keep < len(self._hashes[req_id]):
      raise ValueError(f"trim to {committed_len} tokens would drop committed, hashed pages of {req_id!r}")
    dropped = pages[keep:]
    del pages[keep:]
    self._release(dropped)
    self._committed[req_id] = min(self._committed[req_id], committed_len)
    return dropped

  def commit(self, req_id, token_ids: Sequence[int], committed_len: int) -> None:
    """Record that the request's first committed_len tokens (token_ids[:committed_len]: prompt + committed output)
    have final K/V, and register each newly full page in the prefix cache."""
    pages = self._pages[req_id]
    if committed_len > len(pages) * self.block_size or committed_len > len(token_ids):
      raise ValueError(f"committed_len={committed_len} is past {req_id!r}'s {len(pages)} pages or its "
                       f"{len(token_ids)} tokens")
    hashes = self._hashes[req_id]
    if committed_len < len(hashes) * self.block_size:
      raise ValueError(f"committed_len={committed_len} went back before {req_id!r}'s hashed pages")
    self._committed[req_id] = committed_len
    if not self.enable_prefix_caching:
      return
    bs, salt = self.block_size, self._salt[req_id]
    for i in range(len(hashes), committed_len // bs):
      h = page_hash(hashes[-1] if hashes else _ROOT, salt, token_ids[i * bs:(i + 1) * bs])
      hashes.append(h)
      p = pages[i]
      if h not in self._page_of_hash and p not in self._hash_of_page:  # a twin computed at once stays uncached
        self._page_of_hash[h], self._hash_of_page[p] = p, h

  def free(self, req_id) -> None:
    """Release all of the request's pages (finished, aborted or preempted). Its cached pages stay cached, tail pages
    first in the LRU (so a prefix's head outlives its tail, as in vLLM)."""
    pages = self._pages.pop(req_id)
    del self._hashes[req_id], self._salt[req_id], self._committed[req_id]
    self._release(reversed(pages))

  # ---- prefix cache ----
  def lookup(self, token_ids: Sequence[int], salt: str = "") -> PrefixHit:
    """The pages of the longest cached run of full pages that starts the prompt, under this salt -> (pages,
    n_tokens). At least one prompt token is left to prefill. Valid until the next allocate or reserve."""
    n_query = len(token_ids)
    pages, hashes = [], []
    if self.enable_prefix_caching:
      bs, parent = self.block_size, _ROOT
      for i in range((n_query - 1) // bs if n_query else 0):
        h = page_hash(parent, salt, token_ids[i * bs:(i + 1) * bs])
        p = self._page_of_hash.get(h)
        if p is None:
          break
        pages.append(p)
        hashes.append(h)
        parent = h
    return PrefixHit(pages, len(pages) * self.block_size, hashes, n_query)

  def evict(self, n_pages: Optional[int] = None) -> int:
    """Move up to n_pages (all when None) cached, unreferenced pages to the free list, oldest first; -> how many."""
    n = len(self._lru) if n_pages is None else min(n_pages, len(self._lru))
    for _ in range(n):
      p, _ = self._lru.popitem(last=False)
      del self._page_of_hash[self._hash_of_page.pop(p)]
      self._free.append(p)
      self._freed.append(p)
    return n

  # ---- scheduling and tests ----
  @staticmethod
  def victim(running_ids_in_admission_order: Sequence):
    """The request to preempt when a row cannot get its pages: the most recently admitted (vLLM V1)."""
    if not running_ids_in_admission_order:
      raise ValueError("no running request to preempt")
    return running_ids_in_admission_order[-1]

  def take_freed(self) -> list:
    """Pages whose contents became garbage (freed or evicted) since the last call; the device side fills them with
    NaN in tests, so a read of stale K/V shows. Call it before each device write (a freed page may be reused)."""
    out, self._freed = self._freed, []
    return out

  def check_invariants(self) -> None:
    """Raise AssertionError unless free + used + cached = num_pages - 1, each page's reference count is its number
    of holders, only prefix-cached pages have two holders, and the hash maps agree."""
    usable = set(range(1, self.num_pages))
    free, lru = set(self._free), set(self._lru)
    holders = collections.Counter()
    for req, pages in self._pages.items():
      assert len(set(pages)) == len(pages), f"{req!r} holds a page twice: {pages}"
      assert len(pages) <= self.pages_per_seq, f"{req!r} holds {len(pages)} pages > {self.pages_per_seq}"
      hashes = self._hashes[req]
      assert len(hashes) <= len(pages) and self._committed[req] <= len(pages) * self.block_size
      for i, p in enumerate(pages):
        holders[p] += 1
        h = self._hash_of_page.get(p)
        assert h is None or (i < len(hashes) and hashes[i] == h), f"page {p} of {req!r} has another prefix's hash"
    used = set(holders)
    assert len(free) == len(self._free), "a page is twice in the free list"
    assert not (free & lru) and not (free & used) and not (lru & used), "a page is in two states"
    assert free | lru | used == usable, f"pages lost or invented: {sorted(usable ^ (free | lru | used))[:10]}"
    assert self._ref[0] == 0 and 0 not in self._hash_of_page, "the null page was allocated or cached"
    for p in usable:
      assert self._ref[p] == holders[p], f"page {p}: ref {self._ref[p]} but {holders[p]} holders"
      assert holders[p] <= 1 or p in self._hash_of_page, f"page {p} has {holders[p]} owners but is not cached"
    assert all(p in self._hash_of_page for p in lru) and not any(p in self._hash_of_page for p in free)
    assert len(self._page_of_hash) == len(self._hash_of_page)
    assert all(self._page_of_hash[h] == p for p, h in self._hash_of_page.items())
