"""A tokenizer built from a GGUF file's tokenizer metadata, cached beside the GGUF.

The GGUF carries the vocabulary as llama.cpp's converter wrote it; `tokenizer.ggml.model` says which kind:

- "llama" (SentencePiece; Gemma 3): pieces, scores, types and the special ids. `build_proto` repairs what the
  converter changed and builds the SentencePiece `ModelProto` that matches Hugging Face transformers' tokenizer
  for the same file.
- "gpt2" (byte-level BPE; Qwen2): tokens, merges, types, the pre-tokenizer's name (`tokenizer.ggml.pre`) and the
  Jinja chat template. `build_bpe_spec` builds the `tokenizers` pipeline transformers builds for the file: its
  BPE over the vocab and merges, the split regex of the named pre-tokenizer, byte-level mapping, no normalizer,
  control tokens (type 3) as special added tokens and user-defined ones (type 4) as plain added tokens.

Reading the metadata of 150-260k pieces takes seconds, so `tokenizer_proto` and `bpe_spec` cache the result beside
the GGUF (see `file_cache`) with the GGUF's fingerprint; later loads read the cache in a fraction of a second.

This module only makes the tokenizer's data (`load` picks the kind and serves it): `SentencePieceTokenizer` /
`BPETokenizer` take it from there, and `spec_jax.checkpoints.load.load_tokenizer` joins the two.
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os

from sentencepiece import sentencepiece_model_pb2 as sp_pb2

from spec_jax.checkpoints.file_cache import atomic_write_bytes, cache_path, fingerprint
from spec_jax.checkpoints.gguf_meta import read_metadata

_WS = "\u2581"  # SentencePiece's whitespace marker
# Bump when the proto built from a GGUF changes, so old caches are rebuilt.
CACHE_FORMAT = 1
CACHE_SUFFIX = ".tokenizer.model"
BPE_CACHE_FORMAT = 1
BPE_CACHE_SUFFIX = ".tokenizer.json"

# GGUF token types (llama.cpp) use the same numbers as SentencePiece's ModelProto.SentencePiece.Type.
_NORMAL, _UNKNOWN, _CONTROL, _USER_DEFINED, _UNUSED, _BYTE = 1, 2, 3, 4, 5, 6

METADATA_KEYS = (
    "general.architecture",
    "tokenizer.ggml.model",
    "tokenizer.ggml.tokens",
    "tokenizer.ggml.scores",
    "tokenizer.ggml.token_type",
    "tokenizer.ggml.bos_token_id",
    "tokenizer.ggml.eos_token_id",
    "tokenizer.ggml.unknown_token_id",
    "tokenizer.ggml.padding_token_id",
    "tokenizer.ggml.add_bos_token",
    "tokenizer.ggml.add_space_prefix",
)


def build_proto(path: str) -> bytes:
  """The serialized SentencePiece model for a GGUF's tokenizer metadata (no cache)."""
  md = read_metadata(path, METADATA_KEYS)
  for key in ("tokenizer.ggml.tokens", "tokenizer.ggml.scores", "tokenizer.ggml.token_type"):
    if key not in md:
      raise ValueError(f"{path}: GGUF file has no {key!r} metadata, so it carries no tokenizer")
  model = md.get("tokenizer.ggml.model")
  if model != "llama":
    raise ValueError(f"{path}: tokenizer model {model!r} is not supported (only SentencePiece 'llama')")
  tokens = md["tokenizer.ggml.tokens"]
  scores = md["tokenizer.ggml.scores"]
  types = md["tokenizer.ggml.token_type"]
  n = len(tokens)
  if len(scores) != n or len(types) != n or n == 0:
    raise ValueError(f"{path}: tokenizer arrays disagree: {n} tokens, {len(scores)} scores, {len(types)} types")

  def special(key: str, default: int | None) -> int | None:
    v = md.get(f"tokenizer.ggml.{key}", default)
    if v is not None and not 0 <= int(v) < n:
      raise ValueError(f"{path}: tokenizer.ggml.{key} = {v} is outside the vocabulary of {n}")
    return None if v is None else int(v)

  bos, eos = special("bos_token_id", None), special("eos_token_id", None)
  unk, pad = special("unknown_token_id", 0), special("padding_token_id", None)

  m = sp_pb2.ModelProto()
  pieces = m.pieces
  seen: dict[str, int] = {}
  for i, (tok, score, ttype) in enumerate(zip(tokens, scores, types)):
    ttype = int(ttype)
    if ttype == _USER_DEFINED and " " in tok:
      # llama.cpp wrote "▁" as a plain space in user-defined pieces (the runs of spaces); put it back.
      tok = tok.replace(" ", _WS)
    if i == unk:
      ttype = _UNKNOWN  # the GGUF marks <unk> CONTROL; SentencePiece needs exactly one UNKNOWN piece
    elif ttype == _UNKNOWN or ttype not in (_NORMAL, _CONTROL, _USER_DEFINED, _UNUSED, _BYTE):
      ttype = _NORMAL if ttype != _UNKNOWN else _CONTROL
    if tok in seen:
      raise ValueError(f"{path}: token {tok!r} appears twice in the vocabulary (ids {seen[tok]} and {i})")
    seen[tok] = i
    p = pieces.add()
    p.piece = tok
    p.score = score
    p.type = ttype

  ts = m.trainer_spec
  ts.model_type = sp_pb2.TrainerSpec.BPE
  ts.vocab_size = n
  ts.byte_fallback = True
  ts.unk_id = unk
  ts.unk_piece = tokens[unk]
  ts.bos_id = -1 if bos is None else bos
  ts.eos_id = -1 if eos is None else eos
  ts.pad_id = -1 if pad is None else pad
  if bos is not None:
    ts.bos_piece = tokens[bos]
  if eos is not None:
    ts.eos_piece = tokens[eos]
  if pad is not None:
    ts.pad_piece = tokens[pad]
  ns = m.normalizer_spec
  ns.name = "identity"
  ns.add_dummy_prefix = bool(md.get("tokenizer.ggml.add_space_prefix", False))
  ns.remove_extra_whitespaces = False
  ns.escape_whitespaces = True
  return m.SerializeToString()


