"""Where a compiled loop step's time goes: its instructions by role, from the optimized HLO text.

XLA's cost analysis gives a program's totals only. The optimized HLO names what each top-level instruction (a
fusion, a copy, a kernel call, a collective) reads and writes (its operands' and result's shapes), and XLA:TPU writes
its own estimate of each one's cycles into the instruction's backend config (`estimated_cycles`). This module walks
the program as XLA's cost analysis does (a while loop's body once, a conditional's costliest branch, a fusion as one
instruction) and sums bytes, FLOPs and time per role; what a conditional's costliest branch costs beyond its
cheapest is also reported apart (`branches`), since rows that ask for nothing take the cheapest at run time. A role
comes from the `jax.named_scope` names the model and the loop carry (spec_jax/scopes.py) in each instruction's
`op_name` metadata, else from the instruction's kind (copies, collectives, kernel calls).

Time per instruction: XLA:TPU's estimated cycles at the chip's clock where it gives them; elsewhere (Pallas kernel
calls, collectives, XLA:GPU) the roofline of the instruction's own bytes and FLOPs at the chip's published
bandwidth and peak. The sum is scaled to the compiler's `optimal_seconds` where there is one, so the roles split
the compiler's total (the scale is reported).
"""

from __future__ import annotations

import math
import re
from collections import defaultdict

from serve.compiler.hlo_text import ARRAY_LAYOUT, Instr, array_dims, arrays, in_flight, parse, shape_bytes
from spec_jax import scopes

# Published per-chip figures: HBM bandwidth (bytes/s), dense bf16 peak (FLOP/s), TensorCore clock (Hz).
CHIPS = {
    "TPU v5 lite": dict(bandwidth=819e9, peak=197e12, clock=1.5e9),
    "TPU v5": dict(bandwidth=2765e9, peak=459e12, clock=1.75e9),
    "TPU v5p": dict(bandwidth=2765e9, peak=459e12, clock=1.75e9),
    "TPU v6 lite": dict(bandwidth=1640e9, peak=918e12, clock=1.75e9),
    "TPU v4": dict(bandwidth=1228e9, peak=275e12, clock=1.05e9),
    # NVIDIA H200 SXM: 4.8 TB/s HBM3e, 989 TFLOP/s dense bf16.
    "NVIDIA H200": dict(bandwidth=4.8e12, peak=989e12, clock=0.0),
}

def chip_figures(kind: str) -> dict:
  """The published figures of a chip by its device_kind (an H200's XLA:GPU kind may carry a suffix)."""
  if kind in CHIPS:
    return CHIPS[kind]
  for name, fig in CHIPS.items():
    if name.startswith("NVIDIA") and name in kind:
      return fig
  raise ValueError(f"no published figures for {kind!r}; known: {sorted(CHIPS)}")


_DOT_DIMS = re.compile(r"lhs_contracting_dims=\{([\d,]*)\}")
_KERNEL_COST = re.compile(r'"cost_estimate":\{"flops":"(\d+)",[^}]*"bytes_accessed":"(\d+)"')
_TARGET = re.compile(r'custom_call_target="([^"]+)"')
# XLA:GPU's library GEMMs: (result, s8 workspace) tuples; the workspace is scratch, not HBM traffic.
_GEMMS = ("__cublas$gemm", "__cublas$lt$matmul", "__cublas$lt$matmul$f8")
_GEMM_CONTRACTING = re.compile(r'"lhs_contracting_dimensions":\[([^\]]*)\]')
_COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute",
                "all-reduce-start", "all-gather-start", "collective-permute-start", "all-reduce-done",
                "all-gather-done", "collective-permute-done")
_FREE = ("parameter", "get-tuple-element", "tuple", "bitcast", "constant", "after-all", "partition-id",
         "replica-id", "opt-barrier")
ROLES = scopes.ROLES


