"""Tree verification, case by case (split from test_verify_tree.py, which keeps the exactness tests): zero-probability
tokens, deterministic children, duplicate siblings, padding nodes, greedy walks, the chain against verify_chain,
shape errors."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from spec_jax import sampling, streams
from spec_jax.config import SamplingParams
from spec_jax.verify import PAD, _verify_tree, verify_chain, verify_tree
from tests.test_verify_tree import V, VERIFY


VERIFY_COINS = jax.jit(_verify_tree, static_argnames=("max_depth", "max_children"))


def run_coins(logits, toks, parents, q, coins, params, seed=0):
  """The edge cases share one shape: B = 3 rows of a star-like tree of N = 5 nodes, depth 1, 3 child slots."""
  b = logits.shape[0]
  u = jnp.broadcast_to(jnp.asarray(coins, jnp.float32), (b, 1, 3))
  out = VERIFY_COINS(jnp.asarray(logits), jnp.asarray(toks, jnp.int32), jnp.asarray(parents, jnp.int32),
                     None if q is None else jnp.asarray(q), u, jax.random.key(seed), params, max_depth=1,
                     max_children=3)
  return tuple(np.asarray(o) for o in out)


def star_logits(b=3, n=5, v=V, seed=0):
  return np.random.default_rng(seed).normal(size=(b, n, v)).astype(np.float32)


STAR = np.tile([-1, 0, 0, 0, 0], (3, 1))


def test_zero_probability_token_never_accepted_with_zero_coin():
  """Sampled children, coin exactly 0: every child with p > 0 would be accepted; children with p = 0 (outside
  top-k, or a -inf logit) must not be, whether q gives them mass or not. (Deterministic children take no coins:
  test_deterministic_children_follow_the_targets_draw.)"""
  logits = star_logits()
  logits[:, 0] = [5.0, 4.0, 0.0, -1.0, -2.0, -3.0]
  logits[2, 0, 3] = -np.inf
  params = SamplingParams.stack([(1.0, 2, 1.0), (0.9, 2, 1.0), (1.0, 0, 1.0)])  # row 2: only the -inf is p = 0
  toks = np.array([[0, 2, 3, 1, 0], [0, 5, 4, 1, 0], [0, 3, 3, 2, 0]], np.int32)  # p = 0, p = 0, then p > 0
  # q only on p = 0 tokens, so the residual max(p - q, 0) keeps p. Row 0: q(2) = 0 too (0 * 0 < 0 is still false).
  q = np.full((3, 5, V), 1 / V, np.float32)
  q[:, 0] = [[0, 0, 0, 0.5, 0.5, 0], [0, 0, 0, 0.2, 0.4, 0.4], [0, 0, 0, 1, 0, 0]]
  tokens, num_acc, nodes = run_coins(logits, toks, STAR, q, 0.0, params)
  np.testing.assert_array_equal(nodes[:, 1], [3, 3, 3])
  np.testing.assert_array_equal(tokens[:, 0], [1, 1, 2])
  # All tried children p = 0: nothing accepted, the correction is a p > 0 token.
  toks[:, 3] = [4, 2, 3]
  for seed in range(3):
    tokens, num_acc, nodes = run_coins(logits, toks, STAR, q, 0.0, params, seed)
    assert np.all(num_acc == 0)
    assert np.all(np.isin(tokens[:2, 0], [0, 1])) and tokens[2, 0] != 3


def test_deterministic_children_follow_the_targets_draw():
  """Deterministic children: the emitted tokens are the target's own draws with the rows' TOKEN keys of their
  positions (what plain decoding draws), whatever the tree; the accepted child is the first one equal to the draw,
  so a p = 0 child (outside top-k, a -inf logit) and a duplicate sibling are never accepted."""
  b, reps = 3, 200
  logits = star_logits()
  logits[:, 0] = [5.0, 4.0, 0.0, -1.0, -2.0, -3.0]
  logits[2, 0, 3] = -np.inf
  rows = [(1.0, 2, 1.0), (0.9, 2, 1.0), (1.0, 0, 1.0)]
  toks = np.array([[0, 2, 3, 1, 1], [0, 5, 4, 0, 0], [0, 3, 1, 1, 4]], np.int32)  # p = 0 first; duplicates last
  R = b * reps
  params = SamplingParams.stack(rows * reps)
  lg = jnp.asarray(np.tile(logits, (reps, 1, 1)))
  keys = jax.random.split(jax.random.key(5), R)
  positions = jnp.arange(R, dtype=jnp.int32) % 7 + 3
  tokens, num_acc, nodes = (np.asarray(o) for o in VERIFY(lg, jnp.asarray(np.tile(toks, (reps, 1))),
                                                           jnp.asarray(np.tile(STAR, (reps, 1))), None, keys, params,
                                                           positions=positions, max_depth=1, max_children=4))
  own = np.asarray(jax.jit(sampling.sample)(streams.at(keys, positions, streams.TOKEN), lg[:, 0], params))
  np.testing.assert_array_equal(tokens[:, 0], own)  # the first emitted token is the root's own draw
  t = np.tile(toks, (reps, 1))
  first = np.array([next((j for j in range(1, 5) if t[r, j] == own[r]), -1) for r in range(R)])
  np.testing.assert_array_equal(np.where(num_acc == 1, nodes[:, 1], -1), first)
  # Never a p = 0 child (rows 0, 1: nodes 1, 2 outside top-2; row 2: node 1's -inf) nor a duplicate (node 4 of
  # rows 0, 1; node 3 of row 2).
  assert set(nodes[0::3, 1]) <= {3, -1} and set(nodes[1::3, 1]) <= {3, -1} and set(nodes[2::3, 1]) <= {2, 4, -1}
  assert (num_acc == 1).any() and (num_acc == 0).any()


def test_duplicate_siblings():
  """Sampled children: a rejected token's duplicate sibling is never accepted, even with coin 0."""
  logits = star_logits()
  logits[:, 0] = [2.0, 1.0, 0.5, 0.0, -1.0, -1.0]
  toks = np.tile([0, 0, 0, 1, 2], (3, 1))  # x, x, y
  params = SamplingParams.make(3, 1.0)
  coins = np.array([[[0.999, 0.0, 0.0]]])  # reject x (p(x) < 0.999), then coin 0
  # Sampled children: x is only ever rejected where q(x) > p(x), which leaves max(p - q, 0) no mass on x, so its
  # duplicate cannot win either; y (p(y) > q(y)) is accepted with coin 0.
  q = np.full((3, 5, V), 1 / V, np.float32)
  q[:, 0] = [0.8, 0.04, 0.04, 0.04, 0.04, 0.04]
  _, _, nodes = run_coins(logits, toks, STAR, q, coins, params)
  np.testing.assert_array_equal(nodes[:, 1], 3)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_padding_nodes(temperature):
  """Padding (-1) is never accepted, not even where the clamped index would be the argmax (0 or V-1) or with coin
  0, and it takes no child slot: with 3 slots, the real child after three padding siblings is still tried."""
  logits = star_logits()
  logits[0, 0, 0] = 30.0  # argmax 0
  logits[1, 0, V - 1] = 30.0  # argmax V-1
  logits[2, 0, 2] = 30.0
  toks = np.array([[0, -1, -1, -1, 0], [0, -1, -1, -1, V - 1], [0, -1, -1, -1, 2]], np.int32)
  params = SamplingParams.make(3, temperature)
  tokens, num_acc, nodes = run_coins(logits, toks, STAR, None, 0.0, params)
  np.testing.assert_array_equal(nodes[:, 1], [4, 4, 4])
  # Only padding under the root: nothing accepted, the argmax is the correction.
  toks[:, 4] = -1
  tokens, num_acc, _ = run_coins(logits, toks, STAR, None, 0.0, params)
  np.testing.assert_array_equal(num_acc, 0)
  np.testing.assert_array_equal(tokens[:, 0], [0, V - 1, 2])


