"""Many hosts, one job: joining a `jax.distributed` run, failing it whole, and checking that every host was started
with the same settings. Shared by the commands that run on many hosts (serve.evaluate, train.main).

A command run on many hosts calls `main(module, body, join)`: with --coordinator_address/--num_processes/
--process_id, or with none of them on a TPU pod, a SLURM or an MPI job (jax.distributed detects those), the
command re-runs itself as a supervised child that joins the run (gloo collectives on CPU). jax.distributed's client
aborts the process (a C++ fatal error, not a Python exception) when a process never joins or another one dies, so
the one-line error a user should read is written by the supervising parent from the child's log (`diagnose`).
"""

from __future__ import annotations

import collections
import ctypes
import dataclasses
import json
import os
import re
import signal
import subprocess
import sys
import traceback
from typing import Callable, Optional

import numpy as np

WORKER_ENV = "SPEC_JAX_DISTRIBUTED_WORKER"


class RunFailed(RuntimeError):
  pass


@dataclasses.dataclass(frozen=True)
class Join:
  """How this process joins the run: the flags of spec_jax/flag_table.py's jax.distributed rows."""
  coordinator_address: Optional[str] = None
  num_processes: Optional[int] = None
  process_id: Optional[int] = None
  initialization_timeout: int = 300
  heartbeat_timeout: int = 100

  @classmethod
  def from_flags(cls, flags) -> "Join":
    return cls(flags.coordinator_address, flags.num_processes, flags.process_id, flags.initialization_timeout,
               flags.heartbeat_timeout)

  @property
  def explicit(self) -> bool:
    return self.coordinator_address is not None or (self.num_processes or 1) > 1

  @property
  def multi_process(self) -> bool:
    return self.explicit or cluster_env()


def cluster_env() -> bool:
  """Does the environment describe a multi-process job that jax.distributed detects by itself?"""
  env = os.environ
  return (int(env.get("SLURM_NTASKS", "1") or 1) > 1 or int(env.get("OMPI_COMM_WORLD_SIZE", "1") or 1) > 1
          or bool(env.get("TPU_WORKER_HOSTNAMES", "").count(",")) or bool(env.get("MEGASCALE_COORDINATOR_ADDRESS")))


def initialize(join: Join) -> None:
  """Join the run: with explicit flags, or by auto-detection on TPU pods / SLURM / MPI; a single process
  otherwise. A process that cannot join within the initialization timeout fails (named by supervise())."""
  import jax  # lazy: heavy, only this path (jax: not in the supervising parent)
  if not join.multi_process:
    return
  if join.explicit and (join.coordinator_address is None or join.num_processes is None or join.process_id is None):
    raise ValueError("a multi-process run needs --coordinator_address, --num_processes and --process_id together")
  if join.explicit and not 0 <= join.process_id < join.num_processes:
    raise ValueError(f"--process_id={join.process_id} is outside 0 .. {join.num_processes - 1}")
  jax.config.update("jax_cpu_collectives_implementation", "gloo")  # CPU devices' collectives; GPU/TPU ignore it
  kw = dict(initialization_timeout=join.initialization_timeout, heartbeat_timeout_seconds=join.heartbeat_timeout)
  if join.explicit:
    kw.update(coordinator_address=join.coordinator_address, num_processes=join.num_processes,
              process_id=join.process_id)
  try:
    jax.distributed.initialize(**kw)
  except Exception as e:  # a Python-level failure (bad address, ...); a peer that never joins aborts the process
    # in C++ instead, which supervise() reports
    raise RunFailed(f"process {join.process_id}: could not join the run at {join.coordinator_address}: "
                    f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}") from None


def main(module: str, body: Callable[[], object], join: Join) -> None:
  """A command's main on one host or many: supervise (many), join, run `body`, and end every failure with one
  'error: ...' line and a non-zero exit, never a hang."""
  if join.multi_process and os.environ.get(WORKER_ENV) != "1":
    sys.exit(supervise(module, join))
  try:
    initialize(join)
    import jax  # lazy: heavy, only this path (jax: not in the supervising parent)
    if jax.process_count() > 1:
      print(f"process {jax.process_index()} joined: {jax.process_count()} processes, {jax.device_count()} devices",
            file=sys.stderr, flush=True)
    body()
  except (ValueError, FileNotFoundError, RunFailed) as e:
    print(f"error: {e}", file=sys.stderr, flush=True)
    os._exit(2)  # no atexit: jax.distributed's shutdown barrier would wait for the processes that failed
  except Exception as e:  # a collective with a dead peer, or anything else mid-run: fail the whole run now
    import jax  # lazy: heavy, only this path (jax: not in the supervising parent)
    traceback.print_exc()  # where it failed, above the one line that says so
    print(f"error: process {jax.process_index()} of {jax.process_count()}: the run failed: "
          f"{type(e).__name__}: {str(e)[:800]}", file=sys.stderr, flush=True)
    os._exit(1)


