"""The paged KV cache: a pool of pages of `block_size` tokens, a page table per row, per-row committed lengths.

Row b's logical slot s (== its position) lives in page pages[b, s // block_size] at offset s % block_size. A
contiguous cache is one page table (row b owns pages 1 + b * P .. in order); a serving pool hands pages out
through serve/engine/block_manager.py. Page 0 (of each data shard's share of the pool) is the null page: unassigned table
entries point at it, and writes that no row will read (free rows, positions past a row's reservation or capacity)
land there, so a write never reaches another row's page.

A forward writes its T new entries at slots lengths[b] .. lengths[b]+T-1 without moving `lengths`; the caller
commits by advancing `lengths` (by T for prefill/decode, by accepted+1 after a verify). Entries past a row's
length are stale: attention masks them (and zeroes them, so a stale NaN cannot leak through 0 * NaN) and the next
forward overwrites them. Rollback copies nothing.

Every cache of a decode state (the target's, the draft model's, the EAGLE layer's) shares one page table and one
page count: a page id holds that many tokens of each, so what a proposer holds is part of every page the scheduler
hands out.

An 8-bit cache (--kv_cache_dtype fp8 / fp8_e5m2 / int8) stores K and V in that dtype with a float32 scale per token
and KV head beside the pool, pages last ([L, Hkv, block_size, N]: on TPU the last two dims are the tiled ones, and
(block, pages) tiles (8, 128) with no padding, where (Hkv, block) = (1, 16) on a chip of Llama-3 8B over model:8
padded 8x and XLA copied the whole scale pool into the kernel's layout at every call). A token's scale depends on that token alone, so a page
filled over several calls is the same as one written at once, and the new tokens of a forward attend to each other
quantized exactly as they will be read back from the pool (`fake_quant`): plain decoding, a verified chain and a
tree all compute the same quantized target, so speculation stays exact. An int8 cache of a qk-norm model holds K
over its fixed channel gain (`key_channel_gain`), the query carrying the gain instead.
"""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from jax import lax
from jax.sharding import PartitionSpec as P

from spec_jax.config import ModelConfig
from spec_jax.sharding import CacheLeaf, cache_spec

DEFAULT_BLOCK_SIZE = 16
NULL_PAGE = 0  # local id of each data shard's null page

# --kv_cache_dtype (vLLM's names) -> the pool's storage dtype; None: the activation dtype.
KV_CACHE_DTYPES = {"auto": None, "fp8": jnp.float8_e4m3fn, "fp8_e4m3": jnp.float8_e4m3fn,
                   "fp8_e5m2": jnp.float8_e5m2, "int8": jnp.int8}


def kv_storage_dtype(name: str):
  """The pool dtype of a --kv_cache_dtype value (None for 'auto'); an unknown value is an error."""
  if name not in KV_CACHE_DTYPES:
    raise ValueError(f"unknown --kv_cache_dtype {name!r}; choose one of {tuple(KV_CACHE_DTYPES)}")
  return KV_CACHE_DTYPES[name]


def _qmax(dtype) -> float:
  dtype = jnp.dtype(dtype)
  return float(jnp.iinfo(dtype).max if jnp.issubdtype(dtype, jnp.integer) else jnp.finfo(dtype).max)


def quantize(x, dtype):
  """x [..., D] -> (q [..., D] in `dtype`, float32 scale [...]): one scale per vector (a token's K or V of one KV
  head), its largest magnitude mapped to the dtype's largest value; x ~ q * scale."""
  x = x.astype(jnp.float32)
  amax = jnp.max(jnp.abs(x), axis=-1)
  scale = jnp.where(amax > 0, amax / _qmax(dtype), 1.0)
  y = jnp.clip(x / scale[..., None], -_qmax(dtype), _qmax(dtype))
  if jnp.issubdtype(jnp.dtype(dtype), jnp.integer):
    y = jnp.round(y)
  return y.astype(dtype), scale


def dequantize(q, scale, dtype):
  return (q.astype(jnp.float32) * scale[..., None]).astype(dtype)


def fake_quant(x, kv_dtype: str):
  """x as an 8-bit cache of `kv_dtype` gives it back when read (x itself for 'auto'): what the new tokens of a
  forward attend to, so that they see each other as later forwards will see them in the pool."""
  store = kv_storage_dtype(kv_dtype)
  return x if store is None else dequantize(*quantize(x, store), x.dtype)


