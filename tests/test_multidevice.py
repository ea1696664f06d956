"""Runs tests/multidevice/ in a subprocess with 8 simulated CPU devices: the device count is fixed when JAX
starts, so those tests cannot share this process."""

import os
import subprocess
import sys

import pytest

from tests.conftest import ROOT, TINY_MODEL_XLA_FLAGS

pytestmark = pytest.mark.many_devices


def run_multidevice(*select, timeout=1500, tiny_models=True):
  """tiny_models: the files run only tiny random models, so they compile with TINY_MODEL_XLA_FLAGS."""
  flags = " --xla_force_host_platform_device_count=8" + (" " + TINY_MODEL_XLA_FLAGS if tiny_models else "")
  env = dict(os.environ, XLA_FLAGS=(os.environ.get("XLA_FLAGS", "") + flags).strip())
  cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-x", *select]
  proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
  tail = (proc.stdout + proc.stderr)[-6000:]
  assert proc.returncode == 0, tail
  assert " passed" in tail and "skipped" not in tail.splitlines()[-1], tail


def test_mesh_decode():
  run_multidevice("tests/multidevice/test_mesh_decode.py")


def test_mesh_train():
  run_multidevice("tests/multidevice/test_mesh_train.py")


@pytest.mark.slow
def test_mesh_gemma3():
  run_multidevice("tests/multidevice/test_mesh_gemma.py", tiny_models=False)
