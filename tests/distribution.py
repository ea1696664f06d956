"""The end-to-end checks that speculative sampling keeps the target's distribution: the first 3 sampled tokens of
plain and speculative runs on one prompt, compared position by position (and in adjacent pairs) with a chi-square
test (shared by the one-device, quantized-draft and mesh tests); and each row's tokens over several verify steps
against the target's exact conditional distributions (assert_conditional_law, tests/test_sampled_law.py)."""

from __future__ import annotations

import numpy as np

from spec_jax.config import SamplingParams
from spec_jax.batch import generate
PROMPT = [2, 5, 6, 7]


def sample_plain_and_speculative(params, config, proposer, proposer_params, *, n: int, calls: int, sampling=None,
                                 **kw):
  """`calls` batches of n rows each way (one compiled shape reused; a 3000-row batch once crashed XLA's
  compiler). -> (plain tokens [n * calls, 3], speculative tokens, acceptance rate per call). `sampling`: the
  SamplingParams of n rows (default T 1, top-k 6, top-p 0.95); other keywords go to the speculative run, and
  controls= and kv_cache_dtype= to both (the same target both ways)."""
  samp = sampling if sampling is not None else SamplingParams.make(n, temperature=1.0, top_k=6, top_p=0.95)
  both = {k: v for k, v in kw.items() if k in ("controls", "kv_cache_dtype")}
  plain, specd, rates = [], [], []
  for c in range(calls):
    plain += generate(params, config, [PROMPT] * n, max_new_tokens=3, sampling=samp, seed=100 + c,
                      **both).token_ids
    out = generate(params, config, [PROMPT] * n, max_new_tokens=3, sampling=samp, seed=200 + c, proposer=proposer,
                   proposer_params=proposer_params, adaptive_k=False, **kw)
    specd += out.token_ids
    rates.append(out.stats["acceptance_rate"])
  return np.array(plain), np.array(specd), rates


def assert_commits_plain_tokens(params, config, proposer, proposer_params, *, n: int, sampling=None, **kw):
  """Deterministic drafts (n-gram, suffix): the verifier commits the target's own draw at every position, and each
  draw is keyed by the seed, the row and the position (spec_jax/streams.py), so a speculative run must commit the
  very tokens plain sampling draws with the same seed, row for row. Stronger than a chi-square between the two
  (a distribution can match while tokens do not, never the reverse) and at one run each way, not six.
  -> (acceptance rate, plain tokens [n, 3]). Keywords as sample_plain_and_speculative."""
  samp = sampling if sampling is not None else SamplingParams.make(n, temperature=1.0, top_k=6, top_p=0.95)
  both = {k: v for k, v in kw.items() if k in ("controls", "kv_cache_dtype")}
  plain = np.array(generate(params, config, [PROMPT] * n, max_new_tokens=3, sampling=samp, seed=100,
                            **both).token_ids)
  out = generate(params, config, [PROMPT] * n, max_new_tokens=3, sampling=samp, seed=100, proposer=proposer,
                 proposer_params=proposer_params, adaptive_k=False, **kw)
  specd = np.array(out.token_ids)
  assert len({tuple(r) for r in plain}) > 10, "the rows barely vary: the comparison would say little"
  same = (specd == plain).all(axis=1)
  assert same.all(), f"{int((~same).sum())} of {n} rows differ from plain sampling's with the same seed"
  return out.stats["acceptance_rate"], plain


def assert_same_distribution(plain, specd):
  """Two-sample chi-square on 5 comparisons (3 positions, 2 adjacent pairs), each at 1e-4: a family-wise level of
  5e-4 per call (Bonferroni). Only the first 3 tokens: assert_conditional_law below checks more positions."""
  from scipy.stats import chi2_contingency
  for cols in ([0], [1], [2], [0, 1], [1, 2]):
    a = [tuple(r) for r in plain[:, cols]]
    b = [tuple(r) for r in specd[:, cols]]
    cats = sorted(set(a) | set(b))
    table = np.array([[a.count(c) for c in cats], [b.count(c) for c in cats]])
    table = table[:, table.sum(0) > 0]
    p = chi2_contingency(table)[1]
    assert p > 1e-4, f"token positions {cols}: p = {p}"


# ------------------------------------------------------------------------------------------------------------------
# The loop's law over several verify steps, against the target's exact per-step probabilities
# ------------------------------------------------------------------------------------------------------------------
#
# Each sampled row is checked against the target itself, not against another sampler: a cache-free forward of the
# committed sequence gives, at every generated position, the exact warped (temperature, top-k, top-p; grammar-
# masked) distribution p_s,t that the token there must have been drawn from given its prefix. Per position t the
# observed token counts O_t[v] and their conditional expectations E_t[v] = sum_s p_s,t[v] differ by a sum of
# martingale differences with covariance C_t = sum_s diag(p_s,t) - p_s,t p_s,t^T, so
#   X_t = (O_t - E_t)^T C_t^+ (O_t - E_t)  ~  chi-square(rank C_t)  (asymptotically: the martingale CLT)
# for a correct loop (whatever the prefixes were; the positions' differences are uncorrelated, so pooling them is
# valid too). Pooled over the positions after the first, with the token's id or its rank under p_s,t as the
# category, the statistics have many more draws (power against a bias common to the positions); the rank
# catches a bias toward the target's likely or unlikely tokens that moves between ids with the prefix. Tokens
# outside the support of p fail at once.


