"""The GPU device check, ready for the day a GPU is at hand: one script, one GPU, under 8 minutes.

  python benchmarks/device_check.py --output=/tmp/device_check          # on a GPU host
  python benchmarks/device_check.py --dry_run --output=/tmp/dry         # anywhere: lowers the same programs for CUDA

What it measures (everything into device_check.json and device_check.md, a table BENCHMARKS.md can take):
1. The Pallas GPU attention kernel against the XLA reference at the AOT shapes (Gemma 3 270M decode and verify,
   Llama-8B verify at 16 x 4096, a 16-node tree, Qwen2.5-1.5B verify): max abs error, both times.
2. The kernel's bandwidth: K and V bytes read over its time, as a fraction of the device's HBM bandwidth (the
   published peak, and a measured device copy).
3. A plain decode step of a random-weight Llama-8B-shaped bfloat16 model against its bandwidth floor (weights plus
   the cache read once per step, over the measured copy bandwidth).
4. The verify-cost table: the target's forward over T = k + 1 tokens (and 16- and 32-node trees) over its forward
   of one token, at batch 1, 4, 16 and 64, for Llama-8B: the measured twin of serve.aot's compiler estimate.

It needs only spec_jax's core (jax, flax, numpy): the GPU machine has JAX, flax, optax, orbax, safetensors and
sentencepiece, and nothing else is imported. --dry_run builds and lowers every program for CUDA (jax.export, the
Triton kernels included) without running any, so the script is tested on CPU (tests/aot/test_device_check.py).
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from absl import app, flags  # noqa: E402

from spec_jax import flag_table  # noqa: E402

flag_table.define(("output", "dry_run", "smoke", "hbm_bytes_per_s", "runs"), output="device_check")
FLAGS = flags.FLAGS

# (name, B, T, Hq, Hkv, D, S, tree)
KERNEL_SHAPES = [("gemma3-270m decode", 16, 1, 4, 1, 256, 4096, False),
                 ("gemma3-270m verify k=4", 16, 5, 4, 1, 256, 4096, False),
                 ("llama3-8b verify k=4", 16, 5, 32, 8, 128, 4096, False),
                 ("llama3-8b tree 16 nodes", 16, 16, 32, 8, 128, 4096, True),
                 ("qwen2.5-1.5b verify k=4", 16, 5, 12, 2, 128, 4096, False)]
VERIFY_BATCHES = (1, 4, 16, 64)
VERIFY_TOKENS = (1, 2, 3, 5, 9)  # k = 0, 1, 2, 4, 8
VERIFY_TREES = (16, 32)
CONTEXT = 2048
DTYPE = jnp.bfloat16


def smoke_sizes():
  """--smoke: the same measurements, shrunk for the CPU interpreter (in float32: its bfloat16 dots with float32
  results do not run on XLA:CPU)."""
  global KERNEL_SHAPES, VERIFY_BATCHES, VERIFY_TOKENS, VERIFY_TREES, CONTEXT, DTYPE
  DTYPE = jnp.float32
  KERNEL_SHAPES = [(n, 2, T, Hq, Hkv, D, 64, tree) for n, _, T, Hq, Hkv, D, _, tree in KERNEL_SHAPES]
  VERIFY_BATCHES, VERIFY_TOKENS, VERIFY_TREES, CONTEXT = (1, 2), (1, 3), (4,), 32


def impl() -> str:
  return "pallas_gpu:interpret" if FLAGS.smoke else "pallas_gpu"


def timed(fn, *args, runs: int) -> float:
  """Median seconds per call, every call waited for."""
  jax.block_until_ready(fn(*args))
  samples = []
  for _ in range(runs):
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    samples.append(time.perf_counter() - t0)
  return statistics.median(samples)


def _lower(fn, *args) -> dict:
  """--dry_run: export for CUDA (the Triton kernels lowered) and count the Triton calls."""
  from jax import export
  from spec_jax.kernels.common import lowering_for
  triton = "__gpu$xla.gpu.triton"
  abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype), args)
  with lowering_for("gpu"):
    exp = export.export(fn, platforms=["cuda"], disabled_checks=[export.DisabledSafetyCheck.custom_call(triton)])(
        *abstract)
  return {"lowered": True, "triton_calls": exp.mlir_module().count(triton)}


def random_tree(rng, T):
  """A random tree's ancestor-or-self mask and depths (spec_jax.tree's, as the decode loop builds them)."""
  from spec_jax import tree
  parents = jnp.asarray([[-1] + [int(rng.integers(0, t)) for t in range(1, T)]], jnp.int32)
  mask = tree.ancestor_mask(parents)
  return np.asarray(mask[0]), np.asarray(tree.mask_depths(mask)[0])


def kernel_checks(dry: bool, runs: int, copy_bw: float) -> list:
  from spec_jax.kernels import attention_xla
  from spec_jax.kernels.pallas_gpu import attention_pallas_gpu
  out = []
  for name, B, T, Hq, Hkv, D, S, tree in KERNEL_SHAPES:
    rng = np.random.default_rng(0)
    mk = lambda *shape: jnp.asarray(rng.standard_normal(shape, np.float32) * 0.5, DTYPE)
    lengths = np.full(B, S - T, np.int32)
    mask, depth = random_tree(rng, T) if tree else (None, np.arange(T, dtype=np.int32))
    args = (mk(B, T, Hq, D), mk(B, T, Hkv, D), mk(B, T, Hkv, D), mk(1, B, Hkv, S, D), mk(1, B, Hkv, S, D),
            jnp.asarray(lengths[:, None] + depth[None, :], jnp.int32), jnp.asarray(lengths))
    tm = None if mask is None else jnp.asarray(mask)
    kern = jax.jit(lambda *a: attention_pallas_gpu(*a, scale=D ** -0.5, tree_mask=tm, layer=0,
                                                   interpret=FLAGS.smoke))
    ref = jax.jit(lambda *a: attention_xla(*a, scale=D ** -0.5, tree_mask=tm, layer=0))
    rec = {"name": name, "B": B, "T": T, "Hq": Hq, "Hkv": Hkv, "D": D, "S": S}
    if dry:
      rec.update(_lower(kern, *args))
      out.append(rec)
      continue
    err = float(jnp.max(jnp.abs(kern(*args).astype(jnp.float32) - ref(*args).astype(jnp.float32))))
    t_kern, t_ref = timed(kern, *args, runs=runs), timed(ref, *args, runs=runs)
    kv_bytes = 2 * B * Hkv * S * D * jnp.dtype(DTYPE).itemsize
    rec.update(max_abs_error=err, kernel_us=t_kern * 1e6, xla_us=t_ref * 1e6, kv_bytes=kv_bytes,
               kernel_bytes_per_s=kv_bytes / t_kern, fraction_of_peak=kv_bytes / t_kern / FLAGS.hbm_bytes_per_s,
               fraction_of_copy=kv_bytes / t_kern / copy_bw)
    out.append(rec)
  return out


def copy_bandwidth(dry: bool, runs: int) -> float:
  """Bytes read + written per second by a device copy of 2 GiB (x + 1: a bare copy may become an alias)."""
  if dry:
    return FLAGS.hbm_bytes_per_s
  x = jnp.zeros((1 << (20 if FLAGS.smoke else 30),), DTYPE)
  t = timed(jax.jit(lambda a: a + jnp.asarray(1, a.dtype)), x, runs=runs)
  return 2 * x.nbytes / t


def llama8b():
  from spec_jax.models.shapes import model_shape
  config = model_shape("llama3-8b")
  if FLAGS.smoke:  # Llama-8B's layout, tiny
    config = config.replace(vocab_size=512, d_model=64, num_layers=2, num_heads=8, num_kv_heads=2, head_dim=16,
                            mlp_dim=128)
  return config


def random_params(config, dry: bool):
  from spec_jax.models.transformer import init_params, param_shapes
  if dry:
    return jax.tree.map(lambda s: jax.ShapeDtypeStruct(s, DTYPE), param_shapes(config),
                        is_leaf=lambda x: isinstance(x, tuple))
  return jax.jit(lambda k: init_params(config, k, DTYPE))(jax.random.PRNGKey(0))


def _forward_program(config, batch: int, T: int, tree_nodes: int = 0):
  """The target's forward over T new tokens (a chain, or a token tree of tree_nodes) on a cache at CONTEXT."""
  from spec_jax.cache import KVCache
  from spec_jax.models.transformer import forward
  rng = np.random.default_rng(1)
  if tree_nodes:
    mask, depth = random_tree(rng, tree_nodes)
    T = tree_nodes
  else:
    mask, depth = None, np.arange(T, dtype=np.int32)
  tm = None if mask is None else jnp.asarray(mask)

  def fwd(params, tokens, cache):
    positions = cache.lengths[:, None] + jnp.asarray(depth)[None, :]
    logits, _, cache = forward(params, tokens, positions, cache, config=config, impl=impl(), tree_mask=tm)
    return logits, cache
  cache = jax.eval_shape(lambda: KVCache.init(config, batch, CONTEXT + 64, DTYPE))
  return jax.jit(fwd, donate_argnums=(2,)), jax.ShapeDtypeStruct((batch, T), jnp.int32), cache


