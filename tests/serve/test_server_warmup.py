"""The server is warm when it says ready: with the extended warm-up (the default) the first chat, streamed,
structured-output, logprobs and n=2 requests after "ready" take about what the same request takes again (their
programs were compiled before the port opened); the log gives the warm-up's time per request, where the
compilation cache lives, and says the tiny GGUF is a base model. About 1-3 min (the server compiles
everything into a fresh cache).

Timing-based (first against second of the same request, with a wide margin: a compile takes seconds, a tiny-model
request tens of milliseconds), so it runs alone.
"""

import time

import pytest

from tests.serve.test_server import MODEL, tiny_model, tiny_server  # noqa: F401 (a fixture)

pytestmark = pytest.mark.alone

CHAT = [{"role": "user", "content": "the cat sat on the mat and the dog ran"}]


def test_ready_means_warm(tiny_model, tmp_path):  # noqa: F811
  # Its own compilation cache: with the session's shared one a program missed by the warm-up would load in under a
  # second on the first request and could pass unseen.
  s = tiny_server(tiny_model, "--extended_warmup=true", "--max_logprobs=5", timeout=900,
                  env={"JAX_COMPILATION_CACHE_DIR": str(tmp_path / "xla")})
  try:
    log = s.log()
    assert "extended warm-up in" in log and "HTTP" not in log.split("extended warm-up in")[1].split("\n")[0]
    for name in ("chat", "chat stream", "structured output", "logprobs", "n=2"):
      assert f"{name} " in log.split("extended warm-up in")[1].split("\n")[0], name
    assert "persistent compilation cache:" in log and "is a base model" in log
    c = s.http()
    body = {"model": MODEL, "messages": CHAT, "max_tokens": 4}
    cases = {"chat": body, "stream": dict(body, stream=True),
             "structured": dict(body, response_format={"type": "json_object"}),
             "logprobs": dict(body, logprobs=True, top_logprobs=2), "n=2": dict(body, n=2)}
    for name, b in cases.items():
      times = []
      for _ in range(2):
        t = time.perf_counter()
        r = c.post("/v1/chat/completions", json=b)
        times.append(time.perf_counter() - t)
        assert r.status_code == 200, (name, r.text[:300])
      assert times[0] <= 2 * times[1] + 1.0, (name, times)  # a compile on the first would take seconds
  finally:
    assert s.stop() == 0, s.log()[-3000:]
