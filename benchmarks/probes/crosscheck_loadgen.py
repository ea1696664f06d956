"""Cross-check serve.loadtest against an independent load generator (NVIDIA AIPerf) on one running server.

Our numbers decide keep-or-roll-back, so a tool nobody here wrote measures the same server with the same requests:
the same prompts in the same order (AIPerf reads them from a custom `single_turn` file, not synthetic text), the
same max_tokens, temperature, top_p and seed per request, the same endpoint, the same closed-loop concurrency and
request count. The table shows both tools' TTFT, ITL, output tokens/s and req/s and AIPerf's relative difference.

  python benchmarks/probes/crosscheck_loadgen.py --url=http://127.0.0.1:8000 --aiperf=/tmp/lg-venv/bin/aiperf \
      --tokenizer=/tmp/lg-tok/gemma3 --gguf=~/.cache/spec_jax/gemma-3-270m-Q4_K_M.gguf \
      --concurrency=1,4 --num_requests=16 --max_tokens=32 --output_dir=/tmp/crosscheck

Run it with the project's interpreter (it imports serve.loadtest); AIPerf lives in its own venv and runs as a
subprocess. `--tokenizer` is a local Hugging Face tokenizer directory (no hub here): when it has no
tokenizer.json it is built from the GGUF's tokenizer (the project's SentencePiece proto, converted by transformers
in AIPerf's venv) and checked id for id against spec_jax's tokenizer on the prompts of the run.

Definitions (they explain part of any gap on identical traffic):
- TTFT: both tools time send -> first SSE event with content (the chat role chunk carries none, so neither counts
  it). Ours knows an event's tokens from `return_token_ids`, AIPerf from its text: an event whose text is empty
  (a partial UTF-8 character) is a token for us and nothing for AIPerf.
- ITL, ours: per token. An event carrying n tokens `gap` after the previous event gives n samples of gap / n; the
  first event's tokens give none; p50/p95 pool every sample of every request (docs/architecture.md). A speculative
  step (up to k + 1 tokens) or one engine sync (`--steps_per_sync` steps) arrives as one event.
- ITL, AIPerf: per request, (last content event - first content event) / (output tokens - 1), a per-request TPOT;
  p50/p95 are across requests, so a long request weighs as much as a short one, and bursty events average out.
  The "AIPerf def., usage count" rows apply that definition to both tools' records with the server's token count,
  so what is left there is timing alone.
- Output tokens: ours from the server's usage; AIPerf re-tokenizes the streamed text with `--tokenizer` (its
  default; --aiperf_server_token_count uses usage). Text that does not re-tokenize to the generated ids (likely
  from a random model, rare from Gemma) changes AIPerf's count, its ITL and its tokens/s.
- Tokens/s: output tokens / (first send -> last response), in both. AIPerf's request latency ends at the last
  content event, our e2e (and TPOT, not shown) at the end of the stream.
- Both clients are one asyncio process here (AIPerf: --workers-max 1), but AIPerf adds its controller, dataset,
  timing and record-processor processes: on a small busy CPU they compete with the server. The last rows show
  it: the server's own ITL and TTFT means over each tool's run (/metrics deltas), its CPU seconds
  (process_cpu_seconds_total) and each client's (ours: this process; AIPerf: its waited-for process tree). Pin
  the server and the clients to different cores (taskset) to compare the tools rather than the contention.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import subprocess
import time

import numpy as np

from serve.loadtest.aggregate import cell_stats, pct
from serve.loadtest.loadgen import run_point, warmup
from serve.loadtest.metrics import delta, find_hist, histogram_mean, scrape
from serve.loadtest.traffic import LoadPoint, build_requests, load_prompts

OFFLINE = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
# AIPerf 0.13 under HF_HUB_OFFLINE=1 looks every tokenizer up as a hub repo in the cache, so a local directory fails
# ("Repo id must be in the form ..."). Without it, an absolute path is taken as local and nothing is fetched.
AIPERF_ENV = {"HF_HUB_DISABLE_TELEMETRY": "1", "HF_DATASETS_OFFLINE": "1"}
from spec_jax.datasets import SPEC_BENCH as SPECBENCH  # noqa: E402

# Run in AIPerf's venv: SentencePiece proto -> HF tokenizer directory, then compare ids with ours (no special tokens,
# as AIPerf counts). argv: sentencepiece dir, out dir, check file.
_BUILD_HF_TOKENIZER = """
import json, sys
from transformers import AutoTokenizer, GemmaTokenizer
src, out, check = sys.argv[1:4]
GemmaTokenizer.from_pretrained(src).save_pretrained(out)
tok = AutoTokenizer.from_pretrained(out)
rows = json.load(open(check))
bad = [i for i, (text, ids) in enumerate(rows) if tok.encode(text, add_special_tokens=False) != ids]
print(json.dumps({"checked": len(rows), "mismatched": len(bad), "first": bad[:5]}))
"""


def side_python(aiperf: str) -> str:
  """AIPerf's interpreter: the python beside its entry point (it has transformers; ours need not)."""
  return os.path.join(os.path.dirname(os.path.abspath(aiperf)), "python")


