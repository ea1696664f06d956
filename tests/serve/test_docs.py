"""BUILD.md against the code: its table of request fields matches serve/http/protocol.py's FIELDS (derived from the
code: a field added there needs its row here), and every curl example in it runs as written against a live tiny
server (only the host and port substituted). The table check takes milliseconds; the curls about 20-40 s (the
server's start).
"""

from __future__ import annotations

import os
import re
import subprocess

import pytest

from serve.http.protocol import FIELDS, HARMLESS, HONOURED, ROUTES
from tests.serve.test_server import ROOT, tiny_model, tiny_server  # noqa: F401 (a fixture)

BUILD = os.path.join(ROOT, "BUILD.md")
DOC_MODEL = "gemma-3-270m"  # the model name the examples use
DOC_HOSTS = ("http://127.0.0.1:8000", "http://localhost:8000", "localhost:8000", "127.0.0.1:8000")


def _build_md() -> str:
  with open(BUILD, encoding="utf-8") as f:
    return f.read()


def status_in_code(rule) -> str:
  """The table's row label for a FIELDS rule."""
  if rule == HONOURED:
    return "honoured"
  if rule == HARMLESS:
    return "harmless"
  if set(rule.routes) == set(ROUTES):
    return "refused"
  return "refused on " + "/".join(rule.routes)


def doc_table(text: str) -> dict:
  """{field: row label} from BUILD.md's request-field table (the rows under "| what the server does | fields |";
  a label is its first cell up to the first ':' or '(')."""
  head = text.index("| what the server does | fields |")
  out = {}
  for line in text[head:].splitlines()[2:]:
    if not line.startswith("|"):
      break
    label, fields = (c.strip() for c in line.strip("|").split("|", 1))
    label = re.split(r"[:(]", label)[0].strip().rstrip(",")
    label = label.replace(", the same way", "")
    for name in re.findall(r"`([a-z_]+)`", fields):
      assert name not in out, f"{name} is in two rows of BUILD.md's request-field table"
      out[name] = label
  return out


def test_build_md_request_field_table_matches_protocol():
  doc = doc_table(_build_md())
  code = {name: status_in_code(rule) for name, rule in FIELDS.items()}
  missing = sorted(set(code) - set(doc))
  extra = sorted(set(doc) - set(code))
  wrong = sorted(f"{n}: BUILD.md says {doc[n]!r}, protocol.py {code[n]!r}" for n in set(doc) & set(code)
                 if doc[n] != code[n])
  assert not missing and not extra and not wrong, (missing, extra, wrong)


def curl_examples(text: str) -> list:
  """Every curl command in BUILD.md: lines of ```bash blocks (with their `\\` continuations, without a trailing
  comment) and inline `curl ...` spans."""
  cmds = []
  for block in re.findall(r"```bash\n(.*?)```", text, re.S):
    lines = block.replace("\\\n", " ").splitlines()
    cmds += [re.sub(r"\s+#[^'\"]*$", "", l).strip() for l in lines if l.strip().startswith("curl ")]
  cmds += re.findall(r"`(curl [^`]+)`", text)
  return cmds


def test_curl_examples_are_found():
  cmds = curl_examples(_build_md())
  assert any("/admin/speculation" in c for c in cmds) and any("openapi.json" in c for c in cmds)
  assert all(any(h in c for h in DOC_HOSTS) for c in cmds), cmds


def test_curl_examples_run_as_written(tiny_model):  # noqa: F811
  cmds = curl_examples(_build_md())
  s = tiny_server(tiny_model, f"--served_model_name={DOC_MODEL}")
  try:
    for cmd in cmds:
      live = cmd
      for host in DOC_HOSTS:
        live = live.replace(host, s.url if host.startswith("http") else s.url[len("http://"):])
      r = subprocess.run(["bash", "-o", "pipefail", "-c", live], capture_output=True, text=True, timeout=120)
      assert r.returncode == 0 and r.stdout.strip(), (cmd, r.returncode, r.stdout[-500:], r.stderr[-500:])
      assert '"error"' not in r.stdout, (cmd, r.stdout[-800:])
  finally:
    assert s.stop() == 0, s.log()[-3000:]


@pytest.mark.parametrize("text,found", [
    ("```bash\ncurl -s localhost:8000/x \\\n    -d '{}'   # why\n```", ["curl -s localhost:8000/x      -d '{}'"]),
    ("see `curl http://127.0.0.1:8000/openapi.json`.", ["curl http://127.0.0.1:8000/openapi.json"])])
def test_curl_extraction(text, found):
  assert curl_examples(text) == found
