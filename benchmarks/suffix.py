"""The suffix proposer on traffic with and without cross-request repetition, through long-lived slots (issue 30).

  python benchmarks/suffix.py --json_out=/tmp/suffix.json
  python benchmarks/suffix.py --methods=ngram,suffix,suffix@4 --json_out=/tmp/suffix.json   # and the depth rule off
  python benchmarks/suffix.py --traffic=retries --batches=1 --requests_per_kind=6   # a quick look

Gemma 3 270M (the packaged model), bfloat16 like serve.generate, k fixed (no adaptive controller: the proposers
compare as they are). The prompts are Spec-Bench's questions (spec_jax.datasets.SPEC_BENCH), the odd-indexed ones
only (question index 1, 3, 5, ...): the even-indexed ones are the tuning split, never reported. Traffic kinds:

  specbench        Spec-Bench as is, spread over the file (little cross-request repetition)
  retries          each prompt sent 3 times in a row, greedy
  retries_sampled  the same at --retry_temperature, each send with its own seed
  templated        one instruction format over different inputs: "Extract the names ... as a JSON list", one worked
                   example, then "Sentence: <s>\nNames:" (raw text: the model is a base model), over sentences
                   taken from the questions' text (their first with a capitalized word past the first)

Arms: plain (k = 0) and --methods (n-gram looks at the row's own prompt and output only; suffix also at what earlier
requests wrote; suffix@F is suffix with suffix_decoding_max_spec_factor F: F = 4 drafts all k = 4 tokens on a
one-token match, as n-gram does, where F = 1, vLLM's default, drafts one). Each arm keeps one SlotTable per slot
count (--batches) for the whole run, as the server keeps its slots, warmed up first (its warm-up requests are
another tenant's, so their text is never drafted from). Each kind is one tenant; a repeat (--repeats) is another,
so it cannot draft from the previous repeat's answers. Requests go in waves of `slots` requests (insert them all,
run until all are done, release), and the arms take each wave in turn (plain, ngram, suffix, plain, ...): machine
load hits them alike. A wave's time runs from its first insert (prefill included) to its last token on the host.

Per kind and arm: output tokens/s, speedup over plain and over n-gram, τ (spec_jax.stats.summarize: tokens per
verify step, bonus included), the share of accepted tokens that came from the history, and whether every output
equals plain's (greedy kinds must).
"""

from __future__ import annotations

import json
import logging
import re
import time

import jax
import numpy as np
from absl import app, flags

from spec_jax import flag_table

from serve.jobs.prompts import parse_record
from spec_jax import slots
from spec_jax.checkpoints.load import load_model
from spec_jax.datasets import SPEC_BENCH, read_jsonl
from spec_jax.decode import make_spec
from spec_jax.prefill import DEFAULT_CHUNK, bucket
from spec_jax.proposers.base import NoneProposer
from spec_jax.proposers.registry import Target, build_proposer
from spec_jax.slot_table import SlotTable
from spec_jax.spec_config import SpecConfig
from spec_jax.stats import Stats, summarize

logging.getLogger("jax._src.xla_bridge").setLevel(logging.WARNING)

KINDS = ("specbench", "retries", "retries_sampled", "templated")
FLAG_NAMES = ("model", "dtype", "traffic", "requests_per_kind", "max_new_tokens", "methods", "num_speculative_tokens",
              "batches", "retry_temperature", "repeats", "json_out", "suffix_history_tokens", "prompts_out")
flag_table.define(FLAG_NAMES, model="", dtype="bfloat16", traffic=list(KINDS), requests_per_kind=8,
                  max_new_tokens=64, methods=["ngram", "suffix"], num_speculative_tokens=4, batches="1,4",
                  retry_temperature=0.7, repeats=1, suffix_history_tokens=2048)
FLAGS = flags.FLAGS

SENDS = 3  # a retried prompt is sent this many times in a row
# Raw text with one worked example, not a chat turn: the packaged Gemma 3 270M is a base model, which follows a
# format it is shown (given a chat turn it mostly repeats the question).
TEMPLATE = ("Extract the names of people and places in each sentence as a JSON list of strings.\n\n"
            "Sentence: Maria flew from Lisbon to Boston to meet her brother Carlos.\n"
            "Names: [\"Maria\", \"Lisbon\", \"Boston\", \"Carlos\"]\n\nSentence: {}\nNames:")
