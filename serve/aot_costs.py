"""The verify-cost table from the compiler: `python -m serve.aot --cost_table=PATH` (see serve/aot.py).

One loop step drafting k tokens, compiled for the target chip at each batch size with the layer scan unrolled (XLA's
cost analysis counts a loop's body once: a scanned model's estimate holds one layer); its `optimal_seconds` over
that of a plain step is the cost the adaptive controller reads (configs/costs/, serve.calibrate's format),
labelled as an estimate, not a measurement.
"""

from __future__ import annotations

import time

import jax.numpy as jnp

from serve import aot_compile


def cost_table(flags_cfg: dict, log=print, on_update=None) -> dict:
  """The compiler's estimate of one loop step drafting k tokens (k in cost_ks, a chain of n-gram drafts: the
  target's verify, nearly nothing else) and of each tree size (EAGLE-2 trees, its head's drafting included), at
  each batch size, with the cache read to the capacity. Written in the adaptive controller's format (serve.calibrate:
  per k_max, costs over a plain step, the same at every occupancy since all rows compute), labelled as an estimate,
  with the seconds behind it."""
  from serve import aot_programs as progs
  from spec_jax.models.shapes import model_shape
  from spec_jax.models.transformer import layers_unrolled
  tgt = aot_compile.target(flags_cfg["topology"])
  mesh = aot_compile.mesh_of(list(tgt.devices), flags_cfg["mesh"])
  place = progs.Placement(tgt.devices[0], mesh)
  config = model_shape(flags_cfg["model_shape"])
  dtype = jnp.dtype(flags_cfg["dtype"])
  S = int(flags_cfg["max_model_len"])
  impl = flags_cfg["attention_impl"] or tgt.attention_impl
  chain_ks = sorted({0, *(int(k) for k in flags_cfg["cost_ks"])})
  kinds = [("ngram", k, 1, 0) for k in chain_ks]
  kinds += [(flags_cfg["cost_tree_method"], flags_cfg["cost_tree_depth"], flags_cfg["eagle_topk"], n)
            for n in flags_cfg["cost_trees"]]
  seconds, failures = {}, []
  for b in flags_cfg["cost_batches"]:
    row = {}
    for method, k, topk, nodes in kinds:
      with layers_unrolled():  # XLA's cost analysis counts a loop body once: the layer scan's too
        prog = progs.step_program(config, place, method=method, k=k, topk=topk, nodes=nodes, batch=int(b),
                                  max_model_len=S, dtype=dtype, impl=impl)
        rec = aot_compile.compile_program(prog, tgt.devices[0], tgt.capacity_bytes)
      if not aot_compile.ok(rec) or not rec["optimal_seconds"] or rec["optimal_seconds"] <= 0:
        failures.append({"program": prog.name, **{k: rec.get(k) for k in ("error", "cache_copies", "fits",
                                                                             "optimal_seconds")}})
        log(f"batch {b} {prog.name}: no estimate ({rec.get('error') or rec.get('cache_copies')})")
        continue
      key = str(k) if not nodes else f"{method}_tree{nodes}"
      row[key] = rec["optimal_seconds"]
      seconds[str(b)] = row
      if on_update is not None:  # the table so far: a long run that is stopped keeps what it compiled
        on_update(_assemble(flags_cfg, tgt, chain_ks, seconds, failures))
      log(f"batch {b} {key}: {rec['optimal_seconds'] * 1e3:.3f} ms ({rec['compile_seconds']} s to compile)")
    seconds[str(b)] = row
  return _assemble(flags_cfg, tgt, chain_ks, seconds, failures)


def _assemble(flags_cfg, tgt, chain_ks, seconds, failures) -> dict:
  from serve.step_costs import entry_key
  from spec_jax import adaptive
  out = {"source": f"compiler estimate: XLA:{tgt.platform.upper()} optimal_seconds of one loop step, its layers "
                   "unrolled (python -m serve.aot --cost_table), not a measurement",
         "topology": flags_cfg["topology"], "chip": tgt.chip, "mesh": flags_cfg["mesh"] or "one chip",
         "model_shape": flags_cfg["model_shape"], "context_tokens": int(flags_cfg["max_model_len"]), "dtype": flags_cfg["dtype"],
         "compiler": aot_compile.compiler_version(tgt.platform), "date": time.strftime("%Y-%m-%d"), "seconds": seconds,
         "failures": failures}
  for b, row in seconds.items():
    for k_max in range(2, max(chain_ks) + 1, 2):
      ks = adaptive.option_set(k_max, True)
      if any(str(k) not in row for k in ks):
        continue
      costs = [round(row[str(k)] / row["0"], 4) for k in ks]
      out[entry_key("ngram", flags_cfg["dtype"], k_max, int(b))] = {
          "ks": list(ks), "batch": int(b), "occupancies": sorted({1, int(b)}), "costs": [costs] * len({1, int(b)}),
          "estimate": "compiler"}
    for n in flags_cfg["cost_trees"]:
      if f"{flags_cfg['cost_tree_method']}_tree{n}" not in row or "0" not in row:
        continue
      depth = flags_cfg["cost_tree_depth"]
      costs = [1.0, round(row[f"{flags_cfg['cost_tree_method']}_tree{n}"] / row["0"], 4)]
      out[entry_key(f"{flags_cfg['cost_tree_method']}_tree{n}", flags_cfg["dtype"], depth, int(b))] = {
          "ks": [0, depth], "batch": int(b), "occupancies": sorted({1, int(b)}), "costs": [costs] * len({1, int(b)}),
          "estimate": "compiler"}
  return out


def plot_costs(table: dict, path: str) -> None:
  """Verify cost over a plain step against batch, one line per draft length and tree: where batching eats the
  gain (a line at ratio r needs more than r tokens per step from its drafts to pay)."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  batches = sorted(int(b) for b in table["seconds"])
  keys = sorted({k for row in table["seconds"].values() for k in row if k != "0"},
                key=lambda k: (not k.isdigit(), int(k) if k.isdigit() else k))
  fig, ax = plt.subplots(figsize=(7, 4.5))
  for key in keys:
    rows = [(b, table["seconds"][str(b)]) for b in batches]
    pts = [(b, r[key] / r["0"]) for b, r in rows if key in r and "0" in r]
    ax.plot([b for b, _ in pts], [x for _, x in pts], marker="o", label=f"k = {key}" if key.isdigit() else key.replace("_", " "))
  ax.set_xscale("log", base=2)
  ax.set_xticks(batches, [str(b) for b in batches])
  ax.set_xlabel("batch (busy slots)")
  ax.set_ylabel("step cost over a plain step")
  ax.set_title(f"{table['model_shape']} on {table['topology']} ({table['mesh']}), {table['context_tokens']} tokens: "
               "compiler estimate", fontsize=9)
  ax.grid(True, alpha=0.3)
  ax.legend(fontsize=7, ncol=2)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
