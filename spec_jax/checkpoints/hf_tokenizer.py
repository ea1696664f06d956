"""The tokenizer of a Hugging Face directory that ships `tokenizer.json` (Llama 3, Qwen2/2.5/3, ...) as the spec
`spec_jax.bpe_tokenizer.BPETokenizer` takes: the `tokenizers` pipeline as written, the special tokens and chat
template from `tokenizer_config.json` (or `chat_template.jinja`, where transformers 4.43+ saves it), and whether
a BOS is prepended, as transformers decides it (`add_bos_token`, else what the pipeline's post-processor adds)."""

from __future__ import annotations

import os

from spec_jax.checkpoints.weight_files import read_json


def _token(value, where: str, key: str):
  """tokenizer_config's special token: a string, an AddedToken dict ({"content": ...}) or null."""
  if value is None or isinstance(value, str):
    return value
  if isinstance(value, dict) and isinstance(value.get("content"), str):
    return value["content"]
  raise ValueError(f"{where}: {key} must be a string or an object with 'content', got {value!r}")


def _template(directory: str, cfg: dict, where: str):
  path = os.path.join(directory, "chat_template.jinja")
  if os.path.isfile(path):
    with open(path, encoding="utf-8") as f:
      return f.read()
  t = cfg.get("chat_template")
  if isinstance(t, list):  # named templates: transformers' default is the one named "default"
    named = {d.get("name"): d.get("template") for d in t if isinstance(d, dict)}
    t = named.get("default")
  if t is not None and not isinstance(t, str):
    raise ValueError(f"{where}: chat_template must be a string or a list of named templates")
  return t


def spec(directory: str) -> dict:
  """-> the BPETokenizer spec of `directory` (its tokenizer.json; tokenizer_config.json when present)."""
  import tokenizers  # lazy: heavy, only this path (tokenizers)
  path = os.path.join(directory, "tokenizer.json")
  with open(path, encoding="utf-8") as f:
    text = f.read()
  try:
    tk = tokenizers.Tokenizer.from_str(text)
  except Exception as e:  # tokenizers raises its own Exception subclass on a bad JSON
    raise ValueError(f"{path}: not a valid tokenizers pipeline ({e})") from None
  cfg_path = os.path.join(directory, "tokenizer_config.json")
  cfg = read_json(cfg_path) if os.path.isfile(cfg_path) else {}
  ids = {}
  for key in ("bos_token", "eos_token", "pad_token"):
    tok = _token(cfg.get(key), cfg_path, key)
    i = None if tok is None else tk.token_to_id(tok)
    if tok is not None and i is None:
      raise ValueError(f"{cfg_path}: {key} {tok!r} is not in {path}'s vocabulary")
    ids[key.replace("_token", "_id")] = i
  add_bos = cfg.get("add_bos_token")
  if add_bos is None:  # what the pipeline's post-processor adds around a text (Llama 3's adds its BOS)
    add_bos = ids["bos_id"] is not None and tk.encode("a", add_special_tokens=True).ids[:1] == [ids["bos_id"]]
  return {"tokenizer_json": text, **ids, "add_bos": bool(add_bos),
          "chat_template": _template(directory, cfg, cfg_path)}


def has_tokenizer_json(directory: str) -> bool:
  return os.path.isfile(os.path.join(directory, "tokenizer.json"))

