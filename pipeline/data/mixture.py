"""A mixture in training: several prepared datasets blended by token share into one stream with one cursor.

    from pipeline.data.mixture import open_mixture
    mix = open_mixture(dataset_dir, cfg)              # None for a single dataset; weights from cfg.data.mixture
    plan = mix.plan(total_rows=steps * rows_per_step) # rows, tokens and passes each source must supply
    check_plan(plan, steps, rows_per_step)            # MixtureError (one line) for an over-demanded source
    for batch in MixtureReader(mix, batch_size=8, start=cursor, rank=0, world_size=1): ...

A mixture directory (pipeline/data/mixture_prepare.py writes it) is a dataset directory whose manifest has
`source.kind == "mixture"` and names one prepared dataset per source; it holds a copy of their shared tokenizer
and no shards. The weights are not part of it: they come from `data.mixture` at training time, so a sweep over
weights and a change of weights reuse every prepared source.

The mixed stream (why it is exact and resumable). Weights are token shares: rows are fixed-length packed windows,
so a share of rows is a share of tokens. The stream is cut into blocks of k = data.mixture_block_rows rows. Every
block holds c_i rows of source i, c_i = w_i * k rounded by largest remainder (so the c_i sum to k, each within one
row of w_i * k); the order of the rows inside block b is a permutation seeded by (train.seed, b). The j-th row
of source i in the stream (j = b * c_i + its rank among source i's rows of block b) is row j mod n_i of the
permutation of source i's training split seeded by (train.seed, pass j // n_i, the source's name): each source
walks its own passes, every row once per pass. So position p of the stream is a pure function of p: the cursor in
the checkpoint is that one integer, a resume mid-block continues bit for bit, and a resume on another worker
count with the same global batch reads the same rows (rank r of W reads positions [p + r * B, p + (r + 1) * B)
of each global micro-batch). The stream has no end: the run's length is decided before training (`plan`),
each source repeating at most max_repetitions times, and `engine.epoch` stays 0.

Short runs. The weights are exact over whole blocks only: a run (or a sweep trial, or a phase) of fewer rows than
one block would train on the first rows of one shuffled block, whose shares can be far from the weights (0.2 / 0.2
/ 0.6 over 32 rows of a 1,024-row block: 4 / 9 / 19 rows). Such a run uses blocks of its own length instead
(`fitted_block_rows`), so it trains on round(w_i x its rows) of each source; the block it used is recorded in the
run's mixture.json, and a resume of that phase keeps it (pipeline/train/session/mixture_run.py), so resume stays exact.
The run prints, per source, the share it asked for and the share it trains on.

Batches carry, beside tokens / doc_ids / seq_id, `source` (the source's index in data.mixture) and `pass` (its
repetition), so the data audit names every row unambiguously (seq_ids are per dataset).
"""
from __future__ import annotations

import functools
import json
import math
import zlib
from collections import OrderedDict
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator

import numpy as np

from pipeline.mixture_spec import SourceSpec, normalized, parse_mixture
from pipeline.data.shards import DatasetError, Manifest, ShardReader, load_manifest
from pipeline.storage import absolute, join

if TYPE_CHECKING:
    import ray.data

    from pipeline.config import Config

MIXTURE_KIND = "mixture"
_BLOCK_SALT = 0x6D6978  # seeds block orders apart from the per-source orders
READER_CACHE_BYTES = 128 << 20  # shared by a reader's per-source ShardReaders (pipeline/data/shards.py's default)
RAY_CHUNK_BATCHES = 4096  # global micro-batches per Ray Data pipeline of the endless stream (then the next one)


class MixtureError(DatasetError):
    """A mixture cannot train as configured; the message names the source, what is missing and the fix."""


def is_mixture(manifest: Manifest) -> bool:
    return (manifest.source or {}).get("kind") == MIXTURE_KIND


def fitted_block_rows(block_rows: int, total_rows: int) -> int:
    """Rows per block for a run of `total_rows` rows of the mixed stream: data.mixture_block_rows, or the run's own
    rows when it is shorter than one block (its shares then as close to the weights as whole rows allow)."""
    return max(1, min(int(block_rows), int(total_rows))) if total_rows > 0 else int(block_rows)


def block_counts(weights: list[float], block_rows: int) -> np.ndarray:
    """Rows of each source in every block: w_i * k rounded by largest remainder (they sum to k; ties go to the
    earlier source). Sources of weight 0 get none."""
    raw = np.asarray(weights, np.float64) * block_rows
    counts = np.floor(raw).astype(np.int64)
    rest = block_rows - int(counts.sum())
    order = np.argsort(-(raw - counts), kind="stable")
    counts[order[:rest]] += 1
    return counts


