"""Per-step cost of the decode loop, for comparing two checkouts (the paged KV cache against the commit before it).

  python benchmarks/probes/paged_step.py --batch=8 --method=ngram [--kv_cache_dtype=int8] [--json_out=PATH]

Runs Gemma 3 270M's jitted loop (plain decoding, or n-gram at k 3) on fixed prompts of ~120 tokens for --new
tokens per row, --repeats times after a warm-up, and prints the median and range of decode time per loop step
(prefill excluded). Uses only APIs both checkouts have; run it from each checkout's root, alternating
(benchmarks/probes/paged_step.sh does A, B, A, B)."""

from __future__ import annotations

import argparse
import json
import time

import jax
import numpy as np

from spec_jax.batch import start
from spec_jax.checkpoints.load import load_model
from spec_jax.decode import decode_loop, make_spec
from spec_jax.proposers.base import NoneProposer
from spec_jax.proposers.ngram import NgramProposer


def main():
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--batch", type=int, default=1)
  ap.add_argument("--method", default="none", choices=("none", "ngram"))
  ap.add_argument("--new", type=int, default=48)
  ap.add_argument("--repeats", type=int, default=3)
  ap.add_argument("--kv_cache_dtype", default="", help="auto|fp8|fp8_e5m2|int8 (issue 46); '' = the make_spec default, "
                  "for checkouts without the flag")
  ap.add_argument("--json_out", default="")
  a = ap.parse_args()
  config, params, tok = load_model("", "bfloat16")  # the serving default on CPU (configs/gemma3_270m.py)
  rng = np.random.default_rng(0)
  text = ("The quick brown fox jumps over the lazy dog while the committee reviews the quarterly report and "
          "argues about the budget for next year. ")
  prompts = [tok.encode(text * 2)[:100 + 5 * i] + rng.integers(300, 5000, 8).tolist() for i in range(a.batch)]
  proposer = NoneProposer() if a.method == "none" else NgramProposer(k=3)
  spec = make_spec(config, proposer, adaptive_k=False, **({"kv_cache_dtype": a.kv_cache_dtype} if a.kv_cache_dtype else {}))
  both = {"target": params, "proposer": {}}
  per_step = []
  for r in range(a.repeats + 1):
    state = start(both, spec, prompts, max_new_tokens=a.new)
    jax.block_until_ready(state.tokens)
    t0 = time.perf_counter()
    state = decode_loop(both, state, spec)
    jax.block_until_ready(state.tokens)
    dt = time.perf_counter() - t0
    if r:  # the first run compiles
      per_step.append(dt / max(int(state.step), 1))
  ms = np.array(per_step) * 1e3
  out = {"batch": a.batch, "method": a.method, "kv_cache_dtype": a.kv_cache_dtype or "auto", "steps": int(state.step), "median_ms": float(np.median(ms)),
         "min_ms": float(ms.min()), "max_ms": float(ms.max())}
  print(json.dumps(out), flush=True)
  if a.json_out:
    with open(a.json_out, "a") as f:
      f.write(json.dumps(out) + "\n")


if __name__ == "__main__":
  main()
