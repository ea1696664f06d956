"""What each sampling control and the grammar mask cost a decode step (issue 36's benchmark): Gemma 3 270M, the
JSON-extraction prompts (benchmarks/structured_workload.py), a state prefilled with --batches rows, then exactly
--new_tokens loop steps timed (prefill excluded). Every row has ignore_eos (it acts at commit only, so it costs no
logits work), so no row finishes early and every arm runs the same number of steps over the same rows; a grammar
row past the end of its JSON keeps emitting the stop token under the mask, at the same per-step cost.

Arms (plain decoding, k = 0, unless named "ngram"):
  none              no control (greedy): the lax.cond skips the controls' work
  penalties         presence 0.5, frequency 0.5, repetition 1.1 (greedy)
  logit_bias        20 entries (greedy)
  grammar           the person schema's token automaton (greedy)
  sampled           temperature 0.7, no control
  min_p             temperature 0.7, min_p 0.05
  all               temperature 0.7, penalties + logit_bias + min_p + grammar
  ngram, ngram+all  n-gram k = --num_speculative_tokens (0: left out), without and with every control: the controls
                    then process k + 1 positions a step
Interleaved (every arm in turn, per batch size), --repeats times; ms per step per repeat, and each arm's overhead over
the arm without controls that samples alike (greedy arms over none, sampled ones over sampled, ngram+all over ngram).

  .venv/bin/python -m benchmarks.control_cost --batches=1,4 --new_tokens=48 --repeats=3 \\
      --json_out=benchmarks/reports/structured/control_cost.json
  .venv/bin/python -m benchmarks.control_cost --batches=1 --new_tokens=4 --repeats=1     # a dry run
"""

from __future__ import annotations

import json
import logging
import time

import jax
import numpy as np
from absl import app, flags

from benchmarks import structured_workload as workload
from spec_jax import flag_table
from spec_jax.batch import start
from spec_jax.checkpoints.load import load_model
from spec_jax.config import SamplingParams
from spec_jax.controls import Controls
from spec_jax.decode import decode_loop, make_spec
from spec_jax.grammar import automaton, formats
from spec_jax.grammar.rows import GrammarRows
from spec_jax.proposers.base import NoneProposer
from spec_jax.proposers.ngram import NgramProposer

logging.getLogger("jax._src.xla_bridge").setLevel(logging.WARNING)

FLAG_NAMES = ("model", "dtype", "batches", "new_tokens", "num_speculative_tokens", "repeats", "json_out")
flag_table.define(FLAG_NAMES, model="", dtype="bfloat16", batches="1,4", new_tokens=48, num_speculative_tokens=4,
                  repeats=3, json_out="")
FLAGS = flags.FLAGS

PENALTIES = dict(presence=0.5, frequency=0.5, repetition=1.1)
TEMPERATURE = 0.7


def arm_table(k: int) -> dict:
  """name -> (controls kwargs, grammar?, temperature, proposer, the arm it is compared with)."""
  bias = {int(t): -2.0 for t in range(1000, 1020)}
  none = NoneProposer()
  arms = {"none": ({}, False, 0.0, none, None), "penalties": (PENALTIES, False, 0.0, none, "none"),
          "logit_bias": (dict(logit_bias=bias), False, 0.0, none, "none"), "grammar": ({}, True, 0.0, none, "none"),
          "sampled": ({}, False, TEMPERATURE, none, None), "min_p": (dict(min_p=0.05), False, TEMPERATURE, none, "sampled"),
          "all": (dict(PENALTIES, logit_bias=bias, min_p=0.05), True, TEMPERATURE, none, "sampled")}
  if k:
    ng = NgramProposer(k=k)
    arms["ngram"] = ({}, False, TEMPERATURE, ng, None)
    arms["ngram+all"] = (dict(PENALTIES, logit_bias=bias, min_p=0.05), True, TEMPERATURE, ng, "ngram")
  return arms


def main(argv):
  del argv
  config, target, tok = load_model(FLAGS.model or None, FLAGS.dtype)
  stop_ids = tuple(sorted(set(config.eos_ids) | set(tok.stop_ids)))
  auto = automaton.Compiler(tok, stop_ids).regex(formats.json_schema_regex(workload.SCHEMA))
  people = workload.people(max(int(b) for b in FLAGS.batches.split(",")))
  prompts = [tok.encode(tok.apply_chat_template([workload.prompt_of(p)])) for p in people]
  steps = FLAGS.new_tokens
  arms = arm_table(FLAGS.num_speculative_tokens)
  out = {"model": FLAGS.model or "gemma3-270m (packaged)", "dtype": FLAGS.dtype, "steps": steps,
         "repeats": FLAGS.repeats, "automaton": [auto.num_states, auto.num_classes], "batches": {}}
  for B in (int(b) for b in FLAGS.batches.split(",")):
    rows = prompts[:B]
    runs = {}
    for name, (kw, grammar, temp, proposer, _) in arms.items():
      spec = make_spec(config, proposer, adaptive_k=False, stop_ids=stop_ids)
      c = Controls.make(B, ignore_eos=True, **kw)
      if grammar:
        c = c.replace(grammar=GrammarRows.make([auto] * B, config.vocab_size))
      runs[name] = (spec, c, SamplingParams.make(B, temperature=temp))
    params = {"target": target, "proposer": {}}

    def timed(name):
      spec, c, sampling = runs[name]
      state = start(params, spec, rows, max_new_tokens=steps * (spec.k_max + 1) + 8, sampling=sampling, controls=c)
      jax.block_until_ready(state.tokens)
      t = time.perf_counter()
      state = decode_loop(params, state, spec, steps)
      jax.block_until_ready(state.tokens)
      dt = time.perf_counter() - t
      if int(state.step) != steps or bool(np.asarray(state.done).any()):
        raise AssertionError(f"{name}: {int(state.step)} steps, done {np.asarray(state.done)}; expected {steps}")
      return 1e3 * dt / steps

    for name in runs:  # compile
      timed(name)
    ms = {name: [] for name in runs}
    for _ in range(FLAGS.repeats):
      for name in runs:
        ms[name].append(timed(name))
    table = {}
    for name, (*_, ref) in arms.items():
      row = {"ms_per_step": [round(x, 2) for x in ms[name]], "median": round(float(np.median(ms[name])), 2),
             "spread": round((max(ms[name]) - min(ms[name])) / float(np.median(ms[name])), 3)}
      if ref is not None:
        per = [a / b - 1 for a, b in zip(ms[name], ms[ref])]  # paired per repeat (interleaved)
        row.update(vs=ref, overhead_by_repeat=[round(x, 3) for x in per], overhead=round(float(np.median(per)), 3))
      table[name] = row
    out["batches"][str(B)] = table
    print(f"\nbatch {B}, {steps} steps, ms per step per repeat (overhead over the arm in brackets, per repeat)")
    print("| arm | ms/step | spread | overhead |\n|---|---|---|---|")
    for name, row in table.items():
      ov = (f"{' / '.join(f'{x:+.1%}' for x in row['overhead_by_repeat'])} (vs {row['vs']})" if "vs" in row else "-")
      print(f"| {name} | {' / '.join(f'{x:.1f}' for x in row['ms_per_step'])} | {row['spread']:.1%} | {ov} |")
  if FLAGS.json_out:
    with open(FLAGS.json_out, "w") as f:
      json.dump(out, f, indent=1)


if __name__ == "__main__":
  app.run(main)
