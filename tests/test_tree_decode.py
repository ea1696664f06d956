"""Token trees through the model and the loop: static tree shapes, the tree forward against each path's own
forward (XLA and both Pallas kernels in interpret mode), and greedy decoding with trees token-identical to plain
decoding (an oracle tree proposer that hides the right token among wrong siblings, and Medusa trees)."""

from __future__ import annotations

import dataclasses
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from spec_jax import tree as tree_lib
from spec_jax.cache import KVCache
from spec_jax.batch import generate
from spec_jax.models.transformer import forward, init_params
from spec_jax.proposers import medusa, tree_expand
from spec_jax.proposers.base import Stateless, TreeDraft
from spec_jax.tree import StaticTree
from tests.proposers.test_medusa_eagle import CONFIG, _medusa, _params, _prompts


# ------------------------------------------------------------------------------------------------ shapes

def test_best_tree_takes_the_best_paths_by_product():
  rng = np.random.default_rng(0)
  depth, ranks, nodes = 3, 4, 12
  acc = np.sort(rng.uniform(0.05, 0.9, (depth, ranks)), axis=1)[:, ::-1]
  t = StaticTree.best(acc, nodes)
  assert t.nodes == nodes
  every = [p for d in range(1, depth + 1) for p in itertools.product(range(ranks), repeat=d)]
  value = {p: np.prod([acc[i][r] for i, r in enumerate(p)]) for p in every}
  want = sorted(every, key=lambda p: -value[p])[:nodes - 1]
  assert set(t.paths) == set(want)
  parents, depths, rk = t.arrays()
  assert parents[0] == -1 and all(parents[i] < i for i in range(1, nodes))
  for i, p in enumerate(t.paths, start=1):
    assert depths[i] == len(p) and rk[i] == p[-1]
    assert (t.paths[parents[i] - 1] if parents[i] else ()) == p[:-1]


def test_chain_tree_and_bad_paths():
  t = StaticTree.chain(3)
  assert t.nodes == 4 and t.depth == 3 and t.max_children == 1
  np.testing.assert_array_equal(t.arrays()[0], [-1, 0, 1, 2])
  with pytest.raises(ValueError, match="no parent"):
    StaticTree(((0,), (1, 0)))
  with pytest.raises(ValueError, match="non-empty"):
    StaticTree(((),))


def test_rank_accuracy_from_top1_top5_and_exact_ranks():
  meta = {"eval": {"top1_h0": 0.4, "top5_h0": 0.7, "top1_h1": 0.2, "top5_h1": 0.45}}
  acc = medusa.rank_accuracy(meta, 2, 6)
  for d, (t1, t5) in enumerate([(0.4, 0.7), (0.2, 0.45)]):
    assert acc[d][0] == pytest.approx(t1)
    assert sum(acc[d][:5]) == pytest.approx(t5, rel=1e-6)
    assert all(a > b for a, b in zip(acc[d], acc[d][1:]))
  exact = {"eval": {f"rank{r}_h0": 0.5 / (r + 1) for r in range(3)}}
  assert medusa.rank_accuracy(exact, 1, 3) == [[0.5, 0.25, 0.5 / 3]]
  with pytest.raises(ValueError, match="no held-out accuracy"):
    medusa.rank_accuracy({"eval": {}}, 1, 2)


# ------------------------------------------------------------------------------------------ tree forward

def _random_parents(rng, B, N):
  return np.stack([[-1] + [int(rng.integers(0, i)) for i in range(1, N)] for _ in range(B)]).astype(np.int32)


