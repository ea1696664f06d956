"""spec_jax.verify.verify_tree: exactness of multi-draft tree verification (statistical), greedy, edge cases.

The exactness check uses a tiny "target model" whose next-token logits depend on the path's tokens only (a table
per depth over V = 6 tokens), so the warped target distribution of every prefix is known exactly. Trees are drawn
per sample inside one jitted batch (sampled children i.i.d. from a draft table q, or deterministic top-ranked
children), then verified. Whatever the tree, the emitted tokens must follow the target:
- per depth i, tokens[i] given the emitted prefix tokens[:i] (over samples that accepted i nodes) follows p(.|prefix);
  at i = 0 this is the first emitted token against p(.|root);
- the first two emitted tokens of the generation (tokens[1] if a node was accepted, else the next step's draw from
  p(.|tokens[0])) follow p(x) p(y|x) jointly.
A verifier that forgets the residual update between siblings (below, `reference_verify(..., update=False)`) fails
the same check at the same sample size; the same reference with the update passes it.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from spec_jax import sampling
from spec_jax.config import SamplingParams
from spec_jax.verify import PAD, verify_tree
from tests.test_sampling import ref_probs

P_MIN = 1e-4
N_SAMPLES = 20000
V = 6
ROWS = [(1.0, 0, 1.0), (0.8, 3, 1.0), (1.2, 0, 0.75), (0.0, 0, 1.0)]  # temperature, top-k, top-p, greedy


class Tree:
  """A static tree shape: parents, padding nodes, and for deterministic children the rank (in the draft table's
  order) of each node's token among its parent's candidates (equal ranks: duplicate siblings)."""

  def __init__(self, name, parents, pad=(), ranks=None):
    self.name = name
    self.parents = np.asarray(parents, np.int32)
    n = len(parents)
    self.pad = np.zeros(n, bool)
    self.pad[list(pad)] = True
    self.depth = np.zeros(n, np.int32)
    for i in range(1, n):
      self.depth[i] = self.depth[parents[i]] + 1
    real = ~self.pad
    real[0] = True
    reach = real.copy()  # not under a padding node
    for i in range(1, n):
      reach[i] = real[i] and reach[parents[i]]
    self.max_depth = int(self.depth[reach].max())
    kids = [np.sum(reach & (self.parents == a)) for a in range(n)]
    self.max_children = int(max(kids))
    if ranks is None:  # k-th child of a node: the k-th ranked token
      ranks = [0] + [int(np.sum((self.parents[1:i] == parents[i]) & ~self.pad[1:i])) for i in range(1, n)]
    self.ranks = np.asarray(ranks, np.int32)


TREES = [
    # wide: 3 root children, 2 grandchildren each; deterministic children: the third root child duplicates the first
    Tree("wide", [-1, 0, 0, 0, 1, 1, 2, 2, 3], ranks=[0, 0, 1, 0, 0, 1, 0, 1, 0]),
    # deep and interleaved, as a reranked EAGLE-2 tree: root children 1, 2, 7; the path 0-1-3-6-8 has depth 4
    Tree("deep", [-1, 0, 0, 1, 2, 1, 3, 0, 6]),
    # padding: root children 1 (padding, with a real child 3 under it), 2 and 7 (padding); node 2's children 4 and 6
    # (padding)
    Tree("padded", [-1, 0, 0, 1, 2, 4, 2, 0, 4], pad=(1, 6, 7, 8), ranks=[0] * 9),
]
# Every tree has N = 9 and is verified with the same static bounds, so the verifier compiles once per mode.
N_NODES, MAX_DEPTH, MAX_CHILDREN = 9, 4, 3
assert all(len(t.parents) == N_NODES and t.max_depth <= MAX_DEPTH and t.max_children <= MAX_CHILDREN for t in TREES)
VERIFY = jax.jit(verify_tree, static_argnames=("max_depth", "max_children"))


@functools.lru_cache(maxsize=None)
def target_model(seed=0, max_depth=4):
  """Tables per depth d: logits L[d] [V**d, V] (indexed by the path code) and draft distributions Q[d] that differ
  from the target, with a zero where the target has mass (and mass where top-k/top-p zero it)."""
  rng = np.random.default_rng(seed)
  logits, q = [], []
  for d in range(max_depth + 1):
    x = (rng.normal(size=(V ** d, V)) * 1.2).astype(np.float32)
    for row in ROWS:
      for r in range(x.shape[0]):
        assert ref_probs(x[r], *row)[1] > 1e-4  # no ambiguous top-p boundary in float32
    ql = x + rng.normal(size=x.shape) * 1.0
    ql[np.arange(x.shape[0]), rng.integers(0, V, x.shape[0])] = -np.inf
    qq = np.exp(ql - ql.max(-1, keepdims=True))
    logits.append(x)
    q.append((qq / qq.sum(-1, keepdims=True)).astype(np.float32))
  return logits, q


def code(prefix):
  c = 0
  for t in prefix:
    c = c * V + int(t)
  return c


@functools.lru_cache(maxsize=None)
def target_p(row, prefix):
  """The exact warped target distribution after the emitted prefix (a tuple), float64 [V]."""
  logits, _ = target_model()
  return ref_probs(logits[len(prefix)][code(prefix)], *ROWS[row])[0]


def make_batch(key, tree: Tree, sampled: bool, n: int):
  """n samples of the tree for every row of ROWS, as one batch of n * len(ROWS) rows (row s * B + r: sample s of
  ROWS[r]). Returns target logits [R, N, V], tokens [R, N], parents [R, N], draft probs [R, N, V], params."""
  logits_t, q_t = target_model()
  b = len(ROWS)
  rows = n * b
  nn = len(tree.parents)
  keys = jax.random.split(key, nn)
  codes = [jnp.zeros((rows,), jnp.int32)]
  toks = [jnp.zeros((rows,), jnp.int32)]  # the root's (already committed) token is irrelevant
  for i in range(1, nn):
    pa, d = int(tree.parents[i]), int(tree.depth[tree.parents[i]])
    if tree.pad[i] or tree.pad[pa]:
      tok = jnp.full((rows,), -1 if tree.pad[i] else 0, jnp.int32)
      c = jnp.zeros((rows,), jnp.int32)
    else:
      q_pa = jnp.asarray(q_t[d])[codes[pa]]  # [R, V]
      if sampled:
        tok = jax.random.categorical(keys[i], jnp.log(q_pa), axis=-1).astype(jnp.int32)
      else:
        tok = jnp.argsort(-q_pa, axis=-1, stable=True)[:, tree.ranks[i]].astype(jnp.int32)
      c = codes[pa] * V + tok
    toks.append(tok)
    codes.append(c)
  logits = jnp.stack([jnp.asarray(logits_t[tree.depth[i]])[codes[i]] for i in range(nn)], 1)
  q = jnp.stack([jnp.asarray(q_t[tree.depth[i]])[codes[i]] for i in range(nn)], 1)
  parents = jnp.broadcast_to(jnp.asarray(tree.parents), (rows, nn))
  params = jax.tree.map(lambda a: jnp.tile(a, n), SamplingParams.stack(ROWS))
  return logits, jnp.stack(toks, 1), parents, q, params


def run_many(verify_fn, tree: Tree, sampled: bool, n=N_SAMPLES, seed=0):
  """verify_fn (jitted, static max_depth/max_children) on n samples of the tree for each row of ROWS. Returns
  tokens [n, B, D+1], num_accepted [n, B], accepted_nodes [n, B, D+1], tree tokens [n, B, N]."""
  k_tree, k_verify = jax.random.split(jax.random.key(seed))
  logits, toks, parents, q, params = jax.jit(make_batch, static_argnums=(1, 2, 3))(k_tree, tree, sampled, n)
  out = verify_fn(logits, toks, parents, q if sampled else None, k_verify, params, max_depth=MAX_DEPTH,
                  max_children=MAX_CHILDREN)
  b = len(ROWS)
  return tuple(np.asarray(o).reshape((n, b) + o.shape[1:]) for o in (*out, toks))


def _chi2(counts, probs):
  """(statistic, degrees of freedom) of counts against probs; cells with expectation < 5 are lumped."""
  counts, probs = np.asarray(counts, np.float64), np.asarray(probs, np.float64)
  assert counts[probs == 0].sum() == 0, "emitted a token the target gives probability 0"
  exp = counts.sum() * probs
  big = exp >= 5
  obs, ex = list(counts[big]), list(exp[big])
  if (~big & (probs > 0)).any():
    obs.append(counts[~big].sum())
    ex.append(exp[~big].sum())
  obs, ex = np.array(obs), np.array(ex)
  return float(np.sum((obs - ex) ** 2 / ex)) if len(obs) > 1 else 0.0, max(0, len(obs) - 1)


def _pvalue(stat, dof):
  return float(stats.chi2.sf(stat, dof)) if dof > 0 else 1.0


def exactness_pvalues(tokens, num_acc, seed=0):
  """p-values per (row of ROWS, check): per depth, the emitted token given the emitted prefix; and the completed
  pair of the first two emitted tokens. Returns a dict {(row, check): p}."""
  n, b, d1 = tokens.shape
  rng = np.random.default_rng(seed)
  out = {}
  for r in range(b):
    for i in range(d1):
      sel = num_acc[:, r] >= i
      pre = tokens[sel, r, :i].astype(np.int64) @ (V ** np.arange(i - 1, -1, -1, dtype=np.int64))  # prefix codes
      groups, inv, sizes = np.unique(pre, return_inverse=True, return_counts=True)
      counts = np.bincount(inv * V + tokens[sel, r, i], minlength=len(groups) * V).reshape(-1, V)
      stat, dof = 0.0, 0
      for g in np.nonzero(sizes >= 30)[0]:
        prefix = tuple(int(c) // V ** j % V for j in range(i - 1, -1, -1) for c in [groups[g]])
        s, f = _chi2(counts[g], target_p(r, prefix))
        stat, dof = stat + s, dof + f
      out[(r, f"depth{i}")] = _pvalue(stat, dof)
    t0 = tokens[:, r, 0]
    t1 = tokens[:, r, 1].copy() if d1 > 1 else np.zeros(n, np.int64)
    nxt = num_acc[:, r] < 1  # the next step would draw tokens[1] from p(.|tokens[0])
    for a in np.unique(t0[nxt]):
      m = nxt & (t0 == a)
      t1[m] = rng.choice(V, size=m.sum(), p=target_p(r, (int(a),)))
    joint = (target_p(r, ())[:, None] * np.stack([target_p(r, (a,)) for a in range(V)])).reshape(-1)  # [x * V + y]
    out[(r, "pair")] = _pvalue(*_chi2(np.bincount(t0 * V + t1, minlength=V * V), joint))
  return out


def check_structure(tree: Tree, tokens, num_acc, nodes, toks):
  """The path is a root-to-node path of real nodes whose tokens are the emitted ones; PAD and -1 after."""
  n, b, d1 = tokens.shape
  assert tokens.dtype == np.int32 and num_acc.dtype == np.int32 and nodes.dtype == np.int32
  assert num_acc.min() >= 0 and num_acc.max() <= tree.max_depth
  pos = np.arange(d1)[None, None]
  assert np.all(tokens[pos > num_acc[..., None]] == PAD)
  assert np.all(nodes[pos > num_acc[..., None]] == -1)
  assert np.all(nodes[..., 0] == 0)
  for t in range(1, d1):
    on = num_acc >= t
    nd = nodes[..., t][on]
    assert np.all(tree.parents[nd] == nodes[..., t - 1][on])
    assert not tree.pad[nd].any()
    np.testing.assert_array_equal(np.take_along_axis(toks, nodes[..., t:t + 1].clip(0), 2)[..., 0][on],
                                  tokens[..., t - 1][on])


def reference_verify(target_logits, tree_tokens, parents, draft_probs, key, params, *, max_depth, max_children,
                     update=True, tree: Tree = None):
  """A small independent verifier over a static tree shape: every node's outcome (accepted child or final draw)
  is computed for every row, then the rows walk. update=False is the negative control: it forgets the residual
  update between siblings (each sibling is tried against the node's own p; the final draw uses the residual of
  one rejection: max(p - q, 0), or p without the rejected tokens for deterministic children)."""
  del parents, max_depth, max_children
  r_, n, v = target_logits.shape
  p_all = sampling.warped_probs(target_logits, params)
  keys = jax.random.split(key, 2 * n)
  acc_child, final = [], []
  for a in range(n):
    p = p_all[:, a]
    q = draft_probs[:, a] if draft_probs is not None else None
    kids = [j for j in range(1, n) if tree.parents[j] == a and not tree.pad[j]]
    u = jax.random.uniform(keys[2 * a], (r_, max(1, len(kids))))
    taken, child = jnp.zeros((r_,), bool), jnp.full((r_,), -1, jnp.int32)
    resid, resid0 = p, p
    for c, j in enumerate(kids):
      x = tree_tokens[:, j]
      onehot = jax.nn.one_hot(x, v)
      qq = onehot if q is None else q
      cur = resid if update else p
      ok = u[:, c] * jnp.sum(qq * onehot, -1) < jnp.sum(cur * onehot, -1)
      ok = ok & ~taken
      rej = ~taken & ~ok
      if update:
        nr = jnp.maximum(resid - qq, 0.0)
        nr = nr / jnp.maximum(nr.sum(-1, keepdims=True), 1e-30)
        resid = jnp.where((rej & (nr.sum(-1) > 0))[:, None], nr, resid)
      else:
        one = jnp.maximum(p - qq, 0.0) if q is not None else resid0 * (1 - onehot)
        resid0 = jnp.where((rej & (one.sum(-1) > 0))[:, None], one, resid0)
        resid = resid0
      child = jnp.where(ok, j, child)
      taken = taken | ok
    acc_child.append(child)
    final.append(jax.random.categorical(keys[2 * a + 1], jnp.log(resid), axis=-1).astype(jnp.int32))
  acc_child, final = jnp.stack(acc_child, 1), jnp.stack(final, 1)  # [R, N]
  cur = jnp.zeros((r_,), jnp.int32)
  alive = jnp.ones((r_,), bool)
  toks, nodes, n_acc = [], [cur], jnp.zeros((r_,), jnp.int32)
  rows = jnp.arange(r_)
  for _ in range(tree.max_depth):
    ch = acc_child[rows, cur]
    emit = jnp.where(alive & (ch >= 0), tree_tokens[rows, jnp.maximum(ch, 0)], final[rows, cur])
    toks.append(jnp.where(alive, emit, PAD))
    alive = alive & (ch >= 0)
    cur = jnp.where(alive, ch, cur)
    n_acc = n_acc + alive
    nodes.append(jnp.where(alive, cur, -1))
  toks.append(jnp.where(alive, final[rows, cur], PAD))
  pad = MAX_DEPTH - tree.max_depth  # the same output width as verify_tree's
  return (jnp.pad(jnp.stack(toks, 1), ((0, 0), (0, pad)), constant_values=PAD).astype(jnp.int32),
          n_acc.astype(jnp.int32), jnp.pad(jnp.stack(nodes, 1), ((0, 0), (0, pad)), constant_values=-1))


REFERENCE = jax.jit(reference_verify, static_argnames=("max_depth", "max_children", "update", "tree"))


# ---------------------------------------------------------------------------------------------------------------
# Exactness
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("sampled", [True, False], ids=["sampled", "deterministic"])
@pytest.mark.parametrize("tree", TREES, ids=[t.name for t in TREES])
def test_exact(tree, sampled):
  tokens, num_acc, nodes, toks = run_many(VERIFY, tree, sampled)
  check_structure(tree, tokens, num_acc, nodes, toks)
  pv = exactness_pvalues(tokens, num_acc)
  assert min(pv.values()) > P_MIN, {k: v for k, v in pv.items() if v < 1e-2}
  # The walk goes deep: every depth is reached by some sampling row, and greedy rows emit one fixed sequence.
  assert num_acc[:, :3].max() == tree.max_depth
  g = len(ROWS) - 1
  assert np.all(tokens[:, g] == tokens[0, g]) and np.all(num_acc[:, g] == num_acc[0, g])


def test_independent_reference_passes():
  """The reference verifier below, with the residual update, passes the check: it is a fair judge."""
  tree = TREES[0]
  pv_good = exactness_pvalues(*run_many(functools.partial(REFERENCE, tree=tree, update=True), tree, True, seed=1)[:2])
  assert min(pv_good.values()) > P_MIN, pv_good


@pytest.mark.parametrize("sampled", [True, False], ids=["sampled", "deterministic"])
def test_negative_control_fails_without_residual_update(sampled):
  """The same check at the same sample size fails a verifier that forgets the residual update between siblings."""
  tree = TREES[0]
  pv_bad = exactness_pvalues(*run_many(functools.partial(REFERENCE, tree=tree, update=False), tree, sampled,
                                       seed=1)[:2])
  assert min(pv_bad.values()) < P_MIN, pv_bad
  # Caught at the first emitted token already, for every sampling row that has siblings to try.
  assert all(pv_bad[(r, "depth0")] < P_MIN for r in range(len(ROWS) - 1)), pv_bad


# ---------------------------------------------------------------------------------------------------------------
# Edge cases, with the coins injected
# ---------------------------------------------------------------------------------------------------------------
