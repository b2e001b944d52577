"""The Ray-free engine on CPU: overfitting, exact resume, accumulation, the non-finite guard, checkpoints."""
from __future__ import annotations

import json
import math

import pytest
import torch

from pipeline.config import load_config
from pipeline.train.engine import CheckpointError, Engine, NonFiniteLossError, lr_lambda
from pipeline.train.checkpoints.index import latest_complete
from pipeline.train.checkpoints.local_dir import LocalCheckpoints
from pipeline.train.loop import Hooks, fit
from pipeline.data.synthetic import synthetic_batches

VOCAB, SEQ = 96, 32


def make_cfg(**overrides):
    base = {"model.tier": "nano", "data.seq_len": SEQ, "data.vocab_size": 256, "train.batch_size": 4,
            "train.max_steps": 8, "train.warmup_steps": 2, "train.log_every": 2, "train.eval_every": 4,
            "train.eval_batches": 2, "train.checkpoint_every": 4, "train.lr": 3e-3, "model.compile": "off"}
    base.update(overrides)
    return load_config("cpu", base)


def batches(cfg, n_sequences=64, rank=0, world_size=1):
    def make(epoch, start):
        return synthetic_batches(n_sequences=n_sequences, seq_len=cfg.data.seq_len, vocab_size=VOCAB,
                                 batch_size=cfg.train.batch_size, seed=7, epoch=epoch, start=start,
                                 rank=rank, world_size=world_size)
    return make


def weights(engine):
    return {k: v.detach().clone() for k, v in engine.module.state_dict().items()}


def test_lr_schedule_warmup_then_cosine_to_floor():
    assert lr_lambda(0, 10, 100, 0.1) == pytest.approx(0.1)
    assert lr_lambda(9, 10, 100, 0.1) == pytest.approx(1.0)
    assert lr_lambda(10, 10, 100, 0.1) == pytest.approx(1.0)
    assert lr_lambda(55, 10, 100, 0.1) == pytest.approx(0.1 + 0.9 * 0.5)
    assert lr_lambda(100, 10, 100, 0.1) == pytest.approx(0.1)
    assert lr_lambda(500, 10, 100, 0.1) == pytest.approx(0.1)


def test_nano_overfits_one_fixed_batch():
    """Bound: a nano model memorises one 4 x 32 batch of random tokens to loss < 0.5 within 40 steps
    (it starts at ln(96) = 4.56; it is under 0.5 from step 17 and at 0.07-0.08 from step 30 on: the 150 steps
    this used to take added nothing to the check)."""
    cfg = make_cfg(**{"train.max_steps": 40, "train.lr": 1e-2, "train.warmup_steps": 5, "train.weight_decay": 0.0,
                      "train.min_lr_ratio": 1.0})
    engine = Engine(cfg, VOCAB, torch.device("cpu"))
    batch = next(iter(batches(cfg)(0, 0)))
    first = None
    for _ in range(40):
        engine.train_step([batch])
        m = engine.pull_train_metrics()
        first = first if first is not None else m["train/loss"]
    assert first > 4.0
    assert m["train/loss"] < 0.5, m
    assert m["train/accuracy"] > 0.9


def run_steps(cfg, engine, n, log):
    hooks = Hooks(on_step=lambda e, o, micro: log.extend(int(i) for b in micro for i in b["seq_id"]))
    fit(engine, batches(cfg), None, hooks, max_steps=n, progress=False)


