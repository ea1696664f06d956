"""Self-distilled answers: the frozen target answers the training prompts with this project's own decoding.

  python -m train.distill                       # every training prompt but the held-out ones, into data/distill/
  python -m train.distill --batch=32 --limit=64 --out=/tmp/probe   # a short run (throughput probes, tests)

Prompts are data/train/*.jsonl (never Spec-Bench) in the data pipeline's seeded order
(`train.data.prompt_order`), less its last HELD_OUT entries, which `train.eval_acceptance` measures. Each prompt
is answered once, in its chat template: greedy for two of every three prompts, temperature 0.7 for the third,
up to --max_new_tokens or the end of the turn.

Decoding is continuous batching over `spec_jax.slots` (the server's scheduler, without HTTP): a free slot takes
the next prompt as soon as its last answer ends, so no row idles behind a long answer. The loop itself is the
one the server runs. A run is reproducible for a given batch size and machine. Another batch size changes float
rounding in the batched dots, which flips near-ties (measured: 0.9 % fewer or more tokens over 96 prompts between
batch 16, 32 and 64). A sampled answer's first token comes from its request's key (a function of its position),
the rest from the loop's key, which the batch shares: a resumed shard's sampled answers are other samples of the
same distribution, its greedy answers the same tokens.

Output, compact enough for git: shard-NNNNN.npz per `--shard_size` prompts (prompt position, prompt index in
`load_examples`, temperature, finish, offsets, the prompt + answer token ids as one int32 run) and manifest.json
(settings, each shard's sha256 and counts, the measured throughput): the format is train/distill_shards.py's.
Re-running resumes: shards already written (and matching the manifest's checksum) are skipped. `train.data` reads
the shards back with `distill_shards.load_shards`.
"""

from __future__ import annotations

import os
import sys
import time

import jax
from absl import app, flags

from spec_jax import flag_table, slots
from spec_jax.batch import capacity_for
from spec_jax.checkpoints.load import load_model
from spec_jax.datasets import DISTILL_DIR
from spec_jax.decode import FINISH_NAMES, make_spec
from spec_jax.prefill import bucket
from spec_jax.slot_table import SlotTable
from train import data as data_lib
from train import distill_shards as shards
from train.examples import load_examples

DEFAULT_OUT = DISTILL_DIR

flag_table.define(("out", "model", "dtype", "batch", "max_new_tokens", "max_prompt_tokens", "shard_size", "limit",
                   "steps_per_sync", "seed"), out=DEFAULT_OUT, model="", dtype="float32", batch=32,
                  max_new_tokens=256, limit=0, steps_per_sync=16, seed=0)
FLAGS = flags.FLAGS

SAMPLED_TEMPERATURE = 0.7


def temperature_at(position: int) -> float:
  """Greedy for two of every three prompts, sampled for the third."""
  return SAMPLED_TEMPERATURE if position % 3 == 2 else 0.0


def settings(model: str, dtype: str, max_new_tokens: int, max_prompt_tokens: int, shard_size: int, seed: int,
             target_name: str) -> dict:
  """What shapes the answers (the batch size and sync cadence do not)."""
  return dict(format_version=shards.FORMAT_VERSION, model=model or "gemma3-270m (packaged GGUF)", target_name=target_name,
              dtype=dtype, max_new_tokens=max_new_tokens, max_prompt_tokens=max_prompt_tokens,
              shard_size=shard_size, seed=seed, greedy_every=[0, 1], sampled_every=[2],
              sampled_temperature=SAMPLED_TEMPERATURE, held_out=data_lib.HELD_OUT)


class Generator:
  """Continuous batching over spec_jax.slot_table for a list of prompts; answers come back as they finish."""

  def __init__(self, params, config, tokenizer, *, batch: int, max_new_tokens: int, capacity: int,
               steps_per_sync: int = 16):
    self.spec = make_spec(config, adaptive_k=False, stop_ids=tokenizer.stop_ids if tokenizer else ())
    self.max_new = max_new_tokens
    self.capacity = capacity
    self.steps = steps_per_sync
    self.table = SlotTable({"target": params, "proposer": {}}, self.spec, num_slots=batch, capacity=capacity)

  def run(self, jobs, on_done, log=print):
    """jobs: iterable of (key, prompt_ids, temperature, seed). on_done(key, new_ids, stopped)."""
    table = self.table
    it = iter(jobs)
    exhausted = False
    while True:
      while table.free and not exhausted:
        job = next(it, None)
        if job is None:
          exhausted = True
          break
        key, ids, temp, seed = job
        req = slots.make_request(ids, max_new=self.max_new, spec=self.spec, capacity=self.capacity,
                                 temperature=temp, seed=seed)
        table.insert((key, len(ids)), req)
      if not table.holders:
        return
      snap, held = table.run(self.steps)
      snap = jax.device_get(snap)
      for slot, (key, plen) in held.items():
        if snap.done[slot]:
          new = snap.tokens[slot, plen:snap.lengths[slot]].tolist()
          on_done(key, new, FINISH_NAMES[int(snap.finish[slot])] == "stop")
          table.release(slot)