def make_tokenizer(gguf: str, out_dir: str, aiperf: str, texts: list[str]) -> dict:
  """A local HF tokenizer for AIPerf's token counts, from the same GGUF metadata the server tokenizes with. Through
  spec_jax's SentencePiece proto: transformers 5 reads a GGUF tokenizer only with torch installed."""
  from spec_jax.checkpoints.gguf_tokenizer import tokenizer_proto
  from spec_jax.checkpoints.load import load_tokenizer
  src = os.path.join(out_dir, "sentencepiece")
  os.makedirs(src, exist_ok=True)
  with open(os.path.join(src, "tokenizer.model"), "wb") as f:
    f.write(tokenizer_proto(gguf))
  ours = load_tokenizer(gguf)
  check = os.path.join(out_dir, "check_ids.json")
  with open(check, "w", encoding="utf-8") as f:
    json.dump([(t, ours.encode(t, add_bos=False)) for t in texts], f)
  res = subprocess.run([side_python(aiperf), "-c", _BUILD_HF_TOKENIZER, src, out_dir, check], check=True,
                       capture_output=True, text=True, env={**os.environ, **OFFLINE})
  report = json.loads(res.stdout.strip().splitlines()[-1])
  print(f"tokenizer {out_dir}: {report['mismatched']} of {report['checked']} prompts tokenize differently from "
        f"spec_jax's", flush=True)
  return report


def write_aiperf_input(reqs, path: str) -> str:
  """One single_turn line per request, in our order: AIPerf sends exactly our prompt, budget and sampling."""
  kinds = {r.prompt.is_chat for r in reqs}
  if len(kinds) != 1:
    raise ValueError("the prompt set mixes chat ('turns') and completion ('prompt') lines; AIPerf takes one endpoint")
  with open(path, "w", encoding="utf-8") as f:
    for r in reqs:
      extra = {"temperature": r.temperature, "top_p": r.top_p, "seed": r.seed}
      f.write(json.dumps({"text": r.prompt.text, "output_length": r.max_tokens, "extra": extra}) + "\n")
  return "chat" if kinds.pop() else "completions"


