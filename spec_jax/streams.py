"""Per-request random streams: every random draw of a row is keyed by (the row's own key, the absolute position
of the token it decides, what it is for), never by a batch-wide key.

So a seeded request draws the same numbers alone, beside any other requests, after being re-inserted with its
committed tokens as prompt (the paged cache's preemption), and whatever k the step drafted. The verifier uses
that (spec_jax/verify.py): against deterministic drafts the token at position p is always the target's own draw
with the TOKEN key of p, so a seeded request's output does not depend on the drafts, the draft length or whether
speculation is on (the same tokens as plain decoding with the same seed).

The state keeps each row's key as raw key data (uint32 [B, 2]: shards and writes like any per-row array);
`rows` turns it into typed keys, `at` derives the key of a (position, purpose).
"""

from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

# What a draw is for. A position's draws for different purposes are independent streams.
TOKEN = 0  # the target's token at the position (plain sampling, the first and bonus tokens, the coupled draw)
DRAFT = 1  # a drafter's sampled token at the position
ACCEPT = 2  # the acceptance coins of sampled drafts at the position
RESIDUAL = 3  # the draw from the residual after a rejected sampled draft


def seed_key(seed: int) -> np.ndarray:
  """Host-side: the raw key data (uint32 [2]) of a request's seed (a constant even while a caller traces, e.g.
  the server sizing its page pool with jax.eval_shape of empty_state)."""
  with jax.ensure_compile_time_eval():
    return np.asarray(jax.random.key_data(jax.random.key(int(seed))), np.uint32)


def seed_keys(seeds: Sequence[int]) -> np.ndarray:
  """Host-side: uint32 [B, 2], one row key per seed."""
  return np.stack([seed_key(s) for s in seeds]) if len(seeds) else np.zeros((0, 2), np.uint32)


def batch_keys(seed: int, n: int) -> np.ndarray:
  """Host-side: uint32 [n, 2], n independent row keys from one seed (row i: the seed's key folded with i), so
  batches of different seeds never share a stream."""
  base = jax.random.key(int(seed))
  keys = jax.vmap(lambda i: jax.random.fold_in(base, i))(jnp.arange(n, dtype=jnp.uint32))
  return np.asarray(jax.random.key_data(keys), np.uint32)


def is_single(key: jax.Array) -> bool:
  """A single key (typed, shape (); or raw data, shape (2,)) rather than an array of keys."""
  typed = jnp.issubdtype(key.dtype, jax.dtypes.prng_key)
  return key.ndim == (0 if typed else 1)


def rows(keys: jax.Array, n: int) -> jax.Array:
  """Typed keys [n]: one per row. A single key is split (a stream for a batch of independent rows: tests and
  one-off calls); raw key data [n, 2] is wrapped; typed keys pass through."""
  if is_single(keys):
    return jax.random.split(keys if jnp.issubdtype(keys.dtype, jax.dtypes.prng_key)
                            else jax.random.wrap_key_data(keys), n)
  if not jnp.issubdtype(keys.dtype, jax.dtypes.prng_key):
    keys = jax.random.wrap_key_data(keys.reshape(-1, 2).astype(jnp.uint32))
  return keys.reshape(n)


def at(keys: jax.Array, positions: jax.Array, purpose: int) -> jax.Array:
  """Typed keys of positions' shape [B, ...]: row b's key at each position for `purpose`. keys: typed [B]."""
  pos = jnp.asarray(positions).astype(jnp.uint32)
  k = jnp.broadcast_to(keys.reshape(keys.shape + (1,) * (pos.ndim - 1)), pos.shape)
  derive = lambda key, p: jax.random.fold_in(jax.random.fold_in(key, p), purpose)
  return jax.vmap(derive)(k.reshape(-1), pos.reshape(-1)).reshape(pos.shape)
