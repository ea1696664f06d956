"""The attention projections placed heads-major (spec_jax/layouts.py, issue 48): the layout reaches the compiled
decode loop, it changes no token, and on CPU nothing is re-laid out (the CPU path is untouched).

XLA:TPU is where the layout matters (without it a verify re-lays out the Q weight once per loop call; the aot
guard, tests/aot/test_cost_guard.py, checks that no weight is copied there); XLA:CPU honours the same layouts, so
the placement is checked here by asking for it on CPU.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from spec_jax import layouts, sharding
from spec_jax.batch import generate
from spec_jax.decode import decode_loop, make_spec
from spec_jax.models.transformer import init_params
from spec_jax.proposers import eagle
from spec_jax import slots
from tests.conftest import tiny_llama_config

CONFIG = tiny_llama_config()  # 4 query heads, 2 KV heads: heads-major differs from row-major for Q, K and V


def _both():
  params = init_params(CONFIG, jax.random.PRNGKey(0), jnp.float32)
  ecfg = eagle.layer_config(CONFIG)
  w = eagle.init_params(jax.random.PRNGKey(1), ecfg, target_params=params)
  return eagle.EagleProposer(config=ecfg, vocab_size=CONFIG.vocab_size, k=3), \
      {"target": params, "proposer": eagle.runtime_params(w, params)}


def _orders(tree):
  return {sharding._path_str(p): x.format.layout.major_to_minor
          for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]}


def test_heads_major_on_cpu_when_asked_same_tokens():
  """~15 s. The target's and the EAGLE head's Q/K/V leave heads-major (and nothing else moves); the decode loop
  compiles for that layout; greedy EAGLE decoding gives the same tokens as the row-major weights."""
  proposer, both = _both()
  laid = layouts.lay_out(both, platforms=("cpu",))
  orders = _orders(laid)
  assert orders["target.layers.q"] == orders["target.layers.k"] == orders["target.layers.v"] == (0, 2, 1, 3)
  assert orders["proposer.layer.q"] == (1, 0, 2)  # the head's one layer: [D, H, d] unstacked
  assert orders["target.layers.o"] == (0, 1, 2, 3) and orders["target.layers.gate"] == (0, 1, 2)
  spec = make_spec(CONFIG, proposer, adaptive_k=False)
  state = slots.empty_state(laid, spec, batch=2, capacity=64)
  text = decode_loop.lower(laid, state, spec, np.int32(4)).as_text()
  assert text.count('mhlo.layout_mode = "{3,1,2,0}"') >= 3  # the stacked q, k and v arrive heads-major
  prompts = [[2, 5, 9, 11, 5, 9], [2, 7, 7, 3]]
  run = lambda p: generate(p["target"], CONFIG, prompts, max_new_tokens=12, proposer=proposer,
                           proposer_params=p["proposer"], adaptive_k=False)
  got, want = run(laid), run(both)
  assert got.token_ids == want.token_ids and got.stats["drafted_tokens"] > 0


def test_cpu_placement_keeps_the_default_layout():
  """<1 s. shard_params on CPU (one device) re-lays out nothing: the CPU path's programs are the ones before."""
  _, both = _both()
  placed = sharding.shard_params(both, None)
  assert set(_orders(placed).values()) <= {tuple(range(n)) for n in range(1, 5)}
  assert layouts.heads_major("q", 4) == (0, 2, 1, 3) and layouts.heads_major("o", 4) is None
