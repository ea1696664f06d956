"""The paged KV cache end to end: requests whose pages come from a shuffled pool (no row's pages contiguous), every
page no request owns (and every page freed by an abort) filled with NaN, decode exactly as alone, for chains and
trees, at block sizes that make one verify step cross several page boundaries."""

import jax.numpy as jnp
import numpy as np
import pytest

from spec_jax import slots
from spec_jax.decode import decode_loop, make_spec
from tests.proposers.test_medusa_eagle import CONFIG, _params, _prompts
from tests.test_slots import _proposer, _out, _run_to_end, alone_runs

CAPACITY = 64
MAX_NEW = 14


class Pool:
  """A shuffled free list of pages 1 .. n-1 (0 is the null page); what it takes back is poisoned before reuse."""

  def __init__(self, num_pages, seed):
    self.free = list(np.random.default_rng(seed).permutation(np.arange(1, num_pages)))
    self.freed = []

  def take(self, n, pps):
    got, self.free = self.free[:n], self.free[n:]
    assert len(got) == n, "the test's pool is too small"
    return np.array(got + [0] * (pps - n), np.int32)

  def give(self, row):
    self.freed += [int(p) for p in row if p]
    self.free += [int(p) for p in row if p]


@pytest.mark.parametrize("name,block_size", [("ngram", 1), ("draft", 4), ("eagle", 2), ("eagle_tree", 16),
                                             ("medusa_tree", 1), ("suffix_tree", 4)])