def _flops(comps: dict, comp: str, shapes: dict) -> float:
  """2 x output elements x contracted size of every dot and convolution inside a fused computation."""
  total = 0.0
  for ins in comps.get(comp, []):
    if ins.opcode == "dot":
      lhs = array_dims(shapes.get(ins.operands[0], "")) if ins.operands else []
      cdims = _DOT_DIMS.search(ins.line)
      k = math.prod(lhs[int(d)] for d in cdims.group(1).split(",") if d) if cdims and lhs else 1
      total += 2.0 * math.prod(array_dims(ins.shape)) * k
    elif ins.opcode == "convolution":
      lhs = array_dims(shapes.get(ins.operands[0], "")) if ins.operands else []
      rhs = array_dims(shapes.get(ins.operands[1], "")) if len(ins.operands) > 1 else []
      out = math.prod(array_dims(ins.shape))
      # the contracted size: the kernel's elements over its output features (its last dimension in XLA:TPU's
      # dim_labels for these dots); a bound, not an exact count, where the labels say otherwise
      m = re.search(r"dim_labels=\w+_(\w+)->", ins.line)
      if m and rhs:
        labels = m.group(1)
        o = labels.index("o") if "o" in labels else len(rhs) - 1
        k = math.prod(rhs) // max(rhs[o], 1)
      else:
        k = lhs[-1] if lhs else 1
      total += 2.0 * out * k
    for c in ins.calls:
      total += _flops(comps, c, shapes)
  return total


_SLICING = ("dynamic-slice", "slice", "gather")


def traffic(comps: dict, ins: Instr, shapes: dict, flight: tuple = (frozenset(), frozenset())) -> float:
  """HBM bytes one top-level instruction moves: its result and its operands, where an operand that is only sliced
  or gathered from (a layer's weights out of the stacked [L, ...] parameter, rows of a table) counts the slices,
  and a buffer updated in place (dynamic-update-slice) counts the update, not the whole buffer. A compute fusion
  that carries an async collective's buffers (`flight`, see in_flight) is charged without them, in and out: the
  collective's start and done count them once."""
  held, kinds = flight
  carrying = (ins.opcode == "fusion" and not ins.name.startswith("async-collective-done")
              and any(o in held for o in ins.operands))
  if ins.opcode in _SLICING:
    return 2 * shape_bytes(ins.shape)
  if ins.opcode == "dynamic-update-slice":
    return 2 * shape_bytes(shapes.get(ins.operands[1], "")) if len(ins.operands) > 1 else 0.0
  operand = [0.0 if carrying and o in held else shape_bytes(shapes.get(o, "")) for o in ins.operands]
  if _gemm(ins):  # operands and the product; not the workspace
    return sum(operand) + shape_bytes(ARRAY_LAYOUT.search(ins.shape).group(0))
  if ins.opcode == "copy-start":  # (destination, source alias, context): the source is read once
    return sum(operand)
  out = shape_bytes(ins.shape) if not carrying else sum(
      shape_bytes(full) for bare, full in arrays(ins.shape) if bare not in kinds)
  if ins.opcode == "fusion" and ins.calls:
    for idx in range(len(operand)):
      operand[idx] = min(operand[idx], _param_read(comps, ins.calls[0], idx, operand[idx]))
    update = _in_place_update(comps, ins.calls[0])
    if update is not None:  # the root updates operand `i` in place: the update is what is written
      operand[update[0]] = 0.0
      out = min(out, update[1])
  return out + sum(operand)


_TRITON = "__gpu$xla.gpu.triton"


def _layer_read(ins: Instr, shapes: dict, layers: int) -> float:
  """A Triton kernel's bytes inside a loop over `layers` layers (Pallas on GPU drops its declared cost): an
  operand stacked over the layers (the KV pool [L, ...]) is read one layer a trip; the rest and the result whole."""
  total = shape_bytes(ins.shape)
  for o in ins.operands:
    b = shape_bytes(shapes.get(o, ""))
    dims = array_dims(shapes.get(o, ""))
    total += b / layers if dims and dims[0] == layers else b
  return total


def _gemm(ins: Instr) -> bool:
  target = _TARGET.search(ins.line) if ins.opcode == "custom-call" else None
  return bool(target) and target.group(1) in _GEMMS


def _gemm_flops(ins: Instr, shapes: dict) -> float:
  """2 x the product's elements x the contracted size of a library GEMM (its backend config's dimensions)."""
  lhs = array_dims(shapes.get(ins.operands[0], "")) if ins.operands else []
  m = _GEMM_CONTRACTING.search(ins.line)
  k = math.prod(lhs[int(d.strip('" '))] for d in m.group(1).split(",") if d.strip('" ')) if m and lhs else 1
  return 2.0 * math.prod(array_dims(ins.shape)) * k


