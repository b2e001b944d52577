"""FSDP2 against DDP and the one-process engine, exact resume and resharded resume, on CPU with gloo.

The Ray-free engine and loop run under a real torch.distributed process group in two spawned worker processes
(pipeline/train/distributed/process_group.py), reading the same shards with the same per-rank split as Ray Train's workers;
tests/pipeline/train/test_fsdp_ray.py runs the same engine under Ray Train. One spawn runs every two-worker
scenario but the compiled one (a spawn of its own, in the system tier); the one-worker runs happen in this process (one
of them under a one-worker process group).

Tolerance: a change of worker count or of DDP for FSDP changes only the order of floating-point sums (a
two-worker mean of per-worker means, a reduce-scatter against one mean over the whole batch), so losses agree to
rel 1e-5 and weights to 1e-5 absolute (weights of ~0.1; AdamW moves a weight by up to lr = 3e-3 per step, and
where a gradient is nearly zero a reordered sum changes that step's size the most: 3e-6 at most here). The same
worker count and the same checkpoint give bitwise the same run.
"""
from __future__ import annotations

import hashlib
import json
import pickle
from pathlib import Path

import pytest
import torch

from pipeline.config import load_config
from pipeline.data.synthetic import write_synthetic_dataset

SEQ, VOCAB, STEPS, SAVE_AT = 64, 512, 8, 4  # the `test` preset's shapes on nano
PROMPT = [5, 17, 42, 7]
TOL = dict(rel=1e-5, abs=1e-6)  # losses
WEIGHT_TOL = dict(rtol=1e-4, atol=1e-5)


def cfg_for(**over):
    base = {"model.tier": "nano", "data.seq_len": SEQ, "data.vocab_size": VOCAB, "train.batch_size": 4,
            "train.max_steps": STEPS, "train.warmup_steps": 2, "train.log_every": 1, "model.compile": "off",
            "train.sample_tokens": 0, "tracking.enabled": False}
    return load_config("test", {**base, **over})


def final_weights(module, path: str) -> str:
    """The whole (gathered) weights written to `path` (safetensors, by rank 0); their sha256."""
    from safetensors.torch import save_file
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    sd = {k: v.detach().contiguous() for k, v in sorted(
        get_model_state_dict(module, options=StateDictOptions(full_state_dict=True)).items())}
    if not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0:
        save_file(sd, path)
    return hashlib.sha256(b"".join(v.numpy().tobytes() for v in sd.values())).hexdigest()


def load_weights(runs, name: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(runs["tmp"] / f"{name}.safetensors"))


def train(rank: int, world: int, dataset: str, name: str, over: dict, parallel: str, *, load: str | None = None,
          save_to: str | None = None) -> dict:
    """Train to STEPS with the loop every launcher uses (saving at SAVE_AT when asked); losses per step, and the
    final weights in <dataset>/../<name>.safetensors. A config with a worker range (ray.min_workers > 0) trains as
    an elastic attempt of `world` workers does (pipeline/train/distributed/elastic.py at_world_size)."""
    from pipeline.data.shards import ShardReader, eval_reader
    from pipeline.eval.positions import evaluate_by_position
    from pipeline.train.engine import Engine
    from model.decode_loop import generate_ids
    from pipeline.train.loop import Hooks, fit

    cfg = cfg_for(**over)
    if cfg.ray.min_workers:
        from pipeline.train.distributed.elastic import at_world_size

        cfg = at_world_size(cfg, world)
    engine = Engine(cfg, VOCAB, torch.device("cpu"), rank=rank, world_size=world, parallel=parallel)
    if load:
        engine.load(load)
    losses: list[float] = []

    def on_checkpoint(e, metrics) -> None:
        # as every launcher does (pipeline/train/ray_train.py): every worker writes its shards, a full checkpoint is
        # rank 0's (two DDP workers publishing one directory race: one's rename meets the other's directory)
        if save_to and e.step == SAVE_AT and (e.sharded or rank == 0):
            e.save(save_to, extra={"dataset_dir": dataset})

    t = cfg.train
    fit(engine, lambda epoch, start: ShardReader(dataset, "train", t.batch_size, seed=t.seed, epoch=epoch, start=start,
                                                 rank=rank, world_size=world),
        None, Hooks(on_log=lambda e, m: losses.append(m["train/loss"]), on_checkpoint=on_checkpoint), progress=False)
    digest = final_weights(engine.module, str(Path(dataset).parent / f"{name}.safetensors"))
    with engine.full_model() as decoder:  # what the eval-time samples do: every worker gathers, each can generate
        generated = generate_ids(decoder, [PROMPT], max_new_tokens=8, temperature=0.0)[0].tolist()
    # Loss by position over the validation split, each rank its share (train.eval_by_position's path)
    by_position = evaluate_by_position(engine, eval_reader(dataset, 4, rank, world), SEQ).metrics("val")
    return {"losses": losses, "digest": digest, "parallel": engine.parallel, "generated": generated,
            "by_position": by_position}


