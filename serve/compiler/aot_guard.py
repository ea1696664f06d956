"""The cost-regression guard's measurement (tests/aot/test_cost_guard.py): small shapes that compile in well
under a minute each for one v5e, and the ratios that the committed table (configs/costs/guard_v5e_small.json)
holds: an n-gram k = 4 step and an EAGLE tree step over a plain step, and a plain step over its floor; and the
weights any of them re-lays out on every call (none: spec_jax/layouts.py places the attention projections in the
order the verify reads them)."""

from __future__ import annotations

import os

# First: the compilers' environment (serve/compiler/aot_compile.py) before JAX loads them.
from serve.compiler import aot_compile  # noqa: I001

import jax.numpy as jnp

from serve.compiler import aot_costs, aot_programs as progs
from spec_jax.config import ModelConfig
from spec_jax.models.transformer import layers_unrolled

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TABLE = os.path.join(ROOT, "configs", "costs", "guard_v5e_small.json")
TOPOLOGY = "v5e:2x2"
SHAPE = dict(vocab_size=32768, d_model=256, num_layers=2, num_heads=4, num_kv_heads=1, head_dim=128, mlp_dim=512,
             sliding_window=128, global_every=2, query_pre_attn_scalar=128.0, max_seq_len=1024, bos_id=2,
             eos_ids=(1,), pad_id=0, name="guard-small")
CONTEXT, BATCH = 512, 1
PROGRAMS = {"plain": ("ngram", 0, 1, 0), "ngram_k4": ("ngram", 4, 1, 0), "eagle_tree8": ("eagle", 2, 4, 8)}


def measure() -> dict:
  """Compile the guard's programs; -> {shape, seconds, ratios, roles (microseconds per role of each program)}."""
  tgt = aot_compile.target(TOPOLOGY)
  place = progs.Placement(tgt.devices[0], None)
  config = ModelConfig(**SHAPE)
  seconds, roles, floors, relayouts = {}, {}, {}, {}
  for name, (method, k, topk, nodes) in PROGRAMS.items():
    with layers_unrolled():
      prog = progs.step_program(config, place, method=method, k=k, topk=topk, nodes=nodes, batch=BATCH,
                                max_model_len=CONTEXT, dtype=jnp.bfloat16, impl=tgt.attention_impl)
      rec = aot_compile.compile_program(prog, tgt.devices[0], tgt.capacity_bytes, breakdown=True)
    if not aot_compile.ok(rec) or not rec["optimal_seconds"]:
      raise RuntimeError(f"{prog.name}: no estimate: {rec.get('error') or rec.get('cost_source')}")
    seconds[name] = rec["optimal_seconds"]
    floors[name] = aot_costs.floor(prog, tgt.chip, passes=k)["seconds"]
    roles[name] = {r: round(d["seconds"] * 1e6, 2) for r, d in rec["breakdown"]["roles"].items() if d["count"]}
    relayouts[name] = rec["breakdown"]["weight_relayouts"]
  ratios = {"ngram_k4/plain": seconds["ngram_k4"] / seconds["plain"],
            "eagle_tree8/plain": seconds["eagle_tree8"] / seconds["plain"],
            "plain/floor": seconds["plain"] / floors["plain"]}
  return dict(shape=dict(SHAPE, eos_ids=list(SHAPE["eos_ids"]), topology=TOPOLOGY, context=CONTEXT, batch=BATCH,
                         programs={k: list(v) for k, v in PROGRAMS.items()}),
              compiler=aot_compile.compiler_version("tpu"),
              seconds={k: round(v, 9) for k, v in seconds.items()}, ratios={k: round(v, 4) for k, v in ratios.items()},
              roles=roles, weight_relayouts=relayouts)
