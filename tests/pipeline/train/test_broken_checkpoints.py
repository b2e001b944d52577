"""Every broken checkpoint file is one line: a truncated or corrupt model.safetensors, train_state.pt, meta.json, DCP
shard, `.metadata`, the dataset's tokenizer model, or a checkpoint on S3 with an object missing, under eval,
generate, export, `train --resume` and `validate`. The line names the file and what is wrong, and offers the
previous complete checkpoint as the command to run (pipeline/train/checkpoints/broken.py).

One --no-ray run is trained once (4 steps, a checkpoint every 2: step_000002 and step_000004, both kept); each case
copies it and breaks one file of step_000004. A sharded copy has step_000004 written again in the FSDP layout (FSDP
on a one-worker group in this process); an S3 copy holds both checkpoints in the session's SeaweedFS bucket, with
step_000004's model.safetensors deleted.

    .venv/bin/python -m pytest -q tests/pipeline/train/test_broken_checkpoints.py
"""
from __future__ import annotations

import json
import re
import shlex
import shutil
from pathlib import Path

import pytest

RUN = "broken-ckpt-src"
GARBAGE = b"\x5a"  # the byte a corrupt file is filled with (same size: only its sha256 can tell)


def _main(args: list[str], capsys) -> tuple[int, str, str]:
    from pipeline.run import main

    code = main(args)
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err, out + err
    return code, out, err


@pytest.fixture(scope="module")
def source(test_runs_root) -> Path:
    """The trained run: step_000002 and step_000004 under checkpoints/phase0, finished at step 4."""
    from pipeline.run import main

    assert main(["train", "--no-ray", "--preset", "test", f"--run.root={test_runs_root}", f"--run.name={RUN}",
                 "--train.max_steps=4", "--train.checkpoint_every=2", "--train.eval_every=2",
                 "--train.sample_tokens=0", "--tracking.enabled=false"]) == 0
    run = test_runs_root / RUN
    assert sorted(p.name for p in (run / "checkpoints" / "phase0").iterdir()) == ["step_000002", "step_000004"]
    return run


def copy_run(src: Path, dst: Path) -> Path:
    """A copy of a run whose run.json names its own checkpoints."""
    shutil.copytree(src, dst)
    (dst / "run.json").write_text((dst / "run.json").read_text().replace(str(src), str(dst)))
    return dst


@pytest.fixture(scope="module")
def sharded(source, tmp_path_factory) -> Path:
    """A copy of the run whose step_000004 is the same state in the sharded (FSDP, DCP) layout."""
    import torch

    from pipeline.config import from_dict
    from pipeline.train.engine import Engine
    from pipeline.train.distributed.process_group import process_group

    run = copy_run(source, tmp_path_factory.mktemp("sharded") / RUN)
    step4 = run / "checkpoints" / "phase0" / "step_000004"
    meta = json.loads((step4 / "meta.json").read_text())
    with process_group(0, 1):
        engine = Engine(from_dict(meta["config"]), meta["vocab_size"], torch.device("cpu"), parallel="fsdp")
        engine.load(step4)
        shutil.rmtree(step4)
        engine.save(step4, extra={k: meta[k] for k in ("dataset_dir", "phase", "metrics") if k in meta})
    assert json.loads((step4 / "meta.json").read_text())["layout"] == "sharded"
    return run


@pytest.fixture(scope="module")
def on_s3(source, s3_bucket) -> str:
    """The run's two checkpoints in the bucket; step_000004 lost its model.safetensors. Returns the folder."""
    from pipeline import storage
    from pipeline.train.checkpoints.index import publish

    folder = f"{s3_bucket}/broken-ckpts/{RUN}/checkpoints/phase0"
    for name in ("step_000002", "step_000004"):
        publish(source / "checkpoints" / "phase0" / name, f"{folder}/{name}")
    storage.delete(f"{folder}/step_000004/model.safetensors")
    return folder