def supervise(module: str, join: Join) -> int:
  """Run `python -m module` with this process's arguments as a child and explain how it ended. The child dies
  with this process (PR_SET_PDEATHSIG)."""
  def die_with_parent():
    try:
      ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:  # not Linux: the child may outlive a killed parent
      pass

  env = dict(os.environ, **{WORKER_ENV: "1"})
  proc = subprocess.Popen([sys.executable, "-m", module, *sys.argv[1:]], env=env, stderr=subprocess.PIPE,
                          text=True, errors="replace", preexec_fn=die_with_parent)
  for sig in (signal.SIGTERM, signal.SIGINT):
    signal.signal(sig, lambda *_: proc.terminate())
  tail = collections.deque(maxlen=400)
  for line in proc.stderr:
    sys.stderr.write(line)
    tail.append(line)
  rc = proc.wait()
  if rc == 0:
    return 0
  print(f"error: {diagnose(''.join(tail), rc, join)}", file=sys.stderr, flush=True)
  return rc if 0 < rc < 128 else 1


def diagnose(log: str, rc: int, join: Join) -> str:
  """One line saying which process failed and how, from a failed worker's stderr."""
  me, n, addr = join.process_id, join.num_processes, join.coordinator_address
  who = f"process {me}" if me is not None else "this process"
  if "RegisterTask" in log or ("DEADLINE_EXCEEDED" in log and " joined:" not in log):
    if me == 0 and n == 2:
      missing = "process 1 did not join"
    elif me == 0:
      missing = f"some of processes 1 .. {n - 1} did not join (see their logs)"
    else:
      missing = f"{who} could not register with the coordinator at {addr} (is process 0 running there?)"
    return (f"{who}: the run did not start: not all {n} processes joined within {join.initialization_timeout} s; "
            f"{missing}")
  m = re.search(r"stopped sending heartbeats\):(.*?)The tasks", log, re.S)  # the service lists their ids
  dead = {int(t) for t in re.findall(r"(?:task:)?(\d+)", m.group(1))} if m else set()
  dead = sorted((dead or {int(t) for t in re.findall(r"task:(\d+)", log)}) - ({me} if me is not None else set()))
  if dead:
    return (f"{who}: the run failed: process(es) {dead} died or stopped responding (heartbeat timeout "
            f"{join.heartbeat_timeout} s)")
  if re.search(r"[Gg]loo|Connection (closed|reset)|peer", log):
    return f"{who}: the run failed: another process died mid-run (a collective lost its peer)"
  errors = [l for l in log.splitlines() if l.startswith("error:")]
  last = errors[-1] if errors else next((l for l in reversed(log.splitlines()) if l.strip()), "")
  return f"{who}: the run failed (exit status {rc}): {last[:300]}"


def check_same_settings(settings: dict, what: str = "settings") -> None:
  """Every process must have been started with the same `settings` (a flat JSON-able dict: flags, config): each
  process gathers every process's copy through a collective and raises the same ValueError naming the keys that
  differ, so a mismatched host is refused at start on every host instead of deadlocking later. One process: no-op."""
  import jax  # lazy: heavy, only this path (jax: not in the supervising parent)
  if jax.process_count() == 1:
    return
  from jax.experimental import multihost_utils  # lazy: heavy, only this path (jax: not in the supervising parent)
  blob = np.frombuffer(json.dumps(settings, sort_keys=True, default=str).encode(), np.uint8)
  sizes = np.asarray(multihost_utils.process_allgather(np.int32(len(blob)))).reshape(-1)
  padded = np.zeros(int(sizes.max()), np.uint8)
  padded[:len(blob)] = blob
  every = np.asarray(multihost_utils.process_allgather(padded)).reshape(len(sizes), -1)
  mine = [json.loads(bytes(row[:s]).decode()) for row, s in zip(every, sizes)]
  diffs = []
  for p, other in enumerate(mine[1:], start=1):
    keys = sorted(k for k in set(mine[0]) | set(other) if mine[0].get(k) != other.get(k))
    diffs += [f"{k} ({mine[0].get(k)!r} on process 0, {other.get(k)!r} on process {p})" for k in keys]
  if diffs:
    raise ValueError(f"the processes were started with different {what}: {'; '.join(diffs[:8])}"
                     + (f"; and {len(diffs) - 8} more" if len(diffs) > 8 else "") + ": start every host with "
                     "the same flags")
