"""Slots: a request inserted into a running batch (or into a released slot) decodes exactly as it does alone,
for every proposer; insert touches no other row; the loop runs a bounded number of steps without recompiling."""

import jax
import numpy as np
import pytest

from tests.paged import logical
from spec_jax import slots
from spec_jax.decode import FINISH_ABORT, decode_loop, make_spec
from spec_jax.batch import generate
from spec_jax.proposers.base import NoneProposer
from spec_jax.proposers.draft import early_exit_proposer
from spec_jax.proposers.ngram import NgramProposer
from tests.proposers.test_medusa_eagle import CONFIG, _eagle, _medusa, _params, _prompts

CAPACITY = 128
MAX_NEW = 14


def _proposer(name, params, config=CONFIG):
  """Every proposer kind (and token trees: '<kind>_tree') over a tiny target `config` (shared with the mesh tests)."""
  if name == "none":
    return NoneProposer(), {}
  if name == "ngram":
    return NgramProposer(k=3), {}
  if name == "suffix":  # a short ring, so that it wraps within a test
    from spec_jax.proposers.suffix import SuffixProposer
    return SuffixProposer(k=3, history=16), {}
  if name == "draft":
    return early_exit_proposer(config, params, 2, k=3)
  if name.endswith("_tree"):  # token trees: medusa static, eagle and draft dynamic (EAGLE-2), suffix's continuations
    import dataclasses
    from spec_jax.proposers.tree_expand import DynamicTree
    from spec_jax.tree import StaticTree
    base, pparams = _proposer(name.removesuffix("_tree"), params, config)
    tree = (StaticTree(((0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0))) if name == "medusa_tree"
            else DynamicTree(topk=2, depth=3, nodes=7))
    return dataclasses.replace(base, k=3, tree=tree), pparams
  return (_medusa if name == "medusa" else _eagle)(params, config=config)


def alone_runs(params, proposer, pparams, prompts, max_new=MAX_NEW):
  """Each prompt generated alone (the batch path, no adaptive k): what a slot's output must equal."""
  return [generate(params, CONFIG, [p], max_new_tokens=max_new, proposer=proposer, proposer_params=pparams,
                   adaptive_k=False) for p in prompts]


def _run_to_end(params, state, spec, steps=3):
  while not bool(np.all(np.asarray(state.done))):
    state = decode_loop(params, state, spec, steps)
  return state


def _out(state, slot):
  s = slots.snapshot(state)
  return np.asarray(s.tokens)[slot, int(s.prompt_lens[slot]):int(s.lengths[slot])].tolist()


# Two tree proposers here (EAGLE-2's per-row dynamic trees; the suffix trees, whose state holds the last tree); the
# Medusa and draft trees' batch identity is in tests/test_tree_decode.py (CI time: each case compiles the whole loop).
@pytest.mark.parametrize("name", ["none", "ngram", "suffix", "suffix_tree", "draft", "medusa", "eagle", "eagle_tree"])
def test_insert_mid_decode_and_after_release_equals_alone(name):
  params = _params()
  proposer, pparams = _proposer(name, params)
  prompts = _prompts(3, [9, 5, 12, 7])
  alone = [r.token_ids[0] for r in alone_runs(params, proposer, pparams, prompts)]
  spec = make_spec(CONFIG, proposer, adaptive_k=False)
  both = {"target": params, "proposer": pparams}
  req = lambda p, n=MAX_NEW: slots.make_request(p, max_new=n, spec=spec, capacity=CAPACITY)
  state = slots.empty_state(both, spec, batch=3, capacity=CAPACITY)
  state = slots.insert(both, state, 0, req(prompts[0]), spec)
  state = slots.insert(both, state, 2, req(prompts[1], 100), spec)  # runs until it is aborted
  state = decode_loop(both, state, spec, 3)  # slots 0 and 2 are mid-decode
  assert not np.asarray(state.done)[[0, 2]].any()
  state = slots.insert(both, state, 1, req(prompts[2]), spec)
  state = decode_loop(both, state, spec, 2)
  # Slot 2 is released mid-decode (an abort) and refilled while the others keep decoding.
  state = slots.release(state, 2)
  assert int(state.finish[2]) == FINISH_ABORT
  state = slots.insert(both, state, 2, req(prompts[3]), spec)
  state = _run_to_end(both, state, spec)
  assert _out(state, 0) == alone[0]
  assert _out(state, 1) == alone[2]
  assert _out(state, 2) == alone[3]
  # A finished slot, released and filled again.
  state = slots.release(state, 0)
  state = slots.insert(both, state, 0, req(prompts[1]), spec)
  state = _run_to_end(both, state, spec)
  assert _out(state, 0) == alone[1]
  if name != "none":
    snap = slots.snapshot(state)
    assert int(np.asarray(snap.drafted).sum()) > 0


