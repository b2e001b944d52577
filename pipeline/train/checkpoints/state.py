"""Checkpoints: the engine's whole training state on disk in one of two layouts, and loaders that read both.

    engine.save("ckpt/step_000050")              # the layout follows the engine: full, or sharded under FSDP
    engine.load("ckpt/step_000050")              # either layout, on any number of workers
    state = load_model_state("ckpt/step_000050")  # eval, generate, export: the decoder's full weights, one process

Layouts (meta.json `layout`):
  full     model.safetensors (the decoder's weights), train_state.pt (AdamW, scheduler, RNG; tensors and plain types,
           loaded with torch.load(weights_only=True)) and meta.json. Rank 0 writes it alone: one process and DDP
           workers each hold the whole state.
  sharded  sharded/ in torch.distributed.checkpoint (DCP) form: `.metadata` plus one `__<rank>_0.distcp` per worker
           holding that worker's shards of the weights and AdamW moments (FQN keys, so any number of workers can
           read them back: DCP reshards on load), and meta.json (counters, the scheduler's state, config). Every
           FSDP worker writes its own files; Ray Train merges the workers' directories into one checkpoint
           (every rank reports its directory; the checkpoint is registered once all have).
meta.json `format` 2; format 1 (written before sharded checkpoints existed) is the full layout and still loads.
meta.json's `files` records every other file of the checkpoint with its size and sha256 (a sharded one: every
worker's shards, gathered by rank 0), so a copy in storage can be checked complete with one listing before it is
registered or resumed (pipeline/train/checkpoints/index.py); a checkpoint without it is checked by its layout.

Loading either layout into either kind of engine: full -> one process or DDP (as always); full -> FSDP (every
worker reads the full weights and keeps its shards: `set_model_state_dict(full_state_dict=True)`); sharded -> FSDP
on the same or another worker count, and sharded -> one process or DDP (DCP assembles whole tensors without a
process group). `load_model_state` consolidates a sharded checkpoint in one process, sized from its metadata, with
no manual step: eval, generate and export read FSDP checkpoints as they read full ones.

On object storage (`load` given an s3:// or gs:// location: a resumed Ray Train worker, a new phase) a sharded
checkpoint is read in place: each worker fetches only the byte ranges of the tensors its load plan names, so no
node downloads the whole model and optimizer state. A full checkpoint, needed whole, is copied to a temporary
directory first.

Atomic: a checkpoint is written to a temporary sibling directory and renamed into place; under FSDP every worker
writes into a directory of the same name (shared storage: the same one; Ray Train: each its own), a barrier
follows, then rank 0 renames and, after a second barrier, a worker whose own temporary directory is still there
(it was not shared) renames that. A crash leaves at most a temporary directory, never a half checkpoint.

Safety: DCP's `.metadata` is a pickle. It is read with an unpickler that builds only DCP's metadata classes,
torch sizes, dtypes and layouts (SafeReader); tensors are read with weights_only loading, and a checkpoint whose
metadata declares pickled objects (this project never writes any) is refused.
"""
from __future__ import annotations

import json
import os
import pickle
import shutil
import tempfile
import uuid
import warnings
from pathlib import Path
from typing import Any

import torch

from pipeline.train.checkpoints.checkpoint_error import CheckpointError  # noqa: F401  (raised here; imported from here too)
from pipeline.train.checkpoints.index import file_record

CHECKPOINT_FORMAT = 2
READABLE_FORMATS = (1, 2)  # 1: the full layout, before sharded checkpoints
FULL, SHARDED = "full", "sharded"
SHARDED_DIR = "sharded"  # the DCP directory inside a sharded checkpoint
TRAIN_STATE = "train_state.pt"  # a full checkpoint's optimizer, scheduler and RNG state
MODEL_PREFIX = "decoder."  # LossModule's name for the decoder: checkpoint keys are the engine module's FQNs


