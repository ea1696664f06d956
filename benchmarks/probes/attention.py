"""Time verify/decode attention: the XLA reference against the Pallas kernel for this backend.

  python benchmarks/probes/attention.py [--quick] [--json_out=PATH]

Grid: B in {1,8,32}, T in {1,5,9,17}, S in {512,4096,32768}; layouts gemma3_270m (Hq=4, Hkv=1, D=256) and
llama8b (Hq=32, Hkv=8, D=128); bfloat16, full rows (kv_lengths == S), no window. Attention here only
streams the cache, so the yardstick is memory bandwidth: the script first times a large array copy and
reports each kernel's bytes/s as a fraction of it.

On GPU the Pallas kernel is pallas_gpu, on TPU pallas_tpu. On CPU there is no Pallas backend: both kernels
run in interpret mode on a few small shapes (--quick), which checks them against XLA but times nothing
meaningful.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from spec_jax.kernels import attention  # noqa: E402

LAYOUTS = {"gemma3_270m": dict(Hq=4, Hkv=1, D=256), "llama8b": dict(Hq=32, Hkv=8, D=128)}
FULL_GRID = dict(B=(1, 8, 32), T=(1, 5, 9, 17), S=(512, 4096, 32768))
QUICK_GRID = [("gemma3_270m", 1, 1, 512), ("gemma3_270m", 8, 5, 512), ("llama8b", 1, 9, 512),
              ("llama8b", 2, 17, 4096)]
DTYPE = jnp.bfloat16


def parse_args(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--quick", action="store_true", help="a few small shapes")
  ap.add_argument("--json_out", default=None, help="write all results here as JSON")
  ap.add_argument("--runs", type=int, default=None, help="timed runs per shape (median is reported)")
  ap.add_argument("--time_budget_s", type=float, default=270.0,
                  help="skip the remaining shapes once this much time has passed")
  return ap.parse_args(argv)


def timed(fn, *args, warmup: int, runs: int):
  """Median seconds per call; every call is waited on, so each sample is one whole kernel."""
  for _ in range(warmup):
    jax.block_until_ready(fn(*args))
  samples = []
  for _ in range(runs):
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    samples.append(time.perf_counter() - t0)
  return statistics.median(samples)


def measure_bandwidth(nbytes: int, runs: int) -> float:
  """Bytes read + written per second by a bandwidth-bound elementwise copy of a large array."""
  n = nbytes // 2
  x = jnp.zeros((n,), jnp.bfloat16)
  # x + 1 rather than a bare copy, which XLA may turn into an alias.
  copy = jax.jit(lambda a: a + jnp.asarray(1, a.dtype))
  t = timed(copy, x, warmup=2, runs=runs)
  del x
  return 2 * n * 2 / t


def device_memory_bytes():
  try:
    stats = jax.devices()[0].memory_stats() or {}
  except Exception:  # some backends have no memory stats
    stats = {}
  return stats.get("bytes_limit")


def shape_bytes(B, T, S, Hq, Hkv, D):
  """What attention must move: all K/V slots of full rows, plus q in and out."""
  item = jnp.dtype(DTYPE).itemsize
  return 2 * B * S * Hkv * D * item + 2 * B * T * Hq * D * item


def fits(B, T, S, Hq, Hkv, D, limit):
  if limit is None:
    return True
  # The XLA reference holds [B, Hq, T, S] float32 scores a few times over next to the cache.
  need = shape_bytes(B, T, S, Hq, Hkv, D) + 4 * B * Hq * T * S * 4
  return need < 0.7 * limit


def make_inputs(key, B, T, S, Hq, Hkv, D):
  kq, kk, kv = jax.random.split(key, 3)
  q = jax.random.normal(kq, (B, T, Hq, D), DTYPE)
  k = jax.random.normal(kk, (B, S, Hkv, D), DTYPE)
  v = jax.random.normal(kv, (B, S, Hkv, D), DTYPE)
  lengths = jnp.full((B,), S, jnp.int32)
  positions = (lengths[:, None] - T + jnp.arange(T, dtype=jnp.int32)[None, :]).astype(jnp.int32)
  return q, k, v, positions, lengths


def fmt_table(header, rows):
  widths = [max(len(str(x)) for x in col) for col in zip(header, *rows)]
  line = lambda r: "  ".join(str(x).rjust(w) for x, w in zip(r, widths))
  return "\n".join([line(header), line(["-" * w for w in widths])] + [line(r) for r in rows])


def main(argv=None):
  args = parse_args(argv)
  backend = jax.default_backend()
  interpret = backend not in ("gpu", "tpu")
  pallas_impls = {"gpu": ["pallas_gpu"], "tpu": ["pallas_tpu"]}.get(backend, ["pallas_gpu", "pallas_tpu"])
  quick = args.quick
  if interpret and not quick:
    print("note: no GPU/TPU backend, so running --quick in interpret mode")
    quick = True
  runs = args.runs or (3 if interpret else 10)
  warmup = 1 if interpret else 3

  print(f"backend {backend}: {jax.devices()[0].device_kind}; pallas impls {pallas_impls}")
  if interpret:
    print("INTERPRET MODE: Pallas kernels run in the interpreter on CPU. This checks them against XLA; the "
          "times below say nothing about GPU/TPU speed.")
  limit = device_memory_bytes()
  copy_bytes = (64 << 20) if interpret else min(2 << 30, (limit or (16 << 30)) // 8)
  bandwidth = measure_bandwidth(copy_bytes, runs)
  print(f"measured copy bandwidth: {bandwidth / 1e9:.1f} GB/s (read + write of {copy_bytes / 2**20:.0f} MiB)")

  if quick:
    shapes = QUICK_GRID
  else:
    shapes = [(lay, B, T, S) for lay in LAYOUTS for B in FULL_GRID["B"] for S in FULL_GRID["S"]
              for T in FULL_GRID["T"]]

  started = time.perf_counter()
  results, skipped = [], []
  cache_key = cache = q17 = k = v = q = outs = None
  for lay, B, T, S in shapes:
    dims = LAYOUTS[lay]
    Hq, Hkv, D = dims["Hq"], dims["Hkv"], dims["D"]
    if time.perf_counter() - started > args.time_budget_s:
      skipped.append(((lay, B, T, S), "time budget"))
      continue
    if not fits(B, T, S, Hq, Hkv, D, limit):
      skipped.append(((lay, B, T, S), "memory"))
      continue
    # One cache per (layout, B, S), shared by all T, since filling 4 GB of random numbers is not free.
    if cache_key != (lay, B, S):
      # Drop every reference to the old cache first, or two of the largest would sit in memory at once.
      cache = q17 = k = v = q = outs = None
      cache_key = (lay, B, S)
      cache = make_inputs(jax.random.PRNGKey(B * 131 + S), B, 17, S, Hq, Hkv, D)
    q17, k, v, _, lengths = cache
    q = q17[:, :T]
    positions = (lengths[:, None] - T + jnp.arange(T, dtype=jnp.int32)[None, :]).astype(jnp.int32)
    scale = 1.0 / math.sqrt(D)
    nbytes = shape_bytes(B, T, S, Hq, Hkv, D)

    row = dict(layout=lay, B=B, T=T, S=S, bytes=nbytes)
    fns = {"xla": jax.jit(functools.partial(attention, scale=scale, impl="xla"))}
    for impl in pallas_impls:
      fns[impl] = jax.jit(functools.partial(attention, scale=scale, impl=impl, interpret=interpret))
    outs = {}
    for impl, fn in fns.items():
      t = timed(fn, q, k, v, positions, lengths, warmup=warmup, runs=runs)
      outs[impl] = np.asarray(fn(q, k, v, positions, lengths), np.float32)
      row[f"{impl}_s"] = t
      row[f"{impl}_bytes_per_s"] = nbytes / t
      row[f"{impl}_frac_bw"] = nbytes / t / bandwidth
    for impl in pallas_impls:
      row[f"{impl}_speedup"] = row["xla_s"] / row[f"{impl}_s"]
      row[f"{impl}_max_abs_err"] = float(np.max(np.abs(outs[impl] - outs["xla"])))
    results.append(row)
    parts = [f"{lay:12s} B={B:2d} T={T:2d} S={S:5d}", f"xla {row['xla_s'] * 1e3:8.3f} ms"]
    for impl in pallas_impls:
      parts.append(f"{impl} {row[f'{impl}_s'] * 1e3:8.3f} ms ({row[f'{impl}_bytes_per_s'] / 1e9:7.1f} GB/s, "
                   f"{100 * row[f'{impl}_frac_bw']:5.1f}% bw, x{row[f'{impl}_speedup']:.2f}, "
                   f"err {row[f'{impl}_max_abs_err']:.1e})")
    print(" | ".join(parts), flush=True)

  for shape, why in skipped:
    print(f"skipped {shape}: {why}")
  if args.json_out:
    with open(args.json_out, "w") as f:
      json.dump(dict(backend=backend, device=jax.devices()[0].device_kind, interpret=interpret,
                     copy_bandwidth_bytes_per_s=bandwidth, results=results,
                     skipped=[dict(shape=s, why=w) for s, w in skipped]), f, indent=1)
    print(f"wrote {args.json_out}")

  # Short summary: per layout and T, over all B and S run, the geometric-mean speedup and median bw share.
  header = ["layout", "T", "shapes"]
  for impl in pallas_impls:
    header += [f"{impl} speedup (geomean)", f"{impl} % of bw (median)", f"{impl} max err"]
  table = []
  for lay in LAYOUTS:
    for T in sorted({r["T"] for r in results}):
      rs = [r for r in results if r["layout"] == lay and r["T"] == T]
      if not rs:
        continue
      line = [lay, T, len(rs)]
      for impl in pallas_impls:
        gm = math.exp(statistics.mean(math.log(r[f"{impl}_speedup"]) for r in rs))
        line += [f"x{gm:.2f}", f"{100 * statistics.median(r[f'{impl}_frac_bw'] for r in rs):.1f}",
                 f"{max(r[f'{impl}_max_abs_err'] for r in rs):.1e}"]
      table.append(line)
  print()
  print("summary" + (" (interpret mode: correctness only, times are not meaningful)" if interpret else ""))
  print(fmt_table(header, table))
  return results


if __name__ == "__main__":
  main()
