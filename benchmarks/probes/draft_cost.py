"""What one drafted token costs, against one plain decode step of the target, per proposer.

  python benchmarks/probes/draft_cost.py                         # eagle, medusa, qdraft; batch 1; bf16 layout
  python benchmarks/probes/draft_cost.py --methods=eagle --hlo   # also list the big converts/copies in propose()
  python benchmarks/probes/draft_cost.py --loop                  # also time whole 8-step decode_loop calls

For each method, on a state holding one prompt (two rows for the bfloat16 CPU layout, as serve.generate runs):
- `step0`: one loop step drafting nothing (the plain decode step: target forward of one token, sampling, commit);
- `step(k)`: one whole loop step drafting k (propose, the target's verify pass over k + 1 tokens, acceptance,
  commit, the proposer's update): what the adaptive controller's cost table holds, as step(k) / step0;
- `propose(k)`: the proposer's `propose` alone at k = 1 .. K, on a donated copy of the live proposer state
  (as in the loop, so cache writes are in place).
With --loop, also whole `decode_loop` calls of 8 steps (the server's steps_per_sync), per method: the plain loop,
the fixed-k loop, and the adaptive loop held at k = 0 (speculation switched off) and at k = K (a cost table that
makes K the cheapest), so the adaptive loop's own overhead over the loops it chooses between is measured.
The cost of a drafted token is the marginal (propose(K) - propose(1)) / (K - 1) over step0, plus the fixed part
propose(1) over step0. Timing is interleaved round-robin over everything measured, `--reps` times; the median
and the min..max spread are printed. The budget (BENCHMARKS.md): a learned head's draft token <= 0.1 x step0.
"""

from __future__ import annotations

import functools
import re
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

flags.DEFINE_list("methods", ["eagle", "medusa", "qdraft"], "Proposers to measure.")
flags.DEFINE_string("dtype", "bfloat16", "Target dtype (bfloat16 = the CPU layout serve.generate uses).")
flags.DEFINE_integer("k", 4, "Largest draft length measured.")
flags.DEFINE_integer("reps", 15, "Interleaved repeats.")
flags.DEFINE_integer("context", 256, "Prompt tokens in the slot (the caches attend over them).")
flags.DEFINE_bool("hlo", False, "Print the converts, copies and big dots of the compiled propose(K).")
flags.DEFINE_bool("loop", False, "Also time 8-step decode_loop calls: plain, fixed k, adaptive at k = 0 and K.")
flags.DEFINE_string("draft_layers", "0", "method=draft: 0 = the distilled draft in heads/, N = early exit.")
FLAGS = flags.FLAGS


@functools.partial(jax.jit, static_argnames=("spec", "k"), donate_argnames=("pstate",))
def propose_only(params, state, pstate, spec, k):
  from spec_jax import streams
  from spec_jax.decode import draft_keys
  from spec_jax.proposers.base import ProposeContext
  ctx = ProposeContext(state.tokens, state.lengths, state.sampling, state.last_hidden)
  keys = draft_keys(streams.rows(state.keys, state.lengths.shape[0]), state.lengths, k)
  draft, ps = spec.proposer.propose(params["proposer"], pstate, ctx, k, keys)
  return ps, jnp.sum(draft.tokens), None if draft.probs is None else draft.probs[:, :, 0]


def big_ops(hlo: str, min_elems: int = 1 << 18) -> list[str]:
  """HLO instructions that write >= min_elems elements and are converts, copies, broadcasts or dots."""
  out = []
  for line in hlo.splitlines():
    m = re.match(r"\s*(?:ROOT )?%?[\w.\-]+ = (\w+)\[([\d,]*)\][^ ]* (\w+)\(", line)
    if not m:
      continue
    dims = [int(d) for d in m.group(2).split(",") if d]
    n = int(np.prod(dims)) if dims else 1
    if n >= min_elems and m.group(3) in ("convert", "copy", "broadcast", "dot", "scatter", "dynamic-update-slice",
                                         "fusion", "select"):
      out.append(f"{m.group(3):22s} {m.group(1)}[{m.group(2)}]  {line.strip()[:160]}")
  return out


