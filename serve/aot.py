"""Compile every program spec_jax runs for a TPU topology, on a CPU host with no TPU and no weights.

  pip install -e '.[tpu-aot]'        # libtpu: the real XLA:TPU compiler, Mosaic included
  python -m serve.aot --topology=v5e:2x2 --model_shape=gemma3-270m --output=/tmp/aot_gemma
  python -m serve.aot --topology=v5e:2x4 --model_shape=llama3-8b --mesh=model:8 --max_num_seqs=16 \\
      --max_model_len=4096 --output=/tmp/aot_llama
  python -m serve.aot --topology=v5e:4x4 --model_shape=llama3-8b --mesh=data:4,model:4 --output=/tmp/aot_pod

Per program (serve_programs: the decode loop of every method, chains and trees, slot insert at each prompt
bucket, release, snapshot, the batch start's prefill chunk; train_programs: the trainer's step per head kind),
report.json and report.md give: compiled or the compiler's error; HBM per chip (arguments, outputs,
temporaries) against the chip's capacity, and whether it fits; the compiler's flops, bytes accessed and
optimal_seconds (its roofline time); the Mosaic kernels inside; any host callback (there must be none). The
exit status is non-zero when a program fails to compile or does not fit.

Settings are the accelerator's: bfloat16 layers and caches, the Pallas TPU attention. Abstract parameters
(jax.ShapeDtypeStruct) stand in for weights, so any shape of spec_jax.models.shapes (or a JSON config) compiles,
not only the ones whose weights are here. A multi-host topology (v5e:4x4 is 16 chips on 4 hosts) compiles from
this one process, as the pod evaluation job's programs.
"""

from __future__ import annotations

# First: it sets the compilers' environment (libtpu, XLA's logging) before JAX loads them.
from serve.compiler.aot_compile import compile_program, compiler_version, mesh_of, ok, target  # noqa: I001

import json
import os
import sys
import time

import jax
import jax.numpy as jnp
from absl import flags

from serve.compiler import aot_programs as progs, aot_report
from serve.compiler.aot_costs import breakdown_md, cost_table, plot_breakdown, plot_costs
from serve.compiler.aot_programs import METHODS
from spec_jax.models.shapes import model_shape


def run(flags_cfg: dict, log=print, on_record=None) -> tuple[dict, list]:
  """Compile every program; on_record(run_info, records) after each (the report so far)."""
  tgt = target(flags_cfg["topology"])
  devices, chip, capacity = list(tgt.devices), tgt.chip, tgt.capacity_bytes
  mesh = mesh_of(devices, flags_cfg["mesh"])
  impl = flags_cfg["attention_impl"] or tgt.attention_impl
  place = progs.Placement(devices[0], mesh)
  config = model_shape(flags_cfg["model_shape"])
  draft_config = model_shape(flags_cfg["draft_model_shape"]) if flags_cfg["draft_model_shape"] else None
  dtype = jnp.dtype(flags_cfg["dtype"])
  S = int(flags_cfg["max_model_len"])
  buckets = [int(b) for b in flags_cfg["insert_buckets"]] or [16, 512]
  programs = progs.serving_programs(
      config, place, methods=flags_cfg["methods"], k=flags_cfg["num_speculative_tokens"], topk=flags_cfg["eagle_topk"],
      nodes=flags_cfg["num_draft_tokens"], max_num_seqs=flags_cfg["max_num_seqs"], max_model_len=S, dtype=dtype,
      impl=impl, insert_buckets=[b for b in buckets if b < S], draft_config=draft_config,
      kv_cache_dtype=flags_cfg.get("kv_cache_dtype") or "auto")
  if flags_cfg["train_kinds"]:
    programs += progs.train_programs(config, place, kinds=flags_cfg["train_kinds"], batch=flags_cfg["train_batch"],
                                     seq_len=flags_cfg["train_seq_len"],
                                     target_dtype=jnp.dtype(flags_cfg.get("train_target_dtype", "float32")))
  compiler = compiler_version(tgt.platform)
  run_info = dict(topology=flags_cfg["topology"], chip=chip, chips=len(devices),
                  hosts=len({d.process_index for d in devices}), capacity_bytes=capacity, mesh=flags_cfg["mesh"],
                  model_shape=flags_cfg["model_shape"], max_num_seqs=flags_cfg["max_num_seqs"], max_model_len=S,
                  k=flags_cfg["num_speculative_tokens"], topk=flags_cfg["eagle_topk"], nodes=flags_cfg["num_draft_tokens"],
                  dtype=flags_cfg["dtype"], kv_cache_dtype=flags_cfg.get("kv_cache_dtype") or "auto",
                  attention_impl=impl, platform=tgt.platform, jax=jax.__version__,
                  compiler=compiler, date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                  programs_planned=len(programs))
  records = []
  for prog in programs:
    rec = compile_program(prog, devices[0], capacity)
    records.append(rec)
    log(f"{'ok  ' if ok(rec) else 'FAIL'} {rec['name']}: " + (
        rec.get("error", "")[:300] if not rec["compiled"] else
        f"{rec['memory']['total_bytes'] / 2**30:.2f} GiB, {aot_report.num(rec['optimal_seconds'], 1e3, 3)} ms, "
        f"kernels {rec['kernels'] or 'none'}, {rec['compile_seconds']} s"))
    if on_record is not None:
      on_record(run_info, records)
  return run_info, records


