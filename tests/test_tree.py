"""spec_jax.tree: depths, ancestor mask, positions and KV compaction against plain numpy references."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from spec_jax import tree
from spec_jax.verify import verify_tree
from spec_jax.config import SamplingParams
from tests.paged import logical, to_paged


def random_parents(rng, b, n, chain_bias=0.0):
  """Random trees, one per row: parents[i] uniform below i (or i - 1 with probability chain_bias)."""
  parents = np.full((b, n), -1, np.int32)
  for r in range(b):
    for i in range(1, n):
      parents[r, i] = i - 1 if rng.random() < chain_bias else rng.integers(0, i)
  return parents


def ref_ancestors(parents):
  b, n = parents.shape
  mask = np.zeros((b, n, n), bool)
  for r in range(b):
    for i in range(n):
      j = i
      while j >= 0:
        mask[r, i, j] = True
        j = parents[r, j]
  return mask


TREES = [
    np.array([[-1, 0, 0, 1, 1, 2, 3, 6]], np.int32),
    np.array([[-1, 0, 1, 2, 3, 4, 5, 6]], np.int32),  # a chain: depth N - 1
    np.array([[-1, 0, 0, 0, 0, 0, 0, 0]], np.int32),  # a star
    np.array([[-1, 0, -1, 1, -1, 0, 5, 3]], np.int32),  # padding slots with parent -1
]


@pytest.mark.parametrize("parents", TREES + [random_parents(np.random.default_rng(0), 5, 17, 0.5),
                                             random_parents(np.random.default_rng(1), 3, 64, 0.9)])
def test_mask_depths_positions(parents):
  mask = np.asarray(jax.jit(tree.ancestor_mask)(jnp.asarray(parents)))
  ref = ref_ancestors(parents)
  np.testing.assert_array_equal(mask, ref)
  depths = np.asarray(tree.node_depths(jnp.asarray(parents)))
  np.testing.assert_array_equal(depths, ref.sum(-1) - 1)
  assert depths.dtype == np.int32
  base = np.arange(parents.shape[0], dtype=np.int32) * 7 + 3
  pos = np.asarray(tree.tree_positions(jnp.asarray(base), jnp.asarray(parents)))
  np.testing.assert_array_equal(pos, base[:, None] + ref.sum(-1) - 1)


def test_chain_depth_is_index():
  parents = TREES[1]
  np.testing.assert_array_equal(tree.node_depths(jnp.asarray(parents)), np.arange(8)[None])


@pytest.mark.parametrize("block_size", [1, 2, 8])
def test_write_accepted_writes_the_path_and_keeps_the_prefix(block_size):
  """Through a shuffled page table with NaN elsewhere: rows whose path crosses page boundaries, one reaching the
  end of its table; slots lengths + t receive node nodes[t] for t <= n_acc, nothing below the length moves."""
  rng = np.random.default_rng(3)
  l, b, s, h, d, n = 2, 4, 24, 2, 3, 8
  k = rng.normal(size=(l, b, h, s, d)).astype(np.float32)
  kn = rng.normal(size=(l, b, n, h, d)).astype(np.float32)  # the tree forward's unwritten K/V, node order
  lengths = np.array([0, 5, 9, 20], np.int32)  # row 3: lengths + D + 1 = 24 = S
  nodes = np.array([[0, 2, 5, 7], [0, 1, 3, -1], [0, -1, -1, -1], [0, 1, 2, 3]], np.int32)
  n_acc = np.array([3, 2, 0, 3], np.int32)
  cache = to_paged(k, k, lengths, block_size, rng, fill=np.nan)
  out = jax.jit(tree.write_accepted)(cache, jnp.asarray(kn), jnp.asarray(kn), jnp.asarray(nodes))
  got = logical(out.k, out.pages)
  for r in range(b):
    np.testing.assert_array_equal(got[:, r, :, :lengths[r]], k[:, r, :, :lengths[r]])
    for t in range(n_acc[r] + 1):
      np.testing.assert_array_equal(got[:, r, :, lengths[r] + t], kn[:, r, nodes[r, t]])


def test_write_after_verify_tree_matches_path_tokens():
  """End to end on fake K/V that store the fed token: after verify_tree + write_accepted, slots lengths .. lengths + n
  hold the root then the accepted tokens, i.e. the committed tokens minus the not-yet-fed last one."""
  rng = np.random.default_rng(5)
  b, n, v, s = 6, 9, 7, 32
  parents = random_parents(rng, b, n, 0.4)
  toks = rng.integers(0, v, size=(b, n)).astype(np.int32)
  logits = rng.normal(size=(b, n, v)).astype(np.float32) * 3
  for r in range(b):  # make acceptance likely: node i's logits score its children's tokens
    for i in range(1, n):
      logits[r, parents[r, i], toks[r, i]] += 3.0
  params = SamplingParams.make(b, 1.0)
  tokens, n_acc, nodes = verify_tree(jnp.asarray(logits), jnp.asarray(toks), jnp.asarray(parents), None,
                                     jax.random.key(0), params, max_depth=n - 1, max_children=n - 1)
  tokens, n_acc, nodes = np.asarray(tokens), np.asarray(n_acc), np.asarray(nodes)
  assert n_acc.max() >= 2
  lengths = rng.integers(0, s - n, size=b).astype(np.int32)
  cache = np.full((1, b, 1, s, 1), -5.0, np.float32)  # [L, B, H, S, D]
  fed = np.broadcast_to(toks[None, :, :, None, None], (1, b, n, 1, 1)).astype(np.float32)  # K/V = the fed token
  paged = to_paged(cache, cache, lengths, 4, rng)
  out = tree.write_accepted(paged, jnp.asarray(fed), jnp.asarray(fed), jnp.asarray(nodes))
  k2 = logical(out.k, out.pages)[0, :, 0, :, 0]
  for r in range(b):
    m = n_acc[r]
    np.testing.assert_array_equal(k2[r, lengths[r]:lengths[r] + m + 1], np.r_[toks[r, 0], tokens[r, :m]])