# ------------------------------------------------------------------------------------------ reading DCP safely
_DCP_METADATA = {
    "torch.distributed.checkpoint.metadata": {"Metadata", "MetadataIndex", "StorageMeta", "TensorProperties",
                                              "TensorStorageMetadata", "ChunkStorageMetadata",
                                              "BytesStorageMetadata", "_MEM_FORMAT_ENCODING"},
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},
    "pathlib": {"Path", "PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath"},
    "collections": {"OrderedDict"},
}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if name in _DCP_METADATA.get(module, ()):
            return super().find_class(module, name)
        if module == "torch" and (name == "Size" or isinstance(getattr(torch, name, None), torch.dtype)):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not part of a DCP checkpoint's metadata")


RANGE_MAX = 64 << 20  # back-to-back ranges of one shard file are fetched in one GET up to this size
FETCH_THREADS = 16  # GETs in flight per worker


def _safe_reader(path: str | os.PathLike):
    """A DCP FileSystemReader whose metadata is unpickled by _MetadataUnpickler (module docstring). For a location
    on object storage it reads only the byte ranges this worker's load plan names (ranged GETs, back-to-back
    ranges merged, several in flight; a gap is never read) instead of whole shard files; `bytes_read` counts them."""
    import io
    import posixpath
    from contextlib import contextmanager
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, StorageMeta

    from pipeline.storage import is_local, read_bytes, resolve

    location = str(path)
    remote = not is_local(location)

    class _Ranges:
        """The reader's filesystem on object storage: DCP opens each shard file through it, and is handed nothing
        to read from (read_data fetched the ranges first)."""

        def init_path(self, p: str | os.PathLike, **kwargs: Any) -> str:
            return str(p)

        def concat_path(self, p: str | os.PathLike, suffix: str) -> str:
            return posixpath.join(str(p), suffix)

        @contextmanager
        def create_stream(self, p: str | os.PathLike, mode: str):
            yield None

    class SafeReader(FileSystemReader):
        bytes_read = 0
        _fetched: dict[tuple[str, int, int], bytes] | None = None

        def __init__(self, p: str) -> None:
            super().__init__(p)
            if remote:
                self.fs, self.path = _Ranges(), p

        def read_metadata(self, *args: Any, **kwargs: Any):  # FileSystemReader's, with the safe unpickler
            meta_path = self._get_metadata_path(kwargs.get("rank"))
            where = posixpath.dirname(str(meta_path)) if remote else Path(meta_path).parent
            try:
                if remote:
                    md = _MetadataUnpickler(io.BytesIO(read_bytes(str(meta_path)))).load()
                else:
                    with self.fs.create_stream(Path(meta_path), "rb") as f:
                        md = _MetadataUnpickler(f).load()
            except FileNotFoundError:
                raise CheckpointError(f"{where} has no .metadata; the sharded checkpoint is incomplete, "
                                      f"use an earlier one") from None
            except (pickle.UnpicklingError, EOFError, AttributeError, ValueError) as exc:
                raise CheckpointError(f"{meta_path} is not DCP metadata this version reads ({exc}); use an "
                                      f"earlier checkpoint") from None
            if any(isinstance(v, BytesStorageMetadata) for v in md.state_dict_metadata.values()):
                raise CheckpointError(f"{where} holds pickled objects, which longtrain never writes and "
                                      f"does not load; it was not written by longtrain")
            if getattr(md, "storage_meta", None) is None:
                md.storage_meta = StorageMeta()
            md.storage_meta.load_id = self.load_id
            return md

        def read_data(self, plan, planner):
            if not remote:
                return super().read_data(plan, planner)
            self._fetched = self._fetch({(s.relative_path, s.offset, s.length) for s in
                                         (self.storage_data[item.storage_index] for item in plan.items)})
            try:
                return super().read_data(plan, planner)
            finally:
                self._fetched = None

        def _slice_file(self, file, sinfo):
            if self._fetched is None:
                return super()._slice_file(file, sinfo)
            return io.BytesIO(self._fetched[(sinfo.relative_path, sinfo.offset, sinfo.length)])

        def _fetch(self, wanted: set[tuple[str, int, int]]) -> dict[tuple[str, int, int], bytes]:
            """Every wanted (file, offset, length), read in merged ranges: a worker's slice of the checkpoint."""
            from concurrent.futures import ThreadPoolExecutor

            runs: list[tuple[str, int, int, list[tuple[str, int, int]]]] = []  # (file, start, end, its pieces)
            for key in sorted(wanted):
                name, offset, length = key
                if runs and runs[-1][0] == name and offset <= runs[-1][2] \
                        and offset + length - runs[-1][1] <= RANGE_MAX:
                    runs[-1] = (name, runs[-1][1], max(runs[-1][2], offset + length), runs[-1][3] + [key])
                else:
                    runs.append((name, offset, offset + length, [key]))

            def get(run: tuple[str, int, int, list]) -> bytes:
                fs, file = resolve(posixpath.join(location, run[0]))
                with fs.open_input_file(file) as f:
                    return f.read_at(run[2] - run[1], run[1])

            out: dict[tuple[str, int, int], bytes] = {}
            with ThreadPoolExecutor(FETCH_THREADS) as pool:
                for (name, start, end, keys), data in zip(runs, pool.map(get, runs)):
                    self.bytes_read += len(data)
                    view = memoryview(data)
                    for key in keys:
                        out[key] = view[key[1] - start:key[1] - start + key[2]]
            return out

    return SafeReader(location)


