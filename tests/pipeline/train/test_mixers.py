"""Both model families through everything downstream of the model: the engine (training, exact resume,
checkpoints), evaluation, generation from a checkpoint and the max-batch finder, with model.mixer the only
difference. Ray-free training on the `test` preset's built-in dataset (prepared once per session)."""
from __future__ import annotations

import pytest
import torch

from pipeline.config import load_config
from pipeline.train.engine import CheckpointError, Engine
from tests.pipeline.train.test_engine import VOCAB, make_cfg, run_steps, weights

MIXERS = ("attention", "resonance")


def test_resonance_resume_is_bitwise_equal_to_a_straight_run(tmp_path):
    """As tests/pipeline/train/test_engine.py's resume test: 2N steps straight == N, save, load, N more."""
    cfg = make_cfg(**{"model.mixer": "resonance", "train.max_steps": 8})
    seen_a: list[int] = []
    straight = Engine(cfg, VOCAB, torch.device("cpu"))
    run_steps(cfg, straight, 8, seen_a)
    seen_b: list[int] = []
    first = Engine(cfg, VOCAB, torch.device("cpu"))
    run_steps(cfg, first, 4, seen_b)
    first.save(tmp_path / "ckpt")
    torch.manual_seed(999)
    second = Engine(cfg.replace({"train.seed": 4321}), VOCAB, torch.device("cpu"))
    second.load(tmp_path / "ckpt")
    run_steps(cfg, second, 8, seen_b)
    assert seen_a == seen_b
    a, b = weights(straight), weights(second)
    assert a.keys() == b.keys() and any(".mixer.omega" in k for k in a)
    for k in a:
        assert torch.equal(a[k], b[k]), k
    # a checkpoint of one family is refused by the other with one line naming the fix
    other = Engine(make_cfg(), VOCAB, torch.device("cpu"))
    with pytest.raises(CheckpointError, match="is a resonance model but model.mixer is 'attention'; set "
                                              "--model.mixer=resonance"):
        other.load(tmp_path / "ckpt")


def test_both_families_train_evaluate_and_generate_on_the_builtin_corpus(test_runs_root, tmp_path):
    """The same steps on the same shards for each mixer: validation loss falls well below its start, eval and
    generation from the checkpoint work, and the resonance run trains with its own FLOP count."""
    from pipeline.data.pack import prepare
    from pipeline.data.shards import ShardReader, load_manifest
    from pipeline.cli.eval import evaluate_checkpoint
    from pipeline.train.handoff.text_generation import generate_from_checkpoint
    from pipeline.train.local import train_local

    base = load_config("test", [f"--run.root={test_runs_root}", "--tracking.enabled=false"])
    dataset = prepare(base)  # the session's cached dataset
    vocab = load_manifest(dataset).vocab_size
    over = {"train.max_steps": 24, "train.eval_every": 24, "train.checkpoint_every": 24, "train.lr": 1e-2,
            "train.sample_tokens": 0, "train.eval_batches": 4}
    losses = {}
    for mixer in MIXERS:
        cfg = base.replace({**over, "model.mixer": mixer, "run.name": f"mixer-{mixer}"})
        fresh = Engine(cfg, vocab)
        start = fresh.evaluate(ShardReader(dataset, "val", cfg.train.batch_size, seed=0, epoch=0, start=0),
                               max_batches=4)["val/loss"]
        ckpt, stopped = train_local(cfg, dataset, tmp_path / mixer, None)
        assert not stopped
        end = evaluate_checkpoint(ckpt, max_batches=4)["eval/loss"]
        losses[mixer] = (start, end)
        out = generate_from_checkpoint(ckpt, ["The ", "def f"], max_new_tokens=6, temperature=0.0)
        assert len(out.token_ids) == 2 and out.new_tokens > 0
    for mixer, (start, end) in losses.items():
        assert end < start - 1.0, (mixer, losses)  # from ~ln(vocab) = 6.2 to well under it in 24 steps
    assert Engine(base.replace({"model.mixer": "resonance"}), vocab).flops_per_token < Engine(base, vocab).flops_per_token


@pytest.mark.parametrize("mixer", MIXERS)
@pytest.mark.system
def test_max_batch_finder_runs_both_families(mixer):
    from pipeline.train.max_batch import find_max_batch

    cfg = load_config("test", {"data.seq_len": 32, "data.vocab_size": 300, "model.mixer": mixer,
                               "train.memory_limit_gib": 6 / 1024, "ray.use_gpu": "false"})
    found = find_max_batch(cfg, vocab_size=300, upper=64, device=torch.device("cpu"))
    assert 1 <= found.max_batch < 64
