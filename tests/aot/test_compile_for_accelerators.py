"""Every program compiles for TPU (XLA:TPU and Mosaic, from libtpu) and for an H200 (deviceless XLA:GPU, Triton
kernels through ptxas), on this CPU host, from shapes alone (serve.aot).

Marked `aot`: these need the compilers of `make install-aot` (.venv-aot) and run there (`make test-aot`, a step
of `make test`). Each test compiles one program, so two xdist workers share them. Where the compiler is
missing they skip, unless SPEC_JAX_AOT=required (what make test-aot sets): then a missing compiler fails.
"""

from __future__ import annotations

import importlib.util
import os

import jax
import jax.numpy as jnp
import pytest

from serve.compiler import aot_compile, aot_programs as progs
from spec_jax.models.shapes import model_shape

pytestmark = pytest.mark.aot
REQUIRED = os.environ.get("SPEC_JAX_AOT") == "required"


def _need(module: str, what: str):
  if importlib.util.find_spec(module) is None:
    if REQUIRED:
      pytest.fail(f"{what} is not installed in this environment (make install-aot)")
    pytest.skip(f"{what} not installed (make install-aot)")


def _programs(target_name, shape, mesh="", *, methods, slots, tokens, topk=1, train=()):
  tgt = aot_compile.target(target_name)
  place = progs.Placement(tgt.devices[0], aot_compile.mesh_of(list(tgt.devices), mesh))
  config = model_shape(shape)
  out = progs.serving_programs(config, place, methods=methods, k=4, topk=topk, nodes=16, max_num_seqs=slots,
                               max_model_len=tokens, dtype=jnp.bfloat16, impl=tgt.attention_impl,
                               insert_buckets=[16], adaptive=False)
  out += progs.train_programs(config, place, kinds=train, batch=4, seq_len=256)
  return tgt, {p.name: p for p in out}


def _check(tgt, prog, *, kernel: bool, cost: bool = True):
  """Compiled, fits, no host callback, no copy of the cache, the attention kernel inside (serving programs), and on
  TPU a positive cost estimate (`cost`: where the test asks for one; a second compile for some programs)."""
  rec = aot_compile.compile_program(prog, tgt.devices[0], tgt.capacity_bytes, cost=cost)
  assert rec["compiled"], rec.get("error")
  assert rec["fits"], rec["memory"]
  assert rec["host_callbacks"] == []
  assert rec["cache_copies"] == [], rec["temporaries"]
  want = "spec_attention_tpu" if tgt.platform == "tpu" else "spec_attention_gpu"
  if kernel:
    assert rec["kernels"].get(want, 0) >= 1, rec["kernels"]
  if tgt.platform == "tpu" and cost:
    assert rec["optimal_seconds"] > 0, rec
  return rec


def _global_bytes(args) -> int:
  return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(args) if hasattr(x, "dtype"))


# The longest compiles (1.5-15 minutes each on 2 busy cores) run in `make test-aot` only, not in `make test`'s
# budget: serve.aot's reports (benchmarks/reports/aot) compile every program at full size anyway.
FULL = pytest.mark.aot_full
# The 16-node tree on a v5e: the Llama shape's tree on v5e:2x2 below runs in make test. The EAGLE chain on a v5e
# (~3-6 min): its verify is the n-gram chain's (k = 4, here) and its head and cache are the trees' (Llama's below,
# Gemma's on data:4), each compiled in make test; the EAGLE chain itself on the H200 below.
GEMMA_TPU = ["decode_loop[none]", "decode_loop[ngram]", "decode_loop[suffix]",
             pytest.param("decode_loop[eagle]", marks=FULL),
             pytest.param("decode_loop[eagle tree16]", marks=FULL), "insert[eagle, prompt 16]",
             pytest.param("train_step[eagle]", marks=FULL)]


@pytest.mark.parametrize("name", GEMMA_TPU)
def test_gemma3_270m_on_one_v5e_chip(name):
  _need("libtpu", "libtpu (the TPU compiler)")
  tgt, ps = _programs("v5e:2x2", "gemma3-270m", methods=["none", "ngram", "suffix", "eagle"], slots=4, tokens=1024,
                      topk=4, train=["eagle"])
  _check(tgt, ps[name], kernel=not name.startswith("train"))


LLAMA_SHARDED = ["decode_loop[none]", "decode_loop[ngram]", pytest.param("decode_loop[eagle]", marks=FULL), "decode_loop[eagle tree16]",
                 "insert[ngram, prompt 16]", pytest.param("train_step[eagle]", marks=FULL)]


