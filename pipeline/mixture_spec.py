"""`data.mixture`: named sources blended by token share, parsed and checked when the config is validated.

    from pipeline.mixture_spec import parse_mixture
    sources = parse_mixture("mixes/web_code.yaml")          # a YAML file holding a list, or the list inline:
    sources = parse_mixture('[{name: web, weight: 0.7, source: files, path: "web/*.jsonl"},'
                            ' {name: code, weight: 0.3, source: hf, hf_name: bigcode/the-stack-smol}]')

Each source is a mapping: `name` (letters, digits, `_ . -`; it names the source's metrics, `val/<name>/loss`),
`weight` (>= 0: its share of the training stream's tokens; the weights are normalized to sum to 1; 0 = evaluated,
never trained on), `max_repetitions` (default 4: passes over its training split the run may make), and what the
source reads, with the names of the data.* fields: `source` (builtin | files | hf), `path`, `text_column`,
`hf_name`, `hf_config`, `hf_split`, `hf_streaming`, `max_documents`, `on_bad_record`, `max_bad_fraction` (which of
them each source kind reads: SOURCE_KIND_FIELDS, the table the unused-settings check reads too); a field a source
leaves out comes from data.* (so `--data.max_documents=1000` applies to every source that sets none). A source may
instead be a dataset prepared before: `dataset_dir: runs/datasets/<hash>`. The sources share one tokenizer, row
length and split (data.tokenizer, data.vocab_size, data.seq_len, data.val_fraction, ...): those fields belong to the
whole mixture, and a source that sets one is refused.

Errors are MixtureSpecError (a ValueError) with one line naming the source and the field; pipeline/config.py turns
them into ConfigError. Imports nothing from the project (config.py imports this module).
"""
from __future__ import annotations

import functools
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

DEFAULT_MAX_REPETITIONS = 4.0
SOURCE_KINDS = ("builtin", "files", "hf")
# The data.* fields that only some source kinds read, by kind (every kind reads the others: max_documents,
# on_bad_record, max_bad_fraction, ...). The one rule the data room (pipeline/data/) and the unused-settings check
# (pipeline/cli/unused_settings.py: a field the source does not read is refused) both read.
SOURCE_KIND_FIELDS: dict[str, tuple[str, ...]] = {
    "builtin": (),
    "files": ("path", "text_column"),
    "hf": ("path", "text_column", "hf_name", "hf_config", "hf_split", "hf_streaming"),
}
# The same by field: field -> the kinds that read it.
FIELD_SOURCE_KINDS: dict[str, tuple[str, ...]] = {
    f: tuple(k for k in SOURCE_KINDS if f in SOURCE_KIND_FIELDS[k]) for fields in SOURCE_KIND_FIELDS.values()
    for f in fields}
# What a source may set, with the type of the data.* field of the same name.
SOURCE_FIELDS: dict[str, type] = {"source": str, "path": str, "text_column": str, "hf_name": str, "hf_config": str,
                                  "hf_split": str, "hf_streaming": bool, "max_documents": int,
                                  "on_bad_record": str, "max_bad_fraction": float}
KEYS = ("name", "weight", "max_repetitions", "dataset_dir", *SOURCE_FIELDS)
# Fields of the whole mixture: one tokenizer, one row length, one split for all sources.
SHARED_FIELDS = ("tokenizer", "vocab_size", "seq_len", "val_fraction", "rows_per_shard", "split_seed",
                 "tokenizer_sample_bytes", "min_rows", "dataset_store", "dedup", "dedup_threshold", "dedup_ngram",
                 "dedup_keep")
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
_EXAMPLE = "[{name: web, weight: 0.7, source: files, path: 'web/*.jsonl'}, {name: code, weight: 0.3, ...}]"


class MixtureSpecError(ValueError):
    """data.mixture is invalid; the message names the source and the field."""


