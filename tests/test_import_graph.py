"""The import graph of spec_jax/, serve/ and train/ (read with ast, nothing imported): no cycles, and imports
between folders only in the allowed directions.

Every import counts, at the top of a module or inside a function: an import inside a function hides a cycle from
Python's loader, not from the design. To add a direction rule, add the folder to ALLOWED (a folder may always
import itself and anything outside these three packages)."""

from __future__ import annotations

import ast
import os

from tests.conftest import ROOT

PACKAGES = ("spec_jax", "serve", "train")

# folder -> the folders of PACKAGES it may import (a folder is a module's dotted package: "serve.loadtest").
# A folder not named here takes the rule of its nearest named parent.
ALLOWED = {
    "spec_jax": (),
    "train": ("spec_jax",),
    "serve": ("spec_jax",),
}

# (importer, imported) pairs allowed against ALLOWED, each with its reason.
EXCEPTIONS = {
    # AOT compiles the trainer's step: the program the trainer runs, traced from shapes (serve/compiler/aot_programs.py).
    ("serve.compiler.aot_programs", "train.tasks"): "AOT compiles the trainer-step programs",
    ("serve.compiler.aot_programs", "train.trainer"): "AOT compiles the trainer-step programs",
}


def _module_name(path: str) -> str:
  rel = os.path.relpath(path, ROOT)[:-len(".py")].replace(os.sep, ".")
  return rel[:-len(".__init__")] if rel.endswith(".__init__") else rel


def source_modules() -> dict:
  """{dotted module name: file path} for every .py file of PACKAGES."""
  out = {}
  for pkg in PACKAGES:
    for dirpath, dirnames, files in os.walk(os.path.join(ROOT, pkg)):
      dirnames[:] = [d for d in dirnames if d != "__pycache__"]
      for f in files:
        if f.endswith(".py"):
          path = os.path.join(dirpath, f)
          out[_module_name(path)] = path
  return out


def _resolve(name: str, modules: dict) -> str | None:
  """The module of ours that importing `name` loads (a name inside a module resolves to the module)."""
  while name:
    if name in modules:
      return name
    name = name.rpartition(".")[0]
  return None


def imports_of(module: str, path: str, modules: dict) -> set:
  """The modules of PACKAGES that `module` imports anywhere in its file (packages on the way count too, since
  Python runs their __init__)."""
  with open(path, encoding="utf-8") as f:
    tree = ast.parse(f.read(), path)
  is_pkg = path.endswith("__init__.py")
  names = []
  for node in ast.walk(tree):
    if isinstance(node, ast.Import):
      names += [a.name for a in node.names]
    elif isinstance(node, ast.ImportFrom):
      if node.level:
        base = module.split(".")[:len(module.split(".")) - node.level + (1 if is_pkg else 0)]
        prefix = ".".join(base + ([node.module] if node.module else []))
      else:
        prefix = node.module
      names += [prefix] + [f"{prefix}.{a.name}" for a in node.names]
  out = set()
  for name in names:
    target = _resolve(name, modules)
    if target is not None and target != module and not module.startswith(target + "."):
      out.add(target)
  return out


def import_graph() -> dict:
  modules = source_modules()
  return {m: imports_of(m, p, modules) for m, p in modules.items()}


def find_cycles(graph: dict) -> list:
  """Every strongly connected component of more than one module (Tarjan's algorithm, iterative)."""
  index, low, on_stack, stack, out = {}, {}, set(), [], []
  for root in sorted(graph):
    if root in index:
      continue
    work = [(root, iter(sorted(graph[root])))]
    index[root] = low[root] = len(index)
    stack.append(root)
    on_stack.add(root)
    while work:
      node, it = work[-1]
      nxt = next(it, None)
      if nxt is not None:
        if nxt not in index:
          index[nxt] = low[nxt] = len(index)
          stack.append(nxt)
          on_stack.add(nxt)
          work.append((nxt, iter(sorted(graph.get(nxt, ())))))
        elif nxt in on_stack:
          low[node] = min(low[node], index[nxt])
        continue
      work.pop()
      if work:
        low[work[-1][0]] = min(low[work[-1][0]], low[node])
      if low[node] == index[node]:
        comp = []
        while True:
          m = stack.pop()
          on_stack.discard(m)
          comp.append(m)
          if m == node:
            break
        if len(comp) > 1:
          out.append(sorted(comp))
  return out


def folder_of(module: str) -> str:
  return module.rpartition(".")[0] or module


def rule_for(folder: str):
  """(the ALLOWED key that governs `folder`, its allowed folders)."""
  f = folder
  while f not in ALLOWED:
    if "." not in f:
      raise KeyError(f"no import rule for {folder}: add it to ALLOWED")
    f = f.rpartition(".")[0]
  return f, ALLOWED[f]


def direction_violations(graph: dict) -> list:
  out = []
  for mod, targets in graph.items():
    key, allowed = rule_for(folder_of(mod))
    for t in targets:
      tkey = rule_for(folder_of(t))[0]
      own = tkey == key or tkey.startswith(key + ".") or key.startswith(tkey + ".")
      ok = own or any(tkey == a or tkey.startswith(a + ".") for a in allowed)
      if not ok and (mod, t) not in EXCEPTIONS:
        out.append(f"{mod} -> {t}")
  return sorted(out)


def test_graph_sees_imports_inside_functions():
  graph = import_graph()
  assert "spec_jax.decode" in graph["spec_jax.batch"]  # a top-level import
  assert "spec_jax.proposers.registry" in graph["serve.jobs.setup"]  # inside a function


def test_no_import_cycles():
  cycles = find_cycles(import_graph())
  assert not cycles, "import cycles:\n" + "\n".join(" <-> ".join(c) for c in cycles)


def test_import_directions():
  bad = direction_violations(import_graph())
  assert not bad, "imports against ALLOWED (tests/test_import_graph.py):\n" + "\n".join(bad)


def test_checks_catch_a_cycle_and_a_wrong_direction():
  graph = {"spec_jax.a": {"spec_jax.b"}, "spec_jax.b": {"spec_jax.c"}, "spec_jax.c": {"spec_jax.a"},
           "serve.x": {"train.y"}, "train.y": set(), "spec_jax.d": {"serve.x"}}
  assert find_cycles(graph) == [["spec_jax.a", "spec_jax.b", "spec_jax.c"]]
  assert direction_violations(graph) == ["serve.x -> train.y", "spec_jax.d -> serve.x"]