@pytest.mark.parametrize("name", LLAMA_SHARDED)
def test_llama3_8b_sharded_model4_on_v5e_2x2(name):
  """Tensor parallel over four chips: the Mosaic kernel must sit in a shard_map (the SPMD partitioner refuses to
  split it), the eight KV heads two to a chip; the weights and a 8 x 4096-token cache fit 16 GiB per chip, each
  chip holding about a quarter of the program's arguments (the trainer's frozen float32 target too), not all.
  The cost estimate is Gemma's tests' to check (here a second compile for the EAGLE programs). The plain loop
  once carried the cache with its layers minor (two kv heads a chip), copying it in and back every call."""
  _need("libtpu", "libtpu (the TPU compiler)")
  tgt, ps = _programs("v5e:2x2", "llama3-8b", "model:4", methods=["none", "ngram", "eagle"], slots=8, tokens=4096,
                      topk=4, train=["eagle"])
  rec = _check(tgt, ps[name], kernel=not name.startswith("train"), cost=False)
  assert rec["memory"]["argument_bytes"] < _global_bytes(ps[name].args) / 3


def test_a_tree_on_a_data_mesh_copies_no_cache():
  """Rows split over four chips, two each: each chip writes its own rows and moves its own rows' accepted path
  (write_rows and tree.compact_accepted in a shard_map). Left to the partitioner, the per-row slices of a cache
  split over `data` gathered the whole cache on every chip, every step (five 1 GiB copies for Llama-8B on a
  data:4,model:4 pod), and the row writes copied each chip's own cache."""
  _need("libtpu", "libtpu (the TPU compiler)")
  tgt, ps = _programs("v5e:2x2", "gemma3-270m", "data:4", methods=["eagle"], slots=8, tokens=1024, topk=4)
  _check(tgt, ps["decode_loop[eagle tree16]"], kernel=True, cost=False)


def test_a_copy_of_a_cache_layer_is_caught():
  """The negative control of the check above: a program that materializes one layer of the cache (as the old
  kernel wrapper did) is flagged; the same program reading the layer in place is not."""
  _need("libtpu", "libtpu (the TPU compiler)")
  tgt = aot_compile.target("v5e:2x2")
  sh = jax.sharding.SingleDeviceSharding(tgt.devices[0])
  # A layer of 256 MB: XLA:TPU keeps a small temporary (8 MB at 8 x 2048) in the chip's VMEM, which is not HBM
  # and not counted, so the control must be larger than VMEM.
  L, B, H, S, D = 4, 32, 1, 16384, 256
  cache = jax.ShapeDtypeStruct((L, B, H, S, D), jnp.bfloat16, sharding=sh)
  layer = jax.ShapeDtypeStruct((), jnp.int32, sharding=sh)

  def copying(c, i):
    one = jax.lax.optimization_barrier(jax.lax.dynamic_index_in_dim(c, i, keepdims=False) * 2)
    return one.sum(axis=(2, 3))

  def in_place(c, i):
    return (jax.lax.dynamic_index_in_dim(c, i, keepdims=False) * 2).sum(axis=(2, 3))

  found = {}
  for name, fn in (("copying", copying), ("in_place", in_place)):
    prog = progs.Program(name, jax.jit(fn), (cache, layer), cache_layer=(B, H, S, D))
    found[name] = aot_compile.compile_program(prog, tgt.devices[0], tgt.capacity_bytes)["cache_copies"]
  assert found["in_place"] == []
  assert [c["shape"] for c in found["copying"]] == ["bf16[32,1,16384,256]"], found["copying"]


GEMMA_H200 = ["decode_loop[none]", "decode_loop[eagle]", "decode_loop[eagle tree16]", "insert[eagle, prompt 16]", "prefill_chunk[512 tokens x 4 rows]",
              "train_step[eagle]"]


@pytest.mark.parametrize("name", GEMMA_H200)
def test_gemma3_270m_on_an_h200(name):
  """Deviceless XLA:GPU from the H200's published target spec: the Triton kernel goes through ptxas, with the
  H200's shared memory and register limits (the prefill chunk once asked for 557,056 bytes of 232,448). XLA:GPU
  once copied the EAGLE layer's cache at every draft (nothing ordered its attention call before the row writes)."""
  _need("jax_plugins.xla_cuda12", "jax's CUDA plugin")
  tgt, ps = _programs("h200", "gemma3-270m", methods=["none", "eagle"], slots=4, tokens=1024, topk=4,
                      train=["eagle"])
  rec = _check(tgt, ps[name], kernel=not name.startswith("train"))
  if name.startswith("insert"):  # its one-row LM head once made XLA:GPU copy the whole head in float32 (671 MB)
    config = model_shape("gemma3-270m")
    assert max([t["bytes"] for t in rec["temporaries"]], default=0) < config.vocab_size * config.d_model * 2, \
        rec["temporaries"]


