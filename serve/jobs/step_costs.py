"""The step-cost file the adaptive controller reads: one entry per (method, dtype, largest k, state rows), each
the cost of a loop step drafting k tokens over that of a k = 0 step at measured occupancies. `serve.calibrate`
measures entries, `serve.aot --cost_table` estimates them with the compiler; the server, `serve.generate` and the
benchmarks load them here.
"""

from __future__ import annotations

import json
import os

import numpy as np


def entry_key(method: str, dtype: str, k: int, batch: int) -> str:
  """Costs depend on the state's row count (every row rides along in the forward), not only on the busy ones."""
  return f"{method}/{dtype}/k{k}/b{batch}"


def method_key(proposer) -> str:
  """The method part of a cost entry: a token tree costs more than a chain of its depth, so it has its own."""
  return proposer.name + (f"_tree{proposer.tree.nodes}" if proposer.tree is not None else "")


def table_for(entry: dict, ks, batch: int) -> np.ndarray:
  """An entry's costs as the controller's [batch, len(ks)] table (linear between measured occupancies)."""
  if list(entry["ks"]) != list(ks):
    raise ValueError(f"the calibration was measured for draft lengths {entry['ks']}, this run uses {list(ks)}")
  occ = np.asarray(entry["occupancies"], float)
  costs = np.asarray(entry["costs"], float)
  a = np.arange(1, batch + 1, dtype=float)
  return np.stack([np.interp(a, occ, costs[:, j]) for j in range(costs.shape[1])], axis=1).astype(np.float32)


def load_costs(path: str, method: str, dtype: str, ks, batch: int):
  """The cost table for a state of `batch` rows from a calibration file, or None (the default model) when the file
  has no entry for it. A missing file is an error: a config that names one expects it."""
  if not path or method == "none" or len(ks) < 2:  # one option: nothing to choose, no costs needed
    return None
  repo_path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", path)
  if not os.path.isabs(path) and not os.path.isfile(path) and os.path.isfile(repo_path):
    path = repo_path  # configs name files relative to the repository
  if not os.path.isfile(path):
    raise FileNotFoundError(f"costs file {path!r} not found (write it with python -m serve.calibrate)")
  with open(path, encoding="utf-8") as f:
    entries = json.load(f)
  entry = entries.get(entry_key(method, dtype, max(ks), batch))
  return None if entry is None else table_for(entry, ks, batch)
