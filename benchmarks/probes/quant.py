"""Quantized Gemma 3 270M: decode speed against the bandwidth floor, memory, and quality against float32.

  python benchmarks/probes/quant.py [--batches=1,8] [--repeats=3] [--quality_prompts=16] [--json_out=PATH]

Speed: plain greedy decoding (the jitted while loop, prefill excluded) in four weight layouts: float32, the
bfloat16 CPU layout (bf16 embedding/head, f32 layers; checkpoints/load.py), int8 and int4 (spec_jax/quant.py).
All four run in this process, interleaved (f32, bf16, int8, int4, f32, ...), for every repeat; the table gives
the median and the spread over repeats, and each mode's ratio to the bf16 layout per repeat pair. The floor is
the weight bytes read per step over the measured read bandwidth.

Memory: resident bytes of each mode's params, and the KV cache bytes per token (float32 cache).

Quality against float32, on the training pipeline's held-out prompts and on Spec-Bench (the first prompts of
each category): float32 decodes 64 greedy tokens; both models then score prompt + that continuation, and each
continuation position gives KL(p_f32 || p_q) and whether the two top-1 tokens agree. Greedy agreement: each
quantized model decodes its own 64 greedy tokens; the table gives the fraction of positions equal to float32's
and how many prompts match in all 64.
"""

from __future__ import annotations

import argparse
import collections
import json
import time

import jax
import jax.numpy as jnp
import numpy as np

from serve.jobs.prompts import load_prompts
from serve.jobs.runner import timed_generate
from spec_jax import quant
from spec_jax.checkpoints.load import load_model, load_params
from spec_jax.config import SamplingParams
from spec_jax.batch import generate
from spec_jax.models.transformer import forward
from spec_jax.proposers.base import NoneProposer

from spec_jax.datasets import SPEC_BENCH as SPECBENCH  # noqa: E402
MODES = (("float32", "float32", "none"), ("bf16 layout", "bfloat16", "none"), ("int8", "float32", "int8"),
         ("int4", "float32", "int4"))


