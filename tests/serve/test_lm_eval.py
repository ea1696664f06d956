"""Issue 36, item 6: lm-evaluation-harness against the server, as evaluation users run it: `local-completions` on
small local tasks (a generate-until and a loglikelihood one: echo + logprobs), with the Hugging Face tokenizer
built from the model's own GGUF (spec_jax/checkpoints/gguf_tokenizer.py: a tiny Qwen2's byte-level BPE pipeline,
Gemma 3's SentencePiece model). A server with speculation and one without give the same generations and the same
loglikelihoods (float32 noise)."""

from __future__ import annotations

import json
import os

import pytest

from tests.checkpoints.tiny_qwen2 import write_tiny_qwen2
from tests.serve.test_server import LiveServer

lm_eval = pytest.importorskip("lm_eval", reason="lm-eval is in the test extra (pyproject.toml)")

MODEL = "tiny-qwen2"
DOCS = [{"question": "hello world", "answer": " world", "choices": [" hello", " world", " a"], "label": 1},
        {"question": "a b a b a", "answer": " b", "choices": [" b", " a", " world hello"], "label": 0},
        {"question": "the the the", "answer": " the", "choices": [" the", " hello world"], "label": 0}]
TASKS = {
    "tiny_generate": {"output_type": "generate_until", "doc_to_target": "{{answer}}",
                      "generation_kwargs": {"until": ["\n"], "max_gen_toks": 6, "do_sample": False},
                      "metric_list": [{"metric": "exact_match"}]},
    "tiny_choice": {"output_type": "multiple_choice", "doc_to_target": "{{label}}", "doc_to_choice": "{{choices}}",
                    "metric_list": [{"metric": "acc"}]},
}


def write_hf_tokenizer(model_path: str, out: str) -> str:
  """A directory transformers' AutoTokenizer loads: the GGUF's own tokenizer (tokenizer.json for byte-level BPE,
  tokenizer.model for SentencePiece: Gemma's, which transformers' GemmaTokenizer reads), and its special tokens."""
  from spec_jax.checkpoints.load import load_tokenizer
  from spec_jax.sentencepiece_tokenizer import SentencePieceTokenizer
  tok = load_tokenizer(model_path)
  os.makedirs(out, exist_ok=True)
  piece = lambda i: tok.piece_of(i) if i >= 0 else None
  config = {"eos_token": piece(tok.eos_id), "bos_token": piece(tok.bos_id), "pad_token": piece(tok.pad_id)}
  if isinstance(tok, SentencePieceTokenizer):
    with open(os.path.join(out, "tokenizer.model"), "wb") as f:
      f.write(tok._sp.serialized_model_proto())
    config.update(tokenizer_class="GemmaTokenizer", add_bos_token=True)
  else:
    with open(os.path.join(out, "tokenizer.json"), "w", encoding="utf-8") as f:
      f.write(tok._json)
    config.update(tokenizer_class="PreTrainedTokenizerFast")
  with open(os.path.join(out, "tokenizer_config.json"), "w", encoding="utf-8") as f:
    json.dump(config, f)
  return out


def write_tasks(out: str) -> str:
  os.makedirs(out, exist_ok=True)
  data = os.path.join(out, "docs.jsonl")
  with open(data, "w", encoding="utf-8") as f:
    f.writelines(json.dumps(d) + "\n" for d in DOCS)
  for name, cfg in TASKS.items():
    with open(os.path.join(out, f"{name}.yaml"), "w", encoding="utf-8") as f:
      json.dump({"task": name, "dataset_path": "json", "dataset_kwargs": {"data_files": {"test": data}},
                 "test_split": "test", "doc_to_text": "{{question}}", **cfg}, f)  # JSON is YAML
  return out


