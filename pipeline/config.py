"""One typed configuration tree for every stage, with named presets and field-path overrides.

    from pipeline.config import load_config
    cfg = load_config("cpu", ["--train.batch_size=8", "--model.tier=A"])

Every field is addressed by its path (`train.batch_size`); the same paths are used by the CLI, by
Ray Train's `train_loop_config` and by Ray Tune's `param_space`. Unknown paths and invalid values
raise `ConfigError`, whose message is one line naming the field and what is allowed.
"""
from __future__ import annotations

import dataclasses
import json
import math
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from model.tiers import MIXERS, get_mixer_tier, tiers_for


class ConfigError(ValueError):
    """A user-supplied configuration value is invalid; the message names the field and the fix."""


@dataclass
class ModelConfig:
    tier: str = "nano"
    tie_embeddings: bool = True
    doc_masking: bool = True  # no attention across document boundaries; positions restart per document
    compile: str = "auto"  # auto (on for CUDA) | on | off: regional torch.compile, one block at a time
    activation_checkpointing: str = "none"  # none | all | every_<k> (every k-th block) | mixer (resonance only)
    attention: str = "auto"  # auto | flex | varlen | cudnn | sdpa | dense (model/decoder.py)
    mixer: str = "attention"  # attention (Llama-style decoder) | resonance (model/resonance.py); same tier names


@dataclass
class DataConfig:
    source: str = "builtin"  # builtin | files | hf
    path: str = ""  # files: a file, directory or glob, local or a URI (s3://bucket/corpus/*.jsonl, gs://...)
    text_column: str = "text"
    hf_name: str = ""  # hf: dataset name, e.g. roneneldan/TinyStories
    hf_config: str = ""
    hf_split: str = "train"
    hf_streaming: bool = False
    max_documents: int = 0  # 0 = all
    tokenizer: str = ""  # an existing SentencePiece .model (path or URI); empty = train one
    vocab_size: int = 32000
    tokenizer_sample_bytes: int = 20_000_000  # text sampled to train the tokenizer
    seq_len: int = 256  # tokens per training row; shards hold seq_len + 1
    # > 0: a corpus that packs into fewer rows than this at seq_len is packed again at the longest power-of-two
    # seq_len that gives at least this many (pipeline/train/sizing.py); 0: seq_len as set
    min_rows: int = 0
    val_fraction: float = 0.02
    rows_per_shard: int = 2048
    dataset_dir: str = ""  # this exact dataset directory (path or URI); empty = <data.dataset_store>/<content hash>
    dataset_store: str = ""  # where datasets are cached by content hash; empty = <run.storage>/datasets
    split_seed: int = 0
    tokenize_actors: int = 0  # 0 = one per core (local Ray) / per Ray CPU less one per node (cluster)
    # Unreadable records (a .jsonl line that is not JSON, a missing or non-string text field): skip = drop and
    # count them per file (manifest, validate report), failing only above max_bad_fraction of all records;
    # error = the first one fails the prepare.
    on_bad_record: str = "skip"
    max_bad_fraction: float = 0.001


@dataclass
class TrainConfig:
    batch_size: int = 8  # micro-batch, sequences per worker per forward
    grad_accum: int = 1
    max_steps: int = 200  # optimizer steps
    max_epochs: float = 0.0  # > 0: max_steps is capped at this many passes over the training split; 0: no cap
    lr: float = 3e-3
    min_lr_ratio: float = 0.1  # cosine floor as a fraction of lr
    warmup_steps: int = 20
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0  # 0 disables clipping
    seed: int = 1234
    precision: str = "auto"  # auto (bf16 on CUDA, fp32 on CPU) | bf16 | fp32
    ce_chunk_size: int = 0  # tokens per logits chunk in the fused cross-entropy; 0 = sized from the free memory
    max_bad_steps: int = 5  # consecutive non-finite steps before the run stops
    log_every: int = 10
    eval_every: int = 50
    eval_batches: int = 8
    checkpoint_every: int = 50
    keep_checkpoints: int = 2
    sample_tokens: int = 48  # tokens generated per prompt at evaluation (0 = off)
    memory_limit_gib: float = 0.0  # > 0: train as on a device of this many GiB (OOM above it); 0 = the real device
    # How Ray Train workers share the model (pipeline/train/parallel.py): ddp = a full copy each, gradients
    # all-reduced; fsdp = FSDP2, parameters, gradients and AdamW state sharded across the workers; auto = fsdp when
    # a full copy with its gradients, optimizer state and activations would not fit one worker's memory.
    parallel: str = "auto"


