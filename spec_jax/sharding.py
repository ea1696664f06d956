"""Meshes and partition rules: one table maps logical axes to the mesh axes `data` and `model`.

Every array spec_jax keeps (parameters, KV caches, the decode state, proposer states) is named with logical axes
here, and the table turns those names into a NamedSharding. jit's SPMD partitioner does the rest: the decode loop
is the same function on one device or a pod; the mesh only changes the shardings of its inputs and the
constraints its body applies to the state it carries.

Tensor parallelism (`model`) splits query heads, the MLP and the vocabulary (the tied embedding / LM head, and so
the logits); `embed` and `head_dim` stay whole. K/V heads split over `model` only when their count divides by it:
Gemma 3 270M has one KV head, so with model > 1 every model shard computes the same K/V and keeps a full copy of
the cache rows of its data shard (the K/V projections are small; the cache is replicated `model` times).
A dimension that does not divide by its mesh axis stays whole (`logical_to_spec` falls back to None), so a tiny
model still runs on any mesh. Batch rows (slots) split over `data`; callers pad the row count to a multiple of it.
"""

from __future__ import annotations

import functools
from typing import Any, Optional, Sequence

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from spec_jax.layouts import lay_out
from spec_jax.param_axes import leaf_name as _leaf_name, param_axes
from spec_jax.quant import is_quantized

MESH_AXES = ("data", "model")

# logical axis -> mesh axis (None: replicated)
LOGICAL_RULES = {
    "batch": "data",
    "sequence": None,
    "heads": "model",
    "kv_heads": "model",  # only when the count divides `model` (see the module docstring)
    "head_dim": None,
    "embed": None,
    "mlp": "model",
    "vocab": "model",
    "layers": None,
    "features": "model",  # a proposer's projection's output features (EAGLE's fc, EAGLE-3's fuse)
}


# Decode-state fields that are not per row (shared by the whole batch): replicated.
REPLICATED_STATE = {"spec_enabled", "step", "adapt.costs", "adapt.since_probe", "adapt.uses"}
CACHE_AXES = ("layers", "batch", "kv_heads", "sequence", "head_dim")  # KVCache.k / .v: pages split like rows


def parse_mesh(text: str) -> dict:
  """'data:4,model:2' -> {'data': 4, 'model': 2}; '' -> one device. Axes not named get size 1."""
  sizes = {"data": 1, "model": 1}
  for part in filter(None, (p.strip() for p in (text or "").split(","))):
    name, _, n = part.partition(":")
    if name not in MESH_AXES or not n.strip().isdigit() or int(n) < 1:
      raise ValueError(f"--mesh wants 'data:N,model:M' with N, M >= 1 (axes {MESH_AXES}), got {text!r}")
    sizes[name] = int(n)
  return sizes


def make_mesh(text_or_sizes="", devices: Optional[Sequence] = None) -> Optional[Mesh]:
  """A ('data', 'model') mesh over all (or the given) devices; None for a one-device run ('' or data:1,model:1,
  whatever the device count: the default device). Otherwise the product of the sizes must equal the device count."""
  sizes = parse_mesh(text_or_sizes) if isinstance(text_or_sizes, str) else dict(text_or_sizes)
  n = sizes["data"] * sizes["model"]
  if n == 1:
    return None
  devices = list(jax.devices() if devices is None else devices)
  if n != len(devices):
    raise ValueError(f"mesh data:{sizes['data']},model:{sizes['model']} needs {n} devices, but there are "
                     f"{len(devices)} ({jax.process_count()} process(es)); on CPU simulate them with "
                     f"XLA_FLAGS=--xla_force_host_platform_device_count={n}")
  # Process-major order keeps each host's devices together on `data`, so a host feeds its own rows.
  devices = sorted(devices, key=lambda d: (d.process_index, d.id))
  return Mesh(np.array(devices).reshape(sizes["data"], sizes["model"]), MESH_AXES)


def axis_size(mesh: Optional[Mesh], axis: str) -> int:
  return 1 if mesh is None else mesh.shape[axis]


