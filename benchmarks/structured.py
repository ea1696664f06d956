"""Structured outputs at batch 1 (issue 36's benchmark): the JSON-extraction workload (benchmarks/structured_workload.py:
one person schema over seeded descriptions, chat-templated) on Gemma 3 270M, greedy, every output constrained by the
schema's token automaton (spec_jax/grammar/). Arms, each prompt in turn (plain, ngram, ngram+forced, forced, plain,
...), `--repeats` times:

  plain         no speculation (k = 0): plain constrained decoding
  ngram         n-gram k drafts, the grammar's forced tokens NOT drafted (the automaton's `forced` table blanked)
  ngram+forced  n-gram k drafts, positions the grammar forces drafted with the forced token (what the server does)
  forced        grammar-forced drafts alone (spec_jax/proposers/grammar_only.py: k positions, only forced ones filled)

k is fixed (--num_speculative_tokens; no adaptive controller: the arms compare as they are). Per arm: output tok/s per
repeat (prefill included: wall from prefill to the last token of each prompt, summed), tau (tokens per verify step,
bonus included), the acceptance rate, the share of drafted (and of accepted) tokens that were grammar-forced, the
share of outputs valid against the schema (must be 100 %), and whether every output equals plain's token for token
(greedy: it must). The forced shares come from one more, untimed pass that runs the loop a step at a time and
recomputes each step's drafts as the step builds them (checked: the replayed drafts' count equals the loop's own
`drafted` counter, and the accepted ones equal the committed tokens).

  .venv/bin/python -m benchmarks.structured --limit=48 --repeats=2 --json_out=benchmarks/reports/structured/batch1.json
  .venv/bin/python -m benchmarks.structured --limit=2 --max_new_tokens=24 --repeats=1    # a dry run, ~2 min
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

from benchmarks import structured_workload as workload
from spec_jax import flag_table, streams
from spec_jax.batch import start
from spec_jax.checkpoints.load import load_model
from spec_jax.controls import Controls
from spec_jax.decode import decode_loop, draft_keys, make_spec
from spec_jax.grammar import automaton, formats
from spec_jax.grammar import rows as grammar_rows
from spec_jax.grammar.rows import GrammarRows
from spec_jax.proposers.base import NoneProposer, ProposeContext
from spec_jax.proposers.grammar_only import GrammarOnlyProposer
from spec_jax.proposers.ngram import NgramProposer
from spec_jax.stats import summarize

logging.getLogger("jax._src.xla_bridge").setLevel(logging.WARNING)

FLAG_NAMES = ("model", "dtype", "limit", "max_new_tokens", "num_speculative_tokens", "repeats", "json_out")
flag_table.define(FLAG_NAMES, model="", dtype="bfloat16", limit=48, max_new_tokens=96, num_speculative_tokens=4,
                  repeats=2, json_out="")
FLAGS = flags.FLAGS


@dataclasses.dataclass(frozen=True)
class Arm:
  name: str
  proposer: object
  forced_drafts: bool = True


def arms(k: int) -> list[Arm]:
  return [Arm("plain", NoneProposer()), Arm("ngram", NgramProposer(k=k), forced_drafts=False),
          Arm("ngram+forced", NgramProposer(k=k)), Arm("forced", GrammarOnlyProposer(k=k))]


def controls_for(auto, vocab: int, forced_drafts: bool) -> Controls:
  if not forced_drafts:  # the same automaton with no forced state: the loop drafts only the proposer's tokens
    auto = dataclasses.replace(auto, forced=np.full_like(auto.forced, -1))
  return Controls.make(1).replace(grammar=GrammarRows.make([auto], vocab))


def run_one(params, spec, ids, controls, max_new: int, max_steps=None):
  """Prefill + loop for one prompt; -> (state, seconds)."""
  t0 = time.perf_counter()
  state = start(params, spec, [ids], max_new_tokens=max_new, controls=controls)
  state = decode_loop(params, state, spec) if max_steps is None else state
  jax.block_until_ready(state.tokens)
  return state, time.perf_counter() - t0


@functools.partial(jax.jit, static_argnames=("spec",))
def step_drafts(params, state, spec):
  """The drafts the next step will verify (spec_step's drafting, k fixed): tokens int32[B, k] (< 0: none) and
  whether each was the grammar's forced token."""
  k = spec.ks[0]
  B = state.tokens.shape[0]
  ctx = ProposeContext(state.tokens, state.lengths, state.sampling, state.last_hidden)
  keys = draft_keys(streams.rows(state.keys, B), state.lengths, k)  # as spec_step draws them
  draft, _ = spec.proposer.propose(params["proposer"], state.pstate, ctx, k, keys)
  g = state.controls.grammar
  tokens, _ = grammar_rows.forced_chain(g, draft.tokens.astype(jnp.int32), None)
  tokens = jnp.where(jnp.arange(k)[None, :] < state.draft_cap[:, None], tokens, -1)
  last = jnp.take_along_axis(state.tokens, (state.lengths - 1)[:, None], axis=1)
  states = grammar_rows.path_states(g, jnp.concatenate([last, tokens], axis=1),
                                    grammar_rows.chain_parents(B, k + 1))[:, :k]  # the state before each draft
  forced = (states >= 0) & (g.forced[jnp.arange(B)[:, None], jnp.maximum(states, 0)] >= 0) & (tokens >= 0)
  return tokens, forced


def forced_shares(params, spec, ids, controls, max_new: int) -> dict:
  """Run one prompt a step at a time, counting drafted / forced / accepted drafts per step (untimed)."""
  state = start(params, spec, [ids], max_new_tokens=max_new, controls=controls)
  n = dict(drafted=0, forced=0, accepted=0, accepted_forced=0)
  while not bool(np.asarray(state.done)[0]):
    tokens, forced = (np.asarray(x)[0] for x in step_drafts(params, state, spec))
    length, before = int(state.lengths[0]), jax.tree.map(lambda x: np.asarray(x)[0], state.stats)
    state = decode_loop(params, state, spec, 1)
    after = jax.tree.map(lambda x: np.asarray(x)[0], state.stats)
    drafted, acc = int(after.drafted - before.drafted), int(after.accepted - before.accepted)
    committed = np.asarray(state.tokens)[0, length:length + acc]
    if drafted != int((tokens >= 0).sum()) or not np.array_equal(committed, tokens[:acc]):
      raise AssertionError(f"the replayed drafts {tokens.tolist()} disagree with the loop's step (drafted {drafted}, "
                           f"committed {committed.tolist()}): spec_step's drafting changed; update step_drafts")
    n["drafted"] += drafted
    n["forced"] += int(forced.sum())
    n["accepted"] += acc
    n["accepted_forced"] += int(forced[:acc].sum())
  return n


def main(argv):
  del argv
  config, target, tok = load_model(FLAGS.model or None, FLAGS.dtype)
  k, max_new = FLAGS.num_speculative_tokens, FLAGS.max_new_tokens
  stop_ids = tuple(sorted(set(config.eos_ids) | set(tok.stop_ids)))
  t = time.perf_counter()
  auto = automaton.Compiler(tok, stop_ids).regex(formats.json_schema_regex(workload.SCHEMA))
  compile_s = time.perf_counter() - t
  people = workload.people(FLAGS.limit)
  prompts = [tok.encode(tok.apply_chat_template([workload.prompt_of(p)])) for p in people]
  runs = []
  for a in arms(k):
    spec = make_spec(config, a.proposer, adaptive_k=False, stop_ids=stop_ids)
    runs.append((a, spec, {"target": target, "proposer": {}}, controls_for(auto, config.vocab_size, a.forced_drafts)))
  for a, spec, params, c in runs:  # compile (prompts share one prefill bucket and cache capacity)
    run_one(params, spec, prompts[0], c, 2)
  walls = {a.name: [0.0] * FLAGS.repeats for a, *_ in runs}
  outs = {a.name: [None] * len(prompts) for a, *_ in runs}
  stats = {a.name: [None] * len(prompts) for a, *_ in runs}
  for r in range(FLAGS.repeats):
    for i, ids in enumerate(prompts):
      for a, spec, params, c in runs:
        state, dt = run_one(params, spec, ids, c, max_new)
        walls[a.name][r] += dt
        L, P = int(state.lengths[0]), int(state.prompt_lens[0])
        outs[a.name][i] = np.asarray(state.tokens)[0, P:L].tolist()
        stats[a.name][i] = jax.tree.map(lambda x: np.asarray(x)[:1], state.stats)
    print(f"repeat {r}: " + ", ".join(f"{n} {sum(map(len, outs[n])) / w[r]:.1f} tok/s" for n, w in walls.items()),
          flush=True)
  result = {"model": FLAGS.model or "gemma3-270m (packaged)", "dtype": FLAGS.dtype, "k": k, "max_new_tokens": max_new,
            "prompts": len(prompts), "repeats": FLAGS.repeats, "automaton": {
                "states": auto.num_states, "classes": auto.num_classes, "forced_states": int((auto.forced >= 0).sum()),
                "compile_s": round(compile_s, 2)}, "arms": {}}
  plain = outs["plain"]
  for a, spec, params, c in runs:
    toks = outs[a.name]
    texts = [tok.decode([t for t in o if t not in stop_ids]) for o in toks]
    valid = [workload.validate(x) for x in texts]
    n_out = sum(map(len, toks))
    rates = [n_out / w for w in walls[a.name]]
    s = summarize(jax.tree.map(lambda *xs: np.concatenate(xs), *stats[a.name]))
    row = {"output_tokens": n_out, "tok_s_by_repeat": [round(x, 2) for x in rates],
           "tok_s": round(float(np.median(rates)), 2), "valid": sum(v for v, _ in valid), "outputs": len(toks),
           "invalid": [(people[i]["id"], why, texts[i]) for i, (v, why) in enumerate(valid) if not v][:5],
           "same_as_plain": sum(x == y for x, y in zip(toks, plain)), "tau": s["mean_acceptance_length"],
           "acceptance_rate": s["acceptance_rate"], "verify_steps": s["verify_steps"],
           "fields_as_stated": sum(_matches(x, p["expected"]) for x, p in zip(texts, people))}
    if spec.k_max:
      n = {key: 0 for key in ("drafted", "forced", "accepted", "accepted_forced")}
      for ids in prompts:
        for key, v in forced_shares(params, spec, ids, c, max_new).items():
          n[key] += v
      row.update(n, forced_share_of_drafted=n["forced"] / max(n["drafted"], 1),
                 forced_share_of_accepted=n["accepted_forced"] / max(n["accepted"], 1))
    result["arms"][a.name] = row
  base = result["arms"]["plain"]["tok_s_by_repeat"]
  print(f"\nautomaton {auto.num_states} states x {auto.num_classes} classes ({result['automaton']['forced_states']} "
        f"forced), compiled in {compile_s:.1f} s; {len(prompts)} prompts, k = {k}, greedy\n")
  print("| arm | tok/s per repeat | speedup (per repeat) | tau | acceptance | forced / drafted | forced / accepted "
        "| valid | = plain |")
  print("|---|---|---|---|---|---|---|---|---|")
  for name, row in result["arms"].items():
    sp = [x / b for x, b in zip(row["tok_s_by_repeat"], base)]
    row["speedup_by_repeat"] = [round(x, 3) for x in sp]
    fd = f"{row['forced_share_of_drafted']:.0%}" if "forced" in row else "-"
    fa = f"{row['forced_share_of_accepted']:.0%}" if "forced" in row else "-"
    print(f"| {name} | {' / '.join(f'{x:.1f}' for x in row['tok_s_by_repeat'])} | "
          f"{' / '.join(f'{x:.2f}x' for x in sp)} | {row['tau']:.2f} | {row['acceptance_rate'] or 0:.2f} | {fd} | {fa} | "
          f"{row['valid']}/{row['outputs']} | {row['same_as_plain']}/{row['outputs']} |")
  if FLAGS.json_out:
    with open(FLAGS.json_out, "w") as f:
      json.dump(result, f, indent=1)
  bad = [n for n, row in result["arms"].items() if row["valid"] != row["outputs"] or row["same_as_plain"] != row["outputs"]]
  if bad:
    raise SystemExit(f"arms with invalid outputs or outputs unlike plain decoding's: {bad}")


def _matches(text: str, expected: dict) -> bool:
  """Does the output state the fields the description gave (the model's quality, not the grammar's)?"""
  try:
    return json.loads(text) == expected
  except ValueError:
    return False


if __name__ == "__main__":
  app.run(main)