def sample_rows(params, config, proposer, proposer_params, *, n: int, calls: int, new: int, prompt, sampling,
                seed: int = 0, controls=None):
  """`calls` runs of n rows of one prompt through the loop (one compiled shape reused) -> int [n * calls, new]
  tokens and the runs' (drafted, accepted) totals."""
  out, drafted, accepted = [], 0, 0
  for c in range(calls):
    res = generate(params, config, [list(prompt)] * n, max_new_tokens=new, sampling=sampling, seed=seed + c,
                   proposer=proposer, proposer_params=proposer_params, adaptive_k=False, controls=controls)
    assert all(len(t) == new for t in res.token_ids), "a row stopped early: the test needs full rows"
    out += res.token_ids
    drafted += res.stats["drafted_tokens"]
    accepted += res.stats["accepted_tokens"]
  return np.array(out), drafted, accepted


def exact_conditionals(params, config, prompt, tokens, sampling_rows, grammar=None, chunk: int = 512):
  """float64 [N, new, V]: p_s,t, the warped target distribution of token t of row s given the prompt and the
  row's tokens before it, from a cache-free float32 forward and tests/test_sampling.ref_probs (numpy float64).
  `sampling_rows`: (temperature, top_k, top_p) per row; `grammar`: a TokenAutomaton masking every position
  (tokens it does not allow get -inf before warping, as the loop's mask). -> (probs, ambiguous [N, new]: the
  top-p boundary within 1e-5 of the threshold, where float32 and float64 may keep different sets)."""
  import jax
  import jax.numpy as jnp
  from spec_jax.models.transformer import forward
  from tests.test_sampling import ref_probs
  n, new = tokens.shape
  P = len(prompt)
  seqs = np.concatenate([np.tile(np.asarray(prompt, np.int32), (n, 1)), tokens.astype(np.int32)], axis=1)
  fwd = jax.jit(lambda p, t: forward(p, t, None, None, config=config)[0])
  logits = np.concatenate([np.asarray(fwd(params, jnp.asarray(seqs[i:i + chunk])))
                           for i in range(0, n, chunk)])[:, P - 1:P - 1 + new].astype(np.float64)
  V = logits.shape[-1]
  probs = np.zeros((n, new, V))
  ambiguous = np.zeros((n, new), bool)
  for s in range(n):
    state = grammar.initial if grammar is not None else None
    t_, k_, p_ = sampling_rows[s]
    for t in range(new):
      x = logits[s, t]
      if grammar is not None:
        allowed = np.zeros(V, bool)
        allowed[grammar.allowed(state)] = True
        x = np.where(allowed, x, -np.inf)
        state = grammar.next_state(state, int(tokens[s, t]))
      probs[s, t], margin = ref_probs(x, t_, k_, p_)
      ambiguous[s, t] = margin < 1e-5
  return probs, ambiguous


def _martingale_chi2(onehot, probs):
  """onehot, probs [M, C] -> (statistic, degrees of freedom, p-value) of the observed categories against their
  per-row conditional probabilities (see above)."""
  from scipy.stats import chi2
  d = onehot.sum(0) - probs.sum(0)
  cov = np.diag(probs.sum(0)) - probs.T @ probs
  df = np.linalg.matrix_rank(cov, tol=1e-9 * max(1.0, np.abs(cov).max()))
  stat = float(d @ np.linalg.pinv(cov, rcond=1e-9, hermitian=True) @ d)
  return stat, int(df), float(chi2.sf(stat, df)) if df > 0 else 1.0


def conditional_law_pvalues(tokens, probs, ambiguous=None):
  """tokens int [N, T], probs [N, T, V] (exact_conditionals) -> {comparison name: p-value}: one per position
  ("t0" .. ), and over positions 1 .. T-1 pooled: "ids" (the token's id) and "rank" (its rank under p).
  AssertionError at once on a token p gives no mass."""
  n, T, V = probs.shape
  picked = np.take_along_axis(probs, tokens[..., None], axis=-1)[..., 0]
  bad = (picked <= 0) & ~(ambiguous if ambiguous is not None else np.zeros_like(picked, bool))
  assert not bad.any(), f"{int(bad.sum())} tokens outside the target's support, first at (row, pos) " \
                        f"{tuple(np.argwhere(bad)[0])}"
  onehot = np.eye(V)[tokens]
  out = {f"t{t}": _martingale_chi2(onehot[:, t], probs[:, t])[2] for t in range(T)}
  out["ids"] = _martingale_chi2(onehot[:, 1:].reshape(-1, V), probs[:, 1:].reshape(-1, V))[2]
  order = np.argsort(-probs, axis=-1, kind="stable")  # the category: the token's rank under p
  rank_p = np.take_along_axis(probs, order, axis=-1)[:, 1:].reshape(-1, V)
  rank_of = np.argmax(order == tokens[..., None], axis=-1)[:, 1:].reshape(-1)
  out["rank"] = _martingale_chi2(np.eye(V)[rank_of], rank_p)[2]
  return out


def assert_conditional_law(tokens, probs, ambiguous=None, family_alpha: float = 1e-3):
  """Bonferroni over conditional_law_pvalues' comparisons: a correct loop fails with probability <= family_alpha
  (asymptotically). -> the p-values."""
  pv = conditional_law_pvalues(tokens, probs, ambiguous)
  level = family_alpha / len(pv)
  bad = {k: v for k, v in pv.items() if v < level}
  assert not bad, f"the loop's tokens are not the target's law (per-comparison level {level:.2g}): {bad}"
  return pv
