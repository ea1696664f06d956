"""Gemma 3 tokenizer: SentencePiece built from a GGUF file's metadata, matching transformers' GGUF tokenizer.

`Tokenizer.from_gguf(path)` reads the vocabulary (pieces, scores, types and the special ids) from the GGUF header,
repairs what llama.cpp's converter changed, and builds a SentencePiece `ModelProto`. The serialized proto is cached
beside the GGUF (see `spec_jax.checkpoints.file_cache`) with the GGUF's fingerprint, so later loads skip the header
parse and take a fraction of a second.

Encoding follows Hugging Face transformers' tokenizer for the same GGUF:

- Control pieces written literally in the text (`<start_of_turn>`, `<end_of_turn>`, `<bos>`, `<unused7>`, ...) are
  cut out and become their ids; whitespace around them is kept as text (transformers does not strip it).
- The text between them goes through SentencePiece BPE with byte fallback. User-defined pieces (runs of newlines,
  tabs or spaces, HTML tags, `<start_of_image>`) are matched whole, as transformers' added tokens are.
- A run of more spaces than the longest space piece (31) is split the way transformers' BPE merges split it, where
  plain SentencePiece would take the longest piece first.
"""

from __future__ import annotations

import errno
import hashlib
import heapq
import json
import mmap
import os
import re
import struct
from typing import Iterable, Mapping, Sequence

import sentencepiece as spm
from sentencepiece import sentencepiece_model_pb2 as sp_pb2

from spec_jax.checkpoints.file_cache import atomic_write_bytes, cache_path, fingerprint

__all__ = ["Tokenizer", "StreamDecoder", "read_gguf_tokenizer_metadata"]

_WS = "\u2581"  # SentencePiece's whitespace marker
# Bump when the proto built from a GGUF changes, so old caches are rebuilt.
_CACHE_FORMAT = 1

# GGUF token types (llama.cpp) use the same numbers as SentencePiece's ModelProto.SentencePiece.Type.
_NORMAL, _UNKNOWN, _CONTROL, _USER_DEFINED, _UNUSED, _BYTE = 1, 2, 3, 4, 5, 6

# ------------------------------------------------------------------------------------------------
# Reading the GGUF header

_GGUF_MAGIC = b"GGUF"
# value type -> (struct code, size); 8 is STRING and 9 is ARRAY, handled separately.
_SCALAR = {
    0: ("B", 1), 1: ("b", 1), 2: ("H", 2), 3: ("h", 2), 4: ("I", 4), 5: ("i", 4), 6: ("f", 4), 7: ("?", 1),
    10: ("Q", 8), 11: ("q", 8), 12: ("d", 8),
}
_STRING, _ARRAY = 8, 9
_NUMPY_CODE = {0: "u1", 1: "i1", 2: "u2", 3: "i2", 4: "u4", 5: "i4", 6: "f4", 7: "u1", 10: "u8", 11: "i8", 12: "f8"}

