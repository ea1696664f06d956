"""Whether the served model is a base (pretrained, not instruction-tuned) model, and what that means for chat and
tools: the server says so at start-up (serve/server.py), so a chat answer that continues the prompt does not read as
a server bug.

A GGUF is taken as a base model when its metadata carries no chat template of its own and neither its name nor its
fine-tune field says instruct / it / chat (Gemma 3 270M's packaged GGUF: "Gemma 3 270m", no template). HF
directories are not judged (no reliable marker); the note is only ever a log line.
"""

from __future__ import annotations

import os
import re

from spec_jax.checkpoints.gguf_meta import read_metadata
from spec_jax.checkpoints.load import resolve_model_path

TUNED = re.compile(r"(^|[^a-z])(it|instruct|instruction|chat|sft|rlhf|dpo)([^a-z]|$)", re.I)

NOTE = ("{name} is a base model (pretrained, not instruction-tuned: {why}). /v1/chat/completions still applies a chat "
        "template, but the model tends to continue the conversation's text rather than answer it; with "
        "tool_choice \"auto\" it rarely calls a tool, and a tool-result turn may come back as noise. For such a model "
        "use /v1/completions with text to continue, or force a shape with response_format / tool_choice "
        "\"required\" (structured outputs); for a chat assistant serve an instruction-tuned model (--model=PATH).")


def base_model_note(model: str, tokenizer=None) -> str | None:
  """The start-up note for a base model, or None (instruction-tuned, or not judged)."""
  path = resolve_model_path(model or None)
  if os.path.isdir(path) or not path.endswith(".gguf"):
    return None
  try:
    meta = read_metadata(path, ("general.name", "general.finetune", "tokenizer.chat_template"))
  except (OSError, ValueError):
    return None
  name = str(meta.get("general.name") or os.path.basename(path))
  tuned_name = TUNED.search(name) or TUNED.search(str(meta.get("general.finetune") or ""))
  if meta.get("tokenizer.chat_template") or tuned_name:
    return None
  return NOTE.format(name=name, why="its GGUF has no chat template and no instruct/chat fine-tune in its name")
