"""The generation loop on tiny random models: exactness against a cache-free reference, batch invariance,
lossless speculation, stop tokens inside accepted chunks, exact token limits and adaptive speculation."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from spec_jax import adaptive
from spec_jax.cache import KVCache
from spec_jax.config import SamplingParams
from spec_jax.batch import generate
from spec_jax.models.transformer import forward, init_params
from spec_jax.proposers.base import NoneProposer
from spec_jax.proposers.draft import DraftModelProposer, early_exit_proposer
from spec_jax.proposers.ngram import NgramProposer
from tests.conftest import tiny_gemma_config, tiny_llama_config
from tests.distribution import assert_same_distribution, sample_plain_and_speculative

CONFIG = tiny_gemma_config(eos_ids=(1,))


@functools.lru_cache(maxsize=None)
def _params(seed=0, config=CONFIG):
  return init_params(config, jax.random.PRNGKey(seed))


def _prompts(rng, lengths, vocab=CONFIG.vocab_size):
  return [[2] + rng.integers(3, vocab, n - 1).tolist() for n in lengths]


def _reference_greedy(params, config, prompt, n_new, stop_ids=()):
  """Recompute the whole sequence every token: no cache, no batching, obviously correct."""
  fwd = jax.jit(lambda p, t: forward(p, t, jnp.arange(t.shape[1])[None], KVCache.init(config, 1, t.shape[1]),
                                     config=config)[0])
  seq = list(prompt)
  out = []
  for _ in range(n_new):
    tok = int(jnp.argmax(fwd(params, jnp.asarray(seq)[None])[0, -1]))
    out.append(tok)
    seq.append(tok)
    if tok in stop_ids or tok in config.eos_ids:
      break
  return out


def test_baseline_greedy_matches_cache_free_reference():
  params = _params()
  rng = np.random.default_rng(0)
  prompts = _prompts(rng, [5, 12, 3])  # different lengths; 12 + 10 runs past the 8-token window
  res = generate(params, CONFIG, prompts, max_new_tokens=10)
  for p, got in zip(prompts, res.token_ids):
    assert got == _reference_greedy(params, CONFIG, p, 10)


def test_batch_invariance_float32():
  params = _params()
  prompts = _prompts(np.random.default_rng(1), [7, 4, 11, 6])
  batched = generate(params, CONFIG, prompts, max_new_tokens=12).token_ids
  for i, p in enumerate(prompts):
    alone = generate(params, CONFIG, [p], max_new_tokens=12).token_ids[0]
    assert alone == batched[i]


def _repetitive_prompts(rng, n, vocab=CONFIG.vocab_size):
  """Prompts with repeated spans, so n-gram drafts get accepted and rejected."""
  out = []
  for i in range(n):
    span = rng.integers(3, vocab, 4 + i).tolist()
    out.append([2] + span * 3 + rng.integers(3, vocab, 2).tolist())
  return out


@pytest.mark.parametrize("seed", range(4))
def test_ngram_greedy_is_lossless(seed):
  params = _params(seed)
  rng = np.random.default_rng(seed)
  prompts = _repetitive_prompts(rng, 3) + _prompts(rng, [6])
  base = generate(params, CONFIG, prompts, max_new_tokens=20)
  spec = generate(params, CONFIG, prompts, max_new_tokens=20, proposer=NgramProposer(k=4, ngram_max=3),
                  adaptive_k=False)
  assert spec.token_ids == base.token_ids
  assert spec.finish_reasons == base.finish_reasons
  assert spec.stats["drafted_tokens"] > 0


@pytest.mark.parametrize("seed", range(3))
def test_draft_model_greedy_is_lossless(seed):
  params = _params(seed)
  rng = np.random.default_rng(10 + seed)
  prompts = _prompts(rng, [5, 9, 3])
  base = generate(params, CONFIG, prompts, max_new_tokens=16)
  proposer, pparams = early_exit_proposer(CONFIG, params, 2, k=3)
  spec = generate(params, CONFIG, prompts, max_new_tokens=16, proposer=proposer, proposer_params=pparams,
                  adaptive_k=False)
  assert spec.token_ids == base.token_ids
  assert spec.stats["accepted_tokens"] > 0  # the early exit agrees sometimes: the accept path runs
  # An independent draft model (another random model, Llama layout, same vocab) for a different acceptance.
  dcfg = tiny_llama_config(vocab_size=CONFIG.vocab_size)
  other = DraftModelProposer(config=dcfg, k=4)
  spec2 = generate(params, CONFIG, prompts, max_new_tokens=16, proposer=other,
                   proposer_params=init_params(dcfg, jax.random.PRNGKey(99)), adaptive_k=False)
  assert spec2.token_ids == base.token_ids


def test_stop_token_inside_accepted_chunk_and_exact_max_tokens():
  params = _params(0)
  prompts = _repetitive_prompts(np.random.default_rng(5), 3)
  base = generate(params, CONFIG, prompts, max_new_tokens=24)
  spec = generate(params, CONFIG, prompts, max_new_tokens=24, proposer=NgramProposer(k=6), adaptive_k=False)
  assert spec.token_ids == base.token_ids
  assert spec.stats["mean_acceptance_length"] > 1.2  # multi-token commits happen
  # Stop at a token the run emits mid-output: the output is cut right after its first occurrence.
  out = base.token_ids[0]
  stop = out[len(out) // 2]
  cut = out.index(stop) + 1
  res = generate(params, CONFIG, prompts, max_new_tokens=24, proposer=NgramProposer(k=6), adaptive_k=False,
                 stop_ids=(stop,))
  assert res.token_ids[0] == out[:cut]
  assert res.finish_reasons[0] == "stop"
  # Per-row token limits are exact, whatever the chunk sizes.
  limits = [1, 7, 13]
  res = generate(params, CONFIG, prompts, max_new_tokens=limits, proposer=NgramProposer(k=6), adaptive_k=False)
  for got, want, lim, why in zip(res.token_ids, base.token_ids, limits, res.finish_reasons):
    assert got == want[:lim]
    assert len(got) == lim or why == "stop"
  # Counters count what was committed: drafts cut by the limit or a stop token are not "accepted".
  for res in (res, spec):
    st = res.raw_stats
    np.testing.assert_array_equal(st.emitted, [len(t) - 1 for t in res.token_ids])  # the first token is prefill's
    assert (st.accepted <= st.emitted).all() and (st.accepted >= st.emitted - st.steps).all()
    np.testing.assert_array_equal(st.accepted_at.sum(1), st.accepted)


def test_adaptive_controller_switches_off_and_back_on():
  ks = adaptive.option_set(4, True)
  assert ks == (0, 2, 4)
  st = adaptive.AdaptState.init(2, [1.0, 2.0, 2.5])
  active = jnp.array([True, True])
  # Nothing accepted: speculation stops paying and is switched off.
  for _ in range(5):
    st = adaptive.observe(st, 2, 4, active, jnp.array([0, 0]))
  assert int(adaptive.choose(st, active, active, ks, probe_every=3)) == 0
  for _ in range(3):
    st = adaptive.observe(st, 0, 0, active, jnp.array([0, 0]))
  assert int(adaptive.choose(st, active, active, ks, probe_every=3)) == 1  # a probe
  # The probe and following steps accept everything: the controller goes back to full k.
  for _ in range(6):
    st = adaptive.observe(st, 2, 4, active, jnp.array([4, 4]))
  assert int(adaptive.choose(st, active, active, ks, probe_every=3)) == 2
  # Rows that may not be drafted for (speculation off for them, or globally) never get a draft.
  none = jnp.array([False, False])
  assert int(adaptive.choose(st, active, none, ks, probe_every=3)) == 0


def test_adaptive_generation_stays_lossless_and_uses_several_k():
  params = _params(1)
  rng = np.random.default_rng(3)
  prompts = _repetitive_prompts(rng, 2)
  base = generate(params, CONFIG, prompts, max_new_tokens=40)
  # Drafting is made to look expensive, so the controller drops to k = 0 and then probes.
  spec = generate(params, CONFIG, prompts, max_new_tokens=40, proposer=NgramProposer(k=4), adaptive_k=True,
                  costs=[1.0, 1.6, 2.2], probe_every=4)
  assert spec.token_ids == base.token_ids
  assert spec.ks == (0, 2, 4)
  assert sum(u > 0 for u in spec.option_uses) >= 2


@pytest.mark.full  # tests/test_sampled_law.py's draft case checks the same loop over 8 tokens, with controls
def test_speculative_sampling_matches_plain_sampling_distribution():
  """The first 3 sampled tokens have the same distribution with and without a (sampling) draft model."""
  config = tiny_gemma_config(vocab_size=8, eos_ids=(99,))  # a tiny vocab: enough samples per cell
  params = init_params(config, jax.random.PRNGKey(3))
  dcfg = config.replace(num_layers=1)
  draft = DraftModelProposer(config=dcfg, k=2)
  dparams = init_params(dcfg, jax.random.PRNGKey(4))
  plain, specd, rates = sample_plain_and_speculative(params, config, draft, dparams, n=500, calls=6)  # 3000 each
  assert 0.1 < np.mean(rates) < 0.95  # both accept and reject paths are exercised
  assert_same_distribution(plain, specd)


def test_bad_generation_input():
  params = _params()
  with pytest.raises(ValueError, match="empty"):
    generate(params, CONFIG, [[2, 5], []], max_new_tokens=4)
  with pytest.raises(ValueError, match="exceeds the context"):
    generate(params, CONFIG, [[2] * 250], max_new_tokens=20)
  with pytest.raises(ValueError, match="max_new_tokens"):
    generate(params, CONFIG, [[2, 5]], max_new_tokens=0)
  with pytest.raises(ValueError, match="temperature"):
    SamplingParams.make(1, temperature=-0.5)
  with pytest.raises(ValueError, match="top_p"):
    SamplingParams.make(1, top_p=0.0)
  with pytest.raises(ValueError, match="top_p"):
    SamplingParams.make(1, top_p=1.5)


def test_draft_catches_up_after_steps_without_drafting():
  """After adaptive k = 0 steps the draft must not read cache slots it never wrote: its proposal equals a
  cache-free greedy continuation by the draft model of the committed tokens."""
  from spec_jax.proposers.base import PrefillOut, ProposeContext
  params = _params(0)
  proposer, dparams = early_exit_proposer(CONFIG, params, 2, k=3)
  rng = np.random.default_rng(7)
  committed = [2] + rng.integers(3, CONFIG.vocab_size, 40).tolist()
  S, prompt_len = 64, 6
  tokens = np.zeros((1, S), np.int32)
  tokens[0, :len(committed)] = committed
  pre = PrefillOut(prompt_tokens=jnp.asarray(tokens[:, :8]), tokens=jnp.asarray(tokens),
                   lengths=jnp.asarray([prompt_len + 1]), prompt_lens=jnp.asarray([prompt_len]), prompt_hidden=None,
                   last_hidden=jnp.zeros((1, CONFIG.d_model)), chunk=8)
  cache = jax.jit(lambda p: proposer.init(p, pre, S))(dparams)
  ctx = ProposeContext(jnp.asarray(tokens), jnp.asarray([len(committed)], jnp.int32), SamplingParams.make(1),
                       jnp.zeros((1, CONFIG.d_model)))
  draft, _ = jax.jit(lambda c: proposer.propose(dparams, c, ctx, 3, jax.random.PRNGKey(0)))(cache)
  want = _reference_greedy(dparams, proposer.config.replace(eos_ids=()), committed, 3)
  assert draft.tokens[0].tolist() == want


def test_switch_in_place_runs_exactly_the_indexed_branch():
  from spec_jax.decode import switch_in_place
  branches = [lambda x, i=i: (x[0] + 10 ** i, x[1].at[i].add(1)) for i in range(3)]
  f = jax.jit(lambda idx: switch_in_place(idx, branches, (jnp.zeros((), jnp.int32), jnp.zeros(3, jnp.int32))))
  for idx, want in [(0, 1), (1, 10), (2, 100), (-4, 1), (7, 100)]:  # out of range clamps, as lax.switch does
    total, hits = f(jnp.int32(idx))
    assert int(total) == want
    assert np.asarray(hits).sum() == 1
