"""One typed configuration tree for every stage, with named presets and field-path overrides.

    from pipeline.config import load_config
    cfg = load_config("cpu", ["--train.batch_size=8", "--model.tier=A"])

Every field is addressed by its path (`train.batch_size`); the same paths are used by the CLI, by
Ray Train's `train_loop_config` and by Ray Tune's `param_space`. Unknown paths and invalid values
raise `ConfigError`, whose message is one line naming the field and what is allowed.
"""
from __future__ import annotations

import dataclasses
import difflib
import json
import math
import re
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from model.tiers import MIXERS, get_mixer_tier, tiers_for, with_moe
from pipeline.mixture_spec import FIELD_SOURCE_KINDS, SOURCE_KINDS


class ConfigError(ValueError):
    """A user-supplied configuration value is invalid; the message names the field and the fix."""


@dataclass
class ModelConfig:
    tier: str = "nano"  # model size by name (python -m model lists each tier's parameter count)
    tie_embeddings: bool = True  # the output projection shares the token embedding's weights
    doc_masking: bool = True  # no attention across document boundaries; positions restart per document
    compile: str = "auto"  # auto (on for CUDA) | on | off: regional torch.compile, one block at a time
    activation_checkpointing: str = "none"  # none | all | every_<k> (every k-th block) | mixer (resonance only)
    attention: str = "auto"  # auto | flex | varlen | cudnn | sdpa | dense (model/decoder.py)
    mixer: str = "attention"  # attention (Llama-style decoder) | resonance (model/resonance.py); same tier names
    # RoPE base and scaling (model/rope.py, docs/long-context.md); each may change per phase. The resonance family
    # has no RoPE: setting them for it is refused (unused_by_mixer below)
    rope_theta: float = 0.0  # RoPE base; 0 = the tier's (500,000)
    rope_scaling: str = "none"  # none | linear | yarn | llama3: positions scaled for a longer context than trained
    rope_factor: float = 1.0  # linear, yarn, llama3: how many times the original length the context is scaled to
    rope_original_max_len: int = 0  # yarn, llama3: the context length trained before scaling (e.g. 4096)
    rope_beta_fast: float = 32.0  # yarn: dimensions turning more often than this in the original length are kept
    rope_beta_slow: float = 1.0  # yarn: dimensions turning less often than this are fully interpolated
    rope_low_freq_factor: float = 1.0  # llama3: wavelengths over original_max_len / this are divided by the factor
    rope_high_freq_factor: float = 4.0  # llama3: wavelengths under original_max_len / this are kept
    # Mixture of experts (model/moe.py, docs/models.md#mixture-of-experts): a `-moe` tier (nano-moe, A-moe, B-moe,
    # C-moe) sets the shape; these change it, -1 keeping the tier's. num_experts on a dense tier gives it experts.
    num_experts: int = -1  # routed experts per MoE layer; -1 = the tier's (0 for a dense tier), 0 = dense
    experts_per_token: int = -1  # k, the routed experts each token runs (top-k); -1 = the tier's (2 on a dense tier)
    expert_ffn: int = -1  # SwiGLU width of one expert, a multiple of 8 (fine-grained experts); -1 = the tier's (d_ff / 2 on a dense tier)
    shared_experts: int = -1  # experts every token runs (one sigmoid-gated SwiGLU of this many x expert_ffn); -1 = the tier's (0)
    dense_first_layers: int = -1  # first blocks that keep the dense SwiGLU MLP; -1 = the tier's (0)
    moe_balance: str = "aux"  # aux (a load-balancing loss over the global batch) | bias (DeepSeek-V3's selection bias, no loss)
    moe_aux_weight: float = 0.01  # aux: weight of the load-balancing loss (which is 1 at a perfect balance)
    moe_z_weight: float = 0.0  # weight of the router z-loss, mean logsumexp(logits)^2 (ST-MoE uses 0.001); 0 = off
    moe_bias_rate: float = 0.001  # bias: how far each expert's selection bias moves per optimizer step (DeepSeek-V3: 0.001)
    moe_capacity_factor: float = 0.0  # > 0: in training an expert takes at most this x its even share of a micro-batch, the rest dropped (counted); 0 = dropless
    moe_renormalize: bool = True  # the k chosen router probabilities are renormalised to sum to 1 (Mixtral, Qwen3-MoE)


@dataclass
class DataConfig:
    source: str = "builtin"  # builtin | files | hf: where the text comes from (built-in needs no download)
    path: str = ""  # files: a file, directory or glob, local or a URI (s3://bucket/corpus/*.jsonl, gs://...)
    text_column: str = "text"  # files (.jsonl/.json/.parquet) and hf: the field or column that holds the text
    hf_name: str = ""  # hf: dataset name, e.g. roneneldan/TinyStories
    hf_config: str = ""  # hf: the dataset's configuration (subset) name, e.g. sample-10BT
    hf_split: str = "train"  # hf: the split to read
    hf_streaming: bool = False  # hf: stream the dataset from the Hub instead of downloading it first
    max_documents: int = 0  # read at most this many documents of the source, in order; 0 = all
    tokenizer: str = ""  # an existing SentencePiece .model (path or URI); empty = train one
    vocab_size: int = 32000  # tokenizer pieces (SentencePiece BPE with byte fallback; at least 256)
    tokenizer_sample_bytes: int = 20_000_000  # text sampled to train the tokenizer
    seq_len: int = 256  # tokens per training row; shards hold seq_len + 1
    # > 0: a corpus that packs into fewer rows than this at seq_len is packed again at the longest power-of-two
    # seq_len that gives at least this many (pipeline/train/session/sizing.py); 0: seq_len as set
    min_rows: int = 0  # > 0: pack again at a shorter seq_len when the corpus fills fewer rows
    val_fraction: float = 0.02  # share of the packed rows held out for validation
    rows_per_shard: int = 2048  # packed rows per Parquet shard file
    dataset_dir: str = ""  # this exact dataset directory (path or URI); empty = <data.dataset_store>/<content hash>
    dataset_store: str = ""  # where datasets are cached by content hash; empty = <run.storage>/datasets
    split_seed: int = 0  # seed of the train/validation split
    tokenize_actors: int = 0  # 0 = one per core (local Ray) / per Ray CPU less one per node (cluster)
    # Unreadable records (a .jsonl line that is not JSON, a missing or non-string text field): skip = drop and
    # count them per file (manifest, validate report), failing only above max_bad_fraction of all records;
    # error = the first one fails the prepare.
    on_bad_record: str = "skip"  # skip | error: what an unreadable record does
    max_bad_fraction: float = 0.001  # skip: fail when more than this share of all records is unreadable
    # Several named sources blended by token share: a YAML file holding a list of sources, or the list inline
    # (docs/data.md#mixtures: [{name: web, weight: 0.7, source: files, path: ...}, ...]); empty = the one source above
    mixture: str = ""  # a YAML file of named sources with token-share weights, or the list inline; empty = data.source
    mixture_block_rows: int = 1024  # rows per block of the mixed stream; each source gives round(weight x k) of them
    # Duplicates out before tokenizing, across a mixture's sources and before the train/validation split
    # (docs/data.md#deduplication): exact = documents equal up to spacing; near = also MinHash near-duplicates
    dedup: str = "exact"  # none | exact | near: which duplicate documents prepare removes (one copy is kept)
    dedup_threshold: float = 0.75  # near: Jaccard similarity of word n-gram sets at which documents are duplicates
    dedup_ngram: int = 5  # near: words per shingle (n-gram)
    dedup_keep: str = "first"  # first | weight: which mixture source keeps a shared document (listed first; heaviest)


