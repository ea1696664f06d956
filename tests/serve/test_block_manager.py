"""serve/engine/block_manager.py: pages, reservation, trimming, the prefix cache, preemption's choice, and a property test
that drives random request lifetimes against a slow plain model and a simulated device (tests/serve/
block_manager_model.py), which must catch each of a few planted bugs."""

from __future__ import annotations

import numpy as np
import pytest

from serve.engine.block_manager import BlockManager, make_salt
from tests.serve.block_manager_model import Bugs, run_random_ops


def test_allocate_reserve_trim_free_and_the_table():
  bm = BlockManager(num_pages=8, block_size=4, capacity=20)
  assert bm.pages_per_seq == 5
  assert bm.allocate("a", 6)  # positions 0..5: two pages
  np.testing.assert_array_equal(bm.table("a"), [1, 2, 0, 0, 0])
  assert bm.table("a").dtype == np.int32
  assert bm.reserve("a", 6) and bm.pages_of("a") == [1, 2]  # already covered: nothing new
  assert bm.reserve("a", 13) and bm.pages_of("a") == [1, 2, 3, 4]
  assert bm.trim("a", 9) == [4]  # position 8 is in page 3; page 4 is wholly past
  assert bm.trim("a", 8) == [3]  # 8 tokens fill pages 1 and 2 exactly
  assert bm.num_used == 2 and bm.num_free == 5 and bm.usage() == pytest.approx(2 / 7)
  bm.check_invariants()
  bm.free("a")
  assert bm.num_used == 0 and bm.num_free == 7 and "a" not in bm
  bm.check_invariants()


def test_a_failed_allocation_or_reservation_takes_nothing():
  bm = BlockManager(num_pages=5, block_size=2, capacity=20)  # 4 usable pages
  assert bm.allocate("a", 4)
  assert not bm.allocate("b", 5)  # needs 3, 2 left
  assert "b" not in bm and bm.num_free == 2
  assert not bm.reserve("a", 10)  # needs 3 more
  assert bm.pages_of("a") == [1, 2] and bm.num_free == 2
  assert bm.reserve("a", 8) and bm.num_free == 0
  bm.check_invariants()
  with pytest.raises(ValueError, match="already holds"):
    bm.allocate("a", 1)
  with pytest.raises(ValueError, match="capacity"):
    bm.reserve("a", 21)


