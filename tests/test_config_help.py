"""`python pipeline/run.py --help` teaches: every config field with its type, default and meaning, grouped by
section and generated from pipeline/config.py; a mistyped field gets "did you mean" in one line.

    .venv/bin/python -m pytest -q tests/test_config_help.py
"""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from pipeline.config import field_types, load_config
from pipeline.cli.config_help import field_meanings, fields_help, section_help, sections

ROOT = Path(__file__).resolve().parents[1]


def test_every_config_field_has_a_one_line_meaning():
    """A field added without a trailing `# comment` in pipeline/config.py fails here: --help would show it bare."""
    meanings = field_meanings()
    assert set(meanings) == set(field_types())
    bare = [path for path, meaning in meanings.items() if len(meaning.strip()) < 8]
    assert not bare, f"fields without a trailing `# meaning` comment in pipeline/config.py: {bare}"


def test_help_lists_each_field_with_type_default_and_meaning_by_section(capsys):
    """The mistake: `python pipeline/run.py --help` to find the field for the micro-batch; its line says it."""
    from pipeline.run import parse_args

    with pytest.raises(SystemExit) as done:
        parse_args(["--help"])
    out = capsys.readouterr().out
    assert done.value.code == 0
    assert [ln[:-1] for ln in out.split("\nconfig fields:")[1].splitlines() if re.fullmatch(r"[a-z]+:", ln)] == list(
        sections())
    line = next(ln for ln in out.splitlines() if ln.startswith("  train.batch_size "))
    assert re.fullmatch(r"  train\.batch_size +int +8 +micro-batch, sequences per worker per forward", line), line
    for path, typ in field_types().items():  # every field on a line of its own: path, type, default
        assert re.search(rf"\n  {re.escape(path)} +{typ.__name__} +\S", out), path


def test_help_with_a_preset_shows_its_values(capsys):
    from pipeline.run import parse_args

    with pytest.raises(SystemExit):
        parse_args(["--preset", "test", "--help"])
    out = capsys.readouterr().out
    assert "defaults: the test preset's values" in out
    assert re.search(r"\n  train\.max_steps +int +8 ", out)  # the test preset's 8, not the base config's 200


def test_the_help_section_in_the_docs_is_the_generated_one():
    """docs/configuration.md shows one section of --help; regenerate it with
    python -c "from pipeline.cli.config_help import section_help; print(section_help('ray'))"."""
    doc = (ROOT / "docs" / "configuration.md").read_text()
    block = re.search(r"```text\n(ray:\n.*?)\n```", doc, re.S)
    assert block, "docs/configuration.md has no ```text block of the `ray:` section of --help"
    assert block.group(1) == section_help("ray")
    assert fields_help(load_config("cpu"), "cpu").count("\n\n") == len(sections())


@pytest.mark.parametrize("args, line", [
    (["train", "--train.batch_sze=4"], "error: unknown config field 'train.batch_sze'; did you mean "
                                       "'train.batch_size'? `python pipeline/run.py --help` lists every field with "
                                       "its type, default and meaning"),
    (["train", "--train.tier=A"], "error: unknown config field 'train.tier'; did you mean 'model.tier'?"),
    (["prepare", "--data.txt_column=body"], "error: unknown config field 'data.txt_column'; did you mean "
                                            "'data.text_column'?"),
])
def test_a_mistyped_field_gets_did_you_mean_in_one_line(args, line, capsys):
    from pipeline.run import main

    assert main(args) == 2
    err = capsys.readouterr().err
    assert err.strip().startswith(line) and len(err.strip().splitlines()) == 1, err
    assert "model.mixer, " not in err  # not the list of every field


def test_a_phases_file_error_names_the_file_and_the_phase(tmp_path, capsys):
    from pipeline.run import main

    phases = tmp_path / "phases.yaml"
    phases.write_text("- steps: 4\n- steps: 4\n  overrides: {train.lr: 1e-3, train.batchsize: 2}\n")
    assert main(["train", "--preset", "test", "--no-ray", "--phases", str(phases)]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (f"error: --phases {phases}: phase 1 overrides: unknown config field 'train.batchsize'; did you "
                   f"mean 'train.batch_size'? `python pipeline/run.py --help` lists every field with its type, "
                   f"default and meaning")
    phases.write_text("- steps: 4\n  overrides: {data.hf_name: roneneldan/TinyStories}\n")
    assert main(["train", "--preset", "test", "--no-ray", "--phases", str(phases)]) == 2
    assert capsys.readouterr().err.strip() == (
        f"error: --phases {phases}: phase 0 overrides: data.hf_name is set, but data.source=builtin does not read it "
        f"(it is for data.source=hf); set data.source, or drop data.hf_name")


def test_help_lists_every_tier_with_total_and_active_parameters():
    """`python pipeline/run.py --help` ends with the tiers: a MoE tier's total and active parameters
    (model/flops.py)."""
    from model.flops import active_param_count, param_count
    from model.tiers import MIXERS, tiers_for
    from pipeline.cli.config_help import tiers_help

    text = " ".join(tiers_help().split())  # unwrapped
    for mixer in MIXERS:
        for name, tier in tiers_for(mixer).items():
            total = f"{name} {param_count(tier, 32000) / 1e6:,.1f}M"
            assert total in text, total
            if tier.moe is not None:
                assert f"{total} total, {active_param_count(tier, 32000) / 1e6:,.1f}M active" in text