@dataclass
class TrainConfig:
    batch_size: int = 8  # micro-batch, sequences per worker per forward
    grad_accum: int = 1  # micro-batches accumulated per optimizer step
    max_steps: int = 200  # optimizer steps
    max_epochs: float = 0.0  # > 0: max_steps is capped at this many passes over the training split; 0: no cap
    lr: float = 3e-3  # peak learning rate (AdamW), after warmup
    min_lr_ratio: float = 0.1  # cosine floor as a fraction of lr
    warmup_steps: int = 20  # linear warmup steps before the cosine decay
    weight_decay: float = 0.1  # AdamW weight decay (matrices only)
    beta1: float = 0.9  # AdamW beta1
    beta2: float = 0.95  # AdamW beta2
    grad_clip: float = 1.0  # 0 disables clipping
    seed: int = 1234  # seed of the model's initialisation and the data order
    precision: str = "auto"  # auto (bf16 on CUDA, fp32 on CPU) | bf16 | fp32
    ce_chunk_size: int = 0  # tokens per logits chunk in the fused cross-entropy; 0 = sized from the free memory
    max_bad_steps: int = 5  # consecutive non-finite steps before the run stops
    log_every: int = 10  # steps between training-metric logs (and Ctrl+C checks)
    eval_every: int = 50  # steps between evaluations on the validation split
    eval_batches: int = 8  # validation batches per evaluation during training
    eval_by_position: bool = False  # at each evaluation also the loss by position in the document (val/pos_loss/*)
    checkpoint_every: int = 50  # steps between checkpoints (and at the end)
    # > 0: also checkpoint once this many seconds have passed since the last checkpoint (rank 0's clock, agreed by
    # every worker at a step boundary), bounding the work a lost node costs; 0 = by steps only
    checkpoint_every_s: float = 0.0  # seconds between time-based checkpoints (0 = by steps only)
    keep_checkpoints: int = 2  # checkpoints kept: the best by val/loss and the latest
    sample_tokens: int = 48  # tokens generated per prompt at evaluation (0 = off)
    memory_limit_gib: float = 0.0  # > 0: train as on a device of this many GiB (OOM above it); 0 = the real device
    # How Ray Train workers share the model (pipeline/train/distributed/parallel.py): ddp = a full copy each, gradients
    # all-reduced; fsdp = FSDP2, parameters, gradients and AdamW state sharded across the workers; auto = fsdp when
    # a full copy with its gradients, optimizer state and activations would not fit one worker's memory.
    parallel: str = "auto"  # auto | ddp | fsdp: how Ray Train workers share the model
    # Context parallelism (pipeline/train/distributed/context_parallel.py, docs/long-context.md): each row is split
    # over this many workers, which read the same rows (ray.num_workers a multiple of it); the plan names the smallest
    # that fits (python -m pipeline.train.max_batch --workers N)
    context_parallel_degree: int = 1  # workers that split one row between them (context parallelism); 1 = off
    # The process group's timeout, gloo and NCCL alike (pipeline/train/distributed/collectives.py)
    # Expert parallelism: a MoE model's experts split over this many workers, tokens moved to them by all-to-all
    # (pipeline/train/distributed/expert_parallel.py); it must divide model.num_experts, and the degree (x the context
    # degree) must divide ray.num_workers
    expert_parallel_degree: int = 1  # workers the experts of a MoE model are split over; 1 = every worker holds all
    collective_timeout_s: float = 600.0  # seconds a collective waits for the other ranks before the attempt ends with one line naming the rank, the step and the collective
    # Loss spikes (pipeline/train/spike_guard.py, docs/training.md#loss-spikes): a step whose loss or gradient norm is
    # more than spike_sigmas deviations above the mean of the last spike_window steps is an outlier (OLMo-core's 6
    # and 128); repeated outliers, or a loss that does not come back after an applied one, rewind the run to the
    # newest checkpoint before the spike and skip the rows that led into it (PaLM's recipe)
    spike_action: str = "skip"  # skip (an outlier applies no update) | apply (applied, and watched) | off
    spike_sigmas: float = 6.0  # standard deviations above the trailing mean that make an outlier
    spike_window: int = 128  # steps the trailing mean and deviation of the loss and gradient norm are taken over
    spike_warmup_steps: int = 128  # steps in the window before detection arms (>= 2)
    spike_rewind_outliers: int = 3  # outliers within spike_rewind_window steps that rewind the run; 0 = never
    spike_rewind_window: int = 100  # steps (taken or skipped) in which outliers count as repeated
    spike_recover_steps: int = 20  # apply: steps the loss may stay above its pre-spike mean before a rewind; 0 = never
    spike_skip_steps: int = 200  # a rewind skips at least this many steps' worth of rows from the checkpoint on
    spike_max_rewinds: int = 3  # rewinds a run may make; the next one due stops it with one line


@dataclass
class RayConfig:
    address: str = ""  # empty = start a local Ray; "auto" = join the running cluster
    num_workers: int = 1  # Ray Train workers (one per GPU); a range MIN-MAX (e.g. 2-8) runs elastic, this field MAX
    min_workers: int = 0  # elastic (> 0): the fewest workers a run goes on with after losing nodes; 0 = fixed
    resize_check_s: float = 60.0  # elastic: seconds between checks for returned nodes to grow the worker group back
    use_gpu: str = "auto"  # auto (a GPU per worker when the cluster has GPUs) | true | false
    cpus_per_worker: int = 0  # 0 = auto: a local CPU run splits the cores among workers; GPUs or a cluster: 1
    max_failures: int = 3  # restarts from the latest checkpoint after a worker fails
    placement_strategy: str = "PACK"  # PACK | SPREAD | STRICT_PACK | STRICT_SPREAD (one worker per node)
    storage_path: str = ""  # Ray Train checkpoints (path or URI); empty = <run.storage>/<run name>/ray
    checkpoint_upload: str = "sync"  # sync (the step waits for the upload) | async (it uploads while the next steps train)
    dashboard_host: str = "127.0.0.1"  # the local Ray's dashboard binds here (0.0.0.0 exposes it to the network)


