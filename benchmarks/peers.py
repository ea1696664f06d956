"""Optional peers on the same model and prompts: transformers (torch, CPU) plain greedy, prompt lookup and
assisted generation with a draft model, and llama.cpp (llama-cpp-python) if installed. Each is skipped with a
message when absent.

Run it with an interpreter that has the peer and absl-py installed (never the project's environment), as a
module from the repository root (so that spec_jax's prompt path imports), e.g.:
  /tmp/refenv/bin/python -m benchmarks.peers --per_category=3 --max_new_tokens=64 --json_out=out/peers.json
  /tmp/refenv/bin/python -m benchmarks.peers --gguf=~/.cache/spec_jax/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf \\
      --assistant_gguf=~/.cache/spec_jax/qwen2.5-coder-0.5b-instruct-awq-q4_k_m.gguf --dtypes=float32,bfloat16
Prompts use the GGUF's own chat template (Gemma's when the file has none).
"""

from __future__ import annotations

import collections
import json
import os
import time

from absl import app, flags

from spec_jax import flag_table

from spec_jax.datasets import SPEC_BENCH as SPECBENCH  # noqa: E402
GGUF = os.path.expanduser("~/.cache/spec_jax/gemma-3-270m-Q4_K_M.gguf")
TEMPLATE = "<start_of_turn>user\n{}<end_of_turn>\n<start_of_turn>model\n"

flag_table.define(("per_category", "max_new_tokens", "lookup", "json_out", "gguf", "assistant_gguf", "dtypes",
                   "limit"), per_category=3, max_new_tokens=64, gguf=GGUF, dtypes="float32", limit=0)
FLAGS = flags.FLAGS


