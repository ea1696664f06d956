"""serve/ is split into folders by job, and imports between them go one way (serve/__init__.py says which)."""
import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]
SERVE = ROOT / "serve"

# Which serve folders each may import ("" is serve/ itself: the commands). spec_jax is open to all; train/ only where
# named in TRAIN_ALLOWED.
ALLOWED = {
    "": {"engine", "http", "jobs", "compiler", "loadtest", "many_hosts", ""},
    "http": {"engine"},
    "engine": set(),
    "jobs": set(),
    "compiler": {"jobs"},
    "loadtest": {"engine", "jobs"},
    "many_hosts": set(),
}
TRAIN_ALLOWED = {"serve/compiler/aot_programs.py"}  # the trainer-step programs serve.aot compiles
MAX_FILES = 15  # modules, not counting __init__ and __main__


def _folder_of_module(name):
  """'serve.http.api' -> 'http'; 'serve.server' -> ''; 'serve.engine' -> 'engine'."""
  parts = name.split(".")
  if len(parts) > 1 and (SERVE / parts[1]).is_dir():
    return parts[1]
  return ""


def _imports(path):
  """Every absolute import in a file, at any depth (imports inside functions count too)."""
  out = []
  for node in ast.walk(ast.parse(path.read_text())):
    if isinstance(node, ast.Import):
      out += [a.name for a in node.names]
    elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
      # `from serve import http` names a folder through the imported name
      out += [f"{node.module}.{a.name}" for a in node.names] if node.module == "serve" else [node.module]
  return out


def _serve_files():
  return sorted(p for p in SERVE.rglob("*.py") if "__pycache__" not in p.parts)


def test_imports_between_serve_folders_go_one_way():
  bad = []
  for path in _serve_files():
    rel = path.relative_to(ROOT).as_posix()
    src = path.parent.relative_to(SERVE).as_posix()
    src = "" if src == "." else src.split("/")[0]
    assert src in ALLOWED, f"{rel}: folder serve/{src} is not in the layout (tests/test_serve_layout.py ALLOWED)"
    for name in _imports(path):
      top = name.split(".")[0]
      if top == "serve":
        dst = _folder_of_module(name)
        if dst != src and dst not in ALLOWED[src]:
          bad.append(f"{rel} imports {name} (serve/{src or '.'} may import {sorted(ALLOWED[src]) or 'no serve folder'})")
      elif top == "train" and rel not in TRAIN_ALLOWED:
        bad.append(f"{rel} imports {name} (only {sorted(TRAIN_ALLOWED)} may import train/)")
  assert not bad, "\n".join(bad)


def test_spec_jax_and_train_do_not_import_serve():
  bad = []
  for pkg in ("spec_jax", "train"):
    for path in sorted((ROOT / pkg).rglob("*.py")):
      bad += [f"{path.relative_to(ROOT)} imports {n}" for n in _imports(path) if n.split(".")[0] == "serve"]
  assert not bad, "\n".join(bad)


def test_each_serve_folder_is_small_and_says_what_it_is():
  for folder in [SERVE] + [p for p in SERVE.iterdir() if p.is_dir() and p.name != "__pycache__"]:
    files = [p for p in folder.glob("*.py") if p.name not in ("__init__.py", "__main__.py")]
    assert len(files) <= MAX_FILES, f"{folder.relative_to(ROOT)} holds {len(files)} files (at most {MAX_FILES})"
    init = folder / "__init__.py"
    assert init.exists() and ast.get_docstring(ast.parse(init.read_text())), \
        f"{folder.relative_to(ROOT)}/__init__.py must say what the folder is and what it may import"