def _shard_files(directory: str | os.PathLike) -> set[str]:
    """The files a sharded checkpoint's metadata says hold its tensors."""
    md = _safe_reader(_join(directory, SHARDED_DIR)).read_metadata()
    return {info.relative_path for info in md.storage_data.values()}


def _join(directory: str | os.PathLike, *names: str) -> str:
    from pipeline.storage import join

    return join(str(directory), *names)


# ------------------------------------------------------------------------------------------ meta.json
def read_checkpoint_meta(directory: str | os.PathLike, weights_only: bool = False) -> dict[str, Any]:
    """meta.json of a checkpoint (a local path or a location on object storage), after checking that the files
    of its layout are all there; weights_only: those a reader of the weights alone needs (eval, generate and
    export read no train_state.pt, so a checkpoint that lost it still evaluates and exports)."""
    from pipeline.storage import is_file, read_text
    from pipeline.train.checkpoints.index import missing_files

    meta_path = _join(directory, "meta.json")
    try:  # a StorageError (endpoint down, stalled, denied) goes up as what it is: it says nothing of the checkpoint
        text = read_text(meta_path)
    except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
        from pipeline.train.session.run_dir import CHECKPOINT_HINT

        raise CheckpointError(f"{directory} is not a checkpoint (no meta.json); {CHECKPOINT_HINT}") from None
    try:
        meta = json.loads(text)
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{meta_path} is corrupt ({exc.msg}); use an earlier checkpoint") from None
    if meta.get("format") not in READABLE_FORMATS:
        raise CheckpointError(f"{directory} has checkpoint format {meta.get('format')!r}; this version reads "
                              f"formats {', '.join(map(str, READABLE_FORMATS))}")
    layout = meta.setdefault("layout", FULL)
    if layout not in (FULL, SHARDED):
        raise CheckpointError(f"{directory} has checkpoint layout {layout!r}; this version reads {FULL} and {SHARDED}")
    if meta.get("files"):  # names and sizes meta.json records: one listing (pipeline/train/checkpoints/index.py)
        problem = missing_files(str(directory), meta, skip=[TRAIN_STATE] if weights_only else [])
        if problem:
            raise CheckpointError(f"{problem}; it is incomplete, use an earlier one")
        return meta
    if layout == FULL:
        needed = ["model.safetensors"] + ([] if weights_only else [TRAIN_STATE])
    elif layout == SHARDED:
        needed = [f"{SHARDED_DIR}/{name}" for name in sorted(_shard_files(directory))]
    else:
        raise CheckpointError(f"{directory} has checkpoint layout {layout!r}; this version reads {FULL} and {SHARDED}")
    for name in needed:
        if not is_file(_join(directory, name)):
            raise CheckpointError(f"checkpoint {directory} lacks {name}; it is incomplete, use an earlier one")
    return meta


