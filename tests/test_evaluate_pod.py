"""serve.evaluate, the pod evaluation job: two real processes on loopback (jax.distributed, gloo, 4 CPU devices
each) write the same report as one process with 8 devices; a process that never joins, or that dies mid-run,
fails the run with an error naming it instead of a hang."""

import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from tests.conftest import ROOT, TINY_MODEL_XLA_FLAGS
from tests.serve.test_server import write_tiny_model

CATEGORIES = ("coding", "writing")
pytestmark = pytest.mark.many_devices


def _port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
  d = tmp_path_factory.mktemp("pod")
  model = write_tiny_model(d / "tiny.gguf")
  prompts = d / "prompts.jsonl"
  words = ["the cat sat on the mat", "a dog ran and the cat sat", "the mat is a mat", "dog and cat and dog"]
  with open(prompts, "w") as f:
    for i in range(16):  # 16 prompts of different lengths in two categories
      f.write(json.dumps({"question_id": i, "category": CATEGORIES[i % 2],
                          "turns": [" ".join([words[i % 4]] * (1 + i % 5))]}) + "\n")
  return model, str(prompts), d


def _cmd(model, prompts, out, *extra):
  return [sys.executable, "-m", "serve.evaluate", f"--model={model}", "--dtype=float32", f"--prompts={prompts}",
          "--mesh=data:4,model:2", "--methods=none,draft", "--draft_layers=2", "--num_speculative_tokens=3",
          "--max_new_tokens=6", "--batch_size=16", "--costs_file=", "--progress=false", f"--output_dir={out}", *extra]


def _env(devices):
  # A tiny model; no persistent compilation cache: with a warm one, the two-process runs failed or hung (seen
  # 2026-12-02 under xdist, before sharding.settle; that deadlock is the likely cause, not yet verified), and
  # compiling is what keeps the killed-mid-run pair going past its kill.
  return dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={devices} {TINY_MODEL_XLA_FLAGS}",
              PYTHONUNBUFFERED="1", JAX_COMPILATION_CACHE_DIR="")


def _pair(model, prompts, out, port, *extra):
  addr = [f"--coordinator_address=127.0.0.1:{port}", "--num_processes=2"]
  return [subprocess.Popen(_cmd(model, prompts, out, *addr, f"--process_id={i}", *extra), cwd=ROOT, env=_env(4),
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in range(2)]


def _tokens_and_acceptance(summary):
  """The parts of summary.json that are the same on any mesh and host count (everything but timings)."""
  keep = lambda s: {k: s[k] for k in ("prompts", "output_tokens", "mean_acceptance_length", "acceptance_rate",
                                      "per_position_acceptance", "drafted_tokens", "accepted_tokens") if k in s}
  out = {"baseline": keep(summary["baseline"]), "mesh": {k: summary["mesh"][k] for k in ("data", "model", "devices")}}
  for name, m in summary["methods"].items():
    out[name] = keep(m["speculative"])
    out[name + "/categories"] = [{k: r[k] for k in ("category", "prompts", "mean_acceptance_length")}
                                 for r in m["categories"]]
  return out


@pytest.mark.full  # 2.5 min; the two-process server and trainer tests compare processes with one in make test
def test_two_processes_write_the_report_of_one_process_with_eight_devices(files):
  model, prompts, d = files
  one = subprocess.run(_cmd(model, prompts, d / "one"), cwd=ROOT, env=_env(8), capture_output=True, text=True,
                       timeout=900)
  assert one.returncode == 0, one.stderr[-3000:]
  procs = _pair(model, prompts, d / "two", _port())
  outs = [p.communicate(timeout=900) for p in procs]
  for p, (_, err) in zip(procs, outs):
    assert p.returncode == 0, err[-3000:]
  assert "joined: 2 processes, 8 devices" in outs[1][1]
  assert not (d / "two" / "report.md").read_text() == ""
  a = json.loads((d / "one" / "summary.json").read_text())
  b = json.loads((d / "two" / "summary.json").read_text())
  assert (a["hosts"], b["hosts"]) == (1, 2)
  assert _tokens_and_acceptance(a) == _tokens_and_acceptance(b)
  assert a["methods"]["draft"]["speculative"]["accepted_tokens"] > 0  # the draft is really accepted sometimes
  assert (d / "one" / "outputs.jsonl").read_text() == (d / "two" / "outputs.jsonl").read_text()
  rows = [json.loads(l) for l in (d / "two" / "outputs.jsonl").read_text().splitlines()]
  assert len(rows) == 16 and all(r["draft"]["token_ids"] == r["baseline"]["token_ids"] for r in rows)  # greedy
  for report in (d / "one" / "report.md", d / "two" / "report.md"):
    text = report.read_text()
    assert "## draft" in text and all(c in text for c in CATEGORIES)
  assert "2 host(s)" in (d / "two" / "report.md").read_text()
  assert "1 host(s)" in (d / "one" / "report.md").read_text()


def test_a_process_that_never_joins_is_named(files):
  model, prompts, d = files
  t = time.time()
  p = subprocess.run(_cmd(model, prompts, d / "x", f"--coordinator_address=127.0.0.1:{_port()}", "--num_processes=2",
                          "--process_id=0", "--initialization_timeout=8"), cwd=ROOT, env=_env(4),
                     capture_output=True, text=True, timeout=120)
  assert p.returncode != 0
  assert time.time() - t < 90
  last = p.stderr.strip().splitlines()[-1]
  assert last.startswith("error: process 0: the run did not start") and "process 1 did not join" in last, last


def test_a_process_that_dies_mid_run_fails_the_run(files):
  model, prompts, d = files
  procs = _pair(model, prompts, d / "dead", _port(), "--heartbeat_timeout=5", "--max_new_tokens=40")
  try:
    deadline = time.time() + 300
    seen = ""
    while "joined" not in seen and time.time() < deadline:  # process 1 is in the run
      seen += procs[1].stderr.readline()
    assert "joined" in seen
    time.sleep(3)
    procs[1].send_signal(signal.SIGKILL)  # its worker dies with it
    t = time.time()
    _, err = procs[0].communicate(timeout=120)
    assert procs[0].returncode != 0
    assert time.time() - t < 60
    last = err.strip().splitlines()[-1]
    assert last.startswith("error: process 0: the run failed") and "[1]" in last, last
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
      p.communicate()
