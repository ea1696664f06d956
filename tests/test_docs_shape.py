"""The shape of docs/architecture.md (and the paths README.md names): short enough to read, tables that stay tables,
no history, and every file it names exists. Text only: no model, no JAX.

The path check is strict on purpose: a file that moves or goes away makes the doc false, and this test says which
name to fix."""

from __future__ import annotations

import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

ARCHITECTURE = os.path.join(ROOT, "docs", "architecture.md")
README = os.path.join(ROOT, "README.md")
MAX_LINES = 400
MAX_CELL = 300
# Top-level folders whose paths a doc may name: each named path must exist (a file, or a folder when it ends in /).
CHECKED_ROOTS = ("spec_jax", "serve", "train", "tests", "benchmarks", "configs")
_PATH = re.compile(r"(?<![\w./<>-])((?:%s)/[\w./-]*)" % "|".join(CHECKED_ROOTS))
_MODULE = re.compile(r"python -m ([\w.]+)")
_ISSUE = re.compile(r"\bissues?\s+\d+|(?<![\w&])#\d+\b", re.IGNORECASE)


def _read(path: str) -> str:
  with open(path, encoding="utf-8") as f:
    return f.read()


def table_cells(text: str) -> list:
  """Every cell of every markdown table row: a line starting with '|', split on '|' outside code spans."""
  cells = []
  for line in text.splitlines():
    if not line.lstrip().startswith("|"):
      continue
    cell, in_code = "", False
    for ch in line.strip()[1:]:
      if ch == "`":
        in_code = not in_code
      if ch == "|" and not in_code:
        cells.append(cell.strip())
        cell = ""
      else:
        cell += ch
    if cell.strip():
      cells.append(cell.strip())
  return cells


def long_cells(text: str) -> list:
  return [c[:80] + "..." for c in table_cells(text) if len(c) > MAX_CELL]


def headings(text: str) -> list:
  """Markdown headings, code blocks skipped (a shell comment there is not a heading)."""
  out, fenced = [], False
  for line in text.splitlines():
    if line.startswith("```"):
      fenced = not fenced
    elif not fenced and re.match(r"#{1,6} ", line):
      out.append(line)
  return out


def issue_references(text: str) -> list:
  """Issue numbers anywhere ("issue 35", "#35"): history lives in BENCHMARKS.md and git, not in the design."""
  return [m.group(0) for m in _ISSUE.finditer(text)]


def missing_paths(text: str, root: str = ROOT) -> list:
  """Paths under CHECKED_ROOTS, and modules run with `python -m`, that the doc names and the tree lacks."""
  missing = []
  for m in _PATH.finditer(text):
    path = m.group(1).rstrip(".")
    ok = os.path.isdir(os.path.join(root, path)) if path.endswith("/") else os.path.exists(os.path.join(root, path))
    if not ok:
      missing.append(path)
  for m in _MODULE.finditer(text):
    mod = m.group(1).rstrip(".").replace(".", os.sep)
    if not any(os.path.isfile(os.path.join(root, f)) for f in (mod + ".py", os.path.join(mod, "__main__.py"))):
      missing.append("python -m " + m.group(1))
  return sorted(set(missing))


def test_architecture_is_short():
  n = len(_read(ARCHITECTURE).splitlines())
  assert n < MAX_LINES, f"docs/architecture.md has {n} lines; keep it under {MAX_LINES}"


def test_architecture_table_cells_are_short():
  bad = long_cells(_read(ARCHITECTURE))
  assert not bad, f"table cells over {MAX_CELL} characters (say it in prose below the table):\n" + "\n".join(bad)


def test_architecture_has_no_issue_numbers():
  text = _read(ARCHITECTURE)
  assert not [h for h in headings(text) if _ISSUE.search(h)], "issue numbers in headings"
  assert not issue_references(text), f"issue numbers in docs/architecture.md: {issue_references(text)}"


def test_architecture_names_only_files_that_exist():
  bad = missing_paths(_read(ARCHITECTURE))
  assert not bad, "docs/architecture.md names paths that do not exist:\n" + "\n".join(bad)


def test_readme_names_only_files_that_exist():
  bad = missing_paths(_read(README))
  assert not bad, "README.md names paths that do not exist:\n" + "\n".join(bad)


def test_the_checks_catch_what_they_are_for(tmp_path):
  """Each check on a small bad document, so a check that cannot fail is caught here."""
  (tmp_path / "serve").mkdir()
  (tmp_path / "serve" / "engine").mkdir()
  (tmp_path / "serve" / "engine" / "engine.py").write_text("")
  (tmp_path / "serve" / "loadtest").mkdir()
  (tmp_path / "serve" / "loadtest" / "__main__.py").write_text("")
  doc = "\n".join([
      "# The KV pool (issue 35)",
      "## Trees #13",
      "| file | owns |",
      "|---|---|",
      "| `serve/engine/engine.py` | " + "x" * (MAX_CELL + 1) + " |",
      "| `a | b` | short |",
      "```bash",
      "# issue 7 inside a code block is a shell comment, not a heading",
      "```",
      "`serve/engine/engine.py`, `serve/loadtest/`, `python -m serve.loadtest` exist; `serve/http/gone.py`,",
      "`spec_jax/gone.py`, `train/`, `python -m serve.nothing` do not.",
  ])
  assert len(long_cells(doc)) == 1
  assert "`a | b`" in table_cells(doc)  # a pipe inside a code span does not split the cell
  assert [h for h in headings(doc) if _ISSUE.search(h)] == ["# The KV pool (issue 35)", "## Trees #13"]
  assert issue_references(doc) == ["issue 35", "#13", "issue 7"]
  assert missing_paths(doc, str(tmp_path)) == ["python -m serve.nothing", "serve/http/gone.py",
                                               "spec_jax/gone.py", "train/"]
  assert not missing_paths("`serve/engine/engine.py`, `serve/loadtest/`, python -m serve.loadtest", str(tmp_path))
