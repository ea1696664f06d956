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
import re
import sys
import time

from absl import app, flags

from serve import generate, run_flags  # serve.generate's run flags, which this job takes too
from spec_jax.proposers.registry import METHODS

run_flags.define("methods", "output_dir", "coordinator_address", "num_processes", "process_id",
                 "initialization_timeout", "heartbeat_timeout")
FLAGS = flags.FLAGS


class RunFailed(RuntimeError):
  pass


def _cluster_env() -> bool:
  """Does the environment describe a multi-process job that jax.distributed detects by itself?"""
  env = os.environ
  return (int(env.get("SLURM_NTASKS", "1") or 1) > 1 or int(env.get("OMPI_COMM_WORLD_SIZE", "1") or 1) > 1
          or bool(env.get("TPU_WORKER_HOSTNAMES", "").count(",")) or bool(env.get("MEGASCALE_COORDINATOR_ADDRESS")))


def init_distributed() -> None:
  """Join the run: with explicit flags, or by auto-detection on TPU pods / SLURM / MPI; a single process
  otherwise. A process that cannot join within --initialization_timeout fails (named by supervise())."""
  import jax
  if not _multi_process():
    return
  explicit = FLAGS.coordinator_address is not None or (FLAGS.num_processes or 1) > 1
  if explicit and (FLAGS.coordinator_address is None or FLAGS.num_processes is None or FLAGS.process_id is None):
    raise ValueError("a multi-process run needs --coordinator_address, --num_processes and --process_id together")
  if explicit and not 0 <= FLAGS.process_id < FLAGS.num_processes:
    raise ValueError(f"--process_id={FLAGS.process_id} is outside 0 .. {FLAGS.num_processes - 1}")
  jax.config.update("jax_cpu_collectives_implementation", "gloo")  # CPU devices' collectives; GPU/TPU ignore it
  kw = dict(initialization_timeout=FLAGS.initialization_timeout, heartbeat_timeout_seconds=FLAGS.heartbeat_timeout)
  if explicit:
    kw.update(coordinator_address=FLAGS.coordinator_address, num_processes=FLAGS.num_processes,
              process_id=FLAGS.process_id)
  try:
    jax.distributed.initialize(**kw)
  except Exception as e:  # a Python-level failure (bad address, ...); a peer that never joins aborts the process
    # in C++ instead, which supervise() reports
    raise RunFailed(f"process {FLAGS.process_id}: could not join the run at {FLAGS.coordinator_address}: "
                    f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}") from None


WORKER_ENV = "SPEC_JAX_EVALUATE_WORKER"


def _multi_process() -> bool:
  return FLAGS.coordinator_address is not None or (FLAGS.num_processes or 1) > 1 or _cluster_env()


def main(argv):
  del argv
  if _multi_process() and os.environ.get(WORKER_ENV) != "1":
    sys.exit(supervise())
  try:
    init_distributed()
    import jax
    if jax.process_count() > 1:
      print(f"process {jax.process_index()} joined: {jax.process_count()} processes, {jax.device_count()} devices",
            file=sys.stderr, flush=True)
    run()
  except (ValueError, FileNotFoundError, RunFailed) as e:
    print(f"error: {e}", file=sys.stderr, flush=True)
    os._exit(2)  # no atexit: jax.distributed's shutdown barrier would wait for the processes that failed
  except Exception as e:  # a collective with a dead peer, or anything else mid-run: fail the whole run now
    import jax
    print(f"error: process {jax.process_index()} of {jax.process_count()}: the run failed: "
          f"{type(e).__name__}: {str(e)[:800]}", file=sys.stderr, flush=True)
    os._exit(1)


def supervise() -> int:
  """Run this same command as a child and explain how it ended. jax.distributed's client aborts the process
  (a C++ fatal error, not a Python exception) when a process never joins or another one dies, so the error a
  user should read can only be written from outside it. The child dies with this process (PR_SET_PDEATHSIG)."""
  import collections
  import signal
  import subprocess

  def die_with_parent():
    try:
      import ctypes
      ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:  # not Linux: the child may outlive a killed parent
      pass

  env = dict(os.environ, **{WORKER_ENV: "1"})
  proc = subprocess.Popen([sys.executable, "-m", "serve.evaluate", *sys.argv[1:]], env=env, stderr=subprocess.PIPE,
                          text=True, errors="replace", preexec_fn=die_with_parent)
  for sig in (signal.SIGTERM, signal.SIGINT):
    signal.signal(sig, lambda *_: proc.terminate())
  tail = collections.deque(maxlen=400)
  for line in proc.stderr:
    sys.stderr.write(line)
    tail.append(line)
  rc = proc.wait()
  if rc == 0:
    return 0
  print(f"error: {diagnose(''.join(tail), rc)}", file=sys.stderr, flush=True)
  return rc if 0 < rc < 128 else 1


def diagnose(log: str, rc: int) -> str:
  """One line saying which process failed and how, from a failed worker's stderr."""
  me, n, addr = FLAGS.process_id, FLAGS.num_processes, FLAGS.coordinator_address
  who = f"process {me}" if me is not None else "this process"
  if "RegisterTask" in log or ("DEADLINE_EXCEEDED" in log and " joined:" not in log):
    if me == 0 and n == 2:
      missing = "process 1 did not join"
    elif me == 0:
      missing = f"some of processes 1 .. {n - 1} did not join (see their logs)"
    else:
      missing = f"{who} could not register with the coordinator at {addr} (is process 0 running there?)"
    return (f"{who}: the run did not start: not all {n} processes joined within {FLAGS.initialization_timeout} s; "
            f"{missing}")
  m = re.search(r"stopped sending heartbeats\):(.*?)The tasks", log, re.S)  # the service lists their ids
  dead = {int(t) for t in re.findall(r"(?:task:)?(\d+)", m.group(1))} if m else set()
  dead = sorted((dead or {int(t) for t in re.findall(r"task:(\d+)", log)}) - ({me} if me is not None else set()))
  if dead:
    return (f"{who}: the run failed: process(es) {dead} died or stopped responding (heartbeat timeout "
            f"{FLAGS.heartbeat_timeout} s)")
  if re.search(r"[Gg]loo|Connection (closed|reset)|peer", log):
    return f"{who}: the run failed: another process died mid-run (a collective lost its peer)"
  errors = [l for l in log.splitlines() if l.startswith("error:")]
  last = errors[-1] if errors else next((l for l in reversed(log.splitlines()) if l.strip()), "")
  return f"{who}: the run failed (exit status {rc}): {last[:300]}"


def run() -> dict:
  import jax

  from serve import setup as setup_lib
  from serve.runner import Arm, category_table, run_arms
  from spec_jax import sharding, spec_config
  from spec_jax.proposers.base import NoneProposer
  from spec_jax.spec_config import SpecConfig

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
  from serve.runner import format_table
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
