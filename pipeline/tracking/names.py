"""The stable names of what a run records in MLflow: params, metrics and tags (the MLflow client that logs them is
pipeline/tracking/tracker.py). Plain strings, importing nothing: the Ray-free engine and the Ray Train workers name
their metrics with them without importing MLflow.

    from pipeline.tracking.names import PARAM_WORLD_SIZE, TRAIN_LOSS, TRAIN_LR
    tracker.log_config({PARAM_WORLD_SIZE: 2})
    tracker.log_metrics({TRAIN_LOSS: 3.2, TRAIN_LR: 3e-3}, step=10)

Stable names (the MLflow UI compares runs and sweep trials column by column, so these never change):

| kind   | name                       | meaning                                                        |
|--------|----------------------------|----------------------------------------------------------------|
| param  | `<section>.<field>`        | every config field path from `cfg.flat()`, e.g. `train.batch_size`, `model.tier` |
| param  | `model.params`             | exact trainable parameter count                                |
| param  | `model.active_params`      | parameters one token uses: model.params less the routed experts it does not run (= model.params for a dense model) |
| param  | `world_size`               | number of data-parallel training workers                       |
| param  | `tokenizer_sha256`         | sha256 of the SentencePiece model file                         |
| param  | `manifest_hash`            | content hash of the shard manifest (the dataset identity)      |
| param  | `git_commit`               | `git rev-parse HEAD` (+ `-dirty`) of the code that ran         |
| metric | `train/loss`               | mean token cross-entropy over the logging window (nats)        |
| metric | `train/ppl`                | exp(train/loss)                                                |
| metric | `train/lr`                 | learning rate at the step                                      |
| metric | `train/grad_norm`          | global gradient L2 norm before clipping                        |
| metric | `train/tokens_per_s`       | training tokens per second, all workers together               |
| metric | `train/tokens_per_s_per_gpu` | the same per worker (train/tokens_per_s / world_size)        |
| metric | `train/mfu`                | model FLOPs utilisation, fraction of peak (0..1), per GPU: executed FLOPs over world_size x peak |
| metric | `train/hfu`                | train/mfu plus the forward activation checkpointing recomputes (hardware FLOPs) |
| metric | `train/tflops_per_gpu`     | executed model FLOPs per second per worker (TFLOP/s; also on a CPU) |
| metric | `train/peak_mem_gib`       | peak accelerator memory on rank 0 (GiB)                        |
| metric | `train/tokens_seen`        | training tokens consumed so far, all workers together          |
| metric | `train/accuracy`           | next-token top-1 accuracy over the logging window (0..1)       |
| metric | `train/bad_steps`          | optimizer steps skipped so far for a non-finite loss/gradient  |
| metric | `train/spike_skips`        | loss-spike outlier steps that applied no update so far (train.spike_action=skip; pipeline/train/spike_guard.py) |
| metric | `train/spike_rewinds`      | rewinds past a loss spike so far in the run (pipeline/train/spike_rewind.py) |
| metric | `train/data_wait`          | share of the logging window's wall clock spent waiting for the next batch (0..1) |
| metric | `eval/data_wait`           | share of an evaluation's wall clock waiting for validation batches (0..1) |
| metric | `val/loss`                 | mean token cross-entropy on the validation split (nats)        |
| metric | `val/ppl`                  | exp(val/loss)                                                  |
| metric | `val/accuracy`             | next-token top-1 accuracy on the validation split (0..1)       |
| metric | `val/<source>/loss`, `ppl`, `bpb`, `accuracy` | a mixture: each source's validation split (bpb: bits per UTF-8 byte); val/loss, val/ppl and val/accuracy are then the aggregate weighted by the mixture |
| param  | `mixture/<source>/weight`, `mixture/<source>/repetitions` | a mixture: each source's share of the training tokens and the passes over its data the run makes (phase i > 0: `phase<i>/mixture/...`) |
| metric | `eval/loss`, `eval/ppl`, `eval/accuracy` | the `eval` stage on the whole validation split, at the checkpoint's step |
| metric | `val/pos_loss/<lo>-<hi>`, `val/pos_docs/…`, `val/pos_tokens/…`, `val/cum_ppl/<L>` | loss by position in the document at each evaluation (train.eval_by_position; pipeline/eval/positions.py) |
| metric | `eval/pos_*`, `eval_<k>x/*`, `passkey/*` | the eval stage's --by-position, --seq-len kx and --passkey (pipeline/eval/long_context.py) |
| artifact | `position_loss.png`, `passkey_heatmap.png`, `passkey_grid.json` | pipeline/tracking/long_context_plots.py |
| metric | `eval/<task>/<metric>`, `eval/<task>/<metric>_stderr` | an lm-evaluation-harness task (eval.tasks, `eval --tasks`) at the checkpoint's step: acc, acc_norm, word_perplexity, bits_per_byte, ... and their standard errors (pipeline/eval/harness_tasks.py) |
| metric | `eval/<task>/seconds`      | how long that task's scoring took (its requests and metrics)  |
| tag    | `longtrain.eval_task.<task>` | `ok at step N`, or `FAILED at step N: <reason>` for a task that could not be scored |
| artifact | `eval_tasks.png`           | each task's metrics over the steps (pipeline/tracking/task_curves.py) |
| metric | `moe/aux_loss`, `moe/z_loss` | a mixture of experts: the load-balancing loss (mean over MoE layers; 1 at a perfect balance; measured with model.moe_balance=bias too) and the router z-loss, over the logging window |
| metric | `moe/load_max`, `moe/load_min`, `moe/dropped`, `moe/bias_abs_max` | the worst MoE layer's largest and smallest expert load over the mean load, the share of assignments the capacity dropped, the largest selection bias |
| metric | `moe/layer<ii>/load_max`, `load_min`, `entropy`, `dropped`, `bias_abs_max` | the same per MoE layer (block index ii), and its mean router entropy (nats; ln E at a uniform router) |
| artifact | `expert_load.png`, `expert_load.json` | the load of every expert of every MoE layer over the steps (pipeline/tracking/expert_load_plot.py) |
| metric | `system/*`                 | MLflow's system metrics (CPU %, memory, disk, network; GPU % and memory with pynvml), every `tracking.system_metrics_interval_s` |
| metric | `train/world_size`         | training workers at the step (an elastic run's changes with the nodes it has) |
| metric | `train/steps_redone`       | after a restart: steps between its checkpoint and the last step logged before it |
| metric | `train/resume_s`           | after a restart: seconds from the last step logged before it to the first one after |
| tag    | `mlflow.experimentKind` (experiment) | `custom_model_development`: MLflow 3's UI opens the runs table, not the GenAI overview |
| tag    | `longtrain.tier`, `mlflow.source.git.commit` | a new run's model.tier and the code's commit (git_commit) |
| tag    | `longtrain.kernels`        | the backend each cuda_ops kernel family ran, and why when not Numba's |
| tag    | `longtrain.nonfinite_metrics_skipped` | metric values not logged because they were NaN or inf |
| tag    | `longtrain.registered_model` | on a run whose export was registered: `<name>/<version>` (lineage.py) |
| tag    | `longtrain.parallel`       | how the workers shared the model (none, ddp, fsdp) and why (train.parallel=auto decides) |
| tag    | `longtrain.mesh`           | the workers and the data x context mesh the run trains on, and since which step when a resume changed them (the params keep the first values) |
| tag    | `longtrain.spike.<n>`      | the run's n-th loss-spike event (000, 001, ...): skip, applied outlier, rewind or stop, as its console line says it (the step, the loss against the threshold, the rows skipped) |
| tag    | `longtrain.restart`        | the latest restart of the worker group: its size before and after, why, the steps redone |
| tag    | `longtrain.extended`, `longtrain.max_steps` | a resume that extended the run: the schedule's stretch, and the steps it now trains to (param `train.max_steps` keeps its first value) |
| param  | `dedup/mode`, `dedup/documents_read`, `dedup/removed_exact`, `dedup/removed_near`, `dedup/clusters_exact`, `dedup/clusters_near`, `dedup/kept` (near: `dedup/threshold`, `ngram`, `bands`, `rows`) | the dataset's deduplication (data.dedup): settings and counts from its manifest; a mixture: `dedup/<source>/...` and `dedup/shared/<a>/<b>`, the documents two sources shared (lineage.py) |
| input  | dataset                    | the prepared dataset: name, digest = manifest settings hash, source, profile (lineage.py); a mixture: one per source, tagged with its name and weight |

Metrics are logged at the optimizer step (`step=`). Nested runs carry the MLflow tag `mlflow.parentRunId`.
"""