def _load_cached(model_path: str, meta_path: str, fp: str, fmt: int) -> bytes | None:
  try:
    with open(meta_path, encoding="utf-8") as f:
      meta = json.load(f)
    if meta.get("format") != fmt or meta.get("source_fingerprint") != fp:
      return None
    with open(model_path, "rb") as f:
      data = f.read()
  except (OSError, ValueError):
    return None
  if hashlib.sha256(data).hexdigest() != meta.get("model_sha256"):
    return None  # written by another process in between, or damaged
  return data


def _cached(path, suffix: str, fmt: int, build, use_cache: bool) -> bytes:
  """`build(path)` (bytes), served from the cache beside the GGUF when the GGUF has not changed since."""
  path = os.fspath(path)
  if not os.path.isfile(path):
    raise FileNotFoundError(errno.ENOENT, f"GGUF file not found: {path}", path)
  fp = fingerprint(path)
  model_path = cache_path(path, suffix)
  meta_path = model_path + ".json"
  data = _load_cached(model_path, meta_path, fp, fmt) if use_cache else None
  if data is None:
    data = build(path)
    if use_cache:
      meta = {"format": fmt, "source": os.path.abspath(path), "source_fingerprint": fp,
              "model_sha256": hashlib.sha256(data).hexdigest()}
      try:
        atomic_write_bytes(model_path, data)
        atomic_write_bytes(meta_path, json.dumps(meta, indent=1).encode())
      except OSError:
        pass  # a cache we cannot write only costs time
  return data


def tokenizer_proto(path: str | os.PathLike, *, use_cache: bool = True) -> bytes:
  """`build_proto(path)`, served from the cache beside the GGUF when the GGUF has not changed since."""
  return _cached(path, CACHE_SUFFIX, CACHE_FORMAT, lambda p: build_proto(p), use_cache)


def bpe_spec(path: str | os.PathLike, *, use_cache: bool = True) -> dict:
  """`build_bpe_spec(path)`, served from the cache beside the GGUF when the GGUF has not changed since."""
  data = _cached(path, BPE_CACHE_SUFFIX, BPE_CACHE_FORMAT,
                 lambda p: json.dumps(build_bpe_spec(p), ensure_ascii=False).encode("utf-8"), use_cache)
  return json.loads(data.decode("utf-8"))


_KINDS = {"sentencepiece": (CACHE_SUFFIX, CACHE_FORMAT), "bpe": (BPE_CACHE_SUFFIX, BPE_CACHE_FORMAT)}


def load(path: str | os.PathLike, *, use_cache: bool = True) -> tuple[str, bytes | dict]:
  """-> ("sentencepiece", serialized proto) or ("bpe", `build_bpe_spec`'s dict) for a GGUF: from whichever valid
  cache sits beside it (each is read once), else built from the metadata and cached."""
  path = os.fspath(path)
  if not os.path.isfile(path):
    raise FileNotFoundError(errno.ENOENT, f"GGUF file not found: {path}", path)
  if use_cache:
    fp = fingerprint(path)
    for kind, (suffix, fmt) in _KINDS.items():
      model_path = cache_path(path, suffix)
      data = _load_cached(model_path, model_path + ".json", fp, fmt)
      if data is not None:
        return kind, (data if kind == "sentencepiece" else json.loads(data.decode("utf-8")))
  model = read_metadata(path, ("tokenizer.ggml.model",)).get("tokenizer.ggml.model")
  logging.getLogger("spec_jax.load").info("building the tokenizer from %s's metadata (once: cached beside it)",
                                          os.path.basename(path))
  if model == "llama":
    return "sentencepiece", tokenizer_proto(path, use_cache=use_cache)
  if model == "gpt2":
    return "bpe", bpe_spec(path, use_cache=use_cache)
  raise ValueError(f"{path}: tokenizer model {model!r} is not supported (SentencePiece 'llama' or byte-level "
                   "BPE 'gpt2')")


