"""spec_jax.sampling: warping (temperature -> top-k -> top-p), greedy and sampling, against a numpy reference."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from spec_jax import sampling
from spec_jax.config import SamplingParams

P_MIN = 1e-4  # chi-square p-value threshold

# Jitted once per shape: eager lax.cond is slow.
WARP = jax.jit(sampling.warp_logits, static_argnames="candidates")
PROBS = jax.jit(sampling.warped_probs, static_argnames="candidates")
SAMPLE = jax.jit(sampling.sample, static_argnames="candidates")


def ref_keep(x, temperature, top_k, top_p):
  """Numpy reference of the kept set for one row (float64, stable sort), plus the top-p margin: the distance
  of the cumulative mass at the boundary from top_p (a tiny margin is ambiguous in float32)."""
  x = np.asarray(x, np.float64)
  v = x.shape[-1]
  keep = np.zeros(v, bool)
  if temperature <= 0:
    keep[np.argmax(x)] = True
    return keep, np.inf
  s = x / temperature
  order = np.argsort(-s, kind="stable")
  kk = top_k if 0 < top_k < v else v
  n, margin = kk, np.inf
  if top_p < 1:
    z = s[order[:kk]]
    pr = np.exp(z - z.max())
    pr /= pr.sum()
    cum = np.cumsum(pr)
    n = min(kk, 1 + int(np.sum(cum < top_p)))
    margin = np.min(np.abs(cum[max(0, n - 2):n] - top_p))
  keep[order[:n]] = True
  return keep, margin


def ref_probs(x, temperature, top_k, top_p):
  keep, margin = ref_keep(x, temperature, top_k, top_p)
  if temperature <= 0:
    return keep.astype(np.float64), margin
  s = np.where(keep, np.asarray(x, np.float64) / temperature, -np.inf)
  e = np.exp(s - s.max())
  return e / e.sum(), margin


def chi2_pvalue(samples, probs, min_expected=5.0):
  """Goodness of fit of integer samples to probs; tokens with probability 0 must never appear."""
  probs = np.asarray(probs, np.float64)
  counts = np.bincount(np.asarray(samples).ravel(), minlength=probs.size).astype(np.float64)
  assert counts[probs == 0].sum() == 0, f"sampled outside the support: {np.nonzero((probs == 0) & (counts > 0))}"
  n = counts.sum()
  expected = n * probs
  big = expected >= min_expected
  obs, exp = list(counts[big]), list(expected[big])
  if (~big & (probs > 0)).any():
    obs.append(counts[~big].sum())
    exp.append(expected[~big].sum())
  obs, exp = np.array(obs), np.array(exp)
  if len(obs) < 2:
    return 1.0
  stat = np.sum((obs - exp) ** 2 / exp)
  return float(stats.chi2.sf(stat, len(obs) - 1))


def random_rows(rng, n):
  return [(float(rng.choice([0.0, 0.5, 1.0, 1.7])), int(rng.choice([0, 1, 3, 10, 50, 400])),
           float(rng.choice([1.0, 0.3, 0.8, 0.95, 0.999]))) for _ in range(n)]


# ---------------------------------------------------------------------------------------------------------------


def test_argmax_matches_jnp_with_ties():
  rng = np.random.default_rng(0)
  x = (np.round(rng.normal(size=(6, 3, 50))) + 0.0).astype(np.float32)  # + 0.0: no -0.0 (see test_signed_zero)
  x[0, 0] = -np.inf
  x[1, 1, :] = 2.0
  np.testing.assert_array_equal(sampling.argmax(jnp.asarray(x)), jnp.argmax(jnp.asarray(x), -1))


@pytest.mark.parametrize("shape", [(5, 37), (3, 4, 37)])
def test_greedy_is_argmax(shape):
  rng = np.random.default_rng(1)
  x = jnp.asarray((np.round(rng.normal(size=shape) * 2) + 0.0).astype(np.float32))  # many ties
  params = SamplingParams.make(shape[0])
  expected = np.asarray(jnp.argmax(x, -1))
  np.testing.assert_array_equal(SAMPLE(jax.random.key(0), x, params), expected)
  probs = np.asarray(PROBS(x, params))
  np.testing.assert_array_equal(probs, np.eye(shape[-1], dtype=np.float32)[expected])
  # A greedy row inside a sampling batch is still its argmax.
  mixed = SamplingParams.stack([(0.0, 0, 1.0)] + [(1.0, 5, 0.9)] * (shape[0] - 1))
  out = np.asarray(SAMPLE(jax.random.key(1), x, mixed))
  np.testing.assert_array_equal(out[0], expected[0])


@pytest.mark.parametrize("candidates", [256, 2])  # 2: top_k > candidates takes the bisection fallback
def test_top_k_keeps_exactly_k_with_ties(candidates):
  rng = np.random.default_rng(2)
  v = 64
  x = (np.round(rng.normal(size=(4, v))) + 0.0).astype(np.float32)  # heavy ties
  for k in (1, 3, 7, 20, 63):
    params = SamplingParams.make(4, 1.0, k)
    w = np.asarray(WARP(jnp.asarray(x), params, candidates=candidates))
    for b in range(4):
      kept = np.isfinite(w[b])
      assert kept.sum() == k
      # Exactly the first k of the order (logit descending, index ascending).
      np.testing.assert_array_equal(np.nonzero(kept)[0], np.sort(np.argsort(-x[b], kind="stable")[:k]))
      np.testing.assert_array_equal(w[b][kept], x[b][kept])


@pytest.mark.parametrize("candidates", [1, 8, 4096])  # 1 and 8: mostly the fallback; 4096: always top_k
def test_matches_numpy_reference(candidates):
  rng = np.random.default_rng(3)
  n, v = 48, 300
  rows = random_rows(rng, n)
  x = (rng.normal(size=(n, v)) * rng.uniform(0.5, 4, size=(n, 1))).astype(np.float32)
  x[::2] = np.round(x[::2]) + 0.0  # ties
  params = SamplingParams.stack(rows)
  w = np.asarray(WARP(jnp.asarray(x), params, candidates=candidates))
  probs = np.asarray(PROBS(jnp.asarray(x), params, candidates=candidates))
  checked = 0
  for b, row in enumerate(rows):
    ref, margin = ref_probs(x[b], *row)
    if margin < 1e-5:
      continue  # float32 cannot decide this boundary
    np.testing.assert_array_equal(np.isfinite(w[b]), ref > 0, err_msg=f"row {row}")
    np.testing.assert_allclose(probs[b], ref, atol=2e-6, err_msg=f"row {row}")
    checked += 1
  assert checked >= 40


def test_fast_path_and_fallback_agree_large_vocab():
  rng = np.random.default_rng(4)
  v = 20000
  x = (rng.normal(size=(4, v)) * 1.5).astype(np.float32)
  x[:, :30] += 8.0  # a peaked head, so a top-p nucleus can fit in the candidates
  # Every row fits in the 256 candidates: the default takes the fast path, candidates=1 the bisection.
  rows = [(0.7, 40, 0.95), (1.3, 0, 0.5), (0.8, 100, 1.0), (0.0, 0, 1.0)]
  params = SamplingParams.stack(rows)
  fast = np.isfinite(np.asarray(WARP(jnp.asarray(x), params)))
  slow = np.isfinite(np.asarray(WARP(jnp.asarray(x), params, candidates=1)))
  np.testing.assert_array_equal(fast, slow)
  for b, row in enumerate(rows):
    ref, margin = ref_keep(x[b], *row)
    assert margin > 1e-5
    np.testing.assert_array_equal(fast[b], ref, err_msg=f"row {row}")
  # Rows that do not fit (a nucleus of ~1200 tokens, top_k > 256) take the fallback in one batch with the others.
  rows = [(1.0, 0, 0.9), (1.0, 3000, 1.0), (1.3, 0, 0.5), (1.0, 500, 0.95)]
  kept = np.isfinite(np.asarray(WARP(jnp.asarray(x), SamplingParams.stack(rows))))
  for b, row in enumerate(rows):
    ref, margin = ref_keep(x[b], *row)
    order = np.argsort(-x[b], kind="stable")
    n = int(kept[b].sum())
    np.testing.assert_array_equal(np.nonzero(kept[b])[0], np.sort(order[:n]))  # a prefix of the order
    # Where float32 mass cannot decide the boundary (margin ~1e-6 with ~1e-5 per token), allow one token.
    assert abs(n - ref.sum()) <= (0 if margin > 1e-5 else 1), (row, n, ref.sum(), margin)


def test_signed_zero_ties_by_index():
  """-0.0 == +0.0 like any tie (lax.top_k ranks +0.0 first; a boundary at 0 takes the exact fallback)."""
  x = jnp.asarray([[-0.0, 0.0, -0.0, 0.0, -1.0]] * 2, jnp.float32)
  np.testing.assert_array_equal(sampling.argmax(x), [0, 0])
  for candidates in (256, 1):
    w = np.asarray(WARP(x, SamplingParams.stack([(1.0, 2, 1.0), (1.0, 3, 1.0)]), candidates=candidates))
    np.testing.assert_array_equal(np.isfinite(w), [[True, True, False, False, False], [True, True, True, False, False]])
  for temperature in (0.0, 1.0):  # the all-greedy path, and a greedy row next to a sampling row
    for top_k in (0, 2):  # no filter, and the top_k path
      params = SamplingParams.stack([(0.0, 0, 1.0), (temperature, top_k, 1.0)])
      np.testing.assert_array_equal(np.asarray(PROBS(x, params))[0], [1, 0, 0, 0, 0])


def test_sample_with_probs():
  rng = np.random.default_rng(9)
  x = jnp.asarray(rng.normal(size=(3, 4, 37)).astype(np.float32))  # the shapes of test_greedy_is_argmax: no compile
  params = SamplingParams.stack([(0.0, 0, 1.0), (1.0, 5, 1.0), (0.8, 0, 0.7)])
  tokens, probs = jax.jit(sampling.sample_with_probs)(jax.random.key(3), x, params)
  np.testing.assert_allclose(probs, PROBS(x, params), atol=1e-7)
  np.testing.assert_array_equal(tokens, SAMPLE(jax.random.key(3), x, params))


def test_filters_off():
  rng = np.random.default_rng(5)
  x = jnp.asarray(rng.normal(size=(3, 2, 40)).astype(np.float32))
  for top_k in (0, 40, 1000):
    w = WARP(x, SamplingParams.make(3, 0.7, top_k, 1.0))
    np.testing.assert_array_equal(w, x / jnp.float32(0.7))


def test_order_temperature_then_top_p():
  x = jnp.asarray([[2.0, 1.0, 0.0]])
  # T=1: probs (.665, .245, .090), top_p=0.7 keeps 2. T=0.5: (.867, .117, .016), keeps 1.
  assert np.isfinite(WARP(x, SamplingParams.make(1, 1.0, 0, 0.7))).sum() == 2
  assert np.isfinite(WARP(x, SamplingParams.make(1, 0.5, 0, 0.7))).sum() == 1


def test_order_top_k_then_top_p():
  x = jnp.log(jnp.asarray([[0.3, 0.3, 0.2, 0.2]]))
  # top_k=2 renormalizes to (.5, .5); top_p=0.45 then keeps 1. (top-p first would keep 2, then top-k keeps 2.)
  w = np.asarray(WARP(x, SamplingParams.make(1, 1.0, 2, 0.45)))
  np.testing.assert_array_equal(np.isfinite(w), [[True, False, False, False]])
  # The crossing token is kept: mass 0.3 < 0.31, so two tokens.
  w = np.asarray(WARP(x, SamplingParams.make(1, 1.0, 0, 0.31)))
  np.testing.assert_array_equal(np.isfinite(w), [[True, True, False, False]])


def test_per_row_params_in_one_batch():
  rng = np.random.default_rng(6)
  x = jnp.asarray(rng.normal(size=(5, 3, 30)).astype(np.float32) * 2)
  rows = [(0.0, 0, 1.0), (1.0, 0, 1.0), (0.8, 5, 1.0), (1.2, 0, 0.7), (0.6, 8, 0.8)]
  batch = np.asarray(PROBS(x, SamplingParams.stack(rows)))
  for b, row in enumerate(rows):
    alone = np.asarray(PROBS(x[b:b + 1], SamplingParams.stack([row])))
    np.testing.assert_array_equal(batch[b] > 0, alone[0] > 0)
    np.testing.assert_allclose(batch[b], alone[0], rtol=1e-5, atol=1e-7)  # the log-normalizer may take another path
    for t in range(3):
      np.testing.assert_allclose(batch[b, t], ref_probs(np.asarray(x[b, t]), *row)[0], atol=2e-6)


@pytest.mark.parametrize("v", [12, 67])  # 67: no divisor near sqrt(V), the block sampler pads the vocabulary
def test_sample_matches_warped_distribution(v):
  rng = np.random.default_rng(7)
  rows = [(1.0, 0, 1.0), (0.7, 4, 1.0), (1.5, 0, 0.8), (0.9, 6, 0.9)]
  x = (rng.normal(size=(4, 2, v)) * 1.5).astype(np.float32)
  params = SamplingParams.stack(rows)
  n = 20000
  keys = jax.random.split(jax.random.key(v), n)
  draws = np.asarray(jax.jit(jax.vmap(lambda k: sampling.sample(k, jnp.asarray(x), params)))(keys))  # [n, 4, 2]
  assert draws.dtype == np.int32
  for b, row in enumerate(rows):
    for t in range(2):
      probs, margin = ref_probs(x[b, t], *row)
      assert margin > 1e-4
      assert chi2_pvalue(draws[:, b, t], probs) > P_MIN, (row, t)
      # And a total-variation bound on the empirical distribution.
      emp = np.bincount(draws[:, b, t], minlength=v) / n
      assert 0.5 * np.abs(emp - probs).sum() < 0.03


def test_sample_large_vocab_smoke():
  rng = np.random.default_rng(8)
  v = 262144
  x = rng.normal(size=(2, v)).astype(np.float32)
  x[0, 123] = 30.0
  x[1, 200000] = 30.0
  params = SamplingParams.stack([(1.0, 0, 1.0), (0.8, 50, 0.9)])
  out = np.asarray(SAMPLE(jax.random.key(0), jnp.asarray(x), params))
  np.testing.assert_array_equal(out, [123, 200000])