# --- params -----------------------------------------------------------------------------------
PARAM_MODEL_PARAMS = "model.params"
PARAM_MODEL_ACTIVE_PARAMS = "model.active_params"  # a mixture of experts: what one token runs (model/flops.py)
PARAM_MODEL_TIER = "model.tier"  # also a config field; named here because sweeps group by it
PARAM_WORLD_SIZE = "world_size"
PARAM_TOKENIZER_SHA256 = "tokenizer_sha256"
PARAM_MANIFEST_HASH = "manifest_hash"
PARAM_GIT_COMMIT = "git_commit"
EXTRA_PARAMS = (PARAM_MODEL_PARAMS, PARAM_MODEL_ACTIVE_PARAMS, PARAM_WORLD_SIZE, PARAM_TOKENIZER_SHA256,
                PARAM_MANIFEST_HASH, PARAM_GIT_COMMIT)

# --- metrics ----------------------------------------------------------------------------------
TRAIN_LOSS = "train/loss"
TRAIN_PPL = "train/ppl"
TRAIN_LR = "train/lr"
TRAIN_GRAD_NORM = "train/grad_norm"
TRAIN_TOKENS_PER_S = "train/tokens_per_s"
TRAIN_TOKENS_PER_S_PER_GPU = "train/tokens_per_s_per_gpu"
TRAIN_MFU = "train/mfu"  # FLOPs executed (attention within documents under doc masking) over the peak
TRAIN_HFU = "train/hfu"  # + the forward recomputed by activation checkpointing
TRAIN_TFLOPS_PER_GPU = "train/tflops_per_gpu"
TRAIN_MFU_CAUSAL_EQUIV = "train/mfu_causal_equiv"  # whole-row causal attention counted, as other tools do
TRAIN_EXECUTED_FLOPS_PER_TOKEN = "train/executed_flops_per_token"
TRAIN_PEAK_MEM_GIB = "train/peak_mem_gib"  # the largest of any worker since the run's engine started
# Steady state (pipeline/train/engine.py STEADY_AFTER_STEPS): after the first optimizer steps of the process (compile,
# warm-up), time inside the steps only; train/steady_steps says how many steps that is.
TRAIN_STEADY_TOKENS_PER_S = "train/steady_tokens_per_s"
TRAIN_STEADY_MFU = "train/steady_mfu"
TRAIN_STEADY_STEPS = "train/steady_steps"
TRAIN_TOKENS_SEEN = "train/tokens_seen"
TRAIN_ACCURACY = "train/accuracy"
TRAIN_BAD_STEPS = "train/bad_steps"
TRAIN_DATA_WAIT = "train/data_wait"  # measured by pipeline/train/loop.py
TRAIN_SPIKE_SKIPS = "train/spike_skips"  # outlier steps skipped so far on the run's timeline (a rewind rolls it back)
TRAIN_SPIKE_REWINDS = "train/spike_rewinds"  # rewinds past a loss spike so far in the run
TRAIN_WORLD_SIZE = "train/world_size"  # an elastic run's changes as nodes come and go (pipeline/train/distributed/elastic.py)
TRAIN_STEPS_REDONE = "train/steps_redone"  # logged once after each restart of the worker group
TRAIN_RESUME_S = "train/resume_s"
EVAL_DATA_WAIT = "eval/data_wait"  # measured by pipeline/train/loop.py
VAL_LOSS = "val/loss"
VAL_PPL = "val/ppl"
VAL_ACCURACY = "val/accuracy"
EVAL_LOSS = "eval/loss"  # the eval stage on the whole validation split, at the checkpoint's step
EVAL_PPL = "eval/ppl"
EVAL_ACCURACY = "eval/accuracy"
# A mixture of experts (pipeline/train/moe_balance.py): over the logging window, all workers' tokens
MOE_AUX_LOSS = "moe/aux_loss"
MOE_Z_LOSS = "moe/z_loss"
MOE_LOAD_MAX = "moe/load_max"  # the worst MoE layer's max over mean expert load (1 = perfectly even)
MOE_LOAD_MIN = "moe/load_min"  # the worst MoE layer's min over mean expert load
MOE_DROPPED = "moe/dropped"  # share of all MoE layers' assignments the capacity factor dropped
MOE_BIAS_ABS_MAX = "moe/bias_abs_max"  # model.moe_balance=bias: the largest |selection bias| of any expert
# per MoE layer: moe_layer_metric(block index, one of these)
MOE_LAYER_FIELDS = ("load_max", "load_min", "entropy", "dropped", "bias_abs_max")


