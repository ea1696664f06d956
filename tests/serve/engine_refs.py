"""Where a module other than the engine changes the engine's state: an AST walk for test_engine_owns_state.py.

An engine reference is a parameter named e, eng or engine (or annotated Engine) that its function does not bind
again (an `except ... as e` is an exception, not the engine), inside that function and the ones it encloses, and
`self.e`, `self.eng`, `self.engine`, `self._engine`. Found: an assignment, augmented assignment or `del` whose target
reaches through an engine reference (`e.x = `, `self.e.table.state = `, `e.q[0] = `), setattr or delattr on one,
and any use of its private names (`e._lock`, `e._waiting.popleft()`).
"""

from __future__ import annotations

import ast

NAMES = {"e", "eng", "engine"}
SELF_ATTRS = {"e", "eng", "engine", "_engine"}


def _bound_here(fn) -> set:
  """Names the function binds in its own body (not its parameters)."""
  out = set()
  for node in ast.walk(fn):
    if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
      out.add(node.id)
    elif isinstance(node, ast.ExceptHandler) and node.name:
      out.add(node.name)
  return out


def _params(fn) -> list:
  a = fn.args
  return [*a.posonlyargs, *a.args, *a.kwonlyargs, *([a.vararg] if a.vararg else []),
          *([a.kwarg] if a.kwarg else [])]


def _engine_params(fn) -> set:
  found = set()
  for p in _params(fn):
    note = ast.unparse(p.annotation) if getattr(p, "annotation", None) is not None else ""
    if p.arg in NAMES or note.strip("'\"").split(".")[-1] == "Engine":
      found.add(p.arg)
  return found - _bound_here(fn)


class _Finder(ast.NodeVisitor):
  def __init__(self, path: str):
    self.path, self.names, self.found = path, [set()], []

  def _is_ref(self, node) -> bool:
    if isinstance(node, ast.Name):
      return node.id in self.names[-1]
    return (isinstance(node, ast.Attribute) and node.attr in SELF_ATTRS and isinstance(node.value, ast.Name)
            and node.value.id == "self")

  def _through_ref(self, target) -> bool:
    """Whether `target` (an assignment's) is an attribute or item reached through an engine reference."""
    node = target
    while isinstance(node, (ast.Attribute, ast.Subscript, ast.Starred)):
      inner = node.value
      if self._is_ref(inner) and not isinstance(node, ast.Starred):
        return True
      node = inner
    if isinstance(target, (ast.Tuple, ast.List)):
      return any(self._through_ref(t) for t in target.elts)
    return False

  def _note(self, node, what: str) -> None:
    self.found.append(f"{self.path}:{node.lineno}: {what}: {ast.unparse(node)[:100]}")

  def _function(self, node) -> None:
    inherited = self.names[-1] - _bound_here(node) - {p.arg for p in _params(node)}
    self.names.append(inherited | _engine_params(node))
    self.generic_visit(node)
    self.names.pop()

  visit_FunctionDef = visit_AsyncFunctionDef = visit_Lambda = _function

  def _targets(self, node, targets) -> None:
    if any(self._through_ref(t) for t in targets):
      self._note(node, "assigns engine state")
    self.generic_visit(node)

  def visit_Assign(self, node):
    self._targets(node, node.targets)

  def visit_AugAssign(self, node):
    self._targets(node, [node.target])

  def visit_AnnAssign(self, node):
    self._targets(node, [node.target])

  def visit_Delete(self, node):
    self._targets(node, node.targets)

  def visit_Call(self, node):
    f = node.func
    if isinstance(f, ast.Name) and f.id in ("setattr", "delattr") and node.args and self._is_ref(node.args[0]):
      self._note(node, f"{f.id} on the engine")
    self.generic_visit(node)

  def visit_Attribute(self, node):
    if node.attr.startswith("_") and not node.attr.startswith("__") and self._is_ref(node.value):
      self._note(node, "reaches into the engine's private state")
    self.generic_visit(node)


def find(path: str, source: str) -> list:
  """-> 'path:line: what: code' for each place in `source` that changes (or reaches into) engine state."""
  finder = _Finder(path)
  finder.visit(ast.parse(source, path))
  return finder.found
