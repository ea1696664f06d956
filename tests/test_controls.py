"""Sampling controls (spec_jax/controls.py): the processed logits equal a plain numpy reading of vLLM's definitions,
a drafted path counts as context at every verified position, and decoding with each control is token-identical
with and without speculation (chains and trees, every proposer kind), stop ids and ignore_eos included."""

import numpy as np
import jax.numpy as jnp
import pytest

from spec_jax import controls as ctl
from spec_jax.batch import generate
from spec_jax.controls import Controls
from spec_jax.proposers.ngram import NgramProposer
from tests.proposers.test_medusa_eagle import CONFIG, _params, _prompts
from tests.test_slots import _proposer

V = 40
STOPS = (1,)


def _reference(x, prompt, output, extra, *, presence=0.0, frequency=0.0, repetition=1.0, min_p=0.0, min_tokens=0,
               bias=None, stop_token_ids=(), temperature=1.0, depth=0):
  """One position's processed logits, by the book: bias, min_tokens, repetition, frequency / presence, min_p."""
  x = np.asarray(x, np.float64).copy()
  for t, v in (bias or {}).items():
    x[int(t)] += v
  if len(output) + depth < min_tokens:
    for s in set(STOPS) | set(stop_token_ids):
      x[s] = -np.inf
  out = list(output) + list(extra)
  seen = set(prompt) | set(out)
  for t in seen:
    x[t] = x[t] / repetition if x[t] > 0 else x[t] * repetition
  for t in set(out):
    x[t] -= frequency * out.count(t) + presence
  if min_p > 0 and temperature > 0:
    thr = np.max(x) + temperature * np.log(min_p)
    x[x < thr] = -np.inf
  return x


def test_processed_logits_follow_the_definitions_at_every_position_of_a_path():
  rng = np.random.default_rng(0)
  B, T, S = 3, 4, 24
  prompt_lens = np.array([5, 7, 3], np.int32)
  lengths = np.array([9, 8, 3 + 2], np.int32)
  tokens = rng.integers(0, 12, (B, S)).astype(np.int32)  # small ids: repeats on purpose
  drafts = rng.integers(0, 12, (B, T - 1)).astype(np.int32)
  drafts[1, 1] = -1  # no draft there: positions after it see nothing new from it
  last = tokens[np.arange(B), lengths - 1][:, None]
  logits = rng.normal(0, 3, (B, T, V)).astype(np.float32)
  settings = [dict(presence=0.5, frequency=0.3, repetition=1.3, min_tokens=6, bias={"3": 2.5, "7": -4.0}),
              dict(repetition=0.8, min_p=0.2, stop_token_ids=(5,), min_tokens=9),
              dict(frequency=-0.7, presence=-1.1, min_p=0.05)]
  c = Controls.stack([Controls.make(1, presence=s.get("presence", 0.0), frequency=s.get("frequency", 0.0),
                                    repetition=s.get("repetition", 1.0), min_p=s.get("min_p", 0.0),
                                    min_tokens=s.get("min_tokens", 0), logit_bias=s.get("bias"),
                                    stop_token_ids=s.get("stop_token_ids", ()), vocab_size=V) for s in settings])
  temp = jnp.asarray([0.7, 1.3, 0.0], jnp.float32)
  got = np.asarray(ctl.apply(jnp.asarray(logits), c, temp, jnp.asarray(tokens), jnp.asarray(lengths),
                             jnp.asarray(prompt_lens), *ctl.chain_path(jnp.asarray(last), jnp.asarray(drafts)),
                             STOPS))
  for b, s in enumerate(settings):
    prompt, output = tokens[b, :prompt_lens[b]].tolist(), tokens[b, prompt_lens[b]:lengths[b]].tolist()
    for t in range(T):
      extra = [d for d in drafts[b, :t].tolist() if d >= 0]
      want = _reference(logits[b, t], prompt, output, extra, temperature=float(temp[b]), depth=t, **s)
      np.testing.assert_allclose(got[b, t], want, rtol=1e-5, atol=1e-5, err_msg=f"row {b} position {t}")


