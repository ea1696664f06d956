"""Every program exports for CUDA from this CPU host (jax.export, no GPU and no CUDA plugin), with the Pallas GPU
kernel forced: the lowering to Triton runs in Python, so block shapes and ops Triton would reject fail here.
(Compiling the exported kernels for an H200 is tests/aot/test_compile_for_accelerators.py's, where jax's CUDA
plugin is installed.)"""

from __future__ import annotations

import jax.numpy as jnp
import pytest

from serve.compiler import aot_compile, aot_programs as progs
from spec_jax.models.shapes import model_shape

METHODS = progs.METHODS  # every registered method


@pytest.fixture(scope="module")
def programs():
  config = model_shape("gemma3-270m")
  place = progs.Placement(None, None, lowering="gpu")
  out = progs.serving_programs(config, place, methods=METHODS, k=4, topk=4, nodes=16, max_num_seqs=4,
                               max_model_len=1024, dtype=jnp.bfloat16, impl="pallas_gpu", insert_buckets=[16, 512])
  out += progs.train_programs(config, place, kinds=["medusa", "eagle", "eagle3", "draft"], batch=2, seq_len=128)
  return out


@pytest.mark.full  # 1.4 min; the aot pass compiles Gemma's serving programs for an H200 with the kernel
def test_every_program_exports_for_cuda_with_the_triton_kernel(programs):
  names = [p.name for p in programs]
  # Every method's loop, chains and the trees of those that draft trees, and each trainer step.
  for m in METHODS:
    assert f"decode_loop[{m}]" in names
  for m in ("medusa", "eagle", "eagle3", "draft"):
    assert any(n.startswith(f"decode_loop[{m} tree") for n in names), m
  failed, no_kernel = [], []
  for prog in programs:
    rec = aot_compile.export_cuda(prog)
    if not rec["exported"]:
      failed.append((prog.name, rec["error"][:500]))
      continue
    assert rec["platforms"] == ["cuda"]
    attends = prog.name.startswith(("decode_loop", "insert", "prefill_chunk"))
    if attends and rec["triton_calls"] == 0:
      no_kernel.append(prog.name)
    if not attends:
      assert rec["triton_calls"] == 0, prog.name  # release, snapshot and training run no Pallas kernel
  assert failed == [] and no_kernel == []


def test_export_without_the_gpu_kernel_holds_no_triton_call():
  """The check can fail: the XLA attention exports with no Triton call at all."""
  config = model_shape("gemma3-270m")
  place = progs.Placement(None, None, lowering="gpu")
  prog = progs.serving_programs(config, place, methods=["none"], k=4, topk=1, nodes=0, max_num_seqs=2,
                                max_model_len=512, dtype=jnp.bfloat16, impl="xla", insert_buckets=[])[0]
  rec = aot_compile.export_cuda(prog)
  assert rec["exported"] and rec["triton_calls"] == 0
