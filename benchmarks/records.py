"""The one way a benchmark script hands over a measurement: a JSON line on stdout (for the log) and, with a path,
the same line appended to a JSONL file (the raw numbers BENCHMARKS.md cites). Appending keeps every round of an
interleaved run in one file. (benchmarks/probes/paged_step.py keeps its own copy: it runs in old checkouts too.)"""

from __future__ import annotations

import json
import time


def now_utc() -> str:
  return time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())


def emit(record: dict, path: str = "") -> None:
  line = json.dumps(record)
  print(line, flush=True)
  if path:
    with open(path, "a") as f:
      f.write(line + "\n")