def test_insert_touches_no_other_row_and_loop_is_bounded():
  params = _params()
  proposer, pparams = _eagle(params)
  spec = make_spec(CONFIG, proposer, adaptive_k=True)
  both = {"target": params, "proposer": pparams}
  state = slots.empty_state(both, spec, batch=3, capacity=CAPACITY)
  for slot, p in enumerate(_prompts(5, [6, 11])):
    state = slots.insert(both, state, slot, slots.make_request(p, max_new=40, spec=spec, capacity=CAPACITY), spec)
  state = decode_loop(both, state, spec, 4)
  assert int(state.step) <= 4
  before = jax.tree.map(np.asarray, state)
  state = slots.insert(both, state, 2, slots.make_request(_prompts(6, [9])[0], max_new=40, spec=spec,
                                                          capacity=CAPACITY), spec)
  after = jax.tree.map(np.asarray, state)
  for field in ("tokens", "lengths", "prompt_lens", "max_new", "done", "finish", "last_hidden"):
    np.testing.assert_array_equal(getattr(after, field)[:2], getattr(before, field)[:2], err_msg=field)
  for a, b in ((after.cache, before.cache), (after.pstate.cache, before.pstate.cache)):  # through the page tables
    np.testing.assert_array_equal(logical(a.k, a.pages)[:, :2], logical(b.k, b.pages)[:, :2])
  np.testing.assert_array_equal(after.pstate.pend_feat[:2], before.pstate.pend_feat[:2])
  np.testing.assert_array_equal(after.stats.drafted[:2], before.stats.drafted[:2])
  assert int(after.stats.drafted[2]) == 0 and not after.done[2]
  # Bounded calls with different step counts reuse one compiled loop.
  n0 = decode_loop._cache_size()
  step = int(state.step)
  state = decode_loop(both, state, spec, 1)
  state = decode_loop(both, state, spec, 5)
  assert int(state.step) <= step + 6
  assert decode_loop._cache_size() == n0


def test_speculation_switch_and_per_request_opt_out_stay_exact():
  params = _params(1)
  spec = make_spec(CONFIG, NgramProposer(k=4), adaptive_k=True)
  both = {"target": params, "proposer": {}}
  prompts = _prompts(7, [12, 10])
  alone = [generate(params, CONFIG, [p], max_new_tokens=30).token_ids[0] for p in prompts]
  state = slots.empty_state(both, spec, batch=2, capacity=CAPACITY)
  state = slots.insert(both, state, 0, slots.make_request(prompts[0], max_new=30, spec=spec, capacity=CAPACITY),
                       spec)
  state = slots.insert(both, state, 1, slots.make_request(prompts[1], max_new=30, spec=spec, capacity=CAPACITY,
                                                          draft_cap=0), spec)
  state = decode_loop(both, state, spec, 3)
  state = slots.set_speculation(state, False)
  drafted = np.asarray(state.stats.drafted).copy()
  state = decode_loop(both, state, spec, 4)
  np.testing.assert_array_equal(np.asarray(state.stats.drafted), drafted)  # off: nothing drafted
  state = slots.set_speculation(state, True)
  state = _run_to_end(both, state, spec)
  assert _out(state, 0) == alone[0] and _out(state, 1) == alone[1]
  assert int(state.stats.drafted[1]) == 0  # the request that opted out was never drafted for
  assert int(state.stats.drafted[0]) > 0