def main(argv):
  del argv
  F = flags.FLAGS
  cfg = dict(topology=F.topology, model_shape=F.model_shape, draft_model_shape=F.draft_model_shape, mesh=F.mesh,
             methods=F.methods, num_speculative_tokens=F.num_speculative_tokens, eagle_topk=F.eagle_topk,
             num_draft_tokens=F.num_draft_tokens, max_num_seqs=F.max_num_seqs, max_model_len=F.max_model_len,
             dtype=F.dtype, kv_cache_dtype=F.kv_cache_dtype, attention_impl=F.attention_impl,
             insert_buckets=F.insert_buckets, train_kinds=F.train_kinds, train_batch=F.train_batch,
             train_seq_len=F.train_seq_len, train_target_dtype=F.train_target_dtype)
  unknown = sorted(set(cfg["methods"]) - set(METHODS))
  if unknown:
    raise SystemExit(f"unknown --methods {unknown}")
  if F.cost_table:
    cfg.update(cost_batches=[int(b) for b in F.cost_batches], cost_ks=F.cost_ks,
               cost_trees=[int(n) for n in F.cost_trees], cost_tree_method=F.cost_tree_method,
               cost_tree_depth=F.cost_tree_depth, cost_chains=list(F.cost_chains),
               cost_hlo_dir=F.cost_hlo_dir, cost_layers=[int(n) for n in F.cost_layers])
    os.makedirs(os.path.dirname(os.path.abspath(F.cost_table)), exist_ok=True)

    def write(table):
      with open(F.cost_table, "w", encoding="utf-8") as f:
        json.dump(table, f, indent=1, sort_keys=True)
      stem = os.path.splitext(F.cost_table)[0]
      plot_costs(table, stem + ".png")
      with open(stem + "_breakdown.md", "w", encoding="utf-8") as f:
        f.write(breakdown_md(table))
      plot_breakdown(table, stem + "_breakdown.png")

    table = cost_table(cfg, log=lambda s: print(s, flush=True), on_update=write)
    write(table)
    print(f"cost table: {F.cost_table} (plot beside it); {len(table['failures'])} programs without an estimate")
    sys.exit(1 if table["failures"] else 0)
  os.makedirs(F.output, exist_ok=True)

  def write(run_info, records):  # after every program: a long run that is stopped keeps what it compiled
    with open(os.path.join(F.output, "report.json"), "w", encoding="utf-8") as f:
      json.dump({"run": run_info, "programs": records}, f, indent=1)
    with open(os.path.join(F.output, "report.md"), "w", encoding="utf-8") as f:
      f.write(aot_report.report_md(run_info, records))

  run_info, records = run(cfg, log=lambda s: print(s, flush=True), on_record=write)
  write(run_info, records)
  bad = [r["name"] for r in records if not ok(r)]
  print(f"{len(records) - len(bad)} of {len(records)} programs compiled and fit; report in {F.output}")
  sys.exit(1 if bad else 0)


AOT_FLAGS = ("topology", "model_shape", "draft_model_shape", "mesh", "methods", "num_speculative_tokens",
             "eagle_topk", "num_draft_tokens", "max_num_seqs", "max_model_len", "dtype", "kv_cache_dtype",
             "attention_impl", "insert_buckets", "train_kinds", "train_batch", "train_seq_len", "train_target_dtype",
             "output", "cost_table", "cost_batches",
             "cost_ks", "cost_trees", "cost_tree_method", "cost_tree_depth", "cost_chains",
             "cost_hlo_dir", "cost_layers")


if __name__ == "__main__":
  from absl import app
  from spec_jax import flag_table
  # The accelerator's settings: bfloat16, the target's Pallas kernel (attention_impl ''), trees of 16 nodes.
  flag_table.define(AOT_FLAGS, mesh="", methods=list(METHODS), num_speculative_tokens=4, eagle_topk=4,
                    num_draft_tokens=16, max_num_seqs=16, max_model_len=4096, dtype="bfloat16", attention_impl="",
                    output="aot_report")
  app.run(main)
