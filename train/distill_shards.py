"""The self-distilled answers on disk: `train.distill` writes them, `train.data` reads them.

shard-NNNNN.npz per shard (prompt position, prompt index in `train.data.load_examples`, temperature, finish,
offsets, the prompt + answer token ids as one int32 run) and manifest.json (settings, each shard's sha256 and
counts). A shard whose checksum differs from the manifest's is never read.
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import Sequence

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