# ---------------------------------------------------------------------------------------------- byte-level BPE

BPE_METADATA_KEYS = (
    "tokenizer.ggml.model",
    "tokenizer.ggml.pre",
    "tokenizer.ggml.tokens",
    "tokenizer.ggml.token_type",
    "tokenizer.ggml.merges",
    "tokenizer.ggml.bos_token_id",
    "tokenizer.ggml.eos_token_id",
    "tokenizer.ggml.padding_token_id",
    "tokenizer.ggml.add_bos_token",
    "tokenizer.chat_template",
)

# The pre-tokenizer's split regex, by `tokenizer.ggml.pre` (Qwen2's, as its own tokenizer.json has it).
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")
BPE_SPLITS = {"qwen2": _QWEN2_SPLIT}


def byte_alphabet() -> dict[int, str]:
  """GPT-2's byte -> printable character map: printable Latin-1 bytes stand for themselves, the other 68 bytes
  take the characters from U+0100 upwards in byte order."""
  keep = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
  out = {b: chr(b) for b in keep}
  extra = 0
  for b in range(256):
    if b not in out:
      out[b] = chr(256 + extra)
      extra += 1
  return out


def build_bpe_spec(path: str) -> dict:
  """The byte-level BPE tokenizer of a GGUF (no cache): {"tokenizer_json", "bos_id", "eos_id", "pad_id",
  "add_bos", "chat_template"}."""
  from tokenizers import (  # lazy: heavy, only this path (tokenizers)
      AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers)
  md = read_metadata(path, BPE_METADATA_KEYS)
  if md.get("tokenizer.ggml.model") != "gpt2":
    raise ValueError(f"{path}: tokenizer model {md.get('tokenizer.ggml.model')!r} is not byte-level BPE ('gpt2')")
  for key in ("tokenizer.ggml.tokens", "tokenizer.ggml.merges"):
    if key not in md:
      raise ValueError(f"{path}: GGUF file has no {key!r} metadata, so it carries no BPE tokenizer")
  pre = md.get("tokenizer.ggml.pre")
  if pre not in BPE_SPLITS:
    raise ValueError(f"{path}: BPE pre-tokenizer {pre!r} is not supported (supported: {sorted(BPE_SPLITS)})")
  tokens = md["tokenizer.ggml.tokens"]
  types = md.get("tokenizer.ggml.token_type") or [_NORMAL] * len(tokens)
  n = len(tokens)
  if len(types) != n or n == 0:
    raise ValueError(f"{path}: tokenizer arrays disagree: {n} tokens, {len(types)} types")
  spell = byte_alphabet()
  alphabet = set(spell.values())
  vocab: dict[str, int] = {}
  for i, tok in enumerate(tokens):
    if not set(tok) <= alphabet:  # a token written as text rather than in the byte alphabet
      tok = "".join(spell[b] for b in tok.encode("utf-8"))
    if tok in vocab:
      raise ValueError(f"{path}: token {tok!r} appears twice in the vocabulary (ids {vocab[tok]} and {i})")
    vocab[tok] = i
  merges = []
  for m in md["tokenizer.ggml.merges"]:
    parts = m.split(" ")
    if len(parts) != 2:
      raise ValueError(f"{path}: merge {m!r} is not two tokens separated by one space")
    merges.append((parts[0], parts[1]))
  tk = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
  tk.pre_tokenizer = pre_tokenizers.Sequence([
      pre_tokenizers.Split(Regex(BPE_SPLITS[pre]), behavior="isolated"),
      pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
  tk.decoder = decoders.ByteLevel()
  # Control tokens are matched whole and are special; a "control" token spelled outside the byte alphabet is a
  # converter mislabel (transformers skips those too). User-defined tokens are matched whole, not special.
  tk.add_special_tokens([AddedToken(t, normalized=False, special=True) for t, ty in zip(tokens, types)
                         if int(ty) == _CONTROL and set(t) <= alphabet])
  tk.add_tokens([AddedToken(t, normalized=False, special=False) for t, ty in zip(tokens, types)
                 if int(ty) == _USER_DEFINED and t in vocab])
  if tk.get_vocab_size(with_added_tokens=True) != n:
    raise ValueError(f"{path}: the tokenizer has {tk.get_vocab_size(with_added_tokens=True)} ids, the file {n}")

  def special(key: str):
    v = md.get(f"tokenizer.ggml.{key}")
    if v is not None and not 0 <= int(v) < n:
      raise ValueError(f"{path}: tokenizer.ggml.{key} = {v} is outside the vocabulary of {n}")
    return None if v is None else int(v)

  return {"tokenizer_json": tk.to_str(), "bos_id": special("bos_token_id"), "eos_id": special("eos_token_id"),
          "pad_id": special("padding_token_id"), "add_bos": bool(md.get("tokenizer.ggml.add_bos_token", False)),
          "chat_template": md.get("tokenizer.chat_template")}
