"""Optional peers on the same model and prompts: transformers (torch, CPU) plain greedy and prompt lookup,
and llama.cpp (llama-cpp-python) if installed. Each is skipped with a message when absent.

Run it with an interpreter that has the peer installed (never the project's environment), e.g.:
  /tmp/refenv/bin/python benchmarks/peers.py --per_category=3 --max_new_tokens=64 --json_out=out/peers.json
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import time

SPECBENCH = os.path.join(os.path.dirname(__file__), "..", "..", "shared", "data", "specbench",
                         "spec_bench_question.jsonl")
GGUF = os.path.expanduser("~/.cache/spec_jax/gemma-3-270m-Q4_K_M.gguf")
TEMPLATE = "<start_of_turn>user\n{}<end_of_turn>\n<start_of_turn>model\n"


def pick(per_category):
  seen = collections.Counter()
  out = []
  with open(SPECBENCH) as f:
    for line in f:
      r = json.loads(line)
      if seen[r["category"]] < per_category:
        seen[r["category"]] += 1
        out.append((r["category"], TEMPLATE.format(r["turns"][0].strip())))
  return out


def run_transformers(prompts, max_new, lookup):
  try:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
  except ImportError as e:
    print(f"transformers peer skipped: {e}")
    return None
  torch.set_num_threads(os.cpu_count() or 2)
  d, name = os.path.dirname(GGUF), os.path.basename(GGUF)
  tok = AutoTokenizer.from_pretrained(d, gguf_file=name)
  model = AutoModelForCausalLM.from_pretrained(d, gguf_file=name, dtype=torch.float32).eval()
  res = {}
  for label, kw in (("greedy", {}), (f"prompt_lookup_{lookup}", {"prompt_lookup_num_tokens": lookup})):
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
  same = sum(a == b for a, b in zip(res["greedy"]["outputs"], res[f"prompt_lookup_{lookup}"]["outputs"]))
  print(f"prompt lookup output identical to greedy on {same}/{len(prompts)} prompts")
  return res


def run_llama_cpp(prompts, max_new):
  try:
    from llama_cpp import Llama
  except ImportError as e:
    print(f"llama.cpp peer skipped: {e}")
    return None
  llm = Llama(model_path=GGUF, n_ctx=4096, n_threads=os.cpu_count() or 2, verbose=False)
  n_tot, t_tot = 0, 0.0
  for _, text in prompts:
    t0 = time.perf_counter()
    out = llm(text, max_tokens=max_new, temperature=0.0)
    t_tot += time.perf_counter() - t0
    n_tot += out["usage"]["completion_tokens"]
  print(f"llama.cpp greedy {n_tot / t_tot:.2f} tok/s")
  return {"all_tok_s": n_tot / t_tot}


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--per_category", type=int, default=3)
  ap.add_argument("--max_new_tokens", type=int, default=64)
  ap.add_argument("--lookup", type=int, default=4)
  ap.add_argument("--json_out", default=None)
  args = ap.parse_args()
  prompts = pick(args.per_category)
  out = {"transformers": run_transformers(prompts, args.max_new_tokens, args.lookup),
         "llama_cpp": run_llama_cpp(prompts, args.max_new_tokens)}
  if args.json_out:
    for v in (out["transformers"] or {}).values():
      v.pop("outputs", None)
    with open(args.json_out, "w") as f:
      json.dump(out, f, indent=1)


if __name__ == "__main__":
  main()