def prompts_in_order(tokenizer, seed: int, limit: int = 0, data_dir=None):
  """-> [(position, example index, prompt text)] for the non-held-out prompts of the seeded order."""
  examples = load_examples(data_dir or data_lib.TRAIN_DIR)
  order = data_lib.prompt_order(len(examples), seed)[:len(examples) - data_lib.HELD_OUT]
  if limit:
    order = order[:limit]
  return [(pos, int(i), examples[i][0]) for pos, i in enumerate(order)]


def distill(params, config, tokenizer, *, out: str, batch: int, max_new_tokens: int, max_prompt_tokens: int,
            shard_size: int, seed: int, limit: int = 0, steps_per_sync: int = 16, model: str = "",
            dtype: str = "float32", log=print) -> dict:
  os.makedirs(out, exist_ok=True)
  want = settings(model, dtype, max_new_tokens, max_prompt_tokens, shard_size, seed, config.name)
  manifest = shards.read_manifest(out)
  if manifest and manifest.get("settings") != want:
    raise ValueError(f"{out} holds answers made with other settings ({manifest.get('settings')}); use another "
                     "--out or the same settings")
  manifest = manifest or {"settings": want, "shards": {}, "runs": []}
  items = prompts_in_order(tokenizer, seed, limit)
  shard_of = lambda pos: f"shard-{pos // shard_size:05d}.npz"
  todo, skipped = [], 0
  expected: dict = {}
  for pos, ex, text in items:
    name = shard_of(pos)
    if name in manifest["shards"] and shards.shard_ok(out, manifest, name):
      continue
    ids = tokenizer.encode(tokenizer.apply_chat_template([text]))
    if len(ids) > max_prompt_tokens:
      skipped += 1
      expected.setdefault(name, 0)
      continue
    todo.append((pos, ex, ids))
    expected[name] = expected.get(name, 0) + 1
  log(f"distill: {len(items)} prompts, {len(todo)} to answer ({skipped} over {max_prompt_tokens} tokens skipped), "
      f"batch {batch}")
  pending: dict = {name: [] for name in expected}
  t0 = time.perf_counter()
  counts = {"answers": 0, "tokens": 0}

  def on_done(key, new, stopped):
    pos, ex, ids = key
    name = shard_of(pos)
    pending[name].append(dict(position=pos, example=ex, temperature=temperature_at(pos), finish=int(stopped),
                              prompt_len=len(ids), ids=list(ids) + list(new)))
    counts["answers"] += 1
    counts["tokens"] += len(new)
    if len(pending[name]) == expected[name]:
      entry = shards.write_shard(out, name, pending.pop(name))
      manifest["shards"][name] = entry
      shards.write_manifest(out, manifest)
      dt = time.perf_counter() - t0
      log(f"distill: wrote {name} ({entry['prompts']} prompts, {entry['answer_tokens']} answer tokens); "
          f"{counts['answers']}/{len(todo)} answered, {counts['tokens'] / dt:.1f} tok/s")

  jobs = ((job, job[2], temperature_at(job[0]), seed * 1_000_003 + job[0]) for job in todo)
  for name, n in list(expected.items()):  # shards whose every prompt was skipped
    if n == 0:
      manifest["shards"][name] = shards.write_shard(out, name, [])
      pending.pop(name)
  gen = Generator(params, config, tokenizer, batch=batch, max_new_tokens=max_new_tokens,
                  steps_per_sync=steps_per_sync,
                  capacity=_capacity(max_prompt_tokens, max_new_tokens))
  gen.run(jobs, on_done, log)
  dt = time.perf_counter() - t0
  run = dict(date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), batch=batch, answers=counts["answers"],
             answer_tokens=counts["tokens"], seconds=round(dt, 1),
             tokens_per_s=round(counts["tokens"] / dt, 1) if dt > 0 else None, skipped_long_prompts=skipped)
  if counts["answers"]:
    manifest["runs"].append(run)
  manifest["totals"] = dict(
      prompts=sum(e["prompts"] for e in manifest["shards"].values()),
      answer_tokens=sum(e["answer_tokens"] for e in manifest["shards"].values()),
      prompt_tokens=sum(e["prompt_tokens"] for e in manifest["shards"].values()))
  shards.write_manifest(out, manifest)
  log(f"distill: {counts['answers']} answers, {counts['tokens']} tokens in {dt:.0f} s; totals {manifest['totals']}")
  return manifest


def _capacity(max_prompt_tokens: int, max_new_tokens: int) -> int:
  return capacity_for(bucket(max_prompt_tokens)[0], max_prompt_tokens + max_new_tokens + 2)


def main(argv):
  del argv
  config, params, tokenizer = load_model(FLAGS.model or None, FLAGS.dtype)
  distill(params, config, tokenizer, out=FLAGS.out, batch=FLAGS.batch, max_new_tokens=FLAGS.max_new_tokens,
          max_prompt_tokens=FLAGS.max_prompt_tokens, shard_size=FLAGS.shard_size, seed=FLAGS.seed,
          limit=FLAGS.limit, steps_per_sync=FLAGS.steps_per_sync, model=FLAGS.model, dtype=FLAGS.dtype,
          log=lambda s: print(s, file=sys.stderr, flush=True))


if __name__ == "__main__":
  app.run(main)