@pytest.mark.parametrize("name", ["draft", "eagle_tree"])  # both draft their whole chain / tree every step
def test_per_row_draft_caps_bound_each_rows_drafts_and_stay_exact(name):
  """The segment policy's per-request k: a row drafts at most its cap per step (a tree keeps nodes no deeper than
  it), caps change between loop calls (slots.set_draft_caps), and every row's output is plain greedy's."""
  params = _params(1)
  proposer, pparams = _proposer(name, params)
  spec = make_spec(CONFIG, proposer, adaptive_k=False)
  both = {"target": params, "proposer": pparams}
  prompts = _prompts(3, [9, 5, 12])  # none ends at its first token
  alone = [generate(params, CONFIG, [p], max_new_tokens=24).token_ids[0] for p in prompts]
  state = slots.empty_state(both, spec, batch=3, capacity=CAPACITY)
  for slot, (p, cap) in enumerate(zip(prompts, (None, 1, 2))):
    state = slots.insert(both, state, slot, slots.make_request(p, max_new=24, spec=spec, capacity=CAPACITY,
                                                               draft_cap=cap), spec)
  state = decode_loop(both, state, spec, 4)
  at = np.asarray(state.stats.drafted_at)  # [B, K]: steps that drafted position j, per row
  assert at[0, 2] > 0, "the uncapped row drafts its whole chain or tree"
  assert at[1, 0] > 0 and at[1, 1:].sum() == 0, "cap 1: only the first position"
  assert at[2, 1] > 0 and at[2, 2:].sum() == 0, "cap 2: no third position"
  before = at.copy()
  state = slots.set_draft_caps(state, [0, 3, 2])
  state = _run_to_end(both, state, spec)
  after = np.asarray(state.stats.drafted_at)
  assert (after[0] == before[0]).all(), "cap 0 from here on: nothing more drafted"
  assert after[1, 2] > 0, "the raised cap drafts deeper"
  for slot in range(3):
    assert _out(state, slot) == alone[slot]


def test_bad_requests_are_refused_on_the_host():
  spec = make_spec(CONFIG, NgramProposer(k=4))
  with pytest.raises(ValueError, match="empty"):
    slots.make_request([], max_new=4, spec=spec, capacity=CAPACITY)
  with pytest.raises(ValueError, match="context"):
    slots.make_request([2] * 120, max_new=8, spec=spec, capacity=CAPACITY)
  with pytest.raises(ValueError, match="max_new_tokens"):
    slots.make_request([2, 3], max_new=0, spec=spec, capacity=CAPACITY)
  with pytest.raises(ValueError, match="top_p"):
    slots.make_request([2, 3], max_new=4, spec=spec, capacity=CAPACITY, top_p=0.0)
  with pytest.raises(ValueError, match="top_k"):  # an int over int32 is a clear error, not an OverflowError
    slots.make_request([2, 3], max_new=4, spec=spec, capacity=CAPACITY, top_k=2 ** 63)


def test_a_row_without_room_finishes_with_a_capacity_error_not_a_clamped_write():
  """The host checks keep this from happening; if a state is built wrongly anyway, the row stops with an error
  instead of overwriting its committed cache entries."""
  from spec_jax.decode import FINISH_CAPACITY
  params = _params()
  spec = make_spec(CONFIG, NgramProposer(k=4), adaptive_k=False)
  both = {"target": params, "proposer": {}}
  state = slots.empty_state(both, spec, batch=2, capacity=CAPACITY)
  for slot in range(2):
    state = slots.insert(both, state, slot, slots.make_request(_prompts(8, [6])[0], max_new=10, spec=spec,
                                                               capacity=CAPACITY), spec)
  state = state.replace(max_new=state.max_new.at[0].set(10_000))  # misuse: a limit past the capacity
  n = int(state.cache.lengths[0])  # committed entries so far
  cache_before = logical(state.cache.k, state.cache.pages)[:, 0, :, :n]
  state = _run_to_end(both, state, spec, steps=50)
  assert int(state.finish[0]) == FINISH_CAPACITY
  assert int(state.lengths[0]) <= CAPACITY
  np.testing.assert_array_equal(logical(state.cache.k, state.cache.pages)[:, 0, :, :n], cache_before)
  assert len(_out(state, 1)) == 10


