import json

import pytest

from serve.jobs.prompts import load_prompts


class _Tok:
  def apply_chat_template(self, turns):
    return f"<start_of_turn>user\n{turns[0]}<end_of_turn>\n<start_of_turn>model\n"


def _write(tmp_path, lines):
  p = tmp_path / "p.jsonl"
  p.write_text("\n".join(lines) + "\n")
  return str(p)


def test_prompt_and_turns_and_specbench_fields(tmp_path):
  path = _write(tmp_path, [json.dumps({"id": "a", "prompt": "Hello"}),
                           json.dumps({"question_id": 81, "category": "writing", "turns": ["Write.", "Again."]}),
                           "", json.dumps({"prompt": "no id"})])
  ps = load_prompts(path, _Tok())
  assert [p.id for p in ps] == ["a", "81", "2"]
  assert ps[0].text == "Hello" and not ps[0].is_chat
  assert ps[1].text.startswith("<start_of_turn>user\nWrite.") and ps[1].category == "writing"


@pytest.mark.parametrize("line,match", [
    (json.dumps({"id": 1, "text": "x"}), "needs 'prompt' or 'turns'"),
    (json.dumps({"turns": []}), "non-empty list"),
    (json.dumps({"prompt": 5}), "must be a string"),
    ("{not json", "not valid JSON"),
    (json.dumps([1, 2]), "expected a JSON object"),
])
def test_bad_lines_name_the_line(tmp_path, line, match):
  path = _write(tmp_path, [json.dumps({"prompt": "ok"}), line])
  with pytest.raises(ValueError, match=match) as e:
    load_prompts(path, _Tok())
  assert "p.jsonl:2" in str(e.value)


def test_missing_file(tmp_path):
  with pytest.raises(FileNotFoundError, match="nope.jsonl"):
    load_prompts(str(tmp_path / "nope.jsonl"), _Tok())