def smooths_keys(kv_dtype: str) -> bool:
  """Whether K goes into this cache over its channel gain (`key_channel_gain`): int8 only. int8's grid is uniform,
  so one token's largest channel sets the step for all of them; a float8 grid is relative and gains nothing
  (Gemma 3 270M, benchmarks/probes/kv_key_smoothing.py: e4m3's KL 0.0024 -> 0.0029)."""
  store = kv_storage_dtype(kv_dtype)
  return store is not None and jnp.issubdtype(jnp.dtype(store), jnp.integer)


def key_channel_gain(k_norm):
  """The fixed per-channel gain [D] of a qk-norm model's K (its k-norm weight, whose channels span 0 to ~24 in
  Gemma 3): an int8 cache stores K / gain, and the query is multiplied by it, so q.k is unchanged while the stored
  channels are of one size and a token's scale no longer follows its few largest channels (SmoothQuant's trick,
  from the weights alone: no calibration, the same for every request, so pages stay shareable). RoPE rotates
  channel i with i + D/2, so both get the RMS of their two gains; a pair of zero gains gets 1."""
  g = jnp.abs(k_norm.astype(jnp.float32))
  half = g.shape[-1] // 2
  pair = jnp.sqrt((g[..., :half] ** 2 + g[..., half:] ** 2) / 2)
  pair = jnp.where(pair > 0, pair, 1.0)
  return jnp.concatenate([pair, pair], axis=-1)