def check_checkpoint_fits(meta: dict[str, Any], tier: str, vocab_size: int, where: Any,
                          mixer: str | None = None) -> None:
    """A checkpoint from another tier, vocabulary or model family (mixer, when given) gets one clear error,
    before any weight is touched."""
    ckpt_mixer = meta.get("config", {}).get("model", {}).get("mixer", "attention")
    if mixer is not None and ckpt_mixer != mixer:
        raise CheckpointError(f"checkpoint {where} is a {ckpt_mixer} model but model.mixer is {mixer!r}; "
                              f"set --model.mixer={ckpt_mixer} or start a new run")
    if meta["tier"] != tier:
        raise CheckpointError(f"checkpoint {where} is tier {meta['tier']!r} but model.tier is {tier!r}; "
                              f"set --model.tier={meta['tier']} or start a new run")
    if meta["vocab_size"] != vocab_size:
        raise CheckpointError(f"checkpoint {where} has vocab {meta['vocab_size']} but the dataset's tokenizer "
                              f"has {vocab_size}; use the dataset and tokenizer the checkpoint was trained with")


def check_same_experts(meta: dict[str, Any], cfg, where: Any) -> None:
    """A checkpoint of another mixture-of-experts shape (model.num_experts, experts_per_token, expert_ffn,
    shared_experts, dense_first_layers, or a selection bias where it had none) gets one line naming the field and
    the checkpoint's value, before any weight is touched (the routing settings that shape no weight may change)."""
    from pipeline.config import from_dict, model_tier

    if not meta.get("config"):
        return
    saved, now = model_tier(from_dict(meta["config"])).moe, model_tier(cfg).moe
    shape = ("num_experts", "experts_per_token", "expert_ffn", "shared_experts", "dense_first_layers")
    if (saved is None) != (now is None):
        what = "a dense model" if saved is None else f"a mixture of {saved.num_experts} experts"
        raise CheckpointError(f"checkpoint {where} is {what} but this run's model.tier={cfg.model.tier} with its "
                              f"model.num_experts is {'not' if now is None else 'a mixture'}; set model.num_experts to "
                              f"{0 if saved is None else saved.num_experts} or start a new run")
    for name in shape if saved is not None else ():
        if getattr(saved, name) != getattr(now, name):
            raise CheckpointError(f"checkpoint {where} has model.{name}={getattr(saved, name)} but this run has "
                                  f"{getattr(now, name)}; set --model.{name}={getattr(saved, name)} or start a new run")
    if saved is not None and saved.selection_bias != now.selection_bias:
        was = "bias" if saved.selection_bias else "aux"
        raise CheckpointError(f"checkpoint {where} balanced its experts with model.moe_balance={was} (its selection "
                              f"bias is {'part' if saved.selection_bias else 'not part'} of the weights); set "
                              f"--model.moe_balance={was} or start a new run")


# ------------------------------------------------------------------------------------------ saving
def _meta(engine, layout: str, extra: dict[str, Any] | None) -> dict[str, Any]:
    cfg = engine.cfg
    return {"format": CHECKPOINT_FORMAT, "layout": layout, "tier": cfg.model.tier, "vocab_size": engine.vocab_size,
            "seq_len": cfg.data.seq_len, "tie_embeddings": cfg.model.tie_embeddings, "world_size": engine.world_size,
            "parallel": engine.parallel, "counters": engine.counters(), "config": cfg.to_dict(), **(extra or {})}


def _rng_state(engine) -> dict[str, torch.Tensor]:
    rng = {"torch": torch.get_rng_state()}
    if engine.device.type == "cuda":
        rng["cuda"] = torch.cuda.get_rng_state(engine.device)
    return rng


def _set_rng_state(engine, rng: dict[str, torch.Tensor]) -> None:
    torch.set_rng_state(rng["torch"].cpu())
    if engine.device.type == "cuda" and "cuda" in rng:
        torch.cuda.set_rng_state(rng["cuda"].cpu(), engine.device)