def _params(comps: dict, comp: str) -> dict:
  out = {}
  for x in comps.get(comp, []):
    if x.opcode == "parameter":
      out[int(re.search(r"parameter\((\d+)\)", x.line).group(1))] = x
  return out


def _param_read(comps: dict, comp: str, idx: int, full: float, param=None) -> float:
  """Bytes a fused computation reads of its parameter idx (or of `param`, a bitcast of it): the slices where every
  use slices or gathers from it (through bitcasts and nested fusions too), else all of it."""
  param = param or _params(comps, comp).get(idx)
  if param is None:
    return full
  total = 0.0
  for x in comps.get(comp, []):
    for i, o in enumerate(x.operands):
      if o != param.name:
        continue
      if x.opcode in _SLICING and i == 0:
        total += shape_bytes(x.shape.split("{")[0])  # the slice as read from HBM (its own layout may be VMEM)
      elif x.opcode == "bitcast":  # the same bytes under another shape: what its uses read
        total += _param_read(comps, comp, idx, full, x)
      elif x.opcode == "fusion" and x.calls:
        total += _param_read(comps, x.calls[0], i, full)
      else:
        return full
  return min(total, full)


def _in_place_update(comps: dict, comp: str):
  """(operand index, bytes of the update) when a fused computation's root is a dynamic-update-slice of a
  parameter (XLA updates that buffer in place), else None."""
  body = comps.get(comp, [])
  root = next((x for x in body if x.line.lstrip().startswith("ROOT ")), None)
  if root is None or root.opcode != "dynamic-update-slice" or len(root.operands) < 2:
    return None
  by_name = {x.name: x for x in body}
  base = by_name.get(root.operands[0])
  if base is None or base.opcode != "parameter":
    return None
  idx = int(re.search(r"parameter\((\d+)\)", base.line).group(1))
  upd = by_name.get(root.operands[1])
  return idx, shape_bytes(upd.shape.split("{")[0]) if upd is not None else 0.0


def role_of(ins: Instr) -> str:
  """The role of one top-level instruction: the innermost role scope in its op_name, else its kind."""
  role = scopes.role_of_path(ins.op_name)
  if ins.opcode in _COLLECTIVES or ins.opcode.startswith(("all-", "collective-", "reduce-scatter")):
    return "collectives"
  if role:
    return role
  if ins.opcode in ("copy", "copy-start", "copy-done", "transpose"):
    return "copies/layout"
  return "rest"


