"""Imports inside functions (spec_jax/, serve/, train/; read with ast, nothing imported): each says why it is not at
the top of its module with a `# lazy: <reason>` comment on its (first) line, the reason from REASONS. Anything
else belongs with the module's top-level imports, where the import graph (tests/test_import_graph.py) and a reader
see it at once."""

from __future__ import annotations

import ast

from tests.test_import_graph import source_modules

# The reasons an import may stay inside a function, each followed by what it names: "heavy, only this path
# (matplotlib)", "jax must be configured first (XLA_FLAGS)", "import cycle with spec_jax.sharding".
REASONS = (
    "heavy, only this path (",  # a dependency only some paths need (matplotlib, tokenizers, jinja2, jax in a client)
    "optional dependency (",  # a package that may not be installed
    "jax must be configured first (",  # environment / config / platform / distributed init before jax loads
    "import cycle with ",  # the module imports this one at its top
    "libtpu/CUDA plugin only in .venv-aot",  # compilers for absent chips, in their own environment
)
MARK = "# lazy: "


def _inner_imports(tree):
  """The import statements inside a function (at any depth), in source order."""
  out = []

  def walk(node, in_function):
    for child in ast.iter_child_nodes(node):
      if in_function and isinstance(child, (ast.Import, ast.ImportFrom)):
        out.append(child)
      walk(child, in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)))

  walk(tree, False)
  return out


def _top_level_modules(tree) -> set:
  """The modules a file imports at its top level (`import a.b` -> a.b, `from a import b` -> a)."""
  out = set()
  for node in tree.body:
    if isinstance(node, ast.Import):
      out.update(a.name for a in node.names)
    elif isinstance(node, ast.ImportFrom) and not node.level:
      out.add(node.module)
  return out


def lazy_import_problems(modules: dict) -> list:
  """'path:line: what is wrong' for each import inside a function without a known `# lazy:` reason, or whose
  module the file already imports at its top (then nothing is gained by waiting)."""
  problems = []
  for path in sorted(modules.values()):
    with open(path, encoding="utf-8") as f:
      source = f.read()
    lines = source.splitlines()
    tree = ast.parse(source, path)
    top = _top_level_modules(tree)
    for node in _inner_imports(tree):
      line = lines[node.lineno - 1]
      where = f"{path}:{node.lineno}: {line.strip()}"
      reason = line.partition(MARK)[2]
      if not reason.startswith(REASONS):
        problems.append(f"{where}: no '{MARK}<reason>' comment (reasons: {', '.join(REASONS)}); "
                        "or move it to the module's top-level imports")
        continue
      names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module]
      if isinstance(node, ast.Import) or not node.level:
        already = [n for n in names if n in top]
        if already:
          problems.append(f"{where}: {', '.join(already)} is imported at the top of the module already")
  return problems


def test_every_import_inside_a_function_says_why():
  problems = lazy_import_problems(source_modules())
  assert not problems, "\n".join(problems)
