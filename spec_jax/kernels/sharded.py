"""The Pallas kernels under a device mesh: one kernel call per shard.

Mosaic and Triton calls cannot be partitioned by XLA's SPMD partitioner ("Mosaic kernels cannot be automatically
partitioned. Please wrap the call in a shard_map."), so attention runs inside a `shard_map` laid out as
spec_jax/sharding.py's table says: rows over `data`, query heads over `model`, and the KV heads over `model` when
their count divides it. A model whose KV heads do not split (Gemma 3 270M has one) keeps the whole cache on every
model shard, and each shard attends with its own query heads. The rare layout where neither works (KV heads that
do not divide `model`, more than one of them) runs every head on every model shard: correct, but not split.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P


def head_split(num_heads: int, num_kv_heads: int, model: int) -> tuple:
  """-> (query-head axis, kv-head axis): the mesh axis each is split over, or None (whole)."""
  if model == 1 or num_heads % model:
    return None, None
  if num_kv_heads % model == 0:
    return "model", "model"
  if num_kv_heads == 1:
    return "model", None
  return None, None


def per_shard(kernel, mesh, q, k_new, v_new, k_cache, v_cache, q_positions, lengths, window, tree_mask, layer,
              pages=None, k_scale=None, v_scale=None):
  """kernel(q, k_new, v_new, k_cache, v_cache, q_positions, lengths, window=, tree_mask=, layer=[, pages=]) per
  shard. With `pages` (global ids, each row's in its data shard's share of the pool), each shard reads its own
  share with its rows' ids made local. k_scale/v_scale (an 8-bit cache's) are split like the cache they scale."""
  B, _, Hq, _ = q.shape
  Hkv = k_cache.shape[-3]
  rows = "data" if B % mesh.shape["data"] == 0 else None
  qh, kvh = head_split(Hq, Hkv, mesh.shape["model"])
  stacked = (None,) if layer is not None else ()
  traced = {"window": window if isinstance(window, jax.Array) else None,
            "tree_mask": tree_mask, "layer": None if layer is None else jnp.asarray(layer, jnp.int32),
            "pages": pages, "k_scale": k_scale, "v_scale": v_scale}
  static_window = None if traced["window"] is not None else window
  names = [n for n, v in traced.items() if v is not None]
  scales = P(*stacked, kvh, None, rows)  # [.., Hkv, S, X]: the slot axis last
  extra_specs = {"window": P(), "layer": P(), "pages": P(rows, None), "k_scale": scales, "v_scale": scales,
                 "tree_mask": P(rows, None, None) if tree_mask is not None and tree_mask.ndim == 3 else P()}

  def one(q, k_new, v_new, k_cache, v_cache, q_positions, lengths, *extra):
    kw = dict(zip(names, extra))
    paged = {}
    if "pages" in kw:
      share = k_cache.shape[-4]  # this shard's pages (the pool's axis after the layers)
      index = jax.lax.axis_index("data") if rows else 0
      paged = {"pages": kw["pages"] - index * share}
    if "k_scale" in kw:
      paged.update(k_scale=kw["k_scale"], v_scale=kw["v_scale"])
    return kernel(q, k_new, v_new, k_cache, v_cache, q_positions, lengths,
                  window=kw.get("window", static_window), tree_mask=kw.get("tree_mask"), layer=kw.get("layer"),
                  **paged)

  cache = P(*stacked, rows, kvh, None, None)
  in_specs = (P(rows, None, qh, None), P(rows, None, kvh, None), P(rows, None, kvh, None), cache, cache,
              P(rows, None), P(rows)) + tuple(extra_specs[n] for n in names)
  return jax.shard_map(one, mesh=mesh, in_specs=in_specs, out_specs=P(rows, None, qh, None), check_vma=False)(
      q, k_new, v_new, k_cache, v_cache, q_positions, lengths, *(traced[n] for n in names))
