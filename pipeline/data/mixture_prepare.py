"""Prepare and validate a mixture: one shared tokenizer, then each source as its own cached dataset.

    from pipeline.data.mixture_prepare import prepare_mixture, validate_mixture
    mixture_dir = prepare_mixture(cfg)        # cfg.data.mixture set; <data.dataset_store>/<hash> of the mixture
    report = validate_mixture(mixture_dir)    # every source dataset valid, one tokenizer, one seq_len

1. The tokenizer: data.tokenizer when given; else the one of a source given as a prepared dataset (`dataset_dir`);
   else a SentencePiece model trained on a weight-proportional sample of the weighted sources (source i gives
   w_i x data.tokenizer_sample_bytes of its text, in source order), cached under
   <data.dataset_store>/tokenizers/<hash of the sources, weights and vocab settings>/tokenizer.model. A trained
   tokenizer follows the weights; `prepare` prints the --data.tokenizer that keeps it when they change.
   A mixture of one source trains its tokenizer inside its dataset, as the flat config does (the same dataset).
2. Each source is the flat config with the source's fields and that tokenizer: pipeline/data/pack.py's prepare,
   so it is cached by its own content hash plus the tokenizer's (the same dataset a flat config of that source and
   tokenizer names). Adding a source or changing a weight re-tokenizes nothing already prepared. The sources that
   are not cached yet are prepared at the same time, each Ray Data pipeline on its share of the tokenizer actors
   (data.tokenize_actors or one per core, split between them): the same actors, one after another or side by
   side, so no more CPU-seconds than one source after another.
3. The mixture directory: <data.dataset_store>/<hash of the sources' dataset hashes and the tokenizer> (or
   data.dataset_dir), holding a copy of the tokenizer and a manifest.json with source.kind = "mixture" that names
   every source's dataset. No weights: those come from data.mixture when training (pipeline/data/mixture.py).
Sources of different tokenizers or row lengths (prepared datasets given by dataset_dir) are refused, in one line.
"""
from __future__ import annotations

import contextlib
import json
import logging
import re
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Iterator

from pipeline.data.mixture import MIXTURE_KIND, MixtureError, is_mixture
from pipeline.mixture_spec import SOURCE_FIELDS, SourceSpec, normalized, parse_mixture
from pipeline.data.shards import SCHEMA_VERSION, TOKENIZER_FILE, DatasetError, Manifest, load_manifest, write_manifest
from pipeline.storage import absolute, dataset_store, exists, join, read_bytes, write_bytes

if TYPE_CHECKING:
    from pipeline.config import Config

log = logging.getLogger("longtrain.data")
TOKENIZERS_DIR = "tokenizers"


def source_config(cfg: "Config", spec: SourceSpec, tokenizer: str = "", actors: int | None = None) -> "Config":
    """The flat config of one source: the mixture's data.* with the source's own fields."""
    over = {**spec.overrides(), "data.mixture": "", "data.dataset_dir": "", "data.tokenizer": tokenizer}
    if actors is not None and not cfg.data.tokenize_actors:
        over["data.tokenize_actors"] = actors
    return cfg.replace(over)


@contextlib.contextmanager
def about(spec: SourceSpec) -> Iterator[None]:
    """A corpus or storage error raised while reading one source names that source, and the source's own fields by
    the names the user wrote them with (`path=...`, not `data.path=...`, which the user did not set). A field the
    source leaves to data.* keeps its data.* name: that is where its value came from."""
    from pipeline.data.corpus import DataSourceError
    from pipeline.storage import StorageError

    try:
        yield
    except (DataSourceError, StorageError) as exc:
        label = f"data.mixture source {spec.name!r}"
        text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        if text.startswith(label):
            raise
        own = "|".join(re.escape(k) for k, _ in spec.fields if k in SOURCE_FIELDS)
        if own:
            text = re.sub(rf"\bdata\.({own})\b", r"\1", text)
        raise type(exc)(f"{label}: {text}") from None