@dataclass(frozen=True)
class SourceSpec:
    """One named source of a mixture, as the user wrote it (weights not yet normalized)."""

    name: str
    weight: float
    max_repetitions: float = DEFAULT_MAX_REPETITIONS
    dataset_dir: str = ""  # an already prepared dataset; the fields below are then not used
    fields: tuple[tuple[str, Any], ...] = ()  # the data.* fields this source sets, in SOURCE_FIELDS order

    def overrides(self) -> dict[str, Any]:
        """{"data.source": "files", "data.path": ...}: what this source changes in the config's data section."""
        return {f"data.{k}": v for k, v in self.fields}

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"name": self.name, "weight": self.weight}
        if self.max_repetitions != DEFAULT_MAX_REPETITIONS:
            out["max_repetitions"] = self.max_repetitions
        if self.dataset_dir:
            out["dataset_dir"] = self.dataset_dir
        out.update(self.fields)
        return out


def mixture_json(sources: list[SourceSpec]) -> str:
    """The inline form of a mixture (what a run records and ships to its workers: no file to find there)."""
    return json.dumps([s.to_dict() for s in sources], separators=(",", ":"))


def with_weights(sources: list[SourceSpec], weights: dict[str, float]) -> list[SourceSpec]:
    """The same sources with new weights (by name; a source not named gets 0)."""
    unknown = sorted(set(weights) - {s.name for s in sources})
    if unknown:
        raise MixtureSpecError(f"weights for {unknown}, which the mixture does not have; its sources: "
                               f"{', '.join(s.name for s in sources)}")
    return [SourceSpec(s.name, float(weights.get(s.name, 0.0)), s.max_repetitions, s.dataset_dir, s.fields)
            for s in sources]


def parse_mixture(text: str) -> list[SourceSpec]:
    """The sources of `text` (a YAML/JSON file path, or the list inline); MixtureSpecError when invalid."""
    text = text.strip()
    if text.startswith(("[", "{", "-")) or "\n" in text:
        return list(_parse_inline(text))
    path = Path(text).expanduser()
    try:
        mtime = path.stat().st_mtime_ns
    except OSError:
        raise MixtureSpecError(f"data.mixture={text!r}: no such file; give a YAML file holding a list of sources or "
                               f"the list inline, e.g. {_EXAMPLE}") from None
    return list(_parse_file(str(path.resolve()), mtime))


@functools.lru_cache(maxsize=64)  # a config is validated on every replace(): parse each text once
def _parse_inline(text: str) -> tuple[SourceSpec, ...]:
    return _parse_doc(_load_yaml(text, "data.mixture"), "data.mixture")


@functools.lru_cache(maxsize=64)
def _parse_file(path: str, mtime_ns: int) -> tuple[SourceSpec, ...]:
    try:
        text = Path(path).read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise MixtureSpecError(f"data.mixture file {path!r} cannot be read ({exc})") from None
    return _parse_doc(_load_yaml(text, f"data.mixture file {path!r}"), f"data.mixture file {path!r}")


def _load_yaml(text: str, where: str) -> Any:
    import yaml

    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise MixtureSpecError(f"{where} is not valid YAML/JSON ({str(exc).splitlines()[0]})") from None


def _parse_doc(doc: Any, where: str) -> tuple[SourceSpec, ...]:
    if isinstance(doc, dict) and set(doc) == {"sources"}:  # `sources: [...]` in a file reads as well
        doc = doc["sources"]
    if not isinstance(doc, list) or not doc:
        raise MixtureSpecError(f"{where} must be a non-empty list of sources, e.g. {_EXAMPLE}")
    sources = [_source(item, i, where) for i, item in enumerate(doc)]
    names = [s.name for s in sources]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise MixtureSpecError(f"{where}: source name {dup[0]!r} is used twice; each source needs its own name")
    if not any(s.weight > 0 for s in sources):
        raise MixtureSpecError(f"{where}: every weight is 0; give at least one source a weight > 0 (0 makes a "
                               "source evaluation-only)")
    return tuple(sources)


