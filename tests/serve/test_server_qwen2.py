"""The server on a Qwen2-shaped model: a byte-level BPE vocabulary, a ChatML Jinja template from the GGUF, and
an independent draft model (`--speculative_model`) as the proposer. The server never asks which tokenizer it holds;
chat requests go through the file's own template and greedy output equals the library's plain decoding.

The draft is the target's own tiny file, so every greedy draft is right: the test also sees drafts accepted."""

from __future__ import annotations

import functools

import pytest

from tests.checkpoints.tiny_qwen2 import write_tiny_qwen2
from tests.serve.test_server import LiveServer

MODEL = "tiny-qwen2"


@pytest.fixture(scope="module")
def qwen_model(tmp_path_factory) -> str:
  path = tmp_path_factory.mktemp("qwen2_server") / "tiny-qwen2.gguf"
  return write_tiny_qwen2(path, never_stop=True)[0]


@pytest.fixture(scope="module")
def server(qwen_model):
  s = LiveServer(f"--model={qwen_model}", "--dtype=float32", f"--served_model_name={MODEL}", "--max_model_len=256",
                 "--max_num_seqs=2", "--steps_per_sync=4", "--warmup_prompt_lens=1", "--costs_file=",
                 "--extended_warmup=false",
                 "--method=draft", f"--speculative_model={qwen_model}", "--num_speculative_tokens=3",
                 "--compilation_cache_dir=")
  yield s
  assert s.stop() == 0, s.log()[-3000:]


@functools.lru_cache(maxsize=None)
def _loaded(path):
  from spec_jax.checkpoints.load import load_model
  return load_model(path, "float32")


def _plain(path, ids, n):
  from spec_jax.batch import generate
  config, params, tok = _loaded(path)
  return generate(params, config, [ids], max_new_tokens=n, stop_ids=tok.stop_ids).token_ids[0]


def test_chat_goes_through_the_files_template_and_equals_plain_decoding(server, qwen_model):
  _, _, tok = _loaded(qwen_model)
  msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello world"}]
  c = server.client()
  r = c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=10, temperature=0,
                                extra_body={"return_token_ids": True})
  ids = tok.encode(tok.apply_chat_template(msgs))
  assert ids[:1] == [tok.id_of("<|im_start|>")] and tok.id_of("<|im_end|>") in ids
  assert r.usage.prompt_tokens == len(ids)
  want = _plain(qwen_model, ids, 10)
  assert r.choices[0].model_extra["token_ids"] == want
  assert r.choices[0].message.content == tok.decode(want, skip_special=True)
  extra = r.usage.model_extra
  assert extra["drafted_tokens"] > 0 and extra["accepted_tokens"] == extra["drafted_tokens"]  # the draft is the target


def test_streamed_completion_joins_to_the_decoded_text(server, qwen_model):
  _, _, tok = _loaded(qwen_model)
  c = server.client()
  prompt = "<|im_start|>user\nhello 🍕<|im_end|>\n"
  pieces, ids = [], []
  for ev in c.completions.create(model=MODEL, prompt=prompt, max_tokens=16, temperature=0, stream=True,
                                 extra_body={"return_token_ids": True}):
    if ev.choices:
      pieces.append(ev.choices[0].text)
      ids += ev.choices[0].model_extra.get("token_ids") or []
  assert ids == _plain(qwen_model, tok.encode(prompt), 16)
  assert "".join(pieces) == tok.decode(ids, skip_special=True)  # byte tokens of one character arrive joined
