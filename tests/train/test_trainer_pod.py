"""train.main on many hosts: two real processes on loopback (jax.distributed, gloo, 4 simulated CPU devices each)
train a tiny EAGLE and a tiny Medusa head on one 'data:4,model:2' mesh; their loss curves and final params are
those of one process with 8 devices (float32 rounding), a checkpoint the two processes wrote resumes in one
process on one device and continues as the uninterrupted run did, each process tokenizes exactly the rows it
feeds (workdir/data_reads), and hosts started with different flags are refused at start with an error naming the
flag."""

import json
import os
import socket
import subprocess
import sys

import numpy as np
import pytest

from tests.conftest import ROOT, TINY_MODEL_XLA_FLAGS
from train.data import DataSpec, batch_indices, split_order

pytestmark = pytest.mark.many_devices
STEPS = 4
MESH = "--mesh=data:4,model:2"  # the batch's 8 rows: process 0 holds rows 0-3, process 1 rows 4-7
# float32: another device count or process count sums the same numbers in another order (tests/multidevice/
# test_mesh_train.py measured ~1e-6 after 6 AdamW steps); Adam's normalised update can grow that, hence the room.
RTOL, ATOL = 1e-4, 1e-5


def _port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _cmd(kind, workdir, cache, *extra):
  return [sys.executable, "-m", "train.main", f"--config=configs/train_tiny_test.py:{kind}",
          f"--config.train.workdir={workdir}", f"--config.cache_dir={cache}", "--config.noise=0.05",
          f"--config.train.steps={STEPS}", "--config.train.batch_size=8", "--config.train.save_every=2",
          f"--config.train.eval_every={STEPS}", "--config.train.log_every=1", *extra]


def _env(devices):
  return dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={devices} {TINY_MODEL_XLA_FLAGS}",
              JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1", JAX_COMPILATION_CACHE_DIR="")  # as tests/test_evaluate_pod


def _one(cmd, devices):
  p = subprocess.run(cmd, cwd=ROOT, env=_env(devices), capture_output=True, text=True, timeout=600)
  assert p.returncode == 0, p.stderr[-3000:]
  return p.stderr


