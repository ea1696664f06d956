"""The suffix proposer's token trees: merged continuations (siblings differ, branch 0 is the chain's draft), lossless
greedy and sampled through the loop, and more accepted than the chain where the history holds two continuations
of the same context."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from spec_jax import slots
from spec_jax.batch import generate
from spec_jax.decode import decode_loop, make_spec
from spec_jax.models.transformer import init_params
from spec_jax.proposers import suffix_tree
from spec_jax.proposers.ngram_lookup import NO_TOKEN
from spec_jax.proposers.registry import Target, build_proposer
from spec_jax.proposers.suffix import SuffixProposer
from spec_jax.proposers.tree_expand import DynamicTree
from spec_jax.spec_config import SpecConfig
from tests.conftest import tiny_gemma_config, tiny_llama_config
from tests.distribution import assert_same_distribution, sample_plain_and_speculative

CONFIG = tiny_gemma_config(eos_ids=(1,))
LLAMA = tiny_llama_config(eos_ids=(1,))


def tree_proposer(k=4, width=3, nodes=None, **kw):
  return SuffixProposer(k=k, tree=DynamicTree(topk=width, depth=k, nodes=nodes or 1 + width * k), **kw)


def test_branches_merge_into_a_tree_whose_siblings_differ():
  b = np.array([[[5, 6, 7], [5, 8, 9], [5, 6, 4]],  # share 5, then 5-6: nodes 5; 6, 8; 7, 9, 4
                [[3, NO_TOKEN, NO_TOKEN], [3, 4, NO_TOKEN], [NO_TOKEN] * 3]], np.int32)
  hist = np.array([[True, False, True], [False, True, False]])
  tok, par, h = jax.device_get(suffix_tree.merge(jnp.asarray(b), jnp.asarray(hist), nodes=8))
  assert tok[0].tolist() == [0, 5, 6, 8, 7, 9, 4, NO_TOKEN] and par[0].tolist() == [-1, 0, 1, 1, 2, 3, 2, 0]
  assert h[0].tolist() == [False, True, True, False, True, False, True, False]  # a node is its first branch's
  assert tok[1].tolist() == [0, 3, 4] + [NO_TOKEN] * 5 and par[1].tolist()[:3] == [-1, 0, 1]
  # a smaller tree keeps the first nodes depth by depth (parents before children)
  tok5, par5, _ = jax.device_get(suffix_tree.merge(jnp.asarray(b), jnp.asarray(hist), nodes=5))
  assert tok5[0].tolist() == [0, 5, 6, 8, 7] and par5[0].tolist() == [-1, 0, 1, 1, 2]
  # the accepted path is read back from the committed tokens: 5, 8, 9 came from branch 1 (history only at 5)
  out = jnp.asarray([[5, 8, 9, 2], [3, 4, 1, 0]], jnp.int32)
  n = suffix_tree.accepted_path_hist(*(jnp.asarray(x) for x in (tok, par, h)), out, jnp.asarray([3, 1]))
  assert jax.device_get(n).tolist() == [1, 0]


def test_the_registry_builds_trees_from_eagle_topk():
  p, _ = build_proposer(SpecConfig("suffix", 4, eagle_topk=3), Target(CONFIG, None))
  assert p.tree.topk == 3 and p.tree.nodes == 13 and p.tree.max_children == 3
  p, _ = build_proposer(SpecConfig("suffix", 4, eagle_topk=2, num_draft_tokens=7), Target(CONFIG, None))
  assert p.tree.nodes == 7
  with pytest.raises(ValueError, match="at most 1 \\+ eagle_topk \\* k"):  # two depth-2 branches hold 4 nodes
    build_proposer(SpecConfig("suffix", 2, eagle_topk=2, num_draft_tokens=7), Target(CONFIG, None))


@functools.lru_cache(maxsize=None)
def _params(seed=0):
  return init_params(CONFIG, jax.random.PRNGKey(seed))


def test_tree_greedy_is_lossless_batch_of_different_lengths():
  params = _params(1)
  rng = np.random.default_rng(1)
  span = rng.integers(3, CONFIG.vocab_size, 5).tolist()
  prompts = [[2] + span * 3, [2] + rng.integers(3, CONFIG.vocab_size, 8).tolist(), [2] + span * 2 + [7], [2, 9, 4]]
  base = generate(params, CONFIG, prompts, max_new_tokens=24)
  spec = generate(params, CONFIG, prompts, max_new_tokens=24, proposer=tree_proposer(history=16, spec_factor=4.0),
                  adaptive_k=False)
  assert spec.token_ids == base.token_ids
  assert spec.finish_reasons == base.finish_reasons
  assert spec.stats["drafted_tokens"] > 0 and spec.stats["accepted_tokens"] > 0


def test_tree_sampling_matches_plain_distribution():
  config = tiny_gemma_config(vocab_size=8, eos_ids=(99,))  # a tiny vocab: the history holds several continuations
  params = init_params(config, jax.random.PRNGKey(3))
  proposer = tree_proposer(k=2, width=3, history=8, max_depth=4, spec_factor=2.0)
  plain, specd, rates = sample_plain_and_speculative(params, config, proposer, {}, n=300, calls=4)
  assert 0.0 < np.mean(rates) < 0.95
  assert_same_distribution(plain, specd)


def _planted_run(proposer, prompt, history, max_new):
  """Slot 1's ring holds `history` (tenant 0's); decode `prompt` greedily in slot 0 -> (tokens, accepted,
  accepted from the history)."""
  params = {"target": init_params(LLAMA, jax.random.PRNGKey(2)), "proposer": {}}
  spec = make_spec(LLAMA, proposer, adaptive_k=False)
  state = slots.empty_state(params, spec, batch=2, capacity=128)
  p = state.pstate
  ring = np.full((proposer.history,), NO_TOKEN, np.int32)
  ring[:len(history)] = history
  hist = p.hist.at[1].set(jnp.asarray(ring))
  owner = p.owner.at[1].set(jnp.where(jnp.asarray(ring) >= 0, 0, -1))
  state = state.replace(pstate=p.replace(hist=hist, owner=owner, pos=p.pos.at[1].set(len(history))))
  req = slots.make_request(prompt, max_new=max_new, spec=spec, capacity=128, tenant=0)
  state = decode_loop(params, slots.insert(params, state, np.int32(0), req, spec), spec)
  snap = jax.device_get(slots.snapshot(state))
  return (snap.tokens[0, len(prompt):snap.lengths[0]].tolist(), int(snap.accepted[0]),
          int(snap.accepted_from_history[0]))


def test_the_tree_accepts_more_than_the_chain_where_the_history_holds_two_continuations():
  """The history holds the answer and, later (so the chain's pick among equal matches), a copy with every third
  token changed: contexts the two share go on two ways. The chain drafts the later copy and misses at each change
  it reaches; the tree drafts both. (A plain-Python replay of the two rules on random 40-token answers gives about
  26 accepted tokens for the chain and 31 for the tree.)"""
  prompt = [2] + np.random.default_rng(8).integers(3, LLAMA.vocab_size, 11).tolist()
  max_new = 40
  want = generate(init_params(LLAMA, jax.random.PRNGKey(2)), LLAMA, [prompt], max_new_tokens=max_new).token_ids[0]
  other = [t if i % 3 != 1 else 3 + (t - 2) % (LLAMA.vocab_size - 3) for i, t in enumerate(want)]
  history = [NO_TOKEN] + want + [NO_TOKEN] + other
  kw = dict(k=4, history=128, max_depth=2, spec_factor=2.0)
  chain = _planted_run(SuffixProposer(**kw), prompt, history, max_new)
  tree = _planted_run(tree_proposer(width=2, **kw), prompt, history, max_new)
  assert chain[0] == tree[0] == want
  assert tree[1] >= chain[1] + 3 and tree[2] >= chain[2] + 3
  assert tree[1] >= 0.6 * len(want)
