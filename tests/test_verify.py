"""spec_jax.verify.verify_chain: exactness of speculative sampling (statistical), greedy verification, edge cases.

The exactness check: for fixed target logits (so the target distribution at position i does not depend on the
tokens before it), the committed token at position 0 must follow the warped target p0, and the committed token at
position i >= 1, over the samples that accepted the first i drafts, must follow p_i. The acceptance counts must match
prod_j sum_x min(p_j, q_j). Deliberately wrong verifiers fail the same check at the same sample size.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from spec_jax import sampling
from spec_jax.config import SamplingParams
from spec_jax.verify import PAD, verify_chain
from tests.test_sampling import chi2_pvalue, ref_probs

P_MIN = 1e-4
N_SAMPLES = 40000
V = 10
K = 3
ROWS = [(1.0, 0, 1.0), (0.7, 5, 1.0), (1.3, 0, 0.8), (0.9, 6, 0.9), (0.0, 0, 1.0)]  # the last row is greedy


def make_problem(seed, k=K, rows=ROWS, v=V):
  """Random target logits [B, k+1, V], a drafter distribution q [B, k, V] that differs from p (and has zeros where
  p does not, and mass where p is 0), and the numpy reference of the warped p."""
  rng = np.random.default_rng(seed)
  b = len(rows)
  logits = (rng.normal(size=(b, k + 1, v)) * 1.5).astype(np.float32)
  q_logits = logits[:, :k] + rng.normal(size=(b, k, v)) * 0.8
  q_logits[..., int(rng.integers(v))] = -np.inf
  q = np.exp(q_logits - q_logits.max(-1, keepdims=True))
  q = (q / q.sum(-1, keepdims=True)).astype(np.float32)
  p = np.zeros((b, k + 1, v))
  for r, row in enumerate(rows):
    for i in range(k + 1):
      p[r, i], margin = ref_probs(logits[r, i], *row)
      assert margin > 1e-4
  return jnp.asarray(logits), jnp.asarray(q), p


def run_many(verify_fn, logits, q, params, *, drafts=None, n=N_SAMPLES, seed=0):
  """n independent verifications of the same problem, as one batch of n * B rows (row s * B + r is sample s of
  problem row r; every row draws its own randomness). With drafts=None the drafts are sampled from q and q is passed
  as draft_probs; otherwise the fixed drafts are verified as a deterministic drafter (draft_probs=None).
  Returns tokens [n, B, k+1] and num_accepted [n, B]."""
  b = logits.shape[0]

  def tile(a):
    return jnp.tile(a, (n,) + (1,) * (a.ndim - 1))

  def go(logits, q, drafts, params, key):
    k_draft, k_verify = jax.random.split(key)
    logits, params = tile(logits), jax.tree.map(tile, params)
    if drafts is None:
      q = tile(q)
      d = jax.random.categorical(k_draft, jnp.log(q), axis=-1).astype(jnp.int32)
      return verify_fn(logits, d, q, k_verify, params)
    return verify_fn(logits, tile(drafts), None, k_verify, params)

  tokens, num_acc = jax.jit(go)(logits, q, drafts, params, jax.random.key(seed))
  return np.asarray(tokens).reshape(n, b, -1), np.asarray(num_acc).reshape(n, b)


def exactness_pvalues(tokens, num_acc, p, accept_probs):
  """p-values of (a) the committed-token distributions position by position and (b) the acceptance counts.

  tokens [N, B, k+1], num_acc [N, B], p [B, k+1, V] the reference target, accept_probs [B, k] the expected per-position
  acceptance probability (sum_x min(p, q), or p(draft) for a deterministic drafter)."""
  n, b, k1 = tokens.shape
  dist, accept = [], []
  for r in range(b):
    for i in range(k1):
      reached = num_acc[:, r] >= i
      if reached.sum() >= 200:
        dist.append(chi2_pvalue(tokens[reached, r, i], p[r, i]))
    if k1 > 1:
      # Joint check: after an accepted first draft, token 1 is independent of token 0 and follows p1.
      both = num_acc[:, r] >= 1
      obs, exp = [], []
      for a in np.unique(tokens[both, r, 0]):
        sel = both & (tokens[:, r, 0] == a)
        if sel.sum() >= 100:
          counts = np.bincount(tokens[sel, r, 1], minlength=p.shape[-1])
          e = sel.sum() * p[r, 1]
          assert counts[e == 0].sum() == 0
          obs += list(counts[e > 0])
          exp += list(e[e > 0])
      if len(obs) > 1:
        obs, exp = np.array(obs, float), np.array(exp)
        big = exp >= 5
        stat = np.sum((obs[big] - exp[big]) ** 2 / exp[big])
        dist.append(float(stats.chi2.sf(stat, max(1, big.sum() - 1))))
    for i in range(1, k1):
      prob = float(np.prod(accept_probs[r, :i]))
      m = (num_acc[:, r] >= i).sum()
      if 0 < prob < 1:
        z = (m - n * prob) / np.sqrt(n * prob * (1 - prob))
        accept.append(float(2 * stats.norm.sf(abs(z))))
      else:
        accept.append(1.0 if m == n * prob else 0.0)
  return np.array(dist), np.array(accept)


def beta(p, q):
  """Per-position acceptance probability sum_x min(p, q) [B, k]."""
  return np.minimum(p[:, :q.shape[1]], np.asarray(q, np.float64)).sum(-1)


def variant_verify(target_logits, drafts, draft_probs, key, params, *, accept_with_p=False, correction_from_p=False):
  """A small independent verifier for sampling rows, with switchable mistakes. Both switches off: correct."""
  b, k1, v = target_logits.shape
  k = k1 - 1
  p = sampling.warped_probs(target_logits, params)
  q = draft_probs if draft_probs is not None else jax.nn.one_hot(drafts, v)
  k_acc, k_last = jax.random.split(key)
  p_x = jnp.take_along_axis(p[:, :k], drafts[..., None], -1)[..., 0]
  q_x = jnp.take_along_axis(q, drafts[..., None], -1)[..., 0]
  prob = p_x if accept_with_p else jnp.minimum(1.0, p_x / q_x)
  accept = jax.random.uniform(k_acc, (b, k)) < prob
  n = jnp.sum(jnp.cumprod(accept, axis=1), axis=1)
  rows = jnp.arange(b)
  p_n = p[rows, n]
  q_n = jnp.where((n < k)[:, None], q[rows, jnp.minimum(n, k - 1)], 0.0)
  resid = jnp.maximum(p_n - q_n, 0.0)
  resid = jnp.where(resid.sum(-1, keepdims=True) > 0, resid, p_n)
  dist = p_n if correction_from_p else resid
  last = jax.random.categorical(k_last, jnp.log(dist), axis=-1)
  pos = jnp.arange(k1)[None]
  d_ext = jnp.concatenate([drafts, jnp.zeros((b, 1), drafts.dtype)], 1)
  tokens = jnp.where(pos < n[:, None], d_ext, jnp.where(pos == n[:, None], last[:, None], 0))
  return tokens.astype(jnp.int32), n.astype(jnp.int32)


SAMPLING_ROWS = ROWS[:4]


@functools.lru_cache(maxsize=None)
def sampled_drafts_case():
  logits, q, p = make_problem(seed=10, rows=SAMPLING_ROWS)
  return logits, q, p, SamplingParams.stack(SAMPLING_ROWS)


# ---------------------------------------------------------------------------------------------------------------
# Exact sampling
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("candidates", [256, 1])  # 1: the warp takes its bisection fallback
def test_exact_with_sampled_drafts_mixed_batch(candidates):
  """Drafts sampled from q, draft_probs = q, sampling rows of every warp kind and a greedy row in one batch."""
  logits, q, p = make_problem(seed=11)
  verify = functools.partial(verify_chain, candidates=candidates)
  tokens, num_acc = run_many(verify, logits, q, SamplingParams.stack(ROWS))
  assert tokens.dtype == np.int32 and num_acc.dtype == np.int32
  assert num_acc.min() >= 0 and num_acc.max() <= K
  # PAD after the committed tokens.
  pos = np.arange(K + 1)
  assert np.all(tokens[pos[None, None] > num_acc[..., None]] == PAD)
  dist, accept = exactness_pvalues(tokens, num_acc, p, beta(p, q))
  assert len(dist) >= 4 * (K + 2)
  assert dist.min() > P_MIN, dist
  assert accept.min() > P_MIN, accept


def test_exact_with_deterministic_drafts():
  """draft_probs=None: a draft is accepted with probability p(x), the correction comes from p without x."""
  logits, _, p = make_problem(seed=12)
  order = np.argsort(-p, axis=-1, kind="stable")  # [B, k+1, V]
  top1, top2, worst = order[..., 0], order[..., 1], order[..., -1]
  drafts = np.array([
      [top1[0, 0], top2[0, 1], -1],  # nothing after a missing draft
      [worst[1, 0], top1[1, 1], top1[1, 2]],  # outside the top-k support: never accepted
      [top2[2, 0], top1[2, 1], top1[2, 2]],
      [top1[3, 0], -1, top1[3, 2]],
      [top1[4, 0], top2[4, 1], top1[4, 2]],  # greedy
  ], np.int32)
  tokens, num_acc = run_many(verify_chain, logits, None, SamplingParams.stack(ROWS), drafts=jnp.asarray(drafts))
  assert p[1, 0, drafts[1, 0]] == 0 and np.all(num_acc[:, 1] == 0)
  assert num_acc[:, 0].max() <= 2 and num_acc[:, 3].max() <= 1 and np.all(num_acc[:, 4] == 1)
  accept_probs = np.where(drafts >= 0, np.take_along_axis(p[:, :K], np.maximum(drafts, 0)[..., None], -1)[..., 0], 0)
  dist, accept = exactness_pvalues(tokens, num_acc, p, accept_probs)
  assert dist.min() > P_MIN, dist
  assert accept.min() > P_MIN, accept


@pytest.mark.parametrize("with_probs", [True, False])
def test_exact_k0(with_probs):
  logits, q, p = make_problem(seed=13, k=0)
  params = SamplingParams.stack(ROWS)
  if with_probs:  # sampled "drafts" of length 0 with q of shape [B, 0, V]
    tokens, num_acc = run_many(verify_chain, logits, q, params, n=20000)
  else:
    tokens, num_acc = run_many(verify_chain, logits, None, params, drafts=jnp.zeros((len(ROWS), 0), jnp.int32),
                               n=20000)
  assert tokens.shape == (20000, len(ROWS), 1) and np.all(num_acc == 0)
  dist, _ = exactness_pvalues(tokens, num_acc, p, np.zeros((len(ROWS), 0)))
  assert dist.min() > P_MIN, dist


def test_missing_draft_with_probs_samples_from_p():
  """A -1 draft (clamped to token 0 internally) must not use q[0] for a residual: the token comes from p."""
  logits, q, p = make_problem(seed=14, rows=SAMPLING_ROWS)
  q = q.at[:, :, 0].set(5.0)
  q = q / q.sum(-1, keepdims=True)
  drafts = jnp.asarray(np.tile([[-1, 1, 2]], (len(SAMPLING_ROWS), 1)), jnp.int32)
  params = SamplingParams.stack(SAMPLING_ROWS)
  n = 20000
  tile = lambda a: jnp.tile(a, (n,) + (1,) * (a.ndim - 1))
  tokens, num_acc = jax.jit(verify_chain)(tile(logits), tile(drafts), tile(q), jax.random.key(2),
                                          jax.tree.map(tile, params))
  assert np.all(np.asarray(num_acc) == 0)
  tokens = np.asarray(tokens).reshape(n, len(SAMPLING_ROWS), K + 1)
  for r in range(len(SAMPLING_ROWS)):
    assert chi2_pvalue(tokens[:, r, 0], p[r, 0]) > P_MIN


# ---------------------------------------------------------------------------------------------------------------
# The same check rejects wrong verifiers (and accepts a correct independent one)
# ---------------------------------------------------------------------------------------------------------------


def test_check_accepts_independent_correct_verifier():
  logits, q, p, params = sampled_drafts_case()
  tokens, num_acc = run_many(variant_verify, logits, q, params)
  dist, accept = exactness_pvalues(tokens, num_acc, p, beta(p, q))
  assert dist.min() > P_MIN and accept.min() > P_MIN


@pytest.mark.parametrize("mistake", ["accept_with_p", "correction_from_p"])
def test_check_rejects_wrong_verifier_sampled_drafts(mistake):
  logits, q, p, params = sampled_drafts_case()
  tokens, num_acc = run_many(functools.partial(variant_verify, **{mistake: True}), logits, q, params)
  dist, _ = exactness_pvalues(tokens, num_acc, p, beta(p, q))
  assert dist.min() < P_MIN  # the distribution check alone catches it
  assert np.sum(dist < P_MIN) >= 2


def test_check_rejects_wrong_verifier_deterministic_drafts():
  logits, _, p, params = sampled_drafts_case()
  top1 = np.argmax(p, -1).astype(np.int32)
  drafts = jnp.asarray(top1[:, :K])
  wrong = functools.partial(variant_verify, correction_from_p=True)
  tokens, num_acc = run_many(wrong, logits, None, params, drafts=drafts)
  dist, _ = exactness_pvalues(tokens, num_acc, p, np.zeros((len(SAMPLING_ROWS), K)))
  assert dist.min() < P_MIN  # (verify_chain passes this check in test_exact_with_deterministic_drafts)


# ---------------------------------------------------------------------------------------------------------------
# Greedy and edge cases
# ---------------------------------------------------------------------------------------------------------------

VERIFY = jax.jit(verify_chain)


def greedy_case(k=4, v=20, b=6, seed=20):
  rng = np.random.default_rng(seed)
  logits = rng.normal(size=(b, k + 1, v)).astype(np.float32)
  target = logits.argmax(-1)
  drafts = target[:, :k].copy()
  for r in range(min(b, k)):
    drafts[r, r] = (target[r, r] + 1) % v  # row r matches exactly r drafts; rows >= k match all
  return logits, target, drafts.astype(np.int32)


def check_greedy_rows(tokens, num_acc, target, expected_n, rows):
  for r in rows:
    n = expected_n[r]
    assert num_acc[r] == n
    np.testing.assert_array_equal(tokens[r, :n + 1], target[r, :n + 1])
    assert np.all(tokens[r, n + 1:] == PAD)


@pytest.mark.parametrize("with_probs", [False, True])
def test_greedy_accepts_longest_argmax_prefix(with_probs):
  logits, target, drafts = greedy_case()
  b, k = drafts.shape
  q = jax.nn.softmax(jnp.asarray(np.random.default_rng(0).normal(size=(b, k, 20)), jnp.float32)) if with_probs else None
  tokens, num_acc = VERIFY(jnp.asarray(logits), jnp.asarray(drafts), q, jax.random.key(0), SamplingParams.make(b))
  check_greedy_rows(np.asarray(tokens), np.asarray(num_acc), target, [0, 1, 2, 3, 4, 4], range(b))


def test_greedy_rows_in_mixed_batch():
  logits, target, drafts = greedy_case()
  b = drafts.shape[0]
  params = SamplingParams.stack([(0.0, 0, 1.0), (1.0, 0, 1.0), (0.0, 0, 1.0), (0.8, 5, 0.9), (0.0, 0, 1.0),
                                 (1.0, 1, 1.0)])
  tokens, num_acc = VERIFY(jnp.asarray(logits), jnp.asarray(drafts), None, jax.random.key(1), params)
  tokens, num_acc = np.asarray(tokens), np.asarray(num_acc)
  check_greedy_rows(tokens, num_acc, target, [0, 1, 2, 3, 4, 4], [0, 2, 4])
  # top_k = 1 makes a sampling row deterministic: the same as greedy.
  check_greedy_rows(tokens, num_acc, target, [0, 1, 2, 3, 4, 4], [5])
  for r in (1, 3):
    n = num_acc[r]
    np.testing.assert_array_equal(tokens[r, :n], drafts[r, :n])
    assert np.all(tokens[r, n + 1:] == PAD)


@pytest.mark.parametrize("temperature,top_k", [(0.0, 0), (1.0, 1)])  # the greedy branch and the sampling branch
def test_missing_draft_never_accepted(temperature, top_k):
  v, k = 12, 3
  logits = np.random.default_rng(3).normal(size=(3, k + 1, v)).astype(np.float32)
  logits[:, 1, :] = 0.0
  logits[0, 1, 0] = 50.0  # argmax 0: a clamped -1 would match it
  logits[1, 1, v - 1] = 50.0  # argmax V-1: a wrapped-around -1 would match it
  logits[2, 1, 5] = 50.0
  target = logits.argmax(-1)
  drafts = np.stack([target[:, 0], np.full(3, -1), target[:, 2]], 1).astype(np.int32)
  params = SamplingParams.make(3, temperature, top_k)
  tokens, num_acc = VERIFY(jnp.asarray(logits), jnp.asarray(drafts), None, jax.random.key(2), params)
  check_greedy_rows(np.asarray(tokens), np.asarray(num_acc), target, [1, 1, 1], range(3))
  # All drafts missing.
  tokens, num_acc = VERIFY(jnp.asarray(logits), jnp.full((3, k), -1, jnp.int32), None, jax.random.key(2), params)
  check_greedy_rows(np.asarray(tokens), np.asarray(num_acc), target, [0, 0, 0], range(3))


def test_greedy_k0():
  logits = np.random.default_rng(4).normal(size=(3, 1, 15)).astype(np.float32)
  tokens, num_acc = VERIFY(jnp.asarray(logits), jnp.zeros((3, 0), jnp.int32), None, jax.random.key(0),
                           SamplingParams.make(3))
  np.testing.assert_array_equal(tokens, logits.argmax(-1))
  np.testing.assert_array_equal(num_acc, 0)


def test_shape_errors():
  logits = jnp.zeros((2, 3, 5))
  with pytest.raises(ValueError):
    verify_chain(logits, jnp.zeros((2, 3), jnp.int32), None, jax.random.key(0), SamplingParams.make(2))
  with pytest.raises(ValueError):
    verify_chain(logits, jnp.zeros((2, 2), jnp.int32), jnp.zeros((2, 2, 4)), jax.random.key(0), SamplingParams.make(2))
