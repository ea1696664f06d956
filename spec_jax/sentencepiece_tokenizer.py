"""Gemma 3's tokenizer: SentencePiece with transformers-compatible handling of control tokens and space runs.

A `SentencePieceTokenizer` (one implementation of `spec_jax.tokenizer.Tokenizer`) is made from a serialized SentencePiece model: `spec_jax.checkpoints.load.load_tokenizer` builds one
from a GGUF's metadata (`spec_jax.checkpoints.gguf_tokenizer`) or an HF directory's `tokenizer.model`, and
`SentencePieceTokenizer.from_model_file` reads a `.model` file. This module does no checkpoint I/O of its own.

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
import heapq
import os
import re
from typing import Iterable, Mapping, Sequence

import sentencepiece as spm

from spec_jax import chat_template
from spec_jax.tokenizer import Tokenizer

__all__ = ["SentencePieceTokenizer"]

_WS = "\u2581"  # SentencePiece's whitespace marker
# Candidates for a literal control piece in text: "<" ... ">" with no brackets inside.
_ANGLE = re.compile(r"<[^<>]*>")


class SentencePieceTokenizer(Tokenizer):
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
  def from_model_file(cls, path: str | os.PathLike) -> "SentencePieceTokenizer":
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
  def unk_id(self) -> int:
    return self._unk

  @property
  def end_of_turn_id(self) -> int | None:
    return self._end_of_turn

  @property
  def start_of_turn_id(self) -> int | None:
    return self._start_of_turn

  def _stop_candidates(self):
    return (self._eos, self._end_of_turn)

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

  def __repr__(self) -> str:
    return f"SentencePieceTokenizer(vocab_size={self._vocab_size}, source={self._source!r})"

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

  # ---- decoding

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

  def may_split_character(self, token_id: int) -> bool:
    """Byte-fallback pieces can end in the middle of a UTF-8 character."""
    return self._sp.IsByte(int(token_id))

  # ---- chat template

  def apply_chat_template(self, turns: Sequence[str] | Sequence[Mapping[str, object]],
                          add_generation_prompt: bool = True) -> str:
    """Gemma 3's chat format, without the leading `<bos>` (encode adds it); see `chat_template`."""
    return chat_template.apply_chat_template(turns, add_generation_prompt)
