"""Training throughput of the Ray-free engine: tokens/s, MFU (on executed FLOPs and causal-equivalent),
peak memory, compile time and the share of step time spent waiting on data, for one tier / seq_len /
micro-batch / attention backend / document-length distribution. Data comes from real Parquet shards on
disk (synthetic rows written by pipeline.data.synthetic), read by the same ShardReader a single-GPU run
uses, so the data path is measured too.

    python bench/engine_throughput.py --tier B --seq-len 32768 --batch-size 1 --steps 20
    python bench/engine_throughput.py --tier B --seq-len 32768 --batch-size 2 --attention varlen --doc-len 8192
    python bench/engine_throughput.py --tier A --seq-len 32768 --batch-size max     # largest that fits
    python bench/engine_throughput.py --smoke                                       # tiny, CPU, seconds

--doc-len (pipeline/data/synthetic.py): web (default: log-normal, median 400 tokens, mean ~694, like web
text), a geometric mean such as 8192 (seq_len / 4 at 32k: the rows before), lognormal:MEDIAN:SIGMA, or
manifest:DATASET_DIR (fitted to the document lengths `prepare` recorded).

Runs without Ray or MLflow (torch, pyarrow, numba-cuda). Writes bench/results/engine_throughput-*.json.
"""
from __future__ import annotations

import argparse
import gc
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from bench.common import write_result  # noqa: E402
from model.decoder import resolve_attention  # noqa: E402
from pipeline.config import load_config  # noqa: E402
from pipeline.train.engine import Engine  # noqa: E402
from pipeline.data.shards import ShardReader  # noqa: E402
from pipeline.data.synthetic import parse_doc_lengths, write_synthetic_dataset  # noqa: E402
from pipeline.tracking import names  # noqa: E402

DEFAULT_DOC_LEN = "web"