def shared_tokenizer(cfg: "Config", specs: list[SourceSpec]) -> str:
    """The tokenizer every source is tokenized with (module docstring, 1.): a path or a URI."""
    import sentencepiece

    from pipeline.data.corpus import describe_source
    from pipeline.data.pack import settings_hash

    d = cfg.data
    if d.tokenizer:
        return absolute(d.tokenizer)
    given = [s for s in specs if s.dataset_dir]
    if given:  # (a synthetic dataset has none: then every source must be a prepared dataset)
        where = absolute(given[0].dataset_dir)
        m = load_manifest(where)
        return join(where, m.tokenizer_file) if m.tokenizer_file else ""
    weighted = [(s, w) for s, w in zip(specs, normalized(specs)) if w > 0]
    described = []
    for s, _ in weighted:
        with about(s):
            described.append(describe_source(source_config(cfg, s).data))
    settings = {"sources": described,
                "weights": [round(w, 12) for _, w in weighted], "vocab_size": d.vocab_size,
                "sample_bytes": d.tokenizer_sample_bytes, "recipe": "bpe+byte_fallback+identity",
                "sentencepiece": sentencepiece.__version__}
    location = join(dataset_store(cfg), TOKENIZERS_DIR, settings_hash(settings)[:16], TOKENIZER_FILE)
    if exists(location):  # written in one piece (storage.write_bytes): present means complete
        log.info("reusing the mixture's tokenizer %s", location)
        return location
    from pipeline.data.corpus import read_documents, sample_texts
    from pipeline.data.tokenizer import train_tokenizer
    from pipeline.ray_runtime import ensure_ray

    ensure_ray(cfg.ray.address or None, cfg)
    log.info("training a %d-piece tokenizer on a weight-proportional sample of %d sources (%s)", d.vocab_size,
             len(weighted), ", ".join(f"{s.name} {w:.0%}" for s, w in weighted))

    def sample() -> Iterator[str]:
        for spec, w in weighted:
            scfg = source_config(cfg, spec).data
            with about(spec):
                yield from sample_texts(read_documents(scfg), max(1, int(d.tokenizer_sample_bytes * w)),
                                        scfg.on_bad_record)

    write_bytes(join(location + ".json"), json.dumps(settings, indent=2).encode())  # what it was trained on
    train_tokenizer(sample(), d.vocab_size, location)
    return location


def dedup_priorities(cfg: "Config", specs: list[SourceSpec]) -> list[SourceSpec]:
    """The sources deduplicated together (all but those given as prepared datasets), in the order that keeps a shared
    document: data.dedup_keep=first, as listed in data.mixture; weight, the heaviest first (ties as listed)."""
    members = [s for s in specs if not s.dataset_dir]
    if cfg.data.dedup_keep == "weight":
        members = sorted(members, key=lambda s: -s.weight)  # stable: ties keep the listed order
    return members


def dedup_groups(cfg: "Config", specs: list[SourceSpec]) -> dict[str, dict]:
    """name -> the part of each source's cache key that deduplication across the sources adds: every member's
    description in priority order and this source's priority (its kept documents depend on all of them). Empty when
    the sources are not deduplicated together (data.dedup=none, or one source to read)."""
    from pipeline.data.corpus import describe_source

    members = dedup_priorities(cfg, specs)
    if cfg.data.dedup == "none" or len(members) < 2:
        return {}
    described = []
    for s in members:
        with about(s):
            described.append([s.name, describe_source(source_config(cfg, s).data)])
    return {s.name: {"sources": described, "keep": cfg.data.dedup_keep, "priority": i} for i, s in enumerate(members)}