def test_a_kernel_over_the_h200_shared_memory_fails():
  """The GPU check can fail: a block of 1024 KV slots at head size 256 does not fit an SM's shared memory."""
  _need("jax_plugins.xla_cuda12", "jax's CUDA plugin")
  from spec_jax.kernels.pallas_gpu import attention_pallas_gpu
  tgt = aot_compile.target("h200")
  sh = jax.sharding.SingleDeviceSharding(tgt.devices[0])
  s = lambda shape, dt=jnp.bfloat16: jax.ShapeDtypeStruct(shape, dt, sharding=sh)
  B, T, Hq, H, S, D = 2, 5, 8, 1, 4096, 256
  args = (s((B, T, Hq, D)), s((B, T, H, D)), s((B, T, H, D)), s((1, B, H, S, D)), s((1, B, H, S, D)),
          s((B, T), jnp.int32), s((B,), jnp.int32))

  def fn(block_k):
    return jax.jit(lambda q, kn, vn, kc, vc, p, l: attention_pallas_gpu(q, kn, vn, kc, vc, p, l, scale=0.1,
                                                                        layer=0, block_k=block_k))
  fits = aot_compile.compile_program(progs.Program("block 64", fn(64), args), tgt.devices[0], tgt.capacity_bytes)
  too_big = aot_compile.compile_program(progs.Program("block 1024", fn(1024), args), tgt.devices[0], tgt.capacity_bytes)
  assert fits["compiled"], fits.get("error")
  assert not too_big["compiled"] and "shared memory" in too_big["error"].lower(), too_big


def test_the_command_reports_and_fails_on_what_does_not_fit(tmp_path):
  """serve.aot end to end: Gemma 3 270M fits one v5e chip (exit 0, both reports written); Llama-3 70B's weights
  (140 GB) do not fit its 16 GiB (exit 1, the program marked as not fitting)."""
  _need("libtpu", "libtpu (the TPU compiler)")
  import json
  import subprocess
  import sys
  from tests.conftest import ROOT
  base = [sys.executable, "-m", "serve.aot", "--topology=v5e:2x2", "--methods=none", "--train_kinds=",
          "--insert_buckets=16", "--max_num_seqs=2", "--max_model_len=512"]
  ok = subprocess.run(base + ["--model_shape=gemma3-270m", f"--output={tmp_path / 'gemma'}"], cwd=ROOT,
                      capture_output=True, text=True, timeout=900)
  assert ok.returncode == 0, ok.stdout[-2000:] + ok.stderr[-2000:]
  report = json.loads((tmp_path / "gemma" / "report.json").read_text())
  assert report["run"]["chip"] == "TPU v5 lite" and all(aot_compile.ok(r) for r in report["programs"])
  assert "programs compiled and fit" in (tmp_path / "gemma" / "report.md").read_text()
  big = subprocess.run(base + ["--model_shape=llama3-70b", f"--output={tmp_path / 'llama'}"], cwd=ROOT,
                       capture_output=True, text=True, timeout=900)
  assert big.returncode == 1, big.stdout[-2000:] + big.stderr[-2000:]
  report = json.loads((tmp_path / "llama" / "report.json").read_text())
  loop = next(r for r in report["programs"] if r["name"] == "decode_loop[none]")
  assert loop["fits"] is False
  # Compiled with its 140 GB of arguments counted, or refused by XLA:TPU itself for running out of HBM.
  assert (loop["memory"]["argument_bytes"] > 100e9 if loop["compiled"] else "Ran out of memory" in loop["error"])


