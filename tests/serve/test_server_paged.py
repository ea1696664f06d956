"""The engine on a paged KV pool far smaller than max_num_seqs x max_model_len (serve/engine/kv_scheduler.py): it runs
more requests at once than the pool holds capacity-length ones, preempts when it must, loses none, every greedy
output equals the request's output alone, freed pages filled with NaN change nothing (every method, chains and a
tree), and the pool ends where it started. Each engine runs in a subprocess that shares the tiny servers'
compilation cache."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from serve.engine.kv_scheduler import pool_pages
from tests.serve.test_server import ROOT, tiny_model  # noqa: F401 (a fixture)

HEADS = os.path.join(ROOT, "tests", "fixtures", "published_heads")
POOL = ["--block_size=4", "--num_kv_blocks=49"]  # one config for every test: compiled once per session

SCRIPT = r"""
import json, sys, time
import jax
from absl import flags
jax.config.update("jax_compilation_cache_dir", sys.argv[2])
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
from serve import server
args = json.loads(sys.argv[3])
server.define_flags()
flags.FLAGS(["server", f"--model={sys.argv[1]}", "--dtype=float32", "--max_model_len=256", "--max_num_seqs=4",
             "--steps_per_sync=4", "--costs_file=", "--timing_probe_s=0", *args["flags"]])
engine, tok, _ = server.build_engine(server.settings())
kv = engine.kv
out = {"pages": kv.bm.usable, "pages_per_seq": kv.bm.pages_per_seq,
       "proposer_bytes": kv.proposer_bytes_per_page, "kv_cache_dtype": engine.spec.kv_cache_dtype}
from serve.engine.request_spec import RequestSpec, Sampling
def make(prompt, max_new, seed=0, temperature=0.0, top_p=1.0, **kw):
  return engine.make_request(RequestSpec(prompt_ids=tuple(tok.encode(prompt)), max_new=max_new,
                                         sampling=Sampling(temperature=temperature, top_p=top_p, seed=seed), **kw))
if args["too_long"]:
  try:
    make("the cat", args["too_long"])
  except ValueError as e:
    out["too_long"] = [getattr(e, "field", None), str(e)]
engine.start(warmup_prompt_lens=[1])
free0 = kv.bm.num_free + kv.bm.num_cached

def run(reqs):
  for r in reqs:
    engine.submit(r)
  for r in reqs:
    end = time.time() + 300
    while time.time() < end:
      d = r.output.take()
      if d is not None and d.finished:
        assert d.error is None, d.error
        break
      time.sleep(0.005)
  return [list(r.out_ids) for r in reqs]

def counters():
  s = engine.status()
  return s["prefix_cache_queries"], s["prefix_cache_hits"]

if args.get("prefix"):  # the same long prefix: another salt (no hit), then a first request, then the hit, then
  # another tenant (no hit)
  doc = " ".join(["the cat sat on a mat and a dog ran"] * 4)
  mk = lambda p, **kw: make(p, 16, **kw)
  steps = [("ref", mk(doc + " is a cat", cache_salt="x")), ("first", mk(doc + " the dog")),
           ("hit", mk(doc + " is a cat")), ("other", mk(doc + " is a cat", tenant="other"))]
  for name, r in steps:
    out[name] = [run([r])[0], counters(), len(r.prompt_ids)]
  engine.shutdown(grace_s=5)
  print("RESULT " + json.dumps(out))
  sys.exit(0)

words = "the cat sat on a mat and a dog ran".split()
prompts = [" ".join(words[i % 5:i % 5 + 3 + i % 4] * (1 + i % 3)) for i in range(args["n"])]
sampled = dict(temperature=0.9, top_p=0.95) if args.get("sampled") else {}
mk = lambda i: make(prompts[i], args["max_new"], seed=1000 + i, **sampled)
out["alone"] = [run([mk(i)])[0] for i in range(len(prompts))]
kv.peak_rows = 0
out["together"] = run([mk(i) for i in range(len(prompts))])
end = time.time() + 60  # a finished request's slot and pages go back at the engine's next iteration
while engine.table.holders and time.time() < end:
  time.sleep(0.01)
out["status"] = engine.status()
out["peak_rows"] = kv.peak_rows
out["pool_back"] = [free0, kv.bm.num_free + kv.bm.num_cached, kv.bm.num_used]
kv.bm.check_invariants()
from prometheus_client.parser import text_string_to_metric_families
out["metrics"] = {s.name: s.value for f in text_string_to_metric_families(engine.metrics.render().decode())
                  for s in f.samples if "kv_cache" in s.name or "preemptions" in s.name or "prefix_cache" in s.name}
