"""serve.server on many hosts (serve/many_hosts/multihost.py): two real processes on loopback (jax.distributed, gloo, 4 CPU
devices each) serve one tiny model on one mesh and answer exactly what one process with the same 8 devices answers;
a dead follower stops the leader with an error naming it, and no client hangs; hosts started with different
settings are refused with a message naming the difference."""

from __future__ import annotations

import concurrent.futures
import json
import os
import signal
import subprocess
import sys
import time

import httpx
import pytest

from tests.conftest import ROOT, TINY_MODEL_XLA_FLAGS
from tests.serve.test_server import free_port, write_tiny_model

pytestmark = pytest.mark.many_devices
HEADS = os.path.join(ROOT, "tests", "fixtures", "published_heads")
MESH = "--mesh=data:2,model:4"
# 48 pages of 4 tokens in 2 data shards' shares (23 usable each): two ~60-token requests on one shard do not both
# fit, so the pool preempts.
POOL = ["--block_size=4", "--num_kv_blocks=48", "--max_num_seqs=4", "--max_model_len=128"]
METHODS = {
    "ngram": (None, '{"method": "ngram", "num_speculative_tokens": 3}'),
    "eagle": (os.path.join(HEADS, "target"),
              '{"method": "eagle", "num_speculative_tokens": 3, "model": "%s"}' % os.path.join(HEADS, "eagle1")),
    "none": (None, '{"method": "none"}'),  # the dead-process tests: plain decoding compiles the fewest programs
}
WORDS = ["the cat sat on the mat", "a dog ran and the cat sat", "the mat is a mat", "dog and cat and dog"]
# What a follower whose leader died prints last: the channel's line, or jax.distributed's own abort when its
# client sees the coordination service (in process 0) go first; both name the leader.
STOP_CAUSES = ("error: process 1: the leader (process 0) closed the channel",
               "the JAX distributed service detected fatal errors. This most likely indicates that another task died")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
  d = tmp_path_factory.mktemp("multihost")
  path = write_tiny_model(d / "tiny.gguf")
  # the dequantized weights and the tokenizer are cached beside the file once: not by two processes at once
  from spec_jax.checkpoints import gguf_loader, gguf_tokenizer
  gguf_loader.load_gguf(path)
  gguf_tokenizer.load(path)
  return path


def _env(devices: int) -> dict:
  # no persistent compilation cache: two processes writing one cache is its own test (tests/test_evaluate_pod.py)
  return dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={devices} {TINY_MODEL_XLA_FLAGS}",
              PYTHONUNBUFFERED="1", JAX_COMPILATION_CACHE_DIR="")


def _flags(model: str, method: str, *extra, grammar: bool = True) -> list:
  """grammar=False: no structured outputs (--grammar_capacity='': none of their programs compiled)."""
  heads_model, spec = METHODS[method]
  return [f"--model={heads_model or model}", "--dtype=float32", "--served_model_name=tiny", "--steps_per_sync=4",
          "--warmup_prompt_lens=1", "--costs_file=", "--extended_warmup=false", "--compilation_cache_dir=",
          f"--grammar_capacity={'64,32' if grammar else ''}", f"--speculative_config={spec}", MESH, *POOL, *extra]


