"""The autoregressive drafting chain shared by the draft model and EAGLE: draw a token, feed it, repeat."""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp

from spec_jax import streams
from spec_jax.proposers.base import Draft


def draft_chain(draw: Callable, advance: Callable, carry: Any, key: jax.Array, k: int) -> tuple[Draft, Any]:
  """Draft k tokens. draw(carry, key) -> (token int32[B], q float32[B, V]) from the carry's current prediction;
  advance(carry, token) -> carry, which feeds the token and predicts the next one. The k-th token is drawn but
  not fed (nothing would read its prediction). -> (Draft [B, k] with q [B, k, V], final carry).

  Unrolled (k is small and static), not a lax.scan: inside a loop XLA:CPU hoists loop-invariant converts out
  of it, so a scan over a step that gathers from the bfloat16 embedding converted the whole 262k-row table to
  float32 (670 MB) on every propose, and the carry's caches were copied each iteration (benchmarks/probes/draft_cost.py,
  docs/benchmark-log.md section 13)."""
  # key: typed keys [B, k], draft i's row streams (spec_jax/decode.draft_keys); or one key, split per draft.
  keys = jax.random.split(key, k) if streams.is_single(key) else [key[:, i] for i in range(k)]
  toks, qs = [], []
  for i in range(k):
    tok, q = draw(carry, keys[i])
    toks.append(tok)
    qs.append(q)
    if i < k - 1:
      carry = advance(carry, tok)
  return Draft(tokens=jnp.stack(toks, axis=1).astype(jnp.int32), probs=jnp.stack(qs, axis=1)), carry
