"""The verify-cost table from the compiler: `python -m serve.aot --cost_table=PATH` (see serve/aot.py).

One loop step drafting k tokens, compiled for the target chip at each batch size with the layer scan unrolled (XLA's
cost analysis counts a loop's body once: a scanned model's estimate holds one layer); its `optimal_seconds` over
that of a plain step is the cost the adaptive controller reads (configs/costs/, serve.calibrate's format),
labelled as an estimate, not a measurement.
"""

from __future__ import annotations

import contextlib
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

from serve.compiler import aot_compile, aot_programs as progs
from serve.compiler.aot_breakdown import ROLES, chip_figures
from serve.jobs.step_costs import entry_key
from spec_jax import adaptive
from spec_jax.models.shapes import model_shape
from spec_jax.models.transformer import layers_unrolled

# The chains every cost table holds, one per k and keyed by k alone: the adaptive controller's cost files
# (serve/jobs/step_costs.py) read n-gram's as the step cost of drafting k tokens.
BASE_CHAIN = "ngram"


def cost_table(flags_cfg: dict, log=print, on_update=None) -> dict:
  """The compiler's estimate of one loop step drafting k tokens (k in cost_ks, a chain of n-gram drafts: the
  target's verify, nearly nothing else) and of each tree size (EAGLE-2 trees, its head's drafting included), at
  each batch size, with the cache read to the capacity. Written in the adaptive controller's format (serve.calibrate:
  per k_max, costs over a plain step, the same at every occupancy since all rows compute), labelled as an estimate,
  with the seconds behind it."""
  tgt = aot_compile.target(flags_cfg["topology"])
  mesh = aot_compile.mesh_of(list(tgt.devices), flags_cfg["mesh"])
  place = progs.Placement(tgt.devices[0], mesh)
  config = model_shape(flags_cfg["model_shape"])
  dtype = jnp.dtype(flags_cfg["dtype"])
  S = int(flags_cfg["max_model_len"])
  impl = flags_cfg["attention_impl"] or tgt.attention_impl
  chain_ks = sorted({0, *(int(k) for k in flags_cfg["cost_ks"])})
  kinds = [(BASE_CHAIN, k, 1, 0) for k in chain_ks]
  kinds += [(m, max(chain_ks), 1, 0) for m in flags_cfg.get("cost_chains", ()) if m != BASE_CHAIN and max(chain_ks)]
  kinds += [(m, flags_cfg["cost_tree_depth"], flags_cfg["eagle_topk"], n)
            for m in tree_methods(flags_cfg) for n in flags_cfg["cost_trees"]]
  seconds, failures, parts = {}, [], {}
  for b in flags_cfg["cost_batches"]:
    row = {}
    for method, k, topk, nodes in kinds:
      # XLA's cost analysis counts a loop body once: the layer scan's too, so the TPU estimate unrolls it. XLA:GPU
      # compiles an unrolled stack unlike the served scan (a one-row product's weight converted to float32 whole,
      # before slicing): its step is the served program, the scan counted once per layer (aot_breakdown trips).
      with layers_unrolled() if tgt.platform != "gpu" else contextlib.nullcontext():
        prog = progs.step_program(config, place, method=method, k=k, topk=topk, nodes=nodes, batch=int(b),
                                  max_model_len=S, dtype=dtype, impl=impl,
                                  kv_cache_dtype=flags_cfg.get("kv_cache_dtype") or "auto")
        hlo = flags_cfg.get("cost_hlo_dir") or ""
        if hlo:
          os.makedirs(hlo, exist_ok=True)
          hlo = os.path.join(hlo, f"b{b}_{_key(method, k, nodes)}.hlo.txt")
        rec = aot_compile.compile_program(prog, tgt.devices[0], tgt.capacity_bytes, breakdown=True, hlo_path=hlo)
      gpu = tgt.platform == "gpu"  # deviceless XLA:GPU gives no optimal_seconds: the breakdown's roofline stands in
      if gpu and rec.get("breakdown") and aot_compile.ok(rec):
        rec["optimal_seconds"] = rec["breakdown"]["roofline_seconds"]
      if not aot_compile.ok(rec) or not rec["optimal_seconds"] or rec["optimal_seconds"] <= 0:
        failures.append({"program": prog.name, **{k: rec.get(k) for k in ("error", "cache_copies", "fits",
                                                                             "optimal_seconds")}})
        log(f"batch {b} {prog.name}: no estimate ({rec.get('error') or rec.get('cache_copies')})")
        continue
      key = _key(method, k, nodes)
      row[key] = rec["optimal_seconds"]
      seconds[str(b)] = row
      parts.setdefault(str(b), {})[key] = dict(
          rec["breakdown"], floor=floor(prog, tgt.chip, passes=k),
          optimal_seconds=rec["optimal_seconds"], bytes_accessed=rec["bytes_accessed"], flops=rec["flops"])
      if on_update is not None:  # the table so far: a long run that is stopped keeps what it compiled
        on_update(_assemble(flags_cfg, tgt, chain_ks, seconds, failures, parts))
      log(f"batch {b} {key}: {rec['optimal_seconds'] * 1e3:.3f} ms ({rec['compile_seconds']} s to compile)")
    seconds[str(b)] = row
  return _assemble(flags_cfg, tgt, chain_ks, seconds, failures, parts)


