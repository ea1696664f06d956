"""Logprobs (spec_jax/logprobs.py): each committed token's logprob and top N come from the verify logits that
decided it, equal plain decoding's within float32 noise for chains and trees, and equal a whole-sequence forward's
log-softmax at the token's own position (so a value written one position off, or from the wrong logits, fails).
Processed mode is the distribution after the controls and warping."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from spec_jax import logprobs as lps
from spec_jax.batch import start
from spec_jax.config import SamplingParams
from spec_jax.controls import Controls
from spec_jax.decode import decode_loop, make_spec
from spec_jax.models.transformer import forward
from spec_jax.proposers.base import NoneProposer
from tests.proposers.test_medusa_eagle import CONFIG, _params, _prompts
from tests.test_slots import _proposer

STOPS = (1,)
N = 4


def _run(params, prompts, proposer=NoneProposer(), pparams=None, *, want=N, mode="raw_logprobs", controls=None,
         sampling=None, max_new=16, seed=0, stats=None):
  """-> per row (prompt length, generated ids, chosen [n], top_ids [n, N], top_vals [n, N]). `mode`: one for all
  rows or a list, one per row; `stats`: a dict that gets the run's drafted and accepted totals."""
  spec = make_spec(CONFIG, proposer, adaptive_k=False, stop_ids=STOPS, max_logprobs=N)
  full = {"target": params, "proposer": pparams if pparams is not None else {}}
  n = len(prompts)
  modes = [mode] * n if isinstance(mode, str) else mode
  state = start(full, spec, prompts, max_new_tokens=max_new, seed=seed, sampling=sampling, controls=controls,
                logprobs=([want] * n, [lps.MODES[m] for m in modes]))
  state = decode_loop(full, state, spec)
  g = jax.device_get
  toks, lens, plens = g(state.tokens), g(state.lengths), g(state.prompt_lens)
  lp = g(state.logprobs)
  out = []
  for b in range(n):
    s = slice(int(plens[b]), int(lens[b]))
    out.append((int(plens[b]), toks[b, s].tolist(), lp.chosen[b, s], lp.top_ids[b, s], lp.top_vals[b, s]))
  if proposer.k:
    assert int(g(state.stats.drafted).sum()) > 0, "speculation ran"
  if stats is not None:
    stats.update(drafted=int(g(state.stats.drafted).sum()), accepted=int(g(state.stats.accepted).sum()))
  return out


def _reference(params, prompt, generated):
  """log-softmax of a cache-free forward over prompt + generated: row i is the distribution of token i + 1."""
  seq = jnp.asarray([list(prompt) + list(generated)], jnp.int32)
  logits = forward(params, seq, None, None, config=CONFIG)[0][0]
  return np.asarray(jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1))


@pytest.mark.parametrize("name", ["ngram", "draft", "eagle_tree", "medusa_tree"])
def test_speculative_logprobs_equal_plain_ones_and_the_model_s(name):
  params = _params(1)
  prompts = _prompts(5, [11, 8, 14])
  plain = _run(params, prompts)
  spec = _run(params, prompts, *_proposer(name, params))
  for b, ((pl, ids, ch, ti, tv), (_, ids_s, ch_s, ti_s, tv_s)) in enumerate(zip(plain, spec)):
    assert ids == ids_s and len(ids) > 2
    assert np.max(np.abs(ch - ch_s)) < 1e-4, f"row {b}"
    assert np.max(np.abs(tv - tv_s)) < 1e-4
    # top ids agree wherever the values are not near-ties
    gap = np.abs(np.diff(tv, axis=1)).min(axis=1) > 1e-4
    np.testing.assert_array_equal(ti[gap], ti_s[gap])
    ref = _reference(params, prompts[b], ids)[pl - 1:pl - 1 + len(ids)]
    np.testing.assert_allclose(ch_s, ref[np.arange(len(ids)), ids], atol=1e-4)
    np.testing.assert_allclose(tv_s, -np.sort(-ref, axis=1)[:, :N], atol=1e-4)
    assert (ch_s <= tv_s[:, 0] + 1e-6).all() and np.allclose(ch_s, tv_s[:, 0], atol=1e-5)  # greedy: the best


def test_processed_logprobs_are_after_the_controls_and_warping():
  params = _params(1)
  prompts = _prompts(5, [11, 8])
  n = len(prompts)
  c = Controls.stack([Controls.make(1, presence=0.8, frequency=0.6, repetition=1.5,
                                    vocab_size=CONFIG.vocab_size)] * n)
  raw = _run(params, prompts, controls=c)
  proc = _run(params, prompts, controls=c, mode="processed_logprobs")
  spec = _run(params, prompts, *_proposer("ngram", params), controls=c, mode="processed_logprobs")
  for (pl, ids, ch, _, _), (_, ids_p, ch_p, _, tv_p), (_, ids_s, ch_s, _, tv_s) in zip(raw, proc, spec):
    assert ids == ids_p == ids_s
    assert np.max(np.abs(ch_p - ch_s)) < 1e-4 and np.max(np.abs(tv_p - tv_s)) < 1e-4
    assert np.max(np.abs(ch - ch_p)) > 1e-2, "the penalties change the processed values"
    # greedy with controls: the committed token is the processed distribution's best
    np.testing.assert_allclose(ch_p, tv_p[:, 0], atol=1e-5)
  # sampled with top_k = 2: only two tokens keep a finite processed logprob, and they sum to one
  samp = SamplingParams.make(n, temperature=0.7, top_k=2)
  for (pl, ids, ch, ti, tv) in _run(params, prompts, mode="processed_logprobs", sampling=samp, seed=3):
    assert np.isfinite(tv[:, :2]).all() and np.isneginf(tv[:, 2:]).all()
    np.testing.assert_allclose(np.exp(tv[:, :2]).sum(axis=1), 1.0, atol=1e-5)
    assert np.isfinite(ch).all()
  # raw mode under the same sampling is the model's own log-softmax, whatever the warping
  for b, (pl, ids, ch, _, _) in enumerate(_run(params, prompts, sampling=samp, seed=3)):
    ref = _reference(params, prompts[b], ids)[pl - 1:pl - 1 + len(ids)]
    np.testing.assert_allclose(ch, ref[np.arange(len(ids)), ids], atol=1e-4)


