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


@pytest.mark.full  # 1 min; the aot pass compiles Gemma's serving programs for an H200 with the kernel in make test
def test_dry_run_lowers_every_program_with_the_triton_kernel(tmp_path):
  res, md = _run(tmp_path, "--dry_run")
  assert res["dry_run"] and len(res["kernels"]) == 5
  assert all(k["lowered"] and k["triton_calls"] >= 1 for k in res["kernels"])
  assert res["decode"]["triton_calls"] >= 1
  assert set(res["verify"]) == {"1", "16", "64"}
  assert all(v["triton_calls"] >= 1 for row in res["verify"].values() for v in row.values())
  assert "Triton calls" in md
  # the cost table's own programs, exported, with the committed H200 table's ratios beside them
  progs = res["programs"]
  cols = {"0", "4", "eagle3_k4", "eagle_tree16"}
  assert {b: set(row) for b, row in progs["lowered"].items()} == {"1": cols, "16": cols}
  assert all(v["exported"] and v["triton_calls"] >= 1 for row in progs["lowered"].values() for v in row.values())
  with open(f"{ROOT}/{progs['compiler_table']}", encoding="utf-8") as f:
    table = json.load(f)["seconds"]
  assert len(progs["rows"]) == 8
  for r in progs["rows"]:
    row = table[str(r["batch"])]
    assert r["compiler_over_plain"] == pytest.approx(row[r["column"]] / row["0"]), r
    assert r["measured_over_plain"] is None  # a dry run measures nothing
  assert "| batch | program | measured ms | measured over plain | compiler ms | compiler over plain |" in md
  assert f"| 16 | EAGLE tree 16 | n/a | n/a | {table['16']['eagle_tree16'] * 1e3:.3f} |" in md


# make test-full (~4-9 min cold): the GPU script runs only where a device is lent; run this before a device run
@pytest.mark.slow
@pytest.mark.full
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
  rows = res["programs"]["rows"]
  assert len(rows) == 8 and all(r["measured_ms"] > 0 and r["measured_over_plain"] > 0 for r in rows)
  assert all(r["measured_over_plain"] == 1.0 for r in rows if r["column"] == "0")


def _device_check():
  import importlib.util
  spec = importlib.util.spec_from_file_location("device_check", f"{ROOT}/benchmarks/device_check.py")
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  return mod


def test_program_ratios_put_measured_and_compiler_ratios_over_their_own_plain_step():
  dc = _device_check()
  measured = {"1": {"0": 0.010, "4": 0.011, "eagle3_k4": 0.013, "eagle_tree16": 0.016},
              "16": {"0": 0.020, "4": 0.030}}
  compiler = {"1": {"0": 0.004, "4": 0.005, "eagle3_k4": 0.006, "eagle_tree16": 0.010},
              "16": {"0": 0.008, "4": 0.010, "eagle3_k4": 0.012}}
  rows = {(r["batch"], r["column"]): r for r in dc.program_ratios(measured, compiler)}
  assert set(rows) == {(b, c) for b in (1, 16) for c in ("0", "4", "eagle3_k4", "eagle_tree16")}
  assert rows[1, "0"]["measured_over_plain"] == 1.0 and rows[1, "0"]["compiler_over_plain"] == 1.0
  assert rows[1, "4"]["measured_over_plain"] == pytest.approx(1.1)
  assert rows[1, "4"]["compiler_over_plain"] == pytest.approx(1.25)
  assert rows[1, "4"]["agreement"] == pytest.approx(1.1 / 1.25)
  assert rows[1, "eagle_tree16"]["measured_ms"] == pytest.approx(16.0)
  assert rows[1, "eagle_tree16"]["compiler_ms"] == pytest.approx(10.0)
  assert rows[16, "4"]["measured_over_plain"] == pytest.approx(1.5)  # batch 16's own plain step
  assert rows[16, "4"]["compiler_over_plain"] == pytest.approx(1.25)
  # a program one side lacks: its ratio and the agreement are None, not a number
  assert rows[16, "eagle3_k4"]["measured_over_plain"] is None and rows[16, "eagle3_k4"]["agreement"] is None
  assert rows[16, "eagle3_k4"]["compiler_over_plain"] == pytest.approx(1.5)
  assert rows[16, "eagle_tree16"]["compiler_over_plain"] is None
  assert all(r["measured_over_plain"] is None for r in dc.program_ratios({}, compiler))
