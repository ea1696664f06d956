"""Exact verification of a chain of drafted tokens (speculative sampling, Leviathan et al. 2023 / Chen et al. 2023).

`verify_chain` is fully vectorized over rows and draft positions: no Python or lax loop over positions. The first
rejection is found with a cumulative product of the per-position accept flags, and only one distribution per row
(the residual at the first rejection, or the target at position k for the bonus token) is sampled from.

Output convention: row b commits `tokens[b, :num_accepted[b] + 1]`, i.e. the accepted drafts followed by one
correction (at the first rejection) or bonus token (all k drafts accepted). Every position after that holds the
pad value 0.
"""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp
from jax import lax

from spec_jax import sampling
from spec_jax.config import SamplingParams

PAD = 0


def verify_chain(
    target_logits: jax.Array,
    draft_tokens: jax.Array,
    draft_probs: Optional[jax.Array],
    key: jax.Array,
    params: SamplingParams,
    *,
    candidates: int = sampling.DEFAULT_CANDIDATES,
) -> tuple[jax.Array, jax.Array]:
  """Verify k drafted tokens per row against the target model.

  Args:
    target_logits: [B, k+1, V] raw target logits; position i scores the token after the prefix + drafts[:i]. They
      are warped by `params` (temperature, top-k, top-p) into the target distribution p.
    draft_tokens: int32 [B, k]. A negative token means "no draft here": it is never accepted, so nothing after it
      is either, and the token at its position is sampled from p (greedy: the argmax).
    draft_probs: [B, k, V] the probabilities q the drafter actually sampled from, or None for a deterministic
      drafter (q one-hot on the drafted token).
    key: PRNG key.
    params: per-row SamplingParams [B]. Greedy rows (temperature 0) accept while the draft equals the target argmax
      and commit the argmax after that; sampling rows accept draft x_i with probability min(1, p_i(x_i)/q_i(x_i))
      and, at the first rejection, sample from normalize(max(p_i - q_i, 0)) (falling back to p_i if that is all
      zero). Rows of both kinds mix in one batch.
    candidates: top-k candidates of the warp's fast path (speed only, see spec_jax.sampling).

  Returns:
    tokens int32 [B, k+1] (PAD after the committed ones) and num_accepted int32 [B] in [0, k].
  """
  b, k1, v = target_logits.shape
  k = k1 - 1
  if draft_tokens.shape != (b, k):
    raise ValueError(f"draft_tokens has shape {draft_tokens.shape}, expected {(b, k)}")
  if draft_probs is not None and draft_probs.shape != (b, k, v):
    raise ValueError(f"draft_probs has shape {draft_probs.shape}, expected {(b, k, v)}")

  draft_tokens = draft_tokens.astype(jnp.int32)
  valid = draft_tokens >= 0
  drafts = jnp.clip(draft_tokens, 0, v - 1)  # safe gather index; `valid` masks the clamped ones
  pos = lax.broadcasted_iota(jnp.int32, (b, k1), 1)
  greedy = params.temperature <= 0

  def commit(num_accepted, last_token):
    drafts_ext = jnp.concatenate([drafts, jnp.zeros((b, 1), jnp.int32)], axis=1)
    tokens = jnp.where(pos < num_accepted[:, None], drafts_ext,
                       jnp.where(pos == num_accepted[:, None], last_token[:, None], PAD))
    return tokens.astype(jnp.int32), num_accepted.astype(jnp.int32)

  def first_rejection(accept):
    return jnp.sum(jnp.cumprod(accept.astype(jnp.int32), axis=1), axis=1).astype(jnp.int32)

  def at(a, idx):  # a[B, k+1, ...] at the per-row position idx[B]
    return jnp.take_along_axis(a, idx.reshape((b, 1) + (1,) * (a.ndim - 2)), axis=1)[:, 0]

  def all_greedy():
    target = sampling.argmax(target_logits)  # [B, k+1]
    n = first_rejection(valid & (drafts == target[:, :k]))
    return commit(n, at(target, n))

  def general():
    k_accept, k_resid = jax.random.split(key)
    # The warped target at every position, as per-position statistics: nothing of size V is materialized here.
    x, t, top_k, top_p = sampling.rows(target_logits, params)
    w = sampling.warp_rows(x, t, top_k, top_p, candidates=candidates, with_lse=True)
    w = jax.tree.map(lambda a: a.reshape(b, k1), w)  # fields [B, k+1]
    target = w.i_last  # the argmax, for greedy rows

    # p_i(x_i) at the drafts.
    # (Gathered from the full logits: slicing [:, :k] first would copy B * k * V floats.)
    d_ext = jnp.concatenate([drafts, jnp.zeros((b, 1), jnp.int32)], axis=1)
    x_d = jnp.take_along_axis(target_logits, d_ext[..., None], axis=-1)[:, :k, 0]  # [B, k]
    w_d = jax.tree.map(lambda a: a[:, :k].reshape(-1), w)
    p_x = sampling.probs_at(x_d.reshape(-1), drafts.reshape(-1), w_d).reshape(b, k)
    if draft_probs is None:
      q_x = jnp.ones_like(p_x)
    else:
      q_x = jnp.take_along_axis(draft_probs, drafts[..., None], axis=-1)[..., 0].astype(jnp.float32)
    u = jax.random.uniform(k_accept, (b, k), jnp.float32)  # [0, 1)
    # u < p/q without the division: q = 0 < p accepts, p = 0 rejects.
    sample_accept = u * q_x < p_x
    n = first_rejection(valid & jnp.where(greedy[:, None], drafts == target[:, :k], sample_accept))

    # The distribution at position n: residual max(p - q, 0) after a rejected draft, p itself for the bonus
    # token (n == k) or after a missing draft.
    vocab = lax.broadcasted_iota(jnp.int32, (b, v), 1)
    p_n = sampling.probs_at(at(target_logits, n), vocab, jax.tree.map(lambda a: at(a, n), w))  # [B, V]
    if k == 0:
      residual = p_n
    else:
      n_c = jnp.minimum(n, k - 1)
      rejected = ((n < k) & at(valid, n_c))[:, None]
      if draft_probs is None:
        residual = jnp.where(rejected & (vocab == at(drafts, n_c)[:, None]), 0.0, p_n)
      else:
        residual = jnp.where(rejected, jnp.maximum(p_n - at(draft_probs, n_c).astype(jnp.float32), 0.0), p_n)
      residual = jnp.where(jnp.sum(residual, axis=-1, keepdims=True) > 0, residual, p_n)
    last = sampling.categorical_from_weights(k_resid, residual)
    last = jnp.where(greedy, at(target, n), last)
    return commit(n, last)

  return lax.cond(jnp.all(greedy), all_greedy, general)