def read_bandwidth_gbs() -> float:
  x = jnp.ones((256 * 1024 * 1024 // 4,), jnp.float32)
  f = jax.jit(jnp.sum)
  f(x).block_until_ready()
  best = 1e9
  for _ in range(5):
    t0 = time.perf_counter()
    f(x).block_until_ready()
    best = min(best, time.perf_counter() - t0)
  return x.nbytes / best / 1e9


def speed(models, config, batches, repeats, new_tokens, bw):
  prompt = [2] + list(range(1000, 1100))  # 101 tokens
  cfg = config.replace(eos_ids=())  # fixed-length runs
  rows = []
  for b in batches:
    times = collections.defaultdict(list)

    def run(name):
      res = timed_generate(models[name], cfg, [prompt] * b, max_new_tokens=new_tokens,
                           sampling=SamplingParams.make(b), proposer=NoneProposer(), proposer_params={},
                           adaptive_k=False, costs=None, seed=0, impl="xla", warm=False)
      return b * max(res.option_uses[0], 1) / res.decode_s

    for name in models:  # compile
      timed_generate(models[name], cfg, [prompt] * b, max_new_tokens=2, sampling=SamplingParams.make(b),
                     proposer=NoneProposer(), proposer_params={}, adaptive_k=False, costs=None, seed=0, impl="xla")
    for _ in range(repeats):
      for name in models:
        times[name].append(run(name))
    for name in models:
      v = np.array(times[name])
      wbytes = quant.param_bytes(models[name])
      floor_tok_s = b * bw * 1e9 / wbytes
      vs_bf16 = v / np.array(times["bf16 layout"])
      rows.append({"mode": name, "batch": b, "tok_s": float(np.median(v)), "tok_s_min": float(v.min()),
                   "tok_s_max": float(v.max()), "vs_bf16_layout": float(np.median(vs_bf16)),
                   "vs_bf16_min": float(vs_bf16.min()), "vs_bf16_max": float(vs_bf16.max()),
                   "weight_mb": wbytes / 1e6, "floor_tok_s": floor_tok_s, "of_floor": float(np.median(v)) / floor_tok_s})
      r = rows[-1]
      print(f"  batch {b} {name:12} {r['tok_s']:6.1f} tok/s ({r['tok_s_min']:.1f}-{r['tok_s_max']:.1f}), "
            f"x{r['vs_bf16_layout']:.2f} bf16 layout ({r['vs_bf16_min']:.2f}-{r['vs_bf16_max']:.2f}), "
            f"{r['weight_mb']:.0f} MB, floor {floor_tok_s:.1f} tok/s", flush=True)
  return rows


def quality(models, config, prompt_sets, new_tokens):
  """KL / top-1 on float32's continuation, and greedy agreement of each quantized model's own decode."""
  cfg = config.replace(eos_ids=())
  score = jax.jit(lambda p, t: jax.nn.log_softmax(forward(p, t, config=cfg)[0], -1))
  out = {}
  for set_name, ids in prompt_sets.items():
    ref = [generate(models["float32"], cfg, [p], max_new_tokens=new_tokens).token_ids[0] for p in ids]
    for name in ("int8", "int4"):
      kls, agree, same_pos, exact = [], [], [], 0
      for p, cont in zip(ids, ref):
        seq = p + cont
        toks = jnp.asarray([seq + [0] * (-len(seq) % 128)], jnp.int32)  # causal: the tail pad changes nothing
        a, q = np.asarray(score(models["float32"], toks))[0], np.asarray(score(models[name], toks))[0]
        sl = slice(len(p) - 1, len(p) - 1 + len(cont))  # positions that predict the continuation
        kls.append((np.exp(a[sl]) * (a[sl] - q[sl])).sum(-1))
        agree.append(a[sl].argmax(-1) == q[sl].argmax(-1))
        own = generate(models[name], cfg, [p], max_new_tokens=new_tokens).token_ids[0]
        same_pos.append(np.mean([x == y for x, y in zip(own, cont)]))
        exact += own == cont
      kl = np.concatenate(kls)
      r = {"prompts": len(ids), "kl_mean": float(kl.mean()), "kl_p99": float(np.percentile(kl, 99)),
           "top1_agreement": float(np.concatenate(agree).mean()), "greedy_position_agreement": float(np.mean(same_pos)),
           "greedy_identical_prompts": int(exact)}
      out[f"{set_name}/{name}"] = r
      print(f"  {set_name:10} {name}: KL mean {r['kl_mean']:.4f} p99 {r['kl_p99']:.4f}, top-1 {r['top1_agreement']:.3f}, "
            f"greedy positions {r['greedy_position_agreement']:.3f}, identical {exact}/{len(ids)}", flush=True)
  return out


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--batches", default="1,8")
  ap.add_argument("--repeats", type=int, default=3)
  ap.add_argument("--new_tokens", type=int, default=64)
  ap.add_argument("--quality_prompts", type=int, default=16, help="per set (0: skip the quality part)")
  ap.add_argument("--speed", type=int, default=1)
  ap.add_argument("--json_out", default=None)
  args = ap.parse_args()
  t0 = time.time()
  models, config = {}, None
  for name, dtype, mode in MODES:
    config, models[name] = load_params(None, dtype, mode)
  kv_bytes = 2 * config.num_layers * config.num_kv_heads * config.head_dim * 4
  memory = {name: quant.param_bytes(p) for name, p in models.items()}
  print("resident params:", ", ".join(f"{n} {b / 1e6:.0f} MB" for n, b in memory.items()),
        f"; KV cache {kv_bytes} bytes/token (float32)")
  results = {"memory_bytes": memory, "kv_bytes_per_token": kv_bytes, "settings": vars(args),
             "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
  if args.speed:
    bw = read_bandwidth_gbs()
    print(f"read bandwidth {bw:.1f} GB/s")
    results["bandwidth_gbs"] = bw
    results["speed"] = speed(models, config, [int(b) for b in args.batches.split(",")], args.repeats,
                             args.new_tokens, bw)
  if args.quality_prompts:
    from train.eval_acceptance import held_out_prompts
    _, _, tok = load_model(None, "float32")
    held = [tok.encode(t) for t in held_out_prompts(args.quality_prompts, 0)]
    seen, bench = collections.Counter(), []
    per_cat = max(1, args.quality_prompts // 13)
    for p in load_prompts(SPECBENCH, tok):
      if seen[p.category] < per_cat and len(bench) < args.quality_prompts:
        seen[p.category] += 1
        bench.append(tok.encode(p.text))
    results["quality"] = quality(models, config, {"held-out": held, "spec-bench": bench}, args.new_tokens)
  results["wall_s"] = time.time() - t0
  if args.json_out:
    with open(args.json_out, "w") as f:
      json.dump(results, f, indent=1)


if __name__ == "__main__":
  main()
