"""Where EAGLE's acceptance goes: on the held-out training prompts (train.eval_acceptance's), the share of the
target's greedy output tokens inside the draft vocabulary, and the shipped head's top-1 per draft position
(training-time-test passes, teacher-forced on those outputs) against the target's full-vocabulary argmax.

  python benchmarks/eagle_gap.py      # float32, 16 prompts x 64 tokens, ~2 min on 2 cores
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from spec_jax.checkpoints.load import load_model
from spec_jax.decode import generate
from spec_jax.checkpoints import heads as head_ckpt
from spec_jax.proposers import eagle, vocab
from spec_jax.proposers.registry import default_heads_path
from train import losses
from train.eval_acceptance import held_out_prompts


def main(num_prompts: int = 16, max_new_tokens: int = 64, passes: int = 3):
  config, params, tok = load_model(None, "float32")
  ids = [tok.encode(tok.apply_chat_template([t])) for t in held_out_prompts(num_prompts, 0)]
  outs = generate(params, config, ids, max_new_tokens=max_new_tokens).token_ids
  meta, weights, d2t = head_ckpt.load_heads(default_heads_path("eagle"), config, "eagle", jnp.float32)
  d2t_np = np.asarray(d2t)
  generated = np.concatenate([np.asarray(o) for o in outs])
  print(f"draft-vocabulary coverage of the greedy outputs: {np.isin(generated, d2t_np).mean():.3f} "
        f"({len(generated)} tokens)")

  seqs = [p + o for p, o in zip(ids, outs)]
  B, T = len(seqs), max(map(len, seqs))
  toks = np.zeros((B, T), np.int32)
  is_gen = np.zeros((B, T), bool)
  for i, (p, s) in enumerate(zip(ids, seqs)):
    toks[i, :len(s)] = s
    is_gen[i, len(p):len(s)] = True
  toks = jnp.asarray(toks)
  feats = losses.target_features(params, config, toks)
  ecfg = eagle.layer_config(config, int(meta["mlp_dim"]))
  preds = losses.eagle_unrolled(dict(weights, embed=params["embed"]), ecfg, feats[:, :-1], toks[:, 1:], passes)
  # Position s predicts token s+2; the target's choice there is the argmax of its full head on F[s+1].
  want = np.asarray(jnp.argmax(vocab.project(feats[:, 1:], vocab.output_rows(params)), -1))
  scored = np.zeros(want.shape, bool)
  scored[:, :-1] = is_gen[:, 2:]
  rows = vocab.output_rows(params, d2t)
  for j, pred in enumerate(preds):
    got = d2t_np[np.asarray(jnp.argmax(vocab.project(pred, rows), -1))]
    ok = scored.copy()
    ok[:, :j] = False
    print(f"draft position {j + 1}: top-1 vs the target's argmax {np.mean((got == want)[ok]):.3f} "
          f"({int(ok.sum())} positions)")


if __name__ == "__main__":
  main()