def walk(comps: dict, entry: str, chip: dict, trips: bool = False) -> list:
  """The instructions one run of the program executes, as the cost analysis counts them: while bodies once, of a
  conditional's branches the costliest (by roofline). -> [dict(ins, role, bytes, flops, roofline, cycles)]; an
  instruction without role metadata takes its caller's (a sort XLA built inside a sampler's branch).
  trips: a while loop whose trip count XLA knows (`known_trip_count`: a scan over the layers) counts its body that
  many times, so a scanned model's step covers every layer; the decode loop's own trip count is not known, and its
  body still counts once (one step)."""
  shapes = {ins.name: ins.shape for c in comps.values() for ins in c}
  flight = in_flight(comps)
  users = defaultdict(list)
  for c in comps.values():
    for ins in c:
      for o in ins.operands:
        users[o].append(ins)
  memo = {}

  def role(ins: Instr, outer: str) -> str:
    if ins.opcode == "copy-start":  # a prefetch (into VMEM) or an async copy: the role of what reads it
      for done in users.get(ins.name, []):
        for u in users.get(done.name, []):
          r = scopes.role_of_path(u.op_name)
          if r:
            return r
    r = role_of(ins)
    return outer if r in ("rest", "copies/layout") and outer and not scopes.role_of_path(ins.op_name) and (
        r == "rest" or not ins.op_name) and outer != "rest" else r

  def own(ins: Instr, outer: str, stack: int):
    if ins.opcode in _FREE or ins.opcode.endswith("-done"):
      return None
    target = _TARGET.search(ins.line) if ins.opcode == "custom-call" else None
    if target and target.group(1) in ("AllocateBuffer", "AssumeGatherIndicesInBound"):
      return None
    nbytes = traffic(comps, ins, shapes, flight)
    flops = _flops(comps, ins.calls[0], shapes) if ins.opcode == "fusion" and ins.calls else 0.0
    if ins.opcode in ("dot", "convolution"):
      flops = _flops({"_": [ins]}, "_", shapes)
    if _gemm(ins):
      flops = _gemm_flops(ins, shapes)
    declared = _KERNEL_COST.search(ins.line) if ins.opcode == "custom-call" else None
    if declared:  # a Pallas kernel's own cost declaration (what XLA's cost analysis charges it)
      flops, nbytes = float(declared.group(1)), float(declared.group(2))
    elif stack > 1 and target and target.group(1) == _TRITON:
      nbytes = _layer_read(ins, shapes, stack)
    return dict(ins=ins, role=role(ins, outer), bytes=nbytes, flops=flops,
                roofline=max(nbytes / chip["bandwidth"], flops / chip["peak"]),
                cycles=ins.cycles / chip["clock"] if ins.cycles is not None and chip.get("clock") else None)

  def run(comp: str, outer: str, looped: bool, stack: int = 1) -> list:
    if (comp, outer, looped, stack) in memo:
      return memo[comp, outer, looped, stack]
    out = []
    for ins in comps.get(comp, []):
      inner = scopes.role_of_path(ins.op_name) or outer
      if ins.opcode == "conditional":
        out += _costliest_branch([run(b, inner, looped, stack) for b in ins.branches], ins)
      elif ins.opcode in ("while", "call"):
        n = _trip_count(ins) if trips and ins.opcode == "while" else 1
        for c in ins.calls:
          rows = run(c, inner, looped or ins.opcode == "while", n if n > 1 else stack)
          out += [dict(r, bytes=r["bytes"] * n, flops=r["flops"] * n, roofline=r["roofline"] * n,
                       cycles=r["cycles"] * n if r["cycles"] is not None else None) for r in rows] if n > 1 else rows
      else:
        r = own(ins, outer, stack)
        if r is not None:
          r["per_call"] = not looped  # outside every loop: once per program call (the decode loop's hoisted work)
          out.append(r)
    memo[comp, outer, looped, stack] = out
    return out

  return run(entry, "", False)


def _costliest_branch(runs: list, ins: Instr) -> list:
  """The rows of a conditional's costliest branch, as XLA's cost analysis charges it, each marked with the share
  of its roofline beyond the cheapest branch (`skip`, compounded through nested conditionals) and the outermost
  conditional's name and op (`cond`, `cond_op`): a step whose rows all take the cheapest branch (no row asks for
  the controls, the filters) skips that share at run time, though the estimate charges it."""
  if not runs:
    return []
  cost = [sum(x["roofline"] for x in r) for r in runs]
  top = max(range(len(runs)), key=cost.__getitem__)
  extra = 1.0 - min(cost) / cost[top] if cost[top] > 0 else 0.0
  return [dict(x, skip=1.0 - (1.0 - x.get("skip", 0.0)) * (1.0 - extra), cond=ins.name, cond_op=ins.op_name)
          for x in runs[top]]


def _branches(rows: list, scale: float, top: int) -> dict:
  """What conditionals are charged beyond their cheapest branch (see _costliest_branch): total seconds (scaled
  like the roles) and bytes, and the `top` conditionals by seconds with the role of their costliest work."""
  per = defaultdict(lambda: dict(seconds=0.0, bytes=0.0, roles=defaultdict(float), op_name=""))
  for r in rows:
    if r.get("skip"):
      c = per[r["cond"]]
      c["seconds"] += r["roofline"] * r["skip"] * scale
      c["bytes"] += r["bytes"] * r["skip"]
      c["roles"][r["role"]] += r["roofline"] * r["skip"]
      c["op_name"] = r["cond_op"][-100:]
  items = sorted(per.items(), key=lambda kv: -kv[1]["seconds"])
  return dict(seconds=sum(c["seconds"] for c in per.values()), bytes=sum(c["bytes"] for c in per.values()),
              top=[dict(name=n, seconds=c["seconds"], bytes=c["bytes"], op_name=c["op_name"],
                        role=max(c["roles"], key=c["roles"].get)) for n, c in items[:top]])


