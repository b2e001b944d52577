"""The training loop's progress line (pipeline/train/loop.py fit, through pipeline/console.py): its eta leaves out the
first step and what follows it before the second begins, driven by a clock the test moves, so the values are exact."""
from __future__ import annotations

import re

import torch

from pipeline import console
from pipeline.train.engine import Engine
from pipeline.train.loop import Hooks, fit
from tests.pipeline.test_console import FakeClock
from tests.pipeline.train.test_engine import VOCAB, batches, make_cfg


def test_the_eta_leaves_out_the_first_step_and_its_first_log(monkeypatch, capfd):
    """The first step compiles and warms up (20 s here), and its metrics' first log to MLflow takes 7 s more; each
    later step takes 3 s. After step 2 the eta is 3 s x 4 steps left = 12 s, where the elapsed time over the steps
    done would say 30 s x 4 / 2 = 60 s (the eta once printed 3-4x too long), and the time since the first step
    ended 10 s x 4 = 40 s (what one CI run's line showed: a slow first log counted as a step)."""
    clock = FakeClock()
    monkeypatch.setattr(console, "now", clock)
    monkeypatch.setenv(console.INTERACTIVE_ENV, "0")
    cfg = make_cfg(**{"train.max_steps": 6, "train.log_every": 1, "train.eval_every": 100,
                      "train.checkpoint_every": 100})
    engine = Engine(cfg, VOCAB, torch.device("cpu"))

    def on_step(engine, outcome, micro):  # the step's own time
        clock.t += 20 if engine.step == 1 else 3

    def on_log(engine, metrics):  # the first log is slow (MLflow's first request)
        clock.t += 7 if engine.step == 1 else 0

    fit(engine, batches(cfg), None, Hooks(on_step=on_step, on_log=on_log))
    lines = [ln for ln in capfd.readouterr().out.splitlines() if ln.startswith("train nano")]
    found = [re.search(r"step (\d)/6 .* elapsed (\S+)  eta (\S+)$", ln).groups() for ln in lines]
    assert found == [("1", "0m27s", "?"), ("2", "0m30s", "0m12s"), ("3", "0m33s", "0m09s"),
                     ("4", "0m36s", "0m06s"), ("5", "0m39s", "0m03s"), ("6", "0m42s", "0m00s")], lines
    assert all(re.search(r"  loss \d+\.\d{3}  ppl [\d.]+  tok_s \d+  lr [\d.e+-]+  elapsed", ln) for ln in lines), lines
