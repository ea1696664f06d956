"""Compiling one program for a chip this host does not have, and what the compiled program says: XLA:TPU (libtpu,
Mosaic included) for an abstract TPU topology, deviceless XLA:GPU for a GPU target spec (configs/gpu_targets), and
jax.export for CUDA. `serve.aot` (the command), `serve.compiler.aot_costs` (the cost table) and the tests marked aot use it.

Per program: compiled or the compiler's error; HBM per chip (arguments, outputs, temporaries) against the chip's
capacity; the compiler's flops, bytes accessed and optimal_seconds; the Pallas kernels inside; host callbacks; and
any temporary that copies the KV cache.
"""

from __future__ import annotations

import os

# libtpu reads these when it loads: without them it looks for a TPU VM's metadata and logs errors.
os.environ.setdefault("TPU_ACCELERATOR_TYPE", "v5litepod-4")
os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
os.environ.setdefault("JAX_PLATFORMS", "cpu")  # the host runs on CPU; the topology's devices are abstract
# libtpu locks /tmp/libtpu_lockfile so that one process owns a host's chips; compiling owns no chip, and the
# tests' two workers (or a report beside a cost table) each load it.
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "1")  # XLA's C++ info lines ("Could not find cuda drivers")

import dataclasses  # noqa: E402
import logging  # noqa: E402
import re  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from importlib.metadata import PackageNotFoundError, version  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax import export  # noqa: E402
from jax.experimental import topologies  # noqa: E402

from serve.compiler import aot_breakdown  # noqa: E402
from spec_jax import sharding  # noqa: E402
from spec_jax.kernels.common import lowering_for  # noqa: E402

# Without the chips, jax's backend discovery fails on this host by design: the CUDA plugin (here for deviceless
# compiles) logs a traceback and the TPU probe an error. Compiling needs neither backend.
logging.getLogger("jax._src.xla_bridge").setLevel(logging.CRITICAL)

# Per-chip HBM, from the vendor's published specifications (device_kind as libtpu reports it).
CHIP_HBM_BYTES = {"TPU v4": 32 * 2**30, "TPU v5 lite": 16 * 2**30, "TPU v5": 95 * 2**30, "TPU v5p": 95 * 2**30,
                  "TPU v6 lite": 32 * 2**30, "TPU7x": 192 * 2**30}
# Host callbacks: a program that calls back into Python on every step would round-trip to the host.
_CALLBACK = re.compile(r'custom_call_target="[^"]*(callback|Callback)[^"]*"|is_host_transfer=true')
_KERNEL_CALL = re.compile(r'custom_call_target="(tpu_custom_call|__gpu\$xla\.gpu\.triton)"')
_KERNEL_NAME = re.compile(r'op_name="[^"]*?([\w-]+)/pallas_call"')
_INSTRUCTION = re.compile(r'^\s*(?:ROOT )?%([A-Za-z_][\w-]*?)(?:\.\d+)* = ')


GPU_TARGETS = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "configs",
                           "gpu_targets")


@dataclasses.dataclass(frozen=True)
class Target:
  """The chips compiled for: a TPU topology, or a GPU from its published target spec (deviceless XLA:GPU)."""
  name: str
  platform: str  # "tpu" or "gpu"
  devices: tuple
  chip: str
  capacity_bytes: int

  @property
  def attention_impl(self) -> str:
    return "pallas_tpu" if self.platform == "tpu" else "pallas_gpu"


def target(name: str) -> Target:
  """'v5e:2x2' (a TPU topology: jax.experimental.topologies) or 'h200' (configs/gpu_targets/h200.txtpb). A TPU
  topology may name its host count, 'v5e:4x4,hosts=2' (a v5e-16 slice of two 8-chip hosts; libtpu's own default for
  v5e:4x4 is four hosts of 4 chips): the programs then compile with collectives across those hosts."""
  full = name
  name, _, hosts = name.partition(",hosts=")
  spec = os.path.join(GPU_TARGETS, name.split(":")[0] + ".txtpb")
  if os.path.isfile(spec):
    with open(spec, encoding="utf-8") as f:
      text = f.read()
    shape = name.split(":")[1] if ":" in name else "1x1x1"
    try:
      topo = topologies.get_topology_desc(platform="cuda", topology=shape, target_config=text)
    except Exception as e:  # the CUDA plugin missing, or a shape it does not take
      raise RuntimeError(f"cannot describe GPU target {name!r}: {e}. Deviceless XLA:GPU comes with "
                         "pip install -e '.[gpu-aot]' (jax's CUDA plugin and ptxas)") from e
    memory = int(re.search(r"device_memory_size:\s*(\d+)", text).group(1))
    return Target(name, "gpu", tuple(topo.devices), topo.devices[0].device_kind, memory)
  try:
    topo = topologies.get_topology_desc(platform="tpu", topology_name=name, **_host_bounds(name, hosts))
  except Exception as e:  # libtpu missing, or a name it does not know, or hosts that do not tile it
    raise RuntimeError(f"cannot describe TPU topology {name!r}: {e}. The TPU compiler comes with "
                       "pip install -e '.[tpu-aot]' (libtpu); names look like v5e:2x2, v5e:2x4, v5p:2x2x1; GPU "
                       f"targets: {sorted(n.removesuffix('.txtpb') for n in os.listdir(GPU_TARGETS))}") from e
  chip = topo.devices[0].device_kind
  return Target(full, "tpu", tuple(topo.devices), chip, CHIP_HBM_BYTES.get(chip, 0))


