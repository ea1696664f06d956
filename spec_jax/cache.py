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
  """k, v [L, B, Hkv, S, D] in the activation dtype (L layers, B slots, S capacity); lengths int32[B] committed
  entries per row (slot index == position). Heads before slots: on TPU the last two dims are the tiled ones, and
  (S, D) tiles cleanly for any number of KV heads (with [S, Hkv, D] and one KV head, the (1, D) tiles forced a
  re-layout copy of the whole cache in and out of every compiled loop)."""

  k: jax.Array
  v: jax.Array
  lengths: jax.Array

  @classmethod
  def init(cls, config: ModelConfig, batch: int, max_len: int, dtype=jnp.float32) -> "KVCache":
    shape = (config.num_layers, batch, config.num_kv_heads, max_len, config.head_dim)
    return cls(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype), jnp.zeros((batch,), jnp.int32))

  @property
  def max_len(self) -> int:
    return self.k.shape[3]

  def advance(self, n: jax.Array) -> "KVCache":
    """Commit n[B] more tokens per row."""
    return self.replace(lengths=self.lengths + n.astype(jnp.int32))

  def insert_row(self, row: "KVCache", slot) -> "KVCache":
    """Write a 1-row cache of the same capacity into row `slot` (traced); no other row is touched."""
    put = lambda full, r: jax.lax.dynamic_update_index_in_dim(full, r.astype(full.dtype), slot, 1)
    return KVCache(put(self.k, row.k), put(self.v, row.v),
                   jax.lax.dynamic_update_index_in_dim(self.lengths, row.lengths, slot, 0))

  def nbytes(self) -> int:
    return self.k.size * self.k.dtype.itemsize * 2