@dataclass
class RayConfig:
    address: str = ""  # empty = start a local Ray; "auto" = join the running cluster
    num_workers: int = 1
    use_gpu: str = "auto"  # auto | true | false
    cpus_per_worker: int = 0  # 0 = auto: CPU training on a local Ray splits the cores; GPUs or a joined cluster: 1
    max_failures: int = 3
    placement_strategy: str = "PACK"  # PACK | SPREAD | STRICT_PACK | STRICT_SPREAD (one worker per node)
    storage_path: str = ""  # Ray Train checkpoints (path or URI); empty = <run.storage>/<run name>/ray
    dashboard_host: str = "127.0.0.1"  # the local Ray's dashboard binds here (0.0.0.0 exposes it to the network)


@dataclass
class TrackingConfig:
    tracking_uri: str = ""  # empty = MLFLOW_TRACKING_URI, else sqlite:///<run.root>/mlflow.db
    experiment: str = "longtrain"
    enabled: bool = True
    system_metrics: bool = True  # CPU/memory/disk/network (+ GPU with pynvml) as system/* metrics of the run
    system_metrics_interval_s: float = 10.0  # seconds between samples (>= 1; each sample is one MLflow request)
    register_model: str = ""  # a name: at the end of training, export to Hugging Face format and register it
    # Artifacts of an experiment longtrain creates (path or URI); empty = <run.storage>/mlartifacts when run.storage
    # is a URI, else beside the local store's database. A tracking server decides its own (--artifacts-destination).
    artifact_location: str = ""


@dataclass
class RunConfig:
    root: str = "runs"  # the run directories (run.json, curves) and, without run.storage, every output
    # One bucket (or directory) for datasets, checkpoints and MLflow artifacts: s3://bucket/longtrain on a cluster
    # with no shared filesystem. Empty = $LONGTRAIN_STORAGE, else run.root. Each place can be set apart
    # (data.dataset_store, ray.storage_path, tracking.artifact_location).
    storage: str = ""
    name: str = ""  # empty = generated from tier and time
    storage_retry_s: float = 300.0  # seconds training rides out an object-store outage, stall or 5xx before failing


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    ray: RayConfig = field(default_factory=RayConfig)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)
    run: RunConfig = field(default_factory=RunConfig)

    def __post_init__(self) -> None:
        validate(self)

    def to_dict(self) -> dict[str, dict[str, Any]]:
        return dataclasses.asdict(self)

    def flat(self) -> dict[str, Any]:
        """{"train.batch_size": 8, ...}: the field paths used everywhere."""
        return {f"{s}.{k}": v for s, sec in self.to_dict().items() for k, v in sec.items()}

    def replace(self, overrides: dict[str, Any]) -> "Config":
        """A new validated config with field-path overrides applied."""
        flat = self.flat()
        for key, value in overrides.items():
            if key not in flat:
                raise ConfigError(_unknown_key_message(key))
            flat[key] = _coerce(key, value)
        return from_flat(flat)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)


_SECTION_TYPES = {f.name: typing.get_type_hints(Config)[f.name] for f in dataclasses.fields(Config)}


# Resolved once: typing.get_type_hints re-evaluates every annotation string on each call (~2 ms for a section),
# and a config is built field by field (from_flat checks and coerces each of its ~70 fields), so resolving them
# per call made every Config.replace cost ~0.3 s of CPU.
_FIELD_TYPES: dict[str, type] = {f"{sec}.{name}": typ for sec, cls in _SECTION_TYPES.items()
                                 for name, typ in typing.get_type_hints(cls).items()}


def field_types() -> dict[str, type]:
    """Every field path and its Python type (a copy: the caller may change it)."""
    return dict(_FIELD_TYPES)


def _unknown_key_message(key: str) -> str:
    paths = list(field_types())
    close = [p for p in paths if p.split(".")[-1] == key.split(".")[-1]]
    hint = f" did you mean {close[0]!r}?" if close else ""
    return f"unknown config field {key!r};{hint} valid fields: {', '.join(paths)}"