def _publish(tmp: Path, directory: Path) -> None:
    if directory.exists():
        shutil.rmtree(directory)
    os.replace(tmp, directory)


def checkpoint_bytes(cfg, vocab_size: int) -> int:
    """About what one checkpoint of this model takes in storage, either layout: the fp32 weights (4 B a parameter),
    AdamW's two moments (8 B), and 64 KiB for headers, the RNG state and meta.json (nano: 1.74 MB against 1.70 MB
    written)."""
    from model.flops import param_count
    from pipeline.config import model_tier

    return 12 * param_count(model_tier(cfg), vocab_size, cfg.model.tie_embeddings) + (64 << 10)


def warn_if_no_room_for_checkpoints(cfg, vocab_size: int, location: str) -> str | None:
    """Before a run's first step: one warning line when the disk under `location` (where its checkpoints go) cannot
    hold train.keep_checkpoints + 1 of them (the new one is written before the oldest is removed), rather than the
    run finding out at step 5,000. Nothing on object storage (no free figure there)."""
    from pipeline.disk_space import CHECKPOINT_FIX, warn_if_no_room

    keep = cfg.train.keep_checkpoints
    return warn_if_no_room(location, checkpoint_bytes(cfg, vocab_size), keep + 1,
                           f"{keep} checkpoint(s) kept (train.keep_checkpoints) and the one being written",
                           CHECKPOINT_FIX)


def save(engine, directory: str | os.PathLike, extra: dict[str, Any] | None = None) -> Path:
    """Write the training state of `engine` (pipeline/train/engine.py's Engine) to `directory` atomically (module
    docstring): sharded under FSDP, where every worker must call it, else full (callers have rank 0 call it). A full
    disk ends it with pipeline/disk_space.py's one line (DiskFullError), the temporary directory removed: the
    checkpoints before it stay the newest complete ones."""
    from pipeline.disk_space import CHECKPOINT_FIX, one_line_when_full

    directory = Path(directory)
    with one_line_when_full(directory, "checkpoint", CHECKPOINT_FIX,
                            needed=checkpoint_bytes(engine.cfg, engine.vocab_size)):
        directory.parent.mkdir(parents=True, exist_ok=True)
        if engine.sharded:
            return _save_sharded(engine, directory, extra)
        return _save_full(engine, directory, extra)


def _save_full(engine, directory: Path, extra: dict[str, Any] | None) -> Path:
    from safetensors.torch import save_model

    tmp = Path(tempfile.mkdtemp(prefix=f".{directory.name}.tmp-", dir=directory.parent))
    try:
        save_model(engine.module.decoder, str(tmp / "model.safetensors"))
        torch.save({"optimizer": engine.optimizer.state_dict(), "scheduler": engine.scheduler.state_dict(),
                    "rng": _rng_state(engine)}, tmp / "train_state.pt")
        meta = {**_meta(engine, FULL, extra), "files": file_record(tmp)}  # what a complete copy holds
        (tmp / "meta.json").write_text(json.dumps(meta, indent=2, sort_keys=True))
        _publish(tmp, directory)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return directory