def _prepare_sources(cfg: "Config", specs: list[SourceSpec], tokenizer: str) -> dict[str, str]:
    """name -> dataset directory of every source; those not cached yet are built side by side (after the
    deduplication of all the sources together, when data.dedup is on)."""
    from pipeline.data.pack import dataset_location, dataset_settings, prepare, reusable, settings_hash

    out: dict[str, str] = {}
    todo: list[SourceSpec] = []
    groups = dedup_groups(cfg, specs)
    for spec in specs:
        if spec.dataset_dir:
            out[spec.name] = absolute(spec.dataset_dir)
            continue
        scfg = source_config(cfg, spec, tokenizer)
        with about(spec):
            key = settings_hash(dataset_settings(scfg, groups.get(spec.name)))
        where = dataset_location(scfg, key)
        if reusable(where, key) is not None:
            out[spec.name] = where
        else:
            todo.append(spec)
    if todo:
        from pipeline.data.pack import default_actor_count
        from pipeline.ray_runtime import ensure_ray

        ensure_ray(cfg.ray.address or None, cfg)
        found = {}
        if groups:  # every source is read (a cached one's documents still decide what the others keep)
            from pipeline.data.dedup import GroupSource, dedup_spec, deduplicate

            members = dedup_priorities(cfg, specs)
            log.info("deduplicating %d sources together (%s keeps a shared document)", len(members),
                     " > ".join(s.name for s in members))
            result = deduplicate([GroupSource(s.name, source_config(cfg, s, tokenizer).data, i)
                                  for i, s in enumerate(members)], dedup_spec(cfg.data))
            found = {s.name: (lambda p=i: (result.removal(p), result.record(p))) for i, s in enumerate(members)}
        actors = cfg.data.tokenize_actors or default_actor_count()
        side_by_side = max(1, min(len(todo), actors))
        each = max(1, actors // side_by_side)
        log.info("preparing %d source(s) (%s), %d at a time with %d tokenizer actor(s) each", len(todo),
                 ", ".join(s.name for s in todo), side_by_side, each)
        with ThreadPoolExecutor(max_workers=side_by_side, thread_name_prefix="prepare-source") as pool:
            futures = {s.name: (s, pool.submit(prepare, source_config(cfg, s, tokenizer, each),
                                               dedup_group=groups.get(s.name), dedup=found.get(s.name)))
                       for s in todo}
            for name, (spec, fut) in futures.items():
                with about(spec):
                    out[name] = absolute(fut.result())
    return out


def mixture_dedup(specs: list[SourceSpec], manifests: dict[str, Manifest]) -> dict:
    """The mixture manifest's `dedup`: each source's counts and, per pair of sources, the documents they shared (a
    cluster of duplicates holding documents of both: counted by the documents removed from either)."""
    records = {s.name: manifests[s.name].dedup for s in specs if manifests[s.name].dedup}
    if not records:
        return {}
    first = next(iter(records.values()))
    keys = ("documents_read", "removed_exact", "removed_near", "removed_as_copies_of_other_sources", "kept",
            "clusters_exact", "clusters_near")
    names = sorted(records)
    shared = [{"sources": [a, b], "documents": int(records[a].get("shared_with", {}).get(b, 0))}
              for i, a in enumerate(names) for b in names[i + 1:]]
    settings = {k: v for k, v in first.items() if k not in keys and k not in ("shared_with", "group", "seconds",
                                                                              "stage_seconds")}
    return {**settings, "sources": {n: {k: r.get(k, 0) for k in keys} for n, r in records.items()}, "shared": shared}


def prepare_mixture(cfg: "Config") -> Path | str:
    """Build (or reuse) every source of cfg.data.mixture and the mixture directory naming them; returns it (a Path on
    this machine, else its URI)."""
    from pipeline.data.pack import dataset_location, prepare, reusable, settings_hash
    from pipeline.storage import is_uri

    specs = parse_mixture(cfg.data.mixture)
    if len(specs) == 1 and not specs[0].dataset_dir:  # a mixture of one: the flat config's own dataset
        with about(specs[0]):
            datasets = {specs[0].name: absolute(prepare(source_config(cfg, specs[0], cfg.data.tokenizer)))}
    else:
        datasets = _prepare_sources(cfg, specs, shared_tokenizer(cfg, specs))
    manifests = {name: load_manifest(where) for name, where in datasets.items()}
    first = manifests[specs[0].name]
    for spec in specs:
        m = manifests[spec.name]
        if m.seq_len != first.seq_len or m.tokenizer_sha256 != first.tokenizer_sha256:
            raise MixtureError(
                f"data.mixture source {spec.name!r} ({datasets[spec.name]}) has seq_len {m.seq_len} and tokenizer "
                f"{m.tokenizer_sha256[:12]}, source {specs[0].name!r} {first.seq_len} and "
                f"{first.tokenizer_sha256[:12]}: the sources of a mixture share one tokenizer and one row length; "
                "prepare them with the same data.tokenizer and data.seq_len")
    settings = {"kind": MIXTURE_KIND, "schema_version": SCHEMA_VERSION, "tokenizer_sha256": first.tokenizer_sha256,
                "sources": sorted([s.name, manifests[s.name].settings_hash] for s in specs)}
    key = settings_hash(settings)
    out = dataset_location(cfg, key)
    if reusable(out, key) is None:
        if first.tokenizer_file:  # a copy: the mixture directory is read like any dataset for its tokenizer
            write_bytes(join(out, TOKENIZER_FILE), read_bytes(join(datasets[specs[0].name], first.tokenizer_file)))
        write_manifest(out, _manifest(settings, key, specs, datasets, manifests))  # last: now it is a mixture
    log.info("mixture ready: %s", out)
    return out if is_uri(out) else Path(out)


def _manifest(settings: dict, key: str, specs: list[SourceSpec], datasets: dict[str, str],
              manifests: dict[str, Manifest]) -> Manifest:
    first = manifests[specs[0].name]
    total = {k: sum(int(m.counts.get(k, 0)) for m in manifests.values())
             for k in ("documents", "tokens_total", "tokens_kept", "sequences", "dropped_empty", "bad_records")}
    sources = [{"name": s.name, "dataset_dir": datasets[s.name], "settings_hash": manifests[s.name].settings_hash,
                "rows": {"train": manifests[s.name].rows("train"), "val": manifests[s.name].rows("val")},
                "source": manifests[s.name].source} for s in sorted(specs, key=lambda s: s.name)]
    return Manifest(
        schema_version=SCHEMA_VERSION, seq_len=first.seq_len, vocab_size=first.vocab_size, pad_id=first.pad_id,
        unk_id=first.unk_id, bos_id=first.bos_id, eos_id=first.eos_id, token_type=first.token_type,
        tokenizer_file=TOKENIZER_FILE if first.tokenizer_file else "", tokenizer_sha256=first.tokenizer_sha256,
        settings_hash=key,
        source={"kind": MIXTURE_KIND, "sources": sources}, settings=settings, counts=total,
        packing_efficiency=total["tokens_kept"] / max(1, total["tokens_total"]),
        remainder_policy="per source: " + first.remainder_policy, doc_length={}, shards={"train": [], "val": []},
        created=time.strftime("%Y-%m-%dT%H:%M:%S%z"), dedup=mixture_dedup(specs, manifests))


# ---------------------------------------------------------------------------------------- validation
@dataclass
class MixtureReport:
    dataset_dir: str
    reports: dict[str, object] = field(default_factory=dict)  # source name -> pipeline.data.validate_dataset's report
    errors: list[str] = field(default_factory=list)  # of the mixture itself

    @property
    def ok(self) -> bool:
        return not self.errors and all(r.ok for r in self.reports.values())

    def format(self) -> str:
        lines = [f"mixture {self.dataset_dir}: {len(self.reports)} sources"]
        for name, r in self.reports.items():
            lines.append(f"source {name}: " + r.format())
        if self.errors:
            lines.append("  mixture INVALID:\n" + "\n".join(f"    - {e}" for e in self.errors))
        lines.append("  OK (every source valid, one tokenizer, one seq_len)" if self.ok else "  INVALID")
        return "\n".join(lines)


def validate_mixture(dataset_dir: str | Path) -> MixtureReport:
    """Validate every source dataset of a mixture directory and that they share one tokenizer and one seq_len."""
    from pipeline.data.tokenizer import file_sha256
    from pipeline.data.validate_dataset import validate_dataset

    dataset_dir = absolute(dataset_dir)
    m = load_manifest(dataset_dir)
    if not is_mixture(m):
        raise DatasetError(f"{dataset_dir!r} is one dataset, not a mixture")
    report = MixtureReport(dataset_dir)
    try:
        sha = file_sha256(join(dataset_dir, m.tokenizer_file)) if m.tokenizer_file else m.tokenizer_sha256
        if sha != m.tokenizer_sha256:
            report.errors.append(f"{m.tokenizer_file} sha256 {sha[:12]}... is not the mixture's "
                                 f"{m.tokenizer_sha256[:12]}...: prepare the mixture again")
    except FileNotFoundError:
        report.errors.append(f"{m.tokenizer_file} is missing: prepare the mixture again")
    for src in m.source["sources"]:
        r = validate_dataset(src["dataset_dir"])
        report.reports[src["name"]] = r
        try:
            sm = load_manifest(src["dataset_dir"])
        except DatasetError:
            continue  # the source's own report says why
        if sm.settings_hash != src["settings_hash"]:
            report.errors.append(f"source {src['name']!r}: {src['dataset_dir']} now holds another dataset (settings "
                                 f"hash {sm.settings_hash[:16]}, the mixture names {src['settings_hash'][:16]}): "
                                 "prepare the mixture again")
        if sm.tokenizer_sha256 != m.tokenizer_sha256 or sm.seq_len != m.seq_len:
            report.errors.append(f"source {src['name']!r} has tokenizer {sm.tokenizer_sha256[:12]} and seq_len "
                                 f"{sm.seq_len}, the mixture {m.tokenizer_sha256[:12]} and {m.seq_len}: the sources "
                                 "must share one tokenizer and one row length")
    return report
