"""serve.server as a client sees it: a live server (a subprocess on loopback) driven with the real `openai` client.

The model is a tiny random Gemma 3 written to a GGUF file with a tiny SentencePiece vocabulary, so the server
loads it exactly as it loads Gemma 3 270M. The embedding rows of its stop tokens are zero, so greedy decoding
never stops early and every request runs to max_tokens (token counts are exact).
"""

from __future__ import annotations

import concurrent.futures
import functools
import os
import signal
import socket
import subprocess
import sys
import time

import httpx
import jax
import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MODEL = "tiny-test"
WORDS = ["the", "cat", "sat", "on", "mat", "dog", "ran", "and", "a", "is"]


def write_tiny_model(path) -> str:
  """A GGUF holding both a tiny random Gemma 3 and a tokenizer (Gemma's special layout, bytes, letters, words)."""
  from spec_jax.models.transformer import init_params
  from tests.checkpoints.gguf_writer import write_tiny_gguf
  from tests.conftest import tiny_gemma_config

  tokens = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>", "<start_of_turn>", "<end_of_turn>", "  ", "   "]
  types = [3, 3, 3, 3, 3, 3, 3, 4, 4]
  tokens += [f"<0x{b:02X}>" for b in range(256)]
  types += [6] * 256
  tokens += ["\u2581"] + [chr(c) for c in range(ord("a"), ord("z") + 1)] + ["\u2581" + w for w in WORDS]
  types += [1] * (27 + len(WORDS))
  scores = [-1000.0] * 9 + [0.0] * 256 + [-float(i) for i in range(27)] + [10.0] * len(WORDS)
  config = tiny_gemma_config(vocab_size=len(tokens), num_layers=6, global_every=6, eos_ids=(1, 6), max_seq_len=1024)
  params = jax.tree.map(np.asarray, init_params(config, jax.random.PRNGKey(0)))
  embed = np.array(params["embed"])
  embed[[1, 6, 106]] = 0.0  # stop tokens (<eos>, <end_of_turn>, id 106) never win: runs end at max_tokens
  params["embed"] = embed

  def tokenizer(w):
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_unk_token_id(3)
    w.add_add_space_prefix(False)

  write_tiny_gguf(path, config, params, extra=tokenizer)
  return str(path)


def free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


class LiveServer:
  """`python -m serve.server ...` on a free loopback port; stopped (SIGTERM, then SIGKILL) when the test ends."""

  def __init__(self, *args, api_key: str | None = None, timeout: float = 300, env=None):
    self.port = free_port()
    self.url = f"http://127.0.0.1:{self.port}"
    self.api_key = api_key
    cmd = [sys.executable, "-m", "serve.server", f"--port={self.port}", *args]
    if api_key:
      cmd.append(f"--api_key={api_key}")
    self.log_path = os.path.join(os.environ.get("TMPDIR", "/tmp"), f"spec_jax_server_{self.port}.log")
    self._log = open(self.log_path, "w+")
    self.proc = subprocess.Popen(cmd, cwd=ROOT, stdout=self._log, stderr=subprocess.STDOUT,
                                 env={**os.environ, **(env or {})})
    end = time.time() + timeout
    while time.time() < end:
      if self.proc.poll() is not None:
        raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log()[-4000:]}")
      if "ready: http://" in self.log():
        return
      time.sleep(0.1)
    self.stop()
    raise RuntimeError(f"server not ready after {timeout} s:\n{self.log()[-4000:]}")

  def log(self) -> str:
    with open(self.log_path) as f:
      return f.read()

  def client(self, **kw):
    import openai
    return openai.OpenAI(base_url=f"{self.url}/v1", api_key=self.api_key or "none", max_retries=0, **kw)

  def http(self, **kw) -> httpx.Client:
    headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
    return httpx.Client(base_url=self.url, headers=headers, timeout=60, **kw)

  def metrics(self) -> dict:
    """{(name, frozenset(labels)): value} parsed with prometheus_client's own parser."""
    from prometheus_client.parser import text_string_to_metric_families
    text = httpx.get(f"{self.url}/metrics", timeout=30).text
    out = {}
    for fam in text_string_to_metric_families(text):
      for s in fam.samples:
        out[(s.name, frozenset(s.labels.items()))] = s.value
    return out

  def stop(self, sig=signal.SIGTERM, timeout: float = 60) -> int:
    if self.proc.poll() is None:
      self.proc.send_signal(sig)
      try:
        self.proc.wait(timeout)
      except subprocess.TimeoutExpired:
        self.proc.kill()
        self.proc.wait()
    self._log.close()
    return self.proc.returncode


