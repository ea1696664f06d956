"""What the multi-host mirror costs an engine iteration (issue 47's benchmark; overhead only, not scaling): the same
8 simulated CPU devices and mesh served by one process, then by two processes of 4 (serve/many_hosts/multihost.py: process 0
sends every device call to process 1 before running it), at 1 and 16 running requests.

For each (processes, running) point: start the server(s), send `running` concurrent greedy requests of
--max_tokens tokens (the tiny model never stops early), and read the engine's iterations (the count of
spec_jax:engine_host_seconds) and the wall time between the first and the last answer. Reported: ms per
iteration, and for two processes the leader's own channel cost (its log line at stop: messages, bytes and the
seconds spent sending) per iteration. The per-iteration cost of the broadcast is the two-process ms per iteration
minus the one-process one at the same running count (it also holds gloo's cross-process collectives, which a real
pod pays over its interconnect instead).

  .venv/bin/python -m benchmarks.probes.multihost --running=1,16 --max_tokens=64 --repeats=3 \\
      --json_out=benchmarks/reports/multihost.json
  .venv/bin/python -m benchmarks.probes.multihost --running=1 --max_tokens=8 --repeats=1   # a dry run
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time

import httpx
from absl import app, flags

flags.DEFINE_list("running", ["1", "16"], "Concurrent requests (running rows) per point.")
flags.DEFINE_integer("max_tokens", 64, "Tokens per request.")
flags.DEFINE_integer("repeats", 3, "Bursts per point (the first, which compiles, is dropped: one more runs).")
flags.DEFINE_string("method", "ngram", "Speculative method (ngram or none).")
flags.DEFINE_string("mesh", "data:2,model:4", "The mesh over the 8 devices.")
flags.DEFINE_string("json_out", "", "Write the results here too.")
FLAGS = flags.FLAGS
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROMPTS = ["the cat sat on the mat", "a dog ran and the cat sat", "the mat is a mat", "dog and cat and dog"]


def _port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _model(d: str) -> str:
  sys.path.insert(0, ROOT)
  from tests.serve.test_server import write_tiny_model
  return write_tiny_model(os.path.join(d, "tiny.gguf"))


def _start(model: str, procs: int, slots: int, d: str):
  port, coord = _port(), _port()
  spec = '{"method": "ngram", "num_speculative_tokens": 3}' if FLAGS.method == "ngram" else '{"method": "none"}'
  base = [sys.executable, "-m", "serve.server", f"--model={model}", "--dtype=float32", "--served_model_name=tiny",
          f"--max_num_seqs={slots}", "--max_model_len=256", "--steps_per_sync=4", "--warmup_prompt_lens=1",
          "--costs_file=", "--extended_warmup=false", "--compilation_cache_dir=", f"--mesh={FLAGS.mesh}",
          f"--speculative_config={spec}", "--timing_probe_s=0"]
  many = [f"--coordinator_address=127.0.0.1:{coord}", f"--num_processes={procs}"] if procs > 1 else []
  env = dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={8 // procs}", PYTHONUNBUFFERED="1")
  out = []
  for i in range(procs):
    log = os.path.join(d, f"p{procs}_{i}.log")
    cmd = base + [f"--port={port + i}"] + many + ([f"--process_id={i}"] if procs > 1 else [])
    out.append((subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=open(log, "w"), stderr=subprocess.STDOUT), log))
  url = f"http://127.0.0.1:{port}"
  while "ready: http://" not in open(out[0][1]).read():
    if any(p.poll() is not None for p, _ in out):
      raise RuntimeError(open(out[0][1]).read()[-3000:])
    time.sleep(0.5)
  return url, out


def _iterations(url: str) -> float:
  text = httpx.get(f"{url}/metrics", timeout=30).text
  return float(re.search(r"^spec_jax:engine_host_seconds_count (\S+)", text, re.M).group(1))


def _burst(url: str, n: int) -> tuple:
  body = lambda i: {"model": "tiny", "prompt": PROMPTS[i % 4], "max_tokens": FLAGS.max_tokens, "temperature": 0}
  it0 = _iterations(url)
  t0 = time.perf_counter()
  with concurrent.futures.ThreadPoolExecutor(n) as ex:
    codes = list(ex.map(lambda i: httpx.post(f"{url}/v1/completions", json=body(i), timeout=600).status_code,
                        range(n)))
  wall = time.perf_counter() - t0
  assert codes == [200] * n, codes
  return wall, _iterations(url) - it0


def _stop(procs) -> str:
  for p, _ in procs:
    if p.poll() is None:
      p.send_signal(signal.SIGTERM)
  for p, _ in procs:
    try:
      p.wait(60)
    except subprocess.TimeoutExpired:
      p.kill()
  return open(procs[0][1]).read()


def main(argv):
  del argv
  running = [int(r) for r in FLAGS.running]
  results = []
  with tempfile.TemporaryDirectory() as d:
    model = _model(d)
    for procs in (1, 2):
      url, ps = _start(model, procs, max(running), d)
      try:
        for n in running:
          runs = [_burst(url, n) for _ in range(FLAGS.repeats + 1)][1:]
          ms = [1e3 * w / max(it, 1) for w, it in runs]
          results.append({"processes": procs, "running": n, "ms_per_iteration": [round(x, 3) for x in ms],
                          "iterations": [it for _, it in runs]})
          print(json.dumps(results[-1]), flush=True)
      finally:
        log = _stop(ps)
      m = re.search(r"channel: (\d+) messages \((\d+) calls\), ([\d.]+) MiB, ([\d.]+) s sending", log)
      if procs > 1 and m:
        results.append({"processes": procs, "channel": {"messages": int(m.group(1)), "calls": int(m.group(2)),
                                                        "mib": float(m.group(3)), "send_s": float(m.group(4))}})
        print(json.dumps(results[-1]), flush=True)
  one = {r["running"]: min(r["ms_per_iteration"]) for r in results if r.get("processes") == 1 and "running" in r}
  for r in results:
    if r.get("processes") == 2 and "running" in r:
      print(f"running {r['running']}: broadcast + cross-process collectives "
            f"{min(r['ms_per_iteration']) - one[r['running']]:+.3f} ms per iteration "
            f"(1 process {one[r['running']]:.3f} ms, 2 processes {min(r['ms_per_iteration']):.3f} ms)")
  if FLAGS.json_out:
    with open(FLAGS.json_out, "w") as f:
      json.dump(results, f, indent=1)


if __name__ == "__main__":
  app.run(main)