@dataclass
class MixedSource:
    index: int  # position in data.mixture: what batches and the audit call the source
    name: str
    weight: float  # share of the training stream (normalized; 0 = evaluation only)
    dataset_dir: str
    manifest: Manifest
    max_repetitions: float

    @property
    def train_rows(self) -> int:
        return self.manifest.rows("train")


@dataclass
class SourcePlan:
    """What one source must supply to a run of `total_rows` rows of the mixed stream."""

    name: str
    weight: float
    rows_per_block: int
    rows_needed: int
    train_rows: int
    repetitions: float  # passes over its training split: rows_needed / train_rows
    max_repetitions: float
    dataset_dir: str
    dataset_hash: str
    share: float = 0.0  # what the run trains on: rows_needed / the run's rows (the weight, over whole blocks)

    @property
    def over(self) -> bool:
        return self.rows_needed > self.max_repetitions * self.train_rows


class Mixture:
    """Prepared sources with the weights of a config, and the block schedule of the mixed stream."""

    def __init__(self, dataset_dir: str, manifest: Manifest, sources: list[MixedSource], block_rows: int, seed: int):
        self.dataset_dir, self.manifest, self.sources = dataset_dir, manifest, sources
        self.block_rows, self.seed = int(block_rows), int(seed)
        self.counts = block_counts([s.weight for s in sources], self.block_rows)
        self.training = [s for s in sources if self.counts[s.index] > 0]
        self._base = np.repeat(np.arange(len(sources), dtype=np.int64), self.counts)  # (k,) source of each slot
        self._blocks: OrderedDict[int, tuple[np.ndarray, np.ndarray]] = OrderedDict()
        self._orders: OrderedDict[tuple[int, int], np.ndarray] = OrderedDict()

    @property
    def seq_len(self) -> int:
        return self.manifest.seq_len

    @property
    def vocab_size(self) -> int:
        return self.manifest.vocab_size

    def weights(self) -> dict[str, float]:
        return {s.name: s.weight for s in self.sources}

    # -------------------------------------------------------------------------------- the schedule
    def block(self, b: int) -> tuple[np.ndarray, np.ndarray]:
        """(source (k,), rank (k,)) of block b: which source each of its rows comes from, and how many rows of that
        source precede it in the block."""
        got = self._blocks.get(b)
        if got is None:
            src = self._base[np.random.default_rng([self.seed, int(b), _BLOCK_SALT]).permutation(self.block_rows)]
            rank = np.empty(self.block_rows, np.int64)
            for s in np.flatnonzero(self.counts):
                where = np.flatnonzero(src == s)
                rank[where] = np.arange(len(where))
            got = self._blocks[b] = (src, rank)
            if len(self._blocks) > 8:
                self._blocks.popitem(last=False)
        return got

    def locate(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(source index, j) of stream positions: the j-th row of that source in the stream (0-based)."""
        positions = np.asarray(positions, np.int64)
        blocks, offsets = np.divmod(positions, self.block_rows)
        src = np.empty(len(positions), np.int64)
        local = np.empty(len(positions), np.int64)
        for b in np.unique(blocks):
            sel = blocks == b
            bs, br = self.block(int(b))
            src[sel] = bs[offsets[sel]]
            local[sel] = int(b) * self.counts[src[sel]] + br[offsets[sel]]
        return src, local

    def order(self, index: int, rep: int) -> np.ndarray:
        """Source `index`'s training rows in the order of its pass `rep`."""
        key = (index, int(rep))
        got = self._orders.get(key)
        if got is None:
            s = self.sources[index]
            got = np.random.default_rng([self.seed, int(rep), zlib.crc32(s.name.encode())]).permutation(s.train_rows)
            self._orders[key] = got
            if len(self._orders) > 2 * len(self.sources):
                self._orders.popitem(last=False)
        return got

    # ------------------------------------------------------------------------------------ the plan
    def rows_needed(self, total_rows: int) -> np.ndarray:
        """Rows each source supplies to the first `total_rows` rows of the stream."""
        full, part = divmod(int(total_rows), self.block_rows)
        need = full * self.counts
        if part:
            need = need + np.bincount(self.block(full)[0][:part], minlength=len(self.sources))
        return need

    def plan(self, total_rows: int) -> list[SourcePlan]:
        need = self.rows_needed(total_rows)
        return [SourcePlan(s.name, s.weight, int(self.counts[s.index]), int(need[s.index]), s.train_rows,
                           float(need[s.index] / s.train_rows) if s.train_rows else math.inf, s.max_repetitions,
                           s.dataset_dir, s.manifest.settings_hash, float(need[s.index] / max(1, total_rows)))
                for s in self.sources]


def check_plan(plan: list[SourcePlan], steps: int, rows_per_step: int, seq_len: int) -> None:
    """MixtureError, one line, for the first source that would have to repeat more than its max_repetitions."""
    for p in plan:
        if p.over:
            have = p.train_rows * seq_len
            raise MixtureError(
                f"data.mixture source {p.name!r} (weight {p.weight:.3g}) must supply {p.rows_needed * seq_len:,} "
                f"tokens ({p.rows_needed:,} rows of {seq_len}) to {steps:,} steps of {rows_per_step} rows, and has "
                f"{have:,} tokens ({p.train_rows:,} rows) x max_repetitions {p.max_repetitions:g} = "
                f"{int(have * p.max_repetitions):,}; lower its weight, raise its max_repetitions (to "
                f"{math.ceil(p.repetitions * 100) / 100:g} or more), or add data")


def describe_plan(plan: list[SourcePlan], block_rows: int, asked_block_rows: int | None = None) -> list[str]:
    """One printed line per source: its share asked and trained on, rows per block, and the passes over its data the
    run makes; first, when the run is shorter than data.mixture_block_rows (`asked_block_rows`), a line saying so."""
    lines = []
    if asked_block_rows is not None and block_rows < asked_block_rows:
        lines.append(f"mixture: the run's {block_rows:,} rows are fewer than data.mixture_block_rows="
                     f"{asked_block_rows:,}, over which the weights are exact: it uses blocks of {block_rows:,} rows, "
                     "so each source's share is as close to its weight as whole rows allow")
    for p in plan:
        use = (f"{p.rows_needed:,} of its {p.train_rows:,} training rows: {p.repetitions:.2f} passes "
               f"(max_repetitions {p.max_repetitions:g})" if p.rows_per_block else "evaluation only")
        lines.append(f"mixture: {p.name:<12} weight {p.weight:6.1%} (trains on {p.share:6.1%}), {p.rows_per_block:,} "
                     f"of every {block_rows:,} rows; {use}")
    return lines


def run_manifest(mix: Mixture, plan: list[SourcePlan], *, phase: int, steps: int, rows_per_step: int,
                 asked_block_rows: int | None = None) -> dict:
    """The record of one phase's mixture a run keeps beside it (mixture.json): sources, weights, repetitions,
    tokenizer; `block_rows` is the block the phase trains with, `block_rows_asked` data.mixture_block_rows."""
    return {"phase": phase, "steps": steps, "rows_per_step": rows_per_step, "block_rows": mix.block_rows,
            "block_rows_asked": mix.block_rows if asked_block_rows is None else int(asked_block_rows),
            "seed": mix.seed, "dataset_dir": mix.dataset_dir, "seq_len": mix.seq_len,
            "tokenizer": join(mix.dataset_dir, mix.manifest.tokenizer_file),
            "tokenizer_sha256": mix.manifest.tokenizer_sha256,
            "sources": [{**asdict(p), "index": i} for i, p in enumerate(plan)],
            "dedup": mix.manifest.dedup}  # per source removed; per pair of sources the documents they shared


# ---------------------------------------------------------------------------------------- opening
def open_mixture(dataset_dir: str | Path, mixture: str, block_rows: int, seed: int,
                 manifest: Manifest | None = None) -> Mixture | None:
    """The mixture of `dataset_dir` with the weights of `mixture` (data.mixture's text); None when the directory is
    one dataset. DatasetError / MixtureError (one line) when they do not fit together. `manifest`: the directory's,
    when the caller has read it already."""
    dataset_dir = absolute(dataset_dir)
    manifest = manifest if manifest is not None else load_manifest(dataset_dir)
    if not is_mixture(manifest):
        return None
    prepared = {s["name"]: s for s in manifest.source["sources"]}
    if not mixture:
        raise MixtureError(f"{dataset_dir!r} is a mixture of {', '.join(prepared)}, and data.mixture is empty; set "
                           "data.mixture to its sources and weights")
    specs = parse_mixture(mixture)
    missing = [s.name for s in specs if s.name not in prepared]
    if missing:
        raise MixtureError(f"data.mixture source {missing[0]!r} is not in the prepared mixture {dataset_dir!r} (it has "
                           f"{', '.join(prepared)}); prepare this mixture (python pipeline/run.py prepare "
                           "--data.mixture=...) or drop the source")
    return Mixture(dataset_dir, manifest, _sources(specs, prepared, manifest), block_rows, seed)


def inline_mixture(cfg: "Config") -> "Config":
    """cfg with a data.mixture file replaced by the list it holds: what a run records and ships to workers, which
    may run where the file is not."""
    from pipeline.mixture_spec import mixture_json

    text = cfg.data.mixture
    if not text or text.strip().startswith("["):
        return cfg
    return cfg.replace({"data.mixture": mixture_json(parse_mixture(text))})


def mixture_of(dataset_dir: str | Path, cfg: "Config", manifest: Manifest | None = None) -> Mixture | None:
    """open_mixture with the config's data.mixture, data.mixture_block_rows and train.seed."""
    return open_mixture(dataset_dir, cfg.data.mixture, cfg.data.mixture_block_rows, cfg.train.seed, manifest)


def _sources(specs: list[SourceSpec], prepared: dict[str, dict], manifest: Manifest) -> list[MixedSource]:
    out = []
    for i, (spec, w) in enumerate(zip(specs, normalized(specs))):
        where = prepared[spec.name]["dataset_dir"]
        m = load_manifest(where)
        if m.seq_len != manifest.seq_len or m.tokenizer_sha256 != manifest.tokenizer_sha256:
            raise MixtureError(f"data.mixture source {spec.name!r} ({where}) has seq_len {m.seq_len} and tokenizer "
                               f"{m.tokenizer_sha256[:12]}, the mixture {manifest.seq_len} and "
                               f"{manifest.tokenizer_sha256[:12]}: sources share one tokenizer and row length; "
                               "prepare the mixture again")
        if w > 0 and m.rows("train") == 0:
            raise MixtureError(f"data.mixture source {spec.name!r} has weight {spec.weight:g} and no training rows "
                               f"({where}); give it weight 0 (evaluation only) or more data")
        out.append(MixedSource(i, spec.name, w, where, m, spec.max_repetitions))
    return out


# ---------------------------------------------------------------------------------------- reading
class MixtureReader:
    """This rank's micro-batches of the mixed stream from position `start` (Ray-free; see the module docstring).

    Yields {"tokens": int64 (B, T+1), "doc_ids": int32 (B, T+1), "seq_id": int64 (B,), "source": int64 (B,),
    "pass": int64 (B,)} until `stop` (a stream position; None = no end). `position` is the cursor after what was
    yielded."""

    def __init__(self, mixture: Mixture, batch_size: int, start: int = 0, rank: int = 0, world_size: int = 1,
                 stop: int | None = None):
        if batch_size < 1 or world_size < 1 or not 0 <= rank < world_size or start < 0:
            raise ValueError(f"invalid batch_size={batch_size}, rank={rank}, world_size={world_size}, start={start}")
        self.mixture, self.batch_size, self.rank, self.world_size = mixture, batch_size, rank, world_size
        self.global_batch = batch_size * world_size
        self.position, self.stop = int(start), stop
        cache = max(16 << 20, READER_CACHE_BYTES // max(1, len(mixture.training)))
        self._readers = {s.index: ShardReader(s.dataset_dir, "train", 1, drop_last=False, cache_bytes=cache)
                         for s in mixture.training}

    def positions(self, position: int) -> np.ndarray:
        """Stream positions of this rank's micro-batch in the global micro-batch starting at `position`."""
        first = position + self.rank * self.batch_size
        return np.arange(first, first + self.batch_size, dtype=np.int64)

    def read_positions(self, positions: np.ndarray) -> dict[str, np.ndarray]:
        """Numpy batch for stream positions, in their order."""
        mix = self.mixture
        src, local = mix.locate(positions)
        width = mix.seq_len + 1
        out = {"tokens": np.empty((len(positions), width), np.int64),
               "doc_ids": np.empty((len(positions), width), np.int32),
               "seq_id": np.empty(len(positions), np.int64), "source": src,
               "pass": np.empty(len(positions), np.int64)}
        for s in np.unique(src):
            sel = np.flatnonzero(src == s)
            n = mix.sources[int(s)].train_rows
            reps, within = np.divmod(local[sel], n)
            rows = np.empty(len(sel), np.int64)
            for r in np.unique(reps):
                rows[reps == r] = mix.order(int(s), int(r))[within[reps == r]]
            got = self._readers[int(s)].read_rows(rows)
            for key in ("tokens", "doc_ids", "seq_id"):
                out[key][sel] = got[key]
            out["pass"][sel] = reps
        return out

    def __iter__(self) -> Iterator[dict[str, Any]]:
        import torch

        while self.stop is None or self.position + self.global_batch <= self.stop:
            batch = self.read_positions(self.positions(self.position))
            self.position += self.global_batch
            yield {k: torch.from_numpy(v) for k, v in batch.items()}


def train_batches(dataset_dir: str, cfg: "Config", rank: int = 0, world_size: int = 1,
                  use_ray: bool = False, manifest: Manifest | None = None) -> Callable[[int, int], Any]:
    """`train_batches(epoch, start)` for pipeline/train/loop.py's fit over a mixture: this rank's endless stream
    from position `start` (the epoch is always 0: the stream has no end), read in this process or, with use_ray,
    by Ray Data read tasks (pipelines of RAY_CHUNK_BATCHES global micro-batches, one after another)."""
    t, d = cfg.train, cfg.data
    mix = mixture_of(dataset_dir, cfg, manifest)  # manifest: the mixture's, when the caller has read it already
    if mix is None:
        raise MixtureError(f"{dataset_dir!r} is one dataset, not a mixture")

    def local(epoch: int, start: int):
        return MixtureReader(mix, t.batch_size, start, rank, world_size)

    def chunks(epoch: int, start: int):
        position = start
        while True:
            ds = ray_mixed_batches(mix.dataset_dir, d.mixture, d.mixture_block_rows, t.seed, t.batch_size, position,
                                   RAY_CHUNK_BATCHES, rank, world_size)
            yield from ds.iter_torch_batches(batch_size=t.batch_size, prefetch_batches=2, drop_last=True)
            position += RAY_CHUNK_BATCHES * t.batch_size * world_size

    return chunks if use_ray else local


@functools.lru_cache(maxsize=4)
def _worker_reader(dataset_dir: str, mixture: str, block_rows: int, seed: int, batch_size: int, rank: int,
                   world_size: int) -> MixtureReader:
    """One reader per argument set per Ray worker process: open files and row-group caches are reused."""
    mix = open_mixture(dataset_dir, mixture, block_rows, seed)
    return MixtureReader(mix, batch_size, 0, rank, world_size)


def _read_mixed(batch: dict[str, np.ndarray], reader_args: tuple, start: int) -> dict[str, np.ndarray]:
    reader = _worker_reader(*reader_args)
    positions = np.concatenate([reader.positions(start + int(j) * reader.global_batch) for j in batch["id"]])
    return reader.read_positions(positions)


def ray_mixed_batches(dataset_dir: str, mixture: str, block_rows: int, seed: int, batch_size: int, start: int,
                      n_batches: int, rank: int = 0, world_size: int = 1) -> "ray.data.Dataset":
    """A Ray Data pipeline yielding exactly MixtureReader's next `n_batches` batches from `start`, in order (the
    same fused range -> read operator as pipeline/data/shards.py's ray_batches, and the same read-ahead bound)."""
    import ray.data

    from pipeline.data.shards import BATCHES_PER_TASK, MAX_BLOCKS, READ_TASKS

    args = (absolute(dataset_dir), mixture, int(block_rows), int(seed), int(batch_size), int(rank), int(world_size))
    blocks = max(1, min(-(-n_batches // BATCHES_PER_TASK), MAX_BLOCKS))
    ds = ray.data.range(n_batches, override_num_blocks=blocks, concurrency=READ_TASKS)
    ds.context.execution_options.preserve_order = True
    return ds.map_batches(_read_mixed, fn_kwargs={"reader_args": args, "start": int(start)}, batch_size=None,
                          batch_format="numpy", compute=ray.data.TaskPoolStrategy(size=READ_TASKS))


def write_run_manifest(path: str | Path, record: dict) -> None:
    """Add (or replace) one phase's record in the run's mixture.json: {"phases": [...]} (atomic write)."""
    from pipeline.storage import write_text

    path = Path(path)
    doc = json.loads(path.read_text()) if path.is_file() else {"phases": []}
    doc["phases"] = [p for p in doc["phases"] if p.get("phase") != record["phase"]] + [record]
    doc["phases"].sort(key=lambda p: p["phase"])
    write_text(str(path), json.dumps(doc, indent=2, sort_keys=True) + "\n")