@FULL  # 3.6 min; tests/aot/test_cost_guard.py compiles and costs the same programs in make test
def test_the_cost_table_is_written_in_the_controllers_format(tmp_path):
  """serve.aot --cost_table end to end on a small model shape: every step compiles with a positive estimate, the
  entries are what the adaptive controller loads (serve.jobs.step_costs.load_costs) and hold the estimates' ratios to a
  plain step, labelled as the compiler's, and the plot is written beside the table."""
  _need("libtpu", "libtpu (the TPU compiler)")
  import json
  import subprocess
  import sys
  from serve.jobs.step_costs import load_costs
  from tests.conftest import ROOT
  shape = dict(vocab_size=4096, d_model=256, num_layers=2, num_heads=4, num_kv_heads=1, head_dim=128, mlp_dim=512,
               sliding_window=128, global_every=2, query_pre_attn_scalar=128.0, max_seq_len=1024, bos_id=2,
               eos_ids=[1], pad_id=0, name="small-gemma")
  (tmp_path / "shape.json").write_text(json.dumps(shape))
  out = tmp_path / "costs.json"
  run = subprocess.run([sys.executable, "-m", "serve.aot", "--topology=v5e:2x2", f"--model_shape={tmp_path / 'shape.json'}",
                        "--max_model_len=512", "--cost_batches=1,4", "--cost_ks=1,2", "--cost_trees=4",
                        "--cost_tree_depth=2", "--eagle_topk=2", f"--cost_table={out}"], cwd=ROOT,
                       capture_output=True, text=True, timeout=900)
  assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
  table = json.loads(out.read_text())
  assert "compiler estimate" in table["source"] and table["failures"] == [] and table["chip"] == "TPU v5 lite"
  assert set(table["seconds"]) == {"1", "4"}
  for b in ("1", "4"):
    row = table["seconds"][b]
    assert set(row) == {"0", "1", "2", "eagle_tree4"} and all(v > 0 for v in row.values())
    loaded = load_costs(str(out), "ngram", "bfloat16", (0, 1, 2), int(b))
    assert loaded is not None
    entry = table[f"ngram/bfloat16/k2/b{b}"]
    assert entry["estimate"] == "compiler" and entry["ks"] == [0, 1, 2]
    assert entry["costs"][0] == [1.0, round(row["1"] / row["0"], 4), round(row["2"] / row["0"], 4)]
    assert table[f"eagle_tree4/bfloat16/k2/b{b}"]["costs"][0] == [1.0, round(row["eagle_tree4"] / row["0"], 4)]
  assert (tmp_path / "costs.png").stat().st_size > 10_000


def _triton_module(D: int, T: int, tree: bool) -> tuple:
  """The Triton IR that Pallas lowers the GPU kernel to (captured from jax's Triton lowering: the module XLA hands
  Triton inside the custom call)."""
  from jax._src.pallas.triton import pallas_call_registration as registration
  from spec_jax.kernels.common import lowering_for
  from spec_jax.kernels.pallas_gpu import attention_pallas_gpu
  modules = []
  lower = registration.lowering.lower_jaxpr_to_triton_module

  def capture(*a, **k):
    result = lower(*a, **k)
    modules.append(result.module.operation.get_asm(enable_debug_info=False))
    return result

  registration.lowering.lower_jaxpr_to_triton_module = capture
  try:
    B, Hq, H, S = 4, 8, 2, 1024
    s = lambda shape, dt=jnp.bfloat16: jax.ShapeDtypeStruct(shape, dt)
    args = (s((B, T, Hq, D)), s((B, T, H, D)), s((B, T, H, D)), s((1, B, H, S, D)), s((1, B, H, S, D)),
            s((B, T), jnp.int32), s((B,), jnp.int32))
    mask = jnp.tril(jnp.ones((T, T), bool)) if tree else None
    with lowering_for("gpu"):
      jax.jit(lambda *a: attention_pallas_gpu(*a, scale=0.1, layer=0, tree_mask=mask, num_splits=1)).trace(
          *args).lower(lowering_platforms=("cuda",))
  finally:
    registration.lowering.lower_jaxpr_to_triton_module = lower
  return modules[-1]


@pytest.mark.parametrize("D,T,tree", [(256, 1, False), (128, 5, False), (128, 16, True), (64, 300, False)])
def test_the_triton_package_compiles_the_gpu_kernel_for_sm90(tmp_path, D, T, tree):
  """Triton's own compiler (the `triton` package, with its ptxas) takes the kernel's Triton IR to PTX and a cubin
  for sm_90, on this CPU, within an H200's shared memory per block (opt-in 232,448 bytes)."""
  _need("triton", "the triton package")
  import triton
  from triton.backends.compiler import GPUTarget
  path = tmp_path / "kernel.ttir"
  path.write_text(_triton_module(D, T, tree))
  # The kernel's own stage count; 8 warps, the most it launches with.
  kernel = triton.compile(str(path), target=GPUTarget("cuda", 90, 32), options={"num_warps": 8, "num_stages": 2})
  assert ".target sm_90" in kernel.asm["ptx"] and len(kernel.asm["cubin"]) > 1000
  assert 0 < kernel.metadata.shared <= 232448, kernel.metadata.shared
