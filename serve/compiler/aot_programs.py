"""The programs spec_jax runs, built from shapes alone: what `serve.aot` compiles for a TPU topology or exports
for CUDA without the chips or the weights.

A Program is a jitted function and the abstract arguments (jax.ShapeDtypeStruct with their shardings) it is
traced with. Every program here is the one the library runs, not a copy: `slots.insert`, `decode_loop`,
`prefill_chunk`, the trainer's step. Parameters come from each proposer's own shape functions and runtime-params
assembly, traced under `jax.eval_shape`, so nothing is allocated.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P, SingleDeviceSharding

from configs.train_base import get_config
from spec_jax import adaptive as adaptive_lib, sharding, slots
from spec_jax.cache import DEFAULT_BLOCK_SIZE, KVCache, contiguous_pages, kv_storage_dtype, pool_bytes
from spec_jax.config import ModelConfig, SamplingParams
from spec_jax.controls import Controls
from spec_jax.decode import decode_loop, make_spec
from spec_jax.kernels.common import lowering_for
from spec_jax.layouts import lay_out  # the layouts shard_params places them in (heads-major Q/K/V on TPU)
from spec_jax.models.transformer import param_shapes
from spec_jax.prefill import DEFAULT_CHUNK, bucket, prefill_chunk
from spec_jax.proposers import registry
from spec_jax.proposers.eagle3_layout import default_feature_layers as eagle3_layers
from train.tasks import build_task  # the trainer's step (train_programs): serve's one import of train/
from train.trainer import Trainer, TrainSpec, TrainState

SDS = jax.ShapeDtypeStruct
# The registry's methods that build from shapes alone (eagle builds an EAGLE-1 head and eagle3 an EAGLE-3 one).
METHODS = registry.abstract_methods()


@dataclasses.dataclass
class Program:
  name: str
  fn: Any  # a jitted function (with .trace)
  args: tuple
  kwargs: dict = dataclasses.field(default_factory=dict)
  note: str = ""
  # One layer's K (or V) of the target's cache on one chip: (slots, kv heads, capacity, head dim), and the slot
  # counts a copy of it may show (the chip's and the whole batch's, if the partitioner gathers the slots).
  cache_layer: tuple = ()
  cache_rows: tuple = ()
  cache_itemsize: int = 2
  cache_pool: tuple = ()  # one layer of the page pool on one chip: (pages, kv heads, block, head dim)
  # The decode state's page pools on one chip (every KV cache: the target's and a proposer's), in bytes and pages:
  # what the report sizes the largest pool that fits from.
  pool_bytes: int = 0
  pool_pages: int = 0


def cache_of(config: ModelConfig, slots: int, capacity: int, dtype, mesh=None, kv_cache_dtype: str = "auto") -> dict:
  """The cache-copy check's shapes: per chip under the mesh's layout (a chip's own cache copied is a copy too).
  An 8-bit cache's pool holds 1-byte values (a dequantized copy then shows at twice a pool layer's bytes)."""
  store = kv_storage_dtype(kv_cache_dtype)
  rows, heads = slots, config.num_kv_heads
  if mesh is not None:
    spec = sharding.cache_spec((config.num_layers, slots, heads, capacity, config.head_dim), mesh)
    rows //= mesh.shape[spec[1]] if spec[1] else 1
    heads //= mesh.shape[spec[2]] if spec[2] else 1
  pages = contiguous_pages(slots, -(-capacity // DEFAULT_BLOCK_SIZE), sharding.axis_size(mesh, "data"))
  pages //= sharding.axis_size(mesh, "data")
  return dict(cache_layer=(rows, heads, capacity, config.head_dim), cache_rows=tuple(sorted({rows, slots})),
              cache_itemsize=jnp.dtype(dtype if store is None else store).itemsize,
              cache_pool=(pages, heads, DEFAULT_BLOCK_SIZE, config.head_dim))


def pool_of(state, mesh=None) -> dict:
  """Bytes and pages of every KV page pool of an (abstract) decode state, on one chip."""
  chip = lambda a: (a.sharding.shard_shape(a.shape) if getattr(a, "sharding", None) is not None else a.shape)
  nbytes, pages = pool_bytes(state, chip)
  return dict(pool_bytes=nbytes, pool_pages=pages)


@dataclasses.dataclass(frozen=True)
class Placement:
  """Where the programs run: one device (mesh None), a ('data', 'model') mesh of the target's devices, or no
  device at all (device None: plain abstract arrays, for jax.export)."""
  device: Any = None
  mesh: Optional[jax.sharding.Mesh] = None
  lowering: Optional[str] = None  # without a device: the platform the kernels lower for ("gpu", "tpu")

  def _place(self, tree, on_mesh):
    if self.device is None:
      return tree
    if self.mesh is None:
      return _with(tree, lambda _: SingleDeviceSharding(self.device))
    return _with(tree, on_mesh)

  def params(self, tree):
    return lay_out(self._place(tree, sharding.param_shardings(tree, self.mesh) if self.mesh is not None else None))

  def state(self, tree):
    return self._place(tree, sharding.state_shardings(tree, self.mesh) if self.mesh is not None else None)

  def rows(self, tree):
    def one(x):
      split = x.shape and x.shape[0] % self.mesh.shape["data"] == 0
      return NamedSharding(self.mesh, P(*(("data",) + (None,) * (len(x.shape) - 1))) if split else P())
    return self._place(tree, one)

  def replicated(self, tree):
    return self._place(tree, lambda _: NamedSharding(self.mesh, P()))

  def context(self):
    """The context programs are traced in: the target device as the default one (the kernels read their platform
    from it), or, without a device (export), the platform to lower for."""
    if self.device is not None:
      return jax.default_device(self.device)
    return lowering_for(self.lowering) if self.lowering else contextlib.nullcontext()


def _with(tree, shardings):
  """Abstract arrays with the given shardings (a pytree of them, or a function of each leaf)."""
  if callable(shardings):
    return jax.tree.map(lambda x: SDS(x.shape, x.dtype, sharding=shardings(x)), tree)
  return jax.tree.map(lambda x, s: SDS(x.shape, x.dtype, sharding=s), tree, shardings)


abstract = registry.abstract_params


def target_params(config: ModelConfig, dtype) -> dict:
  return abstract(param_shapes(config), dtype)


def proposer_for(method: str, config: ModelConfig, target: dict, *, k: int, topk: int, nodes: int, impl: str,
                 draft_config: Optional[ModelConfig] = None):
  """-> (proposer, abstract params) for a method: its registry entry's abstract builder (the shapes of the heads
  this project trains, or publishes in). topk > 1: a token tree of `nodes` nodes, depth k, where the method's
  builder drafts trees."""
  return registry.build_abstract(method, config, target, k=k, topk=topk, nodes=nodes, impl=impl,
                                 draft_config=draft_config)


def empty_state(params, spec, batch: int, capacity: int):
  """The abstract DecodeState of `batch` free slots (slots.empty_state's own program, traced)."""
  costs = SDS((len(spec.ks),), jnp.float32)
  return jax.eval_shape(functools.partial(slots._empty, spec=spec, batch=batch, capacity=capacity,
                                          block_size=DEFAULT_BLOCK_SIZE, num_pages=None), params,
                        costs=costs, key=SDS((2,), jnp.uint32))


def serving_programs(config: ModelConfig, place: Placement, *, methods, k: int, topk: int, nodes: int,
                     max_num_seqs: int, max_model_len: int, dtype, impl: str, insert_buckets=(),
                     prefill_rows: int = 0, draft_config=None, adaptive: bool = True,
                     kv_cache_dtype: str = "auto") -> list:
  """Every program the server and serve.generate run, per method: the decode loop (chain, and tree where the
  method drafts trees), slot insert at each prompt bucket, release, snapshot, and the batch start's prefill chunk.
  The loops hold k = 0 among their options, as the server's do (the switches act without recompiling);
  adaptive=False compiles the drafting option alone (one branch: a quicker compile of the same step).
  kv_cache_dtype: every KV cache's (--kv_cache_dtype; an 8-bit pool and its scales)."""
  target = target_params(config, dtype)
  out = []
  shared_done = False
  for method in methods:
    trees = method in registry.METHODS and registry.METHODS[method].trees  # an unknown one: proposer_for says so
    for tree_k in ((1, topk) if trees and topk > 1 else (1,)):
      proposer, pparams = proposer_for(method, config, target, k=k, topk=tree_k, nodes=nodes if tree_k > 1 else 0,
                                       impl=impl, draft_config=draft_config)
      if tree_k > 1 and proposer.tree is None:  # its abstract builder drafts chains only
        continue
      ks = adaptive_lib.option_set(proposer.k, adaptive, proposer.tree)
      spec = make_spec(config, proposer, ks=ks, impl=impl, mesh=place.mesh, kv_cache_dtype=kv_cache_dtype)
      params = place.params({"target": target, "proposer": pparams})
      B = sharding.pad_rows(max_num_seqs, place.mesh)
      with place.context():
        state = place.state(empty_state(params, spec, B, max_model_len))
      label = method + (f" tree{proposer.tree.nodes}" if proposer.tree is not None else "")
      cache_info = cache_of(config, B, max_model_len, dtype, place.mesh, kv_cache_dtype)
      steps = place.replicated(SDS((), jnp.int32))
      out.append(Program(f"decode_loop[{label}]", decode_loop, (params, state, spec, steps),
                         note=f"{B} slots x {max_model_len} tokens, options k in {list(ks)}",
                         **pool_of(state, place.mesh), **cache_info))
      if tree_k > 1:
        continue
      # A request inserted into a running state: the prefill of one prompt plus a write of its row.
      for P_ in sorted(set(insert_buckets)):
        req = slots.Request(tokens=SDS((P_,), jnp.int32), prompt_len=SDS((), jnp.int32),
                            max_new=SDS((), jnp.int32),
                            sampling=jax.eval_shape(lambda: SamplingParams.make(1)),
                            draft_cap=SDS((), jnp.int32), key=SDS((2,), jnp.uint32),
                            tenant=SDS((), jnp.int32), controls=jax.eval_shape(lambda: Controls.make(1)),
                            logprobs=SDS((), jnp.int32), logprobs_mode=SDS((), jnp.int32),
                            pages=SDS((-(-max_model_len // DEFAULT_BLOCK_SIZE),), jnp.int32),
                            cached=SDS((), jnp.int32), known=SDS((max_model_len,), jnp.int32),
                            known_len=SDS((), jnp.int32))
        out.append(Program(f"insert[{label}, prompt {P_}]", slots.insert,
                           (params, state, place.replicated(SDS((), jnp.int32)), place.replicated(req), spec),
                           **cache_info))
      if shared_done:
        continue
      shared_done = True
      out.append(Program("release", slots.release, (state, place.replicated(SDS((), jnp.int32))), **cache_info))
      out.append(Program("snapshot", slots.snapshot, (state,), **cache_info))
      # serve.generate's batch start: prefill chunks of DEFAULT_CHUNK tokens over every row.
      rows = prefill_rows or B
      cache = place.state(jax.eval_shape(lambda: KVCache.init(config, rows, max_model_len, dtype)))
      chunk = min(DEFAULT_CHUNK, bucket(max_model_len // 2)[1])
      out.append(Program(f"prefill_chunk[{chunk} tokens x {rows} rows]", prefill_chunk,
                         (params["target"], place.rows(SDS((rows, chunk), jnp.int32)),
                          place.rows(SDS((rows,), jnp.int32)), cache, place.rows(SDS((rows,), jnp.int32)),
                          place.rows(SDS((rows, config.d_model), dtype))),
                         dict(config=config, impl=impl, mesh=place.mesh), **cache_info))
  return out


def train_programs(config: ModelConfig, place: Placement, *, kinds, batch: int, seq_len: int,
                   target_dtype=jnp.float32) -> list:
  """The trainer's step for each head kind (the target frozen, its features computed inside the step), with the
  reduced draft vocabulary this project's training configs use (configs/train_base.py draft_vocab). The frozen
  target in `target_dtype` (train.main's config.dtype: float32 by default; bfloat16 halves it, as a 70B target on
  a v5e-16 slice needs); the head and its optimizer state are float32 either way."""
  target = target_params(config, target_dtype)
  mesh = place.mesh
  if mesh is None and place.device is not None:  # one chip: a 1 x 1 mesh over it (the trainer's table needs one)
    mesh = jax.sharding.Mesh(np.array([place.device]).reshape(1, 1), sharding.MESH_AXES)
  out = []
  for kind in kinds:
    cfg = get_config("eagle" if kind == "eagle3" else kind)
    cfg.mlp_dim = 0
    cfg.draft_layers = 2
    cfg.feature_layers = eagle3_layers(config) if kind == "eagle3" else ()
    d2t = SDS((min(cfg.draft_vocab, config.vocab_size),), jnp.int32) if cfg.draft_vocab else None
    holder = {}

    def build(params, d2t):
      task, init, frozen, _ = build_task(cfg, config, params, d2t)
      holder["task"] = task
      return init, frozen

    with place.context():
      init, frozen = jax.eval_shape(build, target, d2t)
      trainer = Trainer(holder["task"], TrainSpec(batch_size=batch), mesh)  # its step only: nothing is written
      state = jax.eval_shape(lambda p: TrainState(p, trainer.tx.init(p), jnp.zeros((), jnp.int32),
                                                  jax.random.PRNGKey(0)), init)
    tokens, mask = SDS((batch, seq_len), jnp.int32), SDS((batch, seq_len), jnp.bool_)
    if mesh is not None:
      state = _with(state, trainer.state_shardings(state))
      frozen = _with(frozen, sharding.param_shardings(frozen, mesh))
      rows = NamedSharding(mesh, P("data") if batch % mesh.shape["data"] == 0 else P())
      tokens, mask = _with((tokens, mask), lambda _: rows)
    out.append(Program(f"train_step[{kind}]", trainer.train_step, (state, frozen, tokens, mask),
                       note=f"batch {batch} x {seq_len} tokens, target {jnp.dtype(target_dtype).name}, draft "
                            "vocabulary "
                            f"{d2t.shape[0] if d2t is not None else config.vocab_size}"))
  return out


def step_program(config: ModelConfig, place: Placement, *, method: str, k: int, topk: int, nodes: int, batch: int,
                 max_model_len: int, dtype, impl: str, kv_cache_dtype: str = "auto",
                 feature_layers: Optional[tuple] = None) -> Program:
  """The decode loop with one option, drafting k tokens (k = 0: plain decoding), its state donated as the server's
  is. A while loop's estimate is one trip of its body: one step, the verify-cost table's entry. feature_layers:
  an EAGLE-3 head's target layers in place of its default (aot_layers: a target of fewer layers than its own)."""
  target = target_params(config, dtype)
  proposer, pparams = proposer_for(method if k else "none", config, target, k=max(k, 1), topk=topk, nodes=nodes,
                                   impl=impl)
  if feature_layers is not None and getattr(proposer, "feature_layers", ()):
    proposer = dataclasses.replace(proposer, feature_layers=tuple(feature_layers))
  spec = make_spec(config, proposer, ks=(k,), impl=impl, mesh=place.mesh, kv_cache_dtype=kv_cache_dtype)
  params = place.params({"target": target, "proposer": pparams})
  B = sharding.pad_rows(batch, place.mesh)
  with place.context():
    state = place.state(empty_state(params, spec, B, max_model_len))
  label = "plain" if not k else (f"{method} tree{proposer.tree.nodes}" if proposer.tree is not None else
                                 f"{method} k={k}")
  return Program(f"step[{label}, batch {batch}]", decode_loop,
                 (params, state, spec, place.replicated(SDS((), jnp.int32))),
                 **cache_of(config, B, max_model_len, dtype, place.mesh, kv_cache_dtype))
