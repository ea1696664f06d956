"""The engine on its own (no HTTP): an exception inside it fails only the request it touched, with a 500, and the
engine goes on serving. It runs in a subprocess that shares the tiny servers' compilation cache."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from tests.serve.test_server import ROOT, tiny_model  # noqa: F401 (a fixture)

SCRIPT = r"""
import json, os, sys, time
import jax
from absl import flags
jax.config.update("jax_compilation_cache_dir", sys.argv[2])
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
from serve import server
server.define_flags()
flags.FLAGS(["server", f"--model={sys.argv[1]}", "--dtype=float32", "--max_model_len=256", "--max_num_seqs=4",
             "--steps_per_sync=4", "--costs_file=",
             '--speculative_config={"method": "ngram", "num_speculative_tokens": 4}'])
engine, tok, _ = server.build_engine(server.settings())
engine.start(warmup_prompt_lens=[1])
from serve.engine.request_spec import RequestSpec
make = lambda p, n: engine.make_request(RequestSpec(prompt_ids=tuple(tok.encode(p)), max_new=n))
good = [make(p, 10) for p in ("the cat", "a dog ran")]
bad = make("the mat", 10)
# A request the engine cannot insert: its prompt is not padded to a prefill bucket, so tracing the insert raises.
bad.device_req = bad.device_req.replace(tokens=bad.device_req.tokens[:12])
for r in (good[0], bad, good[1]):
  engine.submit(r)
late = make("is a cat", 6)
out = {}
for name, r in (("good0", good[0]), ("bad", bad), ("good1", good[1]), ("late", late)):
  if name == "late":
    engine.submit(late)  # after the failure: the engine still serves
  end = time.time() + 120
  d = None
  while time.time() < end:
    d = r.output.take()
    if d is not None and d.finished:
      break
    time.sleep(0.01)
  out[name] = {"finish": d.finish_reason, "error": d.error, "tokens": d.usage.completion_tokens}
from prometheus_client.parser import text_string_to_metric_families
errors = {s.labels.get("kind"): s.value for f in text_string_to_metric_families(engine.metrics.render().decode())
          for s in f.samples if s.name == "spec_jax:request_errors_total"}
out["engine_errors"] = errors.get("engine", 0)
out["alive"] = engine.alive
engine.shutdown(grace_s=5)
print("RESULT " + json.dumps(out))
"""


def test_an_engine_exception_fails_only_its_request(tiny_model):
  cache = os.path.join(os.path.dirname(tiny_model), "xla_cache")
  r = subprocess.run([sys.executable, "-c", SCRIPT, tiny_model, cache], cwd=ROOT, capture_output=True, text=True,
                     timeout=600)
  assert r.returncode == 0, r.stderr[-3000:]
  out = json.loads(r.stdout.split("RESULT ", 1)[1])
  assert out["bad"]["finish"] is None and out["bad"]["error"][0] == 500 and out["bad"]["error"][1] == "engine"
  for name, n in (("good0", 10), ("good1", 10), ("late", 6)):
    assert out[name]["finish"] == "length" and out[name]["error"] is None and out[name]["tokens"] == n, out
  assert out["engine_errors"] == 1 and out["alive"]
