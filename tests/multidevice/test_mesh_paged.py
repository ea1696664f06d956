"""The paged KV pool on a mesh with a data axis (serve/sharded_pool.py): one block manager per data shard, each
shard's rows on pages of its own share. Eight slots over data:4,model:2 (two rows a shard) on 4 x 24 usable pages:
six requests fight for pages, shards preempt among their own rows, and with freed pages poisoned every greedy
output equals the request's output alone (a row reading a page of another shard's share, or a stale one, would
not); the pool ends where it started; a repeated prompt is placed on the shard that caches its prefix."""

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
