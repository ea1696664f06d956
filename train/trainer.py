"""A small trainer for heads and drafts on a frozen target.

optax AdamW with linear warmup then cosine decay and global-norm clipping; jitted train and eval steps; the frozen
target's features computed on the fly inside the step; orbax checkpoints (the last `keep` plus the best by eval
loss) holding params, optimizer state, step and rng. The batch of step s is a pure function of (seed, s), so a
run resumed from a checkpoint reads exactly the batches an uninterrupted run would have, and its final params are
bitwise equal.

With a ('data', 'model') Mesh (spec_jax.sharding.make_mesh) the trainable params and the frozen target get the
shardings of spec_jax.sharding's logical-axis table (tensor parallel over 'model', Medusa's heads and EAGLE's fc
split on their output features as in serving), each optimizer-state leaf the
sharding of the param it mirrors (replicated when it mirrors none: counts, scalars), and every batch is split over
'data'. On several processes (train.main on many hosts) each process reads only the rows of a batch that its own
devices hold (put_local_rows) and the step is one SPMD program over every host's devices. The step pins its
output state to those shardings; without a mesh everything stays on one device, as before. Checkpoints are saved
sharded and restored straight into the shardings of the current mesh (abstract arrays carrying the target
sharding), so a run saved on one mesh resumes on another, or on one device.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
import sys
import time
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
from jax.experimental import multihost_utils
import numpy as np
import optax
import orbax.checkpoint as ocp
from flax import struct
from jax.sharding import NamedSharding, PartitionSpec as P
from tqdm import tqdm

from spec_jax import sharding as shd
from train import data as data_lib


@dataclasses.dataclass(frozen=True)
class TrainSpec:
  steps: int = 1000
  batch_size: int = 8
  lr: float = 1e-3
  warmup: int = 50
  end_lr_fraction: float = 0.05
  weight_decay: float = 0.0
  clip: float = 1.0
  eval_every: int = 200
  eval_batches: int = 4
  save_every: int = 200
  keep: int = 2
  log_every: int = 10
  seed: int = 0
  workdir: str = "/tmp/spec_jax_train"
  progress: bool = True
  cache_features: bool = False  # run the frozen target once over the data instead of at every step
  feature_dir: str = ""  # with cache_features: also keep them on disk here, shared by runs on the same data
  # The cached features' storage dtype: "bfloat16" halves the host memory and disk of "float32"; the step reads
  # them back as float32 either way (docs/benchmark-log.md section 14 measures what the rounding costs).
  feature_dtype: str = "float32"


FEATURE_DTYPES = {"float32": np.float32, "bfloat16": jnp.bfloat16}  # jnp.bfloat16 is ml_dtypes' numpy dtype


def _storage_dtype(name: str):
  if name not in FEATURE_DTYPES:
    raise ValueError(f"feature_dtype must be float32 or bfloat16, got {name!r}")
  return FEATURE_DTYPES[name]


@dataclasses.dataclass(frozen=True)
class Task:
  """features(frozen, tokens) -> per-batch frozen-model features (jittable, no gradient);
  loss(params, frozen, features, tokens, mask, key) -> (scalar loss, metrics dict of scalars)."""

  name: str
  features: Callable
  loss: Callable
  features_id: str = ""  # names what `features` computes (the disk cache's key; "" = never cache on disk)


@struct.dataclass
class TrainState:
  params: Any
  opt: Any
  step: jax.Array
  rng: jax.Array


def make_optimizer(spec: TrainSpec):
  sched = optax.warmup_cosine_decay_schedule(0.0, spec.lr, max(spec.warmup, 1), max(spec.steps, spec.warmup + 1),
                                             end_value=spec.lr * spec.end_lr_fraction)
  return optax.chain(optax.clip_by_global_norm(spec.clip),
                     optax.adamw(sched, weight_decay=spec.weight_decay)), sched


def mirror_shardings(tree, params, param_shardings, default):
  """Shardings for a tree whose leaves mirror the params (an optimizer state: Adam's mu and nu are copies of the
  param tree inside optax's state containers): a leaf whose key path ends with a param's key path (the longest
  such) and has its shape gets that param's sharding; every other leaf (step counts, scalars) gets `default`."""
  by_path = {}
  for (path, x), s in zip(jax.tree_util.tree_flatten_with_path(params)[0], jax.tree.leaves(param_shardings)):
    by_path[tuple(path)] = (np.shape(x), s)

  def one(path, x):
    path = tuple(path)
    for k in range(len(path), 0, -1):
      hit = by_path.get(path[-k:])
      if hit is not None:
        return hit[1] if hit[0] == np.shape(x) else default
    return default
  return jax.tree_util.tree_map_with_path(one, tree)


def _train_step(task: Task, tx, constrain, state: TrainState, frozen, tokens, mask, feats=None):
  rng, key = jax.random.split(state.rng)
  if feats is None:
    feats = task.features(frozen, tokens)
  feats = jax.lax.stop_gradient(feats)
  (loss, metrics), grads = jax.value_and_grad(task.loss, has_aux=True)(state.params, frozen, feats, tokens, mask,
                                                                        key)
  updates, opt = tx.update(grads, state.opt, state.params)
  params = optax.apply_updates(state.params, updates)
  metrics = dict(metrics, loss=loss, grad_norm=optax.global_norm(grads))
  return constrain(TrainState(params, opt, state.step + 1, rng)), metrics


def _eval_step(task: Task, params, frozen, tokens, mask, feats=None):
  if feats is None:
    feats = task.features(frozen, tokens)
  loss, metrics = task.loss(params, frozen, feats, tokens, mask, None)
  return dict(metrics, loss=loss)


def put_local_rows(read: Callable[[np.ndarray], np.ndarray], n: int, sharding: NamedSharding) -> jax.Array:
  """A global array of n rows with this (row-split) sharding, built on every process from only the rows its own
  devices hold: read(sorted row indices) -> those rows. On one process that is every row."""
  spans = {(s[0].start or 0, n if s[0].stop is None else s[0].stop)
           for s in sharding.addressable_devices_indices_map((n,)).values()}
  rows = np.unique(np.concatenate([np.arange(a, b) for a, b in spans]))
  local = np.asarray(read(rows))
  at = {int(r): i for i, r in enumerate(rows)}  # global row -> its place in `local`

  def shard(index):
    a, b = index[0].start or 0, n if index[0].stop is None else index[0].stop
    return local[at[a]:at[a] + (b - a)][(slice(None),) + tuple(index[1:])]
  return shd.settle(jax.make_array_from_callback((n,) + local.shape[1:], sharding, shard))


class Trainer:
  def __init__(self, task: Task, spec: TrainSpec, mesh: Optional[jax.sharding.Mesh] = None, log=None):
    if mesh is not None and spec.batch_size % shd.axis_size(mesh, "data"):
      raise ValueError(f"batch_size {spec.batch_size} does not split over the mesh's data axis "
                       f"({shd.axis_size(mesh, 'data')})")
    self.task, self.spec, self.mesh = task, spec, mesh
    self.tx, self.sched = make_optimizer(spec)
    self.log = log or (lambda s: print(s, file=sys.stderr))
    self.train_step = shd.settled(jax.jit(functools.partial(_train_step, task, self.tx, self._constrain),
                                          donate_argnums=(0,)))
    self.eval_step = shd.settled(jax.jit(functools.partial(_eval_step, task)))
    self.features = shd.settled(jax.jit(task.features))
    self.metrics_path = os.path.join(spec.workdir, "metrics.jsonl")

  # Checkpoint managers on first use: the step programs alone (serve.aot compiles them) need no workdir.
  @functools.cached_property
  def ckpt(self) -> ocp.CheckpointManager:
    os.makedirs(self.spec.workdir, exist_ok=True)
    return ocp.CheckpointManager(os.path.join(os.path.abspath(self.spec.workdir), "ckpt"),
                                 options=ocp.CheckpointManagerOptions(max_to_keep=self.spec.keep,
                                                                      enable_async_checkpointing=False))

  @functools.cached_property
  def best(self) -> ocp.CheckpointManager:
    os.makedirs(self.spec.workdir, exist_ok=True)
    return ocp.CheckpointManager(
        os.path.join(os.path.abspath(self.spec.workdir), "best"),
        options=ocp.CheckpointManagerOptions(max_to_keep=1, best_fn=lambda m: m["eval_loss"], best_mode="min",
                                             enable_async_checkpointing=False))

  # ------------------------------------------------------------------------------------------- placement
  def _put_batch(self, x):
    """Host rows (the same full batch on every process) -> a global array split over 'data'."""
    return self._put_rows(lambda rows: x[rows], len(x))

  def _put_rows(self, read: Callable[[np.ndarray], np.ndarray], n: int):
    """A batch of n rows as a global array split over 'data', each process reading (read(row indices)) only the
    rows its own devices hold."""
    if self.mesh is None:
      return jnp.asarray(read(np.arange(n)))
    return put_local_rows(read, n, NamedSharding(self.mesh, P("data")))

  def _one_device(self):
    return jax.sharding.SingleDeviceSharding(jax.local_devices()[0])

  def param_shardings(self, params):
    """The table's shardings on the mesh; without one, everything on the default device."""
    if self.mesh is None:
      return jax.tree.map(lambda _: self._one_device(), params)
    return shd.param_shardings(params, self.mesh)

  def state_shardings(self, state: TrainState) -> TrainState:
    ps = self.param_shardings(state.params)
    rep = self._one_device() if self.mesh is None else NamedSharding(self.mesh, P())
    return TrainState(ps, mirror_shardings(state.opt, state.params, ps, rep), rep, rep)

  def _constrain(self, state: TrainState) -> TrainState:
    """Inside the step: keep the new state in the table's layout (a no-op without a mesh)."""
    if self.mesh is None:
      return state
    return jax.lax.with_sharding_constraint(state, self.state_shardings(state))

  def place_state(self, state: TrainState) -> TrainState:
    return state if self.mesh is None else shd.put(state, self.state_shardings(state))

  def place_frozen(self, frozen):
    return frozen if self.mesh is None else shd.put(frozen, self.param_shardings(frozen))

  @staticmethod
  def _abstract(tree, shardings):
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(np.shape(x), x.dtype, sharding=s), tree, shardings)

  # ------------------------------------------------------------------------------------------- checkpoints
  def init_state(self, params) -> TrainState:
    # A copy: the state is donated to the step, and init params may share buffers with the frozen target.
    params = jax.tree.map(lambda x: jnp.array(x, jnp.float32, copy=True), params)
    return TrainState(params, self.tx.init(params), jnp.zeros((), jnp.int32), jax.random.PRNGKey(self.spec.seed))

  def _as_tree(self, state: TrainState) -> dict:
    return {"params": state.params, "opt": state.opt, "step": state.step,
            "rng": jax.random.key_data(state.rng) if jnp.issubdtype(state.rng.dtype, jax.dtypes.prng_key)
            else state.rng}

  def restore_latest(self, state: TrainState) -> TrainState:
    """The latest checkpoint (saved on any mesh) in this trainer's shardings; `state` (placed or not) gives the
    tree structure, shapes and dtypes."""
    step = self.ckpt.latest_step()
    if step is None:
      return state
    return self.restore(step, state)

  def restore(self, step: int, state: TrainState) -> TrainState:
    tree = self._as_tree(state)
    # Orbax reads each array straight into these shardings, whatever mesh wrote it (without them it would
    # rebuild the writer's shardings).
    sh = self.state_shardings(state)
    abstract = self._abstract(tree, {"params": sh.params, "opt": sh.opt, "step": sh.step, "rng": sh.rng})
    tree = self.ckpt.restore(step, args=ocp.args.StandardRestore(abstract))
    self.log(f"resumed from step {step}")
    return TrainState(tree["params"], tree["opt"], jnp.asarray(tree["step"], jnp.int32), tree["rng"])

  def save(self, state: TrainState):
    self.ckpt.save(int(state.step), args=ocp.args.StandardSave(self._as_tree(state)), force=True)
    self.ckpt.wait_until_finished()

  def save_best(self, state: TrainState, eval_metrics: dict):
    """Kept only while it is the best eval loss so far."""
    self.best.save(int(state.step), args=ocp.args.StandardSave({"params": state.params}),
                   metrics={"eval_loss": float(eval_metrics["loss"])}, force=True)
    self.best.wait_until_finished()

  def best_params(self, like):
    step = self.best.best_step()
    if step is None:
      return None
    abstract = self._abstract({"params": like}, {"params": self.param_shardings(like)})
    return self.best.restore(step, args=ocp.args.StandardRestore(abstract))["params"]

  # ------------------------------------------------------------------------------------------- loops
  def precompute(self, frozen, tokens) -> np.ndarray:
    """The frozen target's features for every sequence in `feature_dtype`, computed in batches and written
    straight into the result (a memory-mapped .npy under `feature_dir`, reused by later runs on the same tokens;
    host memory otherwise), no float32 copy of the whole set held; each process reads its rows, gets every row's."""
    dtype = _storage_dtype(self.spec.feature_dtype)
    path = None
    if self.spec.feature_dir and self.task.features_id:
      key = f"{self.task.features_id}:{self.spec.feature_dtype}".encode()
      rows = data_lib.fingerprint(tokens, jax.process_index(), jax.process_count(), multihost_utils.process_allgather)
      h = hashlib.sha256(key + rows).hexdigest()[:16]
      path = os.path.join(self.spec.feature_dir, f"features-{h}.npy")
      if os.path.exists(path):
        return np.load(path, mmap_mode="r").view(dtype)
    bs = self.spec.batch_size
    out = tmp = None
    for i in range(0, len(tokens), bs):
      pad = max(i + bs - len(tokens), 0)
      idx = i + np.arange(bs) % (bs - pad)  # the last chunk padded to a batch, however short it is
      f = shd.to_host(self.features(frozen, self._put_rows(lambda r: np.asarray(tokens[idx[r]]), bs)))
      if out is None:
        shape = (len(tokens),) + f.shape[1:]
        if path:
          os.makedirs(self.spec.feature_dir, exist_ok=True)
          tmp = f"{path}.{os.getpid()}.tmp.npy"
          # .npy has no bfloat16: the file holds its bits as uint16 (same itemsize), viewed back on load.
          out = np.lib.format.open_memmap(tmp, mode="w+", dtype=np.uint16 if dtype != np.float32 else dtype,
                                          shape=shape).view(dtype)
        else:
          out = np.empty(shape, dtype)
      out[i:i + bs - pad] = np.asarray(f[:bs - pad]).astype(dtype)
    if path:
      out.flush()
      del out
      os.replace(tmp, path)  # atomic: a concurrent run never reads half a file
      return np.load(path, mmap_mode="r").view(dtype)
    return out

  def evaluate(self, params, frozen, data: data_lib.Dataset, eval_feats=None) -> dict:
    n = len(data.eval_tokens)
    bs = self.spec.batch_size
    sums, count = {}, 0
    for i in range(min(self.spec.eval_batches, max(1, -(-n // bs)))):
      idx = np.resize(np.arange(i * bs, (i + 1) * bs) % n, bs)
      toks, mask, f = self._batch(data.eval_tokens, data.eval_mask, eval_feats, idx)
      m = self.eval_step(params, frozen, toks, mask, f)
      for k, v in m.items():
        sums[k] = sums.get(k, 0.0) + float(v)
      count += 1
    return {k: v / count for k, v in sums.items()}

  def _batch(self, tokens, mask, feats, idx):
    """The global batch of rows `idx` (tokens, mask and cached features or None); this process reads only its
    own rows of each."""
    rows = lambda a, dtype=None: self._put_rows(lambda r: np.asarray(a[idx[r]], dtype), len(idx))
    return rows(tokens), rows(mask), None if feats is None else rows(feats, np.float32)

  def _write(self, rec: dict):
    if jax.process_index() != 0:
      return
    os.makedirs(self.spec.workdir, exist_ok=True)
    with open(self.metrics_path, "a") as f:
      f.write(json.dumps(rec) + "\n")

  def fit(self, params, frozen, data: data_lib.Dataset, stop_after: Optional[int] = None):
    """Train (resuming from the latest checkpoint if there is one) -> (final params, last eval metrics)."""
    spec = self.spec
    state = self.restore_latest(self.place_state(self.init_state(params)))
    frozen = self.place_frozen(frozen)
    start = int(state.step)
    feats = eval_feats = None
    if spec.cache_features:
      t = time.perf_counter()
      feats, eval_feats = self.precompute(frozen, data.tokens), self.precompute(frozen, data.eval_tokens)
      self.log(f"cached features of {len(feats) + len(eval_feats)} sequences in {time.perf_counter() - t:.1f} s")
    bar = None
    if spec.progress and jax.process_index() == 0:
      bar = tqdm(total=spec.steps, initial=start, desc=self.task.name, file=sys.stderr, unit="step")
    last_eval, t0 = None, time.perf_counter()
    for step in range(start, spec.steps):
      if stop_after is not None and step >= stop_after:
        break
      idx = data_lib.batch_indices(len(data.tokens), step, spec.batch_size, spec.seed)
      state, m = self.train_step(state, frozen, *self._batch(data.tokens, data.mask, feats, idx))
      done = step + 1
      if done % spec.log_every == 0 or done == spec.steps:
        m = {k: float(v) for k, v in m.items()}
        rec = {"step": done, "split": "train", "lr": float(self.sched(step)),
               "time_s": round(time.perf_counter() - t0, 2), **m}
        self._write(rec)
        if bar:
          bar.set_postfix(loss=f"{m['loss']:.3f}", top1=f"{m.get('top1_h0', 0):.3f}")
      ev = None
      if done % spec.eval_every == 0 or done == spec.steps:
        ev = self.evaluate(state.params, frozen, data, eval_feats)
        last_eval = ev
        self._write({"step": done, "split": "eval", **ev})
        self.log(f"step {done} eval " + " ".join(f"{k}={v:.4f}" for k, v in sorted(ev.items())))
        self.save_best(state, ev)
      if done % spec.save_every == 0 or done == spec.steps:
        self.save(state)
      if bar:
        bar.update(1)
    if bar:
      bar.close()
    self.state = state  # the final TrainState (params, optimizer state, step, rng), for inspection
    return state.params, last_eval
