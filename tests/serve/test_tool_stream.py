"""serve/http/tool_stream.py: a tool call streamed as OpenAI's delta.tool_calls chunks, fed the answer's text in pieces
of every size (no server: the API test is tests/serve/test_server_structured.py)."""

from __future__ import annotations

import json

import pytest

from serve.http import tools
from serve.http.tool_stream import ToolCallStream
from tests.serve.test_server_structured import TIME, WEATHER

LISTED = tools.check_tools([WEATHER, TIME])
CALL = '{"name": "get_weather", "arguments": {"city": "Paris", "days": "3"}}'


def _run(text, constrained, size, reason="stop"):
  ts = ToolCallStream(LISTED, constrained)
  during = [d for i in range(0, len(text), size) for d in ts.feed(text[i:i + size])]
  last, reason = ts.finish(reason)
  return during, last, reason


@pytest.mark.parametrize("size", [1, 3, 7, 1000])
def test_a_constrained_call_streams_its_header_then_its_arguments(size):
  during, last, reason = _run(" " + CALL, True, size)
  out = during + last
  head = out[0]["tool_calls"][0]
  assert head["index"] == 0 and head["id"].startswith("call_") and head["type"] == "function"
  assert head["function"] == {"name": "get_weather", "arguments": ""}
  args = "".join(d["tool_calls"][0]["function"]["arguments"] for d in out[1:])
  assert args == '{"city": "Paris", "days": "3"}' and reason == "tool_calls"
  assert all("content" not in d for d in out)
  if size == 1:  # the arguments stream as they grow, not at the end
    assert len(during) > 5


def test_nested_closing_braces_are_held_only_until_more_text_comes():
  text = '{"name": "get_time", "arguments": {"zone": {"a": {}}, "b": "}"}}'
  for size in (1, 2, 5):
    during, last, _ = _run(text, True, size)
    args = "".join(d["tool_calls"][0]["function"]["arguments"] for d in (during + last)[1:])
    assert args == '{"zone": {"a": {}}, "b": "}"}'


def test_a_call_cut_by_the_token_limit_sends_what_there_is():
  during, last, reason = _run(CALL[:50], True, 4, reason="length")
  args = "".join(d["tool_calls"][0]["function"]["arguments"] for d in (during + last)[1:])
  assert reason == "length" and CALL[:50].endswith(args) and args.startswith('{"city"')


@pytest.mark.parametrize("size", [1, 4])
def test_auto_streams_text_at_once_and_holds_a_possible_call_to_the_end(size):
  during, last, reason = _run("Hello there", False, size)
  assert "".join(d["content"] for d in during) == "Hello there" and not last and reason == "stop"
  during, last, reason = _run('{"x": 1} and more', False, size)  # starts like a call: held, then text
  assert during == [] and last == [{"content": '{"x": 1} and more'}] and reason == "stop"
  during, last, reason = _run(CALL, False, size)  # a whole valid call: sent as one at the end
  assert during == [] and reason == "tool_calls"
  assert last[0]["tool_calls"][0]["function"]["name"] == "get_weather"
  assert json.loads(last[1]["tool_calls"][0]["function"]["arguments"]) == {"city": "Paris", "days": "3"}