def tree_methods(flags_cfg: dict) -> list:
  """--cost_tree_method: one tree proposer or several, comma-separated (eagle,medusa)."""
  return [m for m in str(flags_cfg["cost_tree_method"]).split(",") if m]


def _key(method: str, k: int, nodes: int) -> str:
  """A program's column: k for n-gram chains (the controller's cost files), method_k<k> for other chains,
  method_tree<nodes> for trees."""
  if nodes:
    return f"{method}_tree{nodes}"
  return str(k) if method == BASE_CHAIN or not k else f"{method}_k{k}"


def _tree_bytes(tree, chip_shape) -> float:
  return float(sum(np.prod(chip_shape(x)) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree)))


def floor(prog, chip_kind: str, passes: int = 0) -> dict:
  """A step's first-principles floor on one chip: the bytes it must read (the target's weights once, its KV cache
  at capacity, a drafter's weights once per drafting pass: `passes`) over the chip's bandwidth, its FLOPs (2 per
  weight per scored position) over the peak; the larger. Per chip: each array's shard. An embedding table that is
  not also the LM head is only gathered from (a few rows), so it is not among the bytes that must be read."""
  params, state = prog.args[0], prog.args[1]
  chip_shape = lambda a: (a.sharding.shard_shape(a.shape) if getattr(a, "sharding", None) is not None
                          and hasattr(a.sharding, "shard_shape") else a.shape)
  gathered = lambda p: {k: v for k, v in p.items() if not (k == "embed" and ("lm_head" in p or "rows" in p))}
  target = _tree_bytes(gathered(params["target"]), chip_shape)
  drafter = _tree_bytes(gathered(params["proposer"]), chip_shape) if params["proposer"] else 0.0
  passes = passes if drafter else 0  # a proposer without weights (n-gram, suffix) reads none per pass
  cache = _tree_bytes((state.cache.k, state.cache.v), chip_shape)
  B = state.tokens.shape[0]
  spec = prog.args[2]
  positions = B * (1 + (spec.proposer.tree.nodes - 1 if spec.is_tree(spec.ks[0]) else spec.ks[0]))
  fig = chip_figures(chip_kind)
  nbytes = target + cache + drafter * passes
  flops = 2 * (target / 2) * positions + 2 * (drafter / 2) * B * max(passes, 0)  # bfloat16: 2 bytes a weight
  seconds = max(nbytes / fig["bandwidth"], flops / fig["peak"])
  return dict(bytes=nbytes, flops=flops, seconds=seconds, target_bytes=target, cache_bytes=cache,
              drafter_bytes=drafter, drafter_passes=passes, positions=int(positions))


