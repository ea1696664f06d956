"""A GPT-2-style byte-level BPE tokenizer (Qwen2), run by the `tokenizers` library.

`spec_jax.checkpoints.gguf_tokenizer.bpe_spec` builds the `tokenizers` pipeline from a GGUF's metadata (vocab,
merges, token types, the pre-tokenizer's split) the way transformers builds its tokenizer for the same file; this
class wraps it behind the `Tokenizer` interface, with the chat format rendered from the file's own Jinja
template (`chat_template.JinjaTemplate`).
"""

from __future__ import annotations

from typing import Iterable, Mapping, Sequence

from spec_jax.chat_template import JinjaTemplate
from spec_jax.tokenizer import Tokenizer

__all__ = ["BPETokenizer"]

# End-of-turn markers of the byte-level vocabularies we know; generation stops on those present.
_END_OF_TURN = ("<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<|end_of_text|>")


class BPETokenizer(Tokenizer):
  """Byte-level BPE. `spec` is what `gguf_tokenizer.bpe_spec` returns: the `tokenizers` JSON, the special ids,
  whether the model expects BOS, and the chat template."""

  def __init__(self, spec: Mapping[str, object], source: str = "<memory>"):
    import tokenizers  # lazy: heavy, only this path (tokenizers)
    self._json = str(spec["tokenizer_json"])
    try:
      self._tk = tokenizers.Tokenizer.from_str(self._json)
    except Exception as e:  # tokenizers raises its own Exception subclass on a bad JSON
      raise ValueError(f"{source}: not a valid tokenizers pipeline ({e})") from None
    self._plain = None  # built on first use: see _tk_plain
    self._source = source
    self._vocab_size = self._tk.get_vocab_size(with_added_tokens=True)
    ids = lambda key: -1 if spec.get(key) is None else int(spec[key])
    self._bos, self._eos, self._pad = ids("bos_id"), ids("eos_id"), ids("pad_id")
    self._add_bos = bool(spec.get("add_bos", False))
    added = self._tk.get_added_tokens_decoder()
    self._special_ids = frozenset(i for i, t in added.items() if t.special)
    self._end_of_turn = [self._tk.token_to_id(t) for t in _END_OF_TURN]
    template = spec.get("chat_template")
    self._template = None
    if template:
      piece = lambda i: self._tk.id_to_token(i) if 0 <= i < self._vocab_size else None
      self._template = JinjaTemplate(str(template), {
          "bos_token": piece(self._bos), "eos_token": piece(self._eos), "pad_token": piece(self._pad)})

  @property
  def _tk_plain(self):
    """The same pipeline with special tokens read as plain text (encode(parse_special=False), id_of)."""
    if self._plain is None:
      import tokenizers  # lazy: heavy, only this path (tokenizers)
      self._plain = tokenizers.Tokenizer.from_str(self._json)
      self._plain.encode_special_tokens = True
    return self._plain

  def _stop_candidates(self):
    return (self._eos, *self._end_of_turn)

  def id_of(self, piece: str) -> int:
    """The id of a piece as the vocabulary spells it ("Ġhello") or of the text it stands for (" hello")."""
    i = self._tk.token_to_id(piece)
    if i is None:
      ids = self._tk_plain.encode(piece, add_special_tokens=False).ids
      if len(ids) == 1 and self.decode(ids) == piece:
        i = ids[0]
    if i is None:
      raise KeyError(f"no piece {piece!r} in the vocabulary")
    return i

  def piece_of(self, token_id: int) -> str:
    self._check_id(token_id)
    return self._tk.id_to_token(int(token_id))

  def pieces(self) -> list[str]:
    by_id = sorted(self._tk.get_vocab(with_added_tokens=True).items(), key=lambda kv: kv[1])
    return [piece for piece, _ in by_id]

  def __repr__(self) -> str:
    return f"BPETokenizer(vocab_size={self._vocab_size}, source={self._source!r})"

  # ---- encoding and decoding

  def encode(self, text: str, add_bos: bool = True, *, parse_special: bool = True) -> list[int]:
    if not isinstance(text, str):
      raise TypeError(f"encode expects str, got {type(text).__name__}")
    tk = self._tk if parse_special else self._tk_plain
    ids = tk.encode(text, add_special_tokens=False).ids if text else []
    return ([self._bos] if add_bos and self._add_bos and self._bos >= 0 else []) + ids

  def decode(self, ids: Iterable[int], skip_special: bool = False) -> str:
    ids = [int(t) for t in ids]
    for t in ids:
      self._check_id(t)
    return self._tk.decode(ids, skip_special_tokens=skip_special)

  def may_split_character(self, token_id: int) -> bool:
    """Any byte-level token may end inside a UTF-8 character, except the added tokens (whole strings)."""
    return self._tk.id_to_token(int(token_id)) is not None and int(token_id) not in self._special_ids

  # ---- chat template

  def apply_chat_template(self, turns: Sequence[str] | Sequence[Mapping[str, object]],
                          add_generation_prompt: bool = True) -> str:
    """The checkpoint's own Jinja template, rendered as transformers renders it."""
    if self._template is None:
      raise ValueError(f"{self._source}: this tokenizer has no chat template")
    return self._template.render(turns, add_generation_prompt)
