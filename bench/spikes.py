"""What loss-spike handling costs: the training step with detection on against off (side by side, the same batches,
the steps alternated in one process), and what one rewind costs in steps and wall time (a run that meets a spike and
rewinds against the same run on data without it).

    python bench/spikes.py                                       # nano on CPU: step time, then one rewind
    python bench/spikes.py --tier A --seq-len 4096 --batch-size 4 --steps 60   # on a GPU
    python bench/spikes.py --smoke                               # tiny: the plumbing, seconds

Step time: two engines of the same config and seed, one with train.spike_action=off and one with detection armed
(the default window of 128 steps, armed after 8 so that it tests every step measured), take the same batches; their
steps
alternate (on, off, off, on, ...), each timed by the engine's own clock around train_step (its one host sync ends
it, pipeline/train/engine.py), and by the CPU time the process spent in it (`time.process_time`: on a machine shared
with other work the wall clock mostly measures the others; --threads 1, the default, keeps torch on one thread so
that the CPU time is the step's work). Reported for each clock: the median step of each side, their ratio, and the
median of the per-pair ratios. On CUDA also the host syncs one step makes on each side (torch.cuda.set_sync_debug_mode counts them): the
verdict rides on the step's existing transfer, so the counts should be equal. One process: the all-reduce of the loss
that several workers add (one number per step) is not in this figure.

One rewind: learnable rows with two one-step windows of one token repeated (pipeline/data/synthetic.py
write_spiky_dataset) at the attempts --spike-at and --spike-at + 4; 2 outliers within 10 steps rewind to the newest
checkpoint (every --checkpoint-every steps) and skip 8 steps' worth of rows. The same run on the same rows without the
windows is the baseline: the cost is the extra wall time and the steps trained and thrown away; the rewind itself
(choosing the checkpoint, loading it) is timed apart. --rounds alternates the two runs.

Writes bench/results/spikes_<tier>_s<seq>_b<batch>-<device>-<date>.json.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from bench.common import write_result  # noqa: E402
from pipeline.config import load_config  # noqa: E402
from pipeline.data.synthetic import synthetic_batches, write_spiky_dataset  # noqa: E402


def config(args, **over):
    base = {"model.tier": args.tier, "data.seq_len": args.seq_len, "data.vocab_size": 256,
            "train.batch_size": args.batch_size, "train.warmup_steps": 5, "train.sample_tokens": 0,
            "train.spike_window": 8, "train.spike_warmup_steps": 8, "tracking.enabled": False}
    base.update(over)
    return load_config("test", base)


def sync_count(engine, batch) -> int | None:
    """Host syncs one train_step makes (CUDA only: torch warns once per synchronizing call in sync debug mode)."""
    if engine.device.type != "cuda":
        return None
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            engine.train_step([batch])
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(w.message) for w in caught)


def step_time(args) -> dict:
    from pipeline.train.engine import Engine

    vocab, window = 128, {"train.spike_window": 128}
    sides = {"on": Engine(config(args, **window), vocab),
             "off": Engine(config(args, **window, **{"train.spike_action": "off"}), vocab)}
    batches = list(synthetic_batches(n_sequences=args.batch_size * (args.steps + args.warmup), seq_len=args.seq_len,
                                     vocab_size=vocab, batch_size=args.batch_size))
    times = {clock: {"on": [], "off": []} for clock in ("wall", "cpu")}
    for i, batch in enumerate(batches):
        order = ("on", "off") if i % 2 == 0 else ("off", "on")
        for side in order:
            engine = sides[side]
            start, cpu = engine.clock(), time.process_time()
            engine.train_step([batch])
            if i >= args.warmup:
                times["wall"][side].append(engine.clock() - start)
                times["cpu"][side].append(time.process_time() - cpu)
    out = {"steps_timed": len(times["wall"]["on"]), "warmup_steps": args.warmup, "threads": torch.get_num_threads(),
           "detector_armed": sides["on"].spikes.detector.armed, "outliers_flagged": sides["on"].spikes.skips,
           "host_syncs_per_step": {side: sync_count(engine, batches[-1]) for side, engine in sides.items()}}
    for clock, t in times.items():
        on, off = statistics.median(t["on"]), statistics.median(t["off"])
        out[clock] = {"median_step_s": {"on": on, "off": off}, "ratio_on_off": on / off,
                      "median_pair_ratio": statistics.median(a / b for a, b in zip(t["on"], t["off"])),
                      "iqr_step_s": {k: [statistics.quantiles(v, n=4)[0], statistics.quantiles(v, n=4)[2]]
                                     for k, v in t.items()}}
    return out


def one_rewind(args, tmp: Path) -> dict:
    import pipeline.train.loop as loop
    from pipeline.train.local import train_local
    from pipeline.train.spike_record import read_events

    b, first = args.batch_size, args.spike_at
    bad = [((first - 1) * b, first * b), ((first + 3) * b, (first + 4) * b)]
    n_train = b * (args.rewind_steps + 20)
    spiky, clean = tmp / "spiky", tmp / "clean"
    write_spiky_dataset(spiky, n_train=n_train, n_val=32, seq_len=args.seq_len, vocab_size=128, order_seed=1234,
                        bad=bad)
    write_spiky_dataset(clean, n_train=n_train, n_val=32, seq_len=args.seq_len, vocab_size=128, order_seed=1234)
    cfg = config(args, **{"train.max_steps": args.rewind_steps, "train.checkpoint_every": args.checkpoint_every,
                          "train.log_every": 10, "train.eval_every": 10**6, "train.keep_checkpoints": 50,
                          "train.seed": 1234, "train.spike_rewind_outliers": 2, "train.spike_rewind_window": 10,
                          "train.spike_skip_steps": 8})
    real, rewind_s = loop.rewind, []

    def timed(*a, **k):
        t0 = time.perf_counter()
        event = real(*a, **k)
        rewind_s.append(time.perf_counter() - t0)
        return event

    loop.rewind = timed
    walls: dict[str, list[float]] = {"spiky": [], "clean": []}
    events = []
    try:
        for r in range(args.rounds):
            for side, data in (("spiky", spiky), ("clean", clean))[:: 1 if r % 2 == 0 else -1]:
                run_dir = tmp / f"{side}{r}"
                t0 = time.perf_counter()
                train_local(cfg.replace({"run.root": str(tmp)}), data, run_dir, None)
                walls[side].append(time.perf_counter() - t0)
                if side == "spiky":
                    events = read_events(str(run_dir))
    finally:
        loop.rewind = real
    rewinds = [e["rewind"] for e in events if e["kind"] == "rewind"]
    if not rewinds:
        raise SystemExit(f"no rewind happened (events: {[e['kind'] for e in events]}); raise --spike-at so the model "
                         f"has learned the pattern first")
    rw = rewinds[0]
    outliers = sum(e["kind"] == "skip" for e in events)
    spiky, clean_s = statistics.median(walls["spiky"]), statistics.median(walls["clean"])
    step_s = clean_s / args.rewind_steps  # a step of the baseline, start-up and evaluation included
    lost = rw["at_step"] - rw["to_step"] + outliers
    return {"max_steps": args.rewind_steps, "checkpoint_every": args.checkpoint_every, "rounds": args.rounds,
            "rewind": {"at_step": rw["at_step"], "to_step": rw["to_step"], "rows_skipped":
                       sum(x["end"] - x["start"] for x in rw["ranges"])},
            "steps_thrown_away": rw["at_step"] - rw["to_step"], "outlier_steps_skipped": outliers,
            "steps_lost": lost, "rewind_op_s_median": statistics.median(rewind_s),
            # what the rewind costs by its parts: the steps lost at the baseline's time per step, and the rewind itself
            "cost_by_parts_s": lost * step_s + statistics.median(rewind_s), "baseline_step_s": step_s,
            "wall_s": {"spiky": walls["spiky"], "clean": walls["clean"]},
            "extra_wall_s_median": spiky - clean_s, "extra_wall_share": (spiky - clean_s) / clean_s}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tier", default="nano")
    p.add_argument("--seq-len", type=int, default=32)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--steps", type=int, default=60, help="timed steps per side")
    p.add_argument("--warmup", type=int, default=10, help="untimed steps first (the detector arms after 8)")
    p.add_argument("--spike-at", type=int, default=25, help="the attempt that meets the first bad window")
    p.add_argument("--rewind-steps", type=int, default=40, help="max_steps of the rewind runs")
    p.add_argument("--checkpoint-every", type=int, default=3)
    p.add_argument("--rounds", type=int, default=2, help="rewind run and baseline, alternated, this many times")
    p.add_argument("--threads", type=int, default=1, help="torch's intra-op threads (0: torch's default)")
    p.add_argument("--skip-rewind", action="store_true", help="the step time only")
    p.add_argument("--smoke", action="store_true", help="tiny and fast: the plumbing")
    p.add_argument("--out", help="write the JSON here (default bench/results/)")
    args = p.parse_args(argv)
    if args.smoke:
        args.steps, args.warmup, args.rounds, args.rewind_steps = 4, 9, 1, 32
    if args.threads:
        torch.set_num_threads(args.threads)
    shape = {"tier": args.tier, "seq_len": args.seq_len, "batch_size": args.batch_size}
    result = {"shape": shape, "step_time": step_time(args)}
    st = result["step_time"]
    for clock in ("wall", "cpu"):
        c = st[clock]
        print(f"step time ({clock}): detection on {c['median_step_s']['on'] * 1e3:.2f} ms, off "
              f"{c['median_step_s']['off'] * 1e3:.2f} ms: ratio {c['ratio_on_off']:.3f} (median of pairs "
              f"{c['median_pair_ratio']:.3f}, {st['steps_timed']} steps each)")
    print(f"host syncs per step: {st['host_syncs_per_step']} (counted on CUDA only)")
    if not args.skip_rewind:
        with tempfile.TemporaryDirectory() as tmp:
            result["one_rewind"] = rw = one_rewind(args, Path(tmp))
        print(f"one rewind: step {rw['rewind']['at_step']} back to {rw['rewind']['to_step']} "
              f"({rw['steps_thrown_away']} steps thrown away, {rw['outlier_steps_skipped']} outlier steps skipped, "
              f"{rw['rewind']['rows_skipped']} rows skipped); the rewind itself {rw['rewind_op_s_median']:.2f} s; "
              f"by its parts {rw['cost_by_parts_s']:.1f} s; measured: the run {rw['extra_wall_s_median']:+.1f} s "
              f"({rw['extra_wall_share']:+.1%}) against the run without the spike")
    name = f"spikes_{args.tier}_s{args.seq_len}_b{args.batch_size}" + ("_smoke" if args.smoke else "")
    path = write_result(name, result, Path(args.out) if args.out else None)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
