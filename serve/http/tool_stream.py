"""Streaming a chat answer that may be a tool call (serve/http/tools.py's format: one JSON object
`{"name": ..., "arguments": {...}}`) as OpenAI streams it: `delta.tool_calls` chunks, first the call's index, id,
type and function name with empty arguments, then argument fragments; finish_reason "tool_calls".

- tool_choice required or named: the grammar makes the answer a call, so the call streams as it is generated: the
  header once the name is complete, then the arguments' text as it grows (a run of closing braces and whitespace
  at the end is held back until more text shows it is not the object's end).
- tool_choice auto: an answer is a call only when its whole text is one valid call (as without streaming). Text
  that does not start with "{" streams as content at once; text that does is held to the end, then sent as the
  call or, if it is not one, as content.
"""

from __future__ import annotations

import json
import re
import uuid

from serve.http import tools

# The call's opening up to its arguments' value (the grammar puts "name" first; JSON whitespace at most one space)
_HEADER = re.compile(r'\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"arguments"\s*:\s*')
_TAIL = " \t\r\n}"


class ToolCallStream:
  """One choice's text -> the delta dicts to send ({"content": ...} or {"tool_calls": [...]}), fed as it grows."""

  def __init__(self, listed: dict, constrained: bool):
    self.tools, self.constrained = listed, constrained
    self.text = ""
    self.sent = 0  # content: characters of text sent; a call: characters of its arguments sent
    self.mode = "call" if constrained else None  # None: undecided; "text"; "call"; "held" (auto, maybe a call)
    self.header = None  # the header match once the call's name is complete
    self.id = "call_" + uuid.uuid4().hex[:24]

  def feed(self, piece: str) -> list:
    self.text += piece
    if self.mode is None:
      head = self.text.lstrip()
      if not head:
        return []
      self.mode = "held" if head.startswith("{") else "text"
    if self.mode == "text":
      return self._content()
    if self.mode == "call":
      return self._call(final=False)
    return []

  def finish(self, finish_reason):
    """-> (the last deltas, the finish reason: "tool_calls" for a whole call that ended normally)."""
    if self.mode == "held":
      if tools.parse_call(self.text, self.tools) is not None:
        self.mode = "call"
      else:
        self.mode = "text"
    if self.mode in (None, "text"):
      return self._content(), finish_reason
    out = self._call(final=True)
    whole = self.header is not None and tools.parse_call(self.text, self.tools) is not None
    return out, "tool_calls" if whole and finish_reason == "stop" else finish_reason

  def _content(self) -> list:
    piece, self.sent = self.text[self.sent:], len(self.text)
    return [{"content": piece}] if piece else []

  def _call(self, final: bool) -> list:
    out = []
    if self.header is None:
      m = _HEADER.match(self.text)
      # complete once the arguments' first character came (the whitespace before it may still grow)
      self.header = m if m is not None and m.end() < len(self.text) else None
      if self.header is None:
        # (constrained: the name is not complete yet; at the end, a call cut before its arguments)
        return self._content() if final else []
      name = json.loads(self.header.group(1))
      out.append({"tool_calls": [{"index": 0, "id": self.id, "type": "function",
                                  "function": {"name": name, "arguments": ""}}]})
    args = self.text[self.header.end():]
    if final:  # the arguments end before the call's own closing brace (a call cut short: all of it)
      whole = args.rstrip()
      args = whole[:-1].rstrip() if whole.endswith("}") and self._closed() else args
    else:
      args = args.rstrip(_TAIL) if args.rstrip(_TAIL) else ""
    piece, self.sent = args[self.sent:], max(self.sent, len(args))
    if piece:
      out.append({"tool_calls": [{"index": 0, "function": {"arguments": piece}}]})
    return out

  def _closed(self) -> bool:
    """Is the text a whole JSON object (the call's closing brace came)?"""
    try:
      json.loads(self.text)
      return True
    except json.JSONDecodeError:
      return False


def choice_chunks(ts: ToolCallStream, piece) -> list:
  """A chat delta choice (serve/choices.chat_delta, or None) -> the choices to send in its place: its content
  replaced by what `ts` lets out; the first keeps its logprobs and token ids (sent with an empty delta if nothing
  else goes out)."""
  if piece is None:
    return []
  deltas = ts.feed(piece["delta"].get("content") or "")
  extras = piece.get("logprobs") is not None or "token_ids" in piece
  out = [{**piece, "delta": d} for d in deltas] or ([{**piece, "delta": {}}] if extras else [])
  for o in out[1:]:
    o["logprobs"] = None
    o.pop("token_ids", None)
  return out


def cut_call(listed: dict, text: str):
  """A forced call (tool_choice required or named) that max_tokens cut: its tool_calls entry with the arguments
  generated so far, as vLLM returns it (finish_reason "length"), the same call the stream sent; None when the cut
  came before the function's name was complete (then the text stays content)."""
  ts = ToolCallStream(listed, constrained=True)
  deltas = ts.feed(text) + ts.finish("length")[0]
  calls = [d["tool_calls"][0] for d in deltas if "tool_calls" in d]
  if not calls or "id" not in calls[0]:
    return None
  head = calls[0]
  args = "".join(c["function"]["arguments"] for c in calls)
  return {"id": head["id"], "type": "function", "function": {"name": head["function"]["name"], "arguments": args}}


def answer(body: dict, listed: dict, text: str, forced: bool = False) -> dict:
  """A chat.completion body whose text is one valid call: the call as `tool_calls`, finish_reason tool_calls. A
  forced call (`forced`: tool_choice required or named) cut by max_tokens is a call too, with the arguments cut
  (finish_reason length)."""
  call = tools.parse_call(text, listed)
  if call is None and forced and body["choices"][0]["finish_reason"] == "length":
    call = cut_call(listed, text)
  if call is not None:
    choice = body["choices"][0]
    choice["message"] = {"role": "assistant", "content": None, "tool_calls": [call]}
    if choice["finish_reason"] == "stop":
      choice["finish_reason"] = "tool_calls"
  return body
