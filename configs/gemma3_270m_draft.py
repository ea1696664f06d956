"""Gemma 3 270M with its early-exit self-draft: the first 6 of 18 layers plus the shared final norm and head."""

from configs.gemma3_270m import get_config as _base


def get_config():
  c = _base()
  c.method = "draft"
  c.draft_layers = 6
  c.num_speculative_tokens = 3
  return c