def test_prompt_logprobs_are_the_model_s_and_rows_that_do_not_ask_get_none():
  params = _params(1)
  prompt = _prompts(5, [11])[0]
  got = lps.prompt_logprobs(params, CONFIG, prompt, 3, block=8)  # 11 tokens pad to 16: two blocks
  ref = _reference(params, prompt, [])
  assert got[0] is None and len(got) == len(prompt)
  for i in range(1, len(prompt)):
    lp, rank, ids, vals = got[i]
    assert abs(lp - ref[i - 1, prompt[i]]) < 1e-4
    assert rank == 1 + int(np.sum(ref[i - 1] > ref[i - 1, prompt[i]] + 1e-6))
    np.testing.assert_allclose(vals, -np.sort(-ref[i - 1])[:3], atol=1e-4)
  (pl, ids, ch, ti, tv), = _run(params, [prompt], want=-1)
  assert not ch.any() and not tv.any()


def test_logprobs_requests_are_checked():
  with pytest.raises(ValueError, match="logprobs_mode"):
    lps.check(1, "final", 5)
  with pytest.raises(ValueError, match="at most 5"):
    lps.check(6, "raw_logprobs", 5)
  with pytest.raises(ValueError, match="without logprobs"):
    lps.check(0, "raw_logprobs", lps.OFF)


# Sampled speculation: T 0.8, top-k 12, top-p 0.9, one row per prompt in each mode (one compile for both).
SAMPLED = [(0.8, 12, 0.9)] * 6
LP_MODES = ["raw_logprobs"] * 3 + ["processed_logprobs"] * 3


def _sampled_logprob_errors(name):
  """Run a sampled speculative batch with logprobs -> (raw rows' and processed rows' largest error of the
  committed token's logprob and the top N, against a cache-free forward of the committed sequence)."""
  from tests.test_sampling import ref_probs
  params = _params(1)
  prompts = _prompts(5, [11, 8, 14]) * 2
  stats = {}
  out = _run(params, prompts, *_proposer(name, params), mode=LP_MODES, sampling=SamplingParams.stack(SAMPLED),
             max_new=20, seed=7, stats=stats)
  # Drafts were rejected: each rejection committed a token drawn from the residual, checked below like the rest.
  assert 0 < stats["accepted"] < stats["drafted"], stats
  err = {"raw_logprobs": 0.0, "processed_logprobs": 0.0}
  for b, (pl, ids, ch, ti, tv) in enumerate(out):
    assert len(ids) > 4
    ref = _reference(params, prompts[b], ids)[pl - 1:pl - 1 + len(ids)]
    if LP_MODES[b] == "processed_logprobs":  # the warped target the token was drawn from (float64 reference)
      with np.errstate(divide="ignore"):
        ref = np.log(np.stack([ref_probs(r, *SAMPLED[b])[0] for r in ref]))
    want_ch = ref[np.arange(len(ids)), ids]
    want_top = -np.sort(-ref, axis=1)[:, :N]
    assert np.isfinite(want_ch).all(), "a committed token outside the distribution it was drawn from"
    fin = np.isfinite(want_top)  # processed: entries past the kept set are -inf on both sides
    with np.errstate(invalid="ignore"):  # -inf - -inf where masked out
      top_err = np.inf if (np.isfinite(tv) != fin).any() else np.max(np.abs(np.where(fin, tv - want_top, 0.0)))
    err[LP_MODES[b]] = max(err[LP_MODES[b]], float(np.max(np.abs(ch - want_ch))), top_err)
  return err


@pytest.mark.parametrize("name", ["draft", "eagle_tree"])
def test_sampled_speculative_logprobs_are_the_target_s_at_each_committed_position(name):
  """Raw: the target's log-softmax at the committed token's own position; processed: the log of the warped
  distribution there; including the positions whose token came from the residual after a rejected draft."""
  err = _sampled_logprob_errors(name)
  assert err["raw_logprobs"] < 1e-4 and err["processed_logprobs"] < 1e-4, err


def test_sampled_logprobs_check_fails_on_broken_recording(monkeypatch):
  """The check above on a broken variant: record() given the temperature-scaled logits as raw ones, and processed mode
  warped by temperature only (top-k and top-p dropped). Both modes' errors must be large."""
  from spec_jax import decode
  real_record = lps.record
  monkeypatch.setattr(decode.lps, "record",
                      lambda lp, raw, processed, *a, **kw: real_record(lp, processed / 0.8, processed, *a, **kw))
  monkeypatch.setattr(lps, "_processed", lambda logits, sampling: logits / sampling.temperature[:, None, None])
  jax.clear_caches()  # neither the real loop's trace may be reused, nor this one kept
  try:
    err = _sampled_logprob_errors("draft")
  finally:
    jax.clear_caches()
  assert err["raw_logprobs"] > 1e-2 and err["processed_logprobs"] > 1e-2, err