def metric(m: dict, name: str, **labels) -> float:
  return m.get((name, frozenset((k, str(v)) for k, v in labels.items())), 0.0)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> str:
  """The model file, beside a compilation cache that every server of the session shares (the first compiles).

  One fixed path under the session's base directory: other test modules import this fixture, and each import is
  a fixture of its own, but they all find the same file and cache."""
  path = tmp_path_factory.getbasetemp() / "tiny_server_model" / "tiny.gguf"
  if not path.exists():
    path.parent.mkdir(exist_ok=True)
    write_tiny_model(path)
  return str(path)


def tiny_server(tiny_model, *args, **kw) -> LiveServer:
  """Every tiny server has the same slots, capacity and proposer, so all but the first load their programs from
  the shared compilation cache. The config's calibrated step costs are Gemma's: the tiny model uses the default."""
  cache = os.path.join(os.path.dirname(tiny_model), "xla_cache")
  # --default_max_tokens: a request without max_tokens stops at 64 tokens (the tiny model never stops on its own)
  return LiveServer(f"--model={tiny_model}", "--dtype=float32", f"--served_model_name={MODEL}", "--max_model_len=256",
                    "--max_num_seqs=4", "--steps_per_sync=4", "--default_max_tokens=64",
                    "--warmup_prompt_lens=1,17,33", "--costs_file=",
                    "--extended_warmup=false",  # test_server_warmup.py checks it; the rest count requests exactly
                    f"--compilation_cache_dir={cache}",
                    '--speculative_config={"method": "ngram", "num_speculative_tokens": 4}', *args, **kw)


@pytest.fixture(scope="module")
def server(tiny_model):
  s = tiny_server(tiny_model, "--max_queue=64", api_key="sekret")
  yield s
  assert s.stop() == 0, s.log()[-3000:]


# ------------------------------------------------------------------------------------------------ reference

@functools.lru_cache(maxsize=None)
def _loaded(model_path: str):
  from spec_jax.checkpoints.load import load_model
  return load_model(model_path, "float32")


def reference_greedy(model_path: str, prompt: str, max_new: int) -> list:
  """The same prompt alone through the library's batch generate (the path serve.generate runs)."""
  from spec_jax.batch import generate
  config, params, tok = _loaded(model_path)
  res = generate(params, config, [tok.encode(prompt)], max_new_tokens=max_new, stop_ids=tok.stop_ids)
  return res.token_ids[0]


# ------------------------------------------------------------------------------------------------------ tests

def test_completion_and_chat_streamed_and_not(server):
  c = server.client()
  r = c.completions.create(model=MODEL, prompt="the cat sat", max_tokens=12, temperature=0,
                           extra_body={"return_token_ids": True})
  ch = r.choices[0]
  assert ch.finish_reason == "length" and r.usage.completion_tokens == 12
  assert len(ch.model_extra["token_ids"]) == 12
  assert r.usage.prompt_tokens == len(ch.model_extra["prompt_token_ids"])
  extra = r.usage.model_extra
  assert extra["drafted_tokens"] >= extra["accepted_tokens"] >= 0

  # Streamed: the text pieces join to the non-streamed text, usage comes last, then [DONE] (the client stops).
  pieces, finish, usage = [], None, None
  for ev in c.completions.create(model=MODEL, prompt="the cat sat", max_tokens=12, temperature=0, stream=True,
                                 stream_options={"include_usage": True}):
    if ev.choices:
      pieces.append(ev.choices[0].text)
      finish = ev.choices[0].finish_reason or finish
    else:
      usage = ev.usage
  assert "".join(pieces) == ch.text and finish == "length"
  assert usage is not None and usage.completion_tokens == 12 and usage.prompt_tokens == r.usage.prompt_tokens

  msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "the dog ran"}]
  r = c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=9, temperature=0)
  assert r.choices[0].message.role == "assistant" and r.choices[0].finish_reason == "length"
  assert r.usage.completion_tokens == 9
  roles, text = [], []
  for ev in c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=9, temperature=0, stream=True):
    d = ev.choices[0].delta
    roles.append(d.role)
    text.append(d.content or "")
  assert roles[0] == "assistant" and "".join(text) == r.choices[0].message.content

  # Raw SSE: every event is a data line and the stream ends with [DONE].
  with server.http() as h, h.stream("POST", "/v1/completions", json={"model": MODEL, "prompt": "a", "max_tokens": 3,
                                                                     "stream": True}) as resp:
    lines = [l for l in resp.iter_lines() if l]
  assert all(l.startswith("data: ") for l in lines) and lines[-1] == "data: [DONE]"

  models = c.models.list()
  assert [m.id for m in models.data] == [MODEL]