def _host_bounds(name: str, hosts: str) -> dict:
  """libtpu's chips_per_host_bounds for 'hosts' hosts over a topology 'v5e:AxB[xC]': each host a block of the
  chips, split along the first axis that divides ('' = libtpu's default hosts)."""
  if not hosts:
    return {}
  dims = [int(d) for d in name.split(":")[-1].split("x")]
  dims += [1] * (3 - len(dims))
  n = int(hosts)
  for axis, d in enumerate(dims):
    if n >= 1 and d % n == 0:
      bounds = list(dims)
      bounds[axis] = d // n
      return {"chips_per_host_bounds": tuple(bounds)}
  raise ValueError(f"{hosts} hosts do not split topology {name} along one axis")


def mesh_of(devices, text: str):
  """A ('data', 'model') mesh over the topology's devices; '' = one chip (no mesh)."""
  sizes = sharding.parse_mesh(text)
  n = sizes["data"] * sizes["model"]
  if n == 1:
    return None
  if n != len(devices):
    raise ValueError(f"--mesh {text} needs {n} chips; the topology has {len(devices)}")
  devices = sorted(devices, key=lambda d: (d.process_index, d.id))
  return jax.sharding.Mesh(np.array(devices).reshape(sizes["data"], sizes["model"]), sharding.MESH_AXES)


def analyse(compiled, capacity: int) -> dict:
  """Memory, cost, kernels and host callbacks of one compiled program."""
  m = compiled.memory_analysis()
  mem = {"argument_bytes": int(m.argument_size_in_bytes), "output_bytes": int(m.output_size_in_bytes),
         "alias_bytes": int(m.alias_size_in_bytes), "temp_bytes": int(m.temp_size_in_bytes),
         "code_bytes": int(m.generated_code_size_in_bytes)}
  # Donated arguments alias their outputs: count those bytes once.
  mem["total_bytes"] = (mem["argument_bytes"] + mem["output_bytes"] - mem["alias_bytes"] + mem["temp_bytes"]
                        + mem["code_bytes"])
  cost = compiled.cost_analysis()  # None on XLA:GPU without a device
  if isinstance(cost, list):  # older jaxlibs: one dict per partition
    cost = cost[0] if cost else None
  cost = cost or {}
  text = compiled.as_text()
  kernels = {}  # Pallas kernels (Mosaic or Triton custom calls), by the name the kernel was given
  for line in text.splitlines():
    if _KERNEL_CALL.search(line):
      m = _KERNEL_NAME.search(line) or _INSTRUCTION.search(line)
      name = m.group(1) if m else "?"
      kernels[name] = kernels.get(name, 0) + 1
  known = lambda key: float(cost[key]) if key in cost else None
  return dict(memory=mem, capacity_bytes=capacity, fits=capacity <= 0 or mem["total_bytes"] <= capacity,
              flops=known("flops"), bytes_accessed=known("bytes accessed"),
              optimal_seconds=known("optimal_seconds"), kernels=kernels,
              host_callbacks=sorted(set(m.group(0) for m in _CALLBACK.finditer(text))))


# XLA:TPU's sliced prefetch of weights into VMEM emits `ConcatBitcast` custom calls that its cost model gives no
# cost (-1 s each, which turns optimal_seconds negative). With one slice per prefetch there are none.
UNSLICED = {"xla_tpu_sliced_prefetch_max_slices": 1}


def compiler_version(platform: str) -> str:
  name = "libtpu" if platform == "tpu" else "jax-cuda12-plugin"
  try:
    return f"{name} {version(name)}"
  except PackageNotFoundError:
    return f"{name} ?"