@dataclass
class TrackingConfig:
    tracking_uri: str = ""  # empty = MLFLOW_TRACKING_URI, else sqlite:///<run.root>/mlflow.db
    experiment: str = "longtrain"  # the MLflow experiment runs are logged to
    enabled: bool = True  # track the run in MLflow (params, metrics, artifacts)
    system_metrics: bool = True  # CPU/memory/disk/network (+ GPU with pynvml) as system/* metrics of the run
    system_metrics_interval_s: float = 10.0  # seconds between samples (>= 1; each sample is one MLflow request)
    register_model: str = ""  # a name: at the end of training, export to Hugging Face format and register it
    # Artifacts of an experiment longtrain creates (path or URI); empty = <run.storage>/mlartifacts when run.storage
    # is a URI, else beside the local store's database. A tracking server decides its own (--artifacts-destination).
    artifact_location: str = ""  # where a new experiment keeps its artifacts


@dataclass
class RunConfig:
    root: str = "runs"  # the run directories (run.json, curves) and, without run.storage, every output
    # One bucket (or directory) for datasets, checkpoints and MLflow artifacts: s3://bucket/longtrain on a cluster
    # with no shared filesystem. Empty = $LONGTRAIN_STORAGE, else run.root. Each place can be set apart
    # (data.dataset_store, ray.storage_path, tracking.artifact_location).
    storage: str = ""  # one root for datasets, checkpoints and artifacts, a path or a bucket URI
    name: str = ""  # empty = generated from tier and time
    storage_retry_s: float = 300.0  # seconds training rides out an object-store outage, stall, 5xx or 403 before failing


@dataclass
class EvalConfig:
    # Downstream tasks scored by lm-evaluation-harness (the `eval` extra) on the checkpoints while the run trains, by
    # a Ray task beside the workers (docs/evaluation.md), and by `eval CHECKPOINT --tasks ...`. Names from the
    # harness's registry (hellaswag, arc_easy: their data must be in the Hugging Face cache, nothing is downloaded),
    # paths to task YAMLs of one's own, or builtin_cloze / builtin_docs (made from the dataset's held-out documents)
    tasks: str = ""  # comma-separated lm-evaluation-harness tasks scored at checkpoints; empty = none
    num_fewshot: int = -1  # few-shot examples in each prompt; -1 = each task's own default
    limit: float = 0.0  # examples per task: 0 = all, >= 1 that many, < 1 that share of each task
    every_checkpoints: int = 1  # score every N-th checkpoint (the last one always)
    cpus: float = 1.0  # CPUs the scoring task reserves beside the training workers
    gpus: float = 0.0  # GPUs it reserves (a fraction shares a GPU; the workers then ask for 1 - this each)
    timeout_s: float = 0.0  # seconds one checkpoint's scoring may take before Ray cancels it; 0 = no limit


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    ray: RayConfig = field(default_factory=RayConfig)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)
    run: RunConfig = field(default_factory=RunConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)

    def __post_init__(self) -> None:
        validate(self)

    def to_dict(self) -> dict[str, dict[str, Any]]:
        return dataclasses.asdict(self)

    def flat(self) -> dict[str, Any]:
        """{"train.batch_size": 8, ...}: the field paths used everywhere."""
        return {f"{s}.{k}": v for s, sec in self.to_dict().items() for k, v in sec.items()}

    def replace(self, overrides: dict[str, Any]) -> "Config":
        """A new validated config with field-path overrides applied. `ray.num_workers` also takes a range MIN-MAX
        (an elastic run: ray.num_workers=MAX, ray.min_workers=MIN); a plain count without ray.min_workers beside it
        is a fixed worker count (ray.min_workers=0)."""
        flat = self.flat()
        overrides = _worker_range(overrides)
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


# The names Hugging Face's Trainer / model configs, nanoGPT and litgpt give to what is a longtrain field under
# another name: the first guess of a user coming from them (`--train.learning_rate`), answered by close_fields.
FIELD_ALIASES = {
    "learning_rate": "train.lr", "max_lr": "train.lr", "peak_lr": "train.lr", "min_lr": "train.min_lr_ratio",
    "per_device_train_batch_size": "train.batch_size", "micro_batch_size": "train.batch_size",
    "train_batch_size": "train.batch_size", "gradient_accumulation_steps": "train.grad_accum",
    "gradient_accumulation_iters": "train.grad_accum", "accumulate_grad_batches": "train.grad_accum",
    "max_iters": "train.max_steps", "num_steps": "train.max_steps", "steps": "train.max_steps",
    "num_train_epochs": "train.max_epochs", "epochs": "train.max_epochs",
    "warmup_iters": "train.warmup_steps", "lr_warmup_steps": "train.warmup_steps",
    "num_warmup_steps": "train.warmup_steps", "lr_warmup_iters": "train.warmup_steps",
    "max_grad_norm": "train.grad_clip", "gradient_clip_val": "train.grad_clip", "clip_grad_norm": "train.grad_clip",
    "adam_beta1": "train.beta1", "adam_beta2": "train.beta2",
    "eval_interval": "train.eval_every", "eval_steps": "train.eval_every", "eval_iters": "train.eval_batches",
    "log_interval": "train.log_every", "logging_steps": "train.log_every",
    "save_steps": "train.checkpoint_every", "save_interval": "train.checkpoint_every",
    "save_total_limit": "train.keep_checkpoints", "dtype": "train.precision", "bf16": "train.precision",
    "block_size": "data.seq_len", "max_seq_length": "data.seq_len", "max_seq_len": "data.seq_len",
    "seq_length": "data.seq_len", "context_length": "data.seq_len", "n_ctx": "data.seq_len",
    "max_position_embeddings": "data.seq_len", "dataset_name": "data.hf_name",
    "dataset_config_name": "data.hf_config", "tokenizer_name": "data.tokenizer",
    "context_parallel_size": "train.context_parallel_degree", "cp": "train.context_parallel_degree",
    "context_parallel": "train.context_parallel_degree", "num_local_experts": "model.num_experts",
    "num_experts_per_tok": "model.experts_per_token", "top_k": "model.experts_per_token",
    "moe_intermediate_size": "model.expert_ffn", "n_shared_experts": "model.shared_experts",
    "first_k_dense_replace": "model.dense_first_layers", "router_aux_loss_coef": "model.moe_aux_weight",
    "router_z_loss_coef": "model.moe_z_weight", "norm_topk_prob": "model.moe_renormalize",
    "expert_parallel_size": "train.expert_parallel_degree", "ep": "train.expert_parallel_degree",
    "rope_base": "model.rope_theta", "base": "model.rope_theta", "tie_word_embeddings": "model.tie_embeddings",
    "gradient_checkpointing": "model.activation_checkpointing", "torch_compile": "model.compile",
    "model_name": "model.tier", "model_size": "model.tier", "out_dir": "run.root", "output_dir": "run.root",
    "run_name": "run.name", "experiment_name": "tracking.experiment", "wandb_project": "tracking.experiment",
}


