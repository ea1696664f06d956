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

from spec_jax.cache import KVCache
from spec_jax.models.transformer import forward
from spec_jax.proposers import eagle, medusa, vocab


def target_features(target_params, config, tokens):
  """Final-normed hidden states [B, T, D] of the frozen target (no logits: the heads project themselves)."""
  B, T = tokens.shape
  pos = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
  cache = KVCache.init(config, B, T, target_params["final_norm"].dtype)
  _, hidden, _ = forward(target_params, tokens, pos, cache, config=config, compute_logits=False)
  return jax.lax.stop_gradient(hidden)


def _shift(x, n, fill=0):
  """x[:, t + n] at t (filled past the end)."""
  pad = [(0, 0), (0, n)] + [(0, 0)] * (x.ndim - 2)
  return jnp.pad(x[:, n:], pad, constant_values=fill)


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
  return total / K, metrics


def eagle_loss(weights, frozen, hidden, tokens, mask, *, cfg, key=None, noise=0.0, reg_weight=1.0,
               ce_weight=1.0):
  """frozen: {"embed": [V, D], "rows": [N, D]}. Pairs (F_t, tok_{t+1}) -> F_{t+1} and the target's p(t+2)."""
  B, T = tokens.shape
  feats, toks = hidden[:, :-1], tokens[:, 1:]
  if noise and key is not None:  # EAGLE's feature noise: robustness to its own imperfect features
    feats = feats + noise * jax.random.uniform(key, feats.shape, feats.dtype, -1.0, 1.0)
  pos = jnp.broadcast_to(jnp.arange(T - 1, dtype=jnp.int32), (B, T - 1))
  params = dict(weights, embed=frozen["embed"])
  cache = KVCache.init(cfg, B, T - 1, weights["fc"].dtype)
  pred, _ = eagle.eagle_forward(params, cfg, feats.astype(weights["fc"].dtype), toks, pos, cache)
  want = hidden[:, 1:].astype(pred.dtype)
  ok = mask[:, 1:] & mask[:, :-1]
  reg = jnp.mean(optax_smooth_l1(pred - want), axis=-1)
  student = vocab.project(pred, frozen["rows"])
  teacher = jax.lax.stop_gradient(vocab.project(want, frozen["rows"]))
  # KL(teacher || student): the soft CE's gradient, without the teacher's entropy as a floor.
  p_log = jax.nn.log_softmax(teacher, -1)
  ce = jnp.sum(jnp.exp(p_log) * (p_log - jax.nn.log_softmax(student, -1)), axis=-1)
  reg_l, ce_l = _masked_mean(reg, ok), _masked_mean(ce, ok)
  best = jnp.argmax(teacher, axis=-1)
  metrics = {"reg": reg_l, "kl": ce_l, "top1_h0": _masked_mean(_topk_hits(student, best, 1), ok),
             "top5_h0": _masked_mean(_topk_hits(student, best, 5), ok)}
  return reg_weight * reg_l + ce_weight * ce_l, metrics


def optax_smooth_l1(x, beta=1.0):
  ax = jnp.abs(x)
  return jnp.where(ax < beta, 0.5 * ax * ax / beta, ax - 0.5 * beta)


def draft_kl_loss(draft_params, frozen, teacher_logits, tokens, mask, *, cfg):
  """KL(target || draft) per position; draft_params are the draft's trainable weights, frozen holds the rest."""
  B, T = tokens.shape
  params = dict(frozen, **draft_params)
  pos = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
  cache = KVCache.init(cfg, B, T, params["final_norm"].dtype)
  logits, _, _ = forward(params, tokens, pos, cache, config=cfg)
  p_log = jax.nn.log_softmax(teacher_logits, -1)
  q_log = jax.nn.log_softmax(logits, -1)
  kl = jnp.sum(jnp.exp(p_log) * (p_log - q_log), axis=-1)
  best = jnp.argmax(teacher_logits, -1)
  metrics = {"kl": _masked_mean(kl, mask), "top1_h0": _masked_mean(_topk_hits(logits, best, 1), mask),
             "top5_h0": _masked_mean(_topk_hits(logits, best, 5), mask)}
  return metrics["kl"], metrics