_WANTED_KEYS = (
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


class _HeaderReader:
  """Walks the key/value section of a GGUF header. Raises ValueError on anything malformed."""

  def __init__(self, buf, path: str):
    self.buf = buf
    self.path = path
    self.off = 0
    self.end = len(buf)
    self.e = "<"

  def fail(self, what: str) -> ValueError:
    return ValueError(f"{self.path}: not a valid GGUF file ({what} at byte {self.off})")

  def need(self, n: int) -> None:
    if n < 0 or self.off + n > self.end:
      raise self.fail(f"truncated: {n} more bytes needed")

  def scalar(self, code: str, size: int):
    self.need(size)
    (v,) = struct.unpack_from(self.e + code, self.buf, self.off)
    self.off += size
    return v

  def u32(self) -> int:
    return self.scalar("I", 4)

  def u64(self) -> int:
    return self.scalar("Q", 8)

  def string(self) -> str:
    n = self.u64()
    self.need(n)
    raw = bytes(self.buf[self.off:self.off + n])
    self.off += n
    try:
      return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
      raise self.fail(f"string is not UTF-8 ({exc.reason})") from None

  def skip_string(self) -> None:
    n = self.u64()
    self.need(n)
    self.off += n

  def string_array(self, count: int, keep: bool):
    out = [] if keep else None
    buf, e, end = self.buf, self.e + "Q", self.end
    off = self.off
    unpack = struct.Struct(e).unpack_from
    try:
      for _ in range(count):
        if off + 8 > end:
          raise IndexError
        (n,) = unpack(buf, off)
        off += 8
        if off + n > end:
          raise IndexError
        if keep:
          out.append(bytes(buf[off:off + n]).decode("utf-8"))
        off += n
    except IndexError:
      self.off = off
      raise self.fail("truncated string array") from None
    except UnicodeDecodeError as exc:
      self.off = off
      raise self.fail(f"token string is not UTF-8 ({exc.reason})") from None
    self.off = off
    return out

  def value(self, vtype: int, keep: bool):
    if vtype in _SCALAR:
      code, size = _SCALAR[vtype]
      v = self.scalar(code, size)
      return v if keep else None
    if vtype == _STRING:
      if keep:
        return self.string()
      self.skip_string()
      return None
    if vtype == _ARRAY:
      etype = self.u32()
      count = self.u64()
      if etype == _STRING:
        return self.string_array(count, keep)
      if etype in _SCALAR:
        size = _SCALAR[etype][1]
        self.need(count * size)
        start = self.off
        self.off += count * size
        if not keep:
          return None
        import numpy as np

        return np.frombuffer(self.buf, dtype=self.e + _NUMPY_CODE[etype], count=count, offset=start).copy()
      if etype == _ARRAY:
        out = [self.value(_ARRAY, keep) for _ in range(count)]
        return out if keep else None
      raise self.fail(f"unknown array element type {etype}")
    raise self.fail(f"unknown value type {vtype}")


def read_gguf_tokenizer_metadata(path: str, keys: Iterable[str] = _WANTED_KEYS) -> dict:
  """The requested metadata values of a GGUF file, read straight from its header.

  Much faster than `gguf.GGUFReader` (which builds a numpy view for every field and maps the tensors): this walks
  the key/value section once, decoding only the wanted keys. Arrays of numbers come back as numpy arrays, arrays of
  strings as lists.
  """
  wanted = set(keys)
  try:
    f = open(path, "rb")
  except FileNotFoundError:
    raise FileNotFoundError(errno.ENOENT, f"GGUF file not found: {path}", path) from None
  with f:
    size = os.fstat(f.fileno()).st_size
    if size < 24:
      raise ValueError(f"{path}: not a valid GGUF file (only {size} bytes)")
    with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
      r = _HeaderReader(memoryview(mm), path)
      try:
        if bytes(mm[:4]) != _GGUF_MAGIC:
          raise ValueError(f"{path}: not a GGUF file (magic {bytes(mm[:4])!r}, expected b'GGUF')")
        r.off = 4
        version = r.u32()
        if version > 0xFFFF:  # a big-endian file
          r.e = ">"
          r.off = 4
          version = r.u32()
        if version not in (2, 3):
          raise ValueError(f"{path}: unsupported GGUF version {version} (expected 2 or 3)")
        r.u64()  # tensor count
        kv_count = r.u64()
        if kv_count > size // 13:  # each key/value takes at least 13 bytes
          raise r.fail(f"implausible metadata count {kv_count}")
        out: dict = {}
        for _ in range(kv_count):
          key = r.string()
          vtype = r.u32()
          keep = key in wanted
          v = r.value(vtype, keep)
          if keep:
            out[key] = v
            if len(out) == len(wanted):
              break
        return out
      finally:
        r.buf.release()


# ------------------------------------------------------------------------------------------------
# Building the SentencePiece model


def _proto_from_gguf(path: str) -> bytes:
  md = read_gguf_tokenizer_metadata(path)
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
  for i, (tok, score, ttype) in enumerate(zip(tokens, scores.tolist(), types.tolist())):
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
    if meta.get("format") != _CACHE_FORMAT or meta.get("source_fingerprint") != fp:
      return None
    with open(model_path, "rb") as f:
      data = f.read()
  except (OSError, ValueError):
    return None
  if hashlib.sha256(data).hexdigest() != meta.get("model_sha256"):
    return None  # written by another process in between, or damaged
  return data


# ------------------------------------------------------------------------------------------------
# The tokenizer

# Candidates for a literal control piece in text: "<" ... ">" with no brackets inside.
_ANGLE = re.compile(r"<[^<>]*>")


class Tokenizer:
  """Gemma 3's SentencePiece tokenizer with transformers-compatible handling of control tokens."""

  def __init__(self, model_proto: bytes, source: str = "<memory>"):
    sp = spm.SentencePieceProcessor()
    try:
      sp.LoadFromSerializedProto(model_proto)
    except Exception as exc:  # sentencepiece raises RuntimeError / OSError on bad input
      raise ValueError(f"{source}: not a valid SentencePiece model ({exc})") from None
    self._sp = sp
    self._source = source
    n = sp.GetPieceSize()
    self._vocab_size = n
    self._bos = sp.bos_id()
    self._eos = sp.eos_id()
    self._pad = sp.pad_id()
    self._unk = sp.unk_id()
    # Specials are what transformers treats as special: every CONTROL piece and the unk piece.
    special = [i for i in range(n) if sp.IsControl(i)]
    if self._unk >= 0:
      special.append(self._unk)
    self._special_ids = frozenset(special)
    self._special_by_text = {sp.IdToPiece(i): i for i in special}
    self._special_pattern = self._make_special_pattern()
    # Runs of spaces: transformers splits runs longer than the longest space piece with its own BPE merges.
    self._space_ids = {1: sp.PieceToId(_WS)} if sp.PieceToId(_WS) != self._unk else {}
    k = 2
    while True:
      i = sp.PieceToId(_WS * k)
      if i == self._unk or i in self._special_ids:
        break
      self._space_ids[k] = i
      k += 1
    self._max_space = max(self._space_ids) if self._space_ids else 0
    self._long_space = re.compile(f"[ {_WS}]{{{self._max_space + 1},}}") if self._max_space >= 2 else None
    self._space_split_cache: dict[int, list[int]] = {}
    self._end_of_turn = self._lookup("<end_of_turn>")
    self._start_of_turn = self._lookup("<start_of_turn>")

  # ---- construction

  @classmethod
  def from_gguf(cls, path: str | os.PathLike, *, use_cache: bool = True) -> "Tokenizer":
    """The tokenizer described by a GGUF file's metadata; the built model is cached beside the file."""
    path = os.fspath(path)
    if not os.path.isfile(path):
      raise FileNotFoundError(errno.ENOENT, f"GGUF file not found: {path}", path)
    fp = fingerprint(path)
    model_path = cache_path(path, ".tokenizer.model")
    meta_path = model_path + ".json"
    data = _load_cached_proto(model_path, meta_path, fp) if use_cache else None
    if data is None:
      data = _proto_from_gguf(path)
      if use_cache:
        meta = {"format": _CACHE_FORMAT, "source": os.path.abspath(path), "source_fingerprint": fp,
                "model_sha256": hashlib.sha256(data).hexdigest()}
        try:
          atomic_write_bytes(model_path, data)
          atomic_write_bytes(meta_path, json.dumps(meta, indent=1).encode())
        except OSError:
          pass  # a cache we cannot write only costs time
    return cls(data, source=path)

  @classmethod
  def from_model_file(cls, path: str | os.PathLike) -> "Tokenizer":
    """A tokenizer from a serialized SentencePiece `.model` file."""
    path = os.fspath(path)
    try:
      with open(path, "rb") as f:
        data = f.read()
    except FileNotFoundError:
      raise FileNotFoundError(errno.ENOENT, f"SentencePiece model file not found: {path}", path) from None
    if not data:
      raise ValueError(f"{path}: not a valid SentencePiece model (the file is empty)")
    return cls(data, source=path)

  def serialized_model_proto(self) -> bytes:
    return self._sp.serialized_model_proto()

  def _make_special_pattern(self) -> re.Pattern | None:
    texts = [t for t in self._special_by_text if t]
    if not texts:
      return None
    if all(_ANGLE.fullmatch(t) for t in texts):
      return _ANGLE  # every candidate is looked up; cheaper than an alternation of thousands of names
    # Leftmost match, longest first among those starting at the same place.
    return re.compile("|".join(re.escape(t) for t in sorted(texts, key=len, reverse=True)))

  def _lookup(self, piece: str) -> int | None:
    i = self._sp.PieceToId(piece)
    return None if (i == self._unk and piece != self._sp.IdToPiece(self._unk)) else i

  # ---- properties

  @property
  def bos_id(self) -> int:
    return self._bos

  @property
  def eos_id(self) -> int:
    return self._eos

  @property
  def pad_id(self) -> int:
    return self._pad

  @property
  def unk_id(self) -> int:
    return self._unk

  @property
  def vocab_size(self) -> int:
    return self._vocab_size

  @property
  def end_of_turn_id(self) -> int | None:
    return self._end_of_turn

  @property
  def start_of_turn_id(self) -> int | None:
    return self._start_of_turn

  @property
  def special_ids(self) -> frozenset[int]:
    """Ids transformers treats as special: the control pieces and `<unk>`."""
    return self._special_ids

  @property
  def stop_ids(self) -> tuple[int, ...]:
    """Ids that end a generation: EOS and, when present, `<end_of_turn>`."""
    return tuple(i for i in (self._eos, self._end_of_turn) if i is not None and i >= 0)

  def id_of(self, piece: str) -> int:
    """The id of a piece as it is written in the vocabulary; KeyError if there is none.

    Spaces may be written as " " or "▁".
    """
    i = self._lookup(piece)
    if i is None and " " in piece:
      i = self._lookup(piece.replace(" ", _WS))
    if i is None:
      raise KeyError(f"no piece {piece!r} in the vocabulary")
    return i

  def piece_of(self, token_id: int) -> str:
    self._check_id(token_id)
    return self._sp.IdToPiece(int(token_id))

  def __len__(self) -> int:
    return self._vocab_size

  def __repr__(self) -> str:
    return f"Tokenizer(vocab_size={self._vocab_size}, source={self._source!r})"

  # ---- encoding

  def encode(self, text: str, add_bos: bool = True, *, parse_special: bool = True) -> list[int]:
    """Token ids for `text`, with BOS first when `add_bos`.

    With `parse_special` (the default, as in transformers), control pieces written literally in the text become
    their ids. Without it, the whole text is ordinary text.
    """
    if not isinstance(text, str):
      raise TypeError(f"encode expects str, got {type(text).__name__}")
    ids: list[int] = [self._bos] if add_bos and self._bos >= 0 else []
    if not parse_special or self._special_pattern is None:
      self._encode_plain(text, ids)
      return ids
    start = 0
    lookup = self._special_by_text
    for m in self._special_pattern.finditer(text):
      tid = lookup.get(m.group())
      if tid is None:
        continue
      if m.start() > start:
        self._encode_plain(text[start:m.start()], ids)
      ids.append(tid)
      start = m.end()
    if start < len(text):
      self._encode_plain(text[start:], ids)
    return ids

  def _encode_plain(self, text: str, out: list[int]) -> None:
    if not text:
      return
    if self._long_space is None:
      out.extend(self._sp.EncodeAsIds(text))
      return
    start = 0
    for m in self._long_space.finditer(text):
      if m.start() > start:
        out.extend(self._sp.EncodeAsIds(text[start:m.start()]))
      out.extend(self._split_space_run(m.end() - m.start()))
      start = m.end()
    if start < len(text):
      out.extend(self._sp.EncodeAsIds(text[start:]))

  def _split_space_run(self, n: int) -> list[int]:
    """Ids for a run of n spaces the way transformers' BPE merges it.

    transformers rebuilds merges from the vocabulary, ranked by the merged piece's position in the file and then by
    the longer left part, and its BPE applies the best-ranked merge first (leftmost on ties). The space pieces
    come right after the control pieces, so a run is merged in isolation before anything else touches it.
    """
    cached = self._space_split_cache.get(n)
    if cached is not None:
      return cached
    have = self._space_ids
    lengths = [1] * n
    nxt = list(range(1, n)) + [-1]
    prv = list(range(-1, n - 1))
    alive = [True] * n
    heap: list[tuple[int, int, int, int]] = []

    def push(pos: int) -> None:
      j = nxt[pos]
      if j < 0:
        return
      a, b = lengths[pos], lengths[j]
      if a + b in have:
        heapq.heappush(heap, (a + b, -a, pos, a + b))  # rank: shorter result first, then longer left part

    for pos in range(n - 1):
      push(pos)
    while heap:
      _, _, pos, new_len = heapq.heappop(heap)
      j = nxt[pos] if alive[pos] else -1
      if j < 0 or lengths[pos] + lengths[j] != new_len:
        continue
      lengths[pos] = new_len
      alive[j] = False
      nxt[pos] = nxt[j]
      if nxt[j] >= 0:
        prv[nxt[j]] = pos
      if prv[pos] >= 0:
        push(prv[pos])
      push(pos)
    result = [have[lengths[i]] for i in range(n) if alive[i]]
    if len(self._space_split_cache) < 256:
      self._space_split_cache[n] = result
    return result

  def encode_batch(self, texts: Sequence[str], add_bos: bool = True) -> list[list[int]]:
    return [self.encode(t, add_bos=add_bos) for t in texts]

  # ---- decoding

  def _check_id(self, token_id: int) -> None:
    if not 0 <= int(token_id) < self._vocab_size:
      raise ValueError(f"token id {token_id} is outside the vocabulary of {self._vocab_size}")

  def decode(self, ids: Iterable[int], skip_special: bool = False) -> str:
    """Text for `ids`. BOS and PAD are always dropped; other control tokens are written as their text
    (`<end_of_turn>`) unless `skip_special`."""
    parts: list[str] = []
    run: list[int] = []
    always_skip = {self._bos, self._pad}
    for t in ids:
      t = int(t)
      self._check_id(t)
      if t in self._special_ids:
        if run:
          parts.append(self._sp.DecodeIds(run))
          run = []
        if not skip_special and t not in always_skip:
          parts.append(self._sp.IdToPiece(t))
      else:
        run.append(t)
    if run:
      parts.append(self._sp.DecodeIds(run))
    return "".join(parts)

  def decode_incremental(self, prev_ids: Sequence[int], new_ids: Sequence[int], skip_special: bool = False) -> str:
    """The text that `new_ids` add after `prev_ids`, for streaming.

    Bytes of a character split across tokens are held back until it completes: the text is returned once the
    character is whole, so joining the results of successive calls gives `decode(all_ids)`.
    """
    prev = list(prev_ids)
    before = self._stable_text(prev, skip_special)
    after = self._stable_text(prev + list(new_ids), skip_special)
    return after[len(before):] if after.startswith(before) else after

  def _stable_text(self, ids: list[int], skip_special: bool) -> str:
    """decode(ids) without a trailing incomplete UTF-8 sequence (the part that later tokens could change)."""
    text = self.decode(ids, skip_special=skip_special)
    k = len(ids)
    # Trailing byte pieces that do not yet form a character decode to U+FFFD; hold them back.
    while k > 0 and self._sp.IsByte(int(ids[k - 1])) and text.endswith("\ufffd"):
      k -= 1
      text = self.decode(ids[:k], skip_special=skip_special)
    return text

  def stream(self, skip_special: bool = False) -> "StreamDecoder":
    return StreamDecoder(self, skip_special=skip_special)

  # ---- chat template

  def apply_chat_template(self, turns: Sequence[str] | Sequence[Mapping[str, object]],
                          add_generation_prompt: bool = True) -> str:
    """Gemma 3's chat format, without the leading `<bos>` (encode adds it).

    `turns` is a list of strings, taken as alternating user and model turns starting with the user, or a list of
    {"role", "content"} messages with roles "user", "model" (or "assistant") and an optional first "system"
    message, which Gemma 3 prepends to the first user turn followed by a blank line. Contents are stripped of
    surrounding whitespace, as Gemma 3's template does. Each turn becomes
    `<start_of_turn>{role}\\n{content}<end_of_turn>\\n`; `add_generation_prompt` appends `<start_of_turn>model\\n`.
    """
    if isinstance(turns, (str, bytes)) or not isinstance(turns, Sequence):
      raise TypeError("turns must be a list of strings or of {'role', 'content'} dicts")
    if len(turns) == 0:
      raise ValueError("apply_chat_template needs at least one turn")
    messages: list[tuple[str, str]] = []
    for k, turn in enumerate(turns):
      if isinstance(turn, str):
        messages.append(("user" if k % 2 == 0 else "model", turn))
      elif isinstance(turn, Mapping):
        role = turn.get("role")
        if role not in ("user", "model", "assistant", "system"):
          raise ValueError(f"turn {k}: unknown role {role!r} (expected user, model, assistant or system)")
        messages.append(("model" if role == "assistant" else str(role), _content_text(turn.get("content"), k)))
      else:
        raise TypeError(f"turn {k}: expected str or dict, got {type(turn).__name__}")

    prefix = ""
    if messages[0][0] == "system":
      if len(messages) < 2:
        raise ValueError("a system message must be followed by a user turn")
      prefix = messages[0][1] + "\n\n"
      messages = messages[1:]
    out = []
    for k, (role, content) in enumerate(messages):
      expected = "user" if k % 2 == 0 else "model"
      if role != expected:
        raise ValueError(f"conversation roles must alternate user/model starting with user; "
                         f"turn {k} is {role!r} where {expected!r} was expected")
      body = (prefix if k == 0 else "") + content.strip()
      out.append(f"<start_of_turn>{role}\n{body}<end_of_turn>\n")
    if add_generation_prompt:
      out.append("<start_of_turn>model\n")
    return "".join(out)


def _content_text(content: object, k: int) -> str:
  if isinstance(content, str):
    return content
  if isinstance(content, Sequence) and not isinstance(content, (bytes, bytearray)):
    texts = []
    for item in content:
      if isinstance(item, Mapping) and item.get("type") == "text" and isinstance(item.get("text"), str):
        texts.append(item["text"].strip())
      else:
        raise ValueError(f"turn {k}: only text content parts are supported, got {item!r}")
    return "".join(texts)
  raise ValueError(f"turn {k}: content must be a string, got {type(content).__name__}")


class StreamDecoder:
  """Incremental detokenizer: feed ids as they are generated, get back the text they add.

  It decodes only a short window of recent ids, so a step costs O(window). A character whose UTF-8 bytes are split
  across byte-fallback tokens is held back until it is complete. The concatenation of everything `add` and `flush`
  return equals `Tokenizer.decode` of all the ids fed.
  """

  def __init__(self, tokenizer: Tokenizer, skip_special: bool = False):
    self._tok = tokenizer
    self._skip = skip_special
    self._ids: list[int] = []
    self._prefix = 0  # start of the window that is decoded again
    self._read = 0  # ids up to here have been returned as text

  @property
  def ids(self) -> list[int]:
    return list(self._ids)

  def add(self, new_ids: Iterable[int] | int) -> str:
    if isinstance(new_ids, int):
      new_ids = [new_ids]
    self._ids.extend(int(t) for t in new_ids)
    tok, skip = self._tok, self._skip
    before = tok.decode(self._ids[self._prefix:self._read], skip_special=skip)
    after = tok.decode(self._ids[self._prefix:], skip_special=skip)
    if after.endswith("\ufffd") and tok._sp.IsByte(self._ids[-1]):
      return ""  # an incomplete character; wait for its remaining bytes
    if not after.startswith(before):
      return ""
    self._prefix, self._read = self._read, len(self._ids)
    return after[len(before):]

  def flush(self) -> str:
    """Whatever is still held back (an incomplete character at the end), as decode renders it."""
    tok, skip = self._tok, self._skip
    before = tok.decode(self._ids[self._prefix:self._read], skip_special=skip)
    after = tok.decode(self._ids[self._prefix:], skip_special=skip)
    self._prefix = self._read = len(self._ids)
    return after[len(before):] if after.startswith(before) else ""