def moe_layer_metric(layer: int, field: str) -> str:
    """`moe/layer<ii>/<field>` for block `layer` (zero-padded, so the MLflow UI sorts the layers in order)."""
    if field not in MOE_LAYER_FIELDS:
        raise ValueError(f"unknown MoE layer metric {field!r}; known: {', '.join(MOE_LAYER_FIELDS)}")
    return f"moe/layer{layer:02d}/{field}"


METRICS = (TRAIN_LOSS, TRAIN_PPL, TRAIN_LR, TRAIN_GRAD_NORM, TRAIN_TOKENS_PER_S, TRAIN_TOKENS_PER_S_PER_GPU,
           TRAIN_MFU, TRAIN_HFU, TRAIN_TFLOPS_PER_GPU, TRAIN_MFU_CAUSAL_EQUIV, TRAIN_EXECUTED_FLOPS_PER_TOKEN,
           TRAIN_PEAK_MEM_GIB, TRAIN_TOKENS_SEEN, TRAIN_ACCURACY, TRAIN_BAD_STEPS, TRAIN_STEADY_TOKENS_PER_S,
           TRAIN_STEADY_MFU, TRAIN_STEADY_STEPS, TRAIN_DATA_WAIT, TRAIN_WORLD_SIZE, TRAIN_STEPS_REDONE, TRAIN_RESUME_S,
           TRAIN_SPIKE_SKIPS, TRAIN_SPIKE_REWINDS, VAL_LOSS, VAL_PPL, VAL_ACCURACY, EVAL_DATA_WAIT, MOE_AUX_LOSS,
           MOE_Z_LOSS, MOE_LOAD_MAX, MOE_LOAD_MIN, MOE_DROPPED, MOE_BIAS_ABS_MAX)