# A seeded sampled request is its own random stream (spec_jax/streams.py): the same tokens alone, beside other
# requests, and re-inserted mid-way with its committed tokens as prompt (what the paged cache's preemption does).
# Deterministic drafters (n-gram chains, token trees) commit the target's own draws, so plain decoding with the
# same seed gives them too, whatever k the adaptive loop picks in each batch.
@pytest.mark.parametrize("name", ["ngram", "medusa_tree"])
def test_seeded_sampled_request_is_its_own_stream(name):
  params = _params(2)
  proposer, pparams = _proposer(name, params)
  spec = make_spec(CONFIG, proposer, adaptive_k=True)
  both = {"target": params, "proposer": pparams}
  prompt, others = _prompts(11, [10])[0], _prompts(12, [7, 12, 9])
  n_new, seed = 20, 1234
  req = lambda p, n=n_new, s=seed, t=0.6: slots.make_request(p, max_new=n, spec=spec, capacity=CAPACITY,
                                                             temperature=t, top_k=24, seed=s)

  def alone():
    state = slots.insert(both, slots.empty_state(both, spec, batch=4, capacity=CAPACITY), 1, req(prompt), spec)
    return _out(_run_to_end(both, state, spec), 1)

  ref = alone()
  assert len(ref) >= 6, ref  # long enough to mean something (EOS is token 1)
  # Beside three other sampled or greedy requests, inserted after them, in another slot.
  state = slots.empty_state(both, spec, batch=4, capacity=CAPACITY)
  for slot, (p, s, t) in zip((0, 1, 3), zip(others, (7, 8, 9), (1.0, 0.0, 0.6))):
    state = slots.insert(both, state, slot, req(p, 30, s, t), spec)
  state = decode_loop(both, state, spec, 2)
  state = _run_to_end(both, slots.insert(both, state, 2, req(prompt), spec), spec)
  assert _out(state, 2) == ref
  assert int(np.asarray(state.stats.drafted).sum()) > 0
  # Re-inserted after a few steps with prompt + its committed tokens, the rest of its budget and the same seed.
  state = slots.insert(both, slots.empty_state(both, spec, batch=4, capacity=CAPACITY), 0, req(prompt), spec)
  state = decode_loop(both, state, spec, 2)
  head = _out(state, 0)
  assert 0 < len(head) < len(ref)
  state = slots.insert(both, slots.release(state, 0), 0, req(prompt + head, n_new - len(head)), spec)
  assert head + _out(_run_to_end(both, state, spec), 0) == ref
  # Another seed is another stream.
  state = slots.insert(both, slots.empty_state(both, spec, batch=4, capacity=CAPACITY), 1, req(prompt, s=99), spec)
  assert _out(_run_to_end(both, state, spec), 1) != ref
  if name == "ngram":  # plain decoding draws the same tokens
    plain = make_spec(CONFIG, NoneProposer())
    state = slots.empty_state({"target": params, "proposer": {}}, plain, batch=4, capacity=CAPACITY)
    state = slots.insert({"target": params, "proposer": {}}, state, 1, slots.make_request(
        prompt, max_new=n_new, spec=plain, capacity=CAPACITY, temperature=0.6, top_k=24, seed=seed), plain)
    assert _out(_run_to_end({"target": params, "proposer": {}}, state, plain), 1) == ref