def measure(tier: str, seq_len: int, batch_size: int, *, steps: int, warmup: int, vocab_size: int = 32000,
            grad_accum: int = 1, compile_mode: str = "auto", doc_masking: bool = True,
            activation_checkpointing: str = "none", attention: str = "auto", doc_lengths: str = DEFAULT_DOC_LEN,
            data_dir: Path | None = None, profile_dir: Path | None = None, parallel: str = "none",
            rank: int = 0, world_size: int = 1) -> dict:
    """Train `warmup` + `steps` optimizer steps and time the last `steps`. Returns one result row.

    doc_lengths: the synthetic rows' document-length spec (ignored when data_dir already holds a dataset).
    parallel: none (the one-process engine), ddp or fsdp (pipeline/train/distributed/parallel.py); under a process group of
    world_size workers each reads its rank's rows (bench/fsdp.py starts them), and fsdp without one runs in a
    one-worker group in this process. Figures: tokens/s of all workers, MFU per GPU, peak memory of this worker."""
    import torch.distributed as dist

    from pipeline.train.distributed.process_group import process_group

    if parallel == "fsdp" and not dist.is_initialized():
        with process_group(0, 1):
            return measure(tier, seq_len, batch_size, steps=steps, warmup=warmup, vocab_size=vocab_size,
                           grad_accum=grad_accum, compile_mode=compile_mode, doc_masking=doc_masking,
                           activation_checkpointing=activation_checkpointing, attention=attention,
                           doc_lengths=doc_lengths, data_dir=data_dir, profile_dir=profile_dir, parallel=parallel)
    docs = parse_doc_lengths(doc_lengths)
    cfg = load_config("cpu", {"model.tier": tier, "data.seq_len": seq_len, "data.vocab_size": vocab_size,
                              "train.batch_size": batch_size, "train.grad_accum": grad_accum,
                              "train.max_steps": warmup + steps, "train.warmup_steps": 1,
                              "model.compile": compile_mode, "model.doc_masking": doc_masking,
                              "model.attention": attention,
                              "model.activation_checkpointing": activation_checkpointing})
    row = {"tier": tier, "seq_len": seq_len, "batch_size": batch_size, "grad_accum": grad_accum,
           "compile": compile_mode, "doc_masking": doc_masking, "activation_checkpointing": activation_checkpointing,
           "doc_len": docs.label, "doc_len_distribution": docs.describe(), "parallel": parallel,
           "workers": world_size}
    with tempfile.TemporaryDirectory() as tmp:
        ddir = Path(data_dir or tmp)
        need = (warmup + steps + 3) * batch_size * grad_accum * world_size  # + 3 steps for the profiler
        if not (ddir / "manifest.json").exists():
            write_synthetic_dataset(ddir, n_train=need, n_val=batch_size, seq_len=seq_len, vocab_size=vocab_size,
                                    doc_lengths=docs)
        engine = Engine(cfg, vocab_size, rank=rank, world_size=world_size, parallel=parallel)
        row["attention"] = resolve_attention(attention, engine.device, doc_masking)
        if attention == "auto":
            row["attention"] = f"auto ({row['attention']})"
        reader = iter(ShardReader(ddir, "train", batch_size, seed=0, epoch=0, start=0, rank=rank,
                                  world_size=world_size))
        sync = torch.cuda.synchronize if engine.device.type == "cuda" else (lambda: None)
        data_wait = 0.0
        t_first = None
        for i in range(warmup + steps):
            if i == warmup:  # the timed window starts here
                sync()
                engine.pull_train_metrics()  # resets the interval clock and counters
                if engine.device.type == "cuda":
                    torch.cuda.reset_peak_memory_stats()
                data_wait, t0 = 0.0, time.perf_counter()
            w0 = time.perf_counter()
            micro = [next(reader) for _ in range(grad_accum)]
            data_wait += time.perf_counter() - w0
            s0 = time.perf_counter()
            engine.train_step(micro)
            if i == 0:
                sync()
                t_first = time.perf_counter() - s0
        sync()
        wall = time.perf_counter() - t0
        m = engine.pull_train_metrics()
        if profile_dir is not None:
            profile_steps(engine, reader, grad_accum, Path(profile_dir))
        step_time = wall / steps
        executed = m[names.TRAIN_EXECUTED_FLOPS_PER_TOKEN]
        attention_causal = engine.flops_per_token - engine.matmul_flops_per_token
        row.update(
            params=engine.n_params, flops_per_token=engine.flops_per_token, executed_flops_per_token=executed,
            # computed attention pairs over the row's causal T^2/2 (1 + 1/T without doc masking)
            attn_pairs_frac=((executed - engine.matmul_flops_per_token) / attention_causal
                             if attention_causal else float("nan")),
            tokens_per_s=m[names.TRAIN_TOKENS_PER_S], tokens_per_s_per_gpu=m[names.TRAIN_TOKENS_PER_S_PER_GPU],
            mfu=m.get(names.TRAIN_MFU, float("nan")), hfu=m.get(names.TRAIN_HFU, float("nan")),
            tflops_per_gpu=m[names.TRAIN_TFLOPS_PER_GPU], mfu_causal_equiv=m.get(names.TRAIN_MFU_CAUSAL_EQUIV, float("nan")),
            peak_mem_gib=m[names.TRAIN_PEAK_MEM_GIB], step_time_s=step_time,
            first_step_s=t_first, compile_s_estimate=max(0.0, (t_first or 0) - step_time),
            data_wait_frac=data_wait / wall, loss=m[names.TRAIN_LOSS], device=str(engine.device),
            peak_flops=engine.peak_flops)
        del engine, reader
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return row


