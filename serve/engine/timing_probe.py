"""The proposer's share of a decode step, measured on the live batch, and the device's memory.

A step's time is not split inside the jitted loop (no host clock there), so the engine samples it: every
`interval_s` seconds, while speculation is on, one iteration runs synchronously:
1. wait for the loop in flight, so nothing else runs on the device;
2. time `propose_probe`: the proposer's `propose` on a copy of the live state at the k the adaptive controller
   would pick now (the copy is donated, so the proposer writes its caches in place as in the loop; the drafts
   are thrown away and the live state is untouched);
3. time the real `decode_loop` call of that iteration and divide by the steps it ran.
The counters sum both times over probes, so a load test reads the share of one load point as
delta(proposer time) / delta(step time). The cost is one extra `propose` per probe plus the host work of that
iteration not overlapping the device; the probe count is exported, so a report can bound it.
On many hosts process 0 probes; the others run the same device calls in the same order, untimed (`untimed_loop`).
"""

from __future__ import annotations

import functools
import time
from typing import Optional

import jax
import jax.numpy as jnp

from spec_jax import streams
from spec_jax.decode import choose_option, decode_loop, draft_keys, switch_in_place
from spec_jax.proposers.base import ProposeContext


@functools.partial(jax.jit, static_argnames=("spec",), donate_argnames=("pstate",))
def propose_probe(params, state, pstate, spec):
  """One `propose` at the k that `adaptive_step` would choose for `state` (state.pstate is not read; `pstate` is
  a copy of it). -> (new pstate, a checksum of the drafts, so that they are computed)."""
  option = choose_option(state, spec)
  ctx = ProposeContext(state.tokens, state.lengths, state.sampling, state.last_hidden)
  keys = lambda k: draft_keys(streams.rows(state.keys, state.lengths.shape[0]), state.lengths, k)  # as spec_step's

  def branch(k):
    def run(carry):
      ps, _ = carry
      if k == 0:
        return ps, jnp.zeros((), jnp.int32)
      if spec.is_tree(k):
        draft, ps = spec.proposer.propose_tree(params["proposer"], ps, ctx, keys(k))
      else:
        draft, ps = spec.proposer.propose(params["proposer"], ps, ctx, k, keys(k))
      return ps, jnp.sum(draft.tokens.astype(jnp.int32))
    return run

  # In place, as the loop runs it (a conditional would copy the proposer's caches and overstate the share).
  return switch_in_place(option, [branch(k) for k in spec.ks], (pstate, jnp.zeros((), jnp.int32)))


def time_propose(params, state, spec) -> float:
  """Seconds of one `propose_probe` on `state` (ready), the copy made beforehand and not counted."""
  pstate = jax.tree.map(jnp.copy, state.pstate)
  rest = state.replace(pstate=None)
  jax.block_until_ready(pstate)
  t0 = time.perf_counter()
  jax.block_until_ready(propose_probe(params, rest, pstate, spec))
  return time.perf_counter() - t0


def probed_loop(params, state, spec, steps):
  """A probed iteration's device calls, in order: wait for the loop in flight, one `propose` on a copy of the
  proposer's state (time_propose), the loop -> (state, propose seconds, loop seconds, steps the loop ran)."""
  jax.block_until_ready(state)  # the loop in flight: nothing else runs on the device
  step0 = int(state.step)
  t_prop = time_propose(params, state, spec)
  t0 = time.perf_counter()
  state = decode_loop(params, state, spec, steps)
  ran = int(jax.block_until_ready(state).step) - step0
  return state, t_prop, time.perf_counter() - t0, ran


def untimed_loop(params, state, spec, steps):
  """probed_loop's device calls with nothing recorded (SlotTable.run's `loop`): the warm-up's, which compiles the
  probe, and a follower's on many hosts, where the leader probes and every process must run the same programs in
  the same order or their collectives deadlock (serve/many_hosts/multihost.py)."""
  return probed_loop(params, state, spec, steps)[0]


def device_memory() -> Optional[tuple[int, int]]:
  """(bytes in use, peak bytes in use) of the first local device; None where JAX does not report it (CPU)."""
  try:
    stats = jax.local_devices()[0].memory_stats()
  except Exception:
    return None
  if not stats or "bytes_in_use" not in stats:
    return None
  return int(stats["bytes_in_use"]), int(stats.get("peak_bytes_in_use", stats["bytes_in_use"]))


class StepProbe:
  """When to probe, and the probed loop call: every `every_s` seconds (0: never) while some running request
  drafts (a k = 0 batch has no proposer time); the device's memory is read at most once a second."""

  def __init__(self, metrics, every_s: float):
    self.metrics, self.every_s = metrics, every_s
    self._next_probe = self._next_memory = 0.0

  def due(self, now: float, drafting: bool) -> bool:
    return self.every_s > 0 and now >= self._next_probe and drafting

  def timed_loop(self, params, state, spec, steps):
    """The iteration's loop call (SlotTable.run's `loop`), timed alone after one timed `propose` on the same
    state."""
    state, t_prop, t_loop, ran = probed_loop(params, state, spec, steps)
    self._next_probe = time.monotonic() + self.every_s
    if ran > 0:
      self.metrics.proposer_time.inc(t_prop)
      self.metrics.step_time.inc(t_loop / ran)
      self.metrics.timing_probes.inc()
    return state

  def sample_memory(self, now: float) -> None:
    m = self.metrics
    if m.device_memory is None or now < self._next_memory:
      return
    self._next_memory = now + 1.0
    mem = device_memory()
    if mem is not None:
      m.device_memory.set(mem[0])
      m.device_memory_peak.set(mem[1])