def test_greedy_matches_generate_under_concurrency(server, tiny_model):
  """32 concurrent streams over 4 slots: each completes with its token count, and greedy output is token for token
  the library's batch generate on the prompt alone, whatever slot it landed in and whatever ran beside it."""
  c = server.client()
  prompts = ["the cat sat on the mat", "a dog ran", "the the the the", "is a cat and a dog"]
  jobs = [(prompts[i % 4], 5 + (i * 7) % 20) for i in range(32)]

  def run(job):
    prompt, n = job
    ids, usage, finish = [], None, None
    for ev in c.completions.create(model=MODEL, prompt=prompt, max_tokens=n, temperature=0, stream=True,
                                   stream_options={"include_usage": True}, extra_body={"return_token_ids": True}):
      if ev.choices:
        ids += ev.choices[0].model_extra.get("token_ids") or []
        finish = ev.choices[0].finish_reason or finish
      else:
        usage = ev.usage
    return ids, usage, finish

  with concurrent.futures.ThreadPoolExecutor(32) as pool:
    results = list(pool.map(run, jobs))
  longest = {}
  for (p, n), (ids, usage, finish) in zip(jobs, results):
    assert finish == "length" and usage.completion_tokens == n == len(ids), (p, n, len(ids), usage)
    if n > len(longest.get(p, [])):
      longest[p] = ids
  for p, ids in longest.items():
    ref = reference_greedy(tiny_model, p, len(ids))
    assert ids == ref, p
  for (p, n), (ids, _, _) in zip(jobs, results):
    assert ids == longest[p][:n]  # a shorter run is a prefix of the longest on the same prompt


def test_stop_strings_and_per_request_speculation_off(server):
  c = server.client()
  full = c.completions.create(model=MODEL, prompt="the cat", max_tokens=40, temperature=0).choices[0].text
  assert len(full) > 6
  stop = full[3:5]
  cut = full[:full.find(stop)]
  r = c.completions.create(model=MODEL, prompt="the cat", max_tokens=40, temperature=0, stop=[stop, "\x00never"])
  assert r.choices[0].text == cut and r.choices[0].finish_reason == "stop"
  assert r.usage.completion_tokens < 40
  streamed = "".join(ev.choices[0].text for ev in c.completions.create(
      model=MODEL, prompt="the cat", max_tokens=40, temperature=0, stop=stop, stream=True) if ev.choices)
  assert streamed == cut
  off = c.completions.create(model=MODEL, prompt="the cat", max_tokens=40, temperature=0,
                             extra_body={"speculate": False})
  assert off.choices[0].text == full and off.usage.model_extra["drafted_tokens"] == 0


