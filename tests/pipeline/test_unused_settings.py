"""Nothing a user sets is silently ignored: each mistake below is a command line a newcomer types, and the one line
it now gets (exit 2, no traceback) instead of a run that quietly does something else. All of them are refused while
the command line is read, before any data, Ray or MLflow work (pipeline/cli/unused_settings.py)."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
BS_TIER = str(ROOT / "tune_spaces" / "bs_tier.yaml")

MISTAKES = [
    (["prepare", "--data.source=builtin", "--data.path=corpus/"],
     "error: data.path is set, but data.source=builtin does not read it (it is for data.source=files or hf); set "
     "data.source, or drop data.path"),
    (["prepare", "--data.hf_name=roneneldan/TinyStories"],
     "error: data.hf_name is set, but data.source=builtin does not read it (it is for data.source=hf); set "
     "data.source, or drop data.hf_name"),
    (["train", "--data.source=files", "--data.path=corpus/", "--data.hf_split=validation"],
     "error: data.hf_split is set, but data.source=files does not read it (it is for data.source=hf)"),
    (["train", "--no-ray", "--ray.num_workers=4"],
     "error: ray.num_workers is not used with --no-ray (one plain process, no Ray Train workers); drop it, or drop "
     "--no-ray to train on Ray"),
    (["prepare", "--train.max_steps=80"],
     "error: train.max_steps is not used by `prepare`: prepare reads data.*, run.*, ray.address and model.tier; the "
     "rest is for training; drop it"),
    (["eval", "--checkpoint", "runs/x", "--train.eval_batches=4"],
     "error: train.eval_batches is not used by `eval`: eval takes the model, its data and its settings from the "
     "checkpoint; drop it"),
    (["train", "runs/x"], "error: `train` takes no positional argument ('runs/x'; only validate reads one: a "
                          "dataset, a checkpoint or a run); to continue a run or use its checkpoint, pass --resume runs/x (or "
                          "--checkpoint runs/x)"),
    (["prepare", "--prompt", "Once upon a time"],
     "error: --prompt is not used by `prepare` (it is for generate); drop it, or run the stage it is for"),
    (["export", "--resume", "runs/x", "--out", "hf/x", "--max-new-tokens", "16"],
     "error: --max-new-tokens is not used by `export` (it is for generate)"),
    (["eval", "--checkpoint", "runs/x", "--address", "auto"],
     "error: --address is not used by `eval` (it is for prepare, train and tune)"),
    (["train", "--checkpoint", "runs/x"],
     "error: --checkpoint runs/x is not used by `train` without --resume RUN: a new run starts from scratch"),
    (["train", "--tracking.enabled=false", "--tracking.experiment=mine"],
     "error: tracking.experiment is not used: tracking.enabled=false, so nothing is logged to MLflow; drop it"),
    (["prepare", "--data.on_bad_record=error", "--data.max_bad_fraction=0.01"],
     "error: data.max_bad_fraction is not used: with data.on_bad_record=error the first unreadable record fails the "
     "prepare, whatever the fraction; drop it"),
    (["prepare", "--data.tokenizer=tok.model", "--data.tokenizer_sample_bytes=1000000"],
     "error: data.tokenizer_sample_bytes is not used: data.tokenizer is given, so no tokenizer is trained and nothing "
     "is sampled for one; drop it"),
    (["validate", "runs/datasets/x", "--data.seq_len=128"],
     "error: --data.seq_len=128 is not used by `validate`: validate reads only the dataset directory, checkpoint or run it is given"),
    (["tune", "--space", BS_TIER, "--train.batch_size=4"],
     f"error: train.batch_size is searched by {BS_TIER} (params), which sets it in every trial; drop it from the "
     f"command line, or from the space's params"),
    (["tune", "--space", BS_TIER, "--train.max_steps=300"],
     f"error: train.max_steps is set from {BS_TIER}'s token_budget=16,777,216 in every trial; drop it, or set "
     f"token_budget: 0 in the space"),
    pytest.param(["train", "--no-ray", "--train.precision=bf16"],
                 "error: train.precision=bf16 is not used on a CPU: training here is fp32",
                 marks=pytest.mark.skipif(torch.cuda.is_available(), reason="bf16 trains on a GPU")),
]


@pytest.mark.parametrize("args, line", MISTAKES, ids=[" ".join(getattr(m, "values", m)[0]) for m in MISTAKES])
def test_a_setting_the_command_would_not_use_is_refused_in_one_line(args, line, tmp_path, capsys):
    from pipeline.run import main

    assert main([*args, f"--run.root={tmp_path}"] if args[0] != "validate" else args) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(line) and "\n" not in err, err
    assert not any(tmp_path.iterdir()), "something was written"


def test_a_data_path_without_a_source_reads_those_files_and_says_so(tmp_path, capsys):
    """`prepare --data.path=corpus/` without --data.source=files prepared the built-in corpus, never mentioning the
    path. Now the files are the corpus (said in a note): here an empty one, refused before any Ray work."""
    from pipeline.run import build_config, main, parse_args

    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "part-0.jsonl").write_text("")
    args = ["prepare", "--preset", "test", f"--run.root={tmp_path / 'runs'}", f"--data.path={corpus}"]
    assert build_config(*parse_args(args)).data.source == "files"
    capsys.readouterr()
    assert main(args) == 2
    out, err = capsys.readouterr()
    assert (f"note: data.source=files: data.path={corpus} is set and the built-in corpus (the default source) reads "
            f"no path, so the files there are the corpus") in out
    assert err.strip() == (f"error: no text in data.path='{corpus}': its 1 file(s) (part-0.jsonl) are empty; point "
                           f"data.path at the corpus")
    assert not (tmp_path / "runs").exists()  # refused before a build directory (or Ray) was started


def _not_read() -> list[tuple[str, str]]:
    from pipeline.mixture_spec import FIELD_SOURCE_KINDS, SOURCE_KINDS

    return [(kind, field) for field, kinds in FIELD_SOURCE_KINDS.items() for kind in SOURCE_KINDS if kind not in kinds]


@pytest.mark.parametrize("kind, field", _not_read(), ids=[f"{k}-{f}" for k, f in _not_read()])
def test_a_data_field_the_source_kind_does_not_read_is_refused(kind, field, tmp_path, capsys):
    """Every field the config's table (pipeline/mixture_spec.py SOURCE_KIND_FIELDS) gives to other source kinds is
    refused for this one, with the kinds that read it named."""
    from pipeline.mixture_spec import FIELD_SOURCE_KINDS
    from pipeline.run import main

    needs = {"builtin": [], "files": ["--data.path=corpus/"], "hf": ["--data.hf_name=roneneldan/TinyStories"]}[kind]
    value = "true" if field == "hf_streaming" else "x"
    args = ["prepare", f"--data.source={kind}", *needs, f"--data.{field}={value}", f"--run.root={tmp_path}"]
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    readers = " or ".join(sorted(FIELD_SOURCE_KINDS[field]))
    assert err == (f"error: data.{field} is set, but data.source={kind} does not read it (it is for data.source="
                   f"{readers}); set data.source, or drop data.{field}"), err
    assert not any(tmp_path.iterdir()), "something was written"


def test_the_source_kind_table_names_data_fields_a_mixture_source_may_set():
    """A misspelt field in the table would turn its check off silently: each one is a data.* field, and one a mixture's
    source may set (pipeline/mixture_spec.py SOURCE_FIELDS)."""
    import dataclasses

    from pipeline.config import DataConfig
    from pipeline.mixture_spec import SOURCE_FIELDS, SOURCE_KIND_FIELDS, SOURCE_KINDS

    data_fields = {f.name for f in dataclasses.fields(DataConfig)}
    assert set(SOURCE_KIND_FIELDS) == set(SOURCE_KINDS)
    named = {f for fields in SOURCE_KIND_FIELDS.values() for f in fields}
    assert named <= data_fields & set(SOURCE_FIELDS), named - (data_fields & set(SOURCE_FIELDS))
