"""What storing the trainer's feature cache in bfloat16 instead of float32 costs.

  python benchmarks/probes/feature_dtype.py --rows=64
  python benchmarks/probes/feature_dtype.py --rows=64 \\
      --heads=eagle:heads/eagle_gemma3_270m,eagle3:heads/eagle3_gemma3_270m

On held-out rows of the self-distilled training data (the trainer's own eval split, configs/train_base.py
use_self_distilled), the frozen Gemma 3 270M's features [final; layers 1, 8, 14] are computed in float32 and
rounded to bfloat16. Reported:
- the rounding's relative error per part;
- teacher flips: positions where the target's argmax next token (final hidden through the output rows, the
  reduced draft vocabulary and the full one) differs between the two: label noise a bfloat16 cache adds;
- with --heads, each trained head's held-out metrics (the training loss's top-1 per draft position) fed the
  float32 and the bfloat16 features: how much the head depends on the rounding.
Disk is arithmetic (2 bytes a value against 4); the feature pass computes in float32 either way.
"""

from __future__ import annotations

import importlib

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from absl import app, flags

flags.DEFINE_integer("rows", 64, "Held-out rows (384 tokens each).")
flags.DEFINE_list("heads", [], "kind:checkpoint stem pairs, kind in eagle, eagle3, medusa, draft.")
FLAGS = flags.FLAGS

CONFIGS = {"eagle": "configs.train_eagle_gemma3_270m", "eagle3": "configs.train_eagle3_gemma3_270m",
           "medusa": "configs.train_medusa_gemma3_270m", "draft": "configs.train_draft_gemma3_270m"}
BATCH = 4


def _bf16(x):
  return np.asarray(x, np.float32).astype(ml_dtypes.bfloat16).astype(np.float32)


def main(argv):
  del argv
  from spec_jax.checkpoints import heads as head_ckpt
  from spec_jax.proposers import vocab
  from train import losses
  from train.main import build_data, build_task, load_target
  cfg = importlib.import_module(CONFIGS["eagle3"]).get_config()
  config, params, tok = load_target(cfg)
  data = build_data(cfg, config, params, tok, log=print)
  n = min(FLAGS.rows, len(data.eval_tokens)) // BATCH * BATCH
  toks, mask = data.eval_tokens[:n], data.eval_mask[:n]
  layers = tuple(cfg.cached_feature_layers)
  feat_fn = jax.jit(lambda p, t: losses.target_features(p, config, t, layers))
  f32 = np.concatenate([np.asarray(feat_fn(params, toks[i:i + BATCH])) for i in range(0, n, BATCH)])
  b16 = _bf16(f32)
  D = config.d_model
  m = mask.reshape(-1)
  print(f"{n} held-out rows, {int(mask.sum())} tokens; features {f32.shape[-1]} wide "
        f"(final + layers {list(layers)})")
  print("| part | relative error of the bfloat16 rounding |\n|---|---|")
  for i, name in enumerate(["final"] + [f"layer {l}" for l in layers]):
    a, b = f32[..., i * D:(i + 1) * D].reshape(-1, D)[m], b16[..., i * D:(i + 1) * D].reshape(-1, D)[m]
    print(f"| {name} | {np.linalg.norm(a - b) / np.linalg.norm(a):.2e} |")
  d2t = head_ckpt.make_d2t(data.token_counts(config.vocab_size), cfg.draft_vocab)
  for label, ids in (("draft vocabulary", jnp.asarray(d2t)), ("full vocabulary", None)):
    rows = vocab.output_rows(params, ids)
    am = jax.jit(lambda h, r: jnp.argmax(vocab.project(h, r), -1))
    flips = 0
    for i in range(0, n, BATCH):
      a = np.asarray(am(jnp.asarray(f32[i:i + BATCH, :, :D]), rows))
      b = np.asarray(am(jnp.asarray(b16[i:i + BATCH, :, :D]), rows))
      flips += int(((a != b) & mask[i:i + BATCH]).sum())
    print(f"teacher argmax flips ({label}, {rows.shape[0]} rows): {flips} of {int(mask.sum())} "
          f"({flips / mask.sum():.2e})")
  for spec in FLAGS.heads:
    kind, path = spec.split(":", 1)
    hcfg = importlib.import_module(CONFIGS[kind]).get_config()
    meta, weights, hd2t = head_ckpt.load_heads(path, config, hcfg.kind)
    task, _, frozen, _ = build_task(hcfg, config, params, None if hd2t is None else np.asarray(hd2t))
    loss = jax.jit(lambda w, fz, f, t, mm: task.loss(w, fz, f, t, mm, jax.random.PRNGKey(0))[1])
    out = {}
    for label, feats in (("float32", f32), ("bfloat16", b16)):
      sums = {}
      for i in range(0, n, BATCH):
        mets = loss(weights, frozen, jnp.asarray(feats[i:i + BATCH]), jnp.asarray(toks[i:i + BATCH]),
                    jnp.asarray(mask[i:i + BATCH]))
        for k, v in mets.items():
          if k.startswith("top1_h"):
            sums[k] = sums.get(k, 0.0) + float(v) * BATCH / n
      out[label] = sums
    keys = sorted(out["float32"])
    print(f"{kind} ({path}): top-1 per position, float32 features " +
          " / ".join(f"{out['float32'][k]:.4f}" for k in keys) + "; bfloat16 features " +
          " / ".join(f"{out['bfloat16'][k]:.4f}" for k in keys))


if __name__ == "__main__":
  app.run(main)
