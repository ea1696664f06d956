"""Chunked prefill of right-padded prompts into a KV cache, below the decode loop and the proposers.

The target and every cached proposer (the draft model) prefill through here, so no proposer imports the loop.
Prompts are padded to a bucket (powers of two below the chunk, multiples of it above) so compiles stay few.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from spec_jax import sharding
from spec_jax.cache import KVCache
from spec_jax.config import ModelConfig
from spec_jax.models.transformer import forward
from spec_jax.rows import target_features

DEFAULT_CHUNK = 512


def bucket(max_prompt: int, chunk: int = DEFAULT_CHUNK) -> tuple[int, int]:
  """-> (padded prompt length, chunk): one chunk of a power of two up to `chunk`, multiples of `chunk` above."""
  if max_prompt <= chunk:
    p = max(16, 1 << (max(max_prompt, 1) - 1).bit_length())
    return p, p
  return -(-max_prompt // chunk) * chunk, chunk


def _chunk(params, chunk, start, cache, prompt_lens, last_hidden, *, config, impl, feature_layers=(), mesh=None):
  """One chunk at positions start[b]..start[b]+C-1 (int32[B]). Keeps each row's hidden state at its last prompt
  token; returns the chunk's target features too (target_features: the hidden states, or the feature layers')."""
  B, C = chunk.shape
  start = start.astype(jnp.int32)
  positions = start[:, None] + jnp.broadcast_to(jnp.arange(C, dtype=jnp.int32), (B, C))
  cache = cache.replace(lengths=start)
  _, hidden, cache, *layers = forward(params, chunk, positions, cache, config=config, impl=impl,
                                      compute_logits=False, return_layers=feature_layers, mesh=mesh)
  idx = prompt_lens - 1 - start
  here = (idx >= 0) & (idx < C)
  h = jnp.take_along_axis(hidden, jnp.clip(idx, 0, C - 1)[:, None, None], axis=1)[:, 0]
  return cache, jnp.where(here[:, None], h, last_hidden), target_features(hidden, layers[0] if layers else None)


prefill_chunk = sharding.settled(jax.jit(_chunk, static_argnames=("config", "impl", "feature_layers", "mesh"),
                                         donate_argnames=("cache",)))


def prefill(params, tokens: jax.Array, prompt_lens: jax.Array, cache: KVCache, *, config: ModelConfig,
            impl: str = "xla", chunk: int = DEFAULT_CHUNK, return_all: bool = False, feature_layers: tuple = (),
            mesh=None, offsets=None):
  """Right-padded prompts [B, P] (P a multiple of `chunk`) -> (cache with lengths = prompt_lens, hidden[B, D]).

  `offsets` int32[B] (None: zeros): row b's tokens are its positions offsets[b] .. on, after a cached prefix
  whose K/V its pages already hold (a prefix-cache hit); prompt_lens are then whole lengths, prefix included.
  With `return_all`, the target features of every prompt position [B, P, F] come back third (EAGLE reads them):
  the hidden states, or the outputs of `feature_layers` side by side (spec_jax.rows.target_features).
  Inside another jit (slot insert) the jitted chunks simply inline.
  """
  B, P = tokens.shape
  if P % chunk:
    raise ValueError(f"padded prompt length {P} is not a multiple of the prefill chunk {chunk}")
  # numpy, not jnp: a host value every process holds, so a multi-host jit takes it as replicated
  last_hidden = np.zeros((B, config.d_model), params["final_norm"].dtype)
  every = []
  offsets = np.zeros((B,), np.int32) if offsets is None else offsets
  for start in range(0, P, chunk):
    cache, last_hidden, hidden = prefill_chunk(params, tokens[:, start:start + chunk], offsets + np.int32(start),
                                               cache,
                                               prompt_lens, last_hidden, config=config, impl=impl,
                                               feature_layers=tuple(feature_layers) if return_all else (),
                                               mesh=mesh)
    if return_all:
      every.append(hidden)
  # A fresh buffer: callers donate the cache, and prompt_lens must survive that (astype may return it as is).
  cache = cache.replace(lengths=jnp.copy(prompt_lens).astype(jnp.int32))
  if return_all:
    return cache, last_hidden, jnp.concatenate(every, axis=1)
  return cache, last_hidden