def test_no_controls_leave_the_logits_alone():
  rng = np.random.default_rng(1)
  logits = jnp.asarray(rng.normal(size=(2, 3, V)), jnp.float32)
  toks = jnp.asarray(rng.integers(0, V, (2, 10)), jnp.int32)
  out = ctl.apply(logits, Controls.make(2), jnp.ones((2,)), toks, jnp.array([6, 7]), jnp.array([3, 3]),
                  *ctl.chain_path(toks[:, :1], toks[:, 1:3]), STOPS)
  np.testing.assert_array_equal(np.asarray(out), np.asarray(logits))


@pytest.mark.parametrize("bad, msg", [
    (dict(presence=2.5), "presence_penalty"), (dict(frequency=float("nan")), "frequency_penalty"),
    (dict(repetition=0.0), "repetition_penalty"), (dict(min_p=1.5), "min_p"), (dict(min_tokens=-1), "min_tokens"),
    (dict(min_tokens=2 ** 63), "min_tokens"),
    (dict(logit_bias={"x": 1}), "logit_bias keys"), (dict(logit_bias={"99": 1}), r"in \[0, \d+\)"),
    # every bad key named (issue 50 item 3), and the vocabulary's size
    (dict(logit_bias={"x": 1, "3": 1, "99": 2, "-1": 0}), "these are not: 'x', '99', '-1'$"),
    (dict(logit_bias={"3": 101}), "logit_bias values"), (dict(stop_token_ids=(V,)), "stop_token_ids"),
    (dict(stop_token_ids=(3, V, V + 1)), rf"in \[0, {V}\); these are not: {V}, {V + 1}$"),
    (dict(stop_token_ids=tuple(range(17))), "at most"),
])
def test_bad_controls_name_the_field(bad, msg):
  with pytest.raises(ValueError, match=msg):
    Controls.make(1, vocab_size=V, **bad)


CASES = {  # each changes the greedy output of the tiny model on these prompts
    "penalties": dict(presence=0.8, frequency=0.6, repetition=1.5),
    "bias": dict(logit_bias={"7": 3.0, "11": -2.0, "13": 2.0}),
    "min_tokens_stop_ids": dict(min_tokens=6, stop_token_ids=(5, 77)),
}


def _controls(n, **kw):
  return Controls.stack([Controls.make(1, vocab_size=CONFIG.vocab_size, **kw)] * n)


