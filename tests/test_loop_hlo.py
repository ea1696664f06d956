"""What the compiled decode loop must not hold: a float32 copy of the bfloat16 embedding table, or a copy of the
KV cache per step (the adaptive loop's switch between draft lengths, test at the end).

XLA:CPU gathers bfloat16 rows by converting the whole table to float32; in a loop that convert is loop-invariant
and was hoisted out, so each loop call wrote the table in float32 (670 MB for Gemma 3 270M). Checked on a tiny
model in the CPU layout (bfloat16 table, float32 layers), for plain decoding and fixed- and adaptive-k EAGLE,
whose drafting chain gathers embeddings too. A vocabulary of 331 makes the table's shape unmistakable.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from spec_jax import slots
from spec_jax.decode import decode_loop, make_spec
from spec_jax.models.transformer import init_params
from spec_jax.proposers import eagle
from spec_jax.proposers.base import NoneProposer
from spec_jax.proposers.ngram import NgramProposer
from tests.conftest import tiny_gemma_config

CONFIG = tiny_gemma_config(vocab_size=331)


def _cpu_layout_params():
  p = init_params(CONFIG, jax.random.PRNGKey(0), jnp.float32)
  return dict(p, embed=p["embed"].astype(jnp.bfloat16))


def _table_buffers(hlo: str) -> list:
  shape = rf"\[{CONFIG.vocab_size},{CONFIG.d_model}\]"
  return [l.strip() for l in hlo.splitlines()
          if re.search(r"= f32" + shape, l) and re.search(r"\b(fusion|copy)\(", l)]


def _proposer(method, params):
  """(proposer, its params): none, ngram, or a random EAGLE head of width 48, all drafting k = 4."""
  if method == "none":
    return NoneProposer(), {}
  if method == "ngram":
    return NgramProposer(k=4), {}
  ecfg = eagle.layer_config(CONFIG, 48)
  w = eagle.init_params(jax.random.PRNGKey(1), ecfg, target_params=params)
  return eagle.EagleProposer(config=ecfg, vocab_size=CONFIG.vocab_size, k=4), eagle.runtime_params(w, params)


@pytest.mark.parametrize("method,adaptive", [("none", False), ("eagle", False), ("eagle", True)])
def test_no_float32_copy_of_the_embedding_in_the_loop(method, adaptive):
  params = _cpu_layout_params()
  proposer, pp = _proposer(method, params)
  spec = make_spec(CONFIG, proposer, adaptive_k=adaptive)
  full = {"target": params, "proposer": pp}
  state = slots.empty_state(full, spec, batch=2, capacity=64)
  hlo = decode_loop.lower(full, state, spec, np.int32(8)).compile().as_text()
  assert _table_buffers(hlo) == []


def _copies_of(hlo: str, shape: tuple) -> list:
  dims = ",".join(str(d) for d in shape)
  return [l.strip() for l in hlo.splitlines() if re.search(rf"= \w+\[{dims}\]\S* copy\(", l)]


@pytest.mark.parametrize("method,kv", [("ngram", "auto"), ("eagle", "auto"), ("eagle", "int8")])
def test_the_adaptive_loop_updates_the_kv_cache_in_place(method, kv):
  """The adaptive loop picks each step's k with switch_in_place; a lax.switch there made XLA:CPU copy the whole
  target cache (K and V) in every branch of every step, ~20 % of a plain step on Gemma 3 270M. An 8-bit cache:
  no copy of its pools or scales either, and no dequantized (float32) copy of a whole pool."""
  params = _cpu_layout_params()
  proposer, pp = _proposer(method, params)
  spec = make_spec(CONFIG, proposer, adaptive_k=True, kv_cache_dtype=kv)
  assert len(spec.ks) == 3
  full = {"target": params, "proposer": pp}
  state = slots.empty_state(full, spec, batch=2, capacity=64)
  hlo = decode_loop.lower(full, state, spec, np.int32(8)).compile().as_text()
  assert _copies_of(hlo, state.cache.k.shape) == []
  assert _copies_of(hlo, state.cache.v.shape) == []
  if kv != "auto":
    assert _copies_of(hlo, state.cache.k_scale.shape) == []
    for shape in (state.cache.k.shape, state.cache.k.shape[1:]):  # no dequantized pool, nor one layer's
      dims = ",".join(str(d) for d in shape)
      assert not [l for l in hlo.splitlines() if re.search(rf"= f32\[{dims}\]", l)]