def test_bad_inputs_get_openai_errors_and_the_server_keeps_serving(server):
  import openai
  c = server.client()
  with server.http() as h:
    r = h.post("/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    for body, param in [({"model": MODEL, "prompt": "a", "max_tokens": "many"}, "max_tokens"),
                        ({"model": MODEL, "prompt": "a", "temperature": "hot"}, "temperature"),
                        ({"model": MODEL, "prompt": 5}, "prompt"),
                        ({"model": MODEL, "prompt": "a", "stream": "yes"}, "stream")]:
      r = h.post("/v1/completions", json=body)
      assert r.status_code == 400, body
      assert r.json()["error"]["param"].startswith(param), r.json()
    r = h.post("/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "robot", "content": "x"}]})
    assert r.status_code == 400 and "role" in r.json()["error"]["message"]
    r = h.post("/v1/completions", json={"model": MODEL, "prompt": "a", "unknown_field": 1, "max_tokens": 2})
    assert r.status_code == 200  # unknown fields are ignored
  cases = [dict(prompt=""), dict(prompt="the cat " * 200), dict(prompt="a", max_tokens=0),
           dict(prompt="a", max_tokens=10_000), dict(prompt="a", temperature=-1), dict(prompt="a", top_p=0),
           dict(prompt="a", top_p=1.5), dict(prompt="a", n=0), dict(prompt="a", n=2, best_of=1),
           dict(prompt="a", extra_body={"top_k": -5})]
  for kw in cases:
    with pytest.raises(openai.BadRequestError) as e:
      c.completions.create(model=MODEL, **{"max_tokens": 4, **kw})
    assert e.value.status_code == 400 and e.value.body["message"], kw
  with pytest.raises(openai.NotFoundError):
    c.completions.create(model="gpt-4", prompt="a", max_tokens=2)
  bad_key = server.client()
  bad_key.api_key = "wrong"
  with pytest.raises(openai.AuthenticationError):
    bad_key.completions.create(model=MODEL, prompt="a", max_tokens=2)
  assert httpx.post(f"{server.url}/v1/completions", json={"model": MODEL, "prompt": "a"}).status_code == 401
  assert httpx.get(f"{server.url}/health").status_code == 200  # /health and /metrics need no key
  r = c.completions.create(model=MODEL, prompt="still alive", max_tokens=3)
  assert r.usage.completion_tokens == 3
  m = server.metrics()
  assert metric(m, "spec_jax:request_errors_total", kind="bad_request") >= len(cases)
  assert metric(m, "spec_jax:request_errors_total", kind="unauthorized") >= 2


def test_disconnect_frees_the_slot(server):
  before = metric(server.metrics(), "spec_jax:request_success_total", finished_reason="abort")
  with server.http() as h, h.stream("POST", "/v1/completions", json={
      "model": MODEL, "prompt": "the dog", "max_tokens": 200, "stream": True}) as resp:
    for i, _ in enumerate(resp.iter_lines()):
      if i >= 2:
        break  # leave mid-stream: closing the response closes the connection
  end = time.time() + 20
  while time.time() < end:
    m = server.metrics()
    if (metric(m, "spec_jax:num_slots_in_use") == 0 and
        metric(m, "spec_jax:request_success_total", finished_reason="abort") == before + 1):
      break
    time.sleep(0.1)
  assert metric(m, "spec_jax:num_slots_in_use") == 0
  assert metric(m, "spec_jax:request_success_total", finished_reason="abort") == before + 1


def test_metrics_parse_and_add_up(server):
  c = server.client()
  m0 = server.metrics()
  usages = [c.completions.create(model=MODEL, prompt=p, max_tokens=30, temperature=0).usage
            for p in ("the the the the the", "cat sat cat sat cat sat", "a b c")]
  m1 = server.metrics()
  delta = lambda name, **l: metric(m1, name, **l) - metric(m0, name, **l)
  drafted = sum(u.model_extra["drafted_tokens"] for u in usages)
  accepted = sum(u.model_extra["accepted_tokens"] for u in usages)
  drafts = sum(u.model_extra["num_drafts"] for u in usages)
  assert drafted > 0
  assert delta("spec_jax:spec_decode_num_draft_tokens_total") == drafted
  assert delta("spec_jax:spec_decode_num_accepted_tokens_total") == accepted
  assert delta("spec_jax:spec_decode_num_drafts_total") == drafts
  per_pos = [metric(m1, "spec_jax:spec_decode_num_accepted_tokens_per_pos_total", position=p) for p in range(4)]
  assert sum(per_pos) == metric(m1, "spec_jax:spec_decode_num_accepted_tokens_total")
  assert all(x <= metric(m1, "spec_jax:spec_decode_num_drafts_total") for x in per_pos)
  assert per_pos == sorted(per_pos, reverse=True)  # position p + 1 is only accepted after position p
  assert delta("spec_jax:generation_tokens_total") == sum(u.completion_tokens for u in usages)
  assert delta("spec_jax:request_success_total", finished_reason="length") == 3
  assert delta("spec_jax:time_to_first_token_seconds_count") == 3
  assert delta("spec_jax:e2e_request_latency_seconds_count") == 3
  assert delta("spec_jax:inter_token_latency_seconds_count") > 0
  assert metric(m1, "spec_jax:num_slots") == 4 and metric(m1, "spec_jax:speculation_enabled") == 1


# A prompt that repeats itself: the n-gram proposer finds drafts from the first step on.
COPY_PROMPT = "the cat sat on the mat. the cat sat on the mat. the cat sat"


def test_admin_switch_rolls_back_without_restart(server):
  c = server.client()
  with server.http() as h:
    assert h.post("/admin/speculation", json={"enabled": "no"}).status_code == 400
    assert httpx.post(f"{server.url}/admin/speculation", json={"enabled": False}).status_code == 401
    ref = c.completions.create(model=MODEL, prompt=COPY_PROMPT, max_tokens=30, temperature=0)
    r = h.post("/admin/speculation", json={"enabled": False})
    assert r.status_code == 200 and r.json()["enabled"] is False
    off = c.completions.create(model=MODEL, prompt=COPY_PROMPT, max_tokens=30, temperature=0)
    assert off.choices[0].text == ref.choices[0].text and off.usage.model_extra["drafted_tokens"] == 0
    assert metric(server.metrics(), "spec_jax:speculation_enabled") == 0
    assert h.post("/admin/speculation", json={"enabled": True}).json()["enabled"] is True
    on = c.completions.create(model=MODEL, prompt=COPY_PROMPT, max_tokens=30, temperature=0)
    assert on.choices[0].text == ref.choices[0].text and on.usage.model_extra["drafted_tokens"] > 0
  m = server.metrics()
  assert metric(m, "spec_jax:speculation_switches_total", segment="all", enabled="false", reason="admin") >= 1
  assert metric(m, "spec_jax:speculation_switches_total", segment="all", enabled="true", reason="admin") >= 1
