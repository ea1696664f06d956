"""benchmarks/device_check.py, ready for a GPU: its dry run lowers every program for CUDA with the Triton kernel in
it, its smoke run executes every measurement at tiny shapes (kernel in Pallas interpret mode), and it imports
nothing the GPU machine lacks (JAX, flax, optax, orbax, safetensors and sentencepiece are there; the rest is not)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.conftest import ROOT

# Installed here for the rest of the project, absent on the GPU machine.
NOT_ON_THE_GPU_MACHINE = ("gguf", "ml_collections", "tokenizers", "fastapi", "uvicorn", "prometheus_client",
                          "jinja2", "httpx", "matplotlib", "psutil", "tqdm")

RUN = f"""
import sys, runpy
class Block:
  def find_spec(self, name, path=None, target=None):
    if name.split(".")[0] in {NOT_ON_THE_GPU_MACHINE!r}:
      raise ImportError("not on the GPU machine: " + name)
sys.meta_path.insert(0, Block())
sys.argv = ["device_check.py"] + sys.argv[1:]
runpy.run_path("benchmarks/device_check.py", run_name="__main__")
"""


def _run(tmp_path, *flags):
  out = subprocess.run([sys.executable, "-c", RUN, *flags, f"--output={tmp_path}"], cwd=ROOT, capture_output=True,
                       text=True, timeout=900)
  assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
  return json.loads((tmp_path / "device_check.json").read_text()), (tmp_path / "device_check.md").read_text()


def test_dry_run_lowers_every_program_with_the_triton_kernel(tmp_path):
  res, md = _run(tmp_path, "--dry_run")
  assert res["dry_run"] and len(res["kernels"]) == 5
  assert all(k["lowered"] and k["triton_calls"] >= 1 for k in res["kernels"])
  assert res["decode"]["triton_calls"] >= 1
  assert set(res["verify"]) == {"1", "4", "16", "64"}
  assert all(v["triton_calls"] >= 1 for row in res["verify"].values() for v in row.values())
  assert "Triton calls" in md


@pytest.mark.slow
def test_smoke_run_measures_everything_it_reports(tmp_path):
  res, md = _run(tmp_path, "--smoke", "--runs=2")
  assert not res["dry_run"]
  for k in res["kernels"]:
    assert k["max_abs_error"] < 1e-4, k  # float32 in the interpreter: the kernel equals the reference
    assert k["kernel_us"] > 0 and 0 < k["fraction_of_peak"]
  assert res["decode"]["step_ms"] > 0 and res["decode"]["floor_ms"] > 0
  for row in res["verify"].values():
    assert row["T=1"]["over_plain"] == 1.0 and all(v["seconds"] > 0 for v in row.values())
  assert "Verify cost over a plain step" in md
