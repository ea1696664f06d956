"""Losses for heads and drafts on a frozen target, plus the frozen target's features computed on the fly.

Offsets (the decode loop's, see spec_jax/proposers/medusa.py and eagle.py): F[:, t] is the target's final-normed
hidden at position t; through the LM head it predicts token t+1.
- Medusa head i reads F[:, t] and predicts token t+2+i (CE against the sequence's tokens, which are the
  target's own continuations after self-distillation).
- EAGLE reads the pair (F[:, t], token t+1) and predicts F[:, t+1] (smooth L1) and, through the frozen head,
  the target's distribution for token t+2 (KL from softmax of the target's logits: soft CE less its entropy).
- A distilled draft model: KL(target || draft) per position over the full vocabulary.
Reduced vocabularies: labels outside d2t are dropped (t2d = -1) and distributions live over the N draft ids.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from spec_jax.kernels.reference import NEG_INF
from spec_jax.models import transformer as tfm
from spec_jax.proposers import eagle, medusa, vocab
from spec_jax.rows import target_features as target_features_of


def target_features(target_params, config, tokens, feature_layers=()):
  """Final-normed hidden states [B, T, D] of the frozen target (no logits: the heads project themselves). With
  EAGLE-3 `feature_layers`, those layers' outputs follow side by side: [B, T, (1 + n) D], the first D the final
  hidden (the teacher), the rest what the decode loop hands the head (spec_jax.rows.target_features)."""
  _, hidden, _, *layers = tfm.forward(target_params, tokens, cache=None, config=config, compute_logits=False,
                                      return_layers=tuple(feature_layers))
  if layers:
    hidden = jnp.concatenate([hidden, target_features_of(hidden, layers[0])], axis=-1)
  return jax.lax.stop_gradient(hidden)


def _shift(x, n, fill=0):
  """x[:, t + n] at t (filled past the end)."""
  pad = [(0, 0), (0, n)] + [(0, 0)] * (x.ndim - 2)
  return jnp.pad(x[:, n:], pad, constant_values=fill)


TREE_RANKS = 8  # ranks whose held-out accuracy Medusa training records


def _topk_hits(logits, label, kk):
  """Whether label is in the top-kk of logits (ties counted generously: rank = #strictly greater)."""
  lab = jnp.take_along_axis(logits, label[..., None], axis=-1)
  return jnp.sum(logits > lab, axis=-1) < kk


def _masked_mean(x, m):
  m = m.astype(jnp.float32)
  return jnp.sum(x * m) / jnp.maximum(jnp.sum(m), 1.0)


def medusa_loss(heads, frozen, hidden, tokens, mask):
  """CE per head. frozen: {"rows": [N, D], "t2d": [V] int32 (optional)} -> (loss, metrics)."""
  K = heads["w"].shape[0]
  feats = medusa.head_features(heads, hidden.astype(heads["w"].dtype))  # [B, T, K, D]
  logits = vocab.project(feats, frozen["rows"])  # [B, T, K, N]
  logp = jax.nn.log_softmax(logits, axis=-1)
  total, metrics = 0.0, {}
  for i in range(K):
    lab = _shift(tokens, 2 + i)
    ok = _shift(mask, 2 + i, False) & mask
    if "t2d" in frozen:
      lab = frozen["t2d"][lab]
      ok = ok & (lab >= 0)
      lab = jnp.maximum(lab, 0)
    nll = -jnp.take_along_axis(logp[:, :, i], lab[..., None], axis=-1)[..., 0]
    li = _masked_mean(nll, ok)
    total = total + li
    metrics[f"loss_h{i}"] = li
    metrics[f"top1_h{i}"] = _masked_mean(_topk_hits(logits[:, :, i], lab, 1), ok)
    metrics[f"top5_h{i}"] = _masked_mean(_topk_hits(logits[:, :, i], lab, 5), ok)
    rank = jnp.sum(logits[:, :, i] > jnp.take_along_axis(logits[:, :, i], lab[..., None], axis=-1), axis=-1)
    for r in range(TREE_RANKS):  # per-rank accuracy: what a static tree is chosen from (medusa.rank_accuracy)
      metrics[f"rank{r}_h{i}"] = _masked_mean(rank == r, ok)
  return total / K, metrics


def eagle_unrolled(params, cfg, feats, toks, passes: int, published=None):
  """EAGLE's layer over a whole sequence, then `passes - 1` more passes fed with its own predicted features
  (EAGLE-3's training-time test), each as the decode loop would see it.

  feats [B, T, D] are the target's features F_s (or [B, T, n * D]: EAGLE-3's fused layers, which pass 0 fuses;
  later passes read the head's own D-wide predictions, as drafting does), toks [B, T] the tokens tok_{s+1}. Pass 0 reads
  (F_s, tok_{s+1}) and attends causally over pass 0: it predicts F_{s+1}. Pass j reads (P_{j-1}[s-1], tok_{s+1})
  and attends to pass 0's keys at positions <= s-j and to pass i's key at position s-(j-i) for i = 1..j: exactly
  the cache of draft step j+1 after s-j verified positions (slot == position). Every pass predicts F_{s+1}.
  The fed-back features carry no gradient. params needs "embed". `published`: a published layout's forward
  (eagle.Published; the EAGLE-3 layout of spec_jax/proposers/eagle3_layout.py), the very input and output
  functions drafting runs. -> list of predictions [B, T, D] per pass (what drafting feeds back).
  """
  B, T, _ = feats.shape
  lp = params["layer"]
  pos = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
  base = jnp.float32(cfg.rope_base)
  G = cfg.num_heads // cfg.num_kv_heads
  s_idx = jnp.arange(T)
  preds, ks, vs = [], [], []
  inp = feats
  for j in range(passes):
    x, attn_in = eagle.layer_inputs(params, cfg, inp, toks, published)
    q, k, v = tfm.layer_qkv(cfg, x, lp, pos, base, attn_in)
    ks.append(k)
    vs.append(v)
    qg = q.reshape(B, T, cfg.num_kv_heads, G, -1)
    s0 = jnp.einsum("btkgd,bskd->bkgts", qg, ks[0], preferred_element_type=jnp.float32) * cfg.attn_scale
    s0 = jnp.where((s_idx[None, :] <= s_idx[:, None] - j)[None, None, None], s0, NEG_INF)
    # Pass i's key at position s-(j-i): a diagonal, one score per query.
    ki = [_shift_right(ks[i], j - i) for i in range(1, j + 1)]
    vi = [_shift_right(vs[i], j - i) for i in range(1, j + 1)]
    sd = [jnp.einsum("btkgd,btkd->bkgt", qg, kk, preferred_element_type=jnp.float32) * cfg.attn_scale
          for kk in ki]
    w = jax.nn.softmax(jnp.concatenate([s0] + [d[..., None] for d in sd], axis=-1), axis=-1)
    o = jnp.einsum("bkgts,bskd->btkgd", w[..., :T].astype(v.dtype), vs[0], preferred_element_type=jnp.float32)
    for n, vv in enumerate(vi):
      o = o + jnp.einsum("bkgt,btkd->btkgd", w[..., T + n].astype(v.dtype), vv, preferred_element_type=jnp.float32)
    attn = o.reshape(B, T, cfg.num_heads, -1).astype(q.dtype)
    pred = eagle.out_feature(params, cfg, tfm.layer_finish(cfg, x, attn, lp), published)
    preds.append(pred)
    inp = _shift_right(jax.lax.stop_gradient(pred), 1)
  return preds


def _shift_right(x, n):
  """x[:, s - n] at s (zeros before the start)."""
  if n == 0:
    return x
  pad = [(0, 0), (n, 0)] + [(0, 0)] * (x.ndim - 2)
  return jnp.pad(x[:, :x.shape[1] - n], pad)


def eagle_loss(weights, frozen, hidden, tokens, mask, *, cfg, key=None, noise=0.0, reg_weight=1.0,
               ce_weight=1.0, passes=1, published=None):
  """frozen: {"embed": [V, D], "rows": [N, D]}. Pairs (F_t, tok_{t+1}) -> F_{t+1} and the target's p(t+2),
  averaged over `passes` (1 + the training-time test's self-fed passes; see eagle_unrolled). A published layout's
  predicted feature is not the target's (no regression: reg_weight must be 0); its logits are its own head's."""
  D = cfg.d_model
  final, feats = (hidden, hidden) if hidden.shape[-1] == D else (hidden[..., :D], hidden[..., D:])
  feats, toks = feats[:, :-1], tokens[:, 1:]
  if noise and key is not None:  # EAGLE's feature noise: robustness to its own imperfect features
    feats = feats + noise * jax.random.uniform(key, feats.shape, feats.dtype, -1.0, 1.0)
  params = dict(weights, embed=frozen["embed"], rows=frozen["rows"])
  preds = eagle_unrolled(params, cfg, feats.astype(weights["layer"]["q"].dtype), toks, passes, published)
  want = final[:, 1:].astype(preds[0].dtype)
  ok = mask[:, 1:] & mask[:, :-1]
  teacher = jax.lax.stop_gradient(vocab.project(want, frozen["rows"]))
  # KL(teacher || student): the soft CE's gradient, without the teacher's entropy as a floor.
  p_log = jax.nn.log_softmax(teacher, -1)
  p = jnp.exp(p_log)
  best = jnp.argmax(teacher, axis=-1)
  total, metrics = 0.0, {}
  for j, pred in enumerate(preds):
    okj = ok & (jnp.arange(ok.shape[1]) >= j)[None, :]
    reg = _masked_mean(jnp.mean(optax_smooth_l1(pred - want), axis=-1), okj)
    student = eagle.head_logits(params, cfg, pred, published)
    kl = _masked_mean(jnp.sum(p * (p_log - jax.nn.log_softmax(student, -1)), axis=-1), okj)
    total = total + reg_weight * reg + ce_weight * kl
    metrics.update({f"reg_h{j}": reg, f"kl_h{j}": kl, f"top1_h{j}": _masked_mean(_topk_hits(student, best, 1), okj),
                    f"top5_h{j}": _masked_mean(_topk_hits(student, best, 5), okj)})
  return total / len(preds), metrics


def optax_smooth_l1(x, beta=1.0):
  ax = jnp.abs(x)
  return jnp.where(ax < beta, 0.5 * ax * ax / beta, ax - 0.5 * beta)


def draft_kl_loss(draft_params, frozen, hidden, tokens, mask, *, cfg):
  """KL(target || draft) per position over the output rows in frozen["rows"] (all V, or the reduced draft
  vocabulary, where both distributions are renormalized over the N draft ids). draft_params are the draft's
  layers and final norm; frozen holds the shared embedding; hidden are the target's features (its logits are
  hidden @ rows.T, so no 262k-wide logits are ever stored)."""
  _, h, _ = tfm.forward(dict(draft_params, embed=frozen["embed"]), tokens, cache=None, config=cfg, compute_logits=False)
  student = vocab.project(h, frozen["rows"])
  teacher = jax.lax.stop_gradient(vocab.project(hidden.astype(h.dtype), frozen["rows"]))
  p_log = jax.nn.log_softmax(teacher, -1)
  kl = jnp.sum(jnp.exp(p_log) * (p_log - jax.nn.log_softmax(student, -1)), axis=-1)
  best = jnp.argmax(teacher, -1)
  metrics = {"kl": _masked_mean(kl, mask), "top1_h0": _masked_mean(_topk_hits(student, best, 1), mask),
             "top5_h0": _masked_mean(_topk_hits(student, best, 5), mask)}
  return metrics["kl"], metrics
