"""One jitted forward of the target, by weights (int8 or the bfloat16 CPU layout), rows and tokens, with and
without the 262k-row head: where an int8 draft step's time goes (docs/benchmark-log.md section 19).

  python benchmarks/probes/forward_cost.py --repeats=7 --calls=5

Each case runs on a KV cache of --capacity slots, every row at position --position. The cases run round-robin
(A, B, C, ..., A, B, C, ...), `calls` calls each per repeat; the table gives the median per call and the range
over repeats.
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

from spec_jax.cache import KVCache
from spec_jax.checkpoints.load import load_params
from spec_jax.models.transformer import forward


def case(cfg, params, rows: int, tokens: int, logits: bool, capacity: int, position: int):
  cache = KVCache.init(cfg, rows, capacity, params["final_norm"].dtype)
  cache = cache.replace(lengths=jnp.full((rows,), position, jnp.int32))
  toks = jnp.ones((rows, tokens), jnp.int32)
  pos = position + jnp.tile(jnp.arange(tokens, dtype=jnp.int32)[None], (rows, 1))
  f = jax.jit(lambda p, t, q, c: forward(p, t, q, c, config=cfg, impl="xla", compute_logits=logits)[
      0 if logits else 1])
  f(params, toks, pos, cache).block_until_ready()  # compile
  return lambda: f(params, toks, pos, cache).block_until_ready()


def main():
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--model", default="", help="'' = Gemma 3 270M")
  ap.add_argument("--repeats", type=int, default=7)
  ap.add_argument("--calls", type=int, default=5)
  ap.add_argument("--capacity", type=int, default=1024)
  ap.add_argument("--position", type=int, default=300)
  args = ap.parse_args()
  cfg, int8 = load_params(args.model or None, "bfloat16", "int8")
  _, bf16 = load_params(args.model or None, "bfloat16")
  cases = {}
  for name, params in (("int8", int8), ("bf16 layout", bf16)):
    for rows, tokens in ((1, 1), (2, 1), (2, 2)):
      for logits in (True, False):
        label = f"{name}, {rows} x {tokens}, {'with the head' if logits else 'layer stack only'}"
        cases[label] = case(cfg, params, rows, tokens, logits, args.capacity, args.position)
  times = {k: [] for k in cases}
  for _ in range(args.repeats):
    for k, f in cases.items():
      t = time.perf_counter()
      for _ in range(args.calls):
        f()
      times[k].append((time.perf_counter() - t) / args.calls * 1e3)
  for k, v in times.items():
    print(f"{k:48s} {np.median(v):7.1f} ms  ({min(v):.1f}-{max(v):.1f})")


if __name__ == "__main__":
  main()
