"""The cost table's figures from two small layer counts (`serve.aot --cost_table --cost_layers=A,B`).

A cost program compiles with the target's layers unrolled (aot_costs), so a Llama-3 8B step compiles 32 copies of
one layer: 5-25 minutes a program on a small host. Every target layer is the same program on the same shapes, so
each figure of the step (optimal_seconds, bytes, FLOPs, each role of the breakdown) is c(n) = c0 + n * c1 in the
layer count n: compiled at n = A and n = B (A < B, the rest of the program the same), c(L) = c_A + (c_B - c_A)
(L - A) / (B - A). What is not a target layer (the drafter's layers and heads, the LM head, sampling) is in c0.
Lists (the largest instructions, the weight re-layouts) are the B-layer compile's, labelled so; the floor is the
full model's (aot_costs.floor on the full program), not extrapolated.

Only as good as that line, and XLA:TPU's estimate is not always on one: a layer's estimated cycles depend on the
whole program's VMEM prefetch plan, which depends on the array sizes. Llama-3 8B on v5e-8 `model:8`, batch 1
(BENCHMARKS.md, issue 48): the plain step from 8 and 10 layers gives 2.991 ms (the full compile 2.991, every role
within 0.01 %); from 3 and 5 layers 4.56 (XLA prefetches whole stacked weights, bf16[5,1792,4096] a chip, which
32-layer arrays never allow); an n-gram k = 2 step from 8 and 10 layers 4.95 (whole Q and O weights prefetched at
10 layers); the k = 4 step from 8 and 10 layers, even with weights of the full model's size and their first 8 or
10 layers run, 3.24 against the full 3.61 (its roofline on the line within 0.3 %, XLA's estimate 10 % under).
Check a program against one full compile before trusting its line.
"""

from __future__ import annotations

from spec_jax.config import ModelConfig
from spec_jax.proposers.eagle3_layout import default_feature_layers

# EAGLE-3 fuses three target layers. The default (1, L//2 - 1, L - 4) names three distinct layers in range only
# from L = 7; below that the head reads layers (0, 1, 2). Which layers it reads does not change the step's cost: the
# unrolled target stacks every layer's output and gathers the three.
SMALL_FEATURE_LAYERS = (0, 1, 2)


def counts(values, config: ModelConfig) -> tuple:
  """--cost_layers -> (A, B): two layer counts 1 <= A < B < the model's, or () for the full compile. A model of
  local and global layers (Gemma: every global_every-th global) is the same program per period of that many
  layers, not per layer: B - A and L - A must then be whole periods."""
  values, L = tuple(int(v) for v in values), config.num_layers
  if not values:
    return ()
  if len(values) != 2 or not 1 <= values[0] < values[1] < L:
    raise ValueError(f"--cost_layers takes two layer counts A,B with 1 <= A < B < {L} (the model's), got "
                     f"{list(values)}")
  p = config.global_every if config.sliding_window is not None else 1
  if (values[1] - values[0]) % p or (L - values[0]) % p:
    raise ValueError(f"--cost_layers {list(values)}: {config.name} repeats its layers every {p} (local and global), "
                     f"so B - A and {L} - A must be multiples of {p}")
  return values


def reduced(config: ModelConfig, n: int, fused: bool = True) -> tuple:
  """-> (the config with n layers, EAGLE-3's feature layers for it, or None where the program fuses none)."""
  small = config.replace(num_layers=n)
  if not fused:
    return small, None
  layers = default_feature_layers(small)
  if len(set(layers)) != len(layers) or not all(0 <= l < n for l in layers):
    if n < len(SMALL_FEATURE_LAYERS):
      raise ValueError(f"EAGLE-3 fuses {len(SMALL_FEATURE_LAYERS)} target layers: --cost_layers needs at least "
                       f"{len(SMALL_FEATURE_LAYERS)}, got {n}")
    layers = SMALL_FEATURE_LAYERS
  return small, layers


def _line(a, b, t):
  """A figure at t of the way from the A-layer compile to the B-layer one, linear; what is not a number (or a
  flag) is the B-layer compile's."""
  if isinstance(b, dict) and isinstance(a, dict):
    return {k: _line(a.get(k), v, t) for k, v in b.items()}
  numbers = all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in (a, b))
  if not numbers:
    return b
  value = a + (b - a) * t
  return round(value) if isinstance(a, int) and isinstance(b, int) else value


def extrapolate(rec_a: dict, rec_b: dict, layers: tuple, num_layers: int) -> dict:
  """The compile record of the full model from those at A and B layers (compile_program's records, with their
  breakdowns). A failed compile is returned as it is."""
  for rec in (rec_a, rec_b):
    if not rec.get("compiled") or not rec.get("optimal_seconds"):
      return dict(rec, extrapolated_from_layers=list(layers))
  A, B = layers
  out = _line(rec_a, rec_b, (num_layers - A) / (B - A))
  out["compile_seconds"] = round(rec_a["compile_seconds"] + rec_b["compile_seconds"], 1)
  out["extrapolated_from_layers"] = [A, B]
  out["per_layer_seconds"] = (rec_b["optimal_seconds"] - rec_a["optimal_seconds"]) / (B - A)
  bd = out.get("breakdown")
  if bd and bd["roofline_seconds"]:
    # As a full compile's breakdown: each role's roofline (a sum over instructions: on the line) times the
    # compiler's total over the roofline total (a ratio of two lines, not itself on one).
    bd["scale"] = out["optimal_seconds"] / bd["roofline_seconds"]
    for role in bd["roles"].values():
      role["seconds"] = role["roofline_seconds"] * bd["scale"]
      for t in role["top"]:
        t["seconds"] *= bd["scale"] / rec_b["breakdown"]["scale"]
    bd["top_from_layers"] = B
  return out


def describe(layers: tuple, num_layers: int) -> dict:
  """What the table says about it."""
  A, B = layers
  return {"from_layers": [A, B], "to_layers": num_layers,
          "rule": f"each figure c(L) = c_{A} + (c_{B} - c_{A}) * (L - {A}) / ({B} - {A}), from compiles at {A} and "
                  f"{B} target layers (unrolled, all else the same); largest instructions from the {B}-layer compile; "
                  "floor from the full model; EAGLE-3 reads layers "
                  f"{list(SMALL_FEATURE_LAYERS)} where its default does not fit the count",
          "caveat": "XLA:TPU's estimate is not always linear in the layer count (its prefetch plan depends on the "
                    "array sizes): check each program against one full compile (serve/compiler/aot_layers.py)"}
