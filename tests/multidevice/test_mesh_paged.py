"""The paged KV pool on a mesh with a data axis (serve/engine/sharded_pool.py): one block manager per data shard, each
shard's rows on pages of its own share. Eight slots over data:4,model:2 (two rows a shard) on 4 x 24 usable pages:
six requests fight for pages, shards preempt among their own rows, and with freed pages poisoned every greedy
output equals the request's output alone (a row reading a page of another shard's share, or a stale one, would
not); the pool ends where it started; a repeated prompt is placed on the shard that caches its prefix."""

import jax
import jax.numpy as jnp
import numpy as np

from spec_jax import sharding
from spec_jax.cache import KVCache
from tests.conftest import tiny_gemma_config
from tests.serve.test_server import tiny_model  # noqa: F401 (a fixture)
from tests.serve.test_server_paged import _run

MESH = ["--mesh=data:4,model:2", "--max_num_seqs=8", "--block_size=4", "--num_kv_blocks=101", "--poison_freed_pages",
        '--speculative_config={"method": "ngram", "num_speculative_tokens": 4}']


def test_one_block_manager_per_data_shard(tiny_model):
  out = _run(tiny_model, MESH)
  st = out["status"]
  assert out["pages"] == 96 and st["kv_data_shards"] == 4  # 101 pages: 25 a shard, each with its null page
  assert out["peak_rows"] >= 3  # more rows than one shard has: requests went to several shards
  assert st["num_preemptions"] > 0
  assert all(len(o) == 40 for o in out["alone"])
  assert out["together"] == out["alone"]
  free0, free1, used = out["pool_back"]
  assert free1 == free0 == 96 and used == 0


def test_a_prefix_is_found_on_the_shard_that_caches_it(tiny_model):
  out = _run(tiny_model, MESH + ["--num_kv_blocks=201"], prefix=True)  # a 140-token prompt: 49 pages a shard
  (ref, _, n), (_, (q1, h1), _), (hit, (q2, h2), _), (other, (q3, h3), _) = (
      out[k] for k in ("ref", "first", "hit", "other"))
  assert h2 - h1 >= n - 8 and hit[0] == ref[0]  # the hit was placed where "first" left its pages
  assert h3 == h2 and other[0] == ref[0]


def test_an_8_bit_pool_split_over_data_writes_and_reads_as_on_one_device():
  """The scales are split over `data` like the pages they scale (each shard's rows quantize into, and read from,
  its own share): writes and reads of an int8 pool on data:4,model:2 equal one device's, bit for bit."""
  mesh = sharding.make_mesh("data:4,model:2")
  config = tiny_gemma_config(num_kv_heads=2)
  B, T = 8, 6
  cache = KVCache.init(config, B, 16, jnp.float32, block_size=4, shards=4, kv_dtype="int8")
  rng = np.random.default_rng(0)
  shape = (config.num_layers, B, T, config.num_kv_heads, config.head_dim)
  k, v = (jnp.asarray(300 * rng.standard_normal(shape), jnp.float32) for _ in range(2))
  n = jnp.asarray(rng.integers(1, T + 1, B), jnp.int32)

  def run(c, k, v, mesh):
    c = c.write(k, v, mesh).advance(n)
    return c, c.layer_view(jnp.int32(1), mesh)

  ref, ref_view = jax.jit(lambda c, k, v: run(c, k, v, None))(cache, k, v)
  placed = sharding.put(cache, sharding.state_shardings(cache, mesh))
  assert placed.k_scale.sharding.spec[3] == "data"
  got, got_view = jax.jit(lambda c, k, v: run(c, k, v, mesh))(placed, k, v)
  for a, b in zip(ref.pools() + ref_view, got.pools() + got_view):
    np.testing.assert_array_equal(np.asarray(a.astype(jnp.float32)), np.asarray(b.astype(jnp.float32)))