def close_fields(key: str, n: int = 3) -> list[str]:
    """The field paths a mistyped `key` most likely meant: another project's name for a field (FIELD_ALIASES:
    `train.learning_rate` -> train.lr), the same name in another section (`train.tier` -> model.tier), else the
    nearest spellings of the whole path or of its last part."""
    paths = list(_FIELD_TYPES)
    leaf = key.split(".")[-1]
    if leaf.lower() in FIELD_ALIASES:
        return [FIELD_ALIASES[leaf.lower()]]
    same = [p for p in paths if p.split(".")[-1] == leaf]
    if same:
        return same[:n]
    by_leaf: dict[str, str] = {}
    for p in paths:
        by_leaf.setdefault(p.split(".")[-1], p)
    for word, names, full in ((key, paths, None), (leaf, list(by_leaf), by_leaf)):
        scored = sorted(((difflib.SequenceMatcher(None, word, m).ratio(), m) for m in names), reverse=True)
        # the best match and any as close as it (two equally likely meanings), never a long list
        close = [m for r, m in scored[:n] if r >= 0.75 and r >= scored[0][0] - 0.02]
        if close:
            return [full[m] for m in close] if full else close
    return []


def _unknown_key_message(key: str) -> str:
    """One line: the closest field(s), and where the full list is (not the list itself: ~70 names)."""
    close = close_fields(key)
    hint = f" did you mean {' or '.join(repr(c) for c in close)}?" if close else ""
    return (f"unknown config field {key!r};{hint} `python pipeline/run.py --help` lists every field with its "
            f"type, default and meaning")


# Text fields whose choices hold a yes/no pair (`auto | true | false`, `auto | on | off`): YAML reads an unquoted
# true/false/on/off/yes/no as a boolean, and a user types True or yes as readily as true, so each of those words,
# and a YAML boolean, is taken as the field's own spelling of the pair (field -> (its yes, its no)).
_YES_NO_CHOICES = {"ray.use_gpu": ("true", "false"), "model.compile": ("on", "off")}
_YES_WORDS, _NO_WORDS = ("true", "yes", "on", "1"), ("false", "no", "off", "0")


def _yes_no(key: str, value: Any) -> Any:
    """`value` in the spelling of a _YES_NO_CHOICES field (True -> "true", "Yes" -> "on", ...); else unchanged."""
    yes, no = _YES_NO_CHOICES[key]
    if isinstance(value, bool):
        return yes if value else no
    if isinstance(value, int) and value in (0, 1):
        return yes if value else no
    if isinstance(value, str):
        low = value.strip().lower()
        return yes if low in _YES_WORDS else no if low in _NO_WORDS else value
    return value


def _coerce(key: str, value: Any) -> Any:
    """Turn a CLI string (or a YAML/JSON value) into the field's type, or raise ConfigError."""
    typ = _FIELD_TYPES[key]
    if key in _YES_NO_CHOICES:
        value = _yes_no(key, value)
    if key == "data.mixture" and isinstance(value, list):  # a YAML list of sources (a preset, a phase): inline it
        value = json.dumps(value, separators=(",", ":"))
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


_RANGE = re.compile(r"^\s*(\d+)\s*-\s*(\d+)\s*$")


