"""Test helpers: logical per-row caches <-> paged KVCaches with shuffled page tables (no row's pages contiguous)."""

import jax.numpy as jnp
import numpy as np

from spec_jax.cache import KVCache


def shuffled_table(rng, batch: int, pages_per_seq: int, spare: int = 3) -> tuple[np.ndarray, int]:
  """-> (table int32[batch, pages_per_seq], num_pages): every row's pages drawn at random from a pool with `spare`
  extra pages, page 0 (the null page) never handed out."""
  num_pages = 1 + batch * pages_per_seq + spare
  ids = rng.permutation(np.arange(1, num_pages))[:batch * pages_per_seq]
  return ids.reshape(batch, pages_per_seq).astype(np.int32), num_pages


def to_paged(k, v, lengths, block_size: int, rng, fill=0.0) -> KVCache:
  """k, v logical [L, B, H, S, D] -> a KVCache with a shuffled table (S a multiple of block_size); pages no row
  owns hold `fill` (NaN: any read of them shows)."""
  L, B, H, S, D = k.shape
  pps = S // block_size
  table, n = shuffled_table(rng, B, pps)
  pools = []
  for x in (k, v):
    pool = np.full((L, n, H, block_size, D), fill, np.float32)
    for b in range(B):
      for j in range(pps):
        pool[:, table[b, j]] = x[:, b, :, j * block_size:(j + 1) * block_size]
    pools.append(jnp.asarray(pool))
  return KVCache(pools[0], pools[1], jnp.asarray(lengths, jnp.int32), jnp.asarray(table))


def logical(pool, table) -> np.ndarray:
  """A pool [L, N, H, bs, D] read through table [B, P] -> [L, B, H, P * bs, D]."""
  pool, table = np.asarray(pool), np.asarray(table)
  L, _, H, bs, D = pool.shape
  g = pool[:, table]  # [L, B, P, H, bs, D]
  return g.transpose(0, 1, 3, 2, 4, 5).reshape(L, table.shape[0], H, table.shape[1] * bs, D)
