"""The paged KV cache: a pool of pages of `block_size` tokens, a page table per row, per-row committed lengths.

Row b's logical slot s (== its position) lives in page pages[b, s // block_size] at offset s % block_size. A
contiguous cache is one page table (row b owns pages 1 + b * P .. in order); a serving pool hands pages out
through serve/block_manager.py. Page 0 (of each data shard's share of the pool) is the null page: unassigned table
entries point at it, and writes that no row will read (free rows, positions past a row's reservation or capacity)
land there, so a write never reaches another row's page.

A forward writes its T new entries at slots lengths[b] .. lengths[b]+T-1 without moving `lengths`; the caller
commits by advancing `lengths` (by T for prefill/decode, by accepted+1 after a verify). Entries past a row's
length are stale: attention masks them (and zeroes them, so a stale NaN cannot leak through 0 * NaN) and the next
forward overwrites them. Rollback copies nothing.

Every cache of a decode state (the target's, the draft model's, the EAGLE layer's) shares one page table and one
page count: a page id holds that many tokens of each, so what a proposer holds is part of every page the scheduler
hands out.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from jax import lax
from jax.sharding import PartitionSpec as P

from spec_jax.config import ModelConfig

DEFAULT_BLOCK_SIZE = 16
NULL_PAGE = 0  # local id of each data shard's null page


def contiguous_table(batch: int, pages_per_seq: int, shards: int = 1) -> np.ndarray:
  """int32[batch, pages_per_seq]: row b owns its own run of pages, after its data shard's null page (global ids;
  shard s holds pages s * (1 + rows * P) .. of the pool, rows = batch // shards)."""
  rows = batch // shards
  per_shard = contiguous_pages(batch, pages_per_seq, shards) // shards
  b = np.arange(batch)
  first = (b // rows) * per_shard + 1 + (b % rows) * pages_per_seq
  return (first[:, None] + np.arange(pages_per_seq)[None, :]).astype(np.int32)


def contiguous_pages(batch: int, pages_per_seq: int, shards: int = 1) -> int:
  return shards * (1 + batch // shards * pages_per_seq)


@struct.dataclass
class KVCache:
  """k, v [L, N, Hkv, block_size, D] in the activation dtype (L layers, N pages of the pool; heads before the
  page's tokens: on TPU the last two dims are the tiled ones, and (block, D) tiles cleanly for any number of KV
  heads); lengths int32[B] committed entries per row; pages int32[B, pages_per_seq] the page table (global page
  ids; row b's pages lie in its data shard's share of the pool)."""

  k: jax.Array
  v: jax.Array
  lengths: jax.Array
  pages: jax.Array

  @classmethod
  def init(cls, config: ModelConfig, batch: int, max_len: int, dtype=jnp.float32, *,
           block_size: int = DEFAULT_BLOCK_SIZE, num_pages: int | None = None, pages=None,
           shards: int = 1) -> "KVCache":
    """An empty cache of rows of `max_len` slots (rounded up to whole pages). Without `pages`, the contiguous
    table over a pool of exactly the rows' pages (plus each shard's null page); with `pages` int32[batch, P] and
    `num_pages`, that table over that pool."""
    pps = -(-max_len // block_size)
    if pages is None:
      pages = contiguous_table(batch, pps, shards)
      num_pages = contiguous_pages(batch, pps, shards) if num_pages is None else num_pages
    elif num_pages is None:
      raise ValueError("a page table needs its pool's num_pages")
    pages = jnp.asarray(pages, jnp.int32)
    if pages.shape != (batch, pps):
      raise ValueError(f"page table {pages.shape} is not [batch, pages_per_seq] = {(batch, pps)}")
    shape = (config.num_layers, int(num_pages), config.num_kv_heads, block_size, config.head_dim)
    return cls(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype), jnp.zeros((batch,), jnp.int32), pages)

  @property
  def block_size(self) -> int:
    return self.k.shape[3]

  @property
  def num_pages(self) -> int:
    return self.k.shape[1]

  @property
  def max_len(self) -> int:
    return self.pages.shape[1] * self.block_size

  def advance(self, n: jax.Array) -> "KVCache":
    """Commit n[B] more tokens per row."""
    return self.replace(lengths=self.lengths + n.astype(jnp.int32))

  def nbytes(self) -> int:
    return self.k.size * self.k.dtype.itemsize * 2

  def page_bytes(self) -> int:
    """Bytes one page holds (K and V, every layer)."""
    return self.nbytes() // self.num_pages

  # ---- reads and writes through the page table (inside jit) ----

  def layer_view(self, layer, mesh=None):
    """Layer `layer` (traced) as each row's logical cache: (k, v) [B, Hkv, S, D], S = max_len. Slots at or past
    a row's length are zero (they may hold another request's K/V, or NaN in the poisoned-page tests)."""
    return gather_rows(self.k, self.v, self.pages, self.lengths, layer, mesh)

  def write(self, k_new, v_new, mesh=None) -> "KVCache":
    """k_new, v_new [L, B, T, Hkv, D] written at slots lengths[b] .. lengths[b]+T-1 of each row, through its
    pages (slots past its table go to the null page); `lengths` does not move."""
    k, v = scatter_rows(self.k, self.v, k_new, v_new, self.pages, self.lengths, mesh)
    return self.replace(k=k, v=v)

  def insert_row(self, row: "KVCache", slot) -> "KVCache":
    """Take a one-row view's pool (a slot insert prefilled straight into row `slot`'s pages of this very pool,
    spec_jax/slots.py) and its length; no other row's pages were written."""
    return self.replace(k=row.k, v=row.v, lengths=self.lengths.at[slot].set(row.lengths[0]))

  def with_page_row(self, slot, pages_row) -> "KVCache":
    return self.replace(pages=self.pages.at[slot].set(pages_row.astype(jnp.int32)))


def _shard_local(pages, pool_pages: int, shards: int, index):
  """Global page ids of one data shard's rows -> ids into its share of the pool."""
  return pages - index * (pool_pages // shards) if shards > 1 else pages


def _data_shards(mesh, k, pages):
  if mesh is None or "data" not in mesh.shape:
    return 1
  d = mesh.shape["data"]
  return d if d > 1 and k.shape[1] % d == 0 and pages.shape[0] % d == 0 else 1


def _per_shard(fn, mesh, k, pages, *, pool_args, row_args, out_pool: bool, out_rows: int = 0):
  """Run fn(pools..., pages_local, rows...) per data shard (shard_map over the pool's layout) where the pool is
  split over `data`; as is otherwise (the partitioner places it)."""
  shards = _data_shards(mesh, k, pages)
  if shards == 1:
    return fn(*pool_args, pages, *row_args)
  from spec_jax.sharding import cache_spec
  spec = cache_spec(k.shape, mesh)
  rows, heads = spec[1], spec[2]
  n_pool = k.shape[1]

  def local(*args):
    pools, pg, rest = args[:len(pool_args)], args[len(pool_args)], args[len(pool_args) + 1:]
    index = lax.axis_index("data")
    return fn(*pools, _shard_local(pg, n_pool, shards, index), *rest)

  row_spec = lambda a: P(rows, *([None] * (a.ndim - 1)))
  in_specs = (spec,) * len(pool_args) + (P(rows, None),) + tuple(
      P(None, rows, None, heads, None) if a.ndim == 5 else row_spec(a) for a in row_args)
  if out_pool:
    out_specs = (spec,) * len(pool_args)
  else:
    out_specs = tuple(P(rows, heads, None, None) for _ in range(out_rows))
  return jax.shard_map(local, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)(
      *pool_args, pages, *row_args)


def gather_rows(k_pool, v_pool, pages, lengths, layer, mesh=None):
  """-> (k, v) [B, Hkv, S, D]: layer `layer` of each row's pages in order, zero at slots >= lengths[b]."""

  def fn(kp, vp, pg, lengths):
    B, npp = pg.shape
    bs = kp.shape[3]

    def one(pool):
      lay = lax.dynamic_index_in_dim(pool, layer, 0, keepdims=False)  # [N, Hkv, bs, D]
      g = jnp.take(lay, pg, axis=0)  # [B, P, Hkv, bs, D]
      g = g.transpose(0, 2, 1, 3, 4).reshape(B, g.shape[2], npp * bs, g.shape[4])
      live = jnp.arange(npp * bs, dtype=jnp.int32)[None, :] < lengths[:, None]
      return jnp.where(live[:, None, :, None], g, jnp.zeros((), g.dtype))

    return one(kp), one(vp)

  return _per_shard(fn, mesh, k_pool, pages, pool_args=(k_pool, v_pool), row_args=(lengths,), out_pool=False,
                    out_rows=2)


def _address(pages, slots, bs):
  """Logical slots int32[B, T] -> (page, offset) int32[B, T] through the table; slots outside it (or < 0) -> the
  null page."""
  npp = pages.shape[1]
  blk = slots // bs
  inside = (slots >= 0) & (blk < npp)
  page = jnp.take_along_axis(pages, jnp.clip(blk, 0, npp - 1), axis=1)
  return jnp.where(inside, page, NULL_PAGE), jnp.where(inside, slots % bs, 0)


def scatter_rows(k_pool, v_pool, k_new, v_new, pages, lengths, mesh=None):
  """k_new, v_new [L, B, T, Hkv, D] -> pools with token t of row b at its slot lengths[b] + t.

  One dynamic_update_slice per token (B * T of them, in a loop): each updates the pool in place, where XLA:CPU
  copies the whole buffer for a scatter."""

  def fn(kp, vp, pg, kn, vn, lengths):
    L, B, T, H, D = kn.shape
    page, off = _address(pg, lengths[:, None] + jnp.arange(T, dtype=jnp.int32)[None, :], kp.shape[3])
    # The new tokens go to the pool's head-major order before the loop: swapped token by token inside it, XLA:TPU
    # carried the pool with its layers minor and copied it in and out of every loop call.
    kn, vn = jnp.swapaxes(kn, 2, 3), jnp.swapaxes(vn, 2, 3)  # [L, B, H, T, D]

    def one(i, pools):
      b, t = i // T, i % T
      out = []
      for pool, new in zip(pools, (kn, vn)):
        tok = lax.dynamic_slice(new, (0, b, 0, t, 0), (L, 1, H, 1, D))
        out.append(lax.dynamic_update_slice(pool, tok.astype(pool.dtype), (0, page[b, t], 0, off[b, t], 0)))
      return tuple(out)

    return lax.fori_loop(0, B * T, one, (kp, vp))

  return _per_shard(fn, mesh, k_pool, pages, pool_args=(k_pool, v_pool), row_args=(k_new, v_new, lengths),
                    out_pool=True)


def pool_bytes(tree, shape=lambda a: a.shape) -> tuple[int, int]:
  """-> (bytes, pages) of the K and V pools of every KVCache in a pytree (a decode state, a proposer state; real
  or abstract arrays). `shape` gives the shape counted (a chip's shard of a sharded pool); pages: the first pool's
  (every cache of a state shares one table)."""
  caches = [x for x in jax.tree_util.tree_leaves(tree, is_leaf=lambda x: isinstance(x, KVCache))
            if isinstance(x, KVCache)]
  nbytes = sum(2 * int(np.prod(shape(c.k))) * np.dtype(c.k.dtype).itemsize for c in caches)
  return nbytes, (int(shape(caches[0].k)[1]) if caches else 0)
