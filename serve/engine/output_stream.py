"""What a request's client receives: its tokens as text, cut at stop strings, merged into an `Output` that the
engine thread fills and the HTTP layer drains.

The engine never waits for a client: deltas merge under a short lock while the client is slow, and `notify`
wakes the server's asyncio task.
"""

from __future__ import annotations

import dataclasses
import threading
from typing import Callable, Optional


@dataclasses.dataclass
class Usage:
  prompt_tokens: int
  completion_tokens: int
  drafted_tokens: int
  accepted_tokens: int
  drafts: int
  cached_tokens: int = 0  # prompt tokens read from the prefix cache (OpenAI's prompt_tokens_details)


@dataclasses.dataclass
class Delta:
  """Everything handed to a request since the last `take`."""
  text: str
  token_ids: list
  finish_reason: Optional[str] = None
  error: Optional[tuple] = None  # (status, kind, message)
  usage: Optional[Usage] = None
  logprobs: list = dataclasses.field(default_factory=list)  # (logprob, top ids, top values) per token id, if asked

  @property
  def finished(self) -> bool:
    return self.finish_reason is not None or self.error is not None


class Output:
  """One request's output, filled by the engine thread and drained by the HTTP layer.

  Deltas merge while the client is slow (the engine only appends under a short lock); `notify` is called after
  each append (the server wakes its asyncio task with it)."""

  def __init__(self, notify: Callable[[], None] | None = None):
    self._lock = threading.Lock()
    self._text: list = []
    self._ids: list = []
    self._lps: list = []
    self._final: Optional[Delta] = None
    self._taken_final = False
    self.notify = notify or (lambda: None)

  def put(self, text: str = "", token_ids=(), *, finish_reason=None, error=None, usage=None, logprobs=()) -> None:
    with self._lock:
      if self._final is not None:
        return
      if text:
        self._text.append(text)
      self._ids.extend(token_ids)
      self._lps.extend(logprobs or ())
      if finish_reason is not None or error is not None:
        self._final = Delta("", [], finish_reason, error, usage)
    try:
      self.notify()
    except RuntimeError:  # the server's event loop is closed (shutting down): nobody is listening
      pass

  def take(self) -> Optional[Delta]:
    """Pending text and ids (and the end, once reached); None when there is nothing new."""
    with self._lock:
      if not self._text and not self._ids and (self._final is None or self._taken_final):
        return None
      d = Delta("".join(self._text), self._ids, logprobs=self._lps)
      self._text, self._ids, self._lps = [], [], []
      if self._final is not None:
        d.finish_reason, d.error, d.usage = self._final.finish_reason, self._final.error, self._final.usage
        self._taken_final = True
      return d


class TextStream:
  """A request's new tokens as text: detokenized incrementally (`decoder`, the tokenizer's stream), cut at the
  earliest `stop` string, and put into `output`. Text that could still be the start of a stop string is held
  back until it cannot."""

  def __init__(self, output: Output, decoder, stop: tuple):
    self.output, self.decoder, self.stop = output, decoder, stop
    self.text = ""  # decoded but not yet handed over (the held-back tail)

  def push(self, ids: list, text_ids: list, logprobs=None) -> int:
    """Hand over `ids` (their text: `text_ids`, which leaves out a final stop token; `logprobs`: one entry per
    id, or None). -> how many of `ids` were taken: all of them, or fewer when a stop string ended the text (then
    the caller finishes the request)."""
    lps = logprobs or ()
    if not self.stop:
      self.output.put(self.decoder.add(text_ids), ids, logprobs=lps)
      return len(ids)
    longest = max(len(s) for s in self.stop)
    for i, t in enumerate(ids):
      before = len(self.text)
      if i < len(text_ids):
        self.text += self.decoder.add(t)
      hit = find_stop(self.text, self.stop, max(0, before - longest + 1))
      if hit >= 0:
        self.output.put(self.text[:hit], ids[:i + 1], logprobs=lps[:i + 1])
        self.text = ""
        return i + 1
    safe = len(self.text) - (longest - 1)
    if safe > 0:
      self.output.put(self.text[:safe], ids, logprobs=lps)
      self.text = self.text[safe:]
    else:
      self.output.put("", ids, logprobs=lps)
    return len(ids)

  def flush(self) -> str:
    """The held-back text and the decoder's last bytes, at the end of the request."""
    tail, self.text = self.text + self.decoder.flush(), ""
    return tail


def find_stop(text: str, stops: tuple, start: int) -> int:
  """Earliest index at which any stop string begins, searching from `start`; -1 if none."""
  hits = [i for i in (text.find(s, start) for s in stops) if i >= 0]
  return min(hits) if hits else -1
