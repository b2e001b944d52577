"""The data commands behind `python pipeline/run.py prepare ...` and `python pipeline/run.py validate DIR`.

    python pipeline/run.py prepare --data.source=files --data.path=corpus/ --data.seq_len=2048
    python pipeline/run.py validate runs/datasets/<hash>       # or s3://bucket/longtrain/datasets/<hash>
    python pipeline/run.py prepare --data.mixture=mixes/web_code.yaml  # each source, one shared tokenizer

run.py calls `prepare_main(cfg) -> Path` and `validate_main(dataset_dir) -> int` (the exit code). The same
commands also run standalone: `python -m pipeline.data.stages prepare [PRESET] [--field.path=value ...]` and
`python -m pipeline.data.stages validate DIR`. User errors print one line and exit 2; an invalid dataset exits 1.
"""
from __future__ import annotations

import logging
import sys
import time
from pathlib import Path

from pipeline.console import quiet_ray_data, stage
from pipeline.data.dedup import mixture_dedup_line, summary_line
from pipeline.data.shards import Manifest, load_manifest, tokenizer_location
from pipeline.data.validate_dataset import validate_dataset

log = logging.getLogger("longtrain.data")


class _StderrHandler(logging.StreamHandler):
    """Writes to whatever sys.stderr is when it emits, not the one it was created with (which a caller that
    redirects stderr, such as pytest's capture, may have closed since)."""

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, value) -> None:
        pass


def _quiet_logging() -> None:
    """Our INFO lines, and Ray Data's progress bars in a terminal; Ray's own chatter at WARNING."""
    quiet_ray_data()
    if not log.handlers:
        handler = _StderrHandler()
        handler.setFormatter(logging.Formatter("[data] %(message)s"))
        log.addHandler(handler)
        log.setLevel(logging.INFO)
        log.propagate = False
    for name in ("ray", "ray.data", "ray._private"):
        logging.getLogger(name).setLevel(logging.WARNING)


def prepare_main(cfg) -> Path:
    """Build (or reuse) the dataset for cfg.data and print a summary; returns the dataset directory.

    Raises DataSourceError / TokenizerError / DatasetError (all ValueError) with a one-line message."""
    return prepared(cfg)[0]


def prepared(cfg) -> tuple[Path | str, Manifest]:
    """prepare_main's work, returning the dataset directory and its manifest as read once here, for the command to
    hand on (training reads no manifest.json of its own)."""
    from pipeline.data.pack import prepare_dataset

    _quiet_logging()
    d = cfg.data
    if d.mixture:
        return _prepare_mixture_main(cfg)
    source = {"builtin": "built-in corpus", "files": f"files {d.path}", "hf": f"Hugging Face {d.hf_name}"}.get(
        d.source, d.source)
    stage("prepare", f"{source}, seq_len {d.seq_len}, vocab {header_vocab(d)}")
    t0 = time.time()
    out, m = prepare_dataset(cfg)
    c = m.counts
    print(f"dataset {out}  ({time.time() - t0:.1f} s)\n"
          f"  {c['sequences']:,} sequences of {m.seq_len}+1 tokens: train {m.rows('train'):,}, val {m.rows('val'):,}"
          f"  ({len(m.shards['train'])} + {len(m.shards['val'])} shards)\n"
          f"  {c['documents']:,} documents, {c['tokens_total']:,} tokens, packing efficiency "
          f"{m.packing_efficiency:.4%}; dropped {c['dropped_empty']:,} empty, replaced "
          f"{c['replaced_invalid_utf8']:,} invalid UTF-8; skipped {c.get('bad_records', 0):,} unreadable records"
          f"{_bad_files_line(m)}\n"
          f"  tokenizer {m.tokenizer_file} vocab {m.vocab_size} sha256 {m.tokenizer_sha256[:16]}"
          f"{_skipped_line(d)}\n"
          f"  {summary_line(m.dedup)}")
    return out, m


def _prepare_mixture_main(cfg) -> tuple[Path | str, Manifest]:
    """prepare_main for data.mixture: every source (cached each by its own hash), a summary line per source."""
    from pipeline.data.mixture_prepare import prepare_mixture, source_config
    from pipeline.mixture_spec import normalized, parse_mixture

    d = cfg.data
    specs = parse_mixture(d.mixture)
    stage("prepare", f"mixture of {len(specs)} source(s): "
                     + ", ".join(f"{s.name} {w:.1%}" for s, w in zip(specs, normalized(specs)))
                     + f"; seq_len {d.seq_len}, vocab {header_vocab(d)}")
    t0 = time.time()
    out = prepare_mixture(cfg)
    m = load_manifest(out)
    print(f"mixture {out}  ({time.time() - t0:.1f} s)")
    where = {src["name"]: src["dataset_dir"] for src in m.source["sources"]}
    for spec, w in zip(specs, normalized(specs)):
        sm = load_manifest(where[spec.name])
        print(f"  {spec.name:<12} weight {w:6.1%}  {sm.rows('train'):,} train + "
              f"{sm.rows('val'):,} val rows of {sm.seq_len}+1 ({sm.counts.get('tokens_kept', 0):,} tokens, "
              f"{sm.counts.get('documents', 0):,} documents{_removed(sm.dedup)})  {where[spec.name]}"
              f"{_skipped_line(source_config(cfg, spec).data, '    ', _field(spec)) if not spec.dataset_dir else ''}")
    if m.dedup:
        print(f"  {mixture_dedup_line(m.dedup)}")
    if m.tokenizer_file:
        print(f"  tokenizer vocab {m.vocab_size} sha256 {m.tokenizer_sha256[:16]}; to keep it (and every prepared "
              f"source) when the weights change: --data.tokenizer={tokenizer_location(out, m)}")
    else:  # synthetic sources are token ids without a tokenizer file: there is none to keep
        print(f"  no tokenizer file (synthetic sources, vocab {m.vocab_size})")
    return out, m