# ---------------------------------------------------------------------------------------------------------------
# Greedy
# ---------------------------------------------------------------------------------------------------------------


def greedy_walk(logits, toks, parents, max_depth):
  """Numpy reference: follow the first child equal to the target argmax."""
  b, n, _ = logits.shape
  target = logits.argmax(-1)
  out_t, out_n, out_nodes = [], [], []
  for r in range(b):
    cur, path = 0, [0]
    while len(path) <= max_depth:
      kids = [j for j in range(1, n) if parents[r, j] == cur and toks[r, j] >= 0 and toks[r, j] == target[r, cur]]
      if not kids:
        break
      cur = kids[0]
      path.append(cur)
    emitted = [toks[r, j] for j in path[1:]] + [target[r, cur]]
    out_t.append(emitted + [PAD] * (max_depth + 1 - len(emitted)))
    out_n.append(len(path) - 1)
    out_nodes.append(path + [-1] * (max_depth + 1 - len(path)))
  return np.array(out_t), np.array(out_n), np.array(out_nodes)


# The greedy tests share one shape (B = 12 rows, N = 16 nodes, depth 3, 4 child slots): one compilation.
GB, GN, GDEPTH, GCHILDREN = 12, 16, 3, 4
VERIFY_CHAIN = jax.jit(verify_chain)