def two_workers(rank: int, world: int, dataset: str, tmp: str) -> dict:
    """Every two-worker scenario, in the same two processes (one spawn)."""
    resonance = {"model.mixer": "resonance", "model.tie_embeddings": False, "model.activation_checkpointing": "mixer"}
    runs = {"ddp": ({}, "ddp", {"save_to": f"{tmp}/ddp2"}), "fsdp": ({}, "fsdp", {"save_to": f"{tmp}/fsdp2"}),
            "fsdp_resumed": ({}, "fsdp", {"load": f"{tmp}/fsdp2"}),
            # two micro-batches of 2 per step (the global batch stays 8), every block checkpointed, from the
            # one-process full checkpoint
            "from_full1": ({"train.batch_size": 2, "train.grad_accum": 2, "model.activation_checkpointing": "all"},
                           "fsdp", {"load": f"{tmp}/full1"}),
            "resonance_fsdp": (resonance, "fsdp", {})}
    return {name: train(rank, world, dataset, name, over, mode, **kw) for name, (over, mode, kw) in runs.items()}


def compiled_two_workers(rank: int, world: int, dataset: str, tmp: str) -> dict:
    """Regionally compiled blocks (torch.compile on CPU) sharded after compiling, resumed from the one-worker FSDP
    group's shards: a spawn of its own, in the system tier (inductor's first compile of the blocks took ~40 s of the
    quick tier's FSDP set-up with a fresh TMPDIR, as in a fresh clone)."""
    return {"from_fsdp1": train(rank, world, dataset, "from_fsdp1", {"model.compile": "on"}, "fsdp",
                                load=f"{tmp}/fsdp1")}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from pipeline.train.distributed.process_group import process_group, run_workers

    tmp = tmp_path_factory.mktemp("fsdp")
    ds = str(tmp / "ds")
    write_synthetic_dataset(ds, n_train=160, n_val=16, seq_len=SEQ, vocab_size=VOCAB, seed=3, rows_per_shard=48)
    one = {"train.batch_size": 8}  # one worker with the global batch of two workers x 4
    out = {"tmp": tmp, "one": train(0, 1, ds, "one", one, "none", save_to=f"{tmp}/full1")}
    with process_group(0, 1):  # FSDP on a one-worker group, in this process
        out["one_fsdp"] = train(0, 1, ds, "one_fsdp", one, "fsdp", save_to=f"{tmp}/fsdp1")
    out["two"] = run_workers(two_workers, 2, ds, str(tmp))
    out["two_to_one"] = train(0, 1, ds, "two_to_one", one, "none", load=f"{tmp}/fsdp2")
    # an elastic run of 1-2 workers that lost one: the survivor accumulates two micro-batches of 4 (the global 8)
    elastic = {"ray.num_workers": "1-2"}
    out["elastic_ddp"] = train(0, 1, ds, "elastic_ddp", elastic, "none", load=f"{tmp}/ddp2")
    with process_group(0, 1):
        out["elastic_fsdp"] = train(0, 1, ds, "elastic_fsdp", elastic, "fsdp", load=f"{tmp}/fsdp2")
    out["resonance_one"] = train(0, 1, ds, "resonance_one", {**one, "model.mixer": "resonance",
                                                               "model.tie_embeddings": False}, "none")
    return out


