"""The SSE response of a streamed request: its choices' deltas as OpenAI's chunks (tool calls as delta.tool_calls,
serve/http/tool_stream.py), the usage chunk and [DONE]; and freeing a request's slot when its client is gone."""

from __future__ import annotations

import json

from fastapi.responses import StreamingResponse

from serve.http import choices as ch
from serve.http.protocol import APIError, chat_chunk, completion_chunk, new_id, progress_usage, usage_chunk
from serve.http.tool_stream import ToolCallStream, choice_chunks


def abort_unfinished(engine, choices: list) -> None:
  for c in choices:
    if not c.req.finished:
      engine.abort(c.req)  # the client went away (or the server is stopping): free the slot


class EventStream(StreamingResponse):
  """An SSE response that calls `on_close` however it ends. A client that walks away cancels the response while it
  may be inside `send`, outside the body generator: the generator is then left suspended and its `finally` runs
  only when the garbage collector finds it (seconds later), so the request's slot and pages are freed here, at
  once (the engine frees them at its next iteration)."""

  def __init__(self, body, on_close):
    super().__init__(body, media_type="text/event-stream", headers={"Cache-Control": "no-cache",
                                                                     "X-Accel-Buffering": "no"})
    self.on_close = on_close

  async def __call__(self, scope, receive, send):
    try:
      await super().__call__(scope, receive, send)
    finally:
      self.on_close()
      await self.body_iterator.aclose()


def sse(obj) -> str:
  return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


class ChoiceEvents:
  """The SSE events of one request's choices. event: set when any choice's output has news; ask, fmt: the
  logprobs asked for and their formatter (serve/http/logprobs_format.py); plan: the structured output (its tools)."""

  def __init__(self, engine, model: str, choices: list, event, ask, fmt, *, chat: bool, include_usage: bool,
               with_ids: bool, plan, continuous: bool = False, echo: str = ""):
    self.engine, self.model, self.choices, self.event, self.ask, self.fmt = engine, model, choices, event, ask, fmt
    self.chat, self.include_usage, self.with_ids, self.continuous, self.echo = (chat, include_usage, with_ids,
                                                                                continuous, echo)
    self.rid = new_id("chatcmpl" if chat else "cmpl")
    self.by_index = {c.index: c for c in choices}
    # a chat answer that may be a tool call streams as delta.tool_calls (serve/http/tool_stream.py)
    self.calls = ({c.index: ToolCallStream(plan.tools, plan.regex is not None) for c in choices} if plan.tools
                  else {})

  def response(self) -> EventStream:
    return EventStream(self.events(), lambda: abort_unfinished(self.engine, self.choices))

  def wrap(self, choice) -> dict:
    body = (chat_chunk(self.rid, self.model, {}, None, with_usage_field=self.include_usage) if self.chat else
            completion_chunk(self.rid, self.model, "", None, with_usage_field=self.include_usage))
    body["choices"] = [choice]
    if self.continuous:  # vLLM's continuous_usage_stats: the choice's usage so far in every chunk
      body["usage"] = progress_usage(self.by_index[choice["index"]])
    return body

  def end(self, c) -> list:
    reason, last = c.final.finish_reason, []
    if c.index in self.calls:
      deltas, reason = self.calls[c.index].finish(reason)
      last = [{"index": c.index, "delta": d, "logprobs": None, "finish_reason": None} for d in deltas]
    done = {"index": c.index, "logprobs": None, "finish_reason": reason}
    done.update({"delta": {}} if self.chat else {"text": ""})
    if self.with_ids:
      done["token_ids"] = []
    return last + [done]

  def first(self):
    """Chat's first chunk per choice: the role (and chat echo's content)."""
    for c in self.choices:
      first = self.wrap({"index": c.index, "delta": {"role": "assistant", "content": self.echo}, "logprobs": None,
                         "finish_reason": None})
      if self.with_ids:  # vLLM's: the prompt's ids once, at the top of the first chunk
        first["prompt_token_ids"] = c.prompt_ids
      yield sse(first)

  def deltas(self, c, d):
    """A choice's delta -> its events (an error ends the stream: the caller stops)."""
    piece = (ch.chat_delta if self.chat else ch.completion_delta)(self.fmt, c, d, self.ask, self.with_ids)
    for p in (choice_chunks(self.calls[c.index], piece) if c.index in self.calls else [piece] if piece else []):
      yield sse(self.wrap(p))
    if d.error:  # headers are sent: the error goes in the stream, as vLLM sends it
      status, kind, msg = d.error
      yield sse(APIError(status, msg, code=kind).body())
    elif d.finished:
      for p in self.end(c):
        yield sse(self.wrap(p))

  async def events(self):
    try:
      if self.chat:
        for e in self.first():
          yield e
      live = list(self.choices)
      while live:
        moved = False
        for c in list(live):
          d = c.output.take()
          if d is None:
            continue
          moved = True
          c.add(d)
          for e in self.deltas(c, d):
            yield e
          if d.error:
            live = []
            break
          if d.finished:
            live.remove(c)
        if live and not moved:
          await self.event.wait()
          self.event.clear()
      if self.include_usage and all(c.final is not None and not c.final.error for c in self.choices):
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        yield sse(usage_chunk(self.rid, self.model, obj, ch.total_usage(self.choices)))
      yield "data: [DONE]\n\n"
    finally:
      abort_unfinished(self.engine, self.choices)