def profile_steps(engine: Engine, reader, grad_accum: int, out_dir: Path, steps: int = 3) -> Path:
    """torch.profiler over a few steps: a Chrome trace (open in Perfetto) and the top ops by device time."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if engine.device.type == "cuda" else [])
    with profile(activities=acts, record_shapes=True) as prof:
        for _ in range(steps):
            engine.train_step([next(reader) for _ in range(grad_accum)])
        if engine.device.type == "cuda":
            torch.cuda.synchronize()
    out_dir.mkdir(parents=True, exist_ok=True)
    trace = out_dir / f"trace-{engine.cfg.model.tier}-{engine.cfg.data.seq_len}.json"
    prof.export_chrome_trace(str(trace))
    key = "self_cuda_time_total" if engine.device.type == "cuda" else "self_cpu_time_total"
    print(prof.key_averages().table(sort_by=key, row_limit=15))
    print(f"profiler trace: {trace}")
    return trace


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tier", default="B")
    p.add_argument("--seq-len", type=int, default=32768)
    p.add_argument("--batch-size", default="1", help="an integer, or 'max' for the largest that fits")
    p.add_argument("--grad-accum", type=int, default=1)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--vocab-size", type=int, default=32000)
    p.add_argument("--compile", default="auto", choices=("auto", "on", "off"))
    p.add_argument("--no-doc-masking", action="store_true")
    p.add_argument("--attention", default="auto", choices=("auto", "flex", "varlen", "cudnn", "sdpa", "dense"),
                   help="model.attention (cudnn needs --no-doc-masking)")
    p.add_argument("--doc-len", default=DEFAULT_DOC_LEN,
                   help="document lengths of the synthetic rows: web | MEAN | lognormal:MEDIAN:SIGMA | manifest:DIR")
    p.add_argument("--activation-checkpointing", default="none")
    p.add_argument("--profile", type=Path, default=None, help="also write a torch.profiler trace to this folder")
    p.add_argument("--smoke", action="store_true", help="tiny CPU run: nano, seq_len 64, 3 steps")
    p.add_argument("--out", type=Path, default=None, help="results directory (default bench/results)")
    a = p.parse_args(argv)
    if a.smoke:
        a.tier, a.seq_len, a.batch_size, a.steps, a.warmup, a.vocab_size = "nano", 64, "2", 3, 1, 512
    kw = dict(vocab_size=a.vocab_size, grad_accum=a.grad_accum, compile_mode=a.compile,
              doc_masking=not a.no_doc_masking, activation_checkpointing=a.activation_checkpointing,
              attention=a.attention, doc_lengths=a.doc_len)
    if a.batch_size == "max":
        from pipeline.train.max_batch import find_max_batch

        cfg = load_config("cpu", {"model.tier": a.tier, "data.seq_len": a.seq_len, "data.vocab_size": a.vocab_size,
                                  "model.compile": a.compile, "model.doc_masking": not a.no_doc_masking,
                                  "model.attention": a.attention,
                                  "model.activation_checkpointing": a.activation_checkpointing})
        batch = find_max_batch(cfg).max_batch
    else:
        batch = int(a.batch_size)
    if batch == 0:
        print(f"tier {a.tier} at seq_len {a.seq_len} does not fit even one sequence; try "
              f"--activation-checkpointing all", file=sys.stderr)
        return 1
    row = measure(a.tier, a.seq_len, batch, steps=a.steps, warmup=a.warmup, profile_dir=a.profile, **kw)
    if row["mfu"] != row["mfu"]:
        mfu = "n/a (no peak for this device)"
    else:
        mfu = f"{100 * row['mfu']:.1f}% executed, {100 * row['mfu_causal_equiv']:.1f}% causal-equivalent"
    print(f"{a.tier} seq_len={a.seq_len} batch={batch} attention={row['attention']} doc_len={row['doc_len']} "
          f"(attention pairs {100 * row['attn_pairs_frac']:.1f}% of causal): "
          f"{row['tokens_per_s']:,.0f} tokens/s, MFU {mfu}, "
          f"peak {row['peak_mem_gib']:.2f} GiB, step {row['step_time_s'] * 1e3:.1f} ms, "
          f"data wait {100 * row['data_wait_frac']:.2f}% of step time, first step {row['first_step_s']:.1f} s")
    args = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(a).items()}
    path = write_result("engine_throughput", {"rows": [row], "args": args}, a.out)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