# Metric families: a prefix (the split or stage: val, eval, eval_2x, ...), then what is measured. These functions are
# the one spelling of each family; nothing else writes a metric name out (tests/test_docs.py looks).
VAL, EVAL = "val", "eval"  # the training loop's evaluations, the eval stage's
LOSS, PPL, ACCURACY, BPB = "loss", "ppl", "accuracy", "bpb"  # nats, exp(loss), top-1 (0..1), bits per UTF-8 byte
ROWS = "rows"  # the rows an evaluation scored (eval_<k>x/rows)
POS_LOSS, POS_DOCS, POS_TOKENS, CUM_PPL = "pos_loss", "pos_docs", "pos_tokens", "cum_ppl"  # pipeline/eval/positions.py


def split_metric(prefix: str, measure: str, source: str | None = None) -> str:
    """`<prefix>/<measure>`, or `<prefix>/<source>/<measure>` for one source of a mixture: val/loss, eval_2x/ppl,
    val/web/bpb."""
    return f"{prefix}/{source}/{measure}" if source else f"{prefix}/{measure}"


def longer_rows_prefix(factor: int) -> str:
    """The prefix of the eval stage's measures on rows `factor` times the trained length: eval_2x."""
    return f"{EVAL}_{factor}x"


def position_metric(prefix: str, kind: str, where: str) -> str:
    """Loss by position in the document: `<prefix>/pos_loss|pos_docs|pos_tokens/<lo>-<hi>`, `<prefix>/cum_ppl/<L>`."""
    return f"{prefix}/{kind}/{where}"


def is_position_metric(name: str) -> bool:
    return any(f"/{kind}/" in name for kind in (POS_LOSS, POS_DOCS, POS_TOKENS, CUM_PPL))


PASSKEY, DIGIT_ACCURACY = "passkey", "digit_accuracy"  # passkey/accuracy (every cell), passkey/digit_accuracy


def accuracy_at_length(prefix: str, length: int) -> str:
    """<prefix>/accuracy/<length>: the passkey grid's accuracy over the depths at one context length."""
    return f"{prefix}/{ACCURACY}/{length}"


# Downstream tasks scored by lm-evaluation-harness (pipeline/eval/harness_tasks.py): eval/<task>/<metric> at the
# checkpoint's step, its standard error beside it, and a tag per task saying whether it was scored.
STDERR_SUFFIX = "_stderr"
TASK_STATUS_TAG_PREFIX = "longtrain.eval_task."
TASK_FAILED = "FAILED"


def task_metric(task: str, metric: str) -> str:
    """eval/<task>/<metric>: a harness task's metric (acc, acc_norm, bits_per_byte, ...), e.g. eval/hellaswag/acc."""
    return f"{EVAL}/{task}/{metric}"


