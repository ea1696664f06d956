"""Train the eagle head(s) for Gemma 3 270M: python -m train.main --config=configs/train_eagle_gemma3_270m.py"""

from configs.train_base import get_config as _base


def get_config():
  c = _base("eagle")
  c.export = "heads/eagle_gemma3_270m"
  c.ttt_passes = 3  # training-time test: two self-fed passes (measured in heads/README.md)
  c.train.steps = 1500
  return c
