"""Sampled speculation keeps the target's law over several verify steps, through the whole loop, for every proposer
kind (n-gram, draft model, Medusa, EAGLE; chains and trees; suffix trees; grammar-constrained rows): each sampled
row's 8 tokens (1 from prefill, 7 from verify steps) are checked against the target's exact per-step
distributions from a cache-free forward (tests/distribution.py: assert_conditional_law), with negative controls
at loop level. Trees, whose drafts are deterministic, must moreover commit the law-checked n-gram run's very
tokens (250 rows), which is cheaper and stronger than a second law test.

Power (the choice of sample size). A vocabulary of 8, 2,000 rows per law case, 10 comparisons (each of the 8
positions; and positions 1-7 pooled, by token id and by the token's rank under p), Bonferroni at a family-wise
level of 1e-3 (1e-4 each). A loop whose conditional law differs from p by total-variation distance eps, in a
direction common to the rows, has noncentrality lambda = n chi2(p'||p) >= 4 n eps^2 (Cauchy-Schwarz) in a
chi-square statistic of <= 7 degrees of freedom: pooled (14,000 draws) eps = 0.03 is detected with power >= 0.98
(0.84 at eps = 0.025); at one position alone (2,000 draws) eps = 0.07 with power >= 0.90. (scipy:
ncx2.sf(chi2.isf(1e-4, 7), 7, 4 n eps^2).) Twice the rows would cost twice the run time (the compile is the same).

Negative controls, built here by wrapping the loop's verify functions (spec_jax.decode.verify_chain/verify_tree),
not by changing product code: "wrong_q" verifies against a uniform q instead of the drafter's (for deterministic
drafts and trees: instead of one-hot), "no_residual" draws the correction after a rejection from p instead of the
residual max(p - q, 0). Both must fail the same assertion (at 250 rows the smallest p-values were 1e-14 to
1e-153), and a broken tree the trees' token identity.

Runtime: each case compiles the whole loop once (the compilation cache keeps it for the next run), then runs
2,000 rows (trees and controls 250); on the loaded 2-core machine, cold, a law case took 70-130 s.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from spec_jax import decode
from spec_jax.config import SamplingParams
from spec_jax.controls import Controls
from spec_jax.grammar import automaton
from spec_jax.grammar.rows import GrammarRows
from spec_jax.models.transformer import init_params
from spec_jax.verify import verify_chain, verify_tree
from tests.conftest import tiny_gemma_config
from tests.distribution import assert_conditional_law, exact_conditionals, sample_rows
from tests.test_slots import _proposer

CONFIG = tiny_gemma_config(vocab_size=8, eos_ids=(99,))  # no stop token: every row runs its 8 tokens
PROMPT = [2, 3, 4, 5, 3, 4, 5, 3]  # repeats: n-gram and suffix drafts find matches
NEW = 8
ROWS, CALLS = 1000, 2  # 2,000 rows per case (module docstring: the power calculation)
# Two sampling settings, alternating rows: T 0.7 with top-k 5 and top-p 0.95; T 1.0 with top-k 6 and top-p 0.9.
SETTINGS = [(0.7, 5, 0.95), (1.0, 6, 0.9)]
ROW_SETTINGS = [SETTINGS[i % 2] for i in range(ROWS)]
TOKEN_BYTES = [None, None, b"a", b"b", b"c", b"ab", b"ba", b"ca"]


@functools.lru_cache(maxsize=None)
def _params():
  return init_params(CONFIG, jax.random.PRNGKey(3))


@functools.lru_cache(maxsize=None)
def _grammar():
  return automaton.from_regex("(ab|ba|c){12,}", TOKEN_BYTES, (1,))  # no end within 8 tokens: full rows


@functools.lru_cache(maxsize=None)  # the n-gram run is the trees' reference too
def _run(name, grammar=False, seed=0, calls=CALLS, rows=ROWS):
  """Sample `calls` x `rows` rows through the loop with proposer `name` (tests/test_slots._proposer) -> (tokens,
  exact conditionals, their ambiguous entries, drafted and accepted totals)."""
  params = _params()
  proposer, pparams = _proposer(name, params, config=CONFIG)
  controls = None
  if grammar:
    controls = Controls.stack([Controls.make(1)] * rows).replace(grammar=GrammarRows.make([_grammar()] * rows, 8))
  sampling = SamplingParams.stack(ROW_SETTINGS[:rows])
  tokens, drafted, accepted = sample_rows(params, CONFIG, proposer, pparams, n=rows, calls=calls, new=NEW,
                                          prompt=PROMPT, sampling=sampling, seed=seed, controls=controls)
  probs, ambiguous = exact_conditionals(params, CONFIG, PROMPT, tokens, ROW_SETTINGS[:rows] * calls,
                                        grammar=_grammar() if grammar else None)
  return tokens, probs, ambiguous, drafted, accepted


# The law at 2,000 rows: sampled chains (draft model, Medusa, EAGLE: q and the residual), n-gram (deterministic
# drafts) and grammar rows, whose forced tokens are drafts with a one-hot q.
# Medusa and the grammar rows (the law of constrained drafts is also tests/grammar/test_grammar_decode.py's) run in
# make test-full.
CASES = ["ngram", "draft", pytest.param("medusa", marks=pytest.mark.full), "eagle",
         pytest.param("draft+grammar", marks=pytest.mark.full)]


@pytest.mark.parametrize("case", CASES)
def test_sampled_loop_keeps_the_target_law_over_several_steps(case):
  name, _, grammar = case.partition("+")
  tokens, probs, ambiguous, drafted, accepted = _run(name, grammar=bool(grammar))
  assert drafted > 0 and 0 < accepted < drafted, (drafted, accepted)  # accept and reject paths both ran
  pv = assert_conditional_law(tokens, probs, ambiguous)
  print(case, f"accepted {accepted}/{drafted}", "min p", min(pv.values()))


# Trees (whose children are top-k candidates, not samples) and suffix trees: deterministic drafts commit the very
# tokens plain decoding draws with the same row streams, whatever was drafted (spec_jax/verify.py), a stronger
# statement than the law and a cheaper one to check: 250 rows token for token against the law-checked n-gram run's
# first 250 rows (a row's stream depends on the seed and its index only, not the batch), and the law on them.
TREE_ROWS = 250


@pytest.mark.parametrize("name", ["suffix_tree", "draft_tree", "medusa_tree", "eagle_tree"])
def test_sampled_trees_commit_the_law_checked_tokens(name):
  tokens, probs, ambiguous, drafted, accepted = _run(name, calls=1, rows=TREE_ROWS)
  assert drafted > 0 and 0 < accepted < drafted, (drafted, accepted)
  assert_conditional_law(tokens, probs, ambiguous)
  same = (tokens == _run("ngram", grammar=False)[0][:TREE_ROWS]).all(axis=1)
  assert same.all(), f"{int((~same).sum())} of {TREE_ROWS} rows differ from the n-gram run's"


# ---------------------------------------------------------------------------------------------- negative controls

def _uniform_q(logits):
  return jnp.full(logits.shape, 1.0 / logits.shape[-1], jnp.float32)


def _chain_wrong_q(logits, drafts, q, key, params, **kw):
  return verify_chain(logits, drafts, _uniform_q(logits)[:, :-1], key, params, **kw)


def _tree_wrong_q(logits, tokens, parents, q, key, params, **kw):
  return verify_tree(logits, tokens, parents, _uniform_q(logits), key, params, **kw)


def _chain_no_residual(logits, drafts, q, key, params, *, positions, **kw):
  """The real verification, then the token after a rejected draft replaced by p's own draw there."""
  out, n = verify_chain(logits, drafts, q, key, params, positions=positions, **kw)
  k = drafts.shape[1]
  at_n = jnp.take_along_axis(logits, n[:, None, None], axis=1)  # [B, 1, V]
  own = verify_chain(at_n, jnp.zeros((drafts.shape[0], 0), jnp.int32), None, key, params,
                     positions=positions + n)[0][:, 0]
  fix = (jnp.arange(k + 1)[None, :] == n[:, None]) & (n < k)[:, None]
  return jnp.where(fix, own[:, None], out), n