class Servers:
  """One server: one process with 8 devices, or `n` processes with 4 each (process 0 serves HTTP)."""

  def __init__(self, flags: list, n: int, tmp: str, timeout: float = 600):
    self.port = free_port()
    self.url = f"http://127.0.0.1:{self.port}"
    self.logs = [os.path.join(tmp, f"server_{self.port}_{i}.log") for i in range(n)]
    many = [f"--coordinator_address=127.0.0.1:{free_port()}", f"--num_processes={n}", "--heartbeat_timeout=10",
            "--initialization_timeout=120"] if n > 1 else []
    self.procs = []
    for i in range(n):
      cmd = [sys.executable, "-m", "serve.server", f"--port={self.port + i}", *flags, *many,
             *([f"--process_id={i}"] if n > 1 else [])]
      self.procs.append(subprocess.Popen(cmd, cwd=ROOT, env=_env(8 // n), stdout=open(self.logs[i], "w"),
                                         stderr=subprocess.STDOUT))
    end = time.time() + timeout
    while "ready: http://" not in self.log(0):
      if any(p.poll() is not None for p in self.procs) or time.time() > end:
        self.stop()
        raise RuntimeError("server did not start:\n" + "\n".join(self.log(i)[-3000:] for i in range(n)))
      time.sleep(0.2)

  def log(self, i: int) -> str:
    with open(self.logs[i]) as f:
      return f.read()

  def stop(self) -> list:
    for p in self.procs:
      if p.poll() is None:
        p.send_signal(signal.SIGTERM)
    codes = []
    for p in self.procs:
      try:
        codes.append(p.wait(60))
      except subprocess.TimeoutExpired:
        p.kill()
        codes.append(p.wait())
    return codes


def _complete(url: str, body: dict) -> dict:
  r = httpx.post(f"{url}/v1/completions", json={"model": "tiny", "temperature": 0, **body}, timeout=300)
  assert r.status_code == 200, r.text
  return r.json()


def _metric(url: str, name: str) -> float:
  text = httpx.get(f"{url}/metrics", timeout=30).text
  return sum(float(l.split()[-1]) for l in text.splitlines() if l.startswith(name + " ") or l.startswith(name + "{"))


def _texts(tree):
  """Everything but the logprob values."""
  if isinstance(tree, dict):
    return {k: _texts(v) for k, v in tree.items() if k not in ("token_logprobs", "top_logprobs")}
  if isinstance(tree, (list, tuple)):
    return [_texts(v) for v in tree]
  return tree


def _close(a, b, tol=1e-4) -> bool:
  if isinstance(a, dict):
    return a.keys() == b.keys() and all(_close(a[k], b[k], tol) for k in a)
  if isinstance(a, (list, tuple)):
    return len(a) == len(b) and all(_close(x, y, tol) for x, y in zip(a, b))
  if isinstance(a, float) and isinstance(b, float):
    return abs(a - b) <= tol
  return a == b


def workload(url: str) -> dict:
  """A burst of concurrent greedy requests (the pool preempts), logprobs and n, then a prefix hit, a structured
  output and the prompt's logprobs (echo); -> every answer's text, tokens and logprobs, and the pool's counters."""
  bodies = [{"prompt": " ".join([WORDS[i % 4]] * (1 + i % 2)), "max_tokens": 24} for i in range(6)]
  bodies[1].update(logprobs=2)
  bodies[2].update(n=2)
  with concurrent.futures.ThreadPoolExecutor(len(bodies)) as ex:
    burst = list(ex.map(lambda b: _complete(url, b), bodies))
  doc = " ".join(WORDS[:2])
  prefix = [_complete(url, {"prompt": doc + tail, "max_tokens": 8}) for tail in (" the", " a dog")]
  choice = _complete(url, {"prompt": "pick", "max_tokens": 16, "guided_choice": ["left cat", "right dog"]})
  echo = _complete(url, {"prompt": "the cat sat", "max_tokens": 4, "echo": True, "logprobs": 1})  # prompt logprobs
  keep = lambda r: [(c["text"], c.get("logprobs")) for c in r["choices"]]
  return {"burst": [keep(r) for r in burst], "prefix": [keep(r) for r in prefix], "choice": keep(choice),
          "echo": keep(echo),
          "preemptions": _metric(url, "spec_jax:num_preemptions_total"),
          "prefix_hits": _metric(url, "spec_jax:prefix_cache_hits_total"),
          "probes": _metric(url, "spec_jax:timing_probes_total"),
          "proposer_s": _metric(url, "spec_jax:proposer_time_seconds_total")}


# The n-gram case in make test (its small pool preempts: the mirrored preemption, the host's own path); the EAGLE
# case (its state is one more pytree the same jitted calls carry) in make test-full: ~5 min of the tiny pass.
@pytest.mark.parametrize("method", ["ngram", pytest.param("eagle", marks=pytest.mark.full)])
def test_two_processes_answer_what_one_process_with_eight_devices_answers(tiny, tmp_path, method):
  results, logs = [], []
  for n in (1, 2):
    # the timing probe every second (its first at the first drafting iteration): the followers run its calls too
    s = Servers(_flags(tiny, method, "--timing_probe_s=1"), n, str(tmp_path))
    try:
      results.append(workload(s.url))
    finally:
      codes = s.stop()
      logs.append([s.log(i) for i in range(n)])
    assert codes == [0] * n, "\n".join(l[-3000:] for l in logs[-1])
  one, two = results
  with open(tmp_path / "results.json", "w") as f:
    json.dump(results, f)
  # The workload hits the prefix cache, and with n-gram its small pool preempts (how often depends on timing, so at
  # least one of the two runs). The tiny EAGLE pair's answers end sooner and have never filled the pool: that case
  # checks the mirrored EAGLE state and prefix hits, the n-gram case the mirrored preemption.
  preempted = [r.pop("preemptions") for r in results]
  probes = [(r.pop("probes"), r.pop("proposer_s")) for r in results]
  assert all(count >= 1 and seconds > 0 for count, seconds in probes), probes  # the proposer share is measured
  assert all(r.pop("prefix_hits") > 0 for r in results)
  assert max(preempted) > 0 or method == "eagle", preempted
  assert _texts(two) == _texts(one)  # the same tokens, exactly
  assert _close(two, one)  # the same logprobs (float32 reductions may round apart between programs)
  assert one["choice"][0][0] in ("left cat", "right dog")
  assert one["echo"][0][1]["token_logprobs"][0] is None  # the prompt's logprobs came back (echo)
  assert "process 1 of 2 joined" in logs[1][1] and "following process 0" in logs[1][1]
  assert "the leader stopped after" in logs[1][1]  # the follower ran the leader's calls and ended with it


@pytest.mark.parametrize("dead", [1, 0])
def test_a_dead_process_stops_the_server_and_no_client_hangs(tiny, tmp_path, dead):
  """Process `dead` (1: the follower, 0: the leader) is killed mid-burst: the other one exits with an error naming
  it within seconds, and every client gets an answer or a connection error."""
  s = Servers(_flags(tiny, "none", grammar=False), 2, str(tmp_path))  # what it checks needs no speculation
  other = s.procs[1 - dead]
  try:
    def ask(i):
      try:
        r = httpx.post(f"{s.url}/v1/completions", json={"model": "tiny", "prompt": WORDS[i % 4], "max_tokens": 40,
                                                        "temperature": 0}, timeout=120)
        return r.status_code
      except httpx.TimeoutException as e:
        return e  # a hang: the test fails
      except httpx.TransportError:
        return "connection error"
    with concurrent.futures.ThreadPoolExecutor(8) as ex:
      futures = [ex.submit(ask, i) for i in range(8)]
      time.sleep(1.0)
      s.procs[dead].kill()
      t = time.time()
      other.wait(60)
      took = time.time() - t
      answers = [f.result(timeout=150) for f in futures]
  finally:
    s.stop()
  assert other.returncode not in (0, None)
  assert took < 30, took
  assert all(a == 200 or a == "connection error" for a in answers), answers
  log = s.log(1 - dead)
  if dead == 1:  # the leader's coordination service waits --heartbeat_timeout; the channel notices at once
    assert "error: process 0: follower process 1 closed its connection" in log, log[-3000:]
  else:  # the leader's death closes the channel and the coordination service at once: either may stop it first
    assert any(why in log for why in STOP_CAUSES), log[-3000:]


def test_different_settings_between_hosts_are_refused(tiny, tmp_path):
  port, coord = free_port(), free_port()
  procs = []
  for i, mesh in enumerate(("--mesh=data:2,model:4", "--mesh=data:4,model:2")):
    cmd = [sys.executable, "-m", "serve.server", f"--port={port + i}", *_flags(tiny, "ngram"), mesh,
           f"--coordinator_address=127.0.0.1:{coord}", "--num_processes=2", f"--process_id={i}",
           "--initialization_timeout=60"]
    procs.append(subprocess.Popen(cmd, cwd=ROOT, env=_env(4), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                  text=True))
  try:
    outs = [p.communicate(timeout=180)[0] for p in procs]
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
  for p, out in zip(procs, outs):
    assert p.returncode == 2, out[-3000:]
    assert "the processes were started with different server settings" in out, out[-3000:]
    assert "mesh ('data:2,model:4' on process 0, 'data:4,model:2' on process 1)" in out, out[-3000:]