def assert_same_weights(runs, got: str, want: str) -> None:
    want_sd = load_weights(runs, want)
    for name, tensor in load_weights(runs, got).items():
        torch.testing.assert_close(tensor, want_sd[name], **WEIGHT_TOL, msg=lambda m: f"{got} vs {want}, {name}: {m}")


def test_fsdp_losses_equal_ddp_over_8_steps(runs):
    two = runs["two"][0]
    assert (two["ddp"]["parallel"], two["fsdp"]["parallel"]) == ("ddp", "fsdp")
    assert len(two["fsdp"]["losses"]) == STEPS
    assert two["fsdp"]["losses"] == pytest.approx(two["ddp"]["losses"], **TOL)
    assert_same_weights(runs, "fsdp", "ddp")
    # the one-process engine with the same global batch, and FSDP on a one-worker group
    assert two["fsdp"]["losses"] == pytest.approx(runs["one"]["losses"], **TOL)
    assert runs["one_fsdp"]["losses"] == pytest.approx(runs["one"]["losses"], **TOL)
    assert runs["two"][1]["fsdp"]["digest"] == two["fsdp"]["digest"]  # both workers gathered the same weights


def test_fsdp_resume_is_bitwise(runs):
    """Stopped at step 4, saved sharded, loaded by a fresh pair of workers: steps 5-8 and the final weights are
    bit for bit those of the run that never stopped."""
    two = runs["two"][0]
    assert two["fsdp_resumed"]["losses"] == two["fsdp"]["losses"][SAVE_AT:]
    assert two["fsdp_resumed"]["digest"] == two["fsdp"]["digest"]


def test_resharded_resume_equals_an_uninterrupted_run(runs):
    """2 -> 1: two workers' shards resumed in one process; 1 -> 2: the one-process engine's full checkpoint resumed
    by two FSDP workers with gradient accumulation over two micro-batches (sharded gradients add up across backward
    passes) and every block checkpointed (its parameters gathered again for the recompute). The compiled case is
    test_compiled_blocks_resume_a_one_worker_groups_shards."""
    two, one = runs["two"][0], runs["one"]
    assert runs["two_to_one"]["losses"] == pytest.approx(two["fsdp"]["losses"][SAVE_AT:], **TOL)
    assert_same_weights(runs, "two_to_one", "fsdp")
    assert two["from_full1"]["losses"] == pytest.approx(one["losses"][SAVE_AT:], **TOL)
    assert_same_weights(runs, "from_full1", "one")


@pytest.mark.system  # a spawn of two workers compiling the blocks: ~40 s with a fresh inductor cache
def test_compiled_blocks_resume_a_one_worker_groups_shards(runs):
    """1 -> 2: the checkpoint a one-worker FSDP group sharded, resumed by two FSDP workers with regionally compiled
    blocks (compiled, then sharded: FSDP's hooks outside the graphs): steps 5-8 and the final weights are the
    one-process engine's."""
    from pipeline.train.distributed.process_group import run_workers

    got = run_workers(compiled_two_workers, 2, str(runs["tmp"] / "ds"), str(runs["tmp"]))[0]["from_fsdp1"]
    assert got["parallel"] == "fsdp"
    assert got["losses"] == pytest.approx(runs["one"]["losses"][SAVE_AT:], **TOL)
    assert_same_weights(runs, "from_fsdp1", "one")



def test_an_elastic_resume_on_fewer_workers_continues_the_same_training(runs):
    """A 1-2 worker range that lost a worker at step 4: the survivor resumes the two workers' checkpoint, DDP's full
    layout and FSDP's shards alike, with grad_accum re-derived (2 micro-batches of 4 for the global 8), and steps 5-8
    are the losses and weights of the two workers that never stopped."""
    two = runs["two"][0]
    for name, want in (("elastic_ddp", "ddp"), ("elastic_fsdp", "fsdp")):
        assert runs[name]["losses"] == pytest.approx(two[want]["losses"][SAVE_AT:], **TOL), name
        assert_same_weights(runs, name, want)
    assert runs["elastic_fsdp"]["parallel"] == "fsdp"