def _save_sharded(engine, directory: Path, extra: dict[str, Any] | None) -> Path:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    token = [uuid.uuid4().hex[:8] if engine.rank == 0 else None]
    dist.broadcast_object_list(token, src=0)  # one temporary name for all: shared storage sees one directory
    tmp = directory.parent / f".{directory.name}.tmp-{token[0]}"
    try:
        model_sd, optim_sd = get_state_dict(engine.module, engine.optimizer,
                                            options=StateDictOptions(flatten_optimizer_state_dict=True))
        state = {"model": model_sd, "optim": {k: v for k, v in optim_sd.items() if k.startswith("state.")},
                 "rng": _rng_state(engine)}
        if getattr(engine, "experts", None) is not None:  # split experts: saved in their whole (E, ...) shape, not split by experts
            state["model"] = engine.experts.to_global(state["model"], MODEL_PREFIX)
            state["optim"] = engine.experts.to_global(state["optim"], MODEL_PREFIX)
        dcp.save(state, storage_writer=dcp.FileSystemWriter(str(tmp / SHARDED_DIR)))
        # Every worker hashes the files it wrote (rank 0 also DCP's index); rank 0 records them all in meta.json.
        mine = [f"{SHARDED_DIR}/{p.name}" for p in (tmp / SHARDED_DIR).glob(f"__{engine.rank}_*.distcp")]
        if engine.rank == 0:
            mine.append(f"{SHARDED_DIR}/.metadata")
        records: list[dict | None] = [None] * engine.world_size
        dist.all_gather_object(records, file_record(tmp, mine))
        if engine.rank == 0:
            meta = _meta(engine, SHARDED, extra)
            meta["files"] = {k: v for r in records for k, v in (r or {}).items()}
            meta["scheduler"] = engine.scheduler.state_dict()  # plain numbers and lists: JSON, not a pickle
            (tmp / "meta.json").write_text(json.dumps(meta, indent=2, sort_keys=True))
        dist.barrier()
        if engine.rank == 0:
            _publish(tmp, directory)
        dist.barrier()
        if engine.rank != 0 and tmp.exists():  # this worker's own directory (not shared storage): publish it too
            _publish(tmp, directory)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return directory


# ------------------------------------------------------------------------------------------ loading
def load(engine, directory: str | os.PathLike, weights_only_model: bool = False,
         meta: dict[str, Any] | None = None) -> dict[str, Any]:
    """Restore what save() wrote, from either layout into either kind of engine; returns meta.json. Checks tier,
    vocabulary and model family first. Under FSDP every worker must call it.

    `directory` may be a location on object storage: a sharded checkpoint is then read in place, each worker
    fetching only the byte ranges of its own shards (meta.json's `read_bytes` and `shard_bytes` in the returned
    dict say how much of how much); a full one, which every worker needs whole, is copied to a temporary
    directory first. `meta`: what read_checkpoint_meta(directory) returned, when the caller has it already."""
    from pipeline.storage import is_local, local_copy

    meta = meta or read_checkpoint_meta(directory, weights_only=weights_only_model)
    check_checkpoint_fits(meta, engine.cfg.model.tier, engine.vocab_size, directory, mixer=engine.cfg.model.mixer)
    check_same_experts(meta, engine.cfg, directory)
    if meta["layout"] == SHARDED:
        _load_sharded(engine, str(directory), meta, weights_only_model)
    elif not is_local(str(directory)):
        with local_copy(directory) as local:
            return load(engine, local, weights_only_model, meta)
    elif getattr(engine, "experts", None) is not None:
        _load_full_into_split(engine, Path(directory), weights_only_model)
    elif engine.sharded:
        _load_full_into_sharded(engine, Path(directory), weights_only_model)
    else:
        _load_full(engine, Path(directory), weights_only_model)
    if not weights_only_model:
        c = meta["counters"]
        engine.step, engine.epoch, engine.cursor = c["step"], c["epoch"], c["cursor"]
        engine.tokens_seen, engine.phase = c["tokens_seen"], c.get("phase", 0)
        engine.bad_steps_in_row, engine.bad_steps_total = c["bad_steps_in_row"], c["bad_steps_total"]
        engine.spikes.load_state_dict(c.get("spikes"))  # the spike window, counts and the rows rewinds skipped
        # The cursor counts global sequences, so a resume on another worker count stays exact.
    return meta


def _check_keys(missing, unexpected, directory: Path) -> None:
    if missing or unexpected:
        raise CheckpointError(f"checkpoint {directory} does not match the model: missing {list(missing)[:3]}, "
                              f"unexpected {list(unexpected)[:3]}; was it written by another model version?")


def _load_full(engine, directory: Path, weights_only_model: bool) -> None:
    from safetensors.torch import load_model

    missing, unexpected = load_model(engine.module.decoder, str(directory / "model.safetensors"), strict=False)
    _check_keys(missing, unexpected, directory)
    if weights_only_model:
        return
    state = torch.load(directory / "train_state.pt", map_location=engine.device, weights_only=True)
    engine.optimizer.load_state_dict(state["optimizer"])
    engine.scheduler.load_state_dict(state["scheduler"])
    _set_rng_state(engine, state["rng"])