def time_forward(fn, params, toks, config, batch: int, runs: int) -> float:
  """Median seconds of one forward on a cache filled to CONTEXT. The cache is donated, so each call runs on the
  one the last returned (forward does not advance the lengths: every call reads the same context)."""
  from spec_jax.cache import KVCache
  cache = KVCache.init(config, batch, CONTEXT + 64, DTYPE)
  held = {"cache": cache.replace(lengths=jnp.full((batch,), CONTEXT, jnp.int32))}

  def step(p, tokens):
    logits, held["cache"] = fn(p, tokens, held["cache"])
    return logits
  return timed(step, params, jnp.zeros(toks.shape, jnp.int32), runs=runs)


def verify_costs(dry: bool, runs: int, params) -> dict:
  config = llama8b()
  table = {}
  for b in VERIFY_BATCHES:
    row = {}
    for label, T, nodes in [(f"T={t}", t, 0) for t in VERIFY_TOKENS] + [(f"tree{n}", 0, n) for n in VERIFY_TREES]:
      fn, toks, cache = _forward_program(config, b, T, nodes)
      if dry:
        row[label] = _lower(fn, params, toks, cache)
        continue
      row[label] = {"seconds": time_forward(fn, params, toks, config, b, runs)}
    if not dry:
      base = row["T=1"]["seconds"]
      for v in row.values():
        v["over_plain"] = v["seconds"] / base
    table[str(b)] = row
  return table