@pytest.mark.parametrize("mixed", [False, True], ids=["all_greedy", "mixed_batch"])
def test_greedy_random_trees(mixed):
  """Greedy rows follow the first child equal to the argmax, in the all-greedy fast path and in a mixed batch
  (general path, where top_k = 1 rows are greedy too). The trees are deeper than max_depth: the walk stops there."""
  rng = np.random.default_rng(7)
  v = 5
  parents = np.full((GB, GN), -1, np.int32)
  for r in range(GB):
    for i in range(1, GN):
      parents[r, i] = rng.integers(max(0, i - 4), i)
  logits = rng.normal(size=(GB, GN, v)).astype(np.float32)
  toks = rng.integers(-1, v, size=(GB, GN)).astype(np.int32)  # some padding
  hit = rng.random((GB, GN)) < 0.5  # half of the nodes carry their parent's argmax: deep paths, duplicates
  toks = np.where(hit, logits.argmax(-1)[np.arange(GB)[:, None], np.maximum(parents, 0)], toks).astype(np.int32)
  toks[:, 0] = 0
  rows = [(0.0, 0, 1.0)] * GB
  if mixed:
    rows = [(0.0, 0, 1.0) if r % 3 else ((1.0, 0, 1.0) if r % 2 else (0.7, 1, 1.0)) for r in range(GB)]
  params = SamplingParams.stack(rows)
  check = [r for r in range(GB) if rows[r][0] == 0 or rows[r][1] == 1]
  out = VERIFY(jnp.asarray(logits), jnp.asarray(toks), jnp.asarray(parents), None, jax.random.key(0), params,
               max_depth=GDEPTH, max_children=GCHILDREN)
  ref = greedy_walk(logits, toks, parents, GDEPTH)
  for got, want in zip(out, ref):
    np.testing.assert_array_equal(np.asarray(got)[check], want[check])
  assert ref[1][check].max() == GDEPTH and ref[1][check].min() < GDEPTH


@pytest.mark.parametrize("temperature,top_k", [(0.0, 0), (1.0, 1)])
def test_chain_equals_verify_chain_greedy(temperature, top_k):
  """A tree where every node has one child is a chain: the same tokens and acceptance as verify_chain. (Nodes
  after the chain are padding children of the root: never tried.)"""
  rng = np.random.default_rng(8)
  k, v = GDEPTH, 11
  logits = rng.normal(size=(GB, GN, v)).astype(np.float32)
  target = logits.argmax(-1)
  drafts = target[:, :k].copy()
  for r in range(k):
    drafts[r, r] = (target[r, r] + 1) % v  # row r matches exactly r drafts
  drafts[k, 1] = -1  # a missing draft
  params = SamplingParams.make(GB, temperature, top_k)
  want_t, want_n = VERIFY_CHAIN(jnp.asarray(logits[:, :k + 1]), jnp.asarray(drafts), None, jax.random.key(0), params)
  toks = np.full((GB, GN), -1, np.int32)
  toks[:, 0], toks[:, 1:k + 1] = 0, drafts
  parents = np.zeros((GB, GN), np.int32)
  parents[:, :k + 1] = np.arange(-1, k)
  got_t, got_n, nodes = VERIFY(jnp.asarray(logits), jnp.asarray(toks), jnp.asarray(parents), None, jax.random.key(1),
                               params, max_depth=GDEPTH, max_children=GCHILDREN)
  np.testing.assert_array_equal(got_t, want_t)
  np.testing.assert_array_equal(got_n, want_n)
  np.testing.assert_array_equal(np.asarray(got_n), [0, 1, 2, 1] + [3] * (GB - 4))
  pos = np.arange(k + 1)[None]
  np.testing.assert_array_equal(nodes, np.where(pos <= np.asarray(got_n)[:, None], pos, -1))


def test_shape_errors():
  b, n = 2, 4
  logits = jnp.asarray(star_logits(b, n))
  parents = jnp.asarray(np.tile([-1, 0, 1, 2], (b, 1)), jnp.int32)
  toks = jnp.zeros((b, n), jnp.int32)
  with pytest.raises(ValueError):
    verify_tree(logits, toks[:, :3], parents, None, jax.random.key(0), SamplingParams.make(b))
  with pytest.raises(ValueError):
    verify_tree(logits, toks, parents, jnp.zeros((b, n, V + 1)), jax.random.key(0), SamplingParams.make(b))
  with pytest.raises(ValueError):
    verify_tree(logits, toks, parents, None, jax.random.key(0), SamplingParams.make(b), max_depth=n)