@pytest.mark.parametrize("name", ["ngram", "draft", "eagle_tree", "medusa_tree"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_greedy_with_each_control_equals_plain_decoding_with_it(name, case):
  params = _params(1)
  prompts = _prompts(5, [11, 8, 14])
  c = _controls(len(prompts), **CASES[case])
  plain = generate(params, CONFIG, prompts, max_new_tokens=20, stop_ids=STOPS, controls=c)
  free = generate(params, CONFIG, prompts, max_new_tokens=20, stop_ids=STOPS)
  assert plain.token_ids != free.token_ids, "the control changes the output (else the test proves nothing)"
  proposer, pparams = _proposer(name, params)
  spec = generate(params, CONFIG, prompts, max_new_tokens=20, stop_ids=STOPS, controls=c, proposer=proposer,
                  proposer_params=pparams, adaptive_k=False)
  assert spec.token_ids == plain.token_ids
  assert spec.stats["drafted_tokens"] > 0


def test_min_tokens_and_stop_token_ids_and_ignore_eos_end_rows_as_asked():
  params = _params(1)
  prompts = _prompts(5, [11, 8, 14])
  free = generate(params, CONFIG, prompts, max_new_tokens=24, stop_ids=STOPS)
  # stop at the third token each row would produce: that token, as a row stop id, ends it there
  third = [out[2] for out in free.token_ids]
  c = Controls.stack([Controls.make(1, stop_token_ids=(t,), vocab_size=CONFIG.vocab_size) for t in third])
  for proposer, pparams in ((None, None), (NgramProposer(k=3), {})):
    kw = dict(proposer=proposer, proposer_params=pparams, adaptive_k=False) if proposer is not None else {}
    res = generate(params, CONFIG, prompts, max_new_tokens=24, stop_ids=STOPS, controls=c, **kw)
    for got, want in zip(res.token_ids, free.token_ids):
      cut = want.index(got[-1]) + 1 if got else 0
      assert got == want[:cut] and len(got) <= 3
    assert all(f == "stop" for f in res.finish_reasons)
  # ignore_eos: a model stop token is generated and decoding goes on to the limit
  stop_row = Controls.make(1, logit_bias={str(STOPS[0]): 100.0}, vocab_size=CONFIG.vocab_size)
  res = generate(params, CONFIG, prompts[:1], max_new_tokens=6, stop_ids=STOPS, controls=stop_row)
  assert res.token_ids[0] == [STOPS[0]] and res.finish_reasons[0] == "stop"
  keep = Controls.make(1, logit_bias={str(STOPS[0]): 100.0}, ignore_eos=True, vocab_size=CONFIG.vocab_size)
  res = generate(params, CONFIG, prompts[:1], max_new_tokens=6, stop_ids=STOPS, controls=keep)
  assert res.token_ids[0] == [STOPS[0]] * 6 and res.finish_reasons[0] == "length"
  # min_tokens holds the stop token back for that many tokens, then it ends the row
  late = Controls.make(1, logit_bias={str(STOPS[0]): 100.0}, min_tokens=4, vocab_size=CONFIG.vocab_size)
  res = generate(params, CONFIG, prompts[:1], max_new_tokens=10, stop_ids=STOPS, controls=late)
  assert len(res.token_ids[0]) == 5 and res.token_ids[0][-1] == STOPS[0] and STOPS[0] not in res.token_ids[0][:4]


def test_sampled_with_penalties_bias_and_min_p_keeps_the_distribution():
  """With penalties, a logit bias and min_p together on a vocabulary small enough to fill every cell: a sampling
  draft model (verification with its q) by chi-square on the first 3 sampled tokens against plain sampling; n-gram
  (deterministic drafts) by token identity with plain sampling (tests/distribution.py)."""
  from spec_jax.config import SamplingParams
  from spec_jax.models.transformer import init_params
  from spec_jax.proposers.draft import DraftModelProposer
  from tests.conftest import tiny_gemma_config
  from tests.distribution import PROMPT, assert_commits_plain_tokens, assert_same_distribution
  from tests.distribution import sample_plain_and_speculative
  import jax
  config = tiny_gemma_config(vocab_size=8, eos_ids=(99,))
  params = init_params(config, jax.random.PRNGKey(3))
  dcfg = config.replace(num_layers=1)
  n = 500
  c = Controls.stack([Controls.make(1, presence=0.7, frequency=0.5, repetition=1.4, min_p=0.08,
                                    logit_bias={"3": 1.5}, vocab_size=8)] * n)
  samp = SamplingParams.make(n, temperature=1.0)
  draft = DraftModelProposer(config=dcfg, k=2)
  plain, specd, rates = sample_plain_and_speculative(params, config, draft, init_params(dcfg, jax.random.PRNGKey(4)),
                                                     n=n, calls=6, sampling=samp, controls=c)
  assert np.mean(rates) > 0.02  # some drafts accepted: both paths of verification run
  assert_same_distribution(plain, specd)
  rate, _ = assert_commits_plain_tokens(params, config, NgramProposer(k=2), {}, n=n, sampling=samp, controls=c)
  assert rate > 0.02
  # and the controls do change this distribution (else the check above would not be about them)
  free = np.array(sum((generate(params, config, [PROMPT] * n, max_new_tokens=3, sampling=samp, seed=100 + i).token_ids
                       for i in range(2)), []))
  assert abs(np.mean(free[:, 1] == free[:, 0]) - np.mean(plain[:, 1] == plain[:, 0])) > 0.05