WARM_TENANT = 1000  # the warm-up requests' tenant: nothing measured drafts from their answers


def held_apart(tok) -> list:
  """Spec-Bench's odd-indexed questions in file order: (index, Prompt chat-templated as the other benchmarks do,
  the raw first turn)."""
  return [(i, parse_record(rec, where, tok), rec["turns"][0]) for i, (where, rec) in enumerate(read_jsonl(SPEC_BENCH))
          if i % 2 == 1]


def spread(items: list, n: int, offset: float = 0.0) -> list:
  """n items evenly over the list (each part of the file, so each category, gets its share); offset 0.5 takes the
  ones halfway between offset 0's."""
  return [items[int((j + offset) * len(items) / n)] for j in range(n)]


def sentences(questions: list, n: int) -> list:
  """n sentences of 8-30 words with a capitalized word past the first (a name, likely) from the questions' text,
  at most one per question."""
  out = []
  for _, _, text in questions:
    for s in re.split(r"(?<=[.!?])\s+", " ".join(text.split())):
      s = re.sub(r"^(Summarize|Translate \w+ to \w+):\s*", "", s)  # the question's own instruction
      words = s.split()
      if 8 <= len(words) <= 30 and any(w[:1].isupper() for w in words[1:]) and s not in out:
        out.append(s)
        break
  if len(out) < n:
    raise ValueError(f"only {len(out)} sentences for the templated kind, {n} wanted")
  return spread(out, n)


