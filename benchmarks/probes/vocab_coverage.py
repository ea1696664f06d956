"""How big the reduced draft vocabulary should be: coverage of the target's self-distilled answers by the N most
frequent ids, against what N head rows cost per drafted token.

  python benchmarks/probes/vocab_coverage.py                # the shards in data/distill/gemma3_270m
  python benchmarks/probes/vocab_coverage.py --sizes=8192,32768 --reps=20

Coverage: ids are ranked by frequency over the answers of every shard but the last; the curve is the share of
the last shard's answer tokens (all, and greedy answers only) inside the top N, so it is measured on answers the
ranking never saw. Cost: `vocab.project` of 2 rows (batch 1 on CPU) onto N float32 rows, timed round-robin over
the sizes, median and min..max, with a plain decode step of the bfloat16 layout beside it for scale.
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

flags.DEFINE_string("shards", "", "Shard directory ('' = data/distill/gemma3_270m).")
flags.DEFINE_list("sizes", ["4096", "8192", "16384", "24576", "32768", "49152", "65536"], "Draft vocab sizes.")
flags.DEFINE_integer("reps", 30, "Timed repeats per size (0 = no timing).")
FLAGS = flags.FLAGS


def coverage_curve(train_answers: np.ndarray, test_answers: np.ndarray, sizes, vocab_size: int) -> dict:
  """{N: share of test_answers inside the N most frequent ids of train_answers}."""
  counts = np.bincount(train_answers, minlength=vocab_size)
  order = np.argsort(-counts, kind="stable")
  rank = np.empty(vocab_size, np.int64)
  rank[order] = np.arange(vocab_size)
  r = rank[test_answers]
  return {int(n): float(np.mean(r < n)) for n in sizes}


def main(argv):
  del argv
  from train import distill, distill_shards
  out = FLAGS.shards or distill.DEFAULT_OUT
  recs = distill_shards.load_shards(out)
  size = distill_shards.read_manifest(out)["settings"]["shard_size"]
  last_shard = max(r["position"] // size for r in recs)
  ans = lambda rs: np.concatenate([r["ids"][r["prompt_len"]:] for r in rs]) if rs else np.zeros(0, np.int64)
  train = [r for r in recs if r["position"] // size < last_shard]
  test = [r for r in recs if r["position"] // size == last_shard]
  if not train:
    raise SystemExit("need at least two shards (one to rank ids, one to measure)")
  V = 262144
  sizes = [int(s) for s in FLAGS.sizes]
  tr, te = ans(train), ans(test)
  te_greedy = ans([r for r in test if r["temperature"] == 0.0])
  cov = coverage_curve(tr, te, sizes, V)
  cov_g = coverage_curve(tr, te_greedy, sizes, V)
  print(f"ranked on {len(tr)} answer tokens ({len(train)} answers), measured on {len(te)} ({len(test)} answers; "
        f"{len(te_greedy)} greedy); distinct ids in the ranking data: {len(np.unique(tr))}")
  times = {}
  if FLAGS.reps:
    from spec_jax.checkpoints.load import load_model
    from spec_jax.proposers import vocab
    config, params, _ = load_model(None, "bfloat16")
    h = jnp.asarray(np.random.default_rng(0).standard_normal((2, config.d_model)), jnp.float32)
    rows = {n: jnp.asarray(np.asarray(params["embed"][:n], np.float32)) for n in sizes}
    proj = jax.jit(vocab.project)
    for n in sizes:
      jax.block_until_ready(proj(h, rows[n]))
    samples = {n: [] for n in sizes}
    for _ in range(FLAGS.reps):
      for n in sizes:
        t0 = time.perf_counter()
        jax.block_until_ready(proj(h, rows[n]))
        samples[n].append(time.perf_counter() - t0)
    times = {n: (float(np.median(v)), min(v), max(v)) for n, v in samples.items()}
  print("| draft vocab N | coverage, all answers | coverage, greedy answers | head rows (float32) | project, 2 rows (ms) |")
  print("|---|---|---|---|---|")
  for n in sizes:
    t = times.get(n)
    cell = f"{t[0] * 1e3:.2f} ({t[1] * 1e3:.2f}..{t[2] * 1e3:.2f})" if t else "-"
    print(f"| {n} | {cov[n]:.4f} | {cov_g[n]:.4f} | {n * 640 * 4 / 1e6:.0f} MB | {cell} |")


if __name__ == "__main__":
  app.run(main)
