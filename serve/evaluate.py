"""Pod evaluation: many hosts start this same command; together they run the baseline and each method over one
prompt set on one device mesh, and process 0 writes the report.

  # one host, 8 devices (here simulated on CPU):
  XLA_FLAGS=--xla_force_host_platform_device_count=8 python -m serve.evaluate --mesh=data:8 \
      --methods=none,ngram --prompts=data/specbench/spec_bench_question.jsonl --output_dir=/tmp/eval
  # two hosts (run on each, I = 0 and 1); TPU pods and SLURM/MPI jobs need no --coordinator_address flags:
  python -m serve.evaluate --coordinator_address=HOST0:1234 --num_processes=2 --process_id=I --mesh=data:8 ...

`jax.distributed` joins the processes (gloo collectives on CPU); every host loads the model and the prompts, the
global batch is split over the mesh's `data` axis across hosts, and results come back through JAX collectives
(process_allgather). The run flags are serve.generate's (--config, --model, --max_new_tokens, --batch_size as
the global batch, sampling, --prompts, --limit, ...). Output in --output_dir: report.md (a per-category table for
each method), summary.json (per method, the summary serve.generate --compare writes, plus the mesh and host
count) and outputs.jsonl (every arm's tokens per prompt).
"""

from __future__ import annotations

import dataclasses
import json
import os
import time

import jax
from absl import app, flags

from serve import generate
from serve.jobs import run_flags  # serve.generate's run flags, which this job takes too
from serve.jobs import setup as setup_lib
from serve.jobs.runner import Arm, category_table, format_table, run_arms
from spec_jax import distributed  # joining the run, failing it whole (shared with train.main)
from spec_jax import sharding, spec_config
from spec_jax.proposers.base import NoneProposer
from spec_jax.proposers.registry import METHODS
from spec_jax.spec_config import SpecConfig

run_flags.define("methods", "output_dir", "coordinator_address", "num_processes", "process_id",
                 "initialization_timeout", "heartbeat_timeout")
FLAGS = flags.FLAGS


def main(argv):
  del argv
  distributed.main("serve.evaluate", run, distributed.Join.from_flags(FLAGS))


def run() -> dict:
  if not FLAGS.output_dir:
    raise ValueError("--output_dir is required")
  methods = FLAGS.methods or ["none", "ngram"]
  bad = [m for m in methods if m not in METHODS]
  if bad:
    raise ValueError(f"--methods takes {', '.join(METHODS)}; got {methods}")
  cfg = generate.settings()
  generate.validate(cfg)
  lead = jax.process_index() == 0
  setup = setup_lib.load(cfg, SpecConfig())
  mesh = setup.mesh
  if lead:
    print(f"evaluate: {jax.process_count()} process(es), {jax.device_count()} devices "
          f"({jax.devices()[0].platform}), mesh {sharding.describe(mesh)}", flush=True)
  prompts, prompt_ids = generate.load_prompts(cfg, setup)
  arms = [Arm("baseline", NoneProposer(), {})]
  for m in dict.fromkeys(methods):
    if m != "none":  # each method with the run's other speculative settings (k 4 where the run's is off)
      keys = {k: v for k, v in cfg["spec"].to_json().items() if k != "per_concurrency"}
      keys.update(method=m, num_speculative_tokens=cfg["spec"].k or 4)
      arm = generate.arm(cfg, setup.with_spec(spec_config.from_dict(keys, f"--methods {m}")))
      arms.append(dataclasses.replace(arm, label=m))  # runner fits the costs' rows to the padded batch
  t0 = time.perf_counter()
  runs = run_arms(arms, setup.params, setup.config, setup.tokenizer, prompts, prompt_ids,
                  batch_size=cfg["batch_size"], max_new_tokens=cfg["max_new_tokens"],
                  sampling_args=dict(temperature=cfg["temperature"], top_k=cfg["top_k"], top_p=cfg["top_p"]),
                  adaptive_k=cfg["adaptive"], seed=cfg["seed"], impl=setup.impl, repeats=FLAGS.repeats,
                  progress=FLAGS.progress and lead, mesh=mesh, kv_cache_dtype=setup.kv_cache_dtype)
  base = runs[0]
  run_info = {"dtype": cfg["dtype"], "batch_size": cfg["batch_size"], "max_new_tokens": cfg["max_new_tokens"],
              "temperature": cfg["temperature"], "top_k": cfg["top_k"], "top_p": cfg["top_p"],
              "adaptive": cfg["adaptive"], "attention_impl": setup.impl, "repeats": FLAGS.repeats,
              "mesh": sharding.describe(mesh), "platform": jax.devices()[0].platform}
  summary = {"mesh": sharding.describe(mesh), "hosts": jax.process_count(), "devices": jax.device_count(),
             "prompts": len(prompts), "run": run_info, "baseline": base.summary, "methods": {}}
  for arm, r in zip(arms[1:], runs[1:]):
    ratios = [m / b if b else 0.0 for m, b in zip(r.summary["tokens_per_s_by_repeat"],
                                                  base.summary["tokens_per_s_by_repeat"])]
    summary["methods"][arm.label] = {  # serve.generate --compare's summary
        "baseline": base.summary, "speculative": r.summary,
        "run": dict(run_info, method=arm.label, num_speculative_tokens=arm.proposer.k),
        "speedup": r.summary["output_tokens_per_s"] / max(base.summary["output_tokens_per_s"], 1e-9),
        "speedup_by_repeat": [round(x, 3) for x in ratios],
        "categories": category_table(base, r, cfg["batch_size"])}
  if lead:
    write_outputs(FLAGS.output_dir, summary, arms, runs, time.perf_counter() - t0)
  return summary