def _evaluate(url: str, tokenizer_dir: str, tasks_dir: str, add_bos: bool) -> dict:
  from lm_eval import simple_evaluate
  from lm_eval.tasks import TaskManager
  args = dict(model=MODEL, base_url=f"{url}/v1/completions", tokenizer=tokenizer_dir,
              tokenizer_backend="huggingface", tokenized_requests=True, num_concurrent=1, max_retries=1,
              max_length=200, add_bos_token=add_bos)
  res = simple_evaluate(model="local-completions", model_args=args, tasks=sorted(TASKS),
                        task_manager=TaskManager(include_path=tasks_dir, include_defaults=False), log_samples=True,
                        bootstrap_iters=0)
  return {t: [s["resps"] for s in sorted(res["samples"][t], key=lambda s: s["doc_id"])] for t in TASKS}


def _agree_with_and_without_speculation(tmp_path, monkeypatch, model: str, flags: tuple, spec: dict,
                                        add_bos: bool = False):
  for var, val in (("HF_DATASETS_OFFLINE", "1"), ("HF_HUB_OFFLINE", "1"), ("HF_HOME", str(tmp_path / "hf")),
                   ("TOKENIZERS_PARALLELISM", "false")):
    monkeypatch.setenv(var, val)
  tokenizer_dir = write_hf_tokenizer(model, str(tmp_path / "tokenizer"))
  tasks_dir = write_tasks(str(tmp_path / "tasks"))
  got = {}
  for name, config in (("spec", spec), ("plain", {})):
    s = LiveServer(f"--model={model}", "--dtype=float32", f"--served_model_name={MODEL}", "--max_model_len=256",
                   "--max_num_seqs=2", "--steps_per_sync=4", "--warmup_prompt_lens=1", "--costs_file=",
                   "--extended_warmup=false",
                   "--noadaptive", f"--speculative_config={json.dumps(config)}", *flags, timeout=900)
    try:
      got[name] = _evaluate(s.url, tokenizer_dir, tasks_dir, add_bos)
      with s.http() as h:
        got[name + "_metrics"] = h.get("/metrics").text
    finally:
      assert s.stop() == 0, s.log()[-3000:]
  gen_s, gen_p = got["spec"]["tiny_generate"], got["plain"]["tiny_generate"]
  assert gen_s == gen_p and all(r[0][0] for r in gen_s)  # the same, non-empty generations
  ll_s, ll_p = got["spec"]["tiny_choice"], got["plain"]["tiny_choice"]
  assert [len(r) for r in ll_s] == [len(d["choices"]) for d in DOCS]
  for doc_s, doc_p in zip(ll_s, ll_p):
    for (lp_s, greedy_s), (lp_p, greedy_p) in ((r[0], q[0]) for r, q in zip(doc_s, doc_p)):
      assert abs(lp_s - lp_p) < 1e-4 and greedy_s == greedy_p and lp_s < 0
  drafted = [line for line in got["spec_metrics"].splitlines() if line.startswith("spec_jax:spec_decode_num_draft_tokens_total")]
  assert drafted and float(drafted[0].split()[-1]) > 0, "speculation ran"
  return got


def test_lm_eval_generate_and_loglikelihood_agree_with_and_without_speculation(tmp_path, monkeypatch):
  model, _ = write_tiny_qwen2(tmp_path / "tiny-qwen2.gguf", never_stop=True)
  _agree_with_and_without_speculation(tmp_path, monkeypatch, str(model), ("--compilation_cache_dir=",),
                                      {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1})


@pytest.mark.slow
@pytest.mark.full  # 1.5 min; the tiny model's lm-eval test runs the same harness in make test
def test_lm_eval_on_gemma3_agrees_with_and_without_speculation(tmp_path, monkeypatch, gemma3_gguf_path):
  """The same on Gemma 3 270M, its tokenizer rebuilt from the GGUF's SentencePiece model (lm-eval adds BOS, as
  Gemma wants)."""
  got = _agree_with_and_without_speculation(
      tmp_path, monkeypatch, gemma3_gguf_path, (f"--compilation_cache_dir={tmp_path / 'xla_cache'}",),
      {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1}, add_bos=True)
  assert any(r[0][0].strip() for r in got["plain"]["tiny_generate"])