def decode_floor(dry: bool, runs: int, params, copy_bw: float) -> dict:
  """Plain decoding of one row at a 1,024-token context, per step, against (weights + cache read) / bandwidth."""
  config = llama8b()
  fn, toks, cache = _forward_program(config, 1, 1)
  if dry:
    return _lower(fn, params, toks, cache)
  param_bytes = sum(x.nbytes for x in jax.tree.leaves(params))
  kv_bytes = 2 * config.num_layers * config.num_kv_heads * CONTEXT * config.head_dim * jnp.dtype(DTYPE).itemsize
  seconds = time_forward(fn, params, toks, config, 1, runs)
  floor = (param_bytes + kv_bytes) / copy_bw
  return {"step_ms": seconds * 1e3, "floor_ms": floor * 1e3, "over_floor": seconds / floor,
          "param_bytes": param_bytes, "kv_bytes": kv_bytes}


def report_md(res: dict) -> str:
  lines = [f"# Device check: {res['device']} ({res['date']}{', dry run' if res['dry_run'] else ''})", ""]
  if res["dry_run"]:
    lines += ["Lowered for CUDA, not run: every program below holds the Triton kernel it names.", "",
              "| program | Triton calls |", "|---|---|"]
    lines += [f"| kernel: {k['name']} | {k['triton_calls']} |" for k in res["kernels"]]
    lines += [f"| decode step, llama3-8b B=1 | {res['decode']['triton_calls']} |"]
    for b, row in res["verify"].items():
      lines += [f"| forward {label}, llama3-8b B={b} | {v['triton_calls']} |" for label, v in row.items()]
    return "\n".join(lines) + "\n"
  lines += [f"Copy bandwidth {res['copy_bytes_per_s'] / 1e12:.2f} TB/s (published peak "
            f"{res['hbm_bytes_per_s'] / 1e12:.2f} TB/s).", "",
            "| kernel shape | max abs error | kernel us | XLA us | kernel TB/s | of peak | of copy |",
            "|---|---|---|---|---|---|---|"]
  for k in res["kernels"]:
    lines.append(f"| {k['name']} | {k['max_abs_error']:.2e} | {k['kernel_us']:.1f} | {k['xla_us']:.1f} | "
                 f"{k['kernel_bytes_per_s'] / 1e12:.2f} | {k['fraction_of_peak']:.2f} | {k['fraction_of_copy']:.2f} |")
  d = res["decode"]
  lines += ["", f"Plain decode step, random-weight llama3-8b bf16, batch 1, context {CONTEXT}: {d['step_ms']:.3f} ms "
            f"against a {d['floor_ms']:.3f} ms floor ({d['over_floor']:.2f}x).", "",
            "Verify cost over a plain step (the target's forward over T tokens / over 1 token), llama3-8b:", "",
            "| batch | " + " | ".join(next(iter(res["verify"].values())).keys()) + " |",
            "|---|" + "---|" * len(next(iter(res["verify"].values())))]
  for b, row in res["verify"].items():
    lines.append(f"| {b} | " + " | ".join(f"{v['over_plain']:.2f}" for v in row.values()) + " |")
  return "\n".join(lines) + "\n"


def main(argv):
  del argv
  dry = FLAGS.dry_run
  if FLAGS.smoke:
    smoke_sizes()
  elif not dry and jax.default_backend() != "gpu":
    raise SystemExit(f"no GPU here (jax.default_backend() is {jax.default_backend()!r}); use --dry_run or --smoke")
  t0 = time.perf_counter()
  copy_bw = copy_bandwidth(dry, FLAGS.runs)
  res = {"device": "dry run (no device)" if dry else jax.devices()[0].device_kind + (" smoke" if FLAGS.smoke else ""),
         "dry_run": dry,
         "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "jax": jax.__version__,
         "hbm_bytes_per_s": FLAGS.hbm_bytes_per_s, "copy_bytes_per_s": copy_bw}
  res["kernels"] = kernel_checks(dry, FLAGS.runs, copy_bw)
  params = random_params(llama8b(), dry)
  res["decode"] = decode_floor(dry, FLAGS.runs, params, copy_bw)
  res["verify"] = verify_costs(dry, FLAGS.runs, params)
  res["seconds"] = round(time.perf_counter() - t0, 1)
  os.makedirs(FLAGS.output, exist_ok=True)
  with open(os.path.join(FLAGS.output, "device_check.json"), "w", encoding="utf-8") as f:
    json.dump(res, f, indent=1)
  with open(os.path.join(FLAGS.output, "device_check.md"), "w", encoding="utf-8") as f:
    f.write(report_md(res))
  print(report_md(res))


if __name__ == "__main__":
  app.run(main)