def run_aiperf(args, reqs, conc: int, out_dir: str) -> dict:
  os.makedirs(out_dir, exist_ok=True)
  inp = os.path.join(out_dir, "input.jsonl")
  endpoint = write_aiperf_input(reqs, inp)
  cmd = [args.aiperf, "profile", "--model", args.model, "--url", args.url, "--endpoint-type", endpoint, "--streaming",
         "--input-file", inp, "--custom-dataset-type", "single_turn", "--dataset-sampling-strategy", "sequential",
         "--concurrency", str(conc), "--request-count", str(len(reqs)), "--tokenizer", args.tokenizer,
         "--use-legacy-max-tokens", "--request-timeout-seconds", str(args.request_timeout), "--random-seed", "0",
         "--artifact-dir", out_dir, "--ui-type", "none", "--no-server-metrics", "--no-gpu-telemetry",
         "--workers-max", "1", "--record-processors", "1"]
  if args.aiperf_server_token_count:
    cmd.append("--use-server-token-count")
  if args.api_key:
    cmd += ["--api-key", args.api_key]
  t = time.perf_counter()
  with open(os.path.join(out_dir, "aiperf.log"), "w") as log:
    env = {k: v for k, v in os.environ.items() if k not in OFFLINE} | AIPERF_ENV
    rc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=env).returncode
  if rc != 0:
    raise RuntimeError(f"aiperf exited {rc}; see {out_dir}/aiperf.log")
  with open(os.path.join(out_dir, "profile_export_aiperf.json"), encoding="utf-8") as f:
    summary = json.load(f)
  res = parse_aiperf(summary, os.path.join(out_dir, "profile_export.jsonl"))
  return res | {"cmd": cmd, "run_s": time.perf_counter() - t}


def _value(summary: dict, tag: str, key: str = "avg"):
  """One statistic of profile_export_aiperf.json (metric tag -> {"unit", "avg", "p50", ...}), times in seconds."""
  m = summary.get(tag)
  if not isinstance(m, dict) or m.get(key) is None:
    return None
  return float(m[key]) * {"ns": 1e-9, "us": 1e-6, "ms": 1e-3}.get(str(m.get("unit")), 1.0)


def parse_aiperf(summary: dict, records_path: str) -> dict:
  """TTFT, ITL, tokens/s and counts from AIPerf's summary, under our stat names; plus its ITL and tokens/s redone
  from its per-request records with the server's token count (usage), which separates timing from counting."""
  v = lambda tag, key="avg": _value(summary, tag, key)
  out = {"ttft_p50": v("time_to_first_token", "p50"), "ttft_p95": v("time_to_first_token", "p95"),
         "itl_p50": v("inter_token_latency", "p50"), "itl_p95": v("inter_token_latency", "p95"),
         "itl_mean": v("inter_token_latency"), "output_tok_s": v("output_token_throughput"),
         "req_s": v("request_throughput"), "output_tokens": v("total_output_tokens"),
         "usage_output_tokens": v("total_usage_completion_tokens"),
         "completed": v("completed_request_count") or v("request_count"),
         "errors": v("error_request_count") or 0.0, "duration_s": v("benchmark_duration"),
         "chunk_gap_p50": v("inter_chunk_latency", "p50"), "chunk_gap_p95": v("inter_chunk_latency", "p95"),
         "complete": bool(summary.get("is_complete", True)) and not summary.get("was_cancelled", False)}
  per_req = []
  if os.path.exists(records_path):
    with open(records_path, encoding="utf-8") as f:
      for line in f:
        m = json.loads(line).get("metrics") or {}
        get = lambda k: _value(m, k, "value")
        lat, ttft, n = get("request_latency"), get("time_to_first_token"), get("usage_completion_tokens")
        if None not in (lat, ttft, n) and n > 1:
          per_req.append((lat - ttft) / (n - 1))
  out["itl_server_count_p50"], out["itl_server_count_p95"] = pct(per_req, 50), pct(per_req, 95)
  if out["usage_output_tokens"] is not None and out["duration_s"]:
    out["output_tok_s_server_count"] = out["usage_output_tokens"] / out["duration_s"]
  return out