def _two(cmd, extra=((), ())):
  """The same command on two processes (extra[i]: process i's own further flags) -> [(returncode, stderr)]."""
  addr = [f"--coordinator_address=127.0.0.1:{_port()}", "--num_processes=2"]
  procs = [subprocess.Popen(cmd + addr + [f"--process_id={i}", *extra[i]], cwd=ROOT, env=_env(4),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in range(2)]
  try:
    return [(p.returncode, err) for p in procs for _, err in [p.communicate(timeout=600)]]
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
        p.communicate()


def _metrics(workdir):
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    return [json.loads(l) for l in f]


def _curve(workdir):
  """(step, split) -> the losses and gradient norm (no timings)."""
  return {(r["step"], r["split"]): {k: v for k, v in r.items() if k not in ("time_s", "step", "split")}
          for r in _metrics(workdir)}


def _final(workdir):
  z = np.load(os.path.join(workdir, "final_params.npz"))
  return {k: z[k] for k in z.files}


def _own(idx, p):
  """The rows of a batch of global rows `idx` that process p's devices hold (MESH: positions 4p .. 4p + 3)."""
  return {int(r) for r in np.asarray(idx)[4 * p:4 * p + 4]}


def _expected_reads(p, n_train, n_eval, steps, cached, evaluated, bs=8):
  """The rows process p of 2 must tokenize, and no others: its rows of every batch it feeds (train steps, eval,
  and with cached features the feature pass over every row), plus with cached features its share (rows p, p + 2,
  ...) of the feature cache's fingerprint (which is also the token count's share: draft_vocab is on)."""
  chunks = lambda n: [i + np.arange(bs) % min(bs, n - i) for i in range(0, n, bs)]  # Trainer.precompute's
  train = set().union(*(_own(batch_indices(n_train, s, bs, 0), p) for s in steps))
  ev = set().union(_own(np.resize(np.arange(bs) % n_eval, bs), p)) if evaluated else set()
  if cached:
    train |= set().union(*(_own(c, p) for c in chunks(n_train))) | set(range(p, n_train, 2))
    ev |= set().union(*(_own(c, p) for c in chunks(n_eval))) | set(range(p, n_eval, 2))
  return sorted(train), sorted(ev)


def _assert_reads(workdir, **kw):
  """Each process tokenized exactly the rows it feeds, and read exactly the self-distilled answers among them
  (sequences 0 .. answers_total - 1): a process reading any other row or answer (every answer) fails."""
  for p in range(2):
    with open(os.path.join(workdir, "data_reads", f"process{p}.json")) as f:
      got = json.load(f)
    want = _expected_reads(p, got["train_rows"], got["eval_rows"], **kw)
    assert (got["train"], got["eval"]) == want, (p, got, want)
    tr, ev = split_order(got["train_rows"] + got["eval_rows"], DataSpec(eval_fraction=0.2))  # the tiny config's
    answers = sorted(int(s) for s in [*tr[want[0]], *ev[want[1]]] if s < got["answers_total"])
    assert got["answers"] == answers and 0 < len(answers) < got["answers_total"], (p, got["answers"], answers)
  return got


def _assert_close_runs(a, b):
  ca, cb = _curve(a), _curve(b)
  assert sorted(ca) == sorted(cb) and len([k for k in ca if k[1] == "train"]) == STEPS
  for key in ca:
    for name in ca[key]:
      np.testing.assert_allclose(cb[key][name], ca[key][name], rtol=RTOL, atol=ATOL, err_msg=f"{key} {name}")
  fa, fb = _final(a), _final(b)
  assert fa.keys() == fb.keys() and fa
  for k in fa:
    np.testing.assert_allclose(fb[k], fa[k], rtol=RTOL, atol=ATOL, err_msg=k)


def test_eagle_on_two_processes_then_resumed_on_one_device(tmp_path):
  """Two processes train 2 of 4 steps (a checkpoint at step 2) and stop; one process on one device resumes and
  finishes; loss curve and final params equal one process with 8 devices running all 4 steps. Each run makes its
  own data and cached features (the two processes' feature pass, each reading its own rows, is checked too)."""
  one = str(tmp_path / "one")
  _one(_cmd("eagle", one, str(tmp_path / "data_one"), MESH), 8)
  two, cache = str(tmp_path / "two"), str(tmp_path / "data")
  runs = _two(_cmd("eagle", two, cache, MESH, "--stop_after=2"))
  for rc, err in runs:
    assert rc == 0, err[-3000:]
  assert "joined: 2 processes, 8 devices" in runs[1][1]
  assert "data: 24 sequences" in runs[0][1] and "data:" not in runs[1][1]  # logs from process 0 only
  assert [r["step"] for r in _metrics(two)] == [1, 2] and not os.path.exists(os.path.join(two, "final_params.npz"))
  _assert_reads(two, steps=range(2), cached=True, evaluated=False)
  err = _one(_cmd("eagle", two, cache, "--mesh="), 1)  # the same workdir on one device
  assert "resumed from step 2" in err
  _assert_close_runs(one, two)


def test_medusa_on_two_processes_equals_one_process(tmp_path):
  """Features computed in the step (no feature cache, no draft vocabulary): each process reads only its rows of
  each batch, fewer than every row."""
  cache = str(tmp_path / "data")
  one, two = str(tmp_path / "one"), str(tmp_path / "two")
  plain = ("--config.train.cache_features=False", "--config.draft_vocab=0")
  _one(_cmd("medusa", one, cache, MESH, *plain), 8)
  runs = _two(_cmd("medusa", two, cache, MESH, *plain))
  for rc, err in runs:
    assert rc == 0, err[-3000:]
  assert "step 4 eval" in runs[0][1] and "step 4 eval" not in runs[1][1]  # logs from process 0 only
  got = _assert_reads(two, steps=range(STEPS), cached=False, evaluated=True)
  assert len(got["train"]) < got["train_rows"]
  _assert_close_runs(one, two)


def test_hosts_started_with_different_flags_are_refused(tmp_path):
  runs = _two(_cmd("eagle", str(tmp_path / "w"), str(tmp_path / "data"), MESH),
              extra=((), ("--config.train.lr=0.01",)))
  for i, (rc, err) in enumerate(runs):
    assert rc != 0
    last = err.strip().splitlines()[-1]
    assert "different flags" in last and "train.lr (0.003 on process 0, 0.01 on process 1)" in last, (i, last)
  assert not os.path.exists(tmp_path / "w" / "metrics.jsonl")
