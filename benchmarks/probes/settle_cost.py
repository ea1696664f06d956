"""What `sharding.settled` costs a one-device caller: decode_loop calls of one step, wrapped against the raw jit.

  python benchmarks/probes/settle_cost.py          # a tiny random model (the per-call overhead at its largest)
  python benchmarks/probes/settle_cost.py --calls=500 --reps=7

On one device `settle` only looks at the first output leaf's devices and returns, so the two arms should differ by
a few microseconds a call. Each rep runs `--calls` chained one-step calls per arm, the arms interleaved (A, B, A,
B); the median per-call time and the min..max spread over reps are printed.
"""

from __future__ import annotations

import time

import jax
import numpy as np
from absl import app, flags

from spec_jax.config import ModelConfig
from spec_jax.decode import decode_loop, make_spec
from spec_jax.batch import start
from spec_jax.models.transformer import init_params

FLAGS = flags.DEFINE_integer("calls", 1000, "one-step decode_loop calls per arm and rep")
REPS = flags.DEFINE_integer("reps", 5, "interleaved repeats")

TINY = ModelConfig(vocab_size=97, d_model=32, num_layers=2, num_heads=4, num_kv_heads=1, head_dim=16, mlp_dim=64,
                   sliding_window=8, global_every=2, query_pre_attn_scalar=16.0, max_seq_len=4096, bos_id=2,
                   eos_ids=(1,), pad_id=0, name="tiny-gemma")


def main(_):
  params = {"target": init_params(TINY, jax.random.PRNGKey(0)), "proposer": {}}
  spec = make_spec(TINY, adaptive_k=False)
  arms = {"settled": decode_loop, "raw jit": decode_loop._program}
  fresh = lambda: start(params, spec, [[2, 5, 6, 7]], max_new_tokens=3000)  # never done within one rep
  for fn in arms.values():  # compile both
    jax.block_until_ready(fn(params, fresh(), spec, np.int32(1)))
  times = {name: [] for name in arms}
  for _ in range(REPS.value):
    for name, fn in arms.items():
      state = jax.block_until_ready(fresh())
      t = time.perf_counter()
      for _ in range(FLAGS.value):
        state = fn(params, state, spec, np.int32(1))
      jax.block_until_ready(state)
      times[name].append((time.perf_counter() - t) / FLAGS.value * 1e6)
  med = {name: float(np.median(ts)) for name, ts in times.items()}
  for name, ts in times.items():
    print(f"{name:8s} {med[name]:8.1f} us/call  (spread {min(ts):.1f}..{max(ts):.1f} over {len(ts)} reps)")
  print(f"settled - raw: {med['settled'] - med['raw jit']:+.1f} us/call "
        f"({(med['settled'] / med['raw jit'] - 1) * 100:+.2f} %)")


if __name__ == "__main__":
  app.run(main)
