"""Deterministic training data for heads and drafts on a frozen target.

Sources (never Spec-Bench), all from the repository's data/train/*.jsonl (gsm8k, mbpp, self-instruct seed tasks)
and the Python standard library:
- self-distillation: prompts answered by the frozen target itself, either read from the committed shards of
  `python -m train.distill` (`distill_dir`: thousands of prompts, greedy and T 0.7, 256 new tokens) or generated
  here with the project's batched `spec_jax.batch.generate` at a mix of temperatures (`num_prompts`, cached);
  either way the heads learn the target's own continuations;
- reference transcripts: further prompts with the dataset's own answers, in the chat format. Cheap (no
  generation) and, since the losses are against the target's distribution at every position, still the target's
  behaviour that is learned; EAGLE trained on fixed chat data for the same reason;
- plain-text chunks of the standard library's sources (docstrings and code, files in sorted order).
The self-distilled sequences are cached as .npz under a cache dir keyed by the settings that shape them; they
are read (from that cache or train.distill's shards) one answer at a time, as a row that holds one is first read.

Batches are a pure function of (seed, step), so resuming at step s reads exactly what an uninterrupted run
would have read.
"""

from __future__ import annotations

import dataclasses
import functools
import glob
import hashlib
import json
import os
import sysconfig
from typing import Callable, Optional, Sequence

import numpy as np

from spec_jax.checkpoints.file_cache import replace_from, unique_temp_path
from spec_jax.datasets import TRAIN_DIR
from train.examples import Examples  # the transcripts, read from jsonl
from train.distill_shards import Answers, NpzRows, read_manifest, shard_answers


# The last HELD_OUT prompts of the seeded permutation are never trained on: train.eval_acceptance measures them.
HELD_OUT = 64


def prompt_order(n: int, seed: int) -> np.ndarray:
  """The seeded permutation of the n training prompts: self-distillation takes its head, reference transcripts
  the next part, and its last HELD_OUT entries are held out."""
  return np.random.default_rng(seed).permutation(n)


def stdlib_texts(n: int, chars: int, seed: int) -> list:
  """n plain-text chunks of `chars` characters from the stdlib's .py files (sorted paths, seeded picks)."""
  root = sysconfig.get_paths()["stdlib"]
  files = sorted(p for p in glob.glob(os.path.join(root, "**", "*.py"), recursive=True)
                 if "site-packages" not in p and "/test" not in p[len(root):])
  rng = np.random.default_rng(seed)
  out = []
  for i in rng.permutation(len(files)):
    if len(out) >= n:
      break
    with open(files[i], encoding="utf-8", errors="replace") as f:
      text = f.read()
    if len(text) < chars:
      continue
    start = int(rng.integers(0, len(text) - chars + 1))
    out.append(text[start:start + chars])
  return out


@dataclasses.dataclass(frozen=True)
class DataSpec:
  num_prompts: int = 256  # self-distilled prompts
  num_transcripts: int = 0  # further prompts with their reference answers, as chat transcripts
  num_text: int = 128  # stdlib text chunks
  text_chars: int = 1200
  max_new_tokens: int = 96
  temperatures: tuple = (0.0, 0.7, 1.0)  # cycled over prompt batches
  gen_batch: int = 16
  seq_len: int = 192  # sequences are cut / padded to this
  eval_fraction: float = 0.05
  seed: int = 0
  # A train.distill output directory: its answers replace the num_prompts generated here (num_prompts must be
  # 0), and the reference transcripts start after the last prompt position it answered.
  distill_dir: str = ""


class LazySeqs:
  """n sequences, each made (tokenized: make[i]() -> ids) and packed to seq_len on its first read only, then kept:
  on many hosts a host reads just the rows it feeds. `read` holds the indices made so far."""

  def __init__(self, make: Sequence[Callable[[], Sequence[int]]], seq_len: int):
    self.make, self.seq_len, self.rows, self.read = list(make), seq_len, {}, set()

  def __len__(self):
    return len(self.make)

  def row(self, i: int) -> tuple[np.ndarray, np.ndarray]:
    if i not in self.rows:
      toks, mask = pack([self.make[i]()], self.seq_len)
      self.rows[i] = (toks[0], mask[0])
      self.read.add(i)
    return self.rows[i]