def scale_shape(pool_shape) -> tuple:
  """A pool's [..., N, Hkv, block, D] -> its scales' [..., Hkv, block, N] (pages last: see the module's note)."""
  *lead, n, h, bs, _ = pool_shape
  return (*lead, h, bs, n)


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
class KVCache(CacheLeaf):
  """k, v [L, N, Hkv, block_size, D] in the activation dtype (L layers, N pages of the pool; heads before the
  page's tokens: on TPU the last two dims are the tiled ones, and (block, D) tiles cleanly for any number of KV
  heads); lengths int32[B] committed entries per row; pages int32[B, pages_per_seq] the page table (global page
  ids; row b's pages lie in its data shard's share of the pool).

  An 8-bit cache (kv_dtype != 'auto'): k, v in the storage dtype, k_scale, v_scale float32 [L, Hkv, block_size, N]
  (one per token and KV head, pages last: `scale_shape`), act_dtype the dtype every reader dequantizes to.
  """

  k: jax.Array
  v: jax.Array
  lengths: jax.Array
  pages: jax.Array
  k_scale: Optional[jax.Array] = None
  v_scale: Optional[jax.Array] = None
  kv_dtype: str = struct.field(pytree_node=False, default="auto")
  act_dtype: str = struct.field(pytree_node=False, default="")

  @classmethod
  def init(cls, config: ModelConfig, batch: int, max_len: int, dtype=jnp.float32, *,
           block_size: int = DEFAULT_BLOCK_SIZE, num_pages: int | None = None, pages=None,
           shards: int = 1, kv_dtype: str = "auto") -> "KVCache":
    """An empty cache of rows of `max_len` slots (rounded up to whole pages). Without `pages`, the contiguous
    table over a pool of exactly the rows' pages (plus each shard's null page); with `pages` int32[batch, P] and
    `num_pages`, that table over that pool. `kv_dtype`: --kv_cache_dtype ('auto': `dtype`)."""
    store = kv_storage_dtype(kv_dtype)
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
    lengths = jnp.zeros((batch,), jnp.int32)
    if store is None:
      return cls(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype), lengths, pages)
    scale = lambda: jnp.ones(scale_shape(shape), jnp.float32)
    return cls(jnp.zeros(shape, store), jnp.zeros(shape, store), lengths, pages, scale(), scale(), kv_dtype,
               jnp.dtype(dtype).name)

  @property
  def quantized(self) -> bool:
    return self.k_scale is not None

  def pools(self) -> tuple:
    """The arrays a page holds: (k, v), and (k_scale, v_scale) for an 8-bit cache."""
    return (self.k, self.v) + ((self.k_scale, self.v_scale) if self.quantized else ())

  def with_pools(self, pools) -> "KVCache":
    k, v, *scales = pools
    return self.replace(k=k, v=v, **(dict(k_scale=scales[0], v_scale=scales[1]) if scales else {}))

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
    return sum(a.size * a.dtype.itemsize for a in self.pools())

  def page_bytes(self) -> int:
    """Bytes one page holds (K and V, every layer; their scales in an 8-bit cache)."""
    return self.nbytes() // self.num_pages

  # ---- reads and writes through the page table (inside jit) ----

  def layer_view(self, layer, mesh=None):
    """Layer `layer` (traced) as each row's logical cache: (k, v) [B, Hkv, S, D], S = max_len. Slots at or past
    a row's length are zero (they may hold another request's K/V, or NaN in the poisoned-page tests).
    An 8-bit cache comes back dequantized to its act_dtype."""
    return gather_rows(self.k, self.v, self.pages, self.lengths, layer, mesh, scales=self._scales())

  def _scales(self):
    return (self.k_scale, self.v_scale, self.act_dtype) if self.quantized else None

  def write(self, k_new, v_new, mesh=None) -> "KVCache":
    """k_new, v_new [L, B, T, Hkv, D] written at slots lengths[b] .. lengths[b]+T-1 of each row, through its
    pages (slots past its table go to the null page); `lengths` does not move. An 8-bit cache quantizes them
    here, in the same loop (one scale per token and head)."""
    return self.with_pools(scatter_rows(self.pools(), k_new, v_new, self.pages, self.lengths, mesh))

  def insert_row(self, row: "KVCache", slot) -> "KVCache":
    """Take a one-row view's pool (a slot insert prefilled straight into row `slot`'s pages of this very pool,
    spec_jax/slots.py) and its length; no other row's pages were written."""
    return self.with_pools(row.pools()).replace(lengths=self.lengths.at[slot].set(row.lengths[0]))

  def fill_pages(self, pages, value) -> "KVCache":
    """Pages int32[n] (ids into this pool) of every layer set to `value`, data and scales; an integer pool, which
    cannot hold a NaN `value`, gets its most negative value (its scales carry the NaN)."""
    def data_value(dtype):
      value_ = jnp.asarray(value, jnp.float32)
      if jnp.issubdtype(dtype, jnp.integer):
        value_ = jnp.where(jnp.isnan(value_), jnp.iinfo(dtype).min, value_)
      return value_.astype(dtype)
    k, v = (a.at[:, pages].set(data_value(a.dtype)) for a in (self.k, self.v))
    scales = tuple(a.at[..., pages].set(value) for a in self.pools()[2:])
    return self.with_pools((k, v) + scales)

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
  """Run fn(pools..., pages_local, rows...) per data shard (shard_map over the pool's layout; a scale pool
  [L, Hkv, bs, N] split like its data, over its pages) where the pool is split over `data`; as is otherwise (the partitioner
  places it)."""
  shards = _data_shards(mesh, k, pages)
  if shards == 1:
    return fn(*pool_args, pages, *row_args)
  spec = cache_spec(k.shape, mesh)
  rows, heads = spec[1], spec[2]
  n_pool = k.shape[1]

  def local(*args):
    pools, pg, rest = args[:len(pool_args)], args[len(pool_args)], args[len(pool_args) + 1:]
    index = lax.axis_index("data")
    return fn(*pools, _shard_local(pg, n_pool, shards, index), *rest)

  pool_spec = tuple(spec if a.ndim == 5 else P(spec[0], spec[2], None, spec[1]) for a in pool_args)
  row_spec = lambda a: P(rows, *([None] * (a.ndim - 1)))
  in_specs = pool_spec + (P(rows, None),) + tuple(
      P(None, rows, None, heads, None) if a.ndim == 5 else row_spec(a) for a in row_args)
  if out_pool:
    out_specs = pool_spec
  else:
    out_specs = tuple(P(rows, heads, None, None) for _ in range(out_rows))
  return jax.shard_map(local, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)(
      *pool_args, pages, *row_args)


def gather_rows(k_pool, v_pool, pages, lengths, layer, mesh=None, scales=None):
  """-> (k, v) [B, Hkv, S, D]: layer `layer` of each row's pages in order, zero at slots >= lengths[b].
  scales (k_scale, v_scale, act_dtype): an 8-bit pool, dequantized to act_dtype (its scales paged the same way;
  a poisoned page's NaN scale is masked like its data)."""
  act = None if scales is None else scales[2]

  def fn(kp, vp, *rest):
    *sc, pg, lengths = rest
    B, npp = pg.shape
    bs = kp.shape[3]
    live = jnp.arange(npp * bs, dtype=jnp.int32)[None, :] < lengths[:, None]

    def take(pool):  # -> [B, Hkv, S, D]
      lay = lax.dynamic_index_in_dim(pool, layer, 0, keepdims=False)  # [N, Hkv, bs, D]
      g = jnp.take(lay, pg, axis=0)  # [B, P, Hkv, bs, D]
      g = jnp.swapaxes(g, 1, 2)
      return g.reshape(B, g.shape[1], npp * bs, *g.shape[4:])

    def take_scale(scale):  # [L, Hkv, bs, N] -> [B, Hkv, S]
      lay = lax.dynamic_index_in_dim(scale, layer, 0, keepdims=False)  # [Hkv, bs, N]
      g = jnp.take(lay, pg, axis=2)  # [Hkv, bs, B, P]
      return jnp.transpose(g, (2, 0, 3, 1)).reshape(B, g.shape[0], npp * bs)

    def one(pool, scale):
      g = take(pool)
      if scale is not None:
        g = dequantize(g, take_scale(scale), act)
      return jnp.where(live[:, None, :, None], g, jnp.zeros((), g.dtype))

    ks, vs = sc if sc else (None, None)
    return one(kp, ks), one(vp, vs)

  pools = (k_pool, v_pool) + (tuple(scales[:2]) if scales is not None else ())
  return _per_shard(fn, mesh, k_pool, pages, pool_args=pools, row_args=(lengths,), out_pool=False, out_rows=2)


