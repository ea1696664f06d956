"""The one tokenizer interface the rest of spec_jax sees, and the streaming detokenizer built on it.

Two implementations, both built from a checkpoint's own metadata by `spec_jax.checkpoints.load.load_tokenizer`:

- `SentencePieceTokenizer` (spec_jax/sentencepiece_tokenizer.py): Gemma 3's SentencePiece vocabulary.
- `BPETokenizer` (spec_jax/bpe_tokenizer.py): a GPT-2-style byte-level BPE (Qwen2), run by the `tokenizers`
  library, with the chat template rendered from the checkpoint's own Jinja template.

Both follow Hugging Face transformers' tokenizer for the same file: ids, special-token parsing, decoding and the
chat format. Nothing downstream (serve/, train/) knows which one it holds.
"""

from __future__ import annotations

import abc
import hashlib
from typing import Iterable, Mapping, Sequence

__all__ = ["Tokenizer", "StreamDecoder"]


class Tokenizer(abc.ABC):
  """Text <-> token ids for one vocabulary."""

  # ---- what an implementation provides: these attributes, set in its __init__, and the methods below

  _vocab_size: int
  _bos: int  # -1 when the vocabulary has none
  _eos: int
  _pad: int
  _special_ids: frozenset  # ids that decode(skip_special=True) drops (transformers' special tokens)

  @property
  def vocab_size(self) -> int:
    return self._vocab_size

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
  def special_ids(self) -> frozenset[int]:
    return self._special_ids

  @abc.abstractmethod
  def encode(self, text: str, add_bos: bool = True, *, parse_special: bool = True) -> list[int]:
    """Token ids for `text`. `add_bos`: put BOS first when this vocabulary's model expects one (Gemma does,
    Qwen2 does not). `parse_special`: special tokens written in the text become their ids."""

  @abc.abstractmethod
  def decode(self, ids: Iterable[int], skip_special: bool = False) -> str:
    """Text for `ids`; ValueError for an id outside the vocabulary."""

  @abc.abstractmethod
  def id_of(self, piece: str) -> int:
    """The id of a piece as the vocabulary spells it (or as its text); KeyError if there is none."""

  @abc.abstractmethod
  def piece_of(self, token_id: int) -> str: ...

  @abc.abstractmethod
  def may_split_character(self, token_id: int) -> bool:
    """Whether this token can end inside a UTF-8 character (its text then waits for the next tokens)."""

  @abc.abstractmethod
  def apply_chat_template(self, turns: Sequence[str] | Sequence[Mapping[str, object]],
                          add_generation_prompt: bool = True) -> str:
    """The model's chat format as text for `encode`. `turns`: strings (alternating user and assistant, user
    first) or {"role", "content"} messages (system, user, assistant; "model" is an alias of assistant)."""

  @abc.abstractmethod
  def _stop_candidates(self) -> Sequence[int | None]:
    """EOS and the end-of-turn markers this vocabulary has (None where absent)."""

  # ---- shared

  @property
  def stop_ids(self) -> tuple[int, ...]:
    """Ids that end a generation: EOS and the end-of-turn markers."""
    return tuple(dict.fromkeys(i for i in self._stop_candidates() if i is not None and i >= 0))

  def __len__(self) -> int:
    return self.vocab_size

  def _check_id(self, token_id: int) -> None:
    if not 0 <= int(token_id) < self.vocab_size:
      raise ValueError(f"token id {token_id} is outside the vocabulary of {self.vocab_size}")

  def pieces(self) -> list[str]:
    """Every piece, in id order."""
    return [self.piece_of(i) for i in range(self.vocab_size)]

  def vocab_digest(self) -> str:
    """sha256 of every piece in id order: two tokenizers with the same digest map ids to the same pieces."""
    return hashlib.sha256("\0".join(self.pieces()).encode("utf-8", "surrogatepass")).hexdigest()

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
    # Trailing pieces that do not yet form a character decode to U+FFFD; hold them back.
    while k > 0 and self.may_split_character(int(ids[k - 1])) and text.endswith("\ufffd"):
      k -= 1
      text = self.decode(ids[:k], skip_special=skip_special)
    return text

  def stream(self, skip_special: bool = False) -> "StreamDecoder":
    return StreamDecoder(self, skip_special=skip_special)


class StreamDecoder:
  """Incremental detokenizer: feed ids as they are generated, get back the text they add.

  It decodes only a short window of recent ids, so a step costs O(window). A character whose UTF-8 bytes are split
  across tokens is held back until it is complete. The concatenation of everything `add` and `flush` return
  equals `Tokenizer.decode` of all the ids fed.
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
    if after.endswith("\ufffd") and tok.may_split_character(self._ids[-1]):
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
