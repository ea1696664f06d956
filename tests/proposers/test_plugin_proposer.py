"""A new proposer takes its own file, registered when imported (tests/proposers/toy_repeat.py): loaded with
--plugins, it runs through serve.generate and the server as a built-in method does, and stays lossless."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.serve.test_server import MODEL, ROOT, reference_greedy, tiny_model, tiny_server  # noqa: F401 (a fixture)

PLUGIN = "--plugins=tests.proposers.toy_repeat"
PROMPTS = ["the cat sat on the mat", "a a a a a a a a", "dog dog dog ran"]


def test_the_registry_takes_it():
  import tests.proposers.toy_repeat  # noqa: F401 (registers "repeat")
  from spec_jax.proposers import registry
  from spec_jax.proposers.registry import Target
  from spec_jax.spec_config import SpecConfig, parse
  assert "repeat" in registry.METHODS
  sc = parse('{"method": "repeat", "num_speculative_tokens": 3}')
  assert (sc.method, sc.k) == ("repeat", 3)
  with pytest.raises(ValueError, match="already registered"):
    registry.register("repeat", registry.Method(lambda a: None))
  with pytest.raises(ValueError, match="repeat drafts chains"):
    registry.build_proposer(SpecConfig("repeat", 3, eagle_topk=2), Target(None, None))
  with pytest.raises(ValueError, match="unknown method 'nope'"):
    parse('{"method": "nope"}')


def _generate(tiny_model, tmp_path, *args):
  prompts = tmp_path / "prompts.jsonl"
  prompts.write_text("".join(json.dumps({"id": str(i), "prompt": p}) + "\n" for i, p in enumerate(PROMPTS)))
  return subprocess.run([sys.executable, "-m", "serve.generate", f"--model={tiny_model}", "--dtype=float32",
                         "--max_new_tokens=20", "--batch_size=1", "--costs_file=", f"--prompts={prompts}",
                         "--noprogress", *args], cwd=ROOT, capture_output=True, text=True, timeout=900)


def test_serve_generate_runs_it_lossless(tiny_model, tmp_path):  # noqa: F811
  out, summary = tmp_path / "out.jsonl", tmp_path / "summary.json"
  r = _generate(tiny_model, tmp_path, PLUGIN, "--method=repeat", "--num_speculative_tokens=3", "--compare",
                "--noadaptive", f"--output={out}", f"--summary_json={summary}")
  assert r.returncode == 0, r.stderr[-3000:]
  records = [json.loads(line) for line in out.read_text().splitlines()]
  assert len(records) == len(PROMPTS)
  assert all(x["token_ids"] == x["baseline_token_ids"] and len(x["token_ids"]) == 20 for x in records)
  s = json.loads(summary.read_text())
  assert s["run"]["method"] == "repeat" and s["speculative"]["drafted_tokens"] > 0
  # without the plugin the name is unknown: a clear error, exit 2
  r = _generate(tiny_model, tmp_path, "--method=repeat", "--num_speculative_tokens=3")
  assert r.returncode == 2 and "unknown method 'repeat'" in r.stderr, r.stderr[-2000:]
  r = _generate(tiny_model, tmp_path, "--plugins=tests.proposers.no_such_module", "--method=repeat")
  assert r.returncode == 2 and "--plugins: cannot import" in r.stderr, r.stderr[-2000:]


def test_the_server_serves_it(tiny_model):  # noqa: F811
  s = tiny_server(tiny_model, PLUGIN, '--speculative_config={"method": "repeat", "num_speculative_tokens": 3}')
  try:
    with s.http() as h:
      assert h.get("/admin/speculation").json()["method"] == "repeat"
      drafted = 0
      for prompt in PROMPTS:
        r = h.post("/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 12, "temperature": 0,
                                            "return_token_ids": True})
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["choices"][0]["token_ids"] == reference_greedy(tiny_model, prompt, 12)
        drafted += body["usage"]["drafted_tokens"]
      assert drafted > 0
  finally:
    assert s.stop() == 0, s.log()[-3000:]