def _load_full_into_sharded(engine, directory: Path, weights_only_model: bool) -> None:
    """A one-process or DDP checkpoint resumed under FSDP: every worker reads the whole state and keeps its shards.
    train_state.pt numbers AdamW's tensors by position; the engine's parameter order names them."""
    from safetensors.torch import load_file
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, set_model_state_dict,
                                                         set_optimizer_state_dict)

    full = StateDictOptions(full_state_dict=True)
    weights = {MODEL_PREFIX + k: v for k, v in load_file(str(directory / "model.safetensors")).items()}
    _check_keys(*set_model_state_dict(engine.module, weights, options=full), directory)
    if weights_only_model:
        return
    state = torch.load(directory / "train_state.pt", map_location="cpu", weights_only=True)
    names, saved = engine.param_names, state["optimizer"]
    optim = {"state": {names[i]: s for i, s in saved["state"].items()},
             "param_groups": [{**g, "params": [names[i] for i in g["params"]]} for g in saved["param_groups"]]}
    set_optimizer_state_dict(engine.module, engine.optimizer, optim, options=full)
    engine.scheduler.load_state_dict(state["scheduler"])
    _set_rng_state(engine, state["rng"])


def _load_full_into_split(engine, directory: Path, weights_only_model: bool) -> None:
    """A full checkpoint (every expert in one tensor) resumed with split experts: every worker reads it whole and
    keeps its block of experts (of the weights and of AdamW's moments); the rest as for DDP or FSDP."""
    from safetensors.torch import load_file
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, set_model_state_dict,
                                                         set_optimizer_state_dict)

    ex = engine.experts
    weights = {k: (ex.block(v).clone() if k in ex.params else v)
               for k, v in load_file(str(directory / "model.safetensors")).items()}
    full = StateDictOptions(full_state_dict=True)
    if engine.parallel == "fsdp":
        _check_keys(*set_model_state_dict(engine.module, {MODEL_PREFIX + k: v for k, v in weights.items()},
                                          options=full), directory)
    else:
        _check_keys(*engine.module.decoder.load_state_dict(weights, strict=False), directory)
    if weights_only_model:
        return
    state = torch.load(directory / "train_state.pt", map_location="cpu", weights_only=True)
    names, saved = engine.param_names, state["optimizer"]
    for i, moments in saved["state"].items():
        if names[i][len(MODEL_PREFIX):] in ex.params:
            for key in ("exp_avg", "exp_avg_sq"):
                moments[key] = ex.block(moments[key]).clone()
    if engine.parallel == "fsdp":
        optim = {"state": {names[i]: s for i, s in saved["state"].items()},
                 "param_groups": [{**g, "params": [names[i] for i in g["params"]]} for g in saved["param_groups"]]}
        set_optimizer_state_dict(engine.module, engine.optimizer, optim, options=full)
    else:
        engine.optimizer.load_state_dict(saved)
    engine.scheduler.load_state_dict(state["scheduler"])
    _set_rng_state(engine, state["rng"])


def _dcp_load(state: dict[str, Any], reader, no_dist: bool) -> None:
    """dcp.load in place. With no_dist (one process reading a sharded checkpoint whole: eval, generate, export, or an
    unsharded run resuming one) DCP warns that torch.distributed is not initialised, which is the intent here."""
    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():
        if no_dist:
            warnings.filterwarnings("ignore", message=".*torch.distributed is disabled, unavailable or uninitialized",
                                    category=UserWarning)
        dcp.load(state, storage_reader=reader, no_dist=no_dist)


