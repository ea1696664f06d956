"""The self-distilled answers on disk: `train.distill` writes them, `train.data` reads them.

shard-NNNNN.npz per shard (prompt position, prompt index in `train.examples.load_examples`, temperature, finish,
offsets, the prompt + answer token ids as one int32 run) and manifest.json (settings, each shard's sha256 and
counts). A shard whose checksum differs from the manifest's is never read. `Answers` reads them one answer at a time (a
trainer host of many reads only the answers it feeds).
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import zipfile
from typing import Callable, Sequence

import numpy as np

from spec_jax.datasets import DISTILL_DIR

FORMAT_VERSION = 1


def sha256_of(path: str) -> str:
  h = hashlib.sha256()
  with open(path, "rb") as f:
    for block in iter(lambda: f.read(1 << 20), b""):
      h.update(block)
  return h.hexdigest()


def read_manifest(out: str) -> dict:
  path = os.path.join(out, "manifest.json")
  if not os.path.exists(path):
    return {}
  with open(path) as f:
    return json.load(f)


def write_manifest(out: str, manifest: dict) -> None:
  tmp = os.path.join(out, "manifest.json.tmp")
  with open(tmp, "w") as f:
    json.dump(manifest, f, indent=1, sort_keys=True)
    f.write("\n")
  os.replace(tmp, os.path.join(out, "manifest.json"))


def shard_ok(out: str, manifest: dict, name: str) -> bool:
  entry = manifest.get("shards", {}).get(name)
  path = os.path.join(out, name)
  return entry is not None and os.path.exists(path) and sha256_of(path) == entry["sha256"]


def write_shard(out: str, name: str, records: Sequence[dict]) -> dict:
  """records: dicts of position, example, temperature, finish, prompt_len, ids (prompt + answer)."""
  records = sorted(records, key=lambda r: r["position"])
  lens = np.array([len(r["ids"]) for r in records], np.int64)
  arrays = dict(
      position=np.array([r["position"] for r in records], np.int32),
      example=np.array([r["example"] for r in records], np.int32),
      temperature=np.array([r["temperature"] for r in records], np.float32),
      finish=np.array([r["finish"] for r in records], np.uint8),  # 1 = stop token, 0 = length cap
      prompt_len=np.array([r["prompt_len"] for r in records], np.int32),
      offsets=np.concatenate([[0], np.cumsum(lens)]).astype(np.int64),
      tokens=np.concatenate([np.asarray(r["ids"], np.int32) for r in records]) if records else
      np.zeros(0, np.int32))
  path = os.path.join(out, name)
  tmp = path + ".tmp.npz"
  np.savez_compressed(tmp, **arrays)
  os.replace(tmp, path)
  answer = int(sum(len(r["ids"]) - r["prompt_len"] for r in records))
  return dict(sha256=sha256_of(path), prompts=len(records), answer_tokens=answer,
              prompt_tokens=int(sum(r["prompt_len"] for r in records)),
              stopped=int(sum(r["finish"] for r in records)))


def load_shards(out: str = DISTILL_DIR, verify: bool = True) -> list[dict]:
  """-> one dict per answered prompt (position, example, temperature, finish, prompt_len, ids), in position
  order, from every shard the manifest lists. A shard whose checksum differs is an error, never read."""
  manifest = read_manifest(out)
  if not manifest.get("shards"):
    raise FileNotFoundError(f"no self-distilled shards in {out}: run `python -m train.distill --out={out}`")
  recs = []
  for name in sorted(manifest["shards"]):
    path = os.path.join(out, name)
    if verify and not shard_ok(out, manifest, name):
      raise ValueError(f"{path} is missing or does not match its checksum in {out}/manifest.json: regenerate it "
                       f"with `python -m train.distill --out={out}` (it rewrites bad shards)")
    z = np.load(path)
    off = z["offsets"]
    for i in range(len(z["position"])):
      recs.append(dict(position=int(z["position"][i]), example=int(z["example"][i]),
                       temperature=round(float(z["temperature"][i]), 4), finish=int(z["finish"][i]),
                       prompt_len=int(z["prompt_len"][i]), ids=z["tokens"][off[i]:off[i + 1]]))
  recs.sort(key=lambda r: r["position"])
  return recs


class NpzRows:
  """One array member of an .npz, read a run of rows (along axis 0) at a time, never whole: memory-mapped where the
  member is stored (np.savez: train.data's answers cache), else decompressed up to the rows and no further
  (np.savez_compressed: the shards)."""

  def __init__(self, path: str, name: str):
    self.path = path
    with zipfile.ZipFile(path) as zf:
      self.info = zf.getinfo(name + ".npy")
      with zf.open(self.info) as f:
        self.header = _npy_header(f)
    self.shape, self.dtype = self.header[0], self.header[1]
    self.row_bytes = int(np.prod(self.shape[1:], dtype=np.int64)) * self.dtype.itemsize
    self._map = None
    if self.info.compress_type == zipfile.ZIP_STORED:
      with open(path, "rb") as f:  # the member's data starts after its local header (its own name/extra lengths)
        f.seek(self.info.header_offset + 26)
        n, m = struct.unpack("<HH", f.read(4))
      start = self.info.header_offset + 30 + n + m + self.header[2]
      self._map = np.memmap(path, self.dtype, "r", offset=start, shape=self.shape)

  def rows(self, start: int, stop: int) -> np.ndarray:
    if self._map is not None:
      return np.array(self._map[start:stop])
    with zipfile.ZipFile(self.path) as zf, zf.open(self.info) as f:
      f.seek(self.header[2] + start * self.row_bytes)
      buf = f.read((stop - start) * self.row_bytes)
    return np.frombuffer(buf, self.dtype).reshape((stop - start, *self.shape[1:]))


def _npy_header(f) -> tuple:
  """(shape, dtype, header bytes) of the .npy stream `f` (positioned at its start); C order only."""
  major, _ = np.lib.format.read_magic(f)
  read = np.lib.format.read_array_header_1_0 if major == 1 else np.lib.format.read_array_header_2_0
  shape, fortran, dtype = read(f)
  if fortran and len(shape) > 1:
    raise ValueError("a Fortran-ordered array in an .npz of answers")
  return shape, dtype, f.tell()


class Answers:
  """n answers (prompt + answer token id lists) read one at a time on first use (`answers[i]`); `read` holds the
  indices read so far (a trainer host's workdir/data_reads)."""

  def __init__(self, n: int, read_one: Callable[[int], list]):
    self.n, self._read_one, self.read = n, read_one, set()

  def __len__(self):
    return self.n

  def __getitem__(self, i: int) -> list:
    self.read.add(int(i))
    return self._read_one(int(i))


def shard_answers(out: str, share: tuple = (0, 1)) -> tuple[Answers, int]:
  """-> (the answers of every shard the manifest lists, in position order, read on use; the first position not
  answered). Reads each shard's index (positions, offsets) only, and checks the sha256 of its share of the shards
  (share=(p, P): shards p, p + P, ... in name order; every host of a run checks its own, and a bad one ends the
  run), so no host reads every answer. A shard whose checksum differs is an error, never read."""
  manifest = read_manifest(out)
  if not manifest.get("shards"):
    raise FileNotFoundError(f"no self-distilled shards in {out}: run `python -m train.distill --out={out}`")
  names = sorted(manifest["shards"])
  for name in names[share[0]::share[1]]:
    if not shard_ok(out, manifest, name):
      raise ValueError(f"{os.path.join(out, name)} is missing or does not match its checksum in {out}/manifest.json: "
                       f"regenerate it with `python -m train.distill --out={out}` (it rewrites bad shards)")
  where, tokens = [], {}
  for name in names:
    path = os.path.join(out, name)
    with np.load(path) as z:  # reads only the members named
      pos, off = z["position"], z["offsets"]
    tokens[name] = NpzRows(path, "tokens")
    where += [(int(pos[i]), name, int(off[i]), int(off[i + 1])) for i in range(len(pos))]
  where.sort()
  read = lambda i: tokens[where[i][1]].rows(where[i][2], where[i][3]).tolist()
  return Answers(len(where), read), max(w[0] for w in where) + 1