def ours_stats(res) -> dict:
  """cell_stats over our records, plus ITL in AIPerf's definition (server token count) from the same records."""
  st = cell_stats(res.records, res.wall_s)
  ok = [r for r in res.records if r["status"] == "ok" and (r.get("completion_tokens") or 0) > 1 and r.get("ttft")]
  per_req = [sum(r["event_gaps"]) / (r["completion_tokens"] - 1) for r in ok]
  tpe = [n for r in ok for n in r["tokens_per_event"]]
  gaps = [g for r in ok for g in r["event_gaps"]]
  return st | {"itl_server_count_p50": pct(per_req, 50), "itl_server_count_p95": pct(per_req, 95),
               "usage_output_tokens": st["output_tokens"], "output_tok_s_server_count": st["output_tok_s"],
               "chunk_gap_p50": pct(gaps, 50),
               "chunk_gap_p95": pct(gaps, 95), "tokens_per_event_mean": float(np.mean(tpe)) if tpe else None,
               "duration_s": res.wall_s, "errors": st["failed"]}


ROWS = (  # label, our key, AIPerf's key, scale
    ("TTFT p50 (ms)", "ttft_p50", "ttft_p50", 1e3),
    ("TTFT p95 (ms)", "ttft_p95", "ttft_p95", 1e3),
    ("ITL p50 (ms), each tool's own", "itl_p50", "itl_p50", 1e3),
    ("ITL p95 (ms), each tool's own", "itl_p95", "itl_p95", 1e3),
    ("ITL p50 (ms), AIPerf def., usage count", "itl_server_count_p50", "itl_server_count_p50", 1e3),
    ("ITL p95 (ms), AIPerf def., usage count", "itl_server_count_p95", "itl_server_count_p95", 1e3),
    ("output tok/s, each tool's count", "output_tok_s", "output_tok_s", 1.0),
    ("output tok/s, usage count", "output_tok_s_server_count", "output_tok_s_server_count", 1.0),
    ("requests/s", "req_s", "req_s", 1.0),
    ("SSE event gap p50 (ms)", "chunk_gap_p50", "chunk_gap_p50", 1e3),
    ("SSE event gap p95 (ms)", "chunk_gap_p95", "chunk_gap_p95", 1e3),
    ("output tokens, each tool's count", "output_tokens", "output_tokens", 1.0),
    ("output tokens, usage count", "usage_output_tokens", "usage_output_tokens", 1.0),
    ("completed requests", "completed", "completed", 1.0),
    ("failed requests", "errors", "errors", 1.0),
    ("duration (s)", "duration_s", "duration_s", 1.0),
    # The same server seen from inside during each tool's run: if these differ, the server ran at another speed.
    ("server-side ITL mean (ms)", "server_itl_mean", "server_itl_mean", 1e3),
    ("server-side TTFT mean (ms)", "server_ttft_mean", "server_ttft_mean", 1e3),
    ("server CPU (s)", "server_cpu_s", "server_cpu_s", 1.0),
    ("client CPU (s)", "client_cpu_s", "client_cpu_s", 1.0),
)


def cpu_seconds(who: int) -> float:
  r = resource.getrusage(who)
  return r.ru_utime + r.ru_stime


def server_view(before, after, client_cpu_s: float) -> dict:
  """The server's own histograms and CPU over one tool's run (deltas of /metrics), and the client's CPU."""
  d = delta(before, after)
  out = {}
  for key, stems in (("server_itl_mean", ("inter_token",)), ("server_ttft_mean", ("time_to_first_token",))):
    base = find_hist(d, *stems)
    out[key] = histogram_mean(d, base) if base else None
  # prometheus_client's process collector, where the server exports it (ours does)
  out["server_cpu_s"] = d.value(d.find("process_cpu_seconds"))
  out["client_cpu_s"] = client_cpu_s
  return out


def rel(a, b):
  return (b / a - 1.0) if a not in (None, 0) and b is not None else None