def _load_sharded(engine, directory: str, meta: dict[str, Any], weights_only_model: bool) -> None:
    """DCP fills templates shaped like this engine's own state (sharded under FSDP, whole tensors otherwise), so
    the worker count that wrote the checkpoint does not matter. Records in `meta` the bytes of shards this worker
    read (read_bytes) and their total (shard_bytes)."""
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict, get_state_dict,
                                                         set_state_dict)

    opts = StateDictOptions(flatten_optimizer_state_dict=True)
    reader = _safe_reader(_join(directory, SHARDED_DIR))
    ex = getattr(engine, "experts", None)  # split experts: read as whole-shape DTensors into this rank's blocks
    if weights_only_model:
        model_sd = get_model_state_dict(engine.module)
        # the whole-shape DTensors share the tensors of model_sd, which DCP fills in place
        _dcp_load({"model": ex.to_global(model_sd, MODEL_PREFIX) if ex is not None else model_sd}, reader,
                  no_dist=not engine.sharded)
        _check_keys(*engine.module.load_state_dict(model_sd, strict=False), directory)
        _count_read(meta, reader)
        return
    # For a fresh optimizer get_state_dict first creates AdamW's state (one step with zero gradients at lr 0,
    # which leaves the weights as they are), so there are tensors to read the saved moments into.
    model_sd, optim_sd = get_state_dict(engine.module, engine.optimizer, options=opts)
    state = {"model": model_sd, "optim": {k: v for k, v in optim_sd.items() if k.startswith("state.")},
             "rng": _rng_state(engine)}
    if ex is not None:  # whole-shape DTensors sharing the tensors of `state`, which DCP fills in place
        _dcp_load({**state, "model": ex.to_global(state["model"], MODEL_PREFIX),
                   "optim": ex.to_global(state["optim"], MODEL_PREFIX)}, reader, no_dist=False)
    else:
        _dcp_load(state, reader, no_dist=not engine.sharded)
    set_state_dict(engine.module, engine.optimizer, model_state_dict=state["model"],
                   optim_state_dict={**optim_sd, **state["optim"]}, options=opts)
    engine.scheduler.load_state_dict(meta["scheduler"])
    for group, lr in zip(engine.optimizer.param_groups, engine.scheduler.get_last_lr()):
        group["lr"] = lr  # what the last scheduler step set (the template's groups start at the base lr)
    _set_rng_state(engine, state["rng"])
    _count_read(meta, reader)


def _count_read(meta: dict[str, Any], reader) -> None:
    meta["read_bytes"] = reader.bytes_read  # 0 on a local disk, where DCP reads the files itself
    meta["shard_bytes"] = sum(info.length for info in reader.storage_data.values())


def load_model_state(directory: str | os.PathLike, meta: dict[str, Any] | None = None) -> dict[str, torch.Tensor]:
    """The decoder's whole state dict (CPU tensors, the names model.safetensors uses) from a checkpoint of either
    layout, in this process without a process group: a sharded checkpoint is consolidated on load, its tensors
    sized from its metadata."""
    directory = Path(directory)
    meta = meta or read_checkpoint_meta(directory, weights_only=True)
    if meta["layout"] == FULL:
        from safetensors.torch import load_file

        return load_file(str(directory / "model.safetensors"))
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    reader = _safe_reader(directory / SHARDED_DIR)
    prefix = f"model.{MODEL_PREFIX}"
    template = {fqn[len("model."):]: torch.empty(md.size, dtype=md.properties.dtype)
                for fqn, md in reader.read_metadata().state_dict_metadata.items()
                if fqn.startswith(prefix) and isinstance(md, TensorStorageMetadata)}
    if not template:
        raise CheckpointError(f"checkpoint {directory} holds no model weights; use another checkpoint")
    _dcp_load({"model": template}, reader, no_dist=True)
    return {k[len(MODEL_PREFIX):]: v for k, v in template.items()}


def load_decoder_weights(decoder: torch.nn.Module, directory: str | os.PathLike,
                         meta: dict[str, Any] | None = None) -> None:
    """Load a checkpoint's weights (either layout) into a plain, unsharded decoder; CheckpointError on a mismatch."""
    state = load_model_state(directory, meta)
    _check_keys(*decoder.load_state_dict(state, strict=False), Path(directory))
