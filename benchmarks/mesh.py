"""Decode tokens/s and speculative speedup on meshes of 1, 2, 4 and 8 devices, through serve.evaluate.

  python benchmarks/mesh.py --meshes=';data:2;data:4;data:8;data:2,model:4' --json_out=/tmp/mesh.json

Each mesh runs in its own process (the device count is fixed when JAX starts): on CPU the devices are simulated
with --xla_force_host_platform_device_count, so the figures show the partitioning's overhead on the same two
cores, not scaling. Baseline and ngram run interleaved inside each process (serve.evaluate's arms).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

from absl import app, flags

from spec_jax import flag_table

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
from spec_jax.datasets import SPEC_BENCH as SPECBENCH  # noqa: E402

FLAG_NAMES = ("meshes", "prompts", "limit", "batch_size", "max_new_tokens", "dtype", "repeats", "json_out")
flag_table.define(FLAG_NAMES,
                  meshes=";data:2;data:4;data:8;data:2,model:4", prompts=SPECBENCH, limit=8, batch_size=8,
                  max_new_tokens=48, dtype="float32", repeats=2, json_out="")
FLAGS = flags.FLAGS


def devices(mesh: str) -> int:
  n = 1
  for part in filter(None, mesh.split(",")):
    n *= int(part.split(":")[1])
  return n


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  rows = []
  for mesh in FLAGS.meshes.split(";"):
    n = devices(mesh)
    with tempfile.TemporaryDirectory() as out:
      cmd = [sys.executable, "-m", "serve.evaluate", f"--mesh={mesh}", "--methods=none,ngram",
             f"--prompts={FLAGS.prompts}", f"--limit={FLAGS.limit}", f"--batch_size={FLAGS.batch_size}",
             f"--max_new_tokens={FLAGS.max_new_tokens}", f"--dtype={FLAGS.dtype}", f"--repeats={FLAGS.repeats}",
             "--costs_file=", "--adaptive=false", "--progress=false", f"--output_dir={out}"]
      env = dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={n}")
      subprocess.run(cmd, cwd=ROOT, env=env, check=True, stdout=subprocess.DEVNULL)
      s = json.load(open(os.path.join(out, "summary.json")))
    m = s["methods"]["ngram"]
    row = {"mesh": mesh or "one device", "devices": n, "baseline_tok_s": s["baseline"]["output_tokens_per_s"],
           "baseline_by_repeat": s["baseline"]["tokens_per_s_by_repeat"],
           "ngram_tok_s": m["speculative"]["output_tokens_per_s"], "speedup": m["speedup"],
           "speedup_by_repeat": m["speedup_by_repeat"],
           "mean_acceptance_length": m["speculative"]["mean_acceptance_length"]}
    rows.append(row)
    print(json.dumps(row), flush=True)
  print("\n| mesh | devices | baseline tok/s (repeats) | ngram k=4 tok/s | speedup (repeats) | τ |")
  print("|---|---|---|---|---|---|")
  for r in rows:
    print(f"| {r['mesh']} | {r['devices']} | {r['baseline_tok_s']:.1f} ({', '.join(f'{x:.1f}' for x in r['baseline_by_repeat'])}) "
          f"| {r['ngram_tok_s']:.1f} | {r['speedup']:.2f}x ({', '.join(f'{x:.2f}' for x in r['speedup_by_repeat'])}) "
          f"| {r['mean_acceptance_length']:.2f} |")
  if FLAGS.json_out:
    with open(FLAGS.json_out, "w") as f:
      args = {name: FLAGS[name].value for name in FLAG_NAMES}
      json.dump({"args": args, "rows": rows}, f, indent=1)


if __name__ == "__main__":
  app.run(main)
