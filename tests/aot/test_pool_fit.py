"""serve.aot's sizing of the largest KV page pool per chip from a compiled decode loop's memory."""

from serve.compiler.aot_report import pool_fit, pool_section


def test_the_pool_grows_into_what_the_rest_leaves():
  run = {"capacity_bytes": 16 * 2**30, "max_model_len": 4096}
  # 10 GiB held in all, 2 GiB of it pools of 1024 pages: 8 GiB stays, 8 GiB of 2 MiB pages fit beside it.
  rec = {"compiled": True, "pool_bytes": 2 * 2**30, "pool_pages": 1024, "memory": {"total_bytes": 10 * 2**30}}
  f = pool_fit(run, rec, block_size=16)
  assert f["page_bytes"] == 2 * 2**20 and f["fixed"] == 8 * 2**30
  assert f["pages"] == 4096 and f["requests"] == 4096 // 256
  over = dict(rec, memory={"total_bytes": 30 * 2**30})  # the rest alone is over the chip: no pool
  assert pool_fit(run, over, 16)["pages"] == 0
  assert pool_fit(run, dict(rec, compiled=False), 16) is None
  assert "| 4096 |" in "\n".join(pool_section(run, [dict(rec, name="decode_loop[none]")]))
