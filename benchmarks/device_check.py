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
4. The verify-cost table: the target's forward over T = k + 1 tokens (and a 16-node tree) over its forward of one
   token, at batch 1, 16 and 64, for Llama-8B.
5. The cost table's own programs: one decode-loop step (aot_programs.step_program, what `serve.aot --cost_table`
   compiles, with its XLA:GPU options) for plain decoding, n-gram k = 4, EAGLE-3 k = 4 and the 16-node EAGLE tree,
   Llama-8B shape, random weights, batch 1 and 16, a 2,048-token context: measured ms a step and ratios over plain
   beside the compiler's (the committed H200 table, COMPILER_TABLE): the first lent GPU validates that table.

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
VERIFY_BATCHES = (1, 16, 64)
VERIFY_TOKENS = (1, 2, 5, 9)  # k = 0, 1, 4, 8
VERIFY_TREES = (16,)
CONTEXT = 2048
DTYPE = jnp.bfloat16
# The cost table's programs: (label, method, k, topk, nodes, the table's column); aot_costs builds the same ones
# (plain: n-gram at k = 0; the tree: EAGLE's, depth 4, top-k 4).
STEP_PROGRAMS = (("plain", "ngram", 0, 1, 0, "0"), ("n-gram k=4", "ngram", 4, 1, 0, "4"),
                 ("EAGLE-3 k=4", "eagle3", 4, 1, 0, "eagle3_k4"), ("EAGLE tree 16", "eagle", 4, 4, 16, "eagle_tree16"))
STEP_BATCHES = (1, 16)
STEPS = 8  # loop steps per timed call
COMPILER_TABLE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "reports", "cost_breakdown",
                              "llama3_8b_h200_matrix.json")


def smoke_sizes():
  """--smoke: the same measurements, shrunk for the CPU interpreter (in float32: its bfloat16 dots with float32
  results do not run on XLA:CPU)."""
  global KERNEL_SHAPES, VERIFY_BATCHES, VERIFY_TOKENS, VERIFY_TREES, CONTEXT, DTYPE
  DTYPE = jnp.float32
  KERNEL_SHAPES = [(n, 2, T, Hq, Hkv, D, 64, tree) for n, _, T, Hq, Hkv, D, _, tree in KERNEL_SHAPES]
  global STEP_BATCHES, STEPS
  VERIFY_BATCHES, VERIFY_TOKENS, VERIFY_TREES, CONTEXT = (1, 2), (1, 3), (4,), 32
  STEP_BATCHES, STEPS = (1, 2), 2


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


def program_ratios(measured: dict, compiler: dict) -> list:
  """Rows of the step-program table. measured: {batch: {column: seconds a step}} (empty on a dry run); compiler:
  the cost table's {batch: {column: seconds}}. Each ratio is over plain (column "0") of the same batch and source;
  `agreement` is measured over compiler. None where a side lacks the program or its plain step."""
  rows = []
  for b in STEP_BATCHES:
    got, est = measured.get(str(b), {}), compiler.get(str(b), {})
    for label, _, _, _, _, col in STEP_PROGRAMS:
      m = got[col] / got["0"] if col in got and got.get("0") else None
      c = est[col] / est["0"] if col in est and est.get("0") else None
      rows.append(dict(batch=b, program=label, column=col,
                       measured_ms=got[col] * 1e3 if col in got else None, measured_over_plain=m,
                       compiler_ms=est[col] * 1e3 if col in est else None, compiler_over_plain=c,
                       agreement=m / c if m is not None and c else None))
  return rows


def compiler_table() -> dict:
  """The committed H200 cost table's seconds ({} if absent: the measured side still prints)."""
  if not os.path.isfile(COMPILER_TABLE):
    return {}
  with open(COMPILER_TABLE, encoding="utf-8") as f:
    return json.load(f).get("seconds", {})


def _random_like(tree, seed: int):
  """Arrays of an abstract tree's shapes: floats N(0, 0.02), integers zero (EAGLE-3's d2t offsets)."""
  leaves, treedef = jax.tree.flatten(tree)
  keys = jax.random.split(jax.random.PRNGKey(seed), len(leaves))
  make = lambda a: jax.jit(lambda k: (jax.random.normal(k, a.shape, jnp.float32) * 0.02).astype(a.dtype)
                           if jnp.issubdtype(a.dtype, jnp.floating) else jnp.zeros(a.shape, a.dtype))
  return treedef.unflatten([make(a)(k) for a, k in zip(leaves, keys)])


def _busy(state, k: int, length: int):
  """Every row running at `length` committed tokens, drafting up to k, far from its token limit."""
  B = state.lengths.shape[0]
  L = jnp.full((B,), length, jnp.int32)
  return state.replace(done=jnp.zeros_like(state.done), finish=jnp.zeros_like(state.finish), lengths=L,
                       prompt_lens=L, max_new=jnp.full((B,), 1 << 20, jnp.int32),
                       draft_cap=jnp.full_like(state.draft_cap, k), cache=state.cache.replace(lengths=L - 1))