class RowView:
  """One column (0 tokens, 1 mask) of the rows `order` of a LazySeqs, indexed like an [n, seq_len] array by row
  index arrays or slices; np.asarray reads (makes) every row."""

  def __init__(self, seqs: LazySeqs, order: np.ndarray, col: int):
    self.seqs, self.order, self.col = seqs, np.asarray(order), col

  def __len__(self):
    return len(self.order)

  @property
  def shape(self):
    return (len(self.order), self.seqs.seq_len)

  def __getitem__(self, idx):
    idx = np.arange(len(self))[idx] if isinstance(idx, slice) else np.asarray(idx)
    if idx.ndim != 1 or not np.issubdtype(idx.dtype, np.integer):
      raise TypeError(f"rows are read by a 1-D array of row indices or a slice, got {idx.dtype} {idx.shape}")
    dtype = np.int32 if self.col == 0 else bool
    return np.stack([self.seqs.row(int(self.order[i]))[self.col] for i in idx]) if len(idx) else \
        np.zeros((0, self.seqs.seq_len), dtype)

  def __array__(self, dtype=None, copy=None):
    a = self[np.arange(len(self))]
    return a if dtype is None else a.astype(dtype)

  def rows_read(self) -> list:
    """The rows of this view made so far (by this process)."""
    where = {int(s): r for r, s in enumerate(self.order)}
    return sorted(where[s] for s in self.seqs.read if s in where)