def _assemble(flags_cfg, tgt, chain_ks, seconds, failures, parts=None) -> dict:
  out = {"source": (f"compiler estimate: XLA:TPU optimal_seconds of one loop step, its layers unrolled (python -m "
                    "serve.aot --cost_table), not a measurement" if tgt.platform == "tpu" else
                    f"compiler estimate: XLA:{tgt.platform.upper()}'s bytes and FLOPs of one loop step of the served "
                    "program, its layer scan counted once per layer (python -m serve.aot --cost_table), not a time"),
         "topology": flags_cfg["topology"], "chip": tgt.chip, "mesh": flags_cfg["mesh"] or "one chip",
         "model_shape": flags_cfg["model_shape"], "context_tokens": int(flags_cfg["max_model_len"]), "dtype": flags_cfg["dtype"],
         "compiler": aot_compile.compiler_version(tgt.platform), "date": time.strftime("%Y-%m-%d"), "seconds": seconds,
         "failures": failures, "breakdown": parts or {},
         "time_source": ("XLA:TPU optimal_seconds" if tgt.platform == "tpu" else
                         "no optimal_seconds from deviceless XLA:GPU: the roofline of each instruction's bytes and "
                         "FLOPs at the chip's published bandwidth and peak")}
  for b, row in seconds.items():
    for k_max in range(2, max(chain_ks) + 1, 2):
      ks = adaptive.option_set(k_max, True)
      if any(str(k) not in row for k in ks):
        continue
      costs = [round(row[str(k)] / row["0"], 4) for k in ks]
      out[entry_key(BASE_CHAIN, flags_cfg["dtype"], k_max, int(b))] = {
          "ks": list(ks), "batch": int(b), "occupancies": sorted({1, int(b)}), "costs": [costs] * len({1, int(b)}),
          "estimate": "compiler"}
    for tree in (f"{m}_tree{n}" for m in tree_methods(flags_cfg) for n in flags_cfg["cost_trees"]):
      if tree not in row or "0" not in row:
        continue
      depth = flags_cfg["cost_tree_depth"]
      costs = [1.0, round(row[tree] / row["0"], 4)]
      out[entry_key(tree, flags_cfg["dtype"], depth, int(b))] = {
          "ks": [0, depth], "batch": int(b), "occupancies": sorted({1, int(b)}), "costs": [costs] * len({1, int(b)}),
          "estimate": "compiler"}
  return out


def plot_costs(table: dict, path: str) -> None:
  """Verify cost over a plain step against batch, one line per draft length and tree: where batching eats the
  gain (a line at ratio r needs more than r tokens per step from its drafts to pay)."""
  import matplotlib  # lazy: heavy, only this path (matplotlib)
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # lazy: heavy, only this path (matplotlib)
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