def pad_rows(n: int, mesh: Optional[Mesh]) -> int:
  """Rows a batch of n runs with: a multiple of the `data` axis."""
  d = axis_size(mesh, "data")
  return -(-n // d) * d


def logical_to_spec(axes: Sequence[Optional[str]], shape: Sequence[int], mesh: Mesh) -> P:
  """Logical axis names -> PartitionSpec under LOGICAL_RULES; a dimension that does not divide stays whole,
  and a mesh axis is used at most once (the first dimension that asks for it)."""
  used, out = set(), []
  for name, dim in zip(axes, shape):
    m = LOGICAL_RULES.get(name) if name else None
    if m is None or m in used or dim % mesh.shape[m]:
      out.append(None)
    else:
      used.add(m)
      out.append(m)
  return P(*out)


def cache_spec(shape: Sequence[int], mesh: Mesh) -> P:
  """The PartitionSpec of a KV cache's K or V ([L, B, Hkv, S, D]) under the table: what a per-shard operation on
  the cache (a kernel, a row write, tree compaction) takes as its `shard_map` spec."""
  return logical_to_spec(CACHE_AXES, shape, mesh)


def _path_str(path) -> str:
  return ".".join(str(getattr(p, "name", getattr(p, "key", getattr(p, "idx", "")))) for p in path)


def param_shardings(params, mesh: Mesh):
  """A NamedSharding for every parameter leaf (any pytree of dicts: target, proposer or both)."""
  def one(path, x):
    return NamedSharding(mesh, logical_to_spec(param_axes(_leaf_name(path), np.ndim(x)), np.shape(x), mesh))
  return jax.tree_util.tree_map_with_path(one, params)


class CacheLeaf:
  """A KV cache to the table: spec_jax/cache.py's KVCache subclasses it (the cache imports this table for its
  per-shard operations, so the table names caches by this base): k, v by CACHE_AXES, lengths and pages by row."""


def _is_cache(x) -> bool:
  return isinstance(x, CacheLeaf)


def state_shardings(state, mesh: Mesh):
  """Shardings for a DecodeState, a proposer state or any pytree of per-row arrays: KV caches by CACHE_AXES,
  the batch-wide fields of REPLICATED_STATE replicated, every other array split on its leading (row) axis."""
  def cache(c):
    spec = cache_spec(c.k.shape, mesh)
    kv = NamedSharding(mesh, spec)
    # [L, Hkv, block, N]: split like the pages they scale (and the heads)
    scale = NamedSharding(mesh, P(spec[0], spec[2], None, spec[1])) if c.quantized else None
    return c.replace(k=kv, v=kv, lengths=NamedSharding(mesh, logical_to_spec(("batch",), c.lengths.shape, mesh)),
                     pages=NamedSharding(mesh, logical_to_spec(("batch", None), c.pages.shape, mesh)),
                     k_scale=scale, v_scale=scale)

  def one(path, x):
    if _is_cache(x):
      return cache(x)
    if _path_str(path) in REPLICATED_STATE or np.ndim(x) == 0:
      return NamedSharding(mesh, P())
    return _row_sharding(x, mesh)

  return jax.tree_util.tree_map_with_path(one, state, is_leaf=_is_cache)


def constrain_state(state, mesh: Optional[Mesh]):
  """Inside jit: pin a state's layout to the table (a no-op without a mesh)."""
  if mesh is None:
    return state
  return jax.lax.with_sharding_constraint(state, state_shardings(state, mesh))


def put(tree, shardings):
  """Host values (numpy, or arrays every process holds in full) -> global arrays with these shardings. Works on
  one process and on many: each process fills only its own devices' shards from its full copy."""
  def one(x, s):
    if jax.process_count() == 1 or (isinstance(x, jax.Array) and not x.is_fully_addressable):
      return jax.device_put(x, s)  # one process, or already global: reshard
    x = np.asarray(x)
    return jax.make_array_from_callback(x.shape, s, lambda idx: x[idx])
  return settle(jax.tree.map(one, tree, shardings))


def on_cpu_mesh(x) -> bool:
  """Whether x is a concrete array spread over several CPU devices (not a tracer inside jit)."""
  if not isinstance(x, jax.Array) or isinstance(x, jax.core.Tracer):
    return False
  devices = x.sharding.device_set
  return len(devices) > 1 and next(iter(devices)).platform == "cpu"


def settle(tree):
  """Wait for `tree`'s arrays when they lie on several CPU devices; otherwise return at once.

  Why: XLA:CPU (jaxlib 0.10) can deadlock when programs over several CPU devices are dispatched back to back
  without waiting: one device's thread never reaches a collective's rendezvous, and after 60 s the process aborts
  ("Expected 8 threads to join the rendezvous, but only 7 of them arrived"; tests/multidevice/test_mesh_dispatch.py).
  With each program waited for, only one is ever in flight. GPU and TPU, and one device, keep asynchronous dispatch.
  """
  first = next(iter(jax.tree.leaves(tree)), None)
  if on_cpu_mesh(first):
    jax.block_until_ready(tree)
  return tree


class settled:
  """A jitted program whose calls `settle` their outputs (see settle); attributes such as `.lower` pass through."""

  def __init__(self, program):
    self._program = program
    functools.update_wrapper(self, program)

  def __call__(self, *args, **kwargs):
    return settle(self._program(*args, **kwargs))

  def __getattr__(self, name):
    return getattr(self._program, name)


def shard_params(params, mesh: Optional[Mesh]):
  """Parameters placed by the table, the attention projections heads-major on TPU (spec_jax/layouts.py)."""
  if mesh is None:
    return lay_out(params)
  if is_quantized(params):  # their tiled layout has no entry in the logical-axis table yet
    raise ValueError("quantized weights (--quantize, qdraft) run on one device for now; drop --mesh or "
                     "quantize none")
  return lay_out(put(params, param_shardings(params, mesh)))


def replicated(tree, mesh: Optional[Mesh]):
  """Host values -> replicated global arrays (a no-op without a mesh)."""
  if mesh is None:
    return tree
  return put(tree, jax.tree.map(lambda _: NamedSharding(mesh, P()), tree))


def rows(tree, mesh: Optional[Mesh]):
  """Host values with a leading row axis -> global arrays split over `data` (a no-op without a mesh)."""
  if mesh is None:
    return tree
  return put(tree, jax.tree.map(lambda x: _row_sharding(x, mesh), tree))


def _row_sharding(x, mesh: Mesh) -> NamedSharding:
  """The leading (row) axis over `data`, the rest whole."""
  return NamedSharding(mesh, logical_to_spec(("batch",) + (None,) * (np.ndim(x) - 1), np.shape(x), mesh))


def to_host(x) -> np.ndarray:
  """A (possibly multi-host) array as numpy on every process, gathered with a collective when needed."""
  if isinstance(x, jax.Array) and not x.is_fully_addressable:
    return np.asarray(multihost_utils.process_allgather(x, tiled=True))
  return np.asarray(x)


def describe(mesh: Optional[Mesh]) -> dict:
  if mesh is None:
    return {"data": 1, "model": 1, "devices": 1, "processes": jax.process_count()}
  return {"data": mesh.shape["data"], "model": mesh.shape["model"], "devices": mesh.size,
          "processes": jax.process_count()}


def spec_of(x) -> Any:
  """The PartitionSpec of an array's sharding (for tests and reports)."""
  return getattr(x.sharding, "spec", None)