def _worker_range(overrides: dict[str, Any]) -> dict[str, Any]:
    """`ray.num_workers="2-8"` -> ray.num_workers=8, ray.min_workers=2; a count alone -> ray.min_workers=0."""
    key = "ray.num_workers"
    if key not in overrides:
        return overrides
    value, out = overrides[key], dict(overrides)
    m = _RANGE.match(value) if isinstance(value, str) else None
    if m:
        out["ray.min_workers"], out[key] = int(m.group(1)), int(m.group(2))
    elif isinstance(value, str) and "-" in value.strip()[1:]:
        raise ConfigError(f"{key}={value!r} is neither a worker count nor a range; write a count (8) or MIN-MAX "
                          f"(2-8: elastic, from 2 up to 8 workers)")
    else:
        out.setdefault("ray.min_workers", 0)
    return out


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
    _validate_rope(m)
    _validate_moe(cfg)
    _one_of("data.source", d.source, SOURCE_KINDS)
    if d.source == "files" and not d.path:
        raise ConfigError("data.path is empty; data.source=files needs a file, directory or glob in data.path")
    if d.source == "hf" and not d.hf_name:
        raise ConfigError("data.hf_name is empty; data.source=hf needs a dataset name, e.g. roneneldan/TinyStories")
    if not 256 <= d.vocab_size <= 2**31 - 1:
        raise ConfigError(f"data.vocab_size={d.vocab_size} is invalid; it must be at least 256 (byte fallback)")
    tier = get_mixer_tier(m.tier, m.mixer)
    cp = t.context_parallel_degree
    _positive("train.context_parallel_degree", cp)
    if not 8 <= d.seq_len <= tier.max_seq_len * cp:  # a tier's max_seq_len is what one worker holds of a row
        more = f" (x train.context_parallel_degree={cp})" if cp > 1 else ""
        raise ConfigError(f"data.seq_len={d.seq_len} is out of range for model.tier={m.tier}; allowed 8.."
                          f"{tier.max_seq_len * cp}{more}" + ("" if cp > 1 or d.seq_len < 8 else
                                                             "; a longer row splits over workers with "
                                                             "train.context_parallel_degree"))
    _validate_context_parallel(cfg)
    if not 0.0 <= d.val_fraction < 0.5:
        raise ConfigError(f"data.val_fraction={d.val_fraction} is invalid; it must be in [0, 0.5)")
    for key in ("data.rows_per_shard", "data.tokenizer_sample_bytes"):
        _positive(key, cfg.flat()[key])
    for key in ("data.max_documents", "data.tokenize_actors", "data.min_rows", "train.max_epochs"):
        _positive(key, cfg.flat()[key], zero_ok=True)
    _one_of("data.on_bad_record", d.on_bad_record, ("error", "skip"))
    _positive("data.mixture_block_rows", d.mixture_block_rows)
    if d.mixture:
        _check_mixture(d.mixture)
    _one_of("data.dedup", d.dedup, ("none", "exact", "near"))
    if not (0.0 < d.dedup_threshold <= 1.0):  # also NaN
        raise ConfigError(f"data.dedup_threshold={d.dedup_threshold!r} is invalid; it must be in (0, 1]: the Jaccard "
                          "similarity of two documents' word n-gram sets at which they are near duplicates "
                          "(FineWeb's 0.75)")
    if d.dedup_ngram < 1:
        raise ConfigError(f"data.dedup_ngram={d.dedup_ngram!r} is invalid; it must be >= 1: words per shingle "
                          "(FineWeb's 5)")
    _one_of("data.dedup_keep", d.dedup_keep, ("first", "weight"))
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
    if t.eval_by_position and d.mixture:
        raise ConfigError("train.eval_by_position reads one dataset's validation split, and data.mixture blends "
                          "several; evaluate a source's dataset with `python pipeline/run.py eval --by-position "
                          "--checkpoint ...`, or drop one of the two")
    _positive("train.collective_timeout_s", t.collective_timeout_s)
    _validate_spikes(t)
    _positive("ray.num_workers", r.num_workers)
    _positive("ray.resize_check_s", r.resize_check_s, zero_ok=True)
    _positive("train.checkpoint_every_s", t.checkpoint_every_s, zero_ok=True)
    _validate_elastic(cfg)
    _validate_eval(cfg.eval)
    _positive("ray.cpus_per_worker", r.cpus_per_worker, zero_ok=True)
    _positive("ray.max_failures", r.max_failures, zero_ok=True)
    _one_of("ray.use_gpu", r.use_gpu, ("auto", "true", "false"))
    _one_of("ray.placement_strategy", r.placement_strategy, ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"))
    _one_of("ray.checkpoint_upload", r.checkpoint_upload, ("async", "sync"))
    _positive("run.storage_retry_s", cfg.run.storage_retry_s, zero_ok=True)
    tr = cfg.tracking
    if not (math.isfinite(tr.system_metrics_interval_s) and tr.system_metrics_interval_s >= 1.0):
        raise ConfigError(f"tracking.system_metrics_interval_s={tr.system_metrics_interval_s} is invalid; it must "
                          f"be >= 1 (seconds between samples)")
    if tr.register_model and not tr.enabled:
        raise ConfigError("tracking.register_model needs tracking.enabled=true (the model is registered in MLflow)")


# The RoPE fields each scaling uses; the others must keep their defaults (a value that would be ignored is an error).
_ROPE_PARAMETERS = {"none": (), "linear": ("rope_factor",),
                    "yarn": ("rope_factor", "rope_original_max_len", "rope_beta_fast", "rope_beta_slow"),
                    "llama3": ("rope_factor", "rope_original_max_len", "rope_low_freq_factor",
                               "rope_high_freq_factor")}


def _validate_rope(m: ModelConfig) -> None:
    """model.rope_*: one line naming the field and what is allowed (model/rope.py RopeConfig holds the formulas)."""
    if not (m.rope_theta == 0 or (math.isfinite(m.rope_theta) and m.rope_theta > 1)):
        raise ConfigError(f"model.rope_theta={m.rope_theta!r} is invalid; it must be a RoPE base > 1 (e.g. 10000 or "
                          f"500000), or 0 for the tier's")
    _one_of("model.rope_scaling", m.rope_scaling, _ROPE_PARAMETERS)
    defaults = ModelConfig()
    for name in _ROPE_PARAMETERS["yarn"] + _ROPE_PARAMETERS["llama3"]:
        value = getattr(m, name)
        if name not in _ROPE_PARAMETERS[m.rope_scaling] and value != getattr(defaults, name):
            users = [s for s, names in _ROPE_PARAMETERS.items() if name in names]
            raise ConfigError(f"model.{name}={value!r} has no effect with model.rope_scaling={m.rope_scaling}; it "
                              f"applies to {' | '.join(users)}: set model.rope_scaling, or leave it at "
                              f"{getattr(defaults, name)!r}")
        _positive(f"model.{name}", value, zero_ok=name == "rope_original_max_len")
    if m.rope_scaling in ("yarn", "llama3"):
        if m.rope_factor < 1:
            raise ConfigError(f"model.rope_factor={m.rope_factor!r} is invalid with model.rope_scaling="
                              f"{m.rope_scaling}; it must be >= 1 (the context grows by that factor)")
        if m.rope_original_max_len < 1:
            raise ConfigError(f"model.rope_scaling={m.rope_scaling} needs model.rope_original_max_len, the context "
                              f"length the model was trained at before scaling (e.g. 4096)")
    if m.rope_scaling == "yarn" and not float(m.rope_factor * m.rope_original_max_len).is_integer():
        raise ConfigError(f"model.rope_factor={m.rope_factor!r} x model.rope_original_max_len="
                          f"{m.rope_original_max_len} is not a whole number of tokens; YaRN's scaled context must be "
                          f"(transformers derives the factor from it)")
    if m.rope_scaling == "yarn" and not m.rope_beta_fast > m.rope_beta_slow:
        raise ConfigError(f"model.rope_beta_fast={m.rope_beta_fast!r} must be greater than model.rope_beta_slow="
                          f"{m.rope_beta_slow!r} (YaRN's defaults: 32 and 1)")
    if m.rope_scaling == "llama3" and not m.rope_high_freq_factor > m.rope_low_freq_factor:
        raise ConfigError(f"model.rope_high_freq_factor={m.rope_high_freq_factor!r} must be greater than "
                          f"model.rope_low_freq_factor={m.rope_low_freq_factor!r} (Llama 3's defaults: 4 and 1)")


def model_tier(cfg: Config):
    """The tier cfg trains, with the model.* mixture-of-experts settings applied (model/tiers.py with_moe): what the
    model is built from, and what its parameters and FLOPs are counted from."""
    m = cfg.model
    return with_moe(get_mixer_tier(m.tier, m.mixer), num_experts=m.num_experts,
                    experts_per_token=m.experts_per_token, expert_ffn=m.expert_ffn, shared_experts=m.shared_experts,
                    dense_first_layers=m.dense_first_layers, renormalize=m.moe_renormalize,
                    selection_bias=m.moe_balance == "bias", capacity_factor=m.moe_capacity_factor)


_MOE_SHAPE = ("num_experts", "experts_per_token", "expert_ffn", "shared_experts", "dense_first_layers")
_MOE_SETTINGS = ("moe_balance", "moe_aux_weight", "moe_z_weight", "moe_bias_rate", "moe_capacity_factor",
                 "moe_renormalize")


def _validate_moe(cfg: Config) -> None:
    """model.* mixture-of-experts fields and train.expert_parallel_degree: one line naming the field and the fix."""
    m, t = cfg.model, cfg.train
    _one_of("model.moe_balance", m.moe_balance, ("aux", "bias"))
    for name in _MOE_SHAPE:
        if getattr(m, name) < -1:
            raise ConfigError(f"model.{name}={getattr(m, name)} is invalid; it must be >= 0, or -1 for the tier's")
    for name in ("moe_aux_weight", "moe_z_weight", "moe_bias_rate"):
        _positive(f"model.{name}", getattr(m, name), zero_ok=True)
    if not (m.moe_capacity_factor == 0 or (math.isfinite(m.moe_capacity_factor) and m.moe_capacity_factor >= 1)):
        raise ConfigError(f"model.moe_capacity_factor={m.moe_capacity_factor!r} is invalid; it must be 0 (dropless) "
                          "or >= 1 (a capacity below an expert's even share drops tokens at a perfect balance)")
    _positive("train.expert_parallel_degree", t.expert_parallel_degree)
    if m.tier not in tiers_for(m.mixer):
        return  # model.tier's own check names the tiers
    tier = model_tier(cfg)
    spec = tier.moe
    if spec is None:
        defaults = ModelConfig()
        changed = [f"model.{n}" for n in _MOE_SHAPE[1:] + _MOE_SETTINGS if getattr(m, n) != getattr(defaults, n)]
        if changed:
            raise ConfigError(f"{changed[0]} is set, but model.tier={m.tier} has no experts (a dense tier, or "
                              f"model.num_experts=0); set model.num_experts (e.g. 8) or choose a -moe tier "
                              f"({', '.join(n for n, x in tiers_for(m.mixer).items() if x.moe is not None)})")
        if t.expert_parallel_degree != 1:
            raise ConfigError(f"train.expert_parallel_degree={t.expert_parallel_degree} splits experts, but "
                              f"model.tier={m.tier} is dense; leave it at 1 or choose a -moe tier")
        return
    E, k = spec.num_experts, spec.experts_per_token
    if E < 2:
        raise ConfigError(f"model.num_experts={E} is invalid; a mixture needs >= 2 experts (0 = a dense MLP)")
    if not 1 <= k <= E:
        raise ConfigError(f"model.experts_per_token={k} is invalid; it must be in 1..{E} (model.num_experts)")
    if spec.expert_ffn < 8 or spec.expert_ffn % 8:
        raise ConfigError(f"model.expert_ffn={spec.expert_ffn} is invalid; it must be a positive multiple of 8 "
                          f"(grouped GEMMs want 16-byte aligned rows), e.g. {max(8, spec.expert_ffn // 8 * 8)}")
    if spec.dense_first_layers >= tier.n_layers:
        raise ConfigError(f"model.dense_first_layers={spec.dense_first_layers} leaves no MoE layer in model.tier="
                          f"{m.tier} ({tier.n_layers} layers); it must be < {tier.n_layers}")
    ep = t.expert_parallel_degree
    if E % ep:
        raise ConfigError(f"train.expert_parallel_degree={ep} does not divide model.num_experts={E}: each worker of "
                          f"an expert group holds E / degree experts; choose a divisor of {E}")
    if ep == 1:
        return
    cp, workers = t.context_parallel_degree, cfg.ray.num_workers
    if workers % (ep * cp):
        more = f" x train.context_parallel_degree={cp}" if cp > 1 else ""
        raise ConfigError(f"ray.num_workers={workers} is not a multiple of train.expert_parallel_degree={ep}{more}: "
                          f"the workers form whole expert groups of {ep * cp} (each group holds every expert once); "
                          f"set ray.num_workers to a multiple of {ep * cp} (e.g. "
                          f"{ep * cp * max(1, workers // (ep * cp))}), or change the degree")


def worker_group(cfg: Config) -> int:
    """The workers that must come and go together: a context group (train.context_parallel_degree) times the
    expert-parallel degree (one copy of every expert); 1 without either."""
    return cfg.train.context_parallel_degree * cfg.train.expert_parallel_degree


def _check_mixture(text: str) -> None:
    from pipeline.mixture_spec import MixtureSpecError, parse_mixture

    try:
        parse_mixture(text)
    except MixtureSpecError as exc:
        raise ConfigError(str(exc)) from None


def _validate_spikes(t: TrainConfig) -> None:
    """train.spike_*: one line naming the field and what is allowed."""
    _one_of("train.spike_action", t.spike_action, ("skip", "apply", "off"))
    _positive("train.spike_sigmas", t.spike_sigmas)
    if t.spike_window < 2:
        raise ConfigError(f"train.spike_window={t.spike_window} is invalid; it must be >= 2 (steps the mean and "
                          f"deviation are taken over; OLMo-core's 128)")
    if t.spike_warmup_steps < 2:
        raise ConfigError(f"train.spike_warmup_steps={t.spike_warmup_steps} is invalid; it must be >= 2 (a deviation "
                          f"needs two steps)")
    for key in ("spike_rewind_window", "spike_skip_steps"):
        _positive(f"train.{key}", getattr(t, key))
    for key in ("spike_rewind_outliers", "spike_recover_steps", "spike_max_rewinds"):
        _positive(f"train.{key}", getattr(t, key), zero_ok=True)


def _validate_context_parallel(cfg: Config) -> None:
    """train.context_parallel_degree: one line, before any worker starts, for a combination that cannot run."""
    cp, r, d, m = cfg.train.context_parallel_degree, cfg.ray, cfg.data, cfg.model
    if cp == 1:
        return
    if r.num_workers % cp:
        raise ConfigError(f"ray.num_workers={r.num_workers} is not a multiple of train.context_parallel_degree={cp}: "
                          f"each row is split over {cp} workers; set ray.num_workers to a multiple of {cp} (e.g. "
                          f"{cp * max(1, r.num_workers // cp)}), or change the degree")
    if d.seq_len % cp:
        raise ConfigError(f"data.seq_len={d.seq_len} does not split into {cp} equal slices "
                          f"(train.context_parallel_degree={cp}); choose a seq_len that is a multiple of {cp}")
    if m.mixer == "attention" and m.attention in ("varlen", "cudnn"):
        raise ConfigError(f"model.attention={m.attention} cannot attend across a row split over workers "
                          f"(train.context_parallel_degree={cp}); choose model.attention auto, flex, sdpa or dense")


def rows_per_step(cfg: Config) -> int:
    """Rows of the global batch, one optimizer step: train.batch_size x train.grad_accum x the data-parallel ranks,
    ray.num_workers / train.context_parallel_degree (the workers of a context group share their rows)."""
    t = cfg.train
    return t.batch_size * t.grad_accum * (cfg.ray.num_workers // t.context_parallel_degree)


def one_process_refusal(degree: int, what: str = "context") -> str:
    """Why a run in one plain process (--no-ray) cannot take train.context_parallel_degree > 1 (what="context") or
    train.expert_parallel_degree > 1 (what="experts"), and what to run."""
    key, splits = (("train.context_parallel_degree", "each row") if what == "context" else
                   ("train.expert_parallel_degree", "the experts"))
    return (f"{key}={degree} splits {splits} over {degree} workers, and --no-ray trains in one "
            f"process; drop --no-ray and train on Ray with --ray.num_workers={degree} (or a multiple of it), or set "
            f"{key}=1")


def elastic_worker_counts(cfg: Config) -> list[int]:
    """The worker counts from 1 to ray.num_workers that keep the global batch (train.batch_size x train.grad_accum
    x ray.num_workers sequences per optimizer step) with a whole number of micro-batches per worker; under context
    parallelism (degree d) only whole context groups: multiples of d, the micro-batches counted per group."""
    r, t = cfg.ray, cfg.train
    cp, unit = t.context_parallel_degree, worker_group(cfg)  # split experts: whole expert groups too
    return [w for w in range(unit, r.num_workers + 1, unit) if (t.grad_accum * r.num_workers // cp) % (w // cp) == 0]


def _validate_elastic(cfg: Config) -> None:
    """An elastic range (ray.min_workers > 0): MIN <= MAX, every count in it keeps the global batch, and a placement
    Ray's elastic sizing can follow."""
    r, t = cfg.ray, cfg.train
    if r.min_workers < 0:
        raise ConfigError(f"ray.min_workers={r.min_workers} is invalid; it must be >= 0 (0 = a fixed ray.num_workers)")
    if not r.min_workers:
        return
    text = f"ray.num_workers={r.min_workers}-{r.num_workers}"
    if r.min_workers > r.num_workers:
        raise ConfigError(f"{text}: MIN ({r.min_workers}) is more than MAX ({r.num_workers}); write MIN-MAX with "
                          f"MIN <= MAX, e.g. {r.num_workers}-{r.min_workers}")
    cp = t.context_parallel_degree
    if r.min_workers % cp:
        raise ConfigError(f"{text}: an elastic range keeps whole context groups (train.context_parallel_degree={cp}), "
                          f"so MIN must be a multiple of {cp} too; write e.g. {cp * max(1, r.min_workers // cp)}-"
                          f"{r.num_workers}")
    ep, unit = t.expert_parallel_degree, worker_group(cfg)
    if ep > 1 and (r.min_workers % unit or r.num_workers % unit):
        more = f" x train.context_parallel_degree={cp}" if cp > 1 else ""
        raise ConfigError(f"{text}: an elastic range keeps whole expert groups (train.expert_parallel_degree={ep}"
                          f"{more}), so MIN and MAX must be multiples of {unit}; write e.g. "
                          f"{unit * max(1, r.min_workers // unit)}-{unit * max(1, r.num_workers // unit)}")
    can = elastic_worker_counts(cfg)
    cannot = [w for w in range(r.min_workers, r.num_workers + 1, unit) if w not in can]
    if cannot:
        rows = r.num_workers // cp  # rows per micro-batch step at MAX: one per context group
        global_batch = t.batch_size * t.grad_accum * rows
        want = math.lcm(*range(r.min_workers // cp, rows + 1))
        accum = want // math.gcd(want, rows)  # the least grad_accum x MAX groups that every group count divides
        per = f" in context groups of {cp}" if cp > 1 else ""
        raise ConfigError(
            f"{text} cannot keep the global batch of {global_batch} sequences per step (train.batch_size="
            f"{t.batch_size} x train.grad_accum={t.grad_accum} x {rows} {'context groups' if cp > 1 else 'workers'}) "
            f"at {', '.join(map(str, cannot))} worker(s){per}; the counts that can: {', '.join(map(str, can))}; pick "
            f"MIN-MAX with only those between them, or set train.grad_accum to a multiple of {accum} (a global batch "
            f"of {t.batch_size * accum * rows} fits every count from {r.min_workers} to {r.num_workers})")
    if r.placement_strategy == "STRICT_SPREAD":
        raise ConfigError(f"{text} with ray.placement_strategy=STRICT_SPREAD: Ray sizes an elastic group by the "
                          f"resources of each node, which a one-worker-per-node placement cannot follow; use PACK or "
                          f"SPREAD (ray.cpus_per_worker sized to a node's CPUs gives one worker per node)")


_TASK_NAME = re.compile(r"^[^\s,]+$")


def eval_task_names(text: str) -> list[str]:
    """eval.tasks split at commas (spaces around them allowed): ["builtin_cloze", "hellaswag", "my/task.yaml"]."""
    return [t.strip() for t in text.split(",") if t.strip()]


def _validate_eval(e: EvalConfig) -> None:
    """The eval section: task names without spaces, and numbers in range. Whether a task exists is checked when the
    run starts (pipeline/eval/harness_tasks.py), where the harness's registry and the YAML files are at hand."""
    if e.tasks.strip() and (not eval_task_names(e.tasks) or any(not _TASK_NAME.match(t) or t.startswith("-")
                                                                 for t in eval_task_names(e.tasks))):
        raise ConfigError(f"eval.tasks={e.tasks!r} is invalid; give task names or task YAML paths separated by "
                          f"commas, e.g. builtin_cloze,hellaswag")
    if e.num_fewshot < -1:
        raise ConfigError(f"eval.num_fewshot={e.num_fewshot} is invalid; it must be >= 0, or -1 for each task's own")
    if not (math.isfinite(e.limit) and (e.limit == 0 or 0 < e.limit < 1 or (e.limit >= 1 and e.limit.is_integer()))):
        raise ConfigError(f"eval.limit={e.limit} is invalid; give 0 (every example), a count >= 1, or a share in "
                          f"(0, 1)")
    _positive("eval.every_checkpoints", e.every_checkpoints)
    _positive("eval.cpus", e.cpus, zero_ok=True)
    if not (math.isfinite(e.gpus) and 0 <= e.gpus <= 1):
        raise ConfigError(f"eval.gpus={e.gpus} is invalid; it must be in [0, 1] (a fraction shares a GPU with a "
                          f"worker)")
    _positive("eval.timeout_s", e.timeout_s, zero_ok=True)


# ----------------------------------------------------------------------------------------------
# Presets: small named functions deriving from the base. `default_preset()` picks by hardware.

def _cpu() -> dict[str, Any]:
    """Runs anywhere in minutes: nano tier, 256-token rows, a 2,000-piece tokenizer; a cloze task made from the
    held-out documents scored at each checkpoint (docs/evaluation.md)."""
    return {"model.tier": "nano", "data.vocab_size": 2000, "data.seq_len": 256, "train.batch_size": 8,
            "train.max_steps": 200, "train.lr": 3e-3, "eval.tasks": "builtin_cloze"}


def _gpu() -> dict[str, Any]:
    """One GPU, the default with CUDA: tier B at up to 32k context, sized to its data (pipeline/train/session/sizing.py): a
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
    """The smallest thing that trains end to end; used by the test suite (without deduplication: its corpora hold no
    copies, and deduplication's Ray Data stages would add seconds to each of its prepares; its own tests set it)."""
    return {"model.tier": "nano", "data.vocab_size": 512, "data.seq_len": 64, "data.max_documents": 100,
            "data.dedup": "none",
            "data.rows_per_shard": 16, "train.batch_size": 4, "train.max_steps": 8, "train.warmup_steps": 2,
            "train.log_every": 2, "train.eval_every": 4, "train.eval_batches": 2, "train.checkpoint_every": 4,
            "train.sample_tokens": 8}


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def _long_32k() -> dict[str, Any]:
    """The context-extension recipe (docs/long-context.md), two phases (_long_32k_phases) on the built-in corpus:
    train short at RoPE base 10,000, then extend with YaRN and a re-warmup, tokens per step kept. On a GPU tier A at
    4,096 then 32,768 tokens (8x); on a CPU nano at 256 then 1,024 (4x), a few minutes."""
    if _cuda():
        return {"model.tier": "A", "model.rope_theta": 10_000.0, "data.vocab_size": 32000, "data.seq_len": 4096,
                "data.val_fraction": 0.1,  # the built-in corpus packs into ~19 rows of 32k: keep ~2 for validation
                "train.batch_size": 8, "train.grad_accum": 1, "train.max_steps": 80, "train.lr": 1e-3,
                "train.warmup_steps": 10, "train.log_every": 5, "train.eval_every": 20, "train.checkpoint_every": 40,
                "ray.use_gpu": "true"}
    return {"model.tier": "nano", "model.rope_theta": 10_000.0, "data.vocab_size": 2000, "data.seq_len": 256,
            "train.batch_size": 8, "train.grad_accum": 1, "train.max_steps": 200, "train.lr": 3e-3,
            "train.warmup_steps": 20, "train.eval_every": 50, "train.checkpoint_every": 100}


def _long_32k_phases() -> list[dict[str, Any]]:
    """long-32k's phases: the short context at the preset's seq_len, then 8x longer (GPU: 4,096 -> 32,768) or 4x
    (CPU: 256 -> 1,024; nano's rows stay short enough to train in minutes) with YaRN over the short length."""
    short, long_, factor, steps = (4096, 32768, 8.0, (60, 20)) if _cuda() else (256, 1024, 4.0, (150, 50))
    return [{"name": "short", "steps": steps[0]},
            {"name": "long", "steps": steps[1], "lr_warmup_steps": max(1, steps[1] // 5),
             "overrides": {"data.seq_len": long_, "model.rope_scaling": "yarn", "model.rope_factor": factor,
                           "model.rope_original_max_len": short}}]


def _long_131k() -> dict[str, Any]:
    """Long-context pretraining's last phase (docs/long-context.md): rows four times longer than one worker holds,
    split over the workers (train.context_parallel_degree). On GPUs tier B on FineWeb-Edu over 8 workers: 32,768-token
    rows data-parallel, then 131,072 as data 2 x context 4, the smallest degree the plan gives on 80 GB
    (`python -m pipeline.train.max_batch --tier B --seq-len 131072 --workers 8 --memory-limit-gib 80`); on a CPU nano
    on the built-in corpus over 2 workers, 512 then 2,048 tokens as context 2 (_long_131k_phases)."""
    if _cuda():
        return {**_gpu(), **FINEWEB_32K, "data.max_documents": 400_000, "train.batch_size": 1, "train.grad_accum": 1,
                "train.max_steps": 1250, "train.max_epochs": 0.0, "train.eval_every": 250,
                "train.checkpoint_every": 250, "ray.num_workers": 8}
    return {"model.tier": "nano", "data.vocab_size": 2000, "data.seq_len": 512, "train.batch_size": 4,
            "train.grad_accum": 1, "train.max_steps": 130, "train.lr": 3e-3, "train.warmup_steps": 10,
            "train.eval_every": 50, "train.checkpoint_every": 50, "ray.num_workers": 2}


def _long_131k_phases() -> list[dict[str, Any]]:
    """long-131k's phases: the short rows data-parallel, then 4x longer rows split over the workers, tokens per step
    kept (GPU: 1,000 steps at 32,768 then 250 at 131,072 over context 4; CPU: 100 at 512 then 30 at 2,048 over 2)."""
    short, long_, cp, steps = (32768, 131072, 4, (1000, 250)) if _cuda() else (512, 2048, 2, (100, 30))
    return [{"name": "short", "steps": steps[0]},
            {"name": "long", "steps": steps[1], "lr_warmup_steps": max(1, steps[1] // 5),
             "overrides": {"data.seq_len": long_, "train.context_parallel_degree": cp}}]


PRESETS = {"cpu": _cpu, "gpu": _gpu, "fineweb-32k": _fineweb_32k, "long-32k": _long_32k, "long-131k": _long_131k,
           "test": _test}
# presets that are several phases (pipeline/train/session/train_session.py)
PRESET_PHASES = {"long-32k": _long_32k_phases, "long-131k": _long_131k_phases}


def preset_phases(name: str) -> list[dict[str, Any]] | None:
    """The phases a named preset runs ([{steps, overrides, ...}], as a --phases file lists them), or None."""
    make = PRESET_PHASES.get(name)
    return make() if make is not None else None


def default_preset() -> str:
    """`gpu` when CUDA is present, `cpu` otherwise. A CPU build of torch is told apart by its version file, without
    importing torch (~3 s on 2 cores: a refused command line should not wait for it)."""
    if not torch_build_has_gpu(_torch_version_text()):
        return "cpu"
    import torch

    return "gpu" if torch.cuda.is_available() else "cpu"


def _torch_version_text() -> str | None:
    """The text of the installed torch/version.py (None when it cannot be read: then torch itself is asked)."""
    import importlib.util

    for folder in getattr(importlib.util.find_spec("torch"), "submodule_search_locations", None) or []:
        try:
            return (Path(folder) / "version.py").read_text()
        except OSError:
            pass
    return None


def torch_build_has_gpu(version_text: str | None) -> bool:
    """False for a torch built for neither CUDA nor ROCm (`cuda` and `hip` None in torch/version.py, as in
    `2.13.0+cpu`), where torch.cuda.is_available() is always False; True otherwise (unknown text included)."""
    if version_text is None:
        return True
    builds = dict(re.findall(r"^(cuda|hip)\b[^=\n]*=\s*(.+?)\s*$", version_text, re.M))
    return set(builds) != {"cuda", "hip"} or any(v != "None" for v in builds.values())


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


def load_config(preset_name: str | None = None, overrides: list[str] | dict[str, Any] | None = None, *,
                one_process: bool = False) -> Config:
    """The preset (default: by hardware) with overrides applied, validated. `one_process` (train --no-ray): a
    context-parallel degree is refused first, with the line that says what to run instead, rather than as a worker
    count that --no-ray would refuse in turn."""
    base = preset(preset_name or default_preset())
    if isinstance(overrides, list):
        overrides = parse_overrides(overrides)
    overrides = overrides or {}
    if one_process:
        degree = int(overrides.get("train.context_parallel_degree", base.train.context_parallel_degree))
        if degree > 1:
            raise ConfigError(one_process_refusal(degree))
        degree = int(overrides.get("train.expert_parallel_degree", base.train.expert_parallel_degree))
        if degree > 1:
            raise ConfigError(one_process_refusal(degree, "experts"))
    return base.replace(overrides)


# ------------------------------------------------------------------------------------------ settings left unused
class IgnoredSettingError(ConfigError):
    """A flag or field the command would not use; the message names it and what to do instead."""


# Fields only some data sources read: the one table of them (pipeline/mixture_spec.py SOURCE_KIND_FIELDS).
_SOURCE_FIELDS = {f"data.{field}": set(kinds) for field, kinds in FIELD_SOURCE_KINDS.items()}


def unused_by_source(source: str, keys: Any, where: str = "") -> None:
    """IgnoredSettingError for a data field in `keys` that data.source=`source` does not read (`where`: the phase
    or file that set it, for the message)."""
    for key in keys:
        readers = _SOURCE_FIELDS.get(key)
        if readers and source not in readers:
            raise IgnoredSettingError(f"{where}{key} is set, but data.source={source} does not read it (it is for "
                                      f"data.source={' or '.join(sorted(readers))}); set data.source, or drop {key}")


def unused_by_mixer(mixer: str, keys: Any, where: str = "") -> None:
    """IgnoredSettingError for a RoPE field (model.rope_*) in `keys` when model.mixer=`mixer` has no RoPE (the
    resonance family: its kernel is its position code). `where`: the phase, run or file that set it."""
    if mixer == "attention":
        return
    for key in keys:
        if str(key).startswith("model.rope_"):
            raise IgnoredSettingError(f"{where}{key} is set, but model.mixer={mixer} has no RoPE (its kernel is its "
                                      f"position code), so no RoPE setting is used; drop {key}, or train "
                                      f"model.mixer=attention")