def test_fsdp_composes_with_resonance_untied_head_and_checkpointing(runs):
    """The resonance family (its mixer an FSDP unit of its own, fp32), an untied output weight in the root, and
    the mixer half of every block recomputed in backward (activation_checkpointing=mixer: a checkpoint around the
    mixer unit inside the block unit), against the one-process engine."""
    got, want = runs["two"][0]["resonance_fsdp"], runs["resonance_one"]
    assert got["parallel"] == "fsdp" and len(got["losses"]) == STEPS
    assert got["losses"] == pytest.approx(want["losses"], **TOL)
    assert_same_weights(runs, "resonance_fsdp", "resonance_one")


def test_sharded_checkpoint_on_disk(runs):
    """Two shard files and metadata, meta.json naming the layout; nothing temporary left; consolidated, the
    weights of every parameter, as a full checkpoint holds them."""
    from pipeline.train.checkpoints.state import load_model_state, read_checkpoint_meta

    ckpt = runs["tmp"] / "fsdp2"
    meta = read_checkpoint_meta(ckpt)
    assert (meta["format"], meta["layout"], meta["world_size"], meta["parallel"]) == (2, "sharded", 2, "fsdp")
    assert meta["counters"]["step"] == SAVE_AT and meta["scheduler"]["last_epoch"] == SAVE_AT
    assert sorted(p.name for p in (ckpt / "sharded").iterdir()) == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    assert not [p for p in ckpt.parent.iterdir() if ".tmp-" in p.name]
    state = load_model_state(ckpt)
    assert set(state) == {k.removeprefix("decoder.") for k in load_weights(runs, "one")}
    assert all(t.shape[0] > 0 and t.dtype == torch.float32 for t in state.values())
    # the one-process run and FSDP on a one-worker group trained bit for bit alike: their full and sharded
    # checkpoints consolidate to the same tensors
    full, sharded = load_model_state(runs["tmp"] / "full1"), load_model_state(runs["tmp"] / "fsdp1")
    assert full.keys() == sharded.keys() and all(torch.equal(full[k], sharded[k]) for k in full)


def test_a_damaged_or_foreign_sharded_checkpoint_is_one_clear_error(runs, tmp_path):
    """A missing shard file, and metadata that would run code when unpickled, are refused before anything loads."""
    import shutil

    from pipeline.train.checkpoints.state import CheckpointError, load_model_state, read_checkpoint_meta

    good = runs["tmp"] / "fsdp2"
    missing = tmp_path / "missing"
    shutil.copytree(good, missing)
    (missing / "sharded" / "__1_0.distcp").unlink()
    with pytest.raises(CheckpointError, match="lacks sharded/__1_0.distcp; it is incomplete"):
        read_checkpoint_meta(missing)

    class Exploit:
        def __reduce__(self):
            return (Path.touch, (tmp_path / "pwned",))

    evil = tmp_path / "evil"
    shutil.copytree(good, evil)
    (evil / "sharded" / ".metadata").write_bytes(pickle.dumps(Exploit()))
    with pytest.raises(CheckpointError, match="is not DCP metadata"):
        load_model_state(evil, json.loads((evil / "meta.json").read_text()))
    assert not (tmp_path / "pwned").exists()


def test_eval_reads_a_sharded_checkpoint_as_it_reads_a_full_one(runs):
    """`eval` on the two FSDP workers' step-4 shards (consolidated in this process, no process group) and on the
    one-process run's step-4 full checkpoint: the same validation loss, to the runs' tolerance."""
    from pipeline.cli.eval import evaluate_checkpoint

    sharded = evaluate_checkpoint(runs["tmp"] / "fsdp2")
    full = evaluate_checkpoint(runs["tmp"] / "full1")
    assert sharded["eval/loss"] == pytest.approx(full["eval/loss"], **TOL)


def test_loss_by_position_is_one_result_on_every_worker_layout(runs):
    """Every rank runs the same forwards and one all-reduce: both workers hold the whole split's figures, equal to
    one process's (weights trained under another layout differ by reordered sums only: TOL)."""
    one = runs["one"]["by_position"]
    assert {k.split("/")[1] for k in one} == {"pos_loss", "pos_docs", "pos_tokens", "cum_ppl"} and one["val/pos_tokens/1-64"] > 0
    for mode, want in (("ddp", one), ("fsdp", one), ("resonance_fsdp", runs["resonance_one"]["by_position"])):
        ranks = [r[mode]["by_position"] for r in runs["two"]]
        assert ranks[0] == ranks[1], mode
        assert ranks[0].keys() == want.keys() and ranks[0] == pytest.approx(want, rel=1e-4), mode
    assert runs["one_fsdp"]["by_position"] == pytest.approx(one, rel=1e-4)


