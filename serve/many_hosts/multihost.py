"""The server on many hosts (issue 47): one process a host, one mesh, process 0 the leader.

  # on each host I = 0 .. N-1 (TPU pods, SLURM and MPI need none of the three flags):
  python -m serve.server --mesh=data:2,model:8 --coordinator_address=HOST0:1234 --num_processes=N --process_id=I ...

Every process loads the model and builds the same engine (its construction's device calls are the same code on
each). Process 0 then runs HTTP, the scheduler and the block manager; the others (followers) run no HTTP and no
scheduling. The mirror is at the slot table (spec_jax/slot_table.py): every device call the engine makes goes
through one of its methods with host-side arguments (numpy arrays, python scalars), so the leader's table
(LeaderTable) sends each call, (method name, host arguments), to the followers before running it, and each follower
runs the same method with the same arguments in the same order (`follow`). Same programs, same inputs, same order:
the collectives of every jitted call line up. Each call is sent before it runs (not batched per iteration): on a
CPU mesh every program is waited for (spec_jax/sharding.py settle), so the leader cannot run ahead of a follower.

The snapshot the leader reads is gathered to every device inside its program (MirrorTable.run): the leader reads
it locally, the followers drop theirs.

The channel is a TCP connection from each follower to the leader (its port published in jax.distributed's
key-value store); messages are length-prefixed pickles of (name, numpy arguments) from the leader, and heartbeats
both ways. Like jax.distributed's coordinator it trusts its network: run it on the job's private network. A
follower that dies (its connection closes) or goes silent for --heartbeat_timeout s stops the leader at once with
a log line naming it (os._exit: the engine thread may be stuck in a collective with the dead host), and likewise a
follower whose leader is gone; the leader's clients then get a connection error, not a hang.

At start, every process's run settings (the model, mesh, method, ... all but the per-host ones) are compared with
process 0's through the key-value store; a difference stops every process with a message naming the settings.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import threading

import jax
import numpy as np
from jax._src import distributed as jax_distributed
from jax.sharding import NamedSharding, PartitionSpec

from serve.many_hosts.multihost_channel import Follower, Leader, fatal
from spec_jax import distributed, sharding, slots
from spec_jax.decode import decode_loop
from spec_jax.slot_table import SlotTable

log = logging.getLogger("spec_jax.multihost")
FLAGS = ("coordinator_address", "num_processes", "process_id", "initialization_timeout", "heartbeat_timeout")
# Settings that may differ between hosts: where each one listens, logs and caches, and its place in the run.
PER_HOST = {"host", "port", "process_id", "log_level", "compilation_cache_dir", "coordinator_address"}


# ------------------------------------------------------------------------------------------------ start-up

def join(cfg: dict):
  """Join the run (spec_jax/distributed.py, as serve.evaluate and train.main do: flags, or auto-detection on TPU
  pods / SLURM / MPI) -> a Leader (process 0) or a Follower; None for one process. Checks that every process has
  the same settings, then connects the channel."""
  joining = distributed.Join(cfg.get("coordinator_address"), cfg.get("num_processes"), cfg.get("process_id"),
                             int(cfg.get("initialization_timeout") or 300), int(cfg.get("heartbeat_timeout") or 100))
  if not joining.multi_process:
    return None
  distributed.initialize(joining)
  if jax.process_count() == 1:
    return None
  me, n = jax.process_index(), jax.process_count()
  timeout = joining.initialization_timeout
  distributed.check_same_settings(settings_of(cfg), "server settings")
  if not cfg.get("mesh") or sharding.make_mesh(cfg["mesh"]) is None:
    raise ValueError(f"a server on {n} processes needs --mesh over all {jax.device_count()} devices "
                     f"(e.g. --mesh=data:{n},model:{jax.device_count() // n})")
  beat = float(cfg.get("heartbeat_timeout") or 100)
  cluster = Leader(n, timeout, beat) if me == 0 else Follower(me, timeout, beat)
  log.info("process %d of %d joined (%d devices, %d here); %s", me, n, jax.device_count(), jax.local_device_count(),
           "the leader: HTTP, scheduler and block manager here" if me == 0 else "a follower: mirrors process 0")
  return cluster


def settings_of(cfg: dict) -> dict:
  """The settings every host must share, as JSON-able values, plus what this host brings (devices, platform)."""
  out = {k: (v.to_json() if hasattr(v, "to_json") else v) for k, v in cfg.items() if k not in PER_HOST}
  out = json.loads(json.dumps(out, default=str, sort_keys=True))
  out["local_devices"] = jax.local_device_count()
  out["platform"] = jax.devices()[0].platform
  return out


# ------------------------------------------------------------------------------------------------ the tables

def host_tree(tree):
  """Arguments as host values: numpy arrays (a request built with jnp arrays on one device included)."""
  return jax.tree.map(lambda x: np.asarray(x) if isinstance(x, (jax.Array, np.ndarray, np.generic)) else x, tree)


_SNAPSHOTS: dict = {}


def replicated_snapshot(state, mesh):
  """slots.snapshot with every output gathered to every device: process 0 reads it without a collective of its
  own (the gather is inside the program every process runs)."""
  fn = _SNAPSHOTS.get(mesh)
  if fn is None:
    fn = _SNAPSHOTS[mesh] = jax.jit(lambda s: slots.snapshot(s), out_shardings=NamedSharding(mesh, PartitionSpec()))
  return sharding.settle(fn(state))


class MirrorTable(SlotTable):
  """The slot table of every process of a multi-host server: host arguments in, a snapshot every process holds
  in full out. The followers run its methods as the leader's calls come in."""

  def insert(self, holder, request, slot=None) -> int:
    return super().insert(holder, host_tree(request), slot)

  probe_loop = None  # a follower's loop for the leader's probed iterations (`follow` sets it)

  def run(self, steps: int, loop=None) -> tuple:
    self.state = (loop or decode_loop)(self.params, self.state, self.spec, np.int32(steps))
    return replicated_snapshot(self.state, self.spec.mesh), dict(self.holders)

  def run_probed(self, steps: int) -> tuple:
    """A follower's side of a leader's `run` with a loop (the timing probe's): the same device calls, untimed."""
    if self.probe_loop is None:
      raise ValueError("a probed run on a follower without the probe's loop")
    return self.run(steps, self.probe_loop)