def traffic(kind: str, tok, n: int) -> list:
  """-> [(request name, prompt ids, temperature, seed)] of one kind, in the order they are sent."""
  qs = held_apart(tok)
  if kind == "specbench":
    return [(f"q{i}", tok.encode(p.text), 0.0, 0) for i, p, _ in spread(qs, n)]
  if kind in ("retries", "retries_sampled"):  # other questions than specbench's, each sent SENDS times in a row
    temp = 0.0 if kind == "retries" else FLAGS.retry_temperature
    taken = {i for i, _, _ in spread(qs, n)}
    rest = [q for q in qs if q[0] not in taken]
    return [(f"q{i}#{s}", tok.encode(p.text), temp, s) for i, p, _ in spread(rest, -(-n // SENDS), 0.5)
            for s in range(SENDS)]
  if kind == "templated":
    return [(f"t{j}", tok.encode(TEMPLATE.format(s)), 0.0, 0)
            for j, s in enumerate(sentences(qs, n))]
  raise ValueError(f"unknown traffic kind {kind!r} (one of {KINDS})")


def write_repeats(path: str, n: int) -> None:
  """The batch job's check of the history (issue 45): the specbench kind's n held-apart questions, each twice in a
  row (categories "first" and "second", so serve.generate's table splits the copies), chat turns as the file has
  them. `python -m serve.generate --prompts=PATH --method=suffix --compare` runs the copies at batch 1 one after
  the other."""
  qs = [(i, rec) for i, (_, rec) in enumerate(read_jsonl(SPEC_BENCH)) if i % 2 == 1]
  with open(path, "w", encoding="utf-8") as f:
    for i, rec in spread(qs, n):
      for copy in ("first", "second"):
        f.write(json.dumps({"id": f"q{i}-{copy}", "category": copy, "turns": rec["turns"][:1]}) + "\n")
  print(f"wrote {2 * n} prompts to {path}")


class ArmRun:
  """One arm at one slot count: its long-lived table, and what it measured per kind."""

  def __init__(self, label, proposer, params, config, tok, slots_n, capacity):
    self.label, self.proposer = label, proposer
    self.spec = make_spec(config, proposer, adaptive_k=False, stop_ids=tok.stop_ids)
    self.table = SlotTable({"target": params, "proposer": {}}, self.spec, num_slots=slots_n, capacity=capacity)
    self.capacity = capacity
    self.walls: dict = {}
    self.records: dict = {}

  def request(self, ids, temp, seed, tenant):
    return slots.make_request(ids, max_new=FLAGS.max_new_tokens, spec=self.spec, capacity=self.capacity,
                              temperature=temp, seed=seed, tenant=tenant)

  def warm(self, prompt_ids):
    """Compile insert for every prompt bucket and the loop, by requests of the warm-up tenant."""
    for ids in prompt_ids:
      self.table.insert(None, self.request(ids, 0.7, 0, WARM_TENANT))
      snap, held = self.table.run(FLAGS.max_new_tokens + 1)
      jax.device_get(snap)
      for slot in held:
        self.table.release(slot)

  def wave(self, kind, reqs, tenant, repeat):
    t0 = time.perf_counter()
    for name, ids, temp, seed in reqs:
      self.table.insert((name, len(ids)), self.request(ids, temp, seed, tenant))
    snap, held = self.table.run(FLAGS.max_new_tokens + 1)
    snap = jax.device_get(snap)
    wall = time.perf_counter() - t0
    self.walls.setdefault(kind, []).append((repeat, wall))
    for slot, (name, plen) in held.items():
      if not snap.done[slot]:
        raise RuntimeError(f"{self.label}: {name} unfinished after {FLAGS.max_new_tokens + 1} steps")
      n = int(snap.lengths[slot])
      self.records.setdefault((kind, repeat), {})[name] = dict(
          token_ids=snap.tokens[slot, plen:n].tolist(), steps=int(snap.steps[slot]),
          drafted=int(snap.drafted[slot]), accepted=int(snap.accepted[slot]), emitted=n - plen - 1,
          from_history=int(snap.accepted_from_history[slot]),
          drafted_at=snap.drafted_at[slot].tolist(), accepted_at=snap.accepted_at[slot].tolist())
      self.table.release(slot)


def kind_rate(arm: ArmRun, kind: str, repeats: int) -> list:
  """Output tokens/s of one kind, per repeat: its tokens over its waves' time."""
  rates = []
  for rep in range(repeats):
    wall = sum(w for r, w in arm.walls[kind] if r == rep)
    rates.append(sum(len(r["token_ids"]) for r in arm.records[(kind, rep)].values()) / wall)
  return rates


def kind_summary(arm: ArmRun, plain: ArmRun, ngram, kind: str, repeats: int) -> dict:
  recs = [r for rep in range(repeats) for r in arm.records[(kind, rep)].values()]
  rate = float(np.median(kind_rate(arm, kind, repeats)))
  out = {"requests": len(recs) // repeats, "output_tokens": sum(len(r["token_ids"]) for r in recs) // repeats,
         "tok_s": rate, "tok_s_by_repeat": [round(x, 2) for x in kind_rate(arm, kind, repeats)],
         "identical_to_plain": all(arm.records[(kind, rep)][name]["token_ids"] == r["token_ids"]
                                   for rep in range(repeats) for name, r in plain.records[(kind, rep)].items())}
  if arm.proposer.k:
    k = arm.proposer.k
    stats = Stats(*(np.asarray([r[f] for r in recs], np.int32) for f in ("steps", "drafted", "accepted", "emitted")),
                  drafted_at=np.asarray([r["drafted_at"][:k] for r in recs], np.int32),
                  accepted_at=np.asarray([r["accepted_at"][:k] for r in recs], np.int32))
    s = summarize(stats)
    hist = sum(r["from_history"] for r in recs)
    out.update(tau=s["mean_acceptance_length"], acceptance_rate=s["acceptance_rate"],
               per_position_acceptance=s["per_position_acceptance"], accepted_tokens=s["accepted_tokens"],
               accepted_from_history=hist, history_share=hist / s["accepted_tokens"] if s["accepted_tokens"] else 0.0,
               speedup_over_plain=rate / float(np.median(kind_rate(plain, kind, repeats))))
    if ngram is not None and ngram is not arm:
      out["speedup_over_ngram"] = rate / float(np.median(kind_rate(ngram, kind, repeats)))
  return out


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  if FLAGS.prompts_out:
    return write_repeats(FLAGS.prompts_out, FLAGS.requests_per_kind)
  t_start = time.time()
  config, params, tok = load_model(FLAGS.model or None, FLAGS.dtype)
  kinds = [k for k in FLAGS.traffic if k]
  sent = {kind: traffic(kind, tok, FLAGS.requests_per_kind) for kind in kinds}
  all_ids = [ids for reqs in sent.values() for _, ids, _, _ in reqs]
  k = FLAGS.num_speculative_tokens
  longest = max(bucket(len(ids), DEFAULT_CHUNK)[0] for ids in all_ids)
  capacity = -(-(longest + FLAGS.max_new_tokens + k + 2) // DEFAULT_CHUNK) * DEFAULT_CHUNK
  by_bucket = {}
  for ids in all_ids:
    by_bucket.setdefault(bucket(len(ids), DEFAULT_CHUNK)[0], ids)
  methods = [m for m in FLAGS.methods if m]
  proposers = [("plain", NoneProposer())]
  for m in methods:  # suffix@F: suffix with suffix_decoding_max_spec_factor F
    method, _, factor = m.partition("@")
    proposer, _ = build_proposer(SpecConfig(method, k, suffix_history_tokens=FLAGS.suffix_history_tokens,
                                            suffix_decoding_max_spec_factor=float(factor or 1.0)),
                                 Target(config, params, dtype=FLAGS.dtype))
    proposers.append((m, proposer))
  results = {"settings": {name: FLAGS[name].value for name in FLAG_NAMES}, "capacity": capacity,
             "split": "Spec-Bench questions with an odd index (1, 3, 5, ...)",
             "requests": {kind: [name for name, _, _, _ in reqs] for kind, reqs in sent.items()}, "by_slots": {}}
  for slots_n in [int(b) for b in FLAGS.batches.split(",") if b]:
    t0 = time.time()
    arms = [ArmRun(label, p, params, config, tok, slots_n, capacity) for label, p in proposers]
    for arm in arms:
      arm.warm(list(by_bucket.values()))
    print(f"[{slots_n} slot(s)] warmed up in {time.time() - t0:.0f} s (capacity {capacity})", flush=True)
    for rep in range(FLAGS.repeats):
      for ki, kind in enumerate(kinds):
        reqs = sent[kind]
        tenant = 1 + ki + rep * len(KINDS)
        for w in range(0, len(reqs), slots_n):
          for arm in arms:
            arm.wave(kind, reqs[w:w + slots_n], tenant, rep)
      print(f"[{slots_n} slot(s)] repeat {rep + 1}/{FLAGS.repeats} done at {time.time() - t_start:.0f} s", flush=True)
    plain = arms[0]
    ngram = next((a for a in arms if a.label == "ngram"), None)
    table = {kind: {arm.label: kind_summary(arm, plain, ngram, kind, FLAGS.repeats) for arm in arms}
             for kind in kinds}
    results["by_slots"][str(slots_n)] = {"kinds": table, "outputs": {
        arm.label: {f"{kind}/{rep}": {n: r["token_ids"] for n, r in recs.items()}
                    for (kind, rep), recs in arm.records.items()} for arm in arms}}
    print(format_table(slots_n, table), flush=True)
  results["wall_s"] = time.time() - t_start
  if FLAGS.json_out:
    with open(FLAGS.json_out, "w") as f:
      json.dump(results, f, indent=1)


def format_table(slots_n: int, table: dict) -> str:
  lines = [f"\n== {slots_n} slot(s)",
           "| traffic | arm | tok/s (by repeat) | over plain | over n-gram | τ | from history | identical to plain |",
           "|---|---|---|---|---|---|---|---|"]
  for kind, arms in table.items():
    for label, s in arms.items():
      cells = [kind, label, " / ".join(f"{x:.1f}" for x in s["tok_s_by_repeat"]),
               f"{s['speedup_over_plain']:.2f}x" if "speedup_over_plain" in s else "",
               f"{s['speedup_over_ngram']:.2f}x" if "speedup_over_ngram" in s else "",
               f"{s['tau']:.2f}" if "tau" in s else "", f"{s['history_share']:.2f}" if "tau" in s else "",
               "yes" if s["identical_to_plain"] else "no"]
      lines.append("| " + " | ".join(cells) + " |")
  return "\n".join(lines)


if __name__ == "__main__":
  app.run(main)
