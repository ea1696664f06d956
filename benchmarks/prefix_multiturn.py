"""Multi-turn chat traffic against two servers, prefix caching on and off: TTFT per turn (issue 35).

  python benchmarks/prefix_multiturn.py [--conversations=12] [--turns=4] [--max_tokens=48] [--json_out=PATH]

Each conversation starts from one of Spec-Bench's two-turn questions and goes on with generic follow-ups; every turn
resends the whole conversation (the model's own answers included), as chat clients do. Both servers (Gemma 3 270M,
the same flags but --enable_prefix_caching) run side by side, idle but for the one request in flight: each
conversation runs on one, then the other, the first server alternating, so the two see the same load (greedy: the
same answers, so the same prompts). Prints TTFT per turn (median over conversations), the per-conversation ratio
off / on for turns 2+, with its spread, and the prefix-cache counters. The machine must be otherwise quiet.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import httpx
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from benchmarks import records  # noqa: E402
from serve.loadtest.launcher import ServerProcess  # noqa: E402

FOLLOW_UPS = ("Summarize your answer in two sentences.", "Give one more example, briefly.",
              "What is the weakest point of your answer?", "Rewrite the first sentence more formally.")
DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "data", "specbench",
                    "spec_bench_question.jsonl")


def conversations(n: int, turns: int) -> list:
  rows = [json.loads(line) for line in open(DATA)]
  two = [r["turns"] for r in rows if len(r["turns"]) >= 2]
  return [(list(t) + list(FOLLOW_UPS))[:turns] for t in two[:n]]


def chat_turn(url: str, messages: list, max_tokens: int) -> tuple:
  """-> (TTFT s, answer text, prompt tokens): one streamed, greedy chat completion."""
  body = {"model": "gemma-3-270m", "messages": messages, "max_tokens": max_tokens, "temperature": 0.0,
          "stream": True, "stream_options": {"include_usage": True}}
  t0, ttft, text, usage = time.perf_counter(), None, [], {}
  with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=300) as r:
    r.raise_for_status()
    for line in r.iter_lines():
      if not line.startswith("data: ") or line == "data: [DONE]":
        continue
      chunk = json.loads(line[6:])
      if chunk.get("usage"):
        usage = chunk["usage"]
      for c in chunk.get("choices") or []:
        piece = (c.get("delta") or {}).get("content")
        if piece:
          if ttft is None:
            ttft = time.perf_counter() - t0
          text.append(piece)
  return ttft, "".join(text), usage.get("prompt_tokens")


def counters(url: str) -> dict:
  from prometheus_client.parser import text_string_to_metric_families
  out = {}
  for fam in text_string_to_metric_families(httpx.get(url + "/metrics", timeout=30).text):
    for s in fam.samples:
      if "prefix_cache" in s.name and s.name.endswith("_total"):
        out[s.name.split(":")[-1]] = s.value
  return out


def main():
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--conversations", type=int, default=12)
  ap.add_argument("--turns", type=int, default=4)
  ap.add_argument("--max_tokens", type=int, default=48)
  ap.add_argument("--speculative_config", default="{}")
  ap.add_argument("--json_out", default="")
  a = ap.parse_args()
  flags = {"config": "configs/gemma3_270m.py", "dtype": "bfloat16", "max_num_seqs": 4, "max_model_len": 2048,
           "warmup_prompt_lens": "1,17,33,65,129,257,513,1025"}  # every prompt bucket compiled before measuring
  spec = json.loads(a.speculative_config)
  logs = "/tmp/spec_jax_prefix_multiturn"
  convs = conversations(a.conversations, a.turns)
  ttft = {"on": np.full((len(convs), a.turns), np.nan), "off": np.full((len(convs), a.turns), np.nan)}
  prompt_tokens = np.zeros((len(convs), a.turns), np.int64)
  with ServerProcess({**flags, "enable_prefix_caching": True}, spec, f"{logs}/on.log", startup_timeout=900) as on, \
       ServerProcess({**flags, "enable_prefix_caching": False}, spec, f"{logs}/off.log", startup_timeout=900) as off:
    urls = {"on": on.url, "off": off.url}
    chat_turn(on.url, [{"role": "user", "content": "Hello."}], 4)  # warm both (compiles are cached by then)
    chat_turn(off.url, [{"role": "user", "content": "Hello."}], 4)
    before = counters(on.url)
    answers = {}
    for i, turns in enumerate(convs):
      for name in (("on", "off") if i % 2 == 0 else ("off", "on")):
        msgs = []
        for t, user in enumerate(turns):
          msgs.append({"role": "user", "content": user})
          ttft[name][i, t], answer, prompt_tokens[i, t] = chat_turn(urls[name], msgs, a.max_tokens)
          msgs.append({"role": "assistant", "content": answer})
        answers[name] = [m["content"] for m in msgs]
      same = answers["on"] == answers["off"]
      print(f"conversation {i}: ttft on {np.round(ttft['on'][i] * 1e3).tolist()} ms, off "
            f"{np.round(ttft['off'][i] * 1e3).tolist()} ms, prompts {prompt_tokens[i].tolist()} tokens, same answers "
            f"{same}", flush=True)
    after = counters(on.url)
  ratio = ttft["off"][:, 1:].mean(axis=1) / ttft["on"][:, 1:].mean(axis=1)  # per conversation, turns 2+
  out = {"conversations": len(convs), "turns": a.turns, "max_tokens": a.max_tokens, "speculative_config": spec,
         "ttft_ms_median_by_turn": {k: np.round(np.nanmedian(v, axis=0) * 1e3, 1).tolist() for k, v in ttft.items()},
         "prompt_tokens_median_by_turn": np.median(prompt_tokens, axis=0).tolist(),
         "off_over_on_turns2plus": {"median": round(float(np.median(ratio)), 3),
                                    "p25": round(float(np.percentile(ratio, 25)), 3),
                                    "p75": round(float(np.percentile(ratio, 75)), 3)},
         "prefix_cache": {k: after.get(k, 0) - before.get(k, 0) for k in after},
         "date": records.now_utc()}
  records.emit(out, a.json_out)


if __name__ == "__main__":
  main()
