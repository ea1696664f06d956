"""Gemma 3 270M with the distilled draft shipped in heads/ (configs/train_draft_gemma3_270m.py made it: 2 layers
sharing the target's embedding, drafting over its reduced vocabulary, stored int8). `--draft_layers=6` swaps in the
early-exit self-draft instead."""

from configs.gemma3_270m import get_config as _base


def get_config():
  c = _base()
  c.speculative_config = dict(method="draft", num_speculative_tokens=4)
  return c