# Deviceless XLA:GPU cannot autotune (it would run candidate kernels): level 0 takes its default tilings, and
# without Triton GEMM fusions dots go to cuBLAS (with neither, a training step's f32[4088,640] dot found no
# tiling: "Couldn't find output tile sizes").
GPU_OPTIONS = {"xla_gpu_autotune_level": 0, "xla_gpu_enable_triton_gemm": False}


_ALLOCATION = re.compile(r"^allocation \d+: size (\d+)(.*):$")
_VALUE = re.compile(r"^ value: <\d+ (\S+) @\d+> \(size=(\d+),offset=\d+\): (\S+)")


def temporaries(dump_dir: str, top: int = 0) -> list:
  """The temporary buffers in device memory (HBM) of a compiled program, from XLA's buffer-assignment dump: the
  `top` largest (0: all) as [(bytes, instruction, shape)], biggest first. Parameters, outputs, constants, thread-local scratch and buffers of
  other memory spaces are not."""
  names = [n for n in os.listdir(dump_dir) if n.endswith("after_optimizations-buffer-assignment.txt")]
  if not names:
    return []
  values, keep = [], False
  with open(os.path.join(dump_dir, sorted(names)[-1]), encoding="utf-8") as f:
    for line in f:
      a = _ALLOCATION.match(line)
      if a:
        kind = a.group(2)
        # "color N": another memory space (TPU VMEM, where XLA prefetches buffers), not HBM.
        keep = not any(w in kind for w in ("parameter", "constant", "maybe-live-out", "thread-local", "output",
                                           "color"))
        continue
      v = _VALUE.match(line) if keep else None
      if v:
        values.append((int(v.group(2)), v.group(1), v.group(3).split("{")[0]))
  values.sort(reverse=True)
  return [{"bytes": b, "instruction": n, "shape": sh} for b, n, sh in (values[:top] if top else values)]