def table(results: list, aiperf_version: str) -> str:
  lines = []
  for cell in results:
    head = (f"c={cell['concurrency']} repeat {cell['repeat']}: {cell['requests']} requests, max_tokens "
            f"{cell['max_tokens']}")
    lines.append(f"{head:<40}{'serve.loadtest':>16}{'AIPerf ' + aiperf_version:>16}{'AIPerf/ours-1':>15}")
    for label, ok, ak, scale in ROWS:
      a, b = cell["ours"].get(ok), cell["aiperf"].get(ak)
      fa = f"{a * scale:.2f}" if a is not None else "-"
      fb = f"{b * scale:.2f}" if b is not None else "-"
      d = rel(a, b)
      lines.append(f"  {label:<38}{fa:>16}{fb:>16}{(f'{d:+.1%}' if d is not None else '-'):>15}")
    tpe = cell["ours"].get("tokens_per_event_mean")
    lines.append(f"  (tokens per SSE event, mean: {tpe:.2f})" if tpe else "")
  return "\n".join(lines)


def aiperf_version(aiperf: str) -> str:
  try:
    out = subprocess.run([side_python(aiperf), "-c", "import importlib.metadata as m; print(m.version('aiperf'))"],
                         capture_output=True, text=True, check=True).stdout.strip()
    return out or "?"
  except (OSError, subprocess.CalledProcessError):
    return "?"


