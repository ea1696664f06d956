"""The autoregressive drafting chain shared by the draft model and EAGLE: draw a token, feed it, repeat."""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp

from spec_jax.proposers.base import Draft


def draft_chain(draw: Callable, advance: Callable, carry: Any, key: jax.Array, k: int) -> tuple[Draft, Any]:
  """Draft k tokens. draw(carry, key) -> (token int32[B], q float32[B, V]) from the carry's current prediction;
  advance(carry, token) -> carry, which feeds the token and predicts the next one. The k-th token is drawn but
  not fed (nothing would read its prediction). -> (Draft [B, k] with q [B, k, V], final carry)."""
  keys = jax.random.split(key, k)

  def step(carry, key):
    tok, q = draw(carry, key)
    return advance(carry, tok), (tok, q)

  carry, (toks, qs) = jax.lax.scan(step, carry, keys[:k - 1])
  last_tok, last_q = draw(carry, keys[k - 1])
  tokens = jnp.concatenate([jnp.swapaxes(toks, 0, 1), last_tok[:, None]], axis=1)
  probs = jnp.concatenate([jnp.swapaxes(qs, 0, 1), last_q[:, None]], axis=1)
  return Draft(tokens=tokens.astype(jnp.int32), probs=probs), carry
