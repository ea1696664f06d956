"""The server's extended warm-up: before the port opens, the requests clients send first go through the app
in-process (httpx over ASGI, the same routes, templates and engine), so "ready" means their programs are compiled.

Engine.start compiles insert for --warmup_prompt_lens, the loop, release and the switch, but on a state the engine
thread never runs (its arrays are placed differently, which JAX keys its programs on): a first chat, streamed,
structured-output, logprobs or n > 1 request still compiled insert for its prompt bucket, and a structured one its
grammar insert, on arrival: 25-60 s each on a 2-core CPU. Each warm request asks for
2 tokens; one the server's settings refuse (structured outputs with --grammar_capacity=, logprobs with
--max_logprobs=-1) is skipped. They count in /metrics like any request. --extended_warmup=false skips them.
"""

from __future__ import annotations

import asyncio
import logging
import time

import numpy as np

log = logging.getLogger("spec_jax.server")

CHAT = [{"role": "user", "content": "Hello! Can you tell me a short story about a cat?"}]


def requests(cfg: dict, max_logprobs: int, structured: bool, vocab_size: int) -> list:
  """[(name, path, body)] at the server's settings: first a completion of token ids per --warmup_prompt_lens
  length (each its prompt bucket's insert, as the engine thread runs it: Engine.start's own inserts run before the
  thread, on a state traffic never sees, and real requests compiled the bucket again), then the common kinds."""
  rng = np.random.default_rng(0)  # distinct ids per prompt: no prefix-cache hit shortens a later one's bucket
  out = [(f"{n}-token prompt", "/v1/completions",
          {"model": cfg["served_model_name"], "prompt": [int(x) for x in rng.integers(10, vocab_size, n)],
           "max_tokens": 2}) for n in sorted({int(n) for n in cfg["warmup_prompt_lens"]})]
  chat = {"model": cfg["served_model_name"], "messages": CHAT, "max_tokens": 2}
  out += [("chat", "/v1/chat/completions", chat),
         ("chat stream", "/v1/chat/completions", dict(chat, stream=True)),
         ("completion", "/v1/completions", {"model": cfg["served_model_name"], "prompt": "Once upon a time",
                                            "max_tokens": 2}),
         ("n=2", "/v1/chat/completions", dict(chat, n=2))]
  if structured:
    out.append(("structured output", "/v1/chat/completions", dict(chat, response_format={"type": "json_object"})))
  if max_logprobs >= 0:
    out.append(("logprobs", "/v1/chat/completions", dict(chat, logprobs=True, top_logprobs=min(max_logprobs, 2))))
  return out


def run(api, cfg: dict, max_logprobs: int, structured: bool, vocab_size: int) -> list:
  """Send the warm requests one after another through `api`; -> [(name, seconds, status)]. A failed one is logged
  and skipped: the warm-up never stops the server from starting."""
  import httpx  # lazy: heavy, only this path (httpx: the extended warm-up)

  headers = {"Authorization": f"Bearer {cfg['api_key']}"} if cfg.get("api_key") else {}
  logging.getLogger("httpx").setLevel(logging.WARNING)  # one INFO line per request otherwise

  async def send_all():
    done = []
    transport = httpx.ASGITransport(app=api)
    async with httpx.AsyncClient(transport=transport, base_url="http://warmup", headers=headers,
                                 timeout=None) as client:
      for name, path, body in requests(cfg, max_logprobs, structured, vocab_size):
        t = time.perf_counter()
        try:
          r = await client.post(path, json=body)
          status = r.status_code
          if status != 200:
            log.warning("warm-up %s: HTTP %d %s", name, status, r.text[:300])
        except Exception as e:  # noqa: BLE001 (a warm-up failure is logged, never fatal)
          status = 0
          log.warning("warm-up %s failed: %s: %s", name, type(e).__name__, e)
        done.append((name, time.perf_counter() - t, status))
    return done

  return asyncio.run(send_all())