def fingerprint(tokens, process: int, count: int, allgather: Callable) -> bytes:
  """What a feature cache is keyed on: the bytes of every row; for rows made on read (RowView), a digest per row,
  process `process` of `count` hashing its share (rows p, p + P, ...) and `allgather` (the processes' collective)
  bringing every share to each, so no host reads every row."""
  if not isinstance(tokens, RowView):
    return np.ascontiguousarray(tokens).tobytes()
  n = len(tokens)
  mine = np.zeros((-(-n // count), 32), np.uint8)
  for j, r in enumerate(range(process, n, count)):
    mine[j] = np.frombuffer(hashlib.sha256(np.ascontiguousarray(tokens[[r]]).tobytes()).digest(), np.uint8)
  every = np.asarray(allgather(mine)) if count > 1 else mine[None]
  # every[q, j] is row q + j * count: put them back in row order.
  return b"rows:" + np.ascontiguousarray(every.transpose(1, 0, 2).reshape(-1, 32)[:n]).tobytes()


@dataclasses.dataclass
class Dataset:
  tokens: np.ndarray  # int32 [N, T], padded with 0 (or a RowView: made on read)
  mask: np.ndarray  # bool [N, T], real tokens
  eval_tokens: np.ndarray
  eval_mask: np.ndarray
  answers: Optional[Answers] = None  # the self-distilled answers (sequences 0 .. n - 1), read on use
  examples: Optional["Examples"] = None  # the jsonl examples the prompts and transcripts come from, read on use

  def token_counts(self, vocab_size: int, share: tuple = (0, 1)) -> np.ndarray:
    """Counts of every token id over the training rows; share=(p, P): over rows p, p + P, ... only (process p's
    part of a count summed over P processes)."""
    rows = np.arange(share[0], len(self.tokens), share[1])
    toks, mask = np.asarray(self.tokens[rows]), np.asarray(self.mask[rows], bool)
    return np.bincount(toks[mask], minlength=vocab_size)


def self_distill(generate_fn: Callable, prompts: Sequence[Sequence[int]], spec: DataSpec) -> list:
  """generate_fn(prompt_ids, temperature, seed) -> new token lists. Returns prompt + continuation per prompt."""
  out = []
  for b, i in enumerate(range(0, len(prompts), spec.gen_batch)):
    batch = [list(p) for p in prompts[i:i + spec.gen_batch]]
    temp = spec.temperatures[b % len(spec.temperatures)]
    new = generate_fn(batch, temp, spec.seed + b)
    out.extend(p + n for p, n in zip(batch, new))
  return out


def pack(seqs: Sequence[Sequence[int]], seq_len: int) -> tuple[np.ndarray, np.ndarray]:
  """Cut to seq_len and right-pad with 0 (one sequence per row: position 0 is always its BOS)."""
  toks = np.zeros((len(seqs), seq_len), np.int32)
  mask = np.zeros((len(seqs), seq_len), bool)
  for i, s in enumerate(seqs):
    s = list(s)[:seq_len]
    toks[i, :len(s)] = s
    mask[i, :len(s)] = True
  return toks, mask


def split_order(n: int, spec: DataSpec) -> tuple[np.ndarray, np.ndarray]:
  """-> (train, eval) sequence indices: a seeded permutation, its head held out for eval."""
  order = np.random.default_rng(spec.seed).permutation(n)
  n_eval = max(1, int(round(n * spec.eval_fraction)))
  return order[n_eval:], order[:n_eval]


def split(toks, mask, spec: DataSpec) -> Dataset:
  tr, ev = split_order(len(toks), spec)
  return Dataset(toks[tr], mask[tr], toks[ev], mask[ev])


def split_lazy(seqs: LazySeqs, spec: DataSpec, answers: Optional[Answers] = None, examples=None) -> Dataset:
  """split() over sequences made on read: the same rows in the same order, none made yet."""
  tr, ev = split_order(len(seqs), spec)
  return Dataset(RowView(seqs, tr, 0), RowView(seqs, tr, 1), RowView(seqs, ev, 0), RowView(seqs, ev, 1), answers,
                 examples)


def _encode_example(encode_prompt: Callable, examples: "Examples", i: int) -> list:
  """A reference transcript's ids: example i read from its file and encoded as (prompt, answer)."""
  return encode_prompt(examples[i])


def cache_key(spec: DataSpec, target_name: str, extra: str = "") -> str:
  blob = json.dumps([dataclasses.asdict(spec), target_name, extra], sort_keys=True, default=str)
  return hashlib.sha256(blob.encode()).hexdigest()[:16]


def _distill_key(spec: DataSpec, target_name: str) -> str:
  """Only the settings that shape the self-distilled answers (so more text or transcripts reuse them)."""
  keep = dict(num_prompts=spec.num_prompts, max_new_tokens=spec.max_new_tokens, temperatures=spec.temperatures,
              gen_batch=spec.gen_batch, seq_len=spec.seq_len, seed=spec.seed)
  return hashlib.sha256(json.dumps([keep, target_name], sort_keys=True, default=str).encode()).hexdigest()[:16]


def distilled_answers(spec: DataSpec, target_name: str, log=print, share: tuple = (0, 1)) -> tuple[Answers, int]:
  """-> (prompt + answer token lists of a train.distill directory, read on use; the first prompt position it did
  not answer). Refuses answers of another target (they would teach another model's distribution). share=(p, P):
  this host checks the checksums of its share of the shards (distill_shards.shard_answers)."""
  made_by = read_manifest(spec.distill_dir).get("settings", {}).get("target_name")
  if made_by is not None and made_by != target_name:
    raise ValueError(f"{spec.distill_dir} holds answers of {made_by!r}, not of the target {target_name!r}")
  answers, first = shard_answers(spec.distill_dir, share)
  log(f"data: {len(answers)} self-distilled answers from {spec.distill_dir}")
  return answers, first


def _cached_answers(path: str) -> Answers:
  """The answers of a cache written by _generated_answers, each row read (memory-mapped) on use."""
  tokens, mask = NpzRows(path, "tokens"), NpzRows(path, "mask")
  return Answers(tokens.shape[0], lambda i: tokens.rows(i, i + 1)[0][mask.rows(i, i + 1)[0]].tolist())


def _generated_answers(spec, target_name, prompts, encode_prompt, generate_fn, cache_dir, log) -> Answers:
  """The prompts answered here by generate_fn, cached as .npz under cache_dir. prompts() -> the prompt texts
  (read only when there is no cache)."""
  os.makedirs(cache_dir, exist_ok=True)
  path = os.path.join(cache_dir, f"distill-{_distill_key(spec, target_name)}.npz")
  if os.path.exists(path):
    log(f"data: cached self-distilled sequences {path}")
    return _cached_answers(path)
  prompt_ids = [encode_prompt(p)[:spec.seq_len // 2] for p in prompts()]
  # Similar lengths share a generation batch (less padding); the result order is fixed by the sort.
  prompt_ids.sort(key=len)
  seqs = self_distill(generate_fn, prompt_ids, spec)
  toks, mask = pack(seqs, spec.seq_len)
  # Atomic, one temporary per writer: another host answering the same prompts never reads half a file.
  # np.savez, not compressed: _cached_answers maps its rows
  replace_from(unique_temp_path(path) + ".npz", path, lambda tmp: np.savez(tmp, tokens=toks, mask=mask))
  return Answers(len(seqs), seqs.__getitem__)


def build(spec: DataSpec, *, target_name: str, encode_prompt: Callable, encode_text: Callable,
          generate_fn: Callable, cache_dir: str, prompts: Optional[list] = None, texts: Optional[list] = None,
          transcripts: Optional[list] = None, data_dir: str = TRAIN_DIR, log=print, lazy: bool = False,
          share: tuple = (0, 1)) -> Dataset:
  """The full pipeline; the self-distilled sequences (the slow part) are cached as .npz. `encode_prompt(text)
  -> ids` (BOS and chat template included); `encode_text(text) -> ids` (BOS included) for plain-text chunks;
  `transcripts` are token lists (built from the reference answers when None). lazy: the Dataset's arrays are
  RowViews, each transcript and text chunk tokenized when a row of it is first read (a host of many reads only
  its own rows, and the self-distilled answers are read likewise, one as its row is first read: the Dataset's
  `answers` holds which); otherwise numpy arrays of every row. share=(p, P): this process is p of P (each checks
  its share of the distill shards' checksums)."""
  if spec.distill_dir and spec.num_prompts:
    raise ValueError("distill_dir replaces the generated self-distilled answers: set num_prompts to 0")
  examples = order = None
  if prompts is None or transcripts is None:
    examples = Examples(data_dir)  # each example read as its row (or its generation) needs it
    order = prompt_order(len(examples), spec.seed)

  def check_room(first_transcript):  # before any generation: the held-out prompts stay out of training
    if examples is not None and first_transcript + spec.num_transcripts > len(examples) - HELD_OUT:
      raise ValueError(f"self-distilled prompts + num_transcripts must be <= {len(examples) - HELD_OUT} (the rest "
                       "is held out)")

  if spec.distill_dir:
    answers, first_transcript = distilled_answers(spec, target_name, log, share)
    check_room(first_transcript)
  else:
    first_transcript = spec.num_prompts
    check_room(first_transcript)
    texts_of = (lambda: prompts) if prompts is not None else \
        (lambda: [examples[i][0] for i in order[:spec.num_prompts]])
    answers = _generated_answers(spec, target_name, texts_of, encode_prompt, generate_fn, cache_dir, log)
  n_distilled = len(answers)
  # Every sequence is a thunk: tokenized (and packed) only when a row of it is read.
  ids = lambda x: (lambda: x)
  if transcripts is None:
    picked = order[first_transcript:first_transcript + spec.num_transcripts]
    transcripts = [functools.partial(_encode_example, encode_prompt, examples, i) for i in picked
                   if examples.answered[i]]
  else:
    transcripts = [ids(t) for t in transcripts]
  if texts is None:
    texts = stdlib_texts(spec.num_text, spec.text_chars, spec.seed)
  seqs = LazySeqs([functools.partial(answers.__getitem__, i) for i in range(n_distilled)] + transcripts +
                  [functools.partial(encode_text, t) for t in texts], spec.seq_len)
  data = split_lazy(seqs, spec, answers, examples)
  what = (f"data: {len(seqs)} sequences ({n_distilled} self-distilled, {len(transcripts)} reference transcripts, "
          f"{len(texts)} text chunks)")
  if lazy:
    log(f"{what}, tokenized as read")
    return data
  data = Dataset(*(np.asarray(a) for a in (data.tokens, data.mask, data.eval_tokens, data.eval_mask)), answers,
                 examples)
  log(f"{what}, {int(data.mask.sum() + data.eval_mask.sum())} tokens")
  return data


def batch_indices(n: int, step: int, batch_size: int, seed: int) -> np.ndarray:
  """The row indices of a global step's batch over n sequences: a seeded permutation per epoch, so any step can
  be read directly (and a host can read only its own rows of it)."""
  per_epoch = max(n // batch_size, 1)
  epoch, i = divmod(step, per_epoch)
  perm = np.random.default_rng([seed, epoch]).permutation(n)
  idx = perm[i * batch_size:(i + 1) * batch_size]
  if len(idx) < batch_size:  # fewer sequences than a batch: wrap around
    idx = np.resize(perm, batch_size)
  return idx


def batch_at(data_tokens: np.ndarray, data_mask: np.ndarray, step: int, batch_size: int, seed: int):
  """-> (tokens, mask, row indices) of a global step (batch_indices)."""
  idx = batch_indices(len(data_tokens), step, batch_size, seed)
  return data_tokens[idx], data_mask[idx], idx
