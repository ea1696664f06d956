"""Train the Medusa heads for Gemma 3 270M: python -m train.main --config=configs/train_medusa_gemma3_270m.py

Medusa-2's data recipe with the backbone frozen: the heads learn the target's own self-distilled answers
(configs/train_base.py use_self_distilled)."""

from configs.train_base import get_config as _base, use_self_distilled


def get_config():
  c = use_self_distilled(_base("medusa"))
  c.export = "heads/medusa_gemma3_270m"
  c.train.steps = 800
  return c
