"""Names of the roles a loop step's work plays, as `jax.named_scope`s: they land in each HLO instruction's op_name
metadata (free at run time), and serve/compiler/aot_breakdown.py attributes the compiled step's bytes and time by them."""

from __future__ import annotations

import jax

# scope name -> role (the breakdown's rows); the drafter's own work is split into its layers and its head.
TARGET_LAYERS, ATTENTION, LM_HEAD = "role_target_layers", "role_attention", "role_lm_head"
SAMPLING, CONTROLS, DRAFTER, TREE, PAGES = "role_sampling", "role_controls", "role_drafter", "role_tree", "role_pages"
ROLES = ("target layers", "attention/KV", "LM head", "sampling/verify", "controls/logprobs/grammar",
         "drafter layers", "drafter head", "tree masks/compaction", "page-table gathers", "collectives",
         "copies/layout", "rest")
_ROLE = {TARGET_LAYERS: "target layers", ATTENTION: "attention/KV", LM_HEAD: "LM head", SAMPLING: "sampling/verify",
         CONTROLS: "controls/logprobs/grammar", TREE: "tree masks/compaction", PAGES: "page-table gathers"}


def scope(name: str):
  return jax.named_scope(name)


def role_of_path(op_name: str) -> str:
  """The role of an op_name path: its innermost role scope; inside the drafter, its head (LM head, drawing
  drafts), tree compaction, or else its layers; '' without one."""
  parts = op_name.split("/")
  inner = [p for p in parts if p in _ROLE]
  if DRAFTER in parts:
    inner = [p for p in parts[parts.index(DRAFTER):] if p in _ROLE]
    last = inner[-1] if inner else ""
    return ("drafter head" if last in (LM_HEAD, SAMPLING) else "tree masks/compaction" if last == TREE
            else "drafter layers")
  return _ROLE[inner[-1]] if inner else ""


def scoped(name: str):
  """A decorator: the function's work under the role scope `name`."""
  def wrap(fn):
    def run(*args, **kwargs):
      with jax.named_scope(name):
        return fn(*args, **kwargs)
    run.__name__, run.__doc__ = fn.__name__, fn.__doc__
    return run
  return wrap
