"""Prompt files: JSONL with `prompt` (raw text after BOS) or `turns` (chat; the first turn is templated).

Spec-Bench's question file reads as is (`question_id` is the id, `category` is kept).
"""

from __future__ import annotations

import dataclasses
from typing import Optional

from spec_jax.datasets import read_jsonl

DEFAULT_PROMPTS = [
    {"id": "story", "category": "open", "prompt": "Once upon a time, in a small village by the sea,"},
    {"id": "facts", "category": "open", "prompt": "The three largest planets in the solar system are"},
    {"id": "code", "category": "code",
     "prompt": "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n"},
    {"id": "copy", "category": "copy",
     "prompt": ("Text: The quick brown fox jumps over the lazy dog. The dog sleeps in the sun while the fox "
                "runs into the forest to find its family.\nRepeat the text exactly.\nText: The quick brown")},
    {"id": "summary", "category": "copy",
     "prompt": ("Article: The city council voted on Tuesday to expand the public library, adding a new reading "
                "room, a children's section and longer opening hours. The expansion will cost 2 million dollars "
                "and is expected to open next spring. Council members said the library is the most visited "
                "public building in the city.\nSummary: The city council voted on Tuesday to expand the public "
                "library,")},
    # Plain text to continue: the packaged Gemma 3 270M is a base model (a chat turn makes it babble).
    {"id": "recipe", "category": "open", "prompt": "Pancakes\n\nIngredients:\n- 1 cup flour\n-"},
]


@dataclasses.dataclass
class Prompt:
  id: str
  text: str  # what is encoded (after the chat template, for turns)
  category: str = ""
  is_chat: bool = False


def parse_record(rec: dict, where: str, tokenizer) -> Prompt:
  if not isinstance(rec, dict):
    raise ValueError(f"{where}: expected a JSON object, got {type(rec).__name__}")
  pid = rec.get("id", rec.get("question_id"))
  category = str(rec.get("category", ""))
  if "prompt" in rec:
    if not isinstance(rec["prompt"], str):
      raise ValueError(f"{where}: 'prompt' must be a string")
    if not rec["prompt"]:
      raise ValueError(f"{where}: prompt {str(pid)!r} is empty")
    return Prompt(str(pid) if pid is not None else "", rec["prompt"], category)
  if "turns" in rec:
    turns = rec["turns"]
    if not isinstance(turns, list) or not turns or not all(isinstance(t, str) for t in turns):
      raise ValueError(f"{where}: 'turns' must be a non-empty list of strings")
    if not turns[0]:
      raise ValueError(f"{where}: the first turn of prompt {str(pid)!r} is empty")
    # Only the first turn: later turns need the model's own answers, which a batch run does not have.
    return Prompt(str(pid) if pid is not None else "", tokenizer.apply_chat_template([turns[0]]), category, True)
  raise ValueError(f"{where}: a line needs 'prompt' or 'turns' (got keys {sorted(rec)})")


def load_prompts(path: Optional[str], tokenizer, limit: int = 0) -> list[Prompt]:
  if not path:
    records = [(f"default prompt {i}", r) for i, r in enumerate(DEFAULT_PROMPTS)]
  else:
    records = read_jsonl(path)
  prompts = [parse_record(rec, where, tokenizer) for where, rec in records]
  for i, p in enumerate(prompts):
    if not p.id:
      p.id = str(i)
  if limit:
    prompts = prompts[:limit]
  if not prompts:
    raise ValueError(f"no prompts in {path}")
  return prompts