@pytest.mark.parametrize("case,broken", [("draft", "no_residual"), ("ngram", "wrong_q"), ("medusa_tree", "wrong_q")])
def test_loop_level_negative_controls_fail_the_law(case, broken, monkeypatch):
  # The trees' check, too: computed before the verify is broken (and kept by _run's cache).
  reference = _run("ngram", grammar=False)[0][:TREE_ROWS] if case.endswith("_tree") else None
  if broken == "no_residual":
    monkeypatch.setattr(decode, "verify_chain", _chain_no_residual)
  else:
    monkeypatch.setattr(decode, "verify_chain", _chain_wrong_q)
    monkeypatch.setattr(decode, "verify_tree", _tree_wrong_q)
  jax.clear_caches()  # the loop traced with the real verify must not be reused, nor this one kept after
  try:  # 250 rows: the effects are large; _run's own cache bypassed
    tokens, probs, ambiguous, drafted, accepted = _run.__wrapped__(case, calls=1, rows=TREE_ROWS)
  finally:
    jax.clear_caches()
  assert drafted > 0
  from tests.distribution import conditional_law_pvalues
  try:
    print(case, broken, "p-values", conditional_law_pvalues(tokens, probs, ambiguous))
  except AssertionError as e:
    print(case, broken, e)
  with pytest.raises(AssertionError, match="not the target's law|outside the target's support"):
    assert_conditional_law(tokens, probs, ambiguous)
  if reference is not None:
    assert (tokens != reference).any(axis=1).mean() > 0.1
