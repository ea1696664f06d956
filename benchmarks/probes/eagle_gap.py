"""Where EAGLE's acceptance goes: on the held-out training prompts (train.eval_acceptance's), the share of the
target's greedy output tokens inside the draft vocabulary, and the shipped head's top-1 per draft position
(training-time-test passes, teacher-forced on those outputs) against the target's full-vocabulary argmax, with
the head's argmax taken over
- the reduced draft vocabulary (what the proposer drafts from);
- the reduced vocabulary plus every id already in the row's committed context (a copy of a prompt or earlier
  answer token: most of the target's tokens outside the reduced vocabulary are such copies);
- the full vocabulary (the head's own ceiling).

  python benchmarks/probes/eagle_gap.py           # float32, 16 prompts x 64 tokens, ~2 min on 2 cores
  python benchmarks/probes/eagle_gap.py heads/eagle3_gemma3_270m 64 128
"""

from __future__ import annotations

import sys

import jax.numpy as jnp
import numpy as np

from spec_jax.checkpoints.load import load_model
from spec_jax.batch import generate
from spec_jax.checkpoints import heads as head_ckpt
from spec_jax.proposers import eagle, vocab
from spec_jax.proposers.registry import default_heads_path
from train import losses
from train.eval_acceptance import held_out_prompts


def main(heads: str = "", num_prompts: int = 16, max_new_tokens: int = 64, passes: int = 3):
  config, params, tok = load_model(None, "float32")
  ids = [tok.encode(tok.apply_chat_template([t])) for t in held_out_prompts(num_prompts, 0)]
  outs = generate(params, config, ids, max_new_tokens=max_new_tokens).token_ids
  meta, weights, d2t = head_ckpt.load_heads(heads or default_heads_path("eagle"), config, "eagle", jnp.float32)
  layers = tuple(meta.get("feature_layers") or ())
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
  feats = losses.target_features(params, config, toks, layers)
  D = config.d_model
  final, inputs = (feats, feats) if not layers else (feats[..., :D], feats[..., D:])
  ecfg = eagle.layer_config(config, int(meta["mlp_dim"]))
  preds = losses.eagle_unrolled(dict(weights, embed=params["embed"]), ecfg, inputs[:, :-1], toks[:, 1:], passes)
  feats = final
  # Position s predicts token s+2; the target's choice there is the argmax of its full head on F[s+1].
  want = np.asarray(jnp.argmax(vocab.project(feats[:, 1:], vocab.output_rows(params)), -1))
  scored = np.zeros(want.shape, bool)
  scored[:, :-1] = is_gen[:, 2:]
  rows = vocab.output_rows(params, d2t)
  all_rows = vocab.output_rows(params)
  in_d2t = np.zeros(config.vocab_size, bool)
  in_d2t[d2t_np] = True
  toks_np = np.asarray(toks)
  for j, pred in enumerate(preds):
    got = d2t_np[np.asarray(jnp.argmax(vocab.project(pred, rows), -1))]
    got_ctx = np.zeros_like(got)
    got_full = np.zeros_like(got)
    for b in range(B):  # one row at a time: [T, V] logits
      logits = np.asarray(vocab.project(pred[b], all_rows))
      got_full[b] = logits.argmax(-1)
      # Position s drafts token s + 2 at draft position j + 1: the committed context is tokens 0 .. s + 1 - j.
      first = np.full(config.vocab_size, T + 1)
      for t in range(T - 1, -1, -1):
        first[toks_np[b, t]] = t
      seen = first[None, :] <= (np.arange(logits.shape[0]) + 1 - j)[:, None]  # [T, V]
      got_ctx[b] = np.where(in_d2t[None, :] | seen, logits, -np.inf).argmax(-1)
    ok = scored.copy()
    ok[:, :j] = False
    print(f"draft position {j + 1}: top-1 vs the target's argmax, draft vocabulary {np.mean((got == want)[ok]):.3f}"
          f", + context ids {np.mean((got_ctx == want)[ok]):.3f}, full vocabulary {np.mean((got_full == want)[ok]):.3f}"
          f" ({int(ok.sum())} positions)")


if __name__ == "__main__":
  main(*(a if i == 0 else int(a) for i, a in enumerate(sys.argv[1:])))