def cache_sized(temps: list, layer: tuple, itemsize: int, rows: tuple = (), pool: tuple = ()) -> list:
  """Temporaries that copy the KV cache (a layer of it, or more): `layer` = (slots, kv heads, capacity, head dim)
  of one layer's K on one chip; `rows`: the slot counts a copy may show (the chip's, and the whole batch's where
  the partitioner gathers the slots; default the layer's). A copy ends in the cache's (capacity, head dim)
  dimensions, has the slots' too (unless there is one slot), and at least half a layer's bytes (a weight re-laid
  out as [L, d_model, heads, head dim] can have the same numbers in other places). Logits, sampling and
  attention-score buffers are big too, but lack one of those; slot insert's one-row prefill cache has one row,
  not the slots. `pool` = (pages, kv heads, block, head dim) of one layer of the page pool on one chip: a
  temporary ending in (block, head dim), with the pages, of half a pool layer or more, is a copy of the pool (an
  8-bit pool's `itemsize` is 1: a dequantized copy is twice that); a float32 one with the pages and the block in
  its dims, of half a layer of the scales or more, is a copy of an 8-bit pool's scales, in whatever layout (theirs,
  [.., kv heads, block, pages], or one re-laid out for a kernel, such as the [.., pages, kv heads, block] that
  XLA:TPU once copied the whole scale pool into at every call)."""
  per_chip, _, capacity, head_dim = layer
  rows = set(rows) or {per_chip}
  half = int(np.prod(layer)) * itemsize // 2
  out = []
  for t in temps:
    dims = [int(d) for d in re.findall(r"\d+", t["shape"].split("[", 1)[-1])]
    if dims[-2:] == [capacity, head_dim] and (per_chip == 1 or rows & set(dims)) and t["bytes"] >= half:
      out.append(t)
    elif pool and dims[-2:] == list(pool[2:]) and pool[0] in dims and t["bytes"] >= np.prod(pool) * itemsize // 2:
      out.append(t)
    elif (pool and itemsize == 1 and t["shape"].startswith("f32") and pool[0] in dims and pool[2] in dims
          and t["bytes"] >= np.prod(pool[:3]) * 4 // 2):
      out.append(t)
  return out


def compile_program(prog, device, capacity: int, cost: bool = True, breakdown: bool = False,
                    hlo_path: str = "") -> dict:
  """Compile `prog` for `device` and analyse it. `cost=False` skips the second compile that a program needs for a
  cost estimate when XLA:TPU's sliced prefetch leaves it without one (what a check of memory alone can spare).
  `breakdown`: the step's bytes and time by role (serve/compiler/aot_breakdown.py), from the compile the cost came from;
  `hlo_path`: where to write that compile's optimized HLO text."""
  t0 = time.perf_counter()
  rec = {"name": prog.name, "note": prog.note, "pool_bytes": prog.pool_bytes, "pool_pages": prog.pool_pages}
  options = dict(GPU_OPTIONS) if device.platform == "gpu" else {}
  with tempfile.TemporaryDirectory() as dump:
    options.update(xla_dump_to=dump, xla_dump_hlo_pass_re="^$")  # the buffer assignment only, no pass dumps
    try:
      with jax.default_device(device):
        lowered = prog.fn.trace(*prog.args, **prog.kwargs).lower()
        compiled = lowered.compile(compiler_options=options)
    except Exception as e:  # the compiler's own message is the finding
      rec.update(compiled=False, error=f"{type(e).__name__}: {str(e)[:2000]}")
      if "Ran out of memory" in str(e):  # XLA:TPU refuses a program over the chip's HBM: it does not fit
        rec["fits"] = False
    else:
      # Every temporary is checked (a small program's cache copies rank below its logits); the report keeps 5.
      temps = temporaries(dump)
      rec.update(compiled=True, **analyse(compiled, capacity), cost_source="the program as compiled",
                 temporaries=temps[:5],
                 cache_copies=cache_sized(temps, prog.cache_layer, prog.cache_itemsize, prog.cache_rows,
                                          prog.cache_pool) if prog.cache_layer else [])
  if cost and rec["compiled"] and (rec["optimal_seconds"] or 0) < 0 and "ConcatBitcast" in compiled.as_text():
    with jax.default_device(device):
      compiled = lowered.compile(compiler_options=UNSLICED)
      cost = analyse(compiled, capacity)
    rec.update({k: cost[k] for k in ("flops", "bytes_accessed", "optimal_seconds")},
               cost_source="recompiled without sliced prefetch (its ConcatBitcast calls have no cost)")
  if cost and rec["compiled"] and (rec["optimal_seconds"] or 0) < 0:
    # Other custom calls without a cost (ZeroCrop, beside the all-reduce of a tiny program on a data mesh): the
    # compiler has no estimate, which is not a failure of the program.
    calls = sorted(set(re.findall(r'custom_call_target="([^"]+)"', compiled.as_text())) - {"tpu_custom_call"})
    rec.update(optimal_seconds=None, cost_source=f"none: XLA:TPU's cost model gives {calls or 'a call'} no cost")
  if hlo_path and rec["compiled"]:
    with open(hlo_path, "w", encoding="utf-8") as f:
      f.write(compiled.as_text())
  if breakdown and rec["compiled"]:
    # XLA:GPU's step is costed from the served, scanned program: its layer scan counted once per layer.
    rec["breakdown"] = aot_breakdown.breakdown(compiled.as_text(), device.device_kind, rec["optimal_seconds"],
                                               trips=device.platform == "gpu")
  rec["compile_seconds"] = round(time.perf_counter() - t0, 1)
  return rec


TRITON = "__gpu$xla.gpu.triton"


def export_cuda(prog) -> dict:
  """jax.export of one program for CUDA from this host (no GPU, no CUDA plugin): the lowering, Pallas' Triton
  kernels included. Only the export's check that the module uses no custom calls outside its stable list is
  lifted, for the Triton call (a serialized Triton kernel is tied to the jaxlib that made it)."""
  fn = getattr(prog.fn, "_program", prog.fn)  # the jitted function under sharding.settled
  rec = {"name": prog.name}
  try:
    with lowering_for("gpu"):
      exp = export.export(fn, platforms=["cuda"],
                          disabled_checks=[export.DisabledSafetyCheck.custom_call(TRITON)])(*prog.args,
                                                                                           **prog.kwargs)
    text = exp.mlir_module()
  except Exception as e:  # the lowering's own message is the finding
    rec.update(exported=False, error=f"{type(e).__name__}: {str(e)[:2000]}")
  else:
    rec.update(exported=True, triton_calls=text.count(TRITON), platforms=list(exp.platforms))
  return rec


def ok(rec: dict) -> bool:
  """Compiled, fits, no host callback, no copy of the cache, and a positive cost estimate where the compiler
  gives one (deviceless XLA:GPU gives none)."""
  return (rec["compiled"] and rec["fits"] and not rec["host_callbacks"] and not rec["cache_copies"]
          and (rec["optimal_seconds"] is None or rec["optimal_seconds"] > 0))