def time_step_program(prog, runs: int) -> float:
  """Seconds a loop step of a cost-table program: its decode loop compiled with the table's XLA:GPU options, on
  random weights, every row busy at the context; STEPS steps a call, the median call over the steps it ran."""
  from spec_jax import slots
  from spec_jax.cache import DEFAULT_BLOCK_SIZE
  from serve.compiler.aot_compile import GPU_OPTIONS
  params_abs, state_abs, spec, steps_abs = prog.args
  params = _random_like(params_abs, 0)
  state = jax.jit(lambda p: slots._empty(p, spec=spec, batch=state_abs.lengths.shape[0], capacity=CONTEXT,
                                         block_size=DEFAULT_BLOCK_SIZE, num_pages=None,
                                         costs=jnp.ones((len(spec.ks),), jnp.float32),
                                         key=jax.random.PRNGKey(0)))(params)
  k, length = spec.ks[0], CONTEXT - (spec.ks[0] + 1) * STEPS - 8
  busy = jax.jit(lambda s: _busy(s, k, length))
  fn = getattr(prog.fn, "_program", prog.fn)
  n = jnp.asarray(STEPS, jnp.int32)
  options = GPU_OPTIONS if not FLAGS.smoke else {}
  compiled = fn.trace(params, state, spec, n).lower().compile(compiler_options=options)
  samples = []
  for i in range(runs + 1):
    state = jax.block_until_ready(busy(state))
    before = int(state.step)
    t0 = time.perf_counter()
    state = jax.block_until_ready(compiled(params, state, n))
    dt = time.perf_counter() - t0
    ran = int(state.step) - before
    if not ran:  # every row stopped (an end token): nothing was timed
      raise RuntimeError(f"{prog.name}: the loop ran no step")
    if i:  # the first call warms up
      samples.append(dt / ran)
  return statistics.median(samples)


def step_programs(dry: bool, runs: int) -> dict:
  """Section 5: the cost table's programs, timed (or, dry, exported for CUDA), with the compiler's ratios."""
  from serve.compiler import aot_programs as progs
  from serve.compiler.aot_compile import export_cuda
  config = llama8b()
  place = progs.Placement(lowering="gpu") if dry else progs.Placement(jax.devices()[0])
  measured, lowered = {}, {}
  for b in STEP_BATCHES:
    for label, method, k, topk, nodes, col in STEP_PROGRAMS:
      with place.context():
        prog = progs.step_program(config, place, method=method, k=k, topk=topk, nodes=nodes, batch=b,
                                  max_model_len=CONTEXT, dtype=DTYPE,
                                  impl="xla" if FLAGS.smoke else "pallas_gpu")
      if dry:
        rec = export_cuda(prog)
        lowered.setdefault(str(b), {})[col] = {"exported": rec["exported"], "triton_calls": rec.get("triton_calls", 0),
                                                "error": rec.get("error")}
        continue
      measured.setdefault(str(b), {})[col] = time_step_program(prog, runs)
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  out = {"compiler_table": os.path.relpath(COMPILER_TABLE, root),
         "measured_seconds": measured, "rows": program_ratios(measured, compiler_table())}
  if dry:
    out["lowered"] = lowered
  return out


def _x(v) -> str:
  return "n/a" if v is None else f"{v:.2f}x"


def programs_md(sec: dict, dry: bool) -> list:
  lines = ["", "The cost table's programs (one decode-loop step, aot_programs.step_program), llama3-8b, context "
           f"{CONTEXT}: measured beside the compiler's H200 roofline ({sec['compiler_table']})"
           + (" (dry run: not measured)" if dry else "") + ":", "",
           "| batch | program | measured ms | measured over plain | compiler ms | compiler over plain | "
           "measured / compiler |", "|---|---|---|---|---|---|---|"]
  for r in sec["rows"]:
    ms = lambda v: "n/a" if v is None else f"{v:.3f}"
    lines.append(f"| {r['batch']} | {r['program']} | {ms(r['measured_ms'])} | {_x(r['measured_over_plain'])} | "
                 f"{ms(r['compiler_ms'])} | {_x(r['compiler_over_plain'])} | {_x(r['agreement'])} |")
  return lines


def report_md(res: dict) -> str:
  lines = [f"# Device check: {res['device']} ({res['date']}{', dry run' if res['dry_run'] else ''})", ""]
  if res["dry_run"]:
    lines += ["Lowered for CUDA, not run: every program below holds the Triton kernel it names.", "",
              "| program | Triton calls |", "|---|---|"]
    lines += [f"| kernel: {k['name']} | {k['triton_calls']} |" for k in res["kernels"]]
    lines += [f"| decode step, llama3-8b B=1 | {res['decode']['triton_calls']} |"]
    for b, row in res["verify"].items():
      lines += [f"| forward {label}, llama3-8b B={b} | {v['triton_calls']} |" for label, v in row.items()]
    for b, row in res["programs"]["lowered"].items():
      lines += [f"| step program {col}, llama3-8b B={b} | {v['triton_calls']} |" for col, v in row.items()]
    lines += programs_md(res["programs"], True)
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
  lines += programs_md(res["programs"], False)
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
  del params  # the step programs make their own (with a drafter's)
  res["programs"] = step_programs(dry, FLAGS.runs)
  res["seconds"] = round(time.perf_counter() - t0, 1)
  os.makedirs(FLAGS.output, exist_ok=True)
  with open(os.path.join(FLAGS.output, "device_check.json"), "w", encoding="utf-8") as f:
    json.dump(res, f, indent=1)
  with open(os.path.join(FLAGS.output, "device_check.md"), "w", encoding="utf-8") as f:
    f.write(report_md(res))
  print(report_md(res))


if __name__ == "__main__":
  app.run(main)
