"""A SentencePiece model built from a GGUF file's tokenizer metadata, cached beside the GGUF.

The GGUF carries the vocabulary (pieces, scores, types and the special ids) as llama.cpp's converter wrote it.
`build_proto` repairs what that converter changed and builds the SentencePiece `ModelProto` that matches Hugging
Face transformers' tokenizer for the same file. Reading the metadata of 262k pieces takes many seconds, so
`tokenizer_proto` caches the serialized proto beside the GGUF (see `file_cache`) with the GGUF's fingerprint;
later loads read the cache in a fraction of a second.

This module only makes the proto: `spec_jax.tokenizer.Tokenizer` takes it from there, and
`spec_jax.checkpoints.load.load_tokenizer` joins the two.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os

from sentencepiece import sentencepiece_model_pb2 as sp_pb2

from spec_jax.checkpoints.file_cache import atomic_write_bytes, cache_path, fingerprint
from spec_jax.checkpoints.gguf_meta import read_metadata

_WS = "\u2581"  # SentencePiece's whitespace marker
# Bump when the proto built from a GGUF changes, so old caches are rebuilt.
CACHE_FORMAT = 1
CACHE_SUFFIX = ".tokenizer.model"

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


def _load_cached_proto(model_path: str, meta_path: str, fp: str) -> bytes | None:
  try:
    with open(meta_path, encoding="utf-8") as f:
      meta = json.load(f)
    if meta.get("format") != CACHE_FORMAT or meta.get("source_fingerprint") != fp:
      return None
    with open(model_path, "rb") as f:
      data = f.read()
  except (OSError, ValueError):
    return None
  if hashlib.sha256(data).hexdigest() != meta.get("model_sha256"):
    return None  # written by another process in between, or damaged
  return data


def tokenizer_proto(path: str | os.PathLike, *, use_cache: bool = True) -> bytes:
  """`build_proto(path)`, served from the cache beside the GGUF when the GGUF has not changed since."""
  path = os.fspath(path)
  if not os.path.isfile(path):
    raise FileNotFoundError(errno.ENOENT, f"GGUF file not found: {path}", path)
  fp = fingerprint(path)
  model_path = cache_path(path, CACHE_SUFFIX)
  meta_path = model_path + ".json"
  data = _load_cached_proto(model_path, meta_path, fp) if use_cache else None
  if data is None:
    data = build_proto(path)
    if use_cache:
      meta = {"format": CACHE_FORMAT, "source": os.path.abspath(path), "source_fingerprint": fp,
              "model_sha256": hashlib.sha256(data).hexdigest()}
      try:
        atomic_write_bytes(model_path, data)
        atomic_write_bytes(meta_path, json.dumps(meta, indent=1).encode())
      except OSError:
        pass  # a cache we cannot write only costs time
  return data