def _source(item: Any, i: int, where: str) -> SourceSpec:
    if not isinstance(item, dict):
        raise MixtureSpecError(f"{where}: source {i} must be a mapping with name, weight and a source, got {item!r}")
    name = item.get("name")
    if not isinstance(name, str) or not _NAME.match(name):
        raise MixtureSpecError(f"{where}: source {i} name={name!r} is invalid; give each source a name of letters, "
                               "digits, '_', '.' or '-' (it names the metrics val/<name>/loss)")
    label = f"data.mixture source {name!r}"
    shared = [k for k in item if k in SHARED_FIELDS]
    if shared:
        raise MixtureSpecError(f"{label}: {shared[0]} cannot differ between sources (they share one tokenizer, row "
                               f"length and split); set data.{shared[0]} for the whole mixture")
    unknown = [k for k in item if k not in KEYS]
    if unknown:
        raise MixtureSpecError(f"{label}: unknown field {unknown[0]!r}; a source may set: {', '.join(KEYS)}")
    weight = _number(label, "weight", item.get("weight"))
    if weight < 0:
        raise MixtureSpecError(f"{label}: weight={weight:g} is invalid; it must be >= 0 (0 = evaluation only)")
    reps = _number(label, "max_repetitions", item.get("max_repetitions", DEFAULT_MAX_REPETITIONS))
    if reps <= 0:
        raise MixtureSpecError(f"{label}: max_repetitions={reps:g} is invalid; it must be > 0 (passes over the "
                               "source's training split)")
    dataset_dir = item.get("dataset_dir", "")
    if not isinstance(dataset_dir, str):
        raise MixtureSpecError(f"{label}: dataset_dir={dataset_dir!r} must be a path or URI")
    fields = []
    for key, typ in SOURCE_FIELDS.items():
        if key in item:
            fields.append((key, _typed(label, key, item[key], typ)))
    if dataset_dir and fields:
        raise MixtureSpecError(f"{label}: dataset_dir names a prepared dataset; it cannot also set "
                               f"{', '.join(k for k, _ in fields)}")
    got = dict(fields)
    if "source" in got and got["source"] not in SOURCE_KINDS:
        raise MixtureSpecError(f"{label}: source={got['source']!r} is not allowed; choose one of: "
                               f"{', '.join(SOURCE_KINDS)}")
    if got.get("source") == "files" and not got.get("path"):
        raise MixtureSpecError(f"{label}: source=files needs a path (a file, directory or glob, local or a URI)")
    if got.get("source") == "hf" and not got.get("hf_name"):
        raise MixtureSpecError(f"{label}: source=hf needs hf_name, e.g. roneneldan/TinyStories")
    if got.get("on_bad_record", "skip") not in ("error", "skip"):
        raise MixtureSpecError(f"{label}: on_bad_record={got['on_bad_record']!r} is not allowed; choose error or skip")
    if not 0.0 <= got.get("max_bad_fraction", 0.0) <= 1.0:
        raise MixtureSpecError(f"{label}: max_bad_fraction={got['max_bad_fraction']} is invalid; it must be in [0, 1]")
    if got.get("max_documents", 0) < 0:
        raise MixtureSpecError(f"{label}: max_documents={got['max_documents']} is invalid; it must be >= 0 (0 = all)")
    return SourceSpec(name, weight, reps, dataset_dir, tuple(fields))


def _number(label: str, key: str, value: Any) -> float:
    if value is None:
        raise MixtureSpecError(f"{label}: {key} is missing; give it a number (its share of the training tokens)")
    try:
        number = float(value) if not isinstance(value, bool) else math.nan
    except (TypeError, ValueError):
        number = math.nan
    if not math.isfinite(number):
        raise MixtureSpecError(f"{label}: {key}={value!r} is not a number")
    return number


def _typed(label: str, key: str, value: Any, typ: type) -> Any:
    """A source's field coerced like the data.* field of that name (YAML gives most values their type already)."""
    if isinstance(value, typ) and not (typ is int and isinstance(value, bool)):
        return value
    if typ is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if typ is int and isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, str):
        text = value.strip()
        try:
            if typ is bool and text.lower() in ("true", "false", "1", "0", "yes", "no", "on", "off"):
                return text.lower() in ("true", "1", "yes", "on")
            if typ in (int, float):
                return typ(float(text)) if typ is int else float(text)
        except ValueError:
            pass
    raise MixtureSpecError(f"{label}: {key}={value!r} is not a valid {typ.__name__}")


def normalized(sources: list[SourceSpec]) -> list[float]:
    """The weights as shares of the training stream (summing to 1)."""
    total = sum(s.weight for s in sources)
    return [s.weight / total for s in sources]
