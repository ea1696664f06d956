"""Each token's bytes, the alphabet a grammar automaton is built over.

A grammar constrains text, a model emits token ids: the automaton needs the exact bytes each id adds to the
output. SentencePiece (Gemma): the piece with its whitespace marker as a space, byte-fallback pieces `<0xAB>` as
that byte. Byte-level BPE (Qwen2): the piece's characters through GPT-2's byte-to-unicode table, reversed.
Special tokens (control pieces, BOS/EOS, turn markers) have no bytes: None, never allowed by a grammar (EOS is
handled apart, allowed in accepting states).
"""

from __future__ import annotations

import functools

from spec_jax.bpe_tokenizer import BPETokenizer
from spec_jax.tokenizer import Tokenizer

_WS = "\u2581"


@functools.lru_cache(maxsize=1)
def _unicode_to_byte() -> dict[str, int]:
  """GPT-2's table (printable bytes map to themselves, the rest to code points 256 and up), inverted."""
  printable = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
  table, n = {}, 0
  for b in range(256):
    if b in printable:
      table[chr(b)] = b
    else:
      table[chr(256 + n)] = b
      n += 1
  return table


def token_bytes(tokenizer: Tokenizer) -> list:
  """list[bytes | None] in id order (None: a special token)."""
  special = tokenizer.special_ids
  out: list = []
  if isinstance(tokenizer, BPETokenizer):
    table = _unicode_to_byte()
    for i, piece in enumerate(tokenizer.pieces()):
      if i in special or any(ch not in table for ch in piece):
        out.append(None)  # added tokens outside the byte alphabet are specials in practice
      else:
        out.append(bytes(table[ch] for ch in piece))
    return out
  for i in range(tokenizer.vocab_size):
    if i in special:
      out.append(None)
      continue
    piece = tokenizer.piece_of(i)
    if tokenizer.may_split_character(i) and piece.startswith("<0x") and piece.endswith(">"):
      out.append(bytes([int(piece[3:-1], 16)]))
    else:
      out.append(piece.replace(_WS, " ").encode("utf-8"))
  return out
