"""serve/http/api.py's EventStream: a client that walks away while the response is inside `send` (it stopped reading)
cancels the response outside the body generator; the request must still be aborted at once, not when the
garbage collector finalizes the suspended generator (issue 50 item 9). No server, no JAX: ~0.1 s."""

from __future__ import annotations

import asyncio
import gc

import pytest

from serve.http.event_stream import EventStream


@pytest.mark.parametrize("spec_version", ["2.3", "2.4"])
def test_cancelled_inside_send_aborts_and_closes_the_generator_at_once(spec_version):
  events = []

  async def body():
    try:
      while True:
        yield "data: {}\n\n"
    finally:
      events.append("generator closed")

  async def main():
    in_send, never = asyncio.Event(), asyncio.Event()

    async def send(message):
      if message["type"] == "http.response.body":
        in_send.set()
        await never.wait()  # a client that stopped reading: the write waits

    async def receive():
      await never.wait()
      return {"type": "http.disconnect"}

    response = EventStream(body(), lambda: events.append("aborted"))
    task = asyncio.ensure_future(response({"type": "http", "asgi": {"spec_version": spec_version}}, receive, send))
    await in_send.wait()
    task.cancel()  # the server saw the disconnect
    with pytest.raises(asyncio.CancelledError):
      await task
    assert events == ["aborted", "generator closed"]  # before asyncio.run's own clean-up of generators

  gc.disable()  # the finalizer must not be what closes it
  try:
    asyncio.run(main())
  finally:
    gc.enable()