def _coerce(key: str, value: Any) -> Any:
    """Turn a CLI string (or a YAML/JSON value) into the field's type, or raise ConfigError."""
    typ = _FIELD_TYPES[key]
    if isinstance(value, str) and typ is not str:
        text = value.strip()
        try:
            if typ is bool:
                low = text.lower()
                if low not in ("true", "false", "1", "0", "yes", "no", "on", "off"):
                    raise ValueError
                return low in ("true", "1", "yes", "on")
            return typ(float(text)) if typ is int and "e" in text.lower() else typ(text)
        except ValueError:
            raise ConfigError(f"{key}={value!r} is not a valid {typ.__name__}") from None
    if typ is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if typ is int and isinstance(value, float) and value.is_integer():
        return int(value)
    if not isinstance(value, typ) or (typ is int and isinstance(value, bool)):
        raise ConfigError(f"{key}={value!r} is not a valid {typ.__name__}")
    return value


def from_flat(flat: dict[str, Any]) -> Config:
    """Build a Config from field paths; unknown paths are errors."""
    sections: dict[str, dict[str, Any]] = {s: {} for s in _SECTION_TYPES}
    for key, value in flat.items():
        if key not in _FIELD_TYPES:
            raise ConfigError(_unknown_key_message(key))
        sec, name = key.split(".", 1)
        sections[sec][name] = _coerce(key, value)
    return Config(**{s: _SECTION_TYPES[s](**kw) for s, kw in sections.items()})


def from_dict(nested: dict[str, Any]) -> Config:
    """Build a Config from {"train": {"batch_size": 8}, ...}; unknown sections or keys are errors."""
    flat: dict[str, Any] = {}
    for sec, body in nested.items():
        if sec not in _SECTION_TYPES:
            raise ConfigError(f"unknown config section {sec!r}; sections: {', '.join(_SECTION_TYPES)}")
        if not isinstance(body, dict):
            raise ConfigError(f"config section {sec!r} must be a mapping of fields, got {body!r}")
        for k, v in body.items():
            flat[f"{sec}.{k}"] = v
    return Config().replace(flat) if flat else Config()


def _one_of(key: str, value: Any, allowed: typing.Iterable[Any]) -> None:
    allowed = list(allowed)
    if value not in allowed:
        raise ConfigError(f"{key}={value!r} is not allowed; choose one of: {', '.join(map(str, allowed))}")


def _positive(key: str, value: float, zero_ok: bool = False) -> None:
    if not (value > 0 or (zero_ok and value == 0)) or (isinstance(value, float) and not math.isfinite(value)):
        bound = ">= 0" if zero_ok else "> 0"
        raise ConfigError(f"{key}={value!r} is invalid; it must be {bound}")


