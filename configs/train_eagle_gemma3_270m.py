"""Train the EAGLE head for Gemma 3 270M: python -m train.main --config=configs/train_eagle_gemma3_270m.py

EAGLE-1 features (the target's final-normed hidden state), the 3-pass training-time test, on the committed
self-distilled answers (configs/train_base.py use_self_distilled)."""

from configs.train_base import get_config as _base, use_self_distilled


def get_config():
  c = use_self_distilled(_base("eagle"))
  c.export = "heads/eagle_gemma3_270m"
  c.ttt_passes = 3  # training-time test: two self-fed passes (measured in heads/README.md)
  c.train.steps = 1000
  return c
