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


def compact_accepted(cache, lengths: jax.Array, accepted_nodes: jax.Array, num_accepted: jax.Array, mesh=None):
  """Move the accepted path's K/V into consecutive cache slots, per row, on device -> (k, v) pools.

  cache: the KVCache (spec_jax/cache.py) where the tree forward wrote node i of row b at its slot lengths[b] + i.
  accepted_nodes int32 [B, D+1] and num_accepted int32 [B] as verify_tree returns them: slot lengths[b] + t
  receives node accepted_nodes[b, t] for 1 <= t <= num_accepted[b] (t = 0 is the root, which stays). Slots past
  lengths + num_accepted are stale and may hold anything afterwards (they are beyond the new length). `lengths`
  is not advanced here: the caller advances the cache by the tokens it commits (<= num_accepted + 1).

  Only the path's entries move (W per row, through the page table: cache.move_slots), every read before any
  write; a gather over the whole cache instead made XLA:TPU re-lay out and copy it on every step.
  """
  from spec_jax.cache import move_slots
  lengths = lengths.astype(jnp.int32)
  w = accepted_nodes.shape[1]
  t = jnp.arange(w, dtype=jnp.int32)[None, :]
  node = accepted_nodes.astype(jnp.int32)
  moves = (t >= 1) & (t <= num_accepted.astype(jnp.int32)[:, None]) & (node != t) & (node >= 0)
  src = lengths[:, None] + jnp.maximum(node, 0)
  dst = jnp.where(moves, lengths[:, None] + t, -1)
  return move_slots(cache.k, cache.v, cache.pages, src, dst, mesh)


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
