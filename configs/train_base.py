"""Shared training settings (see train/main.py); the per-kind configs override these."""

import ml_collections

from spec_jax.datasets import DISTILL_DIR  # the committed answers of `python -m train.distill`


def get_config(kind: str = "medusa"):
  c = ml_collections.ConfigDict()
  c.kind = kind  # medusa | eagle | draft
  c.model = ""  # "" = the packaged Gemma 3 270M GGUF; "tiny" = a small random target (tests)
  c.dtype = "float32"
  c.tiny = ml_collections.ConfigDict(dict(
      vocab_size=97, d_model=32, num_layers=2, num_heads=4, num_kv_heads=1, head_dim=8, mlp_dim=64,
      sliding_window=8, global_every=2, query_pre_attn_scalar=8.0, max_seq_len=256, bos_id=2, eos_ids=(1,),
      pad_id=0, name="tiny-train"))
  c.tiny_seed = 0
  c.cache_dir = "/tmp/spec_jax_data"
  c.draft_vocab = 8192  # reduced draft vocabulary (0: the full vocabulary)
  c.num_heads = 4  # medusa
  c.mlp_dim = 1024  # eagle layer's MLP width (0: the target's)
  c.noise = 0.0  # eagle feature noise
  c.feature_layers = ()  # eagle: () = the final-normed hidden (EAGLE-1); e.g. (1, 8, 14) = EAGLE-3's fused layers
  c.cached_feature_layers = ()  # layers the feature pass caches (() = feature_layers); feature_layers begins it
  c.head_layout = "ours"  # eagle: "ours" (this project's layer) | "eagle3" (published EAGLE-3, exported exactly)
  c.ttt_passes = 1  # eagle: 1 + self-fed passes of the training-time test (train/losses.py eagle_unrolled)
  c.reg_weight = 1.0
  c.ce_weight = 1.0
  c.draft_layers = 6  # distilled draft
  c.init_from = ""  # a head checkpoint stem to start from (same kind, shapes and vocabulary) instead of a fresh init
  c.export = ""  # head checkpoint stem to write at the end ("" = none)
  c.export_best = True
  c.export_storage = "bfloat16"  # or "int8": matrices stored as int8 + per-row scales (checkpoints.heads)
  c.data = ml_collections.ConfigDict(dict(
      num_prompts=480, num_transcripts=1500, num_text=400, text_chars=1000, max_new_tokens=96,
      temperatures=(0.0, 0.7, 1.0), gen_batch=16, seq_len=192, eval_fraction=0.05, seed=0, distill_dir=""))
  c.train = ml_collections.ConfigDict(dict(
      steps=1200, batch_size=8, lr=2e-3, warmup=30, end_lr_fraction=0.05, weight_decay=0.0, clip=1.0,
      eval_every=100, eval_batches=4, save_every=100, keep=2, log_every=10, seed=0,
      workdir=f"/tmp/spec_jax_train/{kind}", progress=True, cache_features=True, feature_dtype="float32"))
  return c


def use_self_distilled(c):
  """Train on the committed self-distilled answers only (no reference transcripts, no stdlib text: the target's
  own answers are the distribution a proposer drafts), 384 tokens a row (99% of the answers fit), batch 4 (the
  1,536 positions a step of the old 8 x 192 batches). Every kind shares one bfloat16 feature cache of EAGLE-3's
  layout, [final; layers 1, 8, 14]."""
  c.data.update(dict(distill_dir=DISTILL_DIR, num_prompts=0, num_transcripts=0, num_text=0, seq_len=384))
  c.cached_feature_layers = (1, 8, 14)
  c.train.batch_size = 4
  c.train.eval_batches = 16
  c.train.feature_dtype = "bfloat16"
  return c