def test_resume_is_bitwise_equal_to_straight_run(tmp_path):
    """2N steps straight == N steps, save, load into a fresh engine, N more steps (bitwise, CPU)."""
    cfg = make_cfg(**{"train.max_steps": 12, "train.grad_accum": 2})
    seen_a: list[int] = []
    straight = Engine(cfg, VOCAB, torch.device("cpu"))
    run_steps(cfg, straight, 12, seen_a)  # 12 steps x 2 x 4 = 96 sequences: crosses an epoch of 64

    seen_b: list[int] = []
    first = Engine(cfg, VOCAB, torch.device("cpu"))
    run_steps(cfg, first, 6, seen_b)
    first.save(tmp_path / "ckpt")
    torch.manual_seed(999)  # a fresh process state: the RNG must come back from the checkpoint
    second = Engine(cfg.replace({"train.seed": 4321}), VOCAB, torch.device("cpu"))
    second.load(tmp_path / "ckpt")
    assert (second.step, second.epoch, second.cursor) == (6, 0, 48)
    run_steps(cfg, second, 12, seen_b)

    assert seen_a == seen_b
    a, b = weights(straight), weights(second)
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k
    sa, sb = straight.optimizer.state_dict()["state"], second.optimizer.state_dict()["state"]
    for k in sa:
        assert torch.equal(sa[k]["exp_avg"], sb[k]["exp_avg"])
    assert straight.scheduler.get_last_lr() == second.scheduler.get_last_lr()
    assert (straight.epoch, straight.cursor) == (second.epoch, second.cursor) == (1, 32)
    # Every sequence of epoch 0 was consumed exactly once before the epoch turned.
    assert sorted(seen_a[:64]) == list(range(64))


def test_gradient_accumulation_matches_one_big_batch():
    big = make_cfg(**{"train.batch_size": 8})
    small = make_cfg(**{"train.batch_size": 4, "train.grad_accum": 2})
    e1, e2 = Engine(big, VOCAB, torch.device("cpu")), Engine(small, VOCAB, torch.device("cpu"))
    b8 = next(iter(batches(big)(0, 0)))
    halves = [{k: v[:4] for k, v in b8.items()}, {k: v[4:] for k, v in b8.items()}]
    for _ in range(3):
        e1.train_step([b8])
        e2.train_step(halves)
    for k, v in weights(e1).items():
        torch.testing.assert_close(v, weights(e2)[k], rtol=1e-4, atol=1e-5)


def test_non_finite_steps_are_skipped_counted_and_stop_the_run(tmp_path):
    cfg = make_cfg(**{"train.max_bad_steps": 3})
    engine = Engine(cfg, VOCAB, torch.device("cpu"))
    it = iter(batches(cfg)(0, 0))
    engine.train_step([next(it)])
    ckpts = LocalCheckpoints(tmp_path / "ckpts", keep=2)
    good = ckpts.save(engine)
    good_bytes = (good / "model.safetensors").read_bytes()
    before = weights(engine)
    opt_before = engine.optimizer.state_dict()["state"][0]["exp_avg"].clone()

    poison = engine.module.decoder.output_weight.register_hook(lambda g: g * float("nan"))
    for i in range(2):
        out = engine.train_step([next(it)])
        assert out.skipped and out.step == 1
    assert engine.bad_steps_total == 2 and engine.step == 1
    for k, v in weights(engine).items():
        assert torch.equal(v, before[k]), f"{k} changed by a skipped step"
    assert torch.equal(engine.optimizer.state_dict()["state"][0]["exp_avg"], opt_before)
    with pytest.raises(NonFiniteLossError, match="3 optimizer steps in a row.*train.lr"):
        engine.train_step([next(it)])
    poison.remove()
    assert (good / "model.safetensors").read_bytes() == good_bytes
    assert latest_complete(str(ckpts.directory)) == (str(good), None)

    # A finite step resets the in-a-row count.
    engine2 = Engine(cfg, VOCAB, torch.device("cpu"))
    h = engine2.module.decoder.output_weight.register_hook(lambda g: g * float("inf"))
    engine2.train_step([next(it)])
    h.remove()
    engine2.train_step([next(it)])
    assert (engine2.bad_steps_in_row, engine2.bad_steps_total, engine2.step) == (0, 1, 1)