def test_paged_requests_with_poisoned_free_pages_equal_alone(name, block_size):
  params = _params()
  proposer, pparams = _proposer(name, params)
  prompts = _prompts(3, [9, 5, 12, 7])
  alone = [r.token_ids[0] for r in alone_runs(params, proposer, pparams, prompts)]
  spec = make_spec(CONFIG, proposer, adaptive_k=False)
  both = {"target": params, "proposer": pparams}
  pps = -(-CAPACITY // block_size)
  num_pages = 1 + 3 * pps + 5  # a few more pages than the three slots' worth: the pool is shared, not per slot
  pool = Pool(num_pages, seed=block_size)
  state = slots.empty_state(both, spec, batch=3, capacity=CAPACITY, block_size=block_size, num_pages=num_pages)
  state = slots.fill_pages(state, jnp.arange(1, num_pages))  # nothing is owned yet: every page is stale

  def req(p, n=MAX_NEW):
    need = -(-(len(p) + n + spec.lookahead + 1) // block_size)  # the whole request, reserved at once here
    return slots.make_request(p, max_new=n, spec=spec, capacity=CAPACITY, block_size=block_size,
                              pages=pool.take(need, pps))

  rows = {}
  for slot, (p, n) in ((0, (prompts[0], MAX_NEW)), (2, (prompts[1], 30))):
    rows[slot] = req(p, n)
    state = slots.insert(both, state, slot, rows[slot], spec)
  state = decode_loop(both, state, spec, 3)
  rows[1] = req(prompts[2])
  state = slots.insert(both, state, 1, rows[1], spec)
  state = decode_loop(both, state, spec, 2)
  state = slots.release(state, 2)  # an abort: its pages go back, poisoned, and the next request reuses them
  pool.give(np.asarray(rows[2].pages))
  state = slots.fill_pages(state, jnp.asarray(pool.freed, jnp.int32))
  pool.free = pool.freed + pool.free  # reused first
  rows[2] = req(prompts[3])
  assert set(np.asarray(rows[2].pages).tolist()) & set(pool.freed)
  state = slots.insert(both, state, 2, rows[2], spec)
  state = _run_to_end(both, state, spec)
  assert [_out(state, s) for s in (0, 1, 2)] == [alone[0], alone[2], alone[3]]
  for s in range(3):  # no row's pages are one contiguous run
    pg = np.asarray(rows[s].pages)
    pg = pg[pg > 0]
    assert len(pg) < 2 or not np.all(np.diff(pg) == 1)


def _reuse_then_resume(name, prompts, max_new, capacity, block_size, seed, min_streamed):
  """Three requests on two rows of a shuffled, poisoned pool: a runs alone; b shares a's first 16 tokens and gets
  a's pages for them (whole pages, as far as the proposer can use them: `usable_prefix`), prefilling only the
  rest; c is preempted once it has streamed `min_streamed` tokens (its pages freed and poisoned) and recomputed
  from prompt + streamed tokens on other pages. Each equals its alone run, and nothing writes the shared pages.
  -> (alone runs, use, b, c2, b's (steps, accepted))."""
  params = _params()
  proposer, pparams = _proposer(name, params)
  runs = [alone_runs(params, proposer, pparams, [p], max_new=n)[0] for p, n in zip(prompts, max_new)]
  alone = [r.token_ids[0] for r in runs]
  spec = make_spec(CONFIG, proposer, adaptive_k=False)
  both = {"target": params, "proposer": pparams}
  pps = -(-capacity // block_size)
  num_pages = 1 + 3 * pps
  pool = Pool(num_pages, seed=seed)
  state = slots.empty_state(both, spec, batch=2, capacity=capacity, block_size=block_size, num_pages=num_pages)
  state = slots.fill_pages(state, jnp.arange(1, num_pages))

  def make(i, pages, **kw):
    return slots.make_request(prompts[i], max_new=max_new[i], spec=spec, capacity=capacity, block_size=block_size,
                              pages=pages, **kw)

  full = lambda i: min(pps, -(-(len(prompts[i]) + max_new[i] + spec.lookahead + 1) // block_size))
  a = make(0, pool.take(full(0), pps))
  state = _run_to_end(both, slots.insert(both, state, 0, a, spec), spec)
  assert _out(state, 0) == alone[0]
  assert int(slots.snapshot(state).kv_lengths[0]) >= 16  # the shared positions' K/V are all written
  use = slots.usable_prefix(spec, 16 // block_size * block_size, block_size)
  shared = np.asarray(a.pages)[:use // block_size]
  b = make(1, np.concatenate([shared, pool.take(full(1) - len(shared), pps - len(shared))]), cached=use)
  before = {int(p): np.asarray(state.cache.k[:, int(p)]) for p in shared}
  state = _run_to_end(both, slots.insert(both, state, 1, b, spec), spec)
  assert _out(state, 1) == alone[1]
  snap = slots.snapshot(state)
  b_stats = (int(snap.steps[1]), int(snap.accepted[1]))  # read now: the next loop call donates the state
  for p, k in before.items():  # nothing wrote the shared pages
    np.testing.assert_array_equal(np.asarray(state.cache.k[:, p]), k)
  c = make(2, pool.take(full(2), pps))
  state = slots.insert(both, state, 0, c, spec)
  while len(_out(state, 0)) < min_streamed:
    state = decode_loop(both, state, spec, 1)
  streamed = _out(state, 0)
  assert len(streamed) < max_new[2]
  state = slots.release(state, 0)
  pool.give(np.asarray(c.pages))
  state = slots.fill_pages(state, jnp.asarray(pool.freed, jnp.int32))
  c2 = make(2, pool.take(full(2), pps), output_ids=streamed)
  state = _run_to_end(both, slots.insert(both, state, 0, c2, spec), spec)
  assert _out(state, 0) == alone[2]
  return runs, use, b, c2, b_stats


@pytest.mark.parametrize("name,block_size", [("draft", 4), ("eagle", 4), ("eagle_tree", 2), ("ngram", 8)])
def test_prefix_reuse_and_recompute_from_streamed_tokens_equal_alone(name, block_size):
  """A request reuses another's cached prefix pages (prefilling only the rest, the proposer's cache included), and
  a request preempted mid-decode is recomputed from prompt + its streamed tokens on other pages: both decode
  exactly as alone, with every page no one owns poisoned."""
  base = _prompts(11, [21])[0]
  prompts = [base, base[:16] + _prompts(12, [6])[0][1:], _prompts(13, [10])[0]]
  assert prompts[1][16] != base[16]  # the hit ends at a page boundary: the next token differs
  runs, use, _, _, b_stats = _reuse_then_resume(name, prompts, [MAX_NEW] * 3, CAPACITY, block_size, seed=7,
                                                min_streamed=1)
  assert use == (16 - block_size if name.startswith("eagle") else 16)
  # The proposer drafted exactly as alone: its cache for the reused prefix is right (greedy output alone would not
  # show a wrong one: verification fixes every draft).
  assert b_stats == (int(runs[1].raw_stats.steps[0]), int(runs[1].raw_stats.accepted[0]))


@pytest.mark.parametrize("name", ["ngram", "draft", "eagle"])
def test_a_prefill_padded_past_the_capacity_equals_alone(name):
  """A capacity that is no bucket (43) and a prefill that starts mid-row or runs long (a prefix hit, a resume)
  pad past the row's last page: the padding goes to the null page, the shared pages stay untouched, and decoding
  equals alone (the server answered 500 for these)."""
  capacity = 43
  base = _prompts(21, [24])[0]
  prompts = [base, base[:16] + _prompts(22, [18])[0][1:], _prompts(23, [30])[0]]
  _, use, b, c2, _ = _reuse_then_resume(name, prompts, [6, 6, 8], capacity, 4, seed=3, min_streamed=4)
  # b (33 tokens) prefills all but its 16 (EAGLE: 12) shared ones, padded to 32; c (30 tokens) is recomputed from
  # its 33+ known positions, padded to 64: both past 43
  assert use + int(b.tokens.shape[0]) > capacity and int(c2.tokens.shape[0]) > capacity
