"""End to end on Gemma 3 270M: the server's greedy output, with n-gram speculation, is token for token plain
decoding by `serve.generate` (float32), for a completion and a chat request served beside other traffic."""

from __future__ import annotations

import concurrent.futures
import json
import os
import subprocess
import sys

import pytest

from tests.serve.test_server import ROOT, LiveServer

PROMPT = "The three primary colors are"
TURN = "Write one sentence about the sea."
N = 24


@pytest.mark.slow
def test_greedy_server_output_equals_serve_generate(tmp_path):
  prompts = tmp_path / "p.jsonl"
  prompts.write_text(json.dumps({"id": "plain", "prompt": PROMPT}) + "\n" + json.dumps({"id": "chat", "turns": [TURN]})
                     + "\n")
  out = tmp_path / "out.jsonl"
  r = subprocess.run([sys.executable, "-m", "serve.generate", f"--prompts={prompts}", f"--output={out}",
                      f"--max_new_tokens={N}", "--dtype=float32", "--method=none", "--progress=false",
                      "--config.costs_file="],
                     cwd=ROOT, capture_output=True, text=True, timeout=900)
  assert r.returncode == 0, r.stderr[-3000:]
  ref = {x["id"]: x for x in map(json.loads, out.read_text().splitlines())}

  # Greedy output does not depend on the step costs: both sides use the default cost model.
  server = LiveServer("--dtype=float32", "--max_num_seqs=4", "--max_model_len=512", "--warmup_prompt_lens=1",
                      "--extended_warmup=false",
                      "--costs_file=",
                      f"--compilation_cache_dir={os.path.join(str(tmp_path), 'xla_cache')}", timeout=900)
  try:
    c = server.client(timeout=600)
    model = "gemma-3-270m"
    ids = {"return_token_ids": True}
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
      noise = [pool.submit(c.completions.create, model=model, prompt=f"Count to {i}:", max_tokens=N + 7 * i,
                           temperature=0.8) for i in range(2)]
      plain = pool.submit(c.completions.create, model=model, prompt=PROMPT, max_tokens=N, temperature=0,
                          extra_body=ids)
      chat = pool.submit(c.chat.completions.create, model=model, messages=[{"role": "user", "content": TURN}],
                         max_tokens=N, temperature=0, extra_body=ids)
      plain, chat = plain.result(), chat.result()
      for f in noise:
        f.result()
    for got, rid in ((plain, "plain"), (chat, "chat")):
      choice = got.choices[0].model_extra
      prompt_ids = (got.model_extra if rid == "chat" else choice)["prompt_token_ids"]  # chat: vLLM's top level
      assert prompt_ids == ref[rid]["prompt_token_ids"], rid
      assert choice["token_ids"] == ref[rid]["token_ids"], rid
    if plain.choices[0].finish_reason == "length":  # no stop token for the reference's text to render
      assert plain.choices[0].text == ref["plain"]["text"]
    assert server.metrics()[("spec_jax:spec_decode_num_draft_tokens_total", frozenset())] > 0
  finally:
    assert server.stop() == 0, server.log()[-3000:]