@pytest.mark.parametrize("impl", ["xla", "pallas_gpu:interpret", "pallas_tpu:interpret"])
def test_tree_forward_equals_each_path_forward(impl):
  """Node i's logits in one tree forward equal the last logits of feeding its path (root .. i) as a chain."""
  params = _params()
  rng = np.random.default_rng(1)
  B, N, S = 2, 7, 48
  prompt_lens = [13, 4]  # past the sliding window (8) in row 0
  cache = KVCache.init(CONFIG, B, S)
  P = max(prompt_lens)
  toks = rng.integers(3, CONFIG.vocab_size, (B, P)).astype(np.int32)
  _, _, cache = forward(params, jnp.asarray(toks), jnp.broadcast_to(jnp.arange(P), (B, P)), cache, config=CONFIG)
  cache = cache.replace(lengths=jnp.asarray(prompt_lens, jnp.int32))
  parents = _random_parents(rng, B, N)
  tokens = rng.integers(3, CONFIG.vocab_size, (B, N)).astype(np.int32)
  depths = np.asarray(tree_lib.node_depths(jnp.asarray(parents)))
  pos = np.asarray(prompt_lens)[:, None] + depths
  mask = tree_lib.ancestor_mask(jnp.asarray(parents))
  logits, _, _ = jax.jit(lambda c: forward(params, jnp.asarray(tokens), jnp.asarray(pos), c, config=CONFIG,
                                           impl=impl, tree_mask=mask))(cache)
  for b in range(B):
    for i in range(N):
      path = [i]
      while parents[b, path[-1]] >= 0:
        path.append(int(parents[b, path[-1]]))
      path = path[::-1]
      one = cache.replace(lengths=cache.lengths[b:b + 1], pages=cache.pages[b:b + 1])
      want, _, _ = forward(params, jnp.asarray(tokens[b, path])[None], jnp.asarray(pos[b, path])[None], one,
                           config=CONFIG)
      np.testing.assert_allclose(np.asarray(logits[b, i]), np.asarray(want[0, -1]), rtol=2e-4, atol=2e-4)


# ------------------------------------------------------------------------------------------ tree decoding