def test_metrics_are_finite_and_named(tmp_path):
    cfg = make_cfg()
    engine = Engine(cfg, VOCAB, torch.device("cpu"))
    logged, evals = [], []
    res = fit(engine, batches(cfg), lambda: batches(cfg)(0, 0), Hooks(on_log=lambda e, m: logged.append(m),
              on_eval=lambda e, m: evals.append(m)), progress=False)
    assert res.step == 8 and len(logged) == 4 and len(evals) == 2
    for key in ("train/loss", "train/ppl", "train/lr", "train/grad_norm", "train/tokens_per_s",
                "train/peak_mem_gib", "train/tokens_seen"):
        assert math.isfinite(logged[-1][key]), key
    assert logged[-1]["train/ppl"] == pytest.approx(math.exp(logged[-1]["train/loss"]), rel=1e-5)
    assert "train/mfu" not in logged[-1]  # no peak table entry for a CPU: MFU is not reported
    assert logged[-1]["train/tokens_seen"] == 8 * 4 * SEQ
    assert evals[-1]["val/ppl"] == pytest.approx(math.exp(evals[-1]["val/loss"]), rel=1e-5)


def test_checkpoint_from_another_tier_or_vocab_is_refused(tmp_path):
    cfg = make_cfg()
    engine = Engine(cfg, VOCAB, torch.device("cpu"))
    engine.save(tmp_path / "c")
    meta = json.loads((tmp_path / "c" / "meta.json").read_text())
    assert meta["counters"]["step"] == 0 and meta["tier"] == "nano"
    with pytest.raises(CheckpointError, match="vocab 96 but the dataset's tokenizer has 128"):
        Engine(cfg, 128, torch.device("cpu")).load(tmp_path / "c")
    with pytest.raises(CheckpointError, match="tier 'nano' but model.tier is 'A'"):
        Engine(cfg.replace({"model.tier": "A"}), VOCAB, torch.device("cpu")).load(tmp_path / "c")
    with pytest.raises(CheckpointError, match="not a checkpoint"):
        engine.load(tmp_path / "missing")
    (tmp_path / "c" / "meta.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="corrupt"):
        engine.load(tmp_path / "c")


def test_local_checkpoints_keep_the_newest(tmp_path):
    cfg = make_cfg()
    engine = Engine(cfg, VOCAB, torch.device("cpu"))
    ckpts = LocalCheckpoints(tmp_path, keep=2)
    it = iter(batches(cfg)(0, 0))
    for _ in range(3):
        engine.train_step([next(it)])
        ckpts.save(engine)
    assert [p.name for p in ckpts.all()] == ["step_000002", "step_000003"]
    assert not list(tmp_path.glob(".*tmp*"))


def test_padding_rows_of_an_eval_batch_count_no_tokens():
    """eval_reader fills a short last batch with copies of a real row flagged in `pad`: the loss over [r0, r1, pad,
    pad] is the loss over [r0, r1] alone, not over four rows."""
    cfg = make_cfg()
    engine = Engine(cfg, VOCAB, torch.device("cpu"))
    batch = next(iter(batches(cfg)(0, 0)))
    two = {k: v[:2] for k, v in batch.items()}
    padded = {k: torch.cat([v[:2], v[:1], v[:1]]) for k, v in batch.items()}
    padded["pad"] = torch.tensor([False, False, True, True])
    alone, with_pad = engine.evaluate([two]), engine.evaluate([padded])
    assert with_pad["val/loss"] == pytest.approx(alone["val/loss"], rel=1e-6)
    assert with_pad["val/accuracy"] == pytest.approx(alone["val/accuracy"], rel=1e-6)
    del padded["pad"]  # counted, the copies of row 0 move the mean
    assert engine.evaluate([padded])["val/loss"] != pytest.approx(alone["val/loss"], rel=1e-4)


def test_steady_state_figures_leave_out_the_first_steps_and_the_time_between_steps(monkeypatch):
    """train/steady_*: steps after the first STEADY_AFTER_STEPS, timed inside the steps: the evaluations between
    them are not in the steady-state time, while the interval's tokens/s includes them. The engine's clock is the
    test's (Engine.clock): each optimizer step takes exactly 1 s of it and each evaluation 30 s, so every figure is
    exact whatever the machine's load."""
    from pipeline.train.engine import STEADY_AFTER_STEPS

    now = [1000.0]  # the test's clock, in seconds
    monkeypatch.setattr(Engine, "clock", staticmethod(lambda: now[0]))
    cfg = make_cfg()  # 8 steps of 4 rows of SEQ tokens; a log every 2 steps, an evaluation every 4
    engine = Engine(cfg, VOCAB, torch.device("cpu"))
    engine.peak_flops = 1e12  # as on a device whose peak is known: MFU is reported
    real_step = engine._train_step

    def one_second_step(micro):
        outcome = real_step(micro)
        now[0] += 1.0
        return outcome

    def slow_eval(e, m):
        now[0] += 30.0

    monkeypatch.setattr(engine, "_train_step", one_second_step)
    logged = []
    fit(engine, batches(cfg), lambda: batches(cfg)(0, 0), Hooks(on_log=lambda e, m: logged.append(m),
        on_eval=slow_eval), progress=False)
    assert STEADY_AFTER_STEPS == 3
    step_tokens = 4 * SEQ
    assert [m["train/steady_steps"] for m in logged[1:]] == [1, 3, 5]  # steps 4, 4-6, 4-8
    assert "train/steady_tokens_per_s" not in logged[0] and "train/steady_mfu" not in logged[0]  # step 2: warming up
    last = logged[-1]
    assert last["train/steady_tokens_per_s"] == step_tokens / 1.0  # 5 steps in 5 s: the evaluation at 4 left out
    assert logged[1]["train/tokens_per_s"] == 2 * step_tokens / 2.0  # steps 3-4: no evaluation in between
    assert logged[2]["train/tokens_per_s"] == 2 * step_tokens / 32.0  # steps 5-6 after step 4's evaluation: 32 s
    assert last["train/tokens_per_s"] == 2 * step_tokens / 2.0
    assert 0 < last["train/steady_mfu"]


@pytest.mark.parametrize("mixer", ["attention", "resonance"])
def test_the_engine_resolves_its_tier_once_and_hands_it_on(monkeypatch, mixer):
    """The tier's shape is looked up once, when the engine starts (pipeline/train/memory/plan.py shape_of), and the
    model, RoPE, FLOPs and the choice of DDP or FSDP are handed that one object; the Shape's tier is the model's."""
    import model.decoder
    import model.resonance
    import model.tiers
    import pipeline.config
    import pipeline.train.engine as engine_module
    from pipeline.train.distributed.parallel import resolve_parallel
    from pipeline.train.memory.plan import estimate

    cfg = make_cfg(**{"model.mixer": mixer, "model.tier": "nano"})
    lookups = []

    def counted(original):
        def lookup(*args, **kwargs):
            lookups.append(args)
            return original(*args, **kwargs)
        return lookup

    for module, name in [(model.tiers, "get_mixer_tier"), (model.tiers, "get_tier"), (model.decoder, "get_tier"),
                         (model.resonance, "get_mixer_tier"), (engine_module, "get_mixer_tier"),
                         (pipeline.config, "get_mixer_tier")]:  # model_tier: the tier with its MoE settings
        monkeypatch.setattr(module, name, counted(getattr(module, name)))
    engine = Engine(cfg, VOCAB, torch.device("cpu"))
    assert len(lookups) == 1, lookups
    assert engine.shape.tier is engine.module.decoder.tier and engine.shape.vocab_size == VOCAB
    lookups.clear()
    resolve_parallel(cfg, VOCAB, torch.device("cpu"), shape=engine.shape)
    assert estimate(cfg, VOCAB, workers=2, parallel="fsdp", shape=engine.shape).total > 0
    assert lookups == []
    # handing the shape on changes no figure of the memory model
    assert estimate(cfg, VOCAB, workers=2, parallel="fsdp", device_type="cpu", shape=engine.shape) \
        == estimate(cfg, VOCAB, workers=2, parallel="fsdp", device_type="cpu")