@pytest.mark.parametrize("block_size", [1, 2])
def test_a_reserve_crosses_several_page_boundaries_at_once(block_size):
  # one verify commits k + 1 = 5 tokens: its reservation must cover every one (ROCm ATOM #250 under-allocated)
  bm = BlockManager(num_pages=16, block_size=block_size, capacity=12)
  assert bm.allocate("a", 3)
  bm.commit("a", [7, 8, 9], 3)
  assert bm.reserve("a", 3 + 5)
  table = bm.table("a")
  assert all(table[pos // block_size] != 0 for pos in range(8))  # no position of the call lands on the null page
  assert len(set(table[:bm.pages_for(8)])) == bm.pages_for(8)
  assert table[bm.pages_for(8):].sum() == 0
  bm.commit("a", [7, 8, 9, 1, 2, 3], 6)  # 3 of the 5 committed
  assert len(bm.trim("a", 6)) == bm.pages_for(8) - bm.pages_for(6)
  bm.check_invariants()


def test_fits_ever():
  bm = BlockManager(num_pages=9, block_size=4, capacity=64)  # 8 usable pages = 32 tokens, under capacity
  assert bm.fits_ever(32) and bm.fits_ever(1)
  assert not bm.fits_ever(33)  # over the whole pool
  big = BlockManager(num_pages=100, block_size=4, capacity=64)
  assert big.fits_ever(64) and not big.fits_ever(65)  # over max_model_len


def test_no_tail_leak_after_many_requests_run_to_the_end():
  # the over-reserved tail must come back at the end (sglang-jax #1147, sglang #13826 / #31616 leaked it)
  rng = np.random.default_rng(3)
  bm = BlockManager(num_pages=40, block_size=4, capacity=64)
  start = bm.num_free + bm.num_cached
  for r in range(200):
    toks = [int(t) for t in rng.integers(3, 50, size=int(rng.integers(1, 30)))]
    prompt = toks[:max(1, len(toks) // 2)]
    hit = bm.lookup(prompt)
    assert bm.allocate(r, len(prompt) + 3, prefix=hit)
    bm.commit(r, toks, len(prompt))
    L = len(prompt)
    while L < len(toks):
      assert bm.reserve(r, min(L + 5, 64))  # more than the call will commit
      L = min(L + int(rng.integers(1, 6)), len(toks))
      bm.commit(r, toks, L)
      bm.trim(r, L)
    bm.free(r)
    bm.check_invariants()
  assert bm.num_used == 0 and bm.num_free + bm.num_cached == start == 39
  assert bm.num_cached > 0  # some pages were full and stayed cached


def test_prefix_hit_shares_pages_counts_tokens_and_leaves_a_token_to_prefill():
  bm = BlockManager(num_pages=20, block_size=4, capacity=40)
  doc = list(range(10, 22))  # 12 tokens: three full pages
  assert bm.allocate("a", 12, salt="t")
  bm.commit("a", doc, 12)
  a_pages = bm.pages_of("a")
  pages, n = bm.lookup(doc + [99, 98], "t")
  assert (pages, n) == (a_pages, 12)
  pages, n = bm.lookup(doc, "t")  # the whole prompt is cached, but its last position must be computed
  assert (pages, n) == (a_pages[:2], 8)
  hit = bm.lookup(doc + [5], "t")
  assert bm.allocate("b", 13 + 2, salt="t", prefix=hit)
  assert bm.pages_of("b")[:3] == a_pages and not set(bm.pages_of("b")[3:]) & set(a_pages)
  assert bm.prefix_queries == 13 and bm.prefix_hits == 12
  bm.check_invariants()
  bm.free("a")
  assert bm.num_cached == 0 and bm.num_used == 4  # shared pages still held by b
  bm.check_invariants()


def test_another_salt_never_hits():
  bm = BlockManager(num_pages=20, block_size=2, capacity=40)
  doc = [5, 6, 7, 8, 9]
  assert bm.allocate("a", 5, salt=make_salt("alice"))
  bm.commit("a", doc, 5)
  assert bm.lookup(doc, make_salt("alice"))[1] == 4
  assert bm.lookup(doc, make_salt("bob")) == ([], 0)
  assert bm.lookup(doc, make_salt("alice", "s1")) == ([], 0)  # vLLM's cache_salt separates too
  assert make_salt("a|", "b") != make_salt("a", "|b")
  off = BlockManager(num_pages=20, block_size=2, capacity=40, enable_prefix_caching=False)
  assert off.allocate("a", 5)
  off.commit("a", doc, 5)
  off.free("a")
  assert off.lookup(doc) == ([], 0) and off.num_cached == 0


def test_freed_cached_pages_wait_in_lru_order_and_go_only_when_needed():
  bm = BlockManager(num_pages=7, block_size=2, capacity=12)  # 6 usable
  assert bm.allocate("a", 4)
  bm.commit("a", [1, 2, 3, 4], 4)
  assert bm.allocate("b", 4)
  bm.commit("b", [5, 6, 7, 8], 4)
  a, b = bm.pages_of("a"), bm.pages_of("b")
  bm.free("a")
  bm.free("b")
  assert bm.num_cached == 4 and bm.num_free == 2
  assert bm.take_freed() == []  # cached pages keep their K/V: never poisoned
  assert bm.allocate("c", 4)  # the two free pages first: nothing evicted
  assert bm.lookup([1, 2, 3, 4, 0])[1] == 4 and bm.lookup([5, 6, 7, 8, 0])[1] == 4
  assert bm.allocate("d", 2)  # one eviction: a's tail page, the least recently freed and a tail before its head
  assert bm.pages_of("d") == [a[1]] and bm.take_freed() == [a[1]]
  assert bm.lookup([1, 2, 3, 4, 0]) == ([a[0]], 2) and bm.lookup([5, 6, 7, 8, 0]) == (b, 4)
  bm.check_invariants()
  assert bm.evict() == 3 and bm.num_cached == 0 and bm.lookup([5, 6, 7, 8, 0]) == ([], 0)
  bm.check_invariants()


def test_a_prefix_evicted_after_lookup_is_refused_and_allocate_never_evicts_what_it_shares():
  bm = BlockManager(num_pages=5, block_size=2, capacity=8)  # 4 usable
  assert bm.allocate("a", 4)
  bm.commit("a", [1, 2, 3, 4], 4)
  bm.free("a")
  hit = bm.lookup([1, 2, 3, 4, 5])
  assert hit[1] == 4
  assert bm.allocate("b", 5 + 3, prefix=hit)  # 2 shared + 2 new: the 2 free ones, not the shared cached ones
  assert bm.pages_of("b")[:2] == hit[0]
  bm.check_invariants()
  bm.free("b")
  hit = bm.lookup([1, 2, 3, 4, 5])
  assert bm.allocate("c", 8)  # evicts the cached pages
  with pytest.raises(ValueError, match="evicted since lookup"):
    bm.allocate("d", 5, prefix=hit)


def test_a_preempted_request_is_the_latest_admitted_and_hits_its_own_pages_on_recompute():
  bm = BlockManager(num_pages=12, block_size=4, capacity=32)
  running = []
  for r, prompt in enumerate([[1] * 6, [2] * 6, [3] * 6]):
    assert bm.allocate(r, 6, salt="t")
    bm.commit(r, prompt, 6)
    running.append(r)
  seq = [3] * 6 + [4, 5, 6, 7, 8]  # request 2 streamed five tokens
  assert bm.reserve(2, 11)
  bm.commit(2, seq, 11)
  bm.trim(2, 11)
  assert BlockManager.victim(running) == 2
  bm.free(2)
  running.pop()
  pages, n = bm.lookup(seq, "t")  # recomputed from prompt + streamed tokens
  assert n == 8 and len(pages) == 2
  assert bm.allocate(2, 11, salt="t", prefix=bm.lookup(seq, "t"))
  assert bm.prefix_hits == 8
  bm.check_invariants()
  with pytest.raises(ValueError):
    BlockManager.victim([])


def test_commit_and_trim_refuse_lengths_that_would_corrupt_the_cache():
  bm = BlockManager(num_pages=10, block_size=2, capacity=20)
  assert bm.allocate("a", 4)
  with pytest.raises(ValueError, match="past"):
    bm.commit("a", list(range(6)), 6)  # beyond its reservation (vLLM #50531's read of the null block)
  bm.commit("a", list(range(4)), 4)
  with pytest.raises(ValueError, match="went back"):
    bm.commit("a", list(range(4)), 3)
  with pytest.raises(ValueError, match="hashed"):
    bm.trim("a", 2)
  with pytest.raises(ValueError, match="null page"):
    BlockManager(num_pages=1, block_size=2, capacity=4)


def test_reset_frees_every_page_and_forgets_the_cache_but_not_the_counters():
  bm = BlockManager(num_pages=10, block_size=2, capacity=20, shuffle_seed=1)
  first = list(bm._free)
  assert bm.allocate("a", 5, prefix=bm.lookup([1, 2, 3, 4, 5]))
  bm.commit("a", [1, 2, 3, 4, 5], 5)
  assert bm.allocate("b", 5, prefix=bm.lookup([1, 2, 3, 4, 5]))
  assert bm.prefix_hits == 4
  bm.reset()
  bm.check_invariants()
  assert "a" not in bm and bm.num_free == 9 and list(bm._free) == first
  assert bm.lookup([1, 2, 3, 4, 5]) == ([], 0) and bm.take_freed() == []
  assert bm.prefix_queries == 10 and bm.prefix_hits == 4


def test_shuffled_free_list_gives_no_row_contiguous_pages():
  bm = BlockManager(num_pages=64, block_size=1, capacity=32, shuffle_seed=0)
  assert bm.allocate("a", 16)
  assert (np.diff(bm.pages_of("a")) != 1).any()
  assert sorted(bm._free) != list(bm._free)


@pytest.mark.parametrize("seed,block_size", [(0, 1), (1, 2), (2, 4), (3, 3)])
def test_random_ops_keep_invariants_and_agree_with_the_model(seed, block_size):
  stats = run_random_ops(seed, block_size, n_ops=2500)
  # the run exercised what it claims to: hits, twins, evictions, preemptions and failed reservations
  for key in ("hits", "evictions", "preemptions", "recompute_hits", "failed_allocations", "trims"):
    assert stats[key] > 0, (key, stats)


@pytest.mark.parametrize("bug", Bugs.ALL)
def test_the_property_test_catches_planted_bugs(bug):
  with pytest.raises(AssertionError):
    for seed in range(3):
      run_random_ops(seed, 2, n_ops=1500, bug=bug)


def test_one_block_manager_per_data_shard():
  """serve/engine/sharded_pool.py: each shard hands out pages of its own share in global ids (a row's table points at its
  shard's null page past its pages), a prefix is cached on its shard only, and freed pages come back global."""
  from serve.engine.sharded_pool import ShardedPool
  pool = ShardedPool(num_pages=27, block_size=4, capacity=16, shards=3)  # 27 // 3 = 9 a shard, 8 usable
  assert (pool.num_pages, pool.per_shard, pool.usable, pool.pages_per_seq) == (27, 9, 24, 4)
  np.testing.assert_array_equal(pool.null_row(2), [18] * 4)
  assert pool.allocate("a", 6, shard=1) and pool.allocate("b", 5, shard=2)
  assert pool.shard_of("a") == 1 and pool.pages_of("a") == [1, 2]  # local ids
  np.testing.assert_array_equal(pool.table("a"), [10, 11, 9, 9])
  np.testing.assert_array_equal(pool.table("b"), [19, 20, 18, 18])
  assert pool.available(1) == 6 and pool.available(0) == 8 and pool.num_used == 4
  toks = list(range(9))
  pool.commit("a", toks, 8)  # two full pages cached on shard 1
  assert pool.lookup(toks, "", 1)[1] == 8 and pool.lookup(toks, "", 0)[1] == 0
  with pytest.raises(ValueError, match="already holds"):
    pool.allocate("a", 1, shard=0)
  pool.check_invariants()
  pool.free("b")
  assert sorted(pool.take_freed()) == [19, 20] and "b" not in pool
  assert pool.fits_ever(16) and not pool.fits_ever(17)  # capacity; 4 pages fit a share of 8
  with pytest.raises(ValueError, match="null page"):
    ShardedPool(num_pages=5, block_size=4, capacity=16, shards=3)
  pool.check_invariants()
