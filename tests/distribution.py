"""The end-to-end check that speculative sampling keeps the target's distribution, shared by the one-device,
quantized-draft and mesh tests: the first 3 sampled tokens of plain and speculative runs on one prompt,
compared position by position (and in adjacent pairs) with a chi-square test."""

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


def assert_same_distribution(plain, specd):
  from scipy.stats import chi2_contingency
  for cols in ([0], [1], [2], [0, 1], [1, 2]):
    a = [tuple(r) for r in plain[:, cols]]
    b = [tuple(r) for r in specd[:, cols]]
    cats = sorted(set(a) | set(b))
    table = np.array([[a.count(c) for c in cats], [b.count(c) for c in cats]])
    table = table[:, table.sum(0) > 0]
    p = chi2_contingency(table)[1]
    assert p > 1e-4, f"token positions {cols}: p = {p}"