def test_generation_from_gathered_fsdp_weights(runs):
    """Engine.full_model() (the eval-time samples under FSDP): every worker gathers the whole weights and greedy
    generation with the KV cache gives what the consolidated weights give in a plain decoder."""
    from model.decoder import build_model
    from model.decode_loop import generate_ids

    decoder = build_model("nano", VOCAB)
    decoder.load_state_dict({k.removeprefix("decoder."): v for k, v in load_weights(runs, "fsdp").items()})
    want = generate_ids(decoder, [PROMPT], max_new_tokens=8, temperature=0.0)[0].tolist()
    assert [r["fsdp"]["generated"] for r in runs["two"]] == [want, want]



def load_in_place(rank: int, world: int, local: str, uri: str) -> dict:
    """One FSDP worker loading the two workers' checkpoint from disk and from the bucket: a digest of its shards of
    the weights and AdamW moments from each, and what the bucket read cost."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    from pipeline.train.engine import Engine

    out = {}
    for name, where in (("disk", local), ("bucket", uri)):
        engine = Engine(cfg_for(), VOCAB, torch.device("cpu"), rank=rank, world_size=world, parallel="fsdp")
        meta = engine.load(where)
        model_sd, optim_sd = get_state_dict(engine.module, engine.optimizer,
                                            options=StateDictOptions(flatten_optimizer_state_dict=True))
        h = hashlib.sha256()
        for key, value in sorted({**model_sd, **optim_sd}.items()):
            if isinstance(value, torch.Tensor):
                local_part = value.to_local() if hasattr(value, "to_local") else value
                h.update(key.encode() + local_part.detach().contiguous().numpy().tobytes())
        out[name] = {"digest": h.hexdigest(), "step": engine.step, "read": meta["read_bytes"],
                     "total": meta["shard_bytes"]}
    return out


@pytest.mark.system  # docs/tests.md: over ~5 s (8.4 s in the quick tier on 2 idle cores)
def test_each_worker_reads_only_its_shards_from_object_storage(runs, s3_bucket):
    """The two workers' step-4 checkpoint in the session's S3 bucket, loaded in place by two FSDP workers: each
    gets bit for bit what it gets from disk while fetching only its own part of the shards (ranged GETs), and one
    process consolidating it reads them all."""
    import pyarrow.fs as pafs

    from pipeline import storage
    from pipeline.train.engine import Engine
    from pipeline.train.distributed.process_group import run_workers

    local = runs["tmp"] / "fsdp2"
    uri = f"{s3_bucket}/fsdp-in-place/step_4"
    fs, path = storage.resolve(uri)
    pafs.copy_files(str(local), path, source_filesystem=pafs.LocalFileSystem(), destination_filesystem=fs)
    got = run_workers(load_in_place, 2, str(local), uri)
    for rank, r in enumerate(got):
        assert r["bucket"]["digest"] == r["disk"]["digest"] and r["bucket"]["step"] == SAVE_AT, rank
        assert r["disk"]["read"] == 0  # on disk DCP reads the files itself
        assert 0 < r["bucket"]["read"] < 0.6 * r["bucket"]["total"], r  # about half: its own shards
    assert got[0]["bucket"]["digest"] != got[1]["bucket"]["digest"]  # two different halves

    one = Engine(cfg_for(), VOCAB, torch.device("cpu"))  # no process group: whole tensors, resharded 2 -> 1
    meta = one.load(uri)
    assert meta["read_bytes"] >= meta["shard_bytes"] and one.step == SAVE_AT
    disk = Engine(cfg_for(), VOCAB, torch.device("cpu"))
    disk.load(local)
    for (name, a), (_, b) in zip(one.module.state_dict().items(), disk.module.state_dict().items()):
        assert torch.equal(a, b), name