def main():
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--url", required=True, help="The running serve.server, e.g. http://127.0.0.1:8000.")
  p.add_argument("--model", default="gemma-3-270m", help="The served model name.")
  p.add_argument("--api_key", default="")
  p.add_argument("--aiperf", default="/tmp/lg-venv/bin/aiperf", help="AIPerf's entry point, in its own venv.")
  p.add_argument("--tokenizer", default="/tmp/lg-tok/gemma3", help="Local HF tokenizer dir (built if empty).")
  p.add_argument("--gguf", default=os.path.expanduser("~/.cache/spec_jax/gemma-3-270m-Q4_K_M.gguf"),
                 help="The served GGUF: the tokenizer is built from it when --tokenizer has none.")
  p.add_argument("--concurrency", default="1,4", help="Closed-loop client counts, comma-separated.")
  p.add_argument("--num_requests", type=int, default=16, help="Requests per concurrency (the same for both).")
  p.add_argument("--max_tokens", type=int, default=32)
  p.add_argument("--prompts", default=SPECBENCH, help="JSONL with 'turns' (first turn, chat) or 'prompt'.")
  p.add_argument("--categories", default="", help="Only these prompt categories, comma-separated.")
  p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy.")
  p.add_argument("--top_p", type=float, default=1.0)
  p.add_argument("--seed", type=int, default=0, help="Shuffles the prompts; per-request seeds derive from it.")
  p.add_argument("--warmup", type=int, default=-1,
                 help="Warm-up requests before everything (-1 = the measured set once, so every prompt length "
                      "is compiled before either tool measures).")
  p.add_argument("--repeats", type=int, default=1, help="Per concurrency; the tool order alternates.")
  p.add_argument("--request_timeout", type=float, default=600.0)
  p.add_argument("--aiperf_server_token_count", action="store_true",
                 help="AIPerf counts output tokens from the server's usage instead of re-tokenizing the text.")
  p.add_argument("--output_dir", default="/tmp/crosscheck_loadgen")
  args = p.parse_args()
  args.url = args.url.rstrip("/")
  os.makedirs(args.output_dir, exist_ok=True)
  args.output_dir = os.path.abspath(args.output_dir)
  args.tokenizer = os.path.abspath(os.path.expanduser(args.tokenizer))
  import logging
  logging.getLogger("httpx").setLevel(logging.WARNING)

  cats = tuple(c for c in args.categories.split(",") if c)
  prompts = load_prompts(args.prompts, 0, cats)
  sampling = {"name": "greedy" if args.temperature == 0 else "sampled", "temperature": args.temperature,
              "top_p": args.top_p}
  reqs = build_requests(prompts, args.num_requests, sampling, [args.max_tokens], seed=args.seed)
  if not os.path.exists(os.path.join(args.tokenizer, "tokenizer.json")):
    make_tokenizer(os.path.expanduser(args.gguf), args.tokenizer, args.aiperf,
                   sorted({r.prompt.text for r in reqs}))
  version = aiperf_version(args.aiperf)
  levels = [int(c) for c in args.concurrency.split(",") if c]

  n_warm = len(reqs) if args.warmup < 0 else args.warmup
  if n_warm:
    t = time.perf_counter()
    warm = reqs if args.warmup < 0 else build_requests(prompts, n_warm, sampling, [args.max_tokens], seed=10_000)
    recs = asyncio.run(warmup(args.url, warm, model=args.model, concurrency=max(levels),
                              request_timeout=args.request_timeout, api_key=args.api_key))
    bad = [r for r in recs if r["status"] != "ok"]
    print(f"warm-up: {len(recs)} requests in {time.perf_counter() - t:.0f} s, {len(bad)} failed"
          + (f" (first: {bad[0]['error']})" if bad else ""), flush=True)

  results = []
  for conc in levels:
    for rep in range(args.repeats):
      cell = {"concurrency": conc, "repeat": rep, "requests": len(reqs), "max_tokens": args.max_tokens}
      order = ("ours", "aiperf") if rep % 2 == 0 else ("aiperf", "ours")
      for tool in order:
        t = time.perf_counter()
        # Client CPU: ours is this process; AIPerf's is its process tree, which subprocess.run waits for.
        who = resource.RUSAGE_SELF if tool == "ours" else resource.RUSAGE_CHILDREN
        cpu0, before = cpu_seconds(who), scrape(args.url, api_key=args.api_key)
        if tool == "ours":
          point = LoadPoint("closed", float(conc), f"c{conc}", sampling["name"])
          res = asyncio.run(run_point(args.url, point, reqs, model=args.model, max_requests=len(reqs),
                                      max_seconds=args.request_timeout * len(reqs), drain_s=args.request_timeout,
                                      request_timeout=args.request_timeout, api_key=args.api_key,
                                      sample_interval=3600.0))
          cell["ours"] = ours_stats(res)
          with open(os.path.join(args.output_dir, f"ours_c{conc}_r{rep}.jsonl"), "w", encoding="utf-8") as f:
            for r in res.records:
              f.write(json.dumps(r) + "\n")
        else:
          cell["aiperf"] = run_aiperf(args, reqs, conc, os.path.join(args.output_dir, f"aiperf_c{conc}_r{rep}"))
        cell[tool] |= server_view(before, scrape(args.url, api_key=args.api_key), cpu_seconds(who) - cpu0)
        print(f"c={conc} repeat {rep}: {tool} done in {time.perf_counter() - t:.0f} s", flush=True)
      cell["diff"] = {label: rel(cell["ours"].get(ok), cell["aiperf"].get(ak)) for label, ok, ak, _ in ROWS}
      results.append(cell)
      print(table([cell], version), flush=True)  # each cell as it finishes: a long run that is cut keeps them

  text = table(results, version)
  with open(os.path.join(args.output_dir, "crosscheck.txt"), "w", encoding="utf-8") as f:
    f.write(text + "\n")
  out = {"tool": f"aiperf {version}", "url": args.url, "model": args.model, "prompts": args.prompts,
         "categories": list(cats), "max_tokens": args.max_tokens, "num_requests": len(reqs),
         "temperature": args.temperature, "top_p": args.top_p, "seed": args.seed, "warmup": n_warm,
         "aiperf_token_count": "server usage" if args.aiperf_server_token_count else f"tokenizer {args.tokenizer}",
         "definitions": __doc__[__doc__.index("Definitions"):], "results": results}
  path = os.path.join(args.output_dir, "crosscheck.json")
  with open(path, "w", encoding="utf-8") as f:
    json.dump(out, f, indent=1, default=str)
  print(f"wrote {path}")


if __name__ == "__main__":
  main()