def _address(pages, slots, bs):
  """Logical slots int32[B, T] -> (page, offset) int32[B, T] through the table; slots outside it (or < 0) -> the
  null page."""
  npp = pages.shape[1]
  blk = slots // bs
  inside = (slots >= 0) & (blk < npp)
  page = jnp.take_along_axis(pages, jnp.clip(blk, 0, npp - 1), axis=1)
  return jnp.where(inside, page, NULL_PAGE), jnp.where(inside, slots % bs, 0)


def scatter_rows(pools, k_new, v_new, pages, lengths, mesh=None):
  """pools (k, v[, k_scale, v_scale]) -> the pools with token t of row b (k_new, v_new [L, B, T, Hkv, D]) at its
  slot lengths[b] + t. With scale pools, the new tokens are quantized to the pool's dtype first (one scale per
  token and head, written beside it).

  One dynamic_update_slice per token (B * T of them, in a loop): each updates the pool in place, where XLA:CPU
  copies the whole buffer for a scatter."""
  def fn(*args):
    pools, (pg, kn, vn, lengths) = args[:-4], args[-4:]
    L, B, T, H, D = kn.shape
    page, off = _address(pg, lengths[:, None] + jnp.arange(T, dtype=jnp.int32)[None, :], pools[0].shape[3])
    if len(pools) == 4:
      (kn, ks), (vn, vs) = quantize(kn, pools[0].dtype), quantize(vn, pools[1].dtype)
      news = (kn, vn, ks, vs)  # scales [L, B, T, H]
    else:
      news = (kn, vn)
    # The new tokens go to the pool's head-major order before the loop: swapped token by token inside it, XLA:TPU
    # carried the pool with its layers minor and copied it in and out of every loop call.
    news = tuple(jnp.swapaxes(n, 2, 3) for n in news[:2]) + news[2:]  # [L, B, H, T, D]

    def one(i, pools):
      b, t = i // T, i % T
      out = []
      for pool, new in zip(pools[:2], news[:2]):
        tok = lax.dynamic_slice(new, (0, b, 0, t, 0), (L, 1, H, 1, D))
        out.append(lax.dynamic_update_slice(pool, tok.astype(pool.dtype), (0, page[b, t], 0, off[b, t], 0)))
      for pool, new in zip(pools[2:], news[2:]):  # [L, H, bs, N]: the token's scales, one per head
        tok = lax.dynamic_slice(new, (0, b, t, 0), (L, 1, 1, H)).reshape(L, H, 1, 1)
        out.append(lax.dynamic_update_slice(pool, tok, (0, 0, off[b, t], page[b, t])))
      return tuple(out)

    return lax.fori_loop(0, B * T, one, tuple(pools))

  return _per_shard(fn, mesh, pools[0], pages, pool_args=tuple(pools), row_args=(k_new, v_new, lengths),
                    out_pool=True)


def pool_bytes(tree, shape=lambda a: a.shape) -> tuple[int, int]:
  """-> (bytes, pages) of the K and V pools (and an 8-bit cache's scales) of every KVCache in a pytree (a decode
  state, a proposer state; real or abstract arrays). `shape` gives the shape counted (a chip's shard of a sharded pool); pages: the first pool's
  (every cache of a state shares one table)."""
  caches = [x for x in jax.tree_util.tree_leaves(tree, is_leaf=lambda x: isinstance(x, KVCache))
            if isinstance(x, KVCache)]
  nbytes = sum(int(np.prod(shape(a))) * np.dtype(a.dtype).itemsize for c in caches for a in c.pools())
  return nbytes, (int(shape(caches[0].k)[1]) if caches else 0)
