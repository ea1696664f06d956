"""A draft vocabulary alone: the N target ids most frequent in a training config's data, saved as a head
checkpoint of kind "vocab" (d2t only, no weights). qdraft drafts over it (spec_jax/proposers/draft.py).

  python -m train.draft_vocab --config=configs/train_draft_gemma3_270m.py --size=32768 \
      --vocab_out=heads/qdraft_gemma3_270m

The ranking counts the training split's tokens (prompts and answers) exactly as the heads' d2t does; the held-out
split's coverage by the N ids goes into the metadata.
"""

from __future__ import annotations

import sys

import numpy as np
from absl import app, flags

from spec_jax import flag_table
from spec_jax.checkpoints import heads as head_ckpt
from train.main import _CONFIG, _portable, build_data, load_target  # --config: a train.main config (model, data)

flag_table.define(("size", "vocab_out"))
flags.mark_flag_as_required("vocab_out")
FLAGS = flags.FLAGS


def build(cfg, size: int, out: str, log=None) -> dict:
  """Rank the ids of cfg's data, keep `size`, save; -> the metadata written."""
  log = log or (lambda s: print(s, file=sys.stderr, flush=True))
  if size < 1:
    raise ValueError(f"--size must be >= 1, got {size}")
  config, params, tokenizer = load_target(cfg)
  data = build_data(cfg, config, params, tokenizer, log)
  d2t = head_ckpt.make_d2t(data.token_counts(config.vocab_size), size)
  held = data.eval_tokens[data.eval_mask]
  coverage = float(np.isin(held, d2t).mean()) if held.size else None
  meta = {"heldout_coverage": coverage, "heldout_tokens": int(held.size),
          "train_tokens": int(data.mask.sum()), "data": _portable(dict(cfg.data))}
  path = head_ckpt.save_heads(out, "vocab", {}, config, meta, d2t)
  log(f"wrote {path}: {len(d2t)} ids, held-out coverage {coverage}")
  return meta


def main(argv):
  del argv
  build(_CONFIG.value, FLAGS.size, FLAGS.vocab_out)


if __name__ == "__main__":
  app.run(main)
