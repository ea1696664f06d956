"""Token trees for tree speculation: depths, the tree attention mask, positions, and KV compaction after a verify.

A tree is given per row by `parents` int32 [B, N]: node 0 is the root (parent -1), and every other node's parent
has a lower index (so a node at depth d has index >= d). A node whose parent is -1 other than the root (e.g. a
padding slot) counts as a root of its own: depth 0, attends to itself only. Everything is jittable with static
shapes; nothing loops over nodes at run time.

The loop feeds the N tree tokens at cache slots lengths + node index (positions base + depth), verifies with
`spec_jax.verify.verify_tree`, then `compact_accepted` moves the kept K/V (root, then the accepted nodes) into
consecutive slots so the cache is a plain prefix again.
"""

from __future__ import annotations

import collections
import dataclasses
import heapq
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec as P

from spec_jax.sharding import cache_spec


def ancestor_mask(parents: jax.Array) -> jax.Array:
  """bool [B, N, N]: mask[b, i, j] iff node j is node i or one of its ancestors (what node i may attend to).

  The reflexive-transitive closure of the parent relation by repeated squaring: ceil(log2 N) boolean [N, N]
  products per row, exact for any depth up to N - 1.
  """
  b, n = parents.shape
  j = lax.broadcasted_iota(jnp.int32, (b, n, n), 2)
  i = lax.broadcasted_iota(jnp.int32, (b, n, n), 1)
  reach = (j == i) | (j == parents.astype(jnp.int32)[:, :, None])
  for _ in range(max(1, math.ceil(math.log2(max(n, 2))))):
    f = reach.astype(jnp.float32)
    reach = jnp.einsum("bik,bkj->bij", f, f, precision=lax.Precision.HIGHEST) > 0
  return reach


def node_depths(parents: jax.Array) -> jax.Array:
  """int32 [B, N]: the number of ancestors of each node (root 0)."""
  return mask_depths(ancestor_mask(parents))


def mask_depths(mask: jax.Array) -> jax.Array:
  """node_depths from an ancestor mask already computed."""
  return (jnp.sum(mask, axis=-1) - 1).astype(jnp.int32)


def tree_positions(base: jax.Array, parents: jax.Array) -> jax.Array:
  """int32 [B, N]: the position of each node, base[b] (the root's position) + its depth; siblings share one."""
  return (base.astype(jnp.int32)[:, None] + node_depths(parents)).astype(jnp.int32)


def compact_accepted(cache_k: jax.Array, cache_v: jax.Array, lengths: jax.Array, accepted_nodes: jax.Array,
                     num_accepted: jax.Array, num_nodes: int, mesh=None) -> tuple[jax.Array, jax.Array]:
  """Move the accepted path's K/V into consecutive cache slots, per row, on device.

  cache_k, cache_v: [L, B, Hkv, S, Dh] (KVCache.k / .v) where the tree forward wrote node i < num_nodes of row b
  at slot lengths[b] + i (clipped to S - 1). accepted_nodes int32 [B, D+1] and num_accepted int32 [B] as
  verify_tree returns them: slot lengths[b] + t receives node accepted_nodes[b, t] for t <= num_accepted[b] (t = 0
  is the root, which stays). Slots past lengths + num_accepted are stale and may hold anything afterwards (they are
  beyond the new length). `lengths` is not advanced here: the caller advances the cache by the tokens it commits
  (<= num_accepted + 1).

  Each row reads only the num_nodes slots its tree was written to (one dynamic slice), picks the path's entries
  from that small window, and writes them back with one dynamic_update_slice per row and array,
  in place under donation. A gather over the whole cache instead made XLA:TPU re-lay out and copy the whole cache
  on every step at one slot. A window that would run past S is shifted back (not clamped onto other slots) and
  fills its extra slots with their own contents.

  With a `mesh`, each shard moves its own rows (`shard_map` over the cache's layout): the partitioner, given
  per-row slices of a cache split over `data`, gathered the whole cache onto every chip (1 GiB copies per step
  for Llama-8B on a data:4,model:4 pod).
  """
  n_layers, b, hkv, s, dh = cache_k.shape
  w = accepted_nodes.shape[1]
  n = max(int(num_nodes), w)
  if n > s:
    raise ValueError(f"a tree of {n} nodes (accepted_nodes has {w} columns) does not fit the cache's {s} slots")
  lengths = lengths.astype(jnp.int32)
  start = jnp.clip(lengths, 0, s - w)  # [B] the first slot written
  base = jnp.clip(lengths, 0, s - n)  # [B] the first slot of the window read: base <= start, start + w <= base + n
  dest = start[:, None] + jnp.arange(w, dtype=jnp.int32)[None, :]  # [B, w] the slots written
  t = dest - lengths[:, None]  # path index of each written slot
  moves = (t >= 0) & (t <= num_accepted.astype(jnp.int32)[:, None])
  node = jnp.take_along_axis(accepted_nodes.astype(jnp.int32), jnp.clip(t, 0, w - 1), axis=1)
  src = jnp.clip(jnp.where(moves, lengths[:, None] + node, dest), 0, s - 1) - base[:, None]  # [B, w] in the window

  def move(cache, base, src, start):
    blocks = []
    for r in range(cache.shape[1]):
      window = lax.dynamic_slice(cache, (0, r, 0, base[r], 0), (n_layers, 1, cache.shape[2], n, dh))
      blocks.append(jnp.take(window, src[r], axis=3))  # [L, 1, Hkv, w, Dh]
    # Every row's block is read before any is written, and the barrier keeps the reads out of the writes' fusions:
    # a fusion that also reads the cache cannot update it in place. (A fori_loop over rows, reading and writing
    # each row's window in its body, made XLA:TPU copy the whole cache at 16 slots.)
    blocks = lax.optimization_barrier(blocks)
    for r in range(cache.shape[1]):
      cache = lax.dynamic_update_slice(cache, blocks[r], (0, r, 0, start[r], 0))
    return cache

  def both(k, v, base, src, start):
    return move(k, base, src, start), move(v, base, src, start)

  if mesh is None:
    return both(cache_k, cache_v, base, src, start)
  kv = cache_spec(cache_k.shape, mesh)
  rows = kv[1]
  return jax.shard_map(both, mesh=mesh, in_specs=(kv, kv, P(rows), P(rows, None), P(rows)), out_specs=(kv, kv),
                       check_vma=False)(cache_k, cache_v, base, src, start)