def main(argv):
  del argv
  from serve.calibrate import _one_step
  from spec_jax import backend
  from spec_jax.checkpoints.load import load_model
  from spec_jax.decode import decode_loop, make_spec
  from spec_jax.proposers.base import NoneProposer
  from spec_jax.proposers.registry import Target, build_proposer
  from spec_jax.spec_config import SpecConfig

  config, params, tok = load_model(None, FLAGS.dtype)
  rng = np.random.default_rng(0)
  prompt = [config.bos_id] + rng.integers(1000, 20000, FLAGS.context - 1).tolist()
  rows = backend.batch_rows(params, 1)
  setups, loops = {}, {}
  if FLAGS.loop:
    plain_spec = make_spec(config, NoneProposer(), adaptive_k=False)
    loops["plain"] = _slot_state({"target": params, "proposer": {}}, plain_spec, rows, prompt, None)
  for method in FLAGS.methods:
    proposer, pp = build_proposer(SpecConfig(method, FLAGS.k, draft_layers=int(FLAGS.draft_layers)),
                                  Target(config, params, dtype=FLAGS.dtype))
    spec = make_spec(config, proposer, adaptive_k=True)
    full = {"target": params, "proposer": pp}
    setups[method] = _slot_state(full, spec, rows, prompt, None)
    if FLAGS.loop:
      fixed = make_spec(config, proposer, adaptive_k=False)
      loops[(method, "fixed")] = _slot_state(full, fixed, rows, prompt, None)
      loops[(method, "adaptive k=0")] = _slot_state(full, spec, rows, prompt, None, speculate=False)
      # The controller picks the cheapest option while it has no acceptance evidence: make that k = K.
      costs = np.full((1, len(spec.ks)), 10.0, np.float32)
      costs[0, -1] = 1.0
      loops[(method, f"adaptive k={spec.ks[-1]}")] = _slot_state(full, spec, rows, prompt, costs)

  def run_step(method, option):
    spec, full, state = setups[method]
    jax.block_until_ready(_one_step(full, state, spec, option).lengths)

  def run_propose(method, k):
    spec, full, state = setups[method]
    ps = jax.tree.map(jnp.copy, state.pstate)
    rest = state.replace(pstate=None)
    jax.block_until_ready(ps)
    t0 = time.perf_counter()
    jax.block_until_ready(propose_only(full, rest, ps, spec, k))
    return time.perf_counter() - t0

  def run_loop(name):
    spec, full, state = loops[name]
    s = jax.tree.map(jnp.copy, state)
    jax.block_until_ready(s)
    t0 = time.perf_counter()
    jax.block_until_ready(decode_loop(full, s, spec, np.int32(LOOP_STEPS)).lengths)
    return time.perf_counter() - t0

  ks = sorted({1, 2, FLAGS.k})
  # ("step", option index) for every option of the adaptive set, ("propose", k) for k in ks.
  items = ([(m, "step", i) for m in FLAGS.methods for i in range(len(setups[m][0].ks))] +
           [(m, "propose", k) for m in FLAGS.methods for k in ks])
  if FLAGS.loop:
    items += [("loop", "loop", name) for name in loops]
  run = lambda m, what, x: ((run_step(m, x), None)[1] if what == "step" else
                            run_loop(x) if what == "loop" else run_propose(m, x))
  for it in items:  # compile everything first
    run(*it)
  if FLAGS.hlo:
    for m in FLAGS.methods:
      spec, full, state = setups[m]
      hlo = propose_only.lower(full, state.replace(pstate=None), state.pstate, spec, FLAGS.k).compile().as_text()
      print(f"--- {m}: propose(k={FLAGS.k}) big ops")
      for line in big_ops(hlo):
        print("  " + line)
  times = {it: [] for it in items}
  for _ in range(FLAGS.reps):
    for it in items:
      if it[1] == "step":  # (a loop call times itself, after copying its state)
        t0 = time.perf_counter()
        run(*it)
        times[it].append(time.perf_counter() - t0)
      else:
        times[it].append(run(*it))
  med = {it: float(np.median(v)) for it, v in times.items()}
  spread = lambda it: f"{min(times[it]) * 1e3:.2f}..{max(times[it]) * 1e3:.2f}"
  print(f"\n{config.name}, {FLAGS.dtype}, {rows} rows, context {FLAGS.context}, {FLAGS.reps} interleaved reps, "
        f"{jax.default_backend()}; median ms (min..max)")
  print("| method | step0 | " + " | ".join(f"propose(k={k})" for k in ks) +
        " | per drafted token: marginal / step0 | propose(k=1) / step0 | loop step(k) / step0 |")
  print("|---|---|" + "---|" * len(ks) + "---|---|---|")
  for m in FLAGS.methods:
    spec_ks = setups[m][0].ks
    s0 = med[(m, "step", 0)]
    marg = (med[(m, "propose", FLAGS.k)] - med[(m, "propose", 1)]) / max(FLAGS.k - 1, 1)
    cells = " | ".join(f"{med[(m, 'propose', k)] * 1e3:.2f} ({spread((m, 'propose', k))})" for k in ks)
    loop = ", ".join(f"k={k}: {med[(m, 'step', i)] / s0:.2f}" for i, k in enumerate(spec_ks))
    print(f"| {m} | {s0 * 1e3:.2f} ({spread((m, 'step', 0))}) | {cells} | {marg / s0:.3f} | "
          f"{med[(m, 'propose', 1)] / s0:.3f} | {loop} |")
  if FLAGS.loop:
    base = med[("loop", "loop", "plain")]
    print(f"\n{LOOP_STEPS}-step decode_loop calls, median ms (min..max), over the plain loop:")
    print("| loop | ms | / plain |\n|---|---|---|")
    for name in loops:
      it = ("loop", "loop", name)
      label = name if isinstance(name, str) else " ".join(name)
      print(f"| {label} | {med[it] * 1e3:.1f} ({spread(it)}) | {med[it] / base:.3f} |")
  sys.stdout.flush()


LOOP_STEPS = 8


def _slot_state(full, spec, rows, prompt, costs, speculate=True):
  """(spec, params, state) with `prompt` in slot 0 and room for a loop call's 8 steps (each call copies it)."""
  from spec_jax import slots
  state = slots.empty_state(full, spec, batch=rows, capacity=1024, costs=costs)
  req = slots.make_request(prompt, max_new=128, spec=spec, capacity=1024)
  state = slots.insert(full, state, np.int32(0), req, spec)
  return spec, full, slots.set_speculation(state, speculate)


if __name__ == "__main__":
  app.run(main)
