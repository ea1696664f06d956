"""train.draft_vocab: the N most frequent ids of a training config's data, saved as a "vocab" head checkpoint that
qdraft loads."""

import numpy as np

from configs.train_tiny_test import get_config
from spec_jax.checkpoints.heads import load_heads
from train.draft_vocab import build
from train.main import build_data, load_target


def test_the_vocabulary_is_the_most_frequent_ids_of_the_data(tmp_path):
  cfg = get_config("draft")
  cfg.cache_dir = str(tmp_path / "cache")
  stem = str(tmp_path / "vocab")
  meta = build(cfg, 20, stem, log=lambda s: None)
  config, params, tok = load_target(cfg)
  data = build_data(cfg, config, params, tok, lambda s: None)  # the cached data again
  _, weights, d2t = load_heads(stem, config, "vocab")
  assert weights == {} and len(d2t) == 20 and np.all(np.diff(np.asarray(d2t)) > 0)
  ids, counts = np.unique(data.tokens[data.mask], return_counts=True)
  kept = set(np.asarray(d2t).tolist())
  # Every kept id is at least as frequent as every id left out.
  freq = dict(zip(ids.tolist(), counts.tolist()))
  assert min(freq.get(i, 0) for i in kept) >= max(c for i, c in freq.items() if i not in kept)
  held = data.eval_tokens[data.eval_mask]
  assert meta["heldout_coverage"] == np.mean([t in kept for t in held.tolist()])
  assert meta["train_tokens"] == int(data.mask.sum())
