"""Step costs for the adaptive controller: measure them once, write them to a file, name the file in a config.

  python -m serve.calibrate --method=ngram --output=configs/costs/gemma3_270m_cpu.json   # adds/updates one entry

A cost is the wall time of one loop step drafting k tokens over that of a k = 0 step, at a given number of busy
slots. The library never reads a clock (a seeded run is reproducible); the serving harness and the server load
these tables (the file's format: serve/jobs/step_costs.py). Timing is round-robin over the options with the best of `reps` kept, so a burst of other load hits
every option alike. A drafting step also runs everything a k = 0 step runs, so a measured cost below 1 is noise:
costs are clipped to be non-decreasing in k.
"""

from __future__ import annotations

import functools
import json
import os
import time

import jax
import numpy as np
from absl import flags

from serve import generate as gen  # and its flags: --config, --method, --prompts, ...
from serve.jobs import setup as setup_lib
from serve.jobs.step_costs import entry_key, method_key
from spec_jax import backend, slots
from spec_jax.decode import spec_step


@functools.partial(jax.jit, static_argnames=("spec", "option"))
def _one_step(params, state, spec, option):
  return spec_step(params, state, spec, option)


def measure_costs(params, spec, prompts, *, batch: int, occupancies=None, reps: int = 5, max_new: int = 64,
                  clock=time.perf_counter) -> dict:
  """Costs [len(occupancies), len(ks)] measured on a state with a busy slots of `batch` (prompts cycled).
  A k > 0 step runs everything a k = 0 step runs, so a cost below a smaller k's is noise and is raised to it."""
  occupancies = sorted(set(occupancies or [a for a in (1, 2, 4, 8, 16, 32, 64) if a < batch] + [batch]))
  S = 512 * (1 + (max(len(p) for p in prompts) + max_new + spec.k_max) // 512)
  table = []
  for a in occupancies:
    state = slots.empty_state(params, spec, batch=batch, capacity=S)
    for slot in range(a):
      req = slots.make_request(prompts[slot % len(prompts)], max_new=max_new, spec=spec, capacity=S)
      state = slots.insert(params, state, slot, req, spec)
    for i in range(len(spec.ks)):
      jax.block_until_ready(_one_step(params, state, spec, i).lengths)  # compile
    times = [float("inf")] * len(spec.ks)
    for _ in range(reps):
      for i in range(len(spec.ks)):
        t0 = clock()
        jax.block_until_ready(_one_step(params, state, spec, i).lengths)
        times[i] = min(times[i], clock() - t0)
    costs = np.maximum.accumulate(np.asarray(times) / times[0])
    table.append([round(float(c), 4) for c in costs])
  return {"ks": list(spec.ks), "batch": batch, "occupancies": occupancies, "costs": table}


def main(argv):
  del argv
  FLAGS = flags.FLAGS
  cfg = gen.settings()
  setup = setup_lib.load(cfg)
  _, prompt_ids = gen.load_prompts(cfg, setup)
  spec = setup_lib.loop_spec(setup, setup_lib.draft_lengths(setup, adaptive=True))
  params = {"target": setup.params, "proposer": setup.proposer_params}
  if FLAGS.calibrate_batch != backend.batch_rows(setup.params, FLAGS.calibrate_batch):
    raise ValueError(f"a {cfg['dtype']} state of {FLAGS.calibrate_batch} row(s) runs with "
                     f"{backend.batch_rows(setup.params, FLAGS.calibrate_batch)} on this backend: calibrate that")
  entry = measure_costs(params, spec, prompt_ids, batch=FLAGS.calibrate_batch, reps=FLAGS.calibrate_reps)
  entry["machine"] = f"{os.cpu_count()} cpus, {jax.default_backend()}"
  entry["date"] = time.strftime("%Y-%m-%d")
  entries = {}
  if os.path.isfile(FLAGS.output_costs):
    with open(FLAGS.output_costs, encoding="utf-8") as f:
      entries = json.load(f)
  entries[entry_key(method_key(setup.proposer), cfg["dtype"], spec.k_max, FLAGS.calibrate_batch)] = entry
  os.makedirs(os.path.dirname(os.path.abspath(FLAGS.output_costs)), exist_ok=True)
  with open(FLAGS.output_costs, "w", encoding="utf-8") as f:
    json.dump(entries, f, indent=1, sort_keys=True)
  print(json.dumps(entry))


if __name__ == "__main__":
  from absl import app
  from serve.jobs import run_flags
  run_flags.define("output_costs", "calibrate_batch", "calibrate_reps")
  app.run(main)