def header_vocab(d) -> str:
    """The vocabulary the prepare will have: data.tokenizer's own size when one is given (data.vocab_size is then
    unused), else data.vocab_size, the size of the tokenizer it trains. A tokenizer that cannot be read is left to
    the prepare's own one-line error."""
    from pipeline.data.tokenizer import Tokenizer, TokenizerError
    from pipeline.storage import StorageError

    if not d.tokenizer:
        return str(d.vocab_size)
    try:
        return f"{Tokenizer(d.tokenizer).vocab_size} (data.tokenizer)"
    except (TokenizerError, StorageError, OSError):
        return "of data.tokenizer"


def _removed(record: dict) -> str:
    """`; 1,234 duplicates removed` of a source's manifest `dedup`."""
    if not record:
        return ""
    return f"; {record['removed_exact'] + record['removed_near']:,} duplicates removed"


def _field(spec) -> str:
    """How a mixture source's path is named: by the field it set (`path`), or data.path when it took that one."""
    return "path" if "path" in dict(spec.fields) else "data.path"


def _skipped_line(d, indent: str = "  ", field: str = "data.path") -> str:
    """`\n  skipped 2 file(s) of data.path='corpus/' of a type it does not read: notes.md, old.jsonl.xz (...)` when
    the corpus directory holds files of a type not read (compressed .txt/.jsonl/.json are read): none left out unsaid."""
    from pipeline.data.corpus import READS, skipped_files
    from pipeline.mixture_spec import SOURCE_KIND_FIELDS

    if "path" not in SOURCE_KIND_FIELDS.get(d.source, ()) or not d.path:
        return ""
    skipped = skipped_files(d.path)
    if not skipped:
        return ""
    base = d.path.rstrip("/") + "/"
    names = ", ".join(f[len(base):] if f.startswith(base) else f for f in skipped)  # every one, by its name inside
    return (f"\n{indent}skipped {len(skipped)} file(s) of {field}={d.path!r} of a type it does not read: {names} "
            f"(it reads {READS})")


def _bad_files_line(m) -> str:
    """` (a.jsonl: 2, b.jsonl: 1; first: ...)` when records were skipped: the user sees where, at once."""
    if not m.bad_records:
        return ""
    files = sorted(m.bad_records.items(), key=lambda kv: -kv[1]["count"])
    listed = ", ".join(f"{Path(f).name}: {b['count']:,}" for f, b in files[:5]) + (", ..." if len(files) > 5 else "")
    return f" ({listed}; first: {next(iter(m.bad_records.values()))['first']})"


def validate_main(dataset_dir: str | Path) -> int:
    """Print the validation report; 0 when the dataset is valid, 1 with the reasons otherwise. A mixture: every
    source's report, and whether they share one tokenizer and one seq_len."""
    from pipeline.data.mixture import is_mixture
    from pipeline.data.mixture_prepare import validate_mixture
    from pipeline.data.shards import DatasetError

    try:
        mixture = is_mixture(load_manifest(dataset_dir))
    except DatasetError:
        mixture = False  # validate_dataset reports it
    report = validate_mixture(dataset_dir) if mixture else validate_dataset(dataset_dir)
    print(report.format())
    return 0 if report.ok else 1


def main(argv: list[str] | None = None) -> int:
    from pipeline.config import ConfigError, load_config

    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in ("prepare", "validate"):
        print(__doc__.strip().splitlines()[0] + "\nusage: python -m pipeline.data.stages prepare [PRESET] "
              "[--field=value ...] | validate DIR", file=sys.stderr)
        return 2
    try:
        if argv[0] == "validate":
            if len(argv) != 2:
                print("usage: python -m pipeline.data.stages validate DIR", file=sys.stderr)
                return 2
            return validate_main(argv[1])
        rest = argv[1:]
        preset = rest.pop(0) if rest and not rest[0].startswith("--") else None
        prepare_main(load_config(preset, rest))
        return 0
    except (ConfigError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
