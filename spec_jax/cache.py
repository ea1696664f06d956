"""KV cache per slot: one buffer per layer, per-row committed lengths.

A forward writes its T new entries at slots lengths[b] .. lengths[b]+T-1 without moving `lengths`; the caller
commits by advancing `lengths` (by T for prefill/decode, by accepted+1 after a verify). Entries past a row's
length are stale: attention masks them and the next forward overwrites them. Rollback copies nothing.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from spec_jax.config import ModelConfig


@struct.dataclass
class KVCache:
  k: jax.Array  # [L, B, S, Hkv, D]
  v: jax.Array  # [L, B, S, Hkv, D]
  lengths: jax.Array  # int32[B], committed tokens per row (slot index == position)

  @classmethod
  def init(cls, config: ModelConfig, batch: int, max_len: int, dtype=jnp.float32) -> "KVCache":
    shape = (config.num_layers, batch, max_len, config.num_kv_heads, config.head_dim)
    return cls(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype), jnp.zeros((batch,), jnp.int32))

  @property
  def max_len(self) -> int:
    return self.k.shape[2]

  @property
  def batch(self) -> int:
    return self.k.shape[1]

  def advance(self, n: jax.Array) -> "KVCache":
    """Commit n[B] more tokens per row."""
    return self.replace(lengths=self.lengths + n.astype(jnp.int32))

  def nbytes(self) -> int:
    return self.k.size * self.k.dtype.itemsize * 2
