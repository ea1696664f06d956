"""Runs tests/multidevice/ in a subprocess with 8 simulated CPU devices: the device count is fixed when JAX
starts, so those tests cannot share this process."""

import os
import re
import subprocess
import sys

import pytest

from tests.conftest import ROOT, TINY_MODEL_XLA_FLAGS

pytestmark = pytest.mark.many_devices


def run_multidevice(*select, timeout=1500, tiny_models=True):
  """tiny_models: the files run only tiny random models, so they compile with TINY_MODEL_XLA_FLAGS.

  --capture=sys: XLA's own log lines (a collective that waits, a CHECK that fails) go to file descriptor 2, which
  pytest's default capture would swallow along with the test when the process aborts; this way they reach the
  assertion message below, where stdout and stderr each keep their own tail."""
  flags = " --xla_force_host_platform_device_count=8" + (" " + TINY_MODEL_XLA_FLAGS if tiny_models else "")
  env = dict(os.environ, XLA_FLAGS=(os.environ.get("XLA_FLAGS", "") + flags).strip())
  cmd = [sys.executable, "-m", "pytest", "-q", "--capture=sys", "-p", "no:cacheprovider", "-x", *select]
  try:
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
  except subprocess.TimeoutExpired as e:  # a hang: show what it printed, XLA's "may be stuck" lines included
    pytest.fail(f"no result in {timeout} s\n{_tails(e.stdout, e.stderr)}")
  report = f"exit {proc.returncode}\n{_tails(proc.stdout, proc.stderr)}"
  assert proc.returncode == 0, report
  summary = [line for line in proc.stdout.splitlines() if re.match(r"^\d+ passed.* in [\d.]+s", line)]
  assert summary and "skipped" not in summary[-1], report


def _tails(out, err, n=4000):
  text = lambda b: (b.decode(errors="replace") if isinstance(b, bytes) else b or "")[-n:]
  return f"--- stdout (tail) ---\n{text(out)}\n--- stderr (tail) ---\n{text(err)}"


def test_mesh_decode():
  run_multidevice("-m", "not full", "tests/multidevice/test_mesh_dispatch.py", "tests/multidevice/test_mesh_decode.py")


@pytest.mark.full
def test_mesh_decode_full():
  """The cases make test leaves out (marked full in the file): more proposers and meshes on the same paths."""
  run_multidevice("-m", "full", "tests/multidevice/test_mesh_decode.py")


def test_mesh_paged():
  run_multidevice("tests/multidevice/test_mesh_paged.py")


def test_mesh_train():
  run_multidevice("tests/multidevice/test_mesh_train.py")


@pytest.mark.slow
def test_mesh_gemma3():
  run_multidevice("-m", "not full", "tests/multidevice/test_mesh_gemma.py", tiny_models=False)


@pytest.mark.slow
@pytest.mark.full
def test_mesh_gemma3_full():
  run_multidevice("-m", "full", "tests/multidevice/test_mesh_gemma.py", tiny_models=False)
