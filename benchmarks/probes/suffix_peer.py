"""Does our suffix proposer accept as much per step as Snowflake's SuffixDecoding (arctic-inference, the code behind
vLLM's method "suffix") on the same token streams?

Two steps, two interpreters:

  # 1. our real run (project venv): Gemma 3 270M, greedy, one long-lived slot, benchmarks/suffix.py's traffic
  #    (held-apart Spec-Bench questions as is, retried 3 times, templated); writes every request's prompt and output
  #    ids and our measured steps / accepted drafts per arm
  .venv/bin/python benchmarks/probes/suffix_peer.py record --out=/tmp/suffix_streams.jsonl
  # 2. the peer (a throwaway venv with `pip install arctic-inference`, which builds its C++ suffix tree on CPU):
  #    replays the same streams through its SuffixDecodingCache and prints both side by side
  /tmp/venv-arctic/bin/python benchmarks/probes/suffix_peer.py replay --streams=/tmp/suffix_streams.jsonl

The replay is the loop's greedy step on a known stream: at output position i the peer drafts from prompt +
output[:i], the accepted drafts are the longest draft path equal to output[i:] (cut at the stream's end, as the
loop cuts at max_tokens or a stop token), and output[i : i + accepted + 1] is committed to its cache, as our loop
commits a step's tokens. For a greedy target this is exactly what verification would accept, so the peer's numbers
are what it would measure in our loop. Each traffic kind starts from an empty cache (ours: one tenant per kind, in
one slot whose 2048-token ring holds the whole run). Both count τ = (accepted + steps) / steps per kind.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

ARMS = {  # ours: (spec factor, tree width); the peer's arm of the same name: (max_spec_factor, tree)
    "suffix f1 chain": (1.0, 1), "suffix f4 chain": (4.0, 1), "suffix f4 tree 3x4": (4.0, 3)}
K = 4
MAX_DEPTH = 24  # suffix_decoding_max_tree_depth, both


def record(args):
  sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
  import jax
  from absl import flags
  from benchmarks import suffix as bench
  from spec_jax import slots
  from spec_jax.checkpoints.load import load_model
  from spec_jax.decode import make_spec
  from spec_jax.proposers.suffix import SuffixProposer
  from spec_jax.proposers.tree_expand import DynamicTree
  from spec_jax.slot_table import SlotTable
  flags.FLAGS(["suffix_peer"], known_only=True)  # benchmarks/suffix.py's defaults
  config, params, tok = load_model(None, "bfloat16")
  kinds = args.kinds.split(",")
  sent = {kind: bench.traffic(kind, tok, args.requests_per_kind) for kind in kinds}
  capacity = 1024
  rows = {}
  for arm, (factor, width) in ARMS.items():
    tree = DynamicTree(topk=width, depth=K, nodes=1 + width * K) if width > 1 else None
    spec = make_spec(config, SuffixProposer(k=K, max_depth=MAX_DEPTH, spec_factor=factor, tree=tree),
                     adaptive_k=False, stop_ids=tok.stop_ids)
    table = SlotTable({"target": params, "proposer": {}}, spec, num_slots=1, capacity=capacity)
    for ki, kind in enumerate(kinds):
      for name, ids, _, _ in sent[kind]:
        table.insert(name, slots.make_request(ids, max_new=args.max_new_tokens, spec=spec, capacity=capacity,
                                              tenant=1 + ki))
        snap, held = table.run(args.max_new_tokens + 1)
        snap = jax.device_get(snap)
        out = snap.tokens[0, len(ids):snap.lengths[0]].tolist()
        row = rows.setdefault((kind, name), {"kind": kind, "name": name, "prompt": list(map(int, ids)),
                                             "output": out, "ours": {}})
        if row["output"] != out:
          raise RuntimeError(f"{arm}: {kind}/{name} differs from the first arm's greedy output")
        row["ours"][arm] = {"steps": int(snap.steps[0]), "accepted": int(snap.accepted[0]),
                            "drafted": int(snap.drafted[0]), "from_history": int(snap.accepted_from_history[0])}
        table.release(0)
      print(f"{arm}: {kind} done", flush=True)
  with open(args.out, "w") as f:
    for row in rows.values():
      f.write(json.dumps(row) + "\n")
  print(f"{len(rows)} streams -> {args.out}")


def path_accepted(draft, target) -> int:
  """The longest root-to-node path of a draft tree (token_ids, parents: -1 = under the root) equal to target's
  first tokens."""
  best = {-1: 0}  # node -> accepted depth along its path; the root
  for i, (t, p) in enumerate(zip(draft.token_ids, draft.parents)):
    d = best.get(p)
    if d is not None and d < len(target) and d < K and t == target[d]:
      best[i] = d + 1
  return max(best.values())


def replay(args):
  from arctic_inference.suffix_decoding import SuffixDecodingCache
  rows = [json.loads(line) for line in open(args.streams)]
  kinds = list(dict.fromkeys(r["kind"] for r in rows))
  table = {}
  for kind in kinds:
    for arm, (factor, width) in ARMS.items():
      cache = SuffixDecodingCache(max_tree_depth=MAX_DEPTH)
      steps = accepted = drafted = 0
      for n, r in enumerate(x for x in rows if x["kind"] == kind):
        out = r["output"]
        req = f"{kind}-{n}"
        cache.start_request(req, r["prompt"])
        cache.add_active_response(req, out[:1])  # the first token comes from prefill, not a step
        i = 1
        while i < len(out):
          ctx = r["prompt"] + out[:i]
          d = cache.speculate(req, ctx, max_spec_tokens=K if width == 1 else width * K, max_spec_factor=factor,
                              use_tree_spec=width > 1)
          a = path_accepted(d, out[i:])
          emit = min(a + 1, len(out) - i)
          steps, accepted, drafted = steps + 1, accepted + min(a, emit), drafted + len(d.token_ids)
          cache.add_active_response(req, out[i:i + emit])
          i += emit
        cache.stop_request(req)
      ours = [r["ours"][arm] for r in rows if r["kind"] == kind]
      o_steps, o_acc = sum(x["steps"] for x in ours), sum(x["accepted"] for x in ours)
      table[(kind, arm)] = {"ours_tau": (o_acc + o_steps) / o_steps, "peer_tau": (accepted + steps) / steps,
                            "ours_acc_per_step": o_acc / o_steps, "peer_acc_per_step": accepted / steps,
                            "ours_from_history": sum(x["from_history"] for x in ours) / max(o_acc, 1),
                            "ours_drafted_per_step": sum(x["drafted"] for x in ours) / o_steps,
                            "peer_drafted_per_step": drafted / steps}
  print("| traffic | arm | τ ours | τ arctic | drafted / step ours, arctic | ours: accepted from history |")
  print("|---|---|---|---|---|---|")
  for (kind, arm), s in table.items():
    print(f"| {kind} | {arm} | {s['ours_tau']:.2f} | {s['peer_tau']:.2f} | {s['ours_drafted_per_step']:.2f}, "
          f"{s['peer_drafted_per_step']:.2f} | {s['ours_from_history']:.0%} |")
  if args.json_out:
    with open(args.json_out, "w") as f:
      json.dump({f"{k}/{a}": v for (k, a), v in table.items()}, f, indent=1)


def main():
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  sub = ap.add_subparsers(dest="cmd", required=True)
  rec = sub.add_parser("record")
  rec.add_argument("--out", required=True)
  rec.add_argument("--kinds", default="specbench,retries,templated")
  rec.add_argument("--requests_per_kind", type=int, default=9)
  rec.add_argument("--max_new_tokens", type=int, default=64)
  rep = sub.add_parser("replay")
  rep.add_argument("--streams", required=True)
  rep.add_argument("--json_out", default="")
  args = ap.parse_args()
  (record if args.cmd == "record" else replay)(args)


if __name__ == "__main__":
  main()
