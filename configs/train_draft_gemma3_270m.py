"""Distil a 2-layer draft for Gemma 3 270M: python -m train.main --config=configs/train_draft_gemma3_270m.py

It starts as the target's first 2 layers (the early-exit self-draft), shares the frozen embedding, and is trained
with KL to the target over the reduced draft vocabulary it also drafts with, on the self-distilled answers. Its
layer matrices are stored as int8 (11 MB, so it ships in git and `--method=draft` works on a fresh clone)."""

from configs.train_base import get_config as _base, use_self_distilled


def get_config():
  c = use_self_distilled(_base("draft"))
  c.draft_layers = 2
  c.export = "heads/draft_gemma3_270m"
  c.export_storage = "int8"
  c.train.lr = 3e-4
  c.train.steps = 500
  return c
