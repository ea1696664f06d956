"""The registry (spec_jax/proposers/registry.py) is the only switch over speculation method names outside tests:
every other module asks the method's registry entry what it needs (its builders, options, published head kinds,
how it drafts), so a new method is one entry, not an edit in every module that names methods.

A switch is a comparison of a method expression (a name or attribute with "method" in it) with a method name, or a
dict keyed by method names that such an expression indexes or that is named after methods. Read with ast."""

from __future__ import annotations

import ast
import os

from tests.conftest import ROOT

PACKAGES = ("spec_jax", "serve", "train")
REGISTRY = os.path.join("spec_jax", "proposers", "registry.py")
# the built-in names and vLLM's spelling; "none" is left out: it is the word for "off" in many flags
NAMES = {"ngram", "suffix", "draft", "draft_model", "medusa", "eagle", "eagle3", "qdraft"}


def _names(node) -> list:
  """Method names a literal holds (a string, or a tuple / list / set of them)."""
  if isinstance(node, ast.Constant) and isinstance(node.value, str):
    return [node.value] if node.value in NAMES else []
  if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
    return [n for e in node.elts for n in _names(e)]
  return []


def _about_method(node) -> bool:
  return any(isinstance(n, ast.Name) and "method" in n.id.lower() or
             isinstance(n, ast.Attribute) and "method" in n.attr.lower() for n in ast.walk(node))


def switches(source: str, where: str = "") -> list:
  """'<where>:<line>: <names>' for each switch over method names in `source`."""
  tree = ast.parse(source)
  out = []
  for node in ast.walk(tree):
    hit = []
    if isinstance(node, ast.Compare) and _about_method(node):
      hit = [n for side in [node.left, *node.comparators] for n in _names(side)]
    elif isinstance(node, ast.Subscript) and isinstance(node.value, ast.Dict) and _about_method(node.slice):
      hit = [n for k in node.value.keys if k is not None for n in _names(k)]
    elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get"
          and isinstance(node.func.value, ast.Dict) and node.args and _about_method(node.args[0])):
      hit = [n for k in node.func.value.keys if k is not None for n in _names(k)]
    elif isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None:
      targets = node.targets if isinstance(node, ast.Assign) else [node.target]
      if any(_about_method(t) for t in targets):  # a table or a list of methods under a method's name
        keys = node.value.keys if isinstance(node.value, ast.Dict) else [node.value]
        hit = [n for k in keys if k is not None for n in _names(k)]
    if hit:
      out.append(f"{where}:{node.lineno}: {sorted(set(hit))}")
  return out


def test_only_the_registry_switches_over_method_names():
  found = []
  for pkg in PACKAGES:
    for dirpath, dirnames, files in os.walk(os.path.join(ROOT, pkg)):
      dirnames[:] = [d for d in dirnames if d != "__pycache__"]
      for f in sorted(files):
        path = os.path.join(dirpath, f)
        rel = os.path.relpath(path, ROOT)
        if f.endswith(".py") and rel != REGISTRY:
          with open(path, encoding="utf-8") as fh:
            found += switches(fh.read(), rel)
  assert not found, "switches over method names outside the registry (ask its entry instead):\n" + "\n".join(found)


def test_the_scan_sees_each_kind_of_switch():
  src = '''
if spec.method == "ngram": pass
if method in ("eagle", "eagle3"): pass
allowed = {"medusa": 1, "eagle": 2}[method]
other = {"draft": 1}.get(a.method, 0)
METHOD_ALIASES = {"draft_model": "draft"}
TREE_METHODS = ("medusa", "eagle")
if kind == "eagle": pass
fmt = {"eagle": "eagle1"}[kind]
'''
  assert sorted(int(s.split(":")[1]) for s in switches(src)) == [2, 3, 4, 5, 6, 7]


def test_each_speculative_config_key_is_shared_or_one_methods_option():
  from spec_jax import spec_config
  from spec_jax.proposers.registry import METHODS
  options = [o.key for e in METHODS.values() for o in e.options]
  assert len(options) == len(set(options))  # one owner each
  assert sorted(spec_config.ENTRY_KEYS) == sorted(spec_config.SHARED_KEYS + tuple(options))
