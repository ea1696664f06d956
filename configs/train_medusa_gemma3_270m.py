"""Train the medusa head(s) for Gemma 3 270M: python -m train.main --config=configs/train_medusa_gemma3_270m.py"""

from configs.train_base import get_config as _base


def get_config():
  c = _base("medusa")
  c.export = "heads/medusa_gemma3_270m"
  return c
