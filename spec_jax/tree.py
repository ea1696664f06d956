"""Token trees for tree speculation: depths, the tree attention mask, positions, and the accepted path's KV write.

A tree is given per row by `parents` int32 [B, N]: node 0 is the root (parent -1), and every other node's parent
has a lower index (so a node at depth d has index >= d). A node whose parent is -1 other than the root (e.g. a
padding slot) counts as a root of its own: depth 0, attends to itself only. Everything is jittable with static
shapes; nothing loops over nodes at run time.

The loop feeds the N tree tokens (positions base + depth) in one forward that reads the cache without writing it,
verifies with `spec_jax.verify.verify_tree`, then `write_accepted` writes the kept K/V (root, then the accepted
nodes) into consecutive slots, so the cache is a plain prefix.
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


def write_accepted(cache, k_new, v_new, accepted_nodes, mesh=None):
  """The accepted path's K/V, from the tree forward's unwritten k_new/v_new [L, B, N, Hkv, D] (node order), into
  consecutive slots cache.lengths[b] + t (t = 0 the root) -> the cache (lengths not advanced). accepted_nodes
  int32 [B, D+1] as verify_tree returns them (-1 past the path: those slots get the root's K/V again, beyond the
  length the caller commits, never read). Only D + 1 entries per row are written, and the pool is never read
  (moving the path within the pool after writing every node made XLA:TPU re-lay out and copy it every step)."""
  take = lambda x: jnp.take_along_axis(x, jnp.maximum(accepted_nodes, 0)[None, :, :, None, None], axis=2)
  return cache.write(take(k_new), take(v_new), mesh)


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