# ------------------------------------------------------------------------------------------ breaking one file
def _truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[:len(data) // 2])


def _corrupt(path: Path) -> None:
    path.write_bytes(GARBAGE * path.stat().st_size)


# kind: (run fixture, file under step_000004, how it is broken, what the line says of it)
KINDS = {
    "safetensors-truncated": ("source", "model.safetensors", _truncate, r"holds [\d,]+ bytes of model\.safetensors, "
                              r"meta\.json says [\d,]+"),
    "safetensors-corrupt": ("source", "model.safetensors", _corrupt,
                            r"model\.safetensors does not match the sha256 meta\.json records"),
    "train_state-truncated": ("source", "train_state.pt", _truncate, r"holds [\d,]+ bytes of train_state\.pt"),
    "train_state-corrupt": ("source", "train_state.pt", _corrupt,
                            r"train_state\.pt does not match the sha256 meta\.json records"),
    "meta-corrupt": ("source", "meta.json", lambda p: p.write_text('{"format": 2, "lay'),
                     r"has a corrupt meta\.json"),
    "dcp-shard-corrupt": ("sharded", "sharded/__0_0.distcp", _corrupt,
                          r"sharded/__0_0\.distcp does not match the sha256 meta\.json records"),
    "dcp-metadata-corrupt": ("sharded", "sharded/.metadata", _corrupt,
                             r"sharded/\.metadata does not match the sha256 meta\.json records"),
}


@pytest.fixture
def broken(request, tmp_path):
    """(run copy, broken checkpoint, previous checkpoint, kind's pattern) for the kind in request.param."""
    fixture, name, breaker, pattern = KINDS[request.param]
    run = copy_run(request.getfixturevalue(fixture), tmp_path / RUN)
    ckpt = run / "checkpoints" / "phase0" / "step_000004"
    breaker(ckpt / name)
    return run, ckpt, run / "checkpoints" / "phase0" / "step_000002", pattern


def assert_one_line(code: int, err: str, ckpt, pattern: str, prev, command: str) -> str:
    """Exit 2 and exactly one `error:` line naming the checkpoint, the file and what is wrong, and offering `command`
    with --checkpoint PREV (the previous complete checkpoint); returns the offered command."""
    lines = [ln for ln in err.splitlines() if ln.startswith("error:")]
    assert code == 2 and len(lines) == 1, err
    line = lines[0]
    assert str(ckpt) in line and re.search(pattern, line), line
    assert f"the previous complete checkpoint is {prev} (step 2): " in line, line
    offered = line.split(f"(step 2): ", 1)[1]
    assert offered.startswith(command) and f"--checkpoint {prev}" in offered, line
    return offered


def _eval(ckpt) -> list[str]:
    return ["eval", "--checkpoint", str(ckpt), "--preset", "test", "--tracking.enabled=false"]


def _generate(ckpt) -> list[str]:
    return ["generate", "--checkpoint", str(ckpt), "--prompt", "The ", "--max-new-tokens", "4"]


def _export(ckpt, tmp_path) -> list[str]:
    return ["export", "--checkpoint", str(ckpt), "--out", str(tmp_path / "hf")]


READERS = {"eval": lambda c, t: _eval(c), "generate": lambda c, t: _generate(c), "export": _export}
WEIGHT_KINDS = ["safetensors-truncated", "safetensors-corrupt", "meta-corrupt", "dcp-shard-corrupt",
                "dcp-metadata-corrupt"]


@pytest.mark.parametrize("command", list(READERS))
@pytest.mark.parametrize("broken", WEIGHT_KINDS, indirect=True)
def test_eval_generate_export_name_the_broken_file_and_offer_the_previous_checkpoint(broken, command, tmp_path,
                                                                                     capsys, request):
    run, ckpt, prev, pattern = broken
    code, _, err = _main(READERS[command](ckpt, tmp_path), capsys)
    assert_one_line(code, err, ckpt, pattern, prev, f"python pipeline/run.py {command} --checkpoint {prev}")
    if request.node.callspec.params["broken"] in ("safetensors-corrupt", "dcp-shard-corrupt"):
        # found by the failed load, which the line quotes in the library's words
        assert re.search(r"records \((safetensors|torch\.distributed\.checkpoint): \S", err), err
    assert not (tmp_path / "hf").exists()


@pytest.mark.parametrize("command", list(READERS))
@pytest.mark.parametrize("broken", ["train_state-truncated", "train_state-corrupt"], indirect=True)
def test_eval_generate_export_read_no_train_state(broken, command, tmp_path, capsys):
    """They read the weights alone: a checkpoint whose train_state.pt is lost or corrupt still evaluates, generates
    and exports (train --resume and validate are the commands that refuse it)."""
    run, ckpt, prev, pattern = broken
    code, out, err = _main(READERS[command](ckpt, tmp_path), capsys)
    assert code == 0 and "error:" not in err, err
    assert {"eval": "eval: eval/loss=", "generate": "generate: batch 1", "export": "exported "}[command] in out


@pytest.mark.parametrize("broken", ["safetensors-corrupt", "train_state-corrupt", "dcp-shard-corrupt",
                                    "dcp-metadata-corrupt"], indirect=True)
def test_resume_past_a_file_that_lies_about_itself_offers_the_previous_checkpoint(broken, capsys):
    """Complete by its listing (every size as recorded), yet it does not load: no silent fallback; the one line
    offers `train --resume RUN ... --checkpoint PREV`."""
    run, ckpt, prev, pattern = broken
    args = ["train", "--resume", str(run), "--no-ray", "--preset", "test", "--train.max_steps=6"]
    code, out, err = _main(args, capsys)
    assert_one_line(code, err, ckpt, pattern, prev, f"python pipeline/run.py train --resume {run} --checkpoint {prev}")
    assert "step 5" not in out  # nothing trained


INCOMPLETE_KINDS = ["safetensors-truncated", "train_state-truncated", "meta-corrupt"]  # by its listing


@pytest.mark.parametrize("broken", ["safetensors-truncated", "meta-corrupt"], indirect=True)
def test_resume_skips_a_checkpoint_its_listing_shows_incomplete_with_one_warning(broken, capsys):
    run, ckpt, prev, pattern = broken
    code, out, err = _main(["train", "--resume", str(run), "--no-ray", "--preset", "test", "--train.max_steps=6"],
                           capsys)
    assert code == 0, err
    warning = [ln for ln in out.splitlines() if ln.startswith("resume: ") and "resuming from" in ln]
    assert len(warning) == 1 and re.search(pattern, warning[0]) and f"resuming from {prev} (step 2)" in warning[0]
    assert json.loads((run / "run.json").read_text())["status"] == "finished"
    assert (run / "checkpoints" / "phase0" / "step_000006").is_dir()


@pytest.mark.parametrize("broken", list(KINDS), indirect=True)
def test_validate_names_each_broken_file_and_offers_the_previous_checkpoint(broken, capsys, request):
    run, ckpt, prev, pattern = broken
    code, out, _ = _main(["validate", str(ckpt)], capsys)
    assert code == 1
    assert any(ln.startswith("  BROKEN  ") and re.search(pattern, ln) for ln in out.splitlines()), out
    assert (f"checkpoint {ckpt} is broken (1 problem); the previous complete checkpoint is {prev} (step 2): check it "
            f"with `python pipeline/run.py validate {prev}` and use it with --checkpoint {prev}") in out
    # a run directory is the checkpoint `train --resume RUN` continues from: past one its listing shows incomplete
    # (skipped with a line naming what is wrong), not past one that lies about itself (resume refuses it)
    code, out, _ = _main(["validate", str(run)], capsys)
    if request.node.callspec.params["broken"] in INCOMPLETE_KINDS:
        skipped = [ln for ln in out.splitlines() if ln.startswith("validate: ") and "validating " in ln]
        assert code == 0 and len(skipped) == 1 and re.search(pattern, skipped[0]), out
        assert f"validating {prev}, the newest complete checkpoint of the run" in skipped[0], out
        assert f"checkpoint {prev} is whole" in out, out
    else:
        assert code == 1 and f"checkpoint {ckpt} is broken" in out, out
    code, out, _ = _main(["validate", str(prev)], capsys)
    assert code == 0 and f"checkpoint {prev} is whole" in out, out


def test_validate_of_a_whole_checkpoint_checks_every_file_and_the_load(source, capsys):
    ckpt = source / "checkpoints" / "phase0" / "step_000004"
    code, out, _ = _main(["validate", str(source)], capsys)
    assert code == 0, out
    assert f"validate: checkpoint {ckpt}" in out
    assert re.search(r"ok      model\.safetensors: [\d,]+ bytes, sha256 as recorded", out)
    assert re.search(r"ok      train_state\.pt: [\d,]+ bytes, sha256 as recorded", out)
    assert "ok      loads: the weights and train_state.pt" in out and "ok      tokenizer " in out


def test_the_offered_commands_run(tmp_path, source, capsys):
    """The command the line offers is the one to run: eval --checkpoint PREV and train --resume RUN --checkpoint
    PREV succeed."""
    run = copy_run(source, tmp_path / RUN)
    ckpt, prev = run / "checkpoints" / "phase0" / "step_000004", run / "checkpoints" / "phase0" / "step_000002"
    _corrupt(ckpt / "model.safetensors")
    pattern = KINDS["safetensors-corrupt"][3]
    for args in (_eval(ckpt), ["train", "--resume", str(run), "--no-ray", "--preset", "test", "--train.max_steps=6"]):
        code, _, err = _main(args, capsys)
        offered = assert_one_line(code, err, ckpt, pattern, prev, f"python pipeline/run.py {args[0]}")
        words = shlex.split(offered)
        assert words[:2] == ["python", "pipeline/run.py"]
        code, out, err = _main(words[2:], capsys)
        assert code == 0, err
    assert f"resume: from {prev} (step 2), as --checkpoint asks" in out
    assert (run / "checkpoints" / "phase0" / "step_000006").is_dir()


# ------------------------------------------------------------------------------------------ the tokenizer model
@pytest.fixture
def broken_tokenizer(source, tmp_path) -> tuple[Path, Path, Path]:
    """(run copy, its checkpoint, the tokenizer) where the dataset the checkpoints name is a copy whose
    tokenizer.model is corrupt (the session's dataset is left alone)."""
    run = copy_run(source, tmp_path / RUN)
    ckpt = run / "checkpoints" / "phase0" / "step_000004"
    dataset = Path(json.loads((ckpt / "meta.json").read_text())["dataset_dir"])
    copy = shutil.copytree(dataset, tmp_path / "dataset")
    for meta_path in (run / "checkpoints" / "phase0").glob("step_*/meta.json"):
        meta_path.write_text(meta_path.read_text().replace(str(dataset), str(copy)))
    tokenizer = next(Path(copy).rglob("tokenizer.model"))
    _corrupt(tokenizer)
    return run, ckpt, tokenizer


@pytest.mark.parametrize("command", ["generate", "export"])
def test_a_broken_tokenizer_model_is_one_line_naming_it(broken_tokenizer, command, tmp_path, capsys):
    """Every checkpoint of the run reads the dataset's tokenizer, so no other checkpoint is offered: the line says
    to restore it, and how to check it."""
    run, ckpt, tokenizer = broken_tokenizer
    code, _, err = _main(READERS[command](ckpt, tmp_path), capsys)
    lines = [ln for ln in err.splitlines() if ln.startswith("error:")]
    assert code == 2 and len(lines) == 1, err
    assert (f"error: tokenizer model {tokenizer} (the dataset's, which checkpoint {ckpt} names) is broken: "
            in lines[0]), lines[0]
    assert "its sha256 is not the one the manifest records" in lines[0]
    assert "restore it from a copy of the dataset or prepare the dataset again" in lines[0]


def test_eval_reads_no_tokenizer(broken_tokenizer, capsys):
    run, ckpt, tokenizer = broken_tokenizer
    code, out, err = _main(_eval(ckpt), capsys)
    assert code == 0 and "eval: eval/loss=" in out, err


def test_eval_passkey_names_a_broken_tokenizer_as_generate_does(broken_tokenizer, capsys):
    """eval --passkey reads the dataset's tokenizer through the same checked function as generate, export and validate
    (pipeline/data/shards.py dataset_tokenizer): the line names the file and its sha256, not only the library's words."""
    run, ckpt, tokenizer = broken_tokenizer
    code, _, err = _main(_eval(ckpt) + ["--passkey", "--passkey-lengths", "64", "--passkey-trials", "1"], capsys)
    lines = [ln for ln in err.splitlines() if ln.startswith("error:")]
    assert code == 2 and len(lines) == 1, err
    assert lines[0].startswith(f"error: tokenizer model {tokenizer} (dataset "), lines[0]
    assert "its sha256 is not the one the manifest records" in lines[0]
    assert "restore it from a copy of the dataset or prepare the dataset again" in lines[0]


def test_validate_names_a_broken_tokenizer(broken_tokenizer, capsys):
    run, ckpt, tokenizer = broken_tokenizer
    code, out, _ = _main(["validate", str(ckpt)], capsys)
    assert code == 1
    assert any(ln.startswith(f"  BROKEN  tokenizer model {tokenizer}") for ln in out.splitlines()), out
    assert "ok      loads: the weights and train_state.pt" in out  # the checkpoint itself is whole


# ------------------------------------------------------------------------------------------ object storage
@pytest.mark.parametrize("command", ["eval", "generate", "export", "train", "validate"])
def test_a_checkpoint_on_s3_with_a_missing_object(on_s3, source, command, tmp_path, capsys):
    ckpt, prev = f"{on_s3}/step_000004", f"{on_s3}/step_000002"
    pattern = r"lacks model\.safetensors"
    if command == "validate":
        code, out, _ = _main(["validate", ckpt], capsys)
        assert code == 1 and re.search(rf"  BROKEN  checkpoint {re.escape(ckpt)} {pattern}", out), out
        assert f"the previous complete checkpoint is {prev} (step 2)" in out
        return
    if command == "train":
        run = copy_run(source, tmp_path / RUN)
        args = ["train", "--resume", str(run), "--no-ray", "--preset", "test", "--train.max_steps=6",
                "--checkpoint", ckpt]
    else:
        args = READERS[command](ckpt, tmp_path)
    code, _, err = _main(args, capsys)
    start = f"train --resume {run}" if command == "train" else command
    assert_one_line(code, err, ckpt, pattern, prev, f"python pipeline/run.py {start} --checkpoint {prev}")


def test_the_line_survives_a_trip_through_a_worker_process():
    """Ray Train's workers raise it and the CLI prints it from the driver: its fields travel with it (pickled)."""
    import pickle

    from pipeline.train.checkpoints.broken import BrokenCheckpoint

    broken = BrokenCheckpoint("s3://b/r/ray/phase0/checkpoint_2", "checkpoint s3://b/r/ray/phase0/checkpoint_2 lacks "
                              "model.safetensors", "s3://b/r/ray/phase0/checkpoint_1", 20)
    back = pickle.loads(pickle.dumps(broken))
    assert (back.location, back.problem, back.previous, back.previous_step) == (
        broken.location, broken.problem, broken.previous, 20)
    assert str(back) == str(broken) == ("checkpoint s3://b/r/ray/phase0/checkpoint_2 lacks model.safetensors; the "
                                        "previous complete checkpoint is s3://b/r/ray/phase0/checkpoint_1 (step 20): "
                                        "pass --checkpoint s3://b/r/ray/phase0/checkpoint_1")


@pytest.mark.system  # docs/tests.md: over ~5 s (6.1 s in the quick tier on 2 idle cores)
def test_a_prompts_file_that_is_not_text_is_never_blamed_on_the_whole_checkpoint(source, tmp_path):
    """A gzipped --prompts-file beside a whole checkpoint: its own line, naming the file; no previous checkpoint is
    offered (following that advice would have thrown away good training). A text file then generates."""
    import gzip
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[3]
    ckpt = source / "checkpoints" / "phase0" / "step_000004"
    gz = tmp_path / "prompts.txt.gz"
    gz.write_bytes(gzip.compress(b"Once upon a time\ndef main\n"))
    cmd = [sys.executable, str(root / "pipeline" / "run.py"), "generate", "--checkpoint", str(ckpt),
           "--max-new-tokens", "4"]
    res = subprocess.run([*cmd, "--prompts-file", str(gz)], capture_output=True, text=True, timeout=300, cwd=root)
    assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr
    assert res.stderr.strip().splitlines() == [
        f"error: --prompts-file {gz} is gzip-compressed; it must be a UTF-8 text file with one prompt per line: "
        f"decompress it first (gunzip -k {gz})"]
    assert "==> generate" not in res.stdout  # the model never loaded
    text = tmp_path / "prompts.txt"
    text.write_text(gzip.decompress(gz.read_bytes()).decode())
    res = subprocess.run([*cmd, "--prompts-file", str(text), "--min-p", "0.05"], capture_output=True, text=True,
                         timeout=300, cwd=root)
    assert res.returncode == 0 and "Traceback" not in res.stdout + res.stderr, res.stderr
    assert "--- 'Once upon a time'" in res.stdout and "--- 'def main'" in res.stdout
    assert "generate: batch 2, " in res.stdout


def test_a_text_or_json_error_is_never_blamed_on_a_whole_checkpoint(source):
    """The diagnosis covers the checkpoint's own files: with every file whole (meta.json parsed, sizes and sha256 as
    it records), a UnicodeDecodeError or a JSONDecodeError raised by the command came from something else."""
    from pipeline.train.checkpoints.broken import diagnose

    ckpt = str(source / "checkpoints" / "phase0" / "step_000004")
    assert diagnose(ckpt, UnicodeDecodeError("utf-8", b"\x1f\x8b", 0, 1, "invalid start byte")) is None
    assert diagnose(ckpt, json.JSONDecodeError("Expecting value", "\x1f", 0)) is None
    from safetensors import SafetensorError

    # a format library's error on a whole checkpoint is still the checkpoint's (bytes that lie about themselves)
    assert diagnose(ckpt, SafetensorError("Error while deserializing header")) is not None