class LeaderTable(MirrorTable):
  """Process 0's table: every call goes to the followers (name, host arguments) before it runs here. One lock
  orders them: the engine thread and an HTTP thread (prompt logprobs) must dispatch in the order they sent."""

  channel = None  # set after construction: the constructor's reset runs on every process already

  def __init__(self, *args, **kw):
    self._order = threading.RLock()
    super().__init__(*args, **kw)

  def _mirrored(self, name: str, args: tuple, run):
    with self._order:
      if self.channel is not None:
        self.channel.send(("call", name, args))
      return run(*args)

  def reset(self) -> None:
    self._mirrored("reset", (), super().reset)

  def insert(self, holder, request, slot=None) -> int:
    request = host_tree(request)
    with self._order:
      slot = int(self._free[0] if slot is None else slot)
      return self._mirrored("insert", (None, request, slot), lambda _, r, s: super(LeaderTable, self).insert(
          holder, r, s))

  def run(self, steps: int, loop=None) -> tuple:
    # a loop (the timing probe's, or the warm-up's that compiles it) adds device calls: the followers run them too
    return self._mirrored("run" if loop is None else "run_probed", (int(steps),),
                          lambda s: super(LeaderTable, self).run(s, loop))

  def release(self, slot: int) -> None:
    self._mirrored("release", (int(slot),), super().release)

  def set_speculation(self, enabled: bool) -> None:
    self._mirrored("set_speculation", (bool(enabled),), super().set_speculation)

  def set_draft_caps(self, caps) -> None:
    self._mirrored("set_draft_caps", (np.asarray(caps, np.int32),), super().set_draft_caps)

  def set_page_tables(self, table) -> None:
    self._mirrored("set_page_tables", (np.asarray(table, np.int32),), super().set_page_tables)

  def fill_pages(self, pages) -> None:
    self._mirrored("fill_pages", (np.asarray(pages, np.int32),), super().fill_pages)

  def forget_tenant(self, tenant: int) -> None:
    self._mirrored("forget_tenant", (int(tenant),), super().forget_tenant)

  def prompt_logprobs(self, prompt_ids, top: int) -> list:
    return self._mirrored("prompt_logprobs", ([int(t) for t in prompt_ids], int(top)), super().prompt_logprobs)


MIRRORED = ("reset", "insert", "run", "run_probed", "release", "set_speculation", "set_draft_caps", "set_page_tables",
            "fill_pages", "forget_tenant", "prompt_logprobs")


def table_class(cluster):
  """The engine's slot table class for this process (None: one process, the plain SlotTable)."""
  return None if cluster is None else (LeaderTable if cluster.role == "leader" else MirrorTable)


def lead(table: "LeaderTable", cluster) -> None:
  """Process 0: from now on the engine's table sends its calls to the followers."""
  table.channel = cluster


def follow(engine, cluster: Follower, probe_loop) -> None:
  """A follower's life: run the leader's calls on this engine's table, in order, until the leader stops (then
  return) or dies (the reader thread ends the process). A call that raises here raised on the leader too (same
  program, same inputs): the leader's engine recovers (a reset), which comes next. probe_loop: the device calls
  of the leader's timing probe, untimed (serve/engine/timing_probe.py untimed_loop)."""
  table = engine.table
  table.probe_loop = probe_loop
  log.info("process %d: following process 0", cluster.me)
  # SLURM and Kubernetes signal every process at once: process 0 drains, then stops the followers
  signal.signal(signal.SIGTERM, lambda *_: log.info("SIGTERM: process %d stops when process 0 has drained",
                                                    cluster.me))
  n = 0
  while True:
    msg = cluster.calls.get()
    if msg[0] == "stop":
      log.info("process %d: the leader stopped after %d calls", cluster.me, n)
      return
    _, name, args = msg
    if name not in MIRRORED:
      fatal(f"the leader sent an unknown call {name!r}: are both processes running the same code?")
    try:
      getattr(table, name)(*args)
    except Exception:
      log.exception("mirrored call %s failed (the leader's engine recovers the same way)", name)
    n += 1


def exit_now(code: int) -> None:
  """End this process without jax.distributed's exit barrier (the other processes may be gone already)."""
  sys.stdout.flush()
  sys.stderr.flush()
  logging.shutdown()
  os._exit(code)


def joined() -> bool:
  """Whether this process joined a jax.distributed run."""
  return jax_distributed.global_state.client is not None
