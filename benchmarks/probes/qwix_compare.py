"""spec_jax's quantized dot (spec_jax/quant.py qdot) against Qwix's weight-only einsum, on Gemma 3 270M shapes.

  python benchmarks/probes/qwix_compare.py [--repeats=5]

Qwix is optional (`pip install qwix`); without it the script says so and exits 0. Both quantize the same float
weights to int8 with one scale per output channel; activations stay float32. For each shape and batch: the
median time of a jitted call over interleaved repeats (float32, ours, Qwix, float32, ...), the compiled
temporaries (XLA memory analysis; a full float copy of the weight shows up here), and the largest difference
from the float32 result.
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

from spec_jax import quant

SHAPES = {"lm head 262144x640": (262144, 640), "mlp up 640->2048": (2048, 640), "mlp down 2048->640": (640, 2048)}


def timed(fn, *args, n=10):
  fn(*args).block_until_ready()
  t0 = time.perf_counter()
  for _ in range(n):
    fn(*args).block_until_ready()
  return (time.perf_counter() - t0) / n


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--repeats", type=int, default=5)
  ap.add_argument("--batches", default="1,8")
  args = ap.parse_args()
  try:
    import qwix
  except ImportError:
    print("qwix is not installed (pip install qwix); skipping the comparison")
    return
  rng = np.random.default_rng(0)
  print(f"{'shape':22} {'batch':>5} {'f32 ms':>8} {'ours ms':>8} {'qwix ms':>8} {'ours temp MB':>12} "
        f"{'qwix temp MB':>12} {'ours err':>9} {'qwix err':>9}")
  for name, (n, k) in SHAPES.items():
    w = rng.standard_normal((n, k)).astype(np.float32) / np.sqrt(k)  # [out, in], output-major like the head
    wf = jnp.asarray(w)
    ours_w = quant.quantize(w, 1, 8, contract_last=True)
    qwix_w = qwix.quantize(wf, jnp.int8, channelwise_axes=(0,))
    f32 = jax.jit(lambda x, w: jnp.einsum("mk,nk->mn", x, w, preferred_element_type=jnp.float32))
    ours = jax.jit(quant.qdot)
    theirs = jax.jit(lambda x, w: qwix.einsum("mk,nk->mn", x, w, preferred_element_type=jnp.float32))
    for b in map(int, args.batches.split(",")):
      x = jnp.asarray(rng.standard_normal((b, k)).astype(np.float32))
      ref = np.asarray(f32(x, wf))
      err = lambda y: float(np.abs(np.asarray(y) - ref).max() / np.abs(ref).max())
      temp = lambda f, w: f.lower(x, w).compile().memory_analysis().temp_size_in_bytes / 1e6
      t = {"f32": [], "ours": [], "qwix": []}
      for _ in range(args.repeats):
        t["f32"].append(timed(f32, x, wf))
        t["ours"].append(timed(ours, x, ours_w))
        t["qwix"].append(timed(theirs, x, qwix_w))
      med = {a: 1e3 * float(np.median(v)) for a, v in t.items()}
      print(f"{name:22} {b:>5} {med['f32']:>8.2f} {med['ours']:>8.2f} {med['qwix']:>8.2f} "
            f"{temp(ours, ours_w):>12.1f} {temp(theirs, qwix_w):>12.1f} {err(ours(x, ours_w)):>9.4f} "
            f"{err(theirs(x, qwix_w)):>9.4f}", flush=True)


if __name__ == "__main__":
  main()
