"""Optimized HLO text read into computations of instructions (serve/compiler/aot_breakdown.py's input): each
instruction's name, opcode, shape, operands, op_name, XLA:TPU's estimated cycles and the computations it calls;
and the HBM bytes of a shape."""

from __future__ import annotations

import dataclasses
import math
import re

_DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4, "f32": 4,
                "s64": 8, "u64": 8, "f64": 8, "f8e4m3fn": 1, "f8e5m2": 1, "s4": 0.5, "u4": 0.5, "token": 0}
_ARRAY = re.compile(r"\b(pred|[suf]\d+|bf16|f8e4m3fn|f8e5m2|token)\[([\d,]*)\]")
_COMP_START = re.compile(r"^(ENTRY )?%([\w.\-]+) .*\{\s*$")
_INSTR = re.compile(r"^\s*(?:ROOT )?%([\w.\-]+) = (.*?) ([a-z][a-z0-9\-]*)\((.*)$")
_CYCLES = re.compile(r'"estimated_cycles":"(\d+)"')
_OP_NAME = re.compile(r'op_name="([^"]*)"')
_CALLS = re.compile(r"(?:calls|to_apply|condition|body|true_computation|false_computation)=%([\w.\-]+)")
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")
ARRAY_LAYOUT = re.compile(r"\b(pred|[suf]\d+|bf16|f8e4m3fn|f8e5m2|token)\[([\d,]*)\](\{[^}]*\})?")


def shape_bytes(text: str) -> float:
  """HBM bytes of an HLO shape (an array or a tuple of them; tiling ignored). An array in another memory space
  (`S(n)` in its layout: XLA:TPU's VMEM, SMEM) is not HBM traffic: a weight prefetched into VMEM is counted once,
  by the copy that brings it there."""
  return sum(_DTYPE_BYTES.get(t, 4) * math.prod(int(d) for d in dims.split(",") if d)
             for t, dims, layout in ARRAY_LAYOUT.findall(text) if not re.search(r"S\([1-9]\)", layout or ""))


def array_dims(text: str) -> list:
  m = _ARRAY.search(text)
  return [int(d) for d in m.group(2).split(",") if d] if m else []


@dataclasses.dataclass
class Instr:
  name: str
  opcode: str
  shape: str
  operands: list
  line: str
  op_name: str
  cycles: int | None
  calls: list
  branches: list


def parse(text: str) -> tuple[dict, str]:
  """-> ({computation: [Instr]}, the entry's name)."""
  comps, entry, cur = {}, None, None
  for line in text.splitlines():
    m = _COMP_START.match(line)
    if m and not line.startswith(" "):
      cur = m.group(2)
      comps[cur] = []
      if m.group(1):
        entry = cur
      continue
    if cur is None:
      continue
    m = _INSTR.match(line)
    if not m:
      continue
    name, shape, opcode, rest = m.groups()
    args = rest.split("), ", 1)[0] if "), " in rest else rest.rstrip(")")
    cyc = _CYCLES.search(line)
    op = _OP_NAME.search(line)
    br = _BRANCHES.search(line)
    comps[cur].append(Instr(name, opcode, shape, re.findall(r"%([\w.\-]+)", args), line,
                            op.group(1) if op else "", int(cyc.group(1)) if cyc else None,
                            _CALLS.findall(line), [b.strip().lstrip("%") for b in br.group(1).split(",")] if br
                            else []))
  return comps, entry


def arrays(shape: str) -> list:
  """[(dtype[dims] without layout, the array with it)] of an array or tuple shape."""
  return [(m.group(1) + "[" + m.group(2) + "]", m.group(0)) for m in ARRAY_LAYOUT.finditer(shape)]


def in_flight(comps: dict) -> tuple[set, set]:
  """XLA:TPU's async collective fusion (`async-collective-start` ... `async-collective-done`, both fusions) threads
  the collective's buffers through the compute fusions scheduled between: each does a step of the collective and
  passes them on, as extra operands and extra tuple outputs. -> (the values that hold those buffers, their shapes
  without layout): a compute fusion's own result is a tuple element of another shape."""
  carriers, held, kinds = set(), set(), set()
  for c in comps.values():
    for ins in c:
      if ins.opcode == "fusion" and ins.name.startswith("async-collective-start"):
        carriers.add(ins.name)
        kinds.update(bare for bare, _ in arrays(ins.shape))
      elif ins.opcode == "get-tuple-element" and ins.operands and ins.operands[0] in carriers:
        if any(bare in kinds for bare, _ in arrays(ins.shape)):
          held.add(ins.name)
      elif (ins.opcode == "fusion" and not ins.name.startswith("async-collective-done")
            and any(o in held for o in ins.operands)):
        carriers.add(ins.name)
  return held, kinds
