"""report.md of a `serve.aot` run: one row per compiled program (serve/aot.py builds the records)."""

from __future__ import annotations

from serve.compiler import aot_compile


def num(x, scale: float, digits: int) -> str:
  return "n/a" if x is None else f"{x * scale:.{digits}f}"


def pool_fit(run: dict, r: dict, block_size: int) -> dict | None:
  """The largest KV page pool that fits beside everything else a decode loop holds on a chip: what the program
  holds apart from its pools (weights, the rest of the state, temporaries) stays, the pools grow to the chip's
  capacity. -> pages and bytes per chip, and how many max_model_len requests that is (per data shard's pool)."""
  if not r.get("compiled") or not r.get("pool_pages"):
    return None
  page = r["pool_bytes"] / r["pool_pages"]
  fixed = r["memory"]["total_bytes"] - r["pool_bytes"]
  pages = max(int((run["capacity_bytes"] - fixed) // page), 0)
  per_request = -(-run["max_model_len"] // block_size)
  return dict(pages=pages, bytes=pages * page, page_bytes=page, requests=pages // per_request, fixed=fixed)


def pool_section(run: dict, records: list, block_size: int = 16) -> list:
  rows = [(r["name"], pool_fit(run, r, block_size)) for r in records]
  rows = [(n, f) for n, f in rows if f is not None]
  if not rows:
    return []
  gib = lambda b: f"{b / 2**30:.2f}"
  out = ["", f"## The largest KV page pool per chip ({block_size}-token pages)", "",
         f"Everything a decode loop holds apart from its page pools stays; the pools (the target's and a proposer's "
         f"KV) grow to the chip's {gib(run['capacity_bytes'])} GiB. Requests: of {run['max_model_len']} tokens each, "
         "in one data shard's pool.", "",
         "| program | held apart from the pools GiB | bytes per page | pages | pool GiB | requests of max_model_len |",
         "|---|---|---|---|---|---|"]
  for name, f in rows:
    out.append(f"| {name} | {gib(f['fixed'])} | {f['page_bytes']:.0f} | {f['pages']} | {gib(f['bytes'])} | "
               f"{f['requests']} |")
  return out


def report_md(run: dict, records: list) -> str:
  gib = lambda b: f"{b / 2**30:.2f}"
  lines = [f"# AOT report: {run['model_shape']} on {run['topology']} ({run['chip']}, {run['chips']} chips, "
           f"{run['hosts']} hosts)", "",
           f"- mesh: {run['mesh'] or 'one chip'}; {run['max_num_seqs']} slots x {run['max_model_len']} tokens; "
           f"k = {run['k']}, trees: topk {run['topk']}, {run['nodes'] or 'default'} nodes; {run['dtype']} layers, "
           f"attention {run['attention_impl']}",
           f"- HBM per chip: {gib(run['capacity_bytes'])} GiB; jax {run['jax']}, {run['compiler']}; "
           f"{run['date']}", "",
           "| program | compiled | HBM GiB (args / out / temp / total) | fits | largest temporary | cache copies | "
           "GFLOP | GB accessed | optimal ms | kernels | host callbacks | compile s |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|"]
  for r in records:
    if not r["compiled"]:
      lines.append(f"| {r['name']} | **no**: {r['error'][:160].replace('|', '/')} | | | | | | | | | | "
                   f"{r['compile_seconds']} |")
      continue
    m = r["memory"]
    kern = ", ".join(f"{k} x{n}" for k, n in sorted(r["kernels"].items())) or "none"
    top = r["temporaries"][0] if r["temporaries"] else None
    largest = f"{top['bytes'] / 2**20:.1f} MiB `{top['shape']}`" if top else "none"
    copies = ", ".join(f"**{c['shape']}**" for c in r["cache_copies"]) or "none"
    lines.append(
        f"| {r['name']} | yes | {gib(m['argument_bytes'])} / {gib(m['output_bytes'])} / {gib(m['temp_bytes'])} / "
        f"{gib(m['total_bytes'])} | {'yes' if r['fits'] else '**no**'} | {largest} | {copies} | "
        f"{num(r['flops'], 1e-9, 1)} | "
        f"{num(r['bytes_accessed'], 1e-9, 2)} | {num(r['optimal_seconds'], 1e3, 3)} | {kern} | "
        f"{', '.join(r['host_callbacks']) or 'none'} | {r['compile_seconds']} |")
  lines += pool_section(run, records)
  bad = [r["name"] for r in records if not aot_compile.ok(r)]
  planned = run.get("programs_planned", len(records))
  lines += ["", f"**{len(records) - len(bad)} of {len(records)} programs compiled and fit, with no copy of the KV "
            "cache, no host callback and a positive cost estimate**" +
            (f" (the run stopped after {len(records)} of the {planned} programs planned)" if planned > len(records)
             else "") +
            (f"; failed or over capacity: {', '.join(bad)}" if bad else "."),
            "", "A cache copy is a temporary ending in the cache's (capacity, head dim) dimensions, with its slots' "
            "(unless there is one), and at least half a layer's K, from XLA's buffer-assignment dump. "
            "optimal ms is the compiler's roofline estimate (XLA:TPU `optimal_seconds`), not a measurement, and XLA's "
            "cost analysis counts a loop's body once: for these programs, with the layers in a scan, it covers one "
            "layer and what is outside the scan (the LM head, sampling), and one step of the decode loop "
            "(`--cost_table` unrolls the layers); "
            "the attention kernels declare their cost for a cache read up to its capacity. Where the program as "
            "compiled held XLA:TPU's sliced-prefetch `ConcatBitcast` calls, which its cost model leaves without a "
            "cost, the cost columns come from a second compile with one slice per prefetch "
            "(`xla_tpu_sliced_prefetch_max_slices=1`): " +
            (", ".join(r["name"] for r in records if r.get("cost_source", "").startswith("recompiled")) or "none") +
            "."]
  return "\n".join(lines) + "\n"