@dataclasses.dataclass(frozen=True)
class OracleTree(Stateless):
  """Test-only: a static tree whose nodes on one random path hold the reference continuation (params["ref"],
  the plain greedy output per row) and all others a wrong token; the right path is redrawn every step, so
  accepted paths run through any sibling and compaction must move them. A test double of a proposer only: the
  loop, the forward, the verifier and the compaction under test are the real ones."""

  tree: StaticTree = StaticTree(((0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (2, 0), (0, 0, 0), (0, 1, 0),
                                 (1, 0, 0), (1, 0, 1), (0, 0, 0, 0)))
  vocab_size: int = CONFIG.vocab_size
  name: str = "oracle_tree"

  @property
  def k(self):
    return self.tree.depth

  def propose(self, params, state, ctx, k, key):
    raise AssertionError("only trees here")

  def propose_tree(self, params, state, ctx, key):
    t = self.tree
    parents, depths, ranks = t.arrays()
    B = ctx.lengths.shape[0]
    # key: each row's draft keys [B, depth] (fresh every step: they follow the row's position)
    draw = lambda i, shape, hi: jax.vmap(
        lambda k: jax.random.randint(jax.random.fold_in(k, i), shape, 0, hi))(key[:, 0])
    right = draw(1, (t.depth,), 3)  # the rank holding the right token at each depth
    idx = ctx.lengths[:, None] - 1 + jnp.arange(1, t.depth + 1)[None, :]
    truth = jnp.take_along_axis(params["ref"], jnp.minimum(idx, params["ref"].shape[1] - 1), axis=1)
    paths = [()] + list(t.paths)
    on = jnp.stack([jnp.all(jnp.stack([right[:, i] == r for i, r in enumerate(p)] + [jnp.ones(B, bool)]), 0)
                    for p in paths], axis=1)  # [B, N]: node n lies on the right path
    d = np.maximum(depths - 1, 0)
    # truth + 1 .. truth + V - 8: never the truth, nor the real token when a test shifts `ref` by 7
    wrong = (truth[:, d] + 1 + draw(2, (t.nodes,), self.vocab_size - 8)) % self.vocab_size
    tokens = jnp.where(on, truth[:, d], wrong).astype(jnp.int32)
    return TreeDraft(tokens, jnp.broadcast_to(jnp.asarray(parents), (B, t.nodes))), state


def _reference(params, prompts, max_new):
  base = generate(params, CONFIG, prompts, max_new_tokens=max_new)
  S = max(len(p) for p in prompts) + max_new + 16
  ref = np.zeros((len(prompts), S), np.int32)
  for b, (p, out) in enumerate(zip(prompts, base.token_ids)):
    ref[b, :len(p) + len(out)] = p + out
  return base, jnp.asarray(ref)


@pytest.mark.parametrize("adaptive", [False, True])
def test_oracle_tree_greedy_identity_and_acceptance(adaptive):
  params = _params()
  prompts = _prompts(4, [5, 13, 3])  # batch > 1, rows of different lengths
  base, ref = _reference(params, prompts, 24)
  prop = OracleTree()
  got = generate(params, CONFIG, prompts, max_new_tokens=24, proposer=prop, proposer_params={"ref": ref},
                 adaptive_k=adaptive)
  assert got.token_ids == base.token_ids
  assert got.finish_reasons == base.finish_reasons
  if adaptive:  # the controller may well choose plain steps: only identity is promised
    return
  s = got.stats
  # The right token sits at rank 0-2 of each depth; the tree has rank 2 at depth 1 only, so paths are often cut
  # early, but accepted drafts must be plenty (~1.3 per step expected) and reach beyond the first sibling.
  assert s["accepted_tokens"] > 0.5 * s["verify_steps"]
  assert s["per_position_acceptance"][0] > 0.5
  assert len(s["per_position_acceptance"]) == prop.tree.depth
  assert s["mean_draft_tokens_per_step"] == prop.tree.nodes - 1  # every node drafted: the tree's size
  assert s["acceptance_rate"] == s["accepted_tokens"] / s["drafted_tokens"]


def test_oracle_tree_wrong_everywhere_still_identical():
  """A tree with no right token anywhere: every step commits the target's own token only."""
  params = _params()
  prompts = _prompts(5, [7, 4])
  base, ref = _reference(params, prompts, 12)
  got = generate(params, CONFIG, prompts, max_new_tokens=12, proposer=OracleTree(),
                 proposer_params={"ref": (ref + 7) % CONFIG.vocab_size}, adaptive_k=False)
  assert got.token_ids == base.token_ids
  assert got.stats["accepted_tokens"] == 0 and got.stats["drafted_tokens"] > 0


@pytest.mark.parametrize("topk,nodes", [(2, 7), (3, 10)])
def test_medusa_tree_greedy_identity(topk, nodes):
  params = _params()
  prompts = _prompts(0, [5, 13, 3])
  base = generate(params, CONFIG, prompts, max_new_tokens=18)
  chain, pparams = _medusa(params, k=3)
  acc = [[0.5 ** (d + r + 1) for r in range(topk)] for d in range(3)]
  tree = StaticTree.best(acc, nodes)
  prop = dataclasses.replace(chain, k=tree.depth, tree=tree)
  got = generate(params, CONFIG, prompts, max_new_tokens=18, proposer=prop, proposer_params=pparams,
                 adaptive_k=False)
  assert got.token_ids == base.token_ids
  assert got.stats["drafted_tokens"] > 0


def test_medusa_tree_nodes_are_the_heads_top_candidates():
  params = _params()
  chain, pparams = _medusa(params, k=3)
  tree = StaticTree(((0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0)))
  prop = dataclasses.replace(chain, k=3, tree=tree)
  hidden = jax.random.normal(jax.random.PRNGKey(3), (2, CONFIG.d_model))
  from spec_jax.proposers.base import ProposeContext
  ctx = ProposeContext(jnp.zeros((2, 8), jnp.int32), jnp.full((2,), 4), None, hidden)
  draft, _ = prop.propose_tree(pparams, (), ctx, jax.random.PRNGKey(0))
  logits = np.asarray(medusa.vocab.project(medusa.head_features(pparams["heads"], hidden), pparams["rows"]))
  order = np.argsort(-logits, axis=-1)  # [B, heads, V]
  for i, p in enumerate(tree.paths, start=1):
    np.testing.assert_array_equal(np.asarray(draft.tokens[:, i]), order[:, len(p) - 1, p[-1]])
  np.testing.assert_array_equal(np.asarray(draft.parents[0]), tree.arrays()[0])


def test_tree_needs_room_for_all_its_nodes():
  params = _params()
  cfg = CONFIG.replace(max_seq_len=40)
  prompt = [[2] + [5] * 9]
  with pytest.raises(ValueError, match="exceeds the context"):  # 10 + 20 + 12 nodes > 40, though 10 + 20 + 4 fits
    generate(params, cfg, prompt, max_new_tokens=20, proposer=OracleTree(),
             proposer_params={"ref": jnp.zeros((1, 64), jnp.int32)})


# ------------------------------------------------------------------------------------ EAGLE-2 dynamic trees

def _brute_force_grow(first_logp, table, K, D, N):
  """EAGLE-2's expansion and rerank in plain Python for one row, with a bigram drafter (logp = table[token]):
  -> the set of kept paths (token tuples)."""
  clip = lambda v: max(float(v), tree_expand.LOGP_FLOOR)
  cands = {}  # path -> score
  order = np.argsort(-first_logp, kind="stable")[:K]
  frontier = [((int(t),), clip(first_logp[t])) for t in order]
  cands.update(frontier)
  for _ in range(1, D):
    children = []
    for path, s in frontier:
      row = table[path[-1]]
      for t in np.argsort(-row, kind="stable")[:K]:
        children.append((path + (int(t),), s + clip(row[t]) - tree_expand.DEPTH_PENALTY))
    cands.update(children)
    frontier = sorted(children, key=lambda c: -c[1])[:K]
  return set(sorted(cands, key=lambda p: -cands[p])[:N - 1])


@pytest.mark.parametrize("K,D,N", [(2, 3, 6), (3, 4, 12), (4, 2, 9), (1, 4, 5)])
def test_grow_matches_brute_force(K, D, N):
  rng = np.random.default_rng(K * 10 + D)
  V, B = 23, 3
  table = np.asarray(jax.nn.log_softmax(jnp.asarray(rng.normal(0, 2.0, (V, V)), jnp.float32), axis=-1))
  first = np.asarray(jax.nn.log_softmax(jnp.asarray(rng.normal(0, 2.0, (B, V)), jnp.float32), axis=-1))

  def score(tokens, parent_out, depths, mask):
    assert mask.shape == tokens.shape + tokens.shape[-1:]
    return jnp.asarray(table)[tokens], parent_out

  t = tree_expand.grow(jnp.asarray(first), jnp.zeros((B,)), score, tree_expand.DynamicTree(K, D, N))
  tokens, parents = np.asarray(t.tokens), np.asarray(t.parents)
  for b in range(B):
    assert parents[b, 0] == -1 and all(0 <= parents[b, i] < i for i in range(1, N))
    assert (tokens[b, 1:] >= 0).all()
    paths = set()
    for i in range(1, N):
      p, j = [], i
      while j > 0:
        p.append(int(tokens[b, j]))
        j = parents[b, j]
      paths.add(tuple(p[::-1]))
    assert paths == _brute_force_grow(first[b], table, K, D, N)


def test_dynamic_tree_shape_checks():
  with pytest.raises(ValueError, match="holds"):
    tree_expand.DynamicTree(topk=2, depth=3, nodes=3)
  with pytest.raises(ValueError, match="holds"):
    tree_expand.DynamicTree(topk=2, depth=2, nodes=8)  # at most 1 + 2 + 4
  assert tree_expand.DynamicTree(topk=4, depth=3, nodes=20).lookahead == 19


def _eagle_tree(params, K=3, D=3, N=10, d2t=None):
  from tests.proposers.test_medusa_eagle import _eagle
  chain, pparams = _eagle(params, d2t, k=D)
  return dataclasses.replace(chain, k=D, tree=tree_expand.DynamicTree(K, D, N)), pparams


def _draft_tree(params, K=3, D=3, N=10, d2t=None):
  from tests.proposers.test_medusa_eagle import _distilled
  chain, pparams = _distilled(params, d2t, k=D)
  return dataclasses.replace(chain, k=D, tree=tree_expand.DynamicTree(K, D, N)), pparams


@pytest.mark.parametrize("make,d2t", [(_eagle_tree, None), (_eagle_tree, "reduced"), (_draft_tree, None),
                                      (_draft_tree, "reduced")])
def test_dynamic_tree_greedy_identity(make, d2t):
  from tests.proposers.test_medusa_eagle import D2T
  params = _params()
  prompts = _prompts(0, [5, 13, 3])
  base = generate(params, CONFIG, prompts, max_new_tokens=18)
  prop, pparams = make(params, d2t=D2T if d2t else None)
  for adaptive in (False, True) if d2t is None else (False,):
    got = generate(params, CONFIG, prompts, max_new_tokens=18, proposer=prop, proposer_params=pparams,
                   adaptive_k=adaptive)
    assert got.token_ids == base.token_ids and got.finish_reasons == base.finish_reasons
  assert got.stats["drafted_tokens"] > 0


def test_eagle_tree_children_are_the_drafters_top_candidates_after_their_path():
  """Each node's token is among the top-k of EAGLE's distribution after feeding its path as a chain: the
  expansion's tree mask gives every frontier node exactly its ancestors."""
  from spec_jax.decode import make_spec
  from spec_jax.batch import start
  from spec_jax.proposers import eagle as eagle_lib
  from spec_jax.proposers.base import ProposeContext
  params = _params()
  K, D, N = 3, 3, 9
  prop, pparams = _eagle_tree(params, K, D, N)
  spec = make_spec(CONFIG, prop, adaptive_k=False)
  both = {"target": params, "proposer": pparams}
  prompts = _prompts(2, [9, 6])
  state = start(both, spec, prompts, max_new_tokens=8)
  ctx = ProposeContext(state.tokens, state.lengths, state.sampling, state.last_hidden)
  t, _ = prop.propose_tree(pparams, state.pstate, ctx, jax.random.PRNGKey(0))
  tokens, parents = np.asarray(t.tokens), np.asarray(t.parents)
  L = np.asarray(state.lengths)
  for b in range(len(prompts)):
    c = state.pstate.cache
    one_cache = c.replace(lengths=c.lengths[b:b + 1], pages=c.pages[b:b + 1])
    for i in range(1, N):
      path, j = [], parents[b, i]
      while j > 0:
        path.append(int(tokens[b, j]))
        j = parents[b, j]
      path = path[::-1]  # the ancestors' tokens, root excluded
      cache = one_cache.replace(lengths=jnp.asarray([L[b] - 2], jnp.int32))
      feat, cache = eagle_lib.eagle_forward(pparams, prop.config, state.last_hidden[b:b + 1, None],
                                            state.tokens[b:b + 1, L[b] - 1:L[b]], cache.lengths[:, None], cache)
      for x in path:
        cache = cache.replace(lengths=cache.lengths + 1)
        feat, cache = eagle_lib.eagle_forward(pparams, prop.config, feat, jnp.asarray([[x]]), cache.lengths[:, None],
                                              cache)
      logits = np.asarray(medusa.vocab.project(feat[0, -1], pparams["rows"]))
      assert tokens[b, i] in np.argsort(-logits)[:K], (b, i, path)


@pytest.mark.slow
def test_gemma3_greedy_with_medusa_eagle_and_draft_trees_is_lossless(gemma3_f32, gemma3_tokenizer):
  from spec_jax.proposers.registry import Target, build_proposer
  from spec_jax.spec_config import SpecConfig
  from tests.proposers.test_medusa_eagle import assert_gemma3_greedy_lossless, gemma3_chat_prompts
  config, params = gemma3_f32
  runs = {}
  for method, depth, topk, nodes in (("draft", 3, 2, 8), ("eagle", 4, 3, 16), ("medusa", 4, 3, 16)):
    spec = SpecConfig(method, depth, eagle_topk=topk, num_draft_tokens=nodes,
                      draft_layers=6 if method == "draft" else 0)
    runs[method] = build_proposer(spec, Target(config, params))
    assert runs[method][0].tree is not None and runs[method][0].tree.nodes == nodes
  assert_gemma3_greedy_lossless(config, params, gemma3_chat_prompts(gemma3_tokenizer), runs)
