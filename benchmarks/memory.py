"""Weight and KV-cache footprints of a target and its draft, computed from the loaded params, and the process's
resident memory once both are loaded.

  python benchmarks/memory.py --model=qwen2.5-coder-1.5b-instruct --speculative_model=qwen2.5-coder-0.5b-instruct \\
      --dtype=float32 [--json_out=PATH]

"bytes" is what the params take in this process (on CPU the bfloat16 layout keeps the layer stack in float32);
"all-bf16 bytes" is what a GPU/TPU holds with every weight in bfloat16. KV bytes per token are per sequence:
2 (K and V) x layers x KV heads x head_dim x the cache's element size (the layers' dtype).
"""

from __future__ import annotations

import json
import logging

import jax
import psutil
from absl import app, flags

from spec_jax import flag_table

from spec_jax.checkpoints.load import load_params

# absl's INFO would print jax's backend probing ("Unable to initialize backend 'tpu'") at every start.
logging.getLogger("jax._src.xla_bridge").setLevel(logging.WARNING)

flag_table.define(("model", "speculative_model", "dtype", "json_out"), model="", speculative_model="",
                  dtype="float32")
FLAGS = flags.FLAGS


def footprint(config, params) -> dict:
  leaves = jax.tree.leaves(params)
  n = sum(x.size for x in leaves)
  kv_item = params["final_norm"].dtype.itemsize
  return {"name": config.name, "params": int(n), "bytes": int(sum(x.size * x.dtype.itemsize for x in leaves)),
          "all_bf16_bytes": int(2 * n), "float32_bytes": int(4 * n),
          "kv_bytes_per_token": 2 * config.num_layers * config.num_kv_heads * config.head_dim * kv_item}


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  out = {"dtype": FLAGS.dtype, "models": []}
  keep = []
  for path in filter(None, [FLAGS.model or None, FLAGS.speculative_model]):
    config, params = load_params(path, FLAGS.dtype)
    keep.append(params)
    out["models"].append(footprint(config, params))
  out["rss_bytes_with_all_loaded"] = psutil.Process().memory_info().rss
  print(json.dumps(out, indent=1))
  if FLAGS.json_out:
    with open(FLAGS.json_out, "w") as f:
      json.dump(out, f, indent=1)


if __name__ == "__main__":
  app.run(main)