engine.shutdown(grace_s=5)
print("RESULT " + json.dumps(out))
"""


def _run(tiny_model, flags, n=6, max_new=40, too_long=0, model=None, prefix=False, sampled=False):
  cache = os.path.join(os.path.dirname(tiny_model), "xla_cache")
  args = json.dumps({"flags": flags, "n": n, "max_new": max_new, "too_long": too_long, "prefix": prefix,
                     "sampled": sampled})
  r = subprocess.run([sys.executable, "-c", SCRIPT, model or tiny_model, cache, args], cwd=ROOT, capture_output=True,
                     text=True, timeout=900)
  assert r.returncode == 0, r.stderr[-3000:]
  return json.loads(r.stdout.split("RESULT ", 1)[1])


def test_a_small_pool_runs_more_requests_than_it_holds_preempts_and_loses_nothing(tiny_model):
  # 48 pages of 4 tokens: not one request of max_model_len (256); six requests of ~60 tokens fight for them.
  out = _run(tiny_model, POOL + ['--speculative_config={"method": "ngram", "num_speculative_tokens": 4}'],
             too_long=200)
  assert out["pages"] == 48 and out["pages_per_seq"] == 64
  assert out["peak_rows"] >= 3  # three or four at once where fixed slots of this memory hold none
  assert out["status"]["num_preemptions"] > 0 and out["metrics"]["spec_jax:num_preemptions_total"] > 0
  assert out["status"]["kv_shrunk_steps"] > 0 and out["status"]["kv_shrunk_caps"] > 0  # speculation yielded first
  assert all(len(o) == 40 for o in out["alone"])
  assert out["together"] == out["alone"]
  free0, free1, used = out["pool_back"]
  assert free1 == free0 == out["pages"] and used == 0  # no tail leak
  assert out["metrics"]["spec_jax:kv_cache_pages"] == 48 and out["metrics"]["spec_jax:kv_cache_usage_perc"] == 0
  # The reservation past committed K/V: two calls in flight of T = 4 steps x 5 tokens each, plus a partly filled
  # page, per row (serve/engine/kv_scheduler.py's bound), at most 4 rows.
  st = out["status"]
  assert 0 < st["kv_over_reserved_pages_mean"] <= st["kv_over_reserved_pages_max"] <= 4 * (-(-2 * 20 // 4) + 1)
  field, msg = out["too_long"]  # 8 + 200 + 5 tokens fit max_model_len but need 54 pages: a 400 at once
  assert field == "max_tokens" and "needs 54 KV pages of 4 tokens; the whole pool has 48" in msg


# A covering set, not the product: each method (EAGLE's layer, a draft model's chain, its tree) and each pool dtype
# (float, int8 and fp8 with their scales poisoned too) in at least one case. The poisoned-page path is the pool's,
# the same for every method; what a method adds is its own KV in the page (proposer_bytes), which each case checks.
# The float EAGLE and float tree cases added no path of their own (~3 min of CI's tiny pass, 2026-12-06).
@pytest.mark.parametrize("name,flags", [
    # a float pool (tests/multidevice/test_mesh_paged.py poisons one in make test): make test-full
    pytest.param("draft", ['--speculative_config={"method": "draft", "num_speculative_tokens": 3, "draft_layers": 2}'],
                 marks=pytest.mark.full),
    # 8-bit pools (their scales poisoned too): a draft model's tree on int8, the EAGLE layer on fp8
    ("draft_tree-int8", ["--kv_cache_dtype=int8", '--speculative_config={"method": "draft", "num_speculative_tokens": '
                         '3, "draft_layers": 2, "eagle_topk": 2, "num_draft_tokens": 7}']),
    # the EAGLE layer's pages on fp8: make test-full (the int8 case poisons scales and a proposer's KV in make test;
    # this one, the suite's costliest case, ~3 min, adds fp8's scales and the heads' tiny Llama)
    pytest.param("eagle-fp8", ["--kv_cache_dtype=fp8", '--speculative_config={"method": "eagle", '
                               '"num_speculative_tokens": 3, "model": "%s"}' % os.path.join(HEADS, "eagle1")],
                 marks=pytest.mark.full),
])
def test_poisoned_freed_pages_change_no_output(tiny_model, name, flags):
  model = os.path.join(HEADS, "target") if name.startswith("eagle") else None  # the heads' tiny Llama
  out = _run(tiny_model, POOL + ["--poison_freed_pages", *flags], n=6, max_new=48, model=model)
  assert out["proposer_bytes"] > 0  # the draft model's KV is part of every page
  assert out["kv_cache_dtype"] == (name.split("-")[1] if "-" in name else "auto")
  assert out["status"]["num_preemptions"] > 0
  assert out["together"] == out["alone"]
  assert out["pool_back"][2] == 0


def test_without_yielding_speculation_the_pool_preempts_at_once(tiny_model):
  out = _run(tiny_model, POOL + ["--nokv_speculation_yields",
                                 '--speculative_config={"method": "ngram", "num_speculative_tokens": 4}'])
  assert out["status"]["num_preemptions"] > 0
  assert out["status"]["kv_shrunk_steps"] == 0 and out["status"]["kv_shrunk_caps"] == 0
  assert out["together"] == out["alone"]
  assert out["pool_back"][2] == 0


def test_seeded_sampled_requests_reproduce_across_preemption(tiny_model):
  """Each token's draw is keyed by the request's seed and the token's position (spec_jax/streams.py): a request
  preempted and recomputed draws the same numbers, and against deterministic drafts (n-gram) the verifier commits
  the target's own draw, so sampled output under pressure (preemption, fewer steps, k = 0) equals the request
  alone. Sampled drafts (a draft model at T > 0) stay exact in distribution but not token for token: which
  positions are drafts and which are bonus draws depends on where steps start (docs/architecture.md)."""
  out = _run(tiny_model, POOL + ['--speculative_config={"method": "ngram", "num_speculative_tokens": 4}'],
             sampled=True)
  assert out["status"]["num_preemptions"] > 0
  assert out["together"] == out["alone"]
  assert len({tuple(o) for o in out["alone"]}) == len(out["alone"])  # sampled: six different outputs
  assert out["pool_back"][2] == 0


def test_a_shared_prefix_is_prefilled_once_per_tenant(tiny_model):
  # int8 only: its hit's pages carry their scales as well as the K/V, the salt and tenant keys are the same code
  # for every dtype, and a float pool's hits are checked by tests/multidevice/test_mesh_paged.py (tenants, on a
  # mesh) and tests/serve/test_server_logprobs.py (n choices sharing a prompt's pages).
  out = _run(tiny_model, POOL + ['--speculative_config={"method": "ngram", "num_speculative_tokens": 4}',
                                 "--kv_cache_dtype=int8"], prefix=True)
  assert out["kv_cache_dtype"] == "int8"
  (ref, (q0, h0), n), (_, (q1, h1), _), (hit, (q2, h2), _), (other, (q3, h3), _) = (
      out[k] for k in ("ref", "first", "hit", "other"))
  assert h1 == h0 == 0 and q2 - q1 == n  # the salt "x" kept the first two apart
  assert h2 - h1 >= n - 8  # all of the shared document's full pages but the last (EAGLE's: one less)
  assert hit[0] == ref[0]
  assert h3 == h2 and other[0] == ref[0]  # another tenant: no hit, same output


def test_pool_size_from_flags():
  kw = dict(bytes_per_page=1000, max_num_seqs=4, capacity=128, block_size=16)
  assert pool_pages(num_kv_blocks=0, kv_cache_memory_bytes=0, **kw) == 1 + 4 * 8  # fixed slots' memory
  assert pool_pages(num_kv_blocks=20, kv_cache_memory_bytes=0, **kw) == 20
  assert pool_pages(num_kv_blocks=20, kv_cache_memory_bytes=10_500, **kw) == 10  # bytes win
  with pytest.raises(ValueError, match="at least 2"):
    pool_pages(num_kv_blocks=0, kv_cache_memory_bytes=1500, **kw)
  # data shards: equal shares, each with its null page
  assert pool_pages(num_kv_blocks=0, kv_cache_memory_bytes=0, shards=4, **kw) == 4 * (1 + 1 * 8)
  assert pool_pages(num_kv_blocks=23, kv_cache_memory_bytes=0, shards=4, **kw) == 20
  with pytest.raises(ValueError, match="per data shard"):
    pool_pages(num_kv_blocks=7, kv_cache_memory_bytes=0, shards=4, **kw)