def write_outputs(out_dir: str, summary: dict, arms, runs, elapsed: float) -> None:
  os.makedirs(out_dir, exist_ok=True)
  with open(os.path.join(out_dir, "summary.json"), "w") as f:
    json.dump(summary, f, indent=1)
  with open(os.path.join(out_dir, "outputs.jsonl"), "w", encoding="utf-8") as f:
    for i, rec in enumerate(runs[0].records):
      row = {"id": rec["id"], "category": rec["category"]}
      for arm, r in zip(arms, runs):
        row[arm.label] = {"token_ids": r.records[i]["token_ids"], "finish_reason": r.records[i]["finish_reason"]}
      f.write(json.dumps(row) + "\n")
  m, run = summary["mesh"], summary["run"]
  lines = [f"# Evaluation: {', '.join(a.label for a in arms)}", "",
           f"- mesh: data {m['data']} x model {m['model']} = {m['devices']} devices ({run['platform']}), "
           f"{summary['hosts']} host(s)",
           f"- {summary['prompts']} prompts, global batch {run['batch_size']}, {run['max_new_tokens']} new tokens, "
           f"temperature {run['temperature']}, top-k {run['top_k']}, top-p {run['top_p']}, {run['dtype']}, "
           f"adaptive k {run['adaptive']}, repeats {run['repeats']}",
           f"- baseline: {runs[0].summary['output_tokens']} tokens, "
           f"{runs[0].summary['output_tokens_per_s']:.1f} tok/s", f"- wall time {elapsed:.0f} s", ""]
  for name, s in summary["methods"].items():
    sp = s["speculative"]
    lines += [f"## {name}", "",
              f"{sp['output_tokens_per_s']:.1f} tok/s, speedup {s['speedup']:.2f}x, mean acceptance length "
              f"{sp['mean_acceptance_length']:.2f}, acceptance rate {sp['acceptance_rate']:.2f}", "",
              "```", format_table(s["categories"]), "```", ""]
  if not summary["methods"]:
    lines += ["(baseline only)", ""]
  lines += ["Tokens/s are wall-clock over the whole mesh (a run's time is its slowest host's). On simulated CPU "
            "devices they show overhead, not scaling.", ""]
  with open(os.path.join(out_dir, "report.md"), "w") as f:
    f.write("\n".join(lines))
  print("\n".join(lines), flush=True)


if __name__ == "__main__":
  app.run(main)