def breakdown_md(table: dict) -> str:
  """The breakdown as markdown: per batch, per program its time against its floor, then per role ms and MB."""
  lines = [f"# Where each step's time goes: {table['model_shape']} on {table['topology']} ({table['mesh']}), "
           f"{table['context_tokens']} tokens", "",
           f"{table['source']}; {table['compiler']}; {table['date']}. Time: {table.get('time_source', '')}. "
           "Per role: the share of the step's time (its instructions' rooflines, scaled to the compiler's total) "
           "and the HBM bytes its instructions move (serve/compiler/aot_breakdown.py). Floor: the bytes the step must read "
           "(weights once, the KV cache at capacity, a drafter's weights once per pass) over the bandwidth, or "
           "its FLOPs over the peak.", ""]
  for b, programs in sorted(table.get("breakdown", {}).items(), key=lambda x: int(x[0])):
    plain = table["seconds"].get(b, {}).get("0")
    lines += [f"## batch {b}", "", "| program | ms | over plain | per loop call ms | in costlier branches ms | "
              "floor ms | over floor | GB moved | " + " | ".join(r for r in ROLES) + " | largest instructions |",
              "|---|" + "---|" * (len(ROLES) + 7)]
    for key, d in programs.items():
      ms = d["optimal_seconds"] * 1e3
      cells = []
      for r in ROLES:
        x = d["roles"][r]
        cells.append(f"{x['seconds'] * 1e3:.3f} / {x['bytes'] / 1e6:.0f}" if x["count"] else "")
      top = sorted((t for x in d["roles"].values() for t in x["top"]), key=lambda t: -t["seconds"])[:3]
      tops = "; ".join(f"`{t['name']}` {t['seconds'] * 1e3:.3f} ms {t['shape']}" for t in top)
      lines.append(f"| {'plain' if key == '0' else ('ngram k=' + key if key.isdigit() else key)} | {ms:.3f} | "
                   f"{ms / (plain * 1e3):.2f}x | "
                   + (f"{d['per_call_seconds'] * 1e3:.3f}" if "per_call_seconds" in d else "n/a") + " | "
                   + (_branch_cell(d["branches"]) if "branches" in d else "n/a") + " | "
                   f"{d['floor']['seconds'] * 1e3:.3f} | "
                   f"{d['optimal_seconds'] / d['floor']['seconds']:.2f}x | {d['bytes'] / 1e9:.2f} | "
                   + " | ".join(cells) + f" | {tops} |")
    lines += ["", "Role cells: ms / MB. Per loop call: the part of the estimate outside the decode loop (loop-invariant "
              "work XLA hoists, such as a weight re-laid out for the loop: paid once per loop call, which runs many "
              "steps when serving, but charged in full to this one-step program). In costlier branches: what XLA "
              "charges conditionals beyond their cheapest branch (the controls, logprobs and grammar masks, the "
              "sampler's filters), which a step whose rows ask for none of them skips at run time; the largest "
              "conditional named.", ""]
  return "\n".join(lines) + "\n"


def _branch_cell(branches: dict) -> str:
  """ms charged beyond the cheapest branches, and the costliest conditional: its HLO name and its work's role."""
  top = branches["top"][0] if branches["top"] else None
  return f"{branches['seconds'] * 1e3:.3f}" + (f" (`{top['name']}`, {top['role']})" if top and top["seconds"] > 0
                                              else "")


def plot_breakdown(table: dict, path: str) -> None:
  """Stacked bars: each program's step time by role, per batch, with its floor marked."""
  import matplotlib  # lazy: heavy, only this path (matplotlib)
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # lazy: heavy, only this path (matplotlib)
  bars = [(b, key, d) for b, programs in sorted(table.get("breakdown", {}).items(), key=lambda x: int(x[0]))
          for key, d in programs.items()]
  if not bars:
    return
  fig, ax = plt.subplots(figsize=(max(6, 0.7 * len(bars) + 3), 5))
  bottoms = [0.0] * len(bars)
  colors = plt.get_cmap("tab20").colors
  for i, role in enumerate(ROLES):
    vals = [d["roles"][role]["seconds"] * 1e3 for _, _, d in bars]
    if any(vals):
      ax.bar(range(len(bars)), vals, bottom=bottoms, label=role, color=colors[i % len(colors)])
      bottoms = [a + v for a, v in zip(bottoms, vals)]
  ax.scatter(range(len(bars)), [d["floor"]["seconds"] * 1e3 for _, _, d in bars], marker="_", s=400, color="k",
             label="floor", zorder=3)
  ax.set_xticks(range(len(bars)), [f"b{b} {'plain' if k == '0' else k}" for b, k, _ in bars], rotation=45,
                ha="right", fontsize=7)
  ax.set_ylabel("ms per step")
  ax.set_title(f"{table['model_shape']} on {table['topology']} ({table['mesh']}): step time by role", fontsize=9)
  ax.legend(fontsize=6, ncol=2)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