def task_stderr(task: str, metric: str) -> str:
    """eval/<task>/<metric>_stderr: the standard error the harness gives for that metric."""
    return task_metric(task, metric + STDERR_SUFFIX)


def parse_task_metric(name: str) -> tuple[str, str] | None:
    """(task, metric) of a name task_metric spells (eval/<task>/<metric>), else None."""
    parts = name.split("/")
    return (parts[1], parts[2]) if len(parts) == 3 and parts[0] == EVAL and all(parts) else None


def task_seconds(task: str) -> str:
    """eval/<task>/seconds: how long the task's scoring took (its requests and metrics, not loading the model)."""
    return task_metric(task, "seconds")


def task_status_tag(task: str) -> str:
    """longtrain.eval_task.<task>: `ok at step N` or `FAILED at step N: <reason>`."""
    return TASK_STATUS_TAG_PREFIX + task


# A sweep: what each trial reports to Tune beside the metrics (pipeline/sweep/trial.py), and the parent run's counts.
SWEEP_STATUS, SWEEP_REASON, SWEEP_MLFLOW_RUN_ID = "sweep/status", "sweep/reason", "sweep/mlflow_run_id"
SWEEP_TRIALS, SWEEP_BEST_METRIC = "sweep/trials", "sweep/best_metric"


def sweep_trials_with(status: str) -> str:
    """sweep/trials_<status>: how many trials ended with it (ok, oom, stopped, failed)."""
    return f"{SWEEP_TRIALS}_{status}"


# A dataset's deduplication, as params (pipeline/tracking/lineage.py): dedup/<key>, dedup/<source>/<key> for a mixture
# source, dedup/shared/<a>/<b> for the documents two sources shared.
def dedup_param(key: str, source: str | None = None) -> str:
    return f"dedup/{source}/{key}" if source else f"dedup/{key}"


def dedup_shared_param(a: str, b: str) -> str:
    return f"dedup/shared/{a}/{b}"

# --- tags -------------------------------------------------------------------------------------
PARALLEL_TAG = "longtrain.parallel"  # the mode the workers ran (a tag: a resume may change it)
KERNELS_TAG = "longtrain.kernels"  # the backend each cuda_ops kernel family ran, and why when not Numba's
ELASTIC_TAG = "longtrain.restart"  # what the latest restart of the worker group changed, and why
SPIKE_TAG_PREFIX = "longtrain.spike."  # + the event's index in the run: one tag per loss-spike event (its line)


def spike_tag(index: int) -> str:
    """longtrain.spike.<index>, three digits and more: the run's index-th loss-spike event."""
    return f"{SPIKE_TAG_PREFIX}{index:03d}"


# the workers and the data x context mesh the run trains on now, and since which step when a resume changed them (the
# params ray.num_workers and train.context_parallel_degree keep the values the run started with: MLflow params are
# written once)
MESH_TAG = "longtrain.mesh"
PARENT_RUN_TAG = "mlflow.parentRunId"  # what the MLflow UI nests child runs under
# MLflow 3's UI shows an experiment without this tag as a GenAI one (traces overview first); ours are model training
EXPERIMENT_KIND_TAG, EXPERIMENT_KIND = "mlflow.experimentKind", "custom_model_development"
NONFINITE_TAG = "longtrain.nonfinite_metrics_skipped"
TIER_TAG = "longtrain.tier"  # a new run's model.tier, set when the run is created
GIT_COMMIT_TAG = "mlflow.source.git.commit"  # MLflow's own tag for the code's commit (the UI shows it)
EXTENDED_TAG = "longtrain.extended"  # on a run whose schedule a resume stretched (pipeline/train/session/resume.py)
# beside it: the steps the extended run now trains to (the param train.max_steps is write-once and keeps the value the
# run started with)
MAX_STEPS_TAG = "longtrain.max_steps"
REGISTERED_TAG = "longtrain.registered_model"  # on the run an export registered: "<name>/<version>" (lineage.py)
# A mixture logs one dataset input per source (context "train", or "eval" for a source of weight 0) with these tags;
# the dataset's digest and profile carry its settings hash and tokenizer sha256 (lineage.py).
MIXTURE_SOURCE_TAG = "longtrain.mixture_source"
MIXTURE_WEIGHT_TAG = "longtrain.mixture_weight"
TOKENIZER_TAG = "longtrain.tokenizer_sha256"