@dataclasses.dataclass(frozen=True)
class StaticTree:
  """A tree whose shape is fixed ahead of time (Medusa's trees): node n > 0 is a path of ranks (r_1, ..., r_d),
  the r_i-th most likely candidate at depth i given the path before it; node 0 is the root, the path ().

  `paths` holds the non-root nodes, closed under prefixes and sorted by depth then ranks, so a node's parent
  always has a lower index. A chain of k drafts is ((0,), (0, 0), ...). Hashable: a jit static argument.
  """

  paths: tuple

  def __post_init__(self):
    paths = tuple(sorted({tuple(int(r) for r in p) for p in self.paths}, key=lambda p: (len(p), p)))
    if not paths:
      raise ValueError("a tree needs at least one node besides the root")
    for p in paths:
      if not p or min(p) < 0:
        raise ValueError(f"tree path {p} must be a non-empty tuple of ranks >= 0")
      if len(p) > 1 and p[:-1] not in paths:
        raise ValueError(f"tree path {p} has no parent {p[:-1]} in the tree")
    object.__setattr__(self, "paths", paths)

  @classmethod
  def chain(cls, k: int) -> "StaticTree":
    return cls(tuple((0,) * d for d in range(1, k + 1)))

  @classmethod
  def best(cls, accuracy, nodes: int) -> "StaticTree":
    """The `nodes`-node tree (root included) with the highest expected accepted length, Medusa's construction:
    accuracy[d][r] is how often the rank-r candidate at depth d + 1 is the right token (measured on held-out
    data), a path's value is the product along it, and the tree takes the nodes - 1 best paths. Products only
    shrink along a path, so the best paths are closed under prefixes; the search grows them best first."""
    acc = [[float(a) for a in row] for row in accuracy]
    if nodes < 2:
      raise ValueError(f"a tree needs at least 2 nodes (the root and one draft), got {nodes}")
    heap = [(-acc[0][r], (r,)) for r in range(len(acc[0]))]
    heapq.heapify(heap)
    chosen = []
    while heap and len(chosen) < nodes - 1:
      neg, path = heapq.heappop(heap)
      chosen.append(path)
      if len(path) < len(acc):
        for r in range(len(acc[len(path)])):
          heapq.heappush(heap, (neg * acc[len(path)][r], path + (r,)))
    return cls(tuple(chosen))

  @property
  def nodes(self) -> int:
    return len(self.paths) + 1

  @property
  def depth(self) -> int:
    return max(len(p) for p in self.paths)

  @property
  def ranks(self) -> int:
    """Candidates needed per depth: the highest rank used + 1."""
    return max(max(p) for p in self.paths) + 1

  @property
  def lookahead(self) -> int:
    """Cache entries a step writes past the last committed token."""
    return self.nodes - 1

  @property
  def max_children(self) -> int:
    counts = collections.Counter(p[:-1] for p in self.paths)
    return max(counts.values())

  def arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(parents, depths, ranks) int32 [N]; node 0 is the root (-1, 0, 0), node n the last rank of its path."""
    index = {(): 0} | {p: i + 1 for i, p in enumerate(self.paths)}
    parents = np.array([-1] + [index[p[:-1]] for p in self.paths], np.int32)
    depths = np.array([0] + [len(p) for p in self.paths], np.int32)
    ranks = np.array([0] + [p[-1] for p in self.paths], np.int32)
    return parents, depths, ranks
