"""The adaptive controller's step-cost measurement (serve.calibrate.measure_costs) on proposers of known cost.

- A proposer whose drafting costs a known 40 ms per drafted token (a host sleep inside the jitted step, on a tiny
  model whose own step takes a few ms): the measured costs must grow with k as that cost does.
- A clock that makes a drafting step look cheaper than a plain one (what noise does to a cheap proposer): the
  measured cost of k = 2 must never come out below k = 0's.
"""

from __future__ import annotations

import dataclasses
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from serve import calibrate
from spec_jax.decode import make_spec
from spec_jax.models.transformer import init_params
from spec_jax.proposers.ngram import NgramProposer
from tests.conftest import tiny_gemma_config

PER_TOKEN_S = 0.04


def _sleep_then(delay, tokens):
  time.sleep(delay)
  return tokens


@dataclasses.dataclass(frozen=True)
class KnownCostNgram(NgramProposer):
  """Test-only: ngram drafts delivered after sleeping PER_TOKEN_S per drafted token."""
  name: str = "known_cost"

  def propose(self, params, state, ctx, k, key):
    draft, state = super().propose(params, state, ctx, k, key)
    shape = jax.ShapeDtypeStruct(draft.tokens.shape, draft.tokens.dtype)
    toks = jax.experimental.io_callback(functools.partial(_sleep_then, PER_TOKEN_S * k), shape, draft.tokens)
    return draft.replace(tokens=toks), state


@pytest.fixture(scope="module")
def tiny():
  config = tiny_gemma_config()
  return config, init_params(config, jax.random.PRNGKey(0), jnp.float32)


def _prompts(config):
  rng = np.random.default_rng(0)
  return [[config.bos_id] + rng.integers(3, config.vocab_size, 12).tolist() for _ in range(2)]


def test_costs_follow_a_known_drafting_cost(tiny):
  config, params = tiny
  spec = make_spec(config, KnownCostNgram(k=4), adaptive_k=True)
  assert spec.ks == (0, 2, 4)
  full = {"target": params, "proposer": {}}
  entry = calibrate.measure_costs(full, spec, _prompts(config), batch=2, occupancies=[2], reps=3)
  c0, c2, c4 = entry["costs"][0]
  assert c0 == 1.0
  # A k = 2 step pays 80 ms of drafting over a plain step of a few ms: its cost is far above 1, and a k = 4
  # step's extra cost is twice a k = 2 step's.
  assert c2 > 5.0
  assert (c4 - 1.0) / (c2 - 1.0) == pytest.approx(2.0, rel=0.25)


def test_a_drafting_step_never_measures_cheaper_than_a_plain_one(tiny):
  config, params = tiny
  spec = make_spec(config, NgramProposer(k=4), adaptive_k=True)
  full = {"target": params, "proposer": {}}
  # A clock under which every k = 0 step takes 10 ms, a k = 2 step 6 ms and a k = 4 step 12 ms: the round robin
  # times options in the order of spec.ks, two clock reads per timed step.
  durations = {0: 0.010, 2: 0.006, 4: 0.012}
  clock = {"t": 0.0, "reads": 0}

  def fake_clock():
    # Reads come in (start, stop) pairs for options 0, 2, 4, 0, 2, 4, ...
    pair, second = divmod(clock["reads"], 2)
    clock["reads"] += 1
    if second:
      clock["t"] += durations[spec.ks[pair % len(spec.ks)]]
    return clock["t"]

  entry = calibrate.measure_costs(full, spec, _prompts(config), batch=2, occupancies=[2], reps=3,
                                  clock=fake_clock)
  c0, c2, c4 = entry["costs"][0]
  assert (c0, c2) == (1.0, 1.0)
  assert c4 == pytest.approx(1.2)
