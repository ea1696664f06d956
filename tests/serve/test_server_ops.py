"""Operating the server: overload (429, nothing lost), automatic guardrails that trip and probe, a per-concurrency
speculative config file, and a SIGTERM that drains running requests and exits 0."""

from __future__ import annotations

import concurrent.futures
import json
import signal
import threading
import time

import openai
import pytest

from tests.serve.test_server import MODEL, metric, tiny_model, tiny_server  # noqa: F401 (tiny_model: a fixture)

GUARDRAILS = {"acceptance_floor": 1.01, "acceptance_window_s": 1, "acceptance_for_s": 0.3, "min_drafted": 4,
              "itl_p95_ratio": 0.0, "itl_window_s": 2, "min_itl_samples": 4, "baseline_every_s": 1000,
              "baseline_window_s": 0.5, "cooldown_s": 2, "probe_s": 0.5}


@pytest.fixture(scope="module")
def ops_server(tiny_model, tmp_path_factory):
  spec = tmp_path_factory.mktemp("spec") / "speculative_config.json"
  spec.write_text(json.dumps({"per_concurrency": {"1": {"method": "ngram", "num_speculative_tokens": 4},
                                                  "4": {"num_speculative_tokens": 0}}}))
  # Calibrated step costs (serve.calibrate's format) that make k = 2 prohibitive and k = 4 free: the adaptive
  # controller then never drafts 2 (with the default costs it mostly does).
  costs = spec.parent / "costs.json"
  costs.write_text(json.dumps({"ngram/float32/k4/b4": {"ks": [0, 2, 4], "batch": 4, "occupancies": [1, 4],
                                                    "costs": [[1.0, 1e6, 1.0], [1.0, 1e6, 1.0]]}}))
  s = tiny_server(tiny_model, "--max_queue=2", f"--speculative_config={spec}",
                  f"--guardrails={json.dumps(GUARDRAILS)}", f"--costs_file={costs}")
  yield s
  if s.proc.poll() is None:
    s.stop()


def test_overload_gives_429_and_loses_nothing(ops_server):
  c = ops_server.client()
  m0 = ops_server.metrics()

  def one(i):
    try:
      r = c.completions.create(model=MODEL, prompt=f"the cat {i}", max_tokens=200, temperature=0)
      return ("done", r.usage.completion_tokens, r.choices[0].finish_reason)
    except openai.RateLimitError as e:
      return ("429", e.response.headers.get("retry-after"), e.body)

  with concurrent.futures.ThreadPoolExecutor(24) as pool:
    results = list(pool.map(one, range(24)))
  done = [r for r in results if r[0] == "done"]
  refused = [r for r in results if r[0] == "429"]
  assert len(done) + len(refused) == 24
  assert len(done) >= 6 and refused  # 4 slots + 2 queued at least; the rest bounce
  assert all(n == 200 and f == "length" for _, n, f in done)
  assert all(ra == "1" and body["message"] for _, ra, body in refused)
  m1 = ops_server.metrics()
  assert (metric(m1, "spec_jax:request_errors_total", kind="overloaded") -
          metric(m0, "spec_jax:request_errors_total", kind="overloaded")) == len(refused)
  assert (metric(m1, "spec_jax:request_success_total", finished_reason="length") -
          metric(m0, "spec_jax:request_success_total", finished_reason="length")) == len(done)


def test_guardrails_trip_and_the_probe_fails(ops_server):
  """An acceptance floor nobody meets and an ITL bound of 0 x the baseline: the server measures a k = 0
  baseline window, trips, stays off for the cool-down, probes, and goes off again; every switch is counted."""
  c = ops_server.client()
  stop = threading.Event()

  def traffic():
    while not stop.is_set():
      c.completions.create(model=MODEL, prompt="the the the", max_tokens=40, temperature=0)

  t = threading.Thread(target=traffic)
  t.start()
  try:
    end = time.time() + 60
    while time.time() < end:
      m = ops_server.metrics()
      sw = lambda enabled, reason: metric(m, "spec_jax:speculation_switches_total", segment="default",
                                          enabled=enabled, reason=reason)
      if sw("false", "probe_failed_acceptance") + sw("false", "probe_failed_itl_p95") >= 1:
        break
      time.sleep(0.2)
  finally:
    stop.set()
    t.join()
  assert sw("false", "baseline_window") >= 1 and sw("true", "baseline_done") >= 1
  assert metric(m, "spec_jax:baseline_itl_p95_seconds") > 0
  assert sw("false", "acceptance_floor") + sw("false", "itl_p95") >= 1
  assert sw("true", "probe") >= 1
  assert sw("false", "probe_failed_acceptance") + sw("false", "probe_failed_itl_p95") >= 1
  assert metric(m, "spec_jax:speculation_enabled") == 0
  # Off means off: a request now drafts nothing, and its greedy output is unchanged.
  r = c.completions.create(model=MODEL, prompt="the the the", max_tokens=40, temperature=0)
  assert r.usage.model_extra["drafted_tokens"] == 0
  log = ops_server.log()
  assert "guardrails[default]: speculation off" in log and "guardrails[default]: speculation on (probe)" in log
  # The calibrated costs file was applied: while speculation was on, k = 4 was drafted and k = 2 never.
  steps = lambda k: metric(m, "spec_jax:spec_decode_steps_total", k=k)
  assert steps(4) > 0 and steps(2) == 0


def test_per_concurrency_config_file_and_sigterm_drain(ops_server):
  """Alone (concurrency 1) the file's ngram k = 4 drafts; then SIGTERM mid-stream: the stream still ends normally,
  new requests are refused, and the process exits 0."""
  c = ops_server.client()
  with ops_server.http() as h:
    status = h.get("/admin/speculation").json()
  assert status["k_max"] == 4 and status["method"] == "ngram"
  stream = c.completions.create(model=MODEL, prompt="the dog ran", max_tokens=200, temperature=0, stream=True,
                                stream_options={"include_usage": True})
  events = [next(iter(stream))]
  ops_server.proc.send_signal(signal.SIGTERM)
  events += list(stream)
  finish = [e.choices[0].finish_reason for e in events if e.choices and e.choices[0].finish_reason]
  usage = [e.usage for e in events if not e.choices]
  assert finish == ["length"] and usage[0].completion_tokens == 200
  with pytest.raises((openai.APIConnectionError, openai.InternalServerError)):
    c.completions.create(model=MODEL, prompt="late", max_tokens=2)
  assert ops_server.proc.wait(60) == 0
  assert "draining" in ops_server.log()