def validate(cfg: Config) -> None:
    """Check every field; raise ConfigError with one line naming the field and the allowed values."""
    m, d, t, r = cfg.model, cfg.data, cfg.train, cfg.ray
    _one_of("model.mixer", m.mixer, MIXERS)
    _one_of("model.tier", m.tier, tiers_for(m.mixer))
    _one_of("model.compile", m.compile, ("auto", "on", "off"))
    _one_of("model.attention", m.attention, ("auto", "flex", "varlen", "cudnn", "sdpa", "dense"))
    if m.attention == "cudnn" and m.doc_masking:
        raise ConfigError("model.attention=cudnn runs plain causal attention; add --model.doc_masking=false, or "
                          "choose model.attention=varlen or flex for document masking")
    ac = m.activation_checkpointing
    if ac == "mixer" and m.mixer != "resonance":
        raise ConfigError("model.activation_checkpointing=mixer recomputes the resonance mixer; set "
                          "model.mixer=resonance, or choose none, all or every_<k> (k >= 1)")
    if not (ac in ("none", "all", "mixer") or (ac.startswith("every_") and ac[6:].isdigit() and int(ac[6:]) >= 1)):
        raise ConfigError(
            f"model.activation_checkpointing={ac!r} is not allowed; choose none, all, every_<k> (k >= 1) or "
            "mixer (model.mixer=resonance)"
        )
    _one_of("data.source", d.source, ("builtin", "files", "hf"))
    if d.source == "files" and not d.path:
        raise ConfigError("data.path is empty; data.source=files needs a file, directory or glob in data.path")
    if d.source == "hf" and not d.hf_name:
        raise ConfigError("data.hf_name is empty; data.source=hf needs a dataset name, e.g. roneneldan/TinyStories")
    if not 256 <= d.vocab_size <= 2**31 - 1:
        raise ConfigError(f"data.vocab_size={d.vocab_size} is invalid; it must be at least 256 (byte fallback)")
    tier = get_mixer_tier(m.tier, m.mixer)
    if not 8 <= d.seq_len <= tier.max_seq_len:
        raise ConfigError(
            f"data.seq_len={d.seq_len} is out of range for model.tier={m.tier}; allowed 8..{tier.max_seq_len}"
        )
    if not 0.0 <= d.val_fraction < 0.5:
        raise ConfigError(f"data.val_fraction={d.val_fraction} is invalid; it must be in [0, 0.5)")
    for key in ("data.rows_per_shard", "data.tokenizer_sample_bytes"):
        _positive(key, cfg.flat()[key])
    for key in ("data.max_documents", "data.tokenize_actors", "data.min_rows", "train.max_epochs"):
        _positive(key, cfg.flat()[key], zero_ok=True)
    _one_of("data.on_bad_record", d.on_bad_record, ("error", "skip"))
    if not 0.0 <= d.max_bad_fraction <= 1.0:
        raise ConfigError(f"data.max_bad_fraction={d.max_bad_fraction} is invalid; it must be in [0, 1]")
    _positive("train.ce_chunk_size", cfg.train.ce_chunk_size, zero_ok=True)
    for key in ("train.batch_size", "train.grad_accum", "train.max_steps", "train.lr",
                "train.max_bad_steps", "train.log_every", "train.eval_every", "train.checkpoint_every",
                "train.keep_checkpoints", "train.eval_batches"):
        _positive(key, cfg.flat()[key])
    for key in ("train.warmup_steps", "train.weight_decay", "train.grad_clip", "train.sample_tokens",
                "train.memory_limit_gib"):
        _positive(key, cfg.flat()[key], zero_ok=True)
    if not 0.0 <= t.min_lr_ratio <= 1.0:
        raise ConfigError(f"train.min_lr_ratio={t.min_lr_ratio} is invalid; it must be in [0, 1]")
    for key, beta in (("train.beta1", t.beta1), ("train.beta2", t.beta2)):
        if not 0.0 <= beta < 1.0:
            raise ConfigError(f"{key}={beta} is invalid; it must be in [0, 1)")
    _one_of("train.precision", t.precision, ("auto", "bf16", "fp32"))
    _one_of("train.parallel", t.parallel, ("auto", "ddp", "fsdp"))
    _positive("ray.num_workers", r.num_workers)
    _positive("ray.cpus_per_worker", r.cpus_per_worker, zero_ok=True)
    _positive("ray.max_failures", r.max_failures, zero_ok=True)
    _one_of("ray.use_gpu", r.use_gpu, ("auto", "true", "false"))
    _one_of("ray.placement_strategy", r.placement_strategy, ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"))
    _positive("run.storage_retry_s", cfg.run.storage_retry_s, zero_ok=True)
    tr = cfg.tracking
    if not (math.isfinite(tr.system_metrics_interval_s) and tr.system_metrics_interval_s >= 1.0):
        raise ConfigError(f"tracking.system_metrics_interval_s={tr.system_metrics_interval_s} is invalid; it must "
                          f"be >= 1 (seconds between samples)")
    if tr.register_model and not tr.enabled:
        raise ConfigError("tracking.register_model needs tracking.enabled=true (the model is registered in MLflow)")


# ----------------------------------------------------------------------------------------------
# Presets: small named functions deriving from the base. `default_preset()` picks by hardware.

def _cpu() -> dict[str, Any]:
    """Runs anywhere in minutes: nano tier, 256-token rows, a 2,000-piece tokenizer."""
    return {"model.tier": "nano", "data.vocab_size": 2000, "data.seq_len": 256, "train.batch_size": 8,
            "train.max_steps": 200, "train.lr": 3e-3}


def _gpu() -> dict[str, Any]:
    """One GPU, the default with CUDA: tier B at up to 32k context, sized to its data (pipeline/train/sizing.py): a
    corpus that fills fewer than 256 rows of 32k gets shorter rows, and no run passes over its data more than 4
    times. On the built-in corpus that is a few minutes; on a real one (`fineweb-32k`) 2,000 steps at 32k."""
    return {"model.tier": "B", "data.vocab_size": 32000, "data.seq_len": 32768, "data.min_rows": 256,
            "train.batch_size": 1, "train.grad_accum": 8, "train.max_steps": 2000, "train.max_epochs": 4.0,
            "train.lr": 6e-4, "train.warmup_steps": 100, "train.eval_every": 200, "train.checkpoint_every": 500,
            "ray.use_gpu": "true"}


# A real corpus for the gpu preset: FineWeb-Edu's 10B-token sample, streamed from the Hugging Face Hub, its first
# 500,000 documents (~0.5B tokens at ~1,000 tokens each: about one pass of 2,000 steps x 8 rows of 32,768 tokens).
FINEWEB_32K = {"data.source": "hf", "data.hf_name": "HuggingFaceFW/fineweb-edu", "data.hf_config": "sample-10BT",
               "data.hf_streaming": True, "data.max_documents": 500_000, "data.min_rows": 0}


def _fineweb_32k() -> dict[str, Any]:
    """The gpu preset on a real corpus: tier B, 32,768-token rows of FineWeb-Edu, 2,000 steps of 8 rows."""
    return {**_gpu(), **FINEWEB_32K}


def _test() -> dict[str, Any]:
    """The smallest thing that trains end to end; used by the test suite."""
    return {"model.tier": "nano", "data.vocab_size": 512, "data.seq_len": 64, "data.max_documents": 100,
            "data.rows_per_shard": 16, "train.batch_size": 4, "train.max_steps": 8, "train.warmup_steps": 2,
            "train.log_every": 2, "train.eval_every": 4, "train.eval_batches": 2, "train.checkpoint_every": 4,
            "train.sample_tokens": 8}


PRESETS = {"cpu": _cpu, "gpu": _gpu, "fineweb-32k": _fineweb_32k, "test": _test}


def default_preset() -> str:
    """`gpu` when CUDA is present, `cpu` otherwise."""
    import torch

    return "gpu" if torch.cuda.is_available() else "cpu"


def preset(name: str) -> Config:
    if name in PRESETS:
        return Config().replace(PRESETS[name]())
    p = Path(name)
    if p.suffix in (".yaml", ".yml", ".json") or p.exists():
        return load_preset_file(p)
    raise ConfigError(f"unknown preset {name!r}; built-in presets: {', '.join(PRESETS)}, or a .yaml/.json file")


def load_preset_file(path: Path) -> Config:
    """A YAML/JSON preset: `{base: cpu, overrides: {train.batch_size: 4}}` or a nested config tree."""
    import yaml

    if not path.is_file():
        raise ConfigError(f"preset file {str(path)!r} does not exist")
    try:
        doc = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as exc:
        raise ConfigError(f"preset file {str(path)!r} is not valid YAML/JSON: {exc}".splitlines()[0]) from None
    if not isinstance(doc, dict):
        raise ConfigError(f"preset file {str(path)!r} must hold a mapping")
    if "base" in doc or "overrides" in doc:
        extra = set(doc) - {"base", "overrides"}
        if extra:
            raise ConfigError(f"preset file {str(path)!r}: unknown top-level keys {sorted(extra)}; use base and overrides")
        base = preset(str(doc.get("base", "cpu")))
        return base.replace(dict(doc.get("overrides") or {}))
    return from_dict(doc)


def parse_overrides(args: list[str]) -> dict[str, Any]:
    """['--train.batch_size=8', '--model.tier', 'A'] -> {'train.batch_size': '8', 'model.tier': 'A'}."""
    out: dict[str, Any] = {}
    i = 0
    while i < len(args):
        arg = args[i]
        if not arg.startswith("--") or len(arg) == 2:
            raise ConfigError(f"unexpected argument {arg!r}; overrides look like --train.batch_size=8")
        key = arg[2:]
        if "=" in key:
            key, value = key.split("=", 1)
        elif i + 1 < len(args):
            i += 1
            value = args[i]
        else:
            raise ConfigError(f"override --{key} has no value; write --{key}=VALUE")
        if key not in field_types():
            raise ConfigError(_unknown_key_message(key))
        out[key] = value
        i += 1
    return out


def load_config(preset_name: str | None = None, overrides: list[str] | dict[str, Any] | None = None) -> Config:
    """The preset (default: by hardware) with overrides applied, validated."""
    base = preset(preset_name or default_preset())
    if isinstance(overrides, list):
        overrides = parse_overrides(overrides)
    return base.replace(overrides or {})
