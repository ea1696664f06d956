"""The SSE response of a streamed request, and freeing a request's slot when its client is gone."""

from __future__ import annotations

from fastapi.responses import StreamingResponse


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
