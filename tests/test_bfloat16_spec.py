"""Greedy speculation in bfloat16 against plain greedy decoding in the same layout, for every proposer (chains and
trees), in the two layouts users run: the CPU one (`--dtype=bfloat16` on CPU: a bfloat16 embedding and head,
float32 layers and cache, spec_jax/checkpoints/load.cpu_layout) and the all-bfloat16 one (TPU and GPU: every
weight, activation and the cache in bfloat16).

The rule (BUILD.md, "What exact means"): a k + 1 position verify and a one-position decode round differently in
bfloat16, so the statement that holds is: the speculative tokens equal the plain ones, except that a row may
diverge at a position where the two tokens are a near-tie of the target: their logits, from a float32 cache-free
forward of the common prefix with the layout's (bfloat16-rounded) weights, differ by at most TIE_ULPS bfloat16
ulps of the largest logit there (2^-8 relative each). After a divergence the row is not compared further (its
prefix differs). Divergences are counted and printed; a divergence that is not a near-tie fails, as does a count
above MAX_TIES per layout.

Broken variant (test_a_wrong_bonus_token_is_not_a_near_tie): a loop whose chain verify commits the first
rejected draft instead of the target's token must fail the rule.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from spec_jax import decode
from spec_jax.batch import generate
from spec_jax.checkpoints.load import cpu_layout
from spec_jax.models.transformer import forward
from spec_jax.quant import cast_floats
from spec_jax.verify import verify_chain
from tests.proposers.test_medusa_eagle import CONFIG, _params, _prompts
from tests.test_slots import _proposer

PROPOSERS = ["ngram", "suffix", "draft", "medusa", "eagle", "suffix_tree", "draft_tree", "medusa_tree", "eagle_tree"]
MAX_NEW = 24
TIE_ULPS = 8  # a near-tie: the two logits within 8 * 2^-8 of the largest |logit| at the position
MAX_TIES = 2  # per layout and proposer: more divergences than this is not the rare near-tie the rule allows


@functools.lru_cache(maxsize=None)
def _layout(name):
  p16 = cast_floats(_params(0), jnp.bfloat16)
  return cpu_layout(p16) if name == "cpu" else p16


def _layout_proposer(name, layout):
  proposer, pparams = _proposer(name, _layout(layout))
  return proposer, cast_floats(pparams, jnp.bfloat16) if layout == "bf16" else pparams


PROMPTS = _prompts(4, [11, 7, 14, 9])


@functools.lru_cache(maxsize=None)
def _plain(layout):
  return generate(_layout(layout), CONFIG, PROMPTS, max_new_tokens=MAX_NEW).token_ids


def near_tie_margin(layout, prefix, a, b):
  """(|logit a - logit b|, the tolerance) at the position after `prefix`, from a float32 cache-free forward with
  the layout's weights."""
  p32 = cast_floats(_layout(layout), jnp.float32)
  logits = forward(p32, jnp.asarray([prefix], jnp.int32), None, None, config=CONFIG)[0][0, -1]
  logits = np.asarray(logits, np.float64)
  return abs(logits[a] - logits[b]), TIE_ULPS * 2.0 ** -8 * np.max(np.abs(logits))


def divergences(layout, plain, spec):
  """-> [(row, position, margin, tolerance)] of each row's first divergence (rows without one: none)."""
  out = []
  for r, (x, y) in enumerate(zip(plain, spec)):
    t = next((i for i, (u, v) in enumerate(zip(x, y)) if u != v), None)
    if t is None:
      assert len(x) == len(y), (r, x, y)
      continue
    out.append((r, t, *near_tie_margin(layout, PROMPTS[r] + x[:t], x[t], y[t])))
  return out


def _check(layout, name):
  proposer, pparams = _layout_proposer(name, layout)
  spec = generate(_layout(layout), CONFIG, PROMPTS, max_new_tokens=MAX_NEW, proposer=proposer,
                  proposer_params=pparams, adaptive_k=False)
  assert spec.stats["drafted_tokens"] > 0
  div = divergences(layout, _plain(layout), spec.token_ids)
  print(f"bfloat16 {layout} {name}: {len(div)} near-tie divergences of {len(PROMPTS)} rows {div}")
  not_ties = [d for d in div if d[2] > d[3]]
  assert not not_ties, f"divergences that are not near-ties (row, position, margin, tolerance): {not_ties}"
  assert len(div) <= MAX_TIES, div
  return spec


@pytest.mark.parametrize("layout", ["cpu", "bf16"])
@pytest.mark.parametrize("name", PROPOSERS)
def test_bfloat16_speculative_greedy_equals_plain_up_to_counted_near_ties(layout, name):
  _check(layout, name)


def test_the_layouts_are_the_ones_users_run():
  cpu, b16 = _layout("cpu"), _layout("bf16")
  assert cpu["embed"].dtype == jnp.bfloat16 and cpu["final_norm"].dtype == jnp.float32
  assert {x.dtype for x in jax.tree.leaves(cpu["layers"])} == {jnp.dtype(jnp.float32)}
  assert {x.dtype for x in jax.tree.leaves(b16)} == {jnp.dtype(jnp.bfloat16)}  # the cache follows final_norm's


def _commit_rejected_draft(logits, drafts, q, key, params, **kw):
  """Broken: after the accepted drafts, the first rejected draft is committed instead of the target's token."""
  out, n = verify_chain(logits, drafts, q, key, params, **kw)
  k = drafts.shape[1]
  wrong = jnp.take_along_axis(jnp.concatenate([drafts, out[:, -1:]], axis=1), n[:, None], axis=1)
  fix = (jnp.arange(k + 1)[None, :] == n[:, None]) & (n < k)[:, None] & (wrong >= 0)
  return jnp.where(fix, wrong, out), n


def test_a_wrong_bonus_token_is_not_a_near_tie(monkeypatch):
  monkeypatch.setattr(decode, "verify_chain", _commit_rejected_draft)
  jax.clear_caches()  # neither reuse the real loop's trace nor keep this one
  try:
    with pytest.raises(AssertionError, match="not near-ties"):
      _check("bf16", "ngram")
  finally:
    jax.clear_caches()