def pick(per_category, tok=None, limit=0):
  seen = collections.Counter()
  out = []
  with open(SPECBENCH) as f:
    for line in f:
      r = json.loads(line)
      if seen[r["category"]] < per_category:
        seen[r["category"]] += 1
        q = r["turns"][0].strip()
        if tok is not None and getattr(tok, "chat_template", None):
          text = tok.apply_chat_template([{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True)
        else:
          text = TEMPLATE.format(q)
        out.append((r["category"], text))
  return out[:limit] if limit else out


def run_transformers(prompts, max_new, lookup, gguf_path=GGUF, assistant=None, dtype="float32", tok=None):
  try:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
  except ImportError as e:
    print(f"transformers peer skipped: {e}")
    return None
  torch.set_num_threads(os.cpu_count() or 2)
  dt_ = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
  d, name = os.path.split(gguf_path)
  tok = tok or AutoTokenizer.from_pretrained(d, gguf_file=name)
  model = AutoModelForCausalLM.from_pretrained(d, gguf_file=name, dtype=dt_).eval()
  modes = [("greedy", {}), (f"prompt_lookup_{lookup}", {"prompt_lookup_num_tokens": lookup})]
  if assistant:
    ad, an = os.path.split(assistant)
    draft = AutoModelForCausalLM.from_pretrained(ad, gguf_file=an, dtype=dt_).eval()
    modes.append(("assisted", {"assistant_model": draft}))
  res = {}
  for label, kw in modes:
    per_cat = collections.defaultdict(lambda: [0, 0.0])
    ids0 = tok(prompts[0][1], return_tensors="pt").input_ids
    model.generate(ids0, max_new_tokens=8, do_sample=False, **kw)  # warm-up
    outs = []
    for cat, text in prompts:
      ids = tok(text, return_tensors="pt").input_ids
      t0 = time.perf_counter()
      with torch.no_grad():
        out = model.generate(ids, max_new_tokens=max_new, do_sample=False, min_new_tokens=max_new, **kw)
      dt = time.perf_counter() - t0
      n = out.shape[1] - ids.shape[1]
      per_cat[cat][0] += n
      per_cat[cat][1] += dt
      outs.append(out[0, ids.shape[1]:].tolist())
    res[label] = {"tok_s": {c: n / t for c, (n, t) in per_cat.items()},
                  "all_tok_s": sum(n for n, _ in per_cat.values()) / sum(t for _, t in per_cat.values()),
                  "outputs": outs}
    print(label, f"{res[label]['all_tok_s']:.2f} tok/s", flush=True)
  for label in res:
    same = sum(a == b for a, b in zip(res["greedy"]["outputs"], res[label]["outputs"]))
    print(f"{dtype} {label}: output identical to greedy on {same}/{len(prompts)} prompts; "
          f"{res[label]['all_tok_s'] / res['greedy']['all_tok_s']:.2f}x greedy")
  return res


def run_llama_cpp(prompts, max_new, gguf_path=GGUF):
  """Greedy, one prompt at a time, streamed: end-to-end tok/s (prefill included, as benchmarks/specbench.py
  counts it) and decode-only tok/s (tokens after the first over the time after the first), per category."""
  try:
    import llama_cpp
  except ImportError as e:
    print(f"llama.cpp peer skipped: {e}")
    return None
  llm = llama_cpp.Llama(model_path=gguf_path, n_ctx=4096, n_threads=os.cpu_count() or 2, verbose=False)
  list(llm(prompts[0][1], max_tokens=8, temperature=0.0, stream=True))  # warm-up
  whole = collections.defaultdict(lambda: [0, 0.0])  # category -> tokens, seconds from the request
  after = collections.defaultdict(lambda: [0, 0.0])  # category -> tokens, seconds after the first token
  for cat, text in prompts:
    t0 = time.perf_counter()
    # The stream ends with an empty chunk that carries only the finish reason: not a token.
    stamps = [time.perf_counter() for ch in llm(text, max_tokens=max_new, temperature=0.0, stream=True)
              if ch["choices"][0]["text"] or ch["choices"][0]["finish_reason"] is None]
    if stamps:
      whole[cat][0] += len(stamps)
      whole[cat][1] += stamps[-1] - t0
      after[cat][0] += len(stamps) - 1
      after[cat][1] += stamps[-1] - stamps[0]

  def rates(acc):
    per = {k: n / t for k, (n, t) in acc.items() if t > 0}
    n, t = sum(n for n, _ in acc.values()), sum(t for _, t in acc.values())
    return per, (n / t if t > 0 else float("nan"))

  (tok_s, all_tok_s), (decode_tok_s, all_decode_tok_s) = rates(whole), rates(after)
  res = {"tok_s": tok_s, "decode_tok_s": decode_tok_s, "all_tok_s": all_tok_s, "all_decode_tok_s": all_decode_tok_s,
         "tokens": sum(n for n, _ in whole.values()), "version": llama_cpp.__version__}
  print(f"llama.cpp greedy {all_tok_s:.2f} tok/s end to end, {all_decode_tok_s:.2f} decode only")
  for k in tok_s:
    print(f"  {k:16s} {tok_s[k]:7.2f} {decode_tok_s.get(k, float('nan')):7.2f}")
  return res


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  gguf_path = os.path.expanduser(FLAGS.gguf)
  tok = None
  try:
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(os.path.dirname(gguf_path), gguf_file=os.path.basename(gguf_path))
  except ImportError:
    pass
  prompts = pick(FLAGS.per_category, tok, FLAGS.limit)
  out = {"transformers": {dt: run_transformers(prompts, FLAGS.max_new_tokens, FLAGS.lookup, gguf_path,
                                               os.path.expanduser(FLAGS.assistant_gguf) or None, dt, tok)
                          for dt in FLAGS.dtypes.split(",")},
         "llama_cpp": run_llama_cpp(prompts, FLAGS.max_new_tokens, gguf_path)}
  if FLAGS.json_out:
    for per_dtype in out["transformers"].values():
      for v in (per_dtype or {}).values():
        v.pop("outputs", None)
    with open(FLAGS.json_out, "w") as f:
      json.dump(out, f, indent=1)


if __name__ == "__main__":
  app.run(main)
