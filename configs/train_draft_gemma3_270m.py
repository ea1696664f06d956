"""Train the draft distilled draft for Gemma 3 270M: python -m train.main --config=configs/train_draft_gemma3_270m.py"""

from configs.train_base import get_config as _base


def get_config():
  c = _base("draft")
  c.draft_vocab = 0
  c.train.lr = 1e-4
  c.train.batch_size = 4
  return c