_TRIPS = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')


def _trip_count(ins: Instr) -> int:
  m = _TRIPS.search(ins.line)
  return int(m.group(1)) if m else 1


_MINOR_TO_MAJOR = re.compile(r"\[([\d,]*)\]\{([\d,]*)")


def _order(shape: str) -> tuple:
  """The dimension order (minor to major) of an HLO array's layout, dimensions of size 1 left out (they do not
  change where any element lies)."""
  m = _MINOR_TO_MAJOR.search(shape)
  if not m or not m.group(2):
    return ()
  dims = [int(d) for d in m.group(1).split(",") if d]
  return tuple(int(i) for i in m.group(2).split(",") if dims[int(i)] != 1)


def weight_relayouts(text: str) -> list:
  """Copies of a program input (a weight, mostly) into another dimension order: the whole array re-laid out on
  every call (issue 48: the Q projection for a verify). A copy that keeps the order (a prefetch into VMEM, an
  async copy) is not one. -> [dict(name, input, shape, from, to)]."""
  comps, entry = parse(text)
  inputs = {x.name: x for x in comps.get(entry, []) if x.opcode == "parameter"}
  out = []
  for body in comps.values():
    for ins in body:
      if ins.opcode not in ("copy", "copy-start") or not ins.operands or ins.operands[0] not in inputs:
        continue
      src, dst = _order(inputs[ins.operands[0]].shape), _order(ins.shape.lstrip("("))
      if src != dst:
        out.append(dict(name=ins.name, input=ins.operands[0], shape=ins.shape.lstrip("(").split("{")[0],
                        **{"from": list(src), "to": list(dst)}))
  return out


def breakdown(text: str, chip_kind: str, optimal_seconds: float | None, top: int = 3, trips: bool = False) -> dict:
  """Per role: bytes, FLOPs, the roofline of its instructions (each one's bytes over the bandwidth or FLOPs over
  the peak, the larger), XLA:TPU's estimated cycles as seconds (where it gives them; they include each
  instruction's fixed overhead), its share of `optimal_seconds` (the roofline split scaled to the compiler's total)
  and the `top` largest instructions by roofline (an instruction in a loop of known trip count: all its trips).
  trips: such loops counted that many times (walk), as a scanned model's step is costed on XLA:GPU."""
  chip = chip_figures(chip_kind)
  comps, entry = parse(text)
  rows = walk(comps, entry, chip, trips)
  total = sum(r["roofline"] for r in rows)
  scale = optimal_seconds / total if optimal_seconds and total > 0 else 1.0
  roles = {r: dict(bytes=0.0, flops=0.0, roofline_seconds=0.0, cycles_seconds=0.0, seconds=0.0, count=0, top=[])
           for r in ROLES}
  per = defaultdict(list)
  for r in rows:
    d = roles[r["role"]]
    d["bytes"] += r["bytes"]
    d["flops"] += r["flops"]
    d["roofline_seconds"] += r["roofline"]
    d["cycles_seconds"] += r["cycles"] or 0.0
    d["seconds"] += r["roofline"] * scale
    d["count"] += 1
    per[r["role"]].append(r)
  for role, items in per.items():
    items.sort(key=lambda r: -r["roofline"])
    roles[role]["top"] = [dict(name=r["ins"].name, seconds=r["roofline"] * scale, bytes=r["bytes"],
                               shape=r["ins"].shape.split("{")[0][:80], op_name=r["ins"].op_name[-100:])
                          for r in items[:top]]
  per_call = [r for r in rows if r["per_call"]]
  return dict(roles=roles, scale=scale, instructions=len(rows), roofline_seconds=total,
              # charged to conditionals beyond their cheapest branch: skipped at run time where no row asks
              branches=_branches(rows, scale, top),
              weight_relayouts=weight_relayouts(text),
              # work outside the decode loop (loop-invariant copies XLA hoists: once per loop call, not per step)
              per_call_seconds=sum(r["roofline"] for r in per_call) * scale,
              per_call_bytes=sum(r["bytes"] for r in per_call),
              cycles_seconds=sum(r["cycles"] or 0.0 for r in rows),
              bytes=sum(r["bytes"] for r in rows), flops=sum(r["flops"] for r in rows))
