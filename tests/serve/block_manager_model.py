"""A slow second opinion on serve/engine/block_manager.py for its property test (tests/serve/test_block_manager.py).

`Model` keeps, in plain lists and dicts, who holds which page and which (salt, token prefix) each cached page
stands for (no hashing), and predicts every answer the block manager gives: whether an allocation fits, which
cached pages an allocation evicts (free pages first, then least recently freed), what a lookup finds, what trim and
take_freed return. `run_random_ops` drives random request lifetimes (admission with prefix reuse, loop calls that
reserve, write drafts, commit some and trim, preemption of the latest admitted and its recompute, finishing,
eviction, poisoning) through both, with a simulated device that writes token ids into the pages through the page
table and fills freed pages with POISON; after every operation each running request must read back its committed
tokens and each cached page its prefix's tokens.
"""

from __future__ import annotations

import collections

import numpy as np

from serve.engine.block_manager import BlockManager

POISON = -1


class Model:
  def __init__(self, num_pages: int, bs: int):
    self.num_pages, self.usable, self.bs = num_pages, num_pages - 1, bs
    self.pages: dict = {}  # rid -> its pages, in position order
    self.done: dict = {}  # rid -> how many of its leading pages commit has considered for the cache
    self.key_of: dict = {}  # page -> (salt, the tokens from position 0 to the page's end)
    self.page_of: dict = {}
    self.lru: list = []  # cached pages nobody holds, least recently freed first
    self.freed = collections.Counter()  # what take_freed owes
    self.evictions = 0

  def held(self) -> set:
    return {p for pages in self.pages.values() for p in pages}

  def n_free(self) -> int:
    return self.usable - len(self.held()) - len(self.lru)

  def npages(self, n_tokens: int) -> int:
    return -(-n_tokens // self.bs)

  def expect_lookup(self, tokens, salt) -> list:
    out = []
    for j in range(1, (len(tokens) - 1) // self.bs + 1 if tokens else 0):
      p = self.page_of.get((salt, tuple(tokens[:j * self.bs])))
      if p is None:
        break
      out.append(p)
    return out

  def _uncache(self, p) -> None:
    del self.page_of[self.key_of.pop(p)]
    self.lru.remove(p)
    self.freed[p] += 1

  def _take(self, new: list) -> None:
    """The manager gave `new` to an owner: free pages first, then the oldest cached ones."""
    held = self.held()
    n_evict = max(0, len(new) - self.n_free())
    evicted = self.lru[:n_evict]
    assert len(set(new)) == len(new) and all(1 <= p < self.num_pages and p not in held for p in new), \
        f"pages {new} handed out while held or out of range"
    assert set(new) & set(self.lru) == set(evicted), f"evicted {set(new) & set(self.lru)}, expected {evicted}"
    for p in evicted:
      self._uncache(p)
    self.evictions += len(evicted)

  def _release(self, pages) -> None:
    for p in pages:
      if p not in self.held():
        if p in self.key_of:
          self.lru.append(p)
        else:
          self.freed[p] += 1

  def allocate(self, rid, n_tokens, prefix: list, ok: bool, got: list) -> None:
    revived = [p for p in prefix if p in self.lru]
    need = self.npages(n_tokens) - len(prefix)
    assert ok == (need <= self.n_free() + len(self.lru) - len(revived)), f"allocate said {ok}"
    if not ok:
      return
    assert got[:len(prefix)] == prefix and len(got) == self.npages(n_tokens), f"{got} for {n_tokens}, {prefix}"
    self.pages[rid], self.done[rid] = list(prefix), len(prefix)
    for p in revived:
      self.lru.remove(p)
    self._take(got[len(prefix):])
    self.pages[rid] = list(got)

  def reserve(self, rid, upto, ok: bool, got: list) -> None:
    old = self.pages[rid]
    need = self.npages(upto) - len(old)
    assert ok == (need <= 0 or need <= self.n_free() + len(self.lru)), f"reserve said {ok}"
    if ok and need > 0:
      assert got[:len(old)] == old and len(got) == self.npages(upto), f"reserve({upto}) gave {got} after {old}"
      self._take(got[len(old):])
      self.pages[rid] = list(got)
    else:
      assert got == old

  def commit(self, rid, seq, L, salt) -> None:
    pages = self.pages[rid]
    for j in range(self.done[rid], L // self.bs):
      key, p = (salt, tuple(seq[:(j + 1) * self.bs])), pages[j]
      if key not in self.page_of and p not in self.key_of:
        self.page_of[key], self.key_of[p] = p, key
    self.done[rid] = max(self.done[rid], L // self.bs)

  def trim(self, rid, L, dropped: list) -> None:
    keep = self.npages(L)
    assert dropped == self.pages[rid][keep:], f"trim to {L} gave {dropped}, expected {self.pages[rid][keep:]}"
    self.pages[rid] = self.pages[rid][:keep]
    self._release(dropped)

  def free(self, rid) -> None:
    pages = self.pages.pop(rid)
    del self.done[rid]
    self._release(reversed(pages))

  def evict(self, n, got: int) -> None:
    assert got == min(n, len(self.lru))
    for p in list(self.lru[:got]):
      self._uncache(p)

  def take_freed(self, got: list) -> None:
    assert collections.Counter(got) == +self.freed, f"take_freed gave {sorted(got)}, expected {self.freed}"
    self.freed.clear()


class Bugs:
  """Planted bugs, each a subclass of the real manager; the property test must fail on every one."""
  TRIM_OFF_BY_ONE = "trim frees the page of the last committed token"
  RESERVE_SHORT = "reserve covers one position fewer"
  CACHE_FORGOTTEN = "a freed cached page goes to the free list"
  EVICT_NEWEST = "eviction takes the most recently freed page"
  WHOLE_PROMPT = "lookup may hit the whole prompt"
  SHARE_WITHOUT_REF = "a shared page's reference count is not raised"
  ALL = [TRIM_OFF_BY_ONE, RESERVE_SHORT, CACHE_FORGOTTEN, EVICT_NEWEST, WHOLE_PROMPT, SHARE_WITHOUT_REF]


def make_manager(bug, *args, **kw) -> BlockManager:
  class Buggy(BlockManager):
    def trim(self, req_id, committed_len):
      if bug == Bugs.TRIM_OFF_BY_ONE:
        committed_len = max(committed_len // self.block_size, len(self._hashes[req_id])) * self.block_size
      return super().trim(req_id, committed_len)

    def reserve(self, req_id, upto_tokens):
      return super().reserve(req_id, upto_tokens - (bug == Bugs.RESERVE_SHORT))

    def _release(self, pages):
      pages = list(pages)
      super()._release(pages)
      if bug == Bugs.CACHE_FORGOTTEN:
        for p in pages:
          if p in self._lru:
            del self._lru[p]
            del self._page_of_hash[self._hash_of_page.pop(p)]
            self._free.append(p)

    def _take(self, n):
      if bug != Bugs.EVICT_NEWEST:
        return super()._take(n)
      out = []
      for _ in range(n):
        if not self._free and self._lru:
          self._lru.move_to_end(next(reversed(self._lru)), last=False)
        out += super()._take(1)
      return out

    def lookup(self, token_ids, salt=""):
      return super().lookup(list(token_ids) + [0] * (bug == Bugs.WHOLE_PROMPT), salt)

    def allocate(self, req_id, n_tokens, *, salt="", prefix=None):
      ok = super().allocate(req_id, n_tokens, salt=salt, prefix=prefix)
      if ok and prefix is not None and bug == Bugs.SHARE_WITHOUT_REF:
        for p in prefix[0]:
          if self._ref[p] > 1:
            self._ref[p] -= 1
      return ok

  return (Buggy if bug else BlockManager)(*args, **kw)


def run_random_ops(seed: int, bs: int, n_ops: int, bug=None, capacity: int = 40) -> dict:
  """Random operations with shared prefixes; every answer checked against `Model` and the simulated device."""
  rng = np.random.default_rng(seed)
  pps = -(-capacity // bs)
  num_pages = 1 + pps * int(rng.integers(2, 4))  # two or three full-length requests: pressure, preemption
  bm = make_manager(bug, num_pages, bs, capacity, shuffle_seed=seed)
  model = Model(num_pages, bs)
  content = np.full((num_pages, bs), POISON, np.int64)
  bases = [rng.integers(3, 7, size=capacity) for _ in range(3)]  # a small vocabulary: twins and hits happen
  reqs, running, queue = {}, [], collections.deque()
  stats = collections.Counter()
  next_id = 0

  def new_request():
    n = int(rng.integers(2, capacity + 1))
    shared = int(rng.integers(0, n + 1))
    seq = list(bases[int(rng.integers(3))][:shared]) + list(rng.integers(3, 7, size=n - shared))
    return [int(t) for t in seq], int(rng.integers(1, n)), ["x", "y"][int(rng.integers(2))]

  def poison():
    got = bm.take_freed()
    model.take_freed(got)
    content[got] = POISON

  def write(rid, lo, hi, tokens):
    table = bm.table(rid)
    for pos in range(lo, hi):
      page = table[pos // bs]
      assert page != 0, f"position {pos} of {rid} is past its reservation: the write lands on the null page"
      content[page, pos % bs] = tokens[pos - lo]

  def check_reads():
    for rid in running:
      seq, L = reqs[rid]["seq"], reqs[rid]["L"]
      table = bm.table(rid)
      read = [int(content[table[pos // bs], pos % bs]) for pos in range(L)]
      assert read == seq[:L], f"request {rid} reads {read}, committed {seq[:L]}"
    for p in model.lru:
      assert list(content[p]) == list(model.key_of[p][1][-bs:]), f"cached page {p} lost its K/V"

  def release(rid, preempt):
    bm.free(rid)
    model.free(rid)
    running.remove(rid)
    r = reqs.pop(rid)
    if preempt:
      queue.appendleft((r["seq"], r["L"], r["salt"]))  # recompute from prompt + streamed tokens
      stats["preemptions"] += 1

  for _ in range(n_ops):
    op = rng.choice(["admit", "step", "step", "step", "finish", "lookup", "evict", "poison"])
    if op == "admit":
      recompute = bool(queue) and rng.random() < 0.7
      seq, plen, salt = queue.popleft() if recompute else new_request()
      prompt = seq[:plen]
      hit = bm.lookup(prompt, salt)
      assert hit[0] == model.expect_lookup(prompt, salt) and hit[1] == len(hit[0]) * bs, f"lookup {hit}"
      n = min(plen + int(rng.integers(0, 4)), capacity)
      rid, next_id = next_id, next_id + 1
      ok = bm.allocate(rid, n, salt=salt, prefix=hit)
      model.allocate(rid, n, hit[0], ok, bm.pages_of(rid) if ok else [])
      if not ok:
        stats["failed_allocations"] += 1
        if recompute:
          queue.appendleft((seq, plen, salt))
        continue
      stats["hits"] += hit[1] > 0
      stats["recompute_hits"] += recompute and hit[1] > 0
      poison()
      write(rid, hit[1], plen, prompt[hit[1]:])  # prefill only the rest
      reqs[rid] = dict(seq=seq, L=plen, salt=salt)
      running.append(rid)
      bm.commit(rid, seq, plen)
      model.commit(rid, seq, plen, salt)
    elif op == "step" and running:
      rid = running[int(rng.integers(len(running)))]
      r = reqs[rid]
      if r["L"] == len(r["seq"]):
        release(rid, False)
        continue
      upto = min(r["L"] + int(rng.integers(1, 7)), len(r["seq"]))
      ok = bm.reserve(rid, upto)
      model.reserve(rid, upto, ok, bm.pages_of(rid))
      if not ok:
        release(bm.victim(running), True)
        continue
      poison()
      a = int(rng.integers(1, upto - r["L"] + 1))  # accepted + bonus; the rest were drafts it rejected
      write(rid, r["L"], upto, r["seq"][r["L"]:r["L"] + a] + [1000 + i for i in range(upto - r["L"] - a)])
      r["L"] += a
      bm.commit(rid, r["seq"], r["L"])
      model.commit(rid, r["seq"], r["L"], r["salt"])
      dropped = bm.trim(rid, r["L"])
      model.trim(rid, r["L"], dropped)
      stats["trims"] += bool(dropped)
    elif op == "finish" and running:
      release(running[int(rng.integers(len(running)))], False)
    elif op == "lookup":
      seq, plen, salt = new_request()
      assert bm.lookup(seq[:plen], salt)[0] == model.expect_lookup(seq[:plen], salt)
    elif op == "evict":
      n = int(rng.integers(0, 3))
      model.evict(n, bm.evict(n))
    elif op == "poison":
      poison()
    bm.check_invariants()
    counts, expected = (bm.num_used, bm.num_cached, bm.num_free), (len(model.held()), len(model.lru), model.n_free())
    assert counts == expected, f"(used, cached, free) = {counts}, the model says {expected}"
    check_reads()
  stats["evictions"] = model.evictions
  return stats
