"""serve.loadtest end to end on a tiny random Gemma 3 served by serve.server's own constructors.

Two in-process servers (build_engine + create_app under uvicorn on loopback): the baseline, which also serves the
"identical" arm, and a planted slow proposer (ngram whose jitted propose() sleeps through io_callback) with adaptive k off so
it drafts every step. A short matrix drives them; the slow arm must get "roll back", the copy "neutral". The same
run checks the files, the percentiles against numpy over the raw records, and /metrics deltas against the per-request
usage sums. A second test lets the tool start `python -m serve.server` itself.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import threading
import time

import jax
import numpy as np
import pytest

from serve.loadtest.pipeline import run
from spec_jax.proposers.ngram import NgramProposer
from tests.serve.test_server import MODEL, WORDS, free_port, write_tiny_model

# Its verdicts come from timings: run alone, never beside an xdist worker (the Makefile's last pass).
pytestmark = pytest.mark.alone

SLOW_S = 0.05  # per proposer call; a tiny-model step takes a few ms
REQUESTS = 16  # per load point: a tiny-model point lasts ~1 s, long enough that one pause does not decide it


def _sleep_then(delay, tokens):
  time.sleep(delay)
  return tokens


@dataclasses.dataclass(frozen=True)
class SlowNgram(NgramProposer):
  """Test-only: ngram drafts, delivered after a host sleep inside the jitted step."""
  delay_s: float = SLOW_S
  name: str = "slow_ngram"

  def propose(self, params, state, ctx, k, key):
    draft, state = super().propose(params, state, ctx, k, key)
    shape = jax.ShapeDtypeStruct(draft.tokens.shape, draft.tokens.dtype)
    toks = jax.experimental.io_callback(functools.partial(_sleep_then, self.delay_s), shape, draft.tokens)
    return draft.replace(tokens=toks), state


class InProcessServer:
  """serve.server.build_engine + serve.http.api.create_app, served by uvicorn in a thread."""

  def __init__(self, model: str, speculative_config: dict, *, slow: bool = False, adaptive: bool = True):
    import uvicorn

    from configs.gemma3_270m import get_config
    from serve import server as S
    from serve.http.api import create_app
    from spec_jax.spec_config import from_dict
    cfg = {**get_config().to_dict(), **S.SERVER_DEFAULTS}
    # One step per engine iteration: every token is its own event, so ITL is a step time, not a batch of them.
    cfg.update(model=model, dtype="float32", max_num_seqs=2, max_model_len=128, served_model_name=MODEL,
               spec=from_dict(speculative_config), adaptive=adaptive, port=free_port(),
               steps_per_sync=1, costs_file="", timing_probe_s=0.5)  # the tiny model has no calibrated step costs
    engine, tokenizer, _ = S.build_engine(cfg)
    if slow:
      p = engine.spec.proposer
      engine.spec = dataclasses.replace(engine.spec, proposer=SlowNgram(k=p.k, ngram_min=p.ngram_min,
                                                                          ngram_max=p.ngram_max))
    engine.start()
    self.engine = engine
    self.server = uvicorn.Server(uvicorn.Config(create_app(engine, tokenizer, cfg), host="127.0.0.1",
                                                port=cfg["port"], log_level="warning", lifespan="off"))
    self.thread = threading.Thread(target=self.server.run, daemon=True)
    self.thread.start()
    end = time.time() + 60
    while not self.server.started:
      if time.time() > end or not self.thread.is_alive():
        raise RuntimeError("uvicorn did not start")
      time.sleep(0.02)
    self.url = f"http://127.0.0.1:{cfg['port']}"

  def stop(self):
    self.server.should_exit = True
    self.thread.join(30)
    self.engine.shutdown(grace_s=1.0)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
  return write_tiny_model(tmp_path_factory.mktemp("tiny") / "tiny.gguf")


@pytest.fixture(scope="module")
def prompts_file(tmp_path_factory):
  rng = np.random.default_rng(0)
  path = tmp_path_factory.mktemp("prompts") / "p.jsonl"
  rows = []
  for i in range(8):
    n = 3 if i % 2 else 12
    text = " ".join(rng.choice(WORDS, size=n))
    rows.append({"id": f"p{i}", "category": "short" if n == 3 else "long", "prompt": text})
  path.write_text("".join(json.dumps(r) + "\n" for r in rows))
  return str(path)


def _cfg(out_dir, prompts, **kw) -> dict:
  c = dict(output_dir=str(out_dir), model_name=MODEL, slots=2, url="", api_key="", prompts=prompts, prompt_limit=0,
           categories=[], output_lengths=[16, 32], prompt_len_edges=[8], seed=0,
           samplings=[{"name": "greedy", "temperature": 0.0, "top_p": 1.0}], closed_levels=[1, 2],
           overload_factor=2.0, open_rates=[], requests_per_point=REQUESTS, requests_per_client=4,
           max_seconds_per_point=60.0, drain_seconds=60.0, warmup_requests=4, request_timeout=120.0,
           sample_interval=0.25, min_segment_requests=2, baseline_repeats=3,
           guardrails={"noise_floor": 0.75, "acceptance_floor": 0.0, "min_requests": 4})
  c.update(kw)
  return c


def test_matrix_slow_arm_rolls_back_identical_is_neutral(tiny_model, prompts_file, tmp_path):
  servers = {}
  t0 = time.time()
  try:
    servers["base"] = InProcessServer(tiny_model, {})
    servers["slow"] = InProcessServer(tiny_model, {"method": "ngram", "num_speculative_tokens": 3}, slow=True,
                                      adaptive=False)
    cfg = _cfg(tmp_path, prompts_file,
               baseline={"name": "baseline", "speculative_config": {}, "url": servers["base"].url},
               # The identical arm is the baseline's own server, measured between two baseline repeats: any
               # difference is time-to-time noise, which the repeats bracket (two servers of one config differed
               # by 2x on a loaded CI machine).
               arms=[{"name": "identical", "speculative_config": {}, "url": servers["base"].url},
                     {"name": "slow_ngram", "speculative_config": {"method": "ngram", "num_speculative_tokens": 3},
                      "url": servers["slow"].url, "pid": os.getpid()}])
    print(f"servers up in {time.time() - t0:.1f} s")  # pytest shows the run's log when a test fails
    t0 = time.time()
    summary = run(cfg, str(tmp_path), verify_tuned=True, log=lambda *a: print(f"{time.time() - t0:6.1f}", *a))
  finally:
    for s in servers.values():
      s.stop()

  # Files: report (verdict first), plots, raw records, tuned config the server accepts.
  report = (tmp_path / "report.md").read_text()
  assert report.index("## Verdict") < report.index("## Measurements per load point")
  assert report.index("## KV cache per load point") < report.index("## Plots")  # issue 35's columns
  for png in ("latency_throughput.png", "ttft_itl_distributions.png", "acceptance_per_position.png",
              "speedup_per_segment.png", "kv_usage.png"):
    assert (tmp_path / png).stat().st_size > 1000
  records = [json.loads(l) for l in (tmp_path / "records.jsonl").read_text().splitlines()]
  arms = ("baseline", "identical", "slow_ngram", "baseline#2", "baseline#3")
  assert {r["arm"] for r in records} == set(arms)
  assert all(r["status"] == "ok" for r in records), [r["error"] for r in records if r["status"] != "ok"][:3]
  assert all(r["completion_tokens"] == r["max_tokens"] for r in records)  # the tiny model never stops early
  assert all(r["token_count_source"] == "token_ids" for r in records)
  from spec_jax.spec_config import parse
  tuned = json.loads((tmp_path / "speculative_config.json").read_text())
  parse(json.dumps(tuned))
  assert tuned == {}  # nothing wins here: k = 0 everywhere

  # Verdicts.
  v, o = summary["verdicts"], summary["overall"]
  for key in ("greedy/c1", "greedy/c2"):
    cell = v["slow_ngram"][key]["all"]
    assert cell["verdict"] == "roll back" and cell["metric"] in ("itl_p95", "req_s"), cell
    assert v["identical"][key]["all"]["verdict"] == "neutral", v["identical"][key]["all"]
  assert o["slow_ngram"]["overall"] == "roll back" and o["identical"]["overall"] == "neutral"
  assert summary["noise"]["greedy/c1"]["itl_p95"] is not None

  # Percentiles: numpy over the raw records.
  for arm in arms:
    for key in ("greedy/c1", "greedy/c2"):
      ok = [r for r in records if r["arm"] == arm and r["point"] == key]
      st = summary["stats"][arm][key]["all"]
      assert st["completed"] == len(ok) == REQUESTS
      assert st["ttft_p50"] == pytest.approx(np.percentile([r["ttft"] for r in ok], 50))
      assert st["e2e_p95"] == pytest.approx(np.percentile([r["e2e"] for r in ok], 95))
      assert st["itl_p95"] == pytest.approx(np.percentile(np.concatenate([r["itl"] for r in ok]), 95))
      assert st["tpot_mean"] == pytest.approx(np.mean([r["tpot"] for r in ok]))
      long = [r for r in ok if r["category"] == "long"]
      assert summary["stats"][arm][key]["category=long"]["itl_p50"] == pytest.approx(
          np.percentile(np.concatenate([r["itl"] for r in long]), 50))

  # /metrics deltas against the per-request usage sums.
  points = json.loads((tmp_path / "points.json").read_text())
  for arm in arms:
    for key, p in points[arm]["points"].items():
      ok = [r for r in records if r["arm"] == arm and r["point"] == key]
      sp = p["metrics"]["speculation"]
      assert sp["draft_tokens"] == sum(r["drafted_tokens"] for r in ok)
      assert sp["accepted_tokens"] == sum(r["accepted_tokens"] for r in ok)
      assert p["metrics"]["generation_tokens"] == sum(r["completion_tokens"] for r in ok)
      assert all(c["match"] for c in p["usage_check"].values() if isinstance(c, dict))
      if arm == "slow_ngram":
        assert sp["draft_tokens"] > 0 and sp["drafts"] > 0
      else:
        assert sp["draft_tokens"] == 0
  # The timing probe: the sleeping proposer is most of a step; the arms that never draft have no proposer time.
  for key in ("greedy/c1", "greedy/c2"):
    m = points["slow_ngram"]["points"][key]["metrics"]
    assert m["timing_probes"] >= 1 and m["proposer_share"] > 0.5, m
    assert m["step_seconds"] / m["timing_probes"] > SLOW_S
    assert points["identical"]["points"][key]["metrics"]["proposer_share"] is None
  assert points["slow_ngram"]["server"]["reported"]["speculation"]["method"] == "slow_ngram"
  assert points["identical"]["server"]["reported"]["speculation"]["k_max"] == 0
  assert points["slow_ngram"]["points"]["greedy/c1"]["samples"]["rss_bytes"]["max"] > 0
  # Slot occupancy: the slow arm's points last seconds; the baseline's (< 1 s) may fall between two samples.
  assert points["slow_ngram"]["points"]["greedy/c2"]["samples"]["slots_in_use"]["max"] >= 1
  # The KV pool: pages held while the slow arm's requests ran; counters present (0 preemptions: a roomy pool)
  assert points["slow_ngram"]["points"]["greedy/c2"]["samples"]["kv_usage"]["max"] > 0
  assert points["slow_ngram"]["points"]["greedy/c2"]["metrics"]["preemptions"] == 0
  assert points["slow_ngram"]["points"]["greedy/c2"]["metrics"]["prefix_cache_queries"] > 0


def test_tool_starts_and_stops_the_server(tiny_model, prompts_file, tmp_path):
  cfg = _cfg(tmp_path, prompts_file, baseline_repeats=1, arms=[], closed_levels=[2], requests_per_point=4,
             requests_per_client=2, warmup_requests=2,
             server={"flags": {"model": tiny_model, "dtype": "float32", "max_num_seqs": 2, "max_model_len": 128,
                               "served_model_name": MODEL}, "startup_timeout": 600, "stop_grace": 30})
  summary = run(cfg, str(tmp_path), verify_tuned=False, plots=False, log=lambda *a: None)
  points = json.loads((tmp_path / "points.json").read_text())
  srv = points["baseline"]["server"]
  assert srv["launched"] and srv["exit_code"] == 0  # SIGTERM: drained and exited cleanly
  assert "--speculative_config={}" in srv["argv"] and f"--model={tiny_model}" in srv["argv"]
  assert srv["reported"]["speculation"]["method"] == "none" and srv["reported"]["models"]["data"][0]["id"] == MODEL
  assert "ready: http://" in (tmp_path / "server_baseline.log").read_text()
  assert points["baseline"]["points"]["greedy/c2"]["samples"]["rss_bytes"]["max"] > 10 * 2**20
  assert summary["stats"]["baseline"]["greedy/c2"]["all"]["completed"] == 4
  assert summary["fixed_settings"]["identical"] and (tmp_path / "report.md").exists()
