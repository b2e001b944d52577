"""Mixtures as data: data.mixture's parsing and one-line errors, the block schedule, and a real three-source mixture
(built-in corpus, a local JSONL file, a JSONL file in the session's S3 bucket) whose mixed stream holds every block
of 1,024 rows at 0.5 / 0.3 / 0.2 exactly to one row, validates, and refuses sources that cannot share a stream.

    .venv/bin/python -m pytest -q tests/pipeline/data/test_mixture.py
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from pipeline.config import ConfigError, load_config
from pipeline.data.mixture import (MixtureError, MixtureReader, block_counts, check_plan, describe_plan,
                                   fitted_block_rows, mixture_of)
from pipeline.mixture_spec import parse_mixture

FILES = {"name": "web", "weight": 0.7, "source": "files", "path": "corpus/*.jsonl"}
CODE = {"name": "code", "weight": 0.3, "source": "hf", "hf_name": "bigcode/the-stack-smol", "text_column": "content"}


def cfg_with(mixture, **over):
    return load_config("test", {"data.mixture": mixture if isinstance(mixture, str) else json.dumps(mixture), **over})


# ------------------------------------------------------------------------------------------ the config
def test_a_mixture_is_read_inline_or_from_a_yaml_file_and_travels_inline(tmp_path):
    path = tmp_path / "web_code.yaml"
    path.write_text("- {name: web, weight: 0.7, source: files, path: 'corpus/*.jsonl'}\n"
                    "- name: code\n  weight: 0.3\n  source: hf\n  hf_name: bigcode/the-stack-smol\n"
                    "  text_column: content\n  max_repetitions: 2\n")
    from_file = parse_mixture(str(path))
    assert [(s.name, s.weight, s.max_repetitions) for s in from_file] == [("web", 0.7, 4.0), ("code", 0.3, 2.0)]
    assert from_file[1].overrides() == {"data.source": "hf", "data.hf_name": "bigcode/the-stack-smol",
                                        "data.text_column": "content"}
    assert parse_mixture(json.dumps([FILES, CODE]))[0] == from_file[0]
    from pipeline.data.mixture import inline_mixture

    cfg = inline_mixture(load_config("test", [f"--data.mixture={path}"]))
    assert json.loads(cfg.data.mixture)[1]["max_repetitions"] == 2  # the run records and ships the list itself
    # a YAML list in a preset or a phase's overrides is taken as it is
    listed = load_config("test", {"data.mixture": [FILES, CODE]}).data.mixture
    assert parse_mixture(listed) == parse_mixture(cfg_with([FILES, CODE]).data.mixture)


@pytest.mark.parametrize("mixture, message", [
    ([{**FILES, "wieght": 1}], "data.mixture source 'web': unknown field 'wieght'; a source may set: name, weight,"),
    ([{**FILES, "weight": -0.1}], "data.mixture source 'web': weight=-0.1 is invalid; it must be >= 0"),
    ([{**FILES, "weight": 0}, {**CODE, "weight": 0}], "every weight is 0; give at least one source a weight > 0"),
    ([FILES, {**CODE, "name": "web"}], "source name 'web' is used twice"),
    ([{**FILES, "seq_len": 512}], "data.mixture source 'web': seq_len cannot differ between sources (they share one "
                                  "tokenizer, row length and split); set data.seq_len for the whole mixture"),
    ([{**FILES, "tokenizer": "t.model"}], "tokenizer cannot differ between sources"),
    ([{"name": "web", "weight": 1, "source": "files"}], "data.mixture source 'web': source=files needs a path"),
    ([{"name": "x/y", "weight": 1}], "source 0 name='x/y' is invalid"),
    ([{**FILES, "max_repetitions": 0}], "max_repetitions=0 is invalid; it must be > 0"),
    ([{**FILES, "source": "s3"}], "source='s3' is not allowed; choose one of: builtin, files, hf"),
    ("mixes/nope.yaml", "data.mixture='mixes/nope.yaml': no such file"),
    ("[{name: web", "data.mixture is not valid YAML/JSON"),
])
def test_a_bad_mixture_is_one_line_naming_the_source_and_field(mixture, message):
    with pytest.raises(ConfigError) as err:
        cfg_with(mixture)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_the_flat_config_is_still_one_dataset_of_the_same_hash():
    """The new fields do not enter a dataset's cache key: every dataset prepared before is found again."""
    from pipeline.data.pack import dataset_settings

    base = load_config("test")
    assert base.data.mixture == "" and base.data.mixture_block_rows == 1024
    assert set(dataset_settings(base)) == {"schema_version", "pack_version", "source", "tokenizer", "seq_len",
                                           "val_fraction", "rows_per_shard", "split_seed"}
    assert dataset_settings(base) == dataset_settings(base.replace({"data.mixture_block_rows": 7}))


# ------------------------------------------------------------------------------------------ the schedule
@pytest.mark.parametrize("seed", range(20))
def test_block_counts_sum_to_the_block_and_round_each_weight_to_one_row(seed):
    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 7))
    w = rng.dirichlet(np.ones(n)) if seed % 3 else np.r_[rng.dirichlet(np.ones(n)), 0.0]  # and an eval-only source
    k = int(rng.integers(1, 5000))
    counts = block_counts(list(w), k)
    assert counts.sum() == k and np.all(np.abs(counts - w * k) < 1)
    assert counts[w == 0].sum() == 0
    assert list(block_counts([0.5, 0.3, 0.2], 1024)) == [512, 307, 205]


# ------------------------------------------------------------------------------------------ the real mixture
def test_a_run_shorter_than_a_block_gets_a_block_of_its_own_length():
    """0.2 / 0.2 / 0.6 over 32 rows: the first 32 rows of a 1,024-row block may hold 4 / 9 / 19 of them; a 32-row
    block holds round(w x 32) of each, by largest remainder: 7 / 6 / 19."""
    assert fitted_block_rows(1024, 32) == 32 and fitted_block_rows(1024, 5000) == 1024
    assert fitted_block_rows(1024, 0) == 1024  # no run length known: the configured block
    assert block_counts([0.2, 0.2, 0.6], fitted_block_rows(1024, 32)).tolist() == [7, 6, 19]


def test_three_sources_keep_their_token_share_in_every_block(mixture_setup):
    """builtin / local JSONL / JSONL in S3 at 0.5 / 0.3 / 0.2: every block of 1,024 rows of the stream the training
    workers read holds 512 / 307 / 205 rows of them (exact to one row of w x 1,024), and ten blocks and a part
    hold each source's share to within 0.5 %. Rows are fixed-length windows, so these are token shares. Each
    source walks its own passes: every one of its rows once per pass."""
    cfg = mixture_setup.config()
    mix = mixture_of(mixture_setup.dataset, cfg)
    assert [(s.name, s.weight) for s in mix.sources] == [("std", 0.5), ("topics", 0.3), ("notes", 0.2)]
    assert mix.sources[2].dataset_dir.startswith("/") and mix.sources[2].manifest.source["path"].startswith("s3://")
    reader = MixtureReader(mix, batch_size=256)
    rows = 10 * 1024 + 300
    batches = [next(iter(reader)) for _ in range(rows // 256 + 1)]
    source = np.concatenate([b["source"].numpy() for b in batches])[:rows]
    seq_id = np.concatenate([b["seq_id"].numpy() for b in batches])[:rows]
    passes = np.concatenate([b["pass"].numpy() for b in batches])[:rows]
    tokens = np.concatenate([b["tokens"].numpy() for b in batches])[:rows]
    for b in range(10):
        counts = np.bincount(source[b * 1024:(b + 1) * 1024], minlength=3)
        assert np.all(np.abs(counts - np.array([0.5, 0.3, 0.2]) * 1024) <= 1), (b, counts)
    share = np.bincount(source, minlength=3) * cfg.data.seq_len / (rows * cfg.data.seq_len)
    assert np.all(np.abs(share - [0.5, 0.3, 0.2]) < 0.005), share
    for s in mix.sources:  # a full pass: every training row once; the next pass starts again
        got = seq_id[(source == s.index) & (passes == 0)]
        if np.any((source == s.index) & (passes == 1)):
            assert len(got) == len(set(got.tolist())) == s.train_rows
        assert len(set(got.tolist())) == len(got)
    # the rows are the sources' own: a row of `notes` is the row of that seq_id in its dataset (in the bucket)
    from pipeline.data.shards import ShardReader

    notes = np.flatnonzero(source == 2)[:5]
    own = ShardReader(mix.sources[2].dataset_dir, "train", 1, drop_last=False)
    where = {int(i): r for r, i in enumerate(own.read_rows(np.arange(own.num_rows))["seq_id"])}
    assert np.array_equal(own.read_rows(np.array([where[int(i)] for i in seq_id[notes]]))["tokens"], tokens[notes])


def test_an_over_demanded_source_is_refused_in_one_line_with_the_fix(mixture_setup):
    cfg = mixture_setup.config()
    mix = mixture_of(mixture_setup.dataset, cfg)
    topics = mix.sources[1].train_rows
    steps = int(topics * 4 / 0.3 / 8) + 10  # 8 rows a step: topics (0.3) would need more than 4 passes
    plan = mix.plan(steps * 8)
    with pytest.raises(MixtureError) as err:
        check_plan(plan, steps, 8, mix.seq_len)
    msg = str(err.value)
    assert msg.startswith(f"data.mixture source 'topics' (weight 0.3) must supply {plan[1].rows_needed * 64:,} tokens "
                          f"({plan[1].rows_needed:,} rows of 64) to {steps:,} steps of 8 rows, and has "
                          f"{topics * 64:,} tokens ({topics:,} rows) x max_repetitions 4 = ")
    assert msg.endswith("; lower its weight, raise its max_repetitions (to "
                        f"{np.ceil(plan[1].repetitions * 100) / 100:g} or more), or add data") and "\n" not in msg
    check_plan(mix.plan(100 * 8), 100, 8, mix.seq_len)  # a short run passes
    lines = describe_plan(mix.plan(100 * 8), mix.block_rows)
    assert lines[0].startswith("mixture: std          weight  50.0% (trains on  ") and \
        "%), 512 of every 1,024 rows; " in lines[0]
    assert "passes (max_repetitions 4)" in lines[0]


def test_a_mixture_validates_and_sources_that_cannot_share_a_stream_are_refused(mixture_setup, tmp_path, capsys):
    from pipeline.data.mixture_prepare import prepare_mixture
    from pipeline.data.shards import load_manifest
    from pipeline.data.synthetic import write_synthetic_dataset
    from pipeline.run import main

    rc = main(["validate", mixture_setup.dataset])
    out, err = capsys.readouterr()
    assert rc == 0, out + err
    assert out.startswith(f"mixture {mixture_setup.dataset}: 3 sources"), out + err
    assert out.count("  OK\n") == 3 and out.rstrip().endswith("OK (every source valid, one tokenizer, one seq_len)"), \
        out + err

    manifest = load_manifest(mixture_setup.dataset)
    std = next(s["dataset_dir"] for s in manifest.source["sources"] if s["name"] == "std")
    write_synthetic_dataset(tmp_path / "synthetic", n_train=64, n_val=8, seq_len=32, vocab_size=512)
    mixture = [{"name": "std", "weight": 0.5, "dataset_dir": std},
               {"name": "synthetic", "weight": 0.5, "dataset_dir": str(tmp_path / "synthetic")}]
    cfg = load_config("test", {"data.mixture": json.dumps(mixture), "run.root": str(tmp_path / "runs")})
    with pytest.raises(MixtureError, match=r"^data.mixture source 'synthetic' \(.*\) has seq_len 32 and tokenizer "
                                           r"synthetic, source 'std' 64 and \w+: the sources of a mixture share one "
                                           r"tokenizer and one row length; prepare them with the same "
                                           r"data.tokenizer and data.seq_len$"):
        prepare_mixture(cfg)
    rc = main(["train", "--no-ray", "--preset", "test", f"--run.root={tmp_path / 'runs'}",
               f"--data.mixture={json.dumps(mixture)}", "--tracking.enabled=false"])
    out, err = capsys.readouterr()
    assert rc == 2, out + err
    err = err.strip()
    assert err.startswith("error: data.mixture source 'synthetic'") and "\n" not in err, out + err


def test_new_weights_or_a_new_source_tokenize_nothing_already_prepared(mixture_setup):
    """With the mixture's tokenizer kept (what `prepare` prints, and what phases and sweeps do), other weights find
    the same mixture and every source in the cache, and a fourth source (here a dataset prepared before, given by
    dataset_dir) makes a new mixture naming the same three datasets: no Ray work, no new build."""
    from pipeline.data.mixture_prepare import prepare_mixture
    from pipeline.data.shards import load_manifest

    before = {s["name"]: s for s in load_manifest(mixture_setup.dataset).source["sources"]}
    reweighted = [{**s, "weight": w} for s, w in zip(mixture_setup.mixture, (0.2, 0.2, 0.6))]
    cfg = mixture_setup.config(**{"data.mixture": json.dumps(reweighted), "data.tokenizer": mixture_setup.tokenizer})
    assert str(prepare_mixture(cfg)) == mixture_setup.dataset
    extra = {"name": "again", "weight": 0.1, "dataset_dir": before["topics"]["dataset_dir"]}
    cfg = mixture_setup.config(**{"data.mixture": json.dumps(reweighted + [extra]),
                                  "data.tokenizer": mixture_setup.tokenizer})
    grown = load_manifest(prepare_mixture(cfg))
    after = {s["name"]: s for s in grown.source["sources"]}
    assert set(after) == {"std", "topics", "notes", "again"}
    assert all(after[n]["dataset_dir"] == before[n]["dataset_dir"] and after[n]["settings_hash"] ==
               before[n]["settings_hash"] for n in before)
    builds = {n: [p.name for p in Path(before[n]["dataset_dir"]).glob("build-*") if p.is_dir()] for n in before}
    assert all(len(b) == 1 for b in builds.values()), builds  # each source was built once, by the session's prepare


@pytest.mark.system  # docs/tests.md: over ~5 s (5.8 s in the quick tier on 2 idle cores)
def test_a_source_whose_path_does_not_exist_is_named_with_its_own_field(tmp_path):
    """`prepare` as a user types it: the line names the source and the field it set (`path`), not data.path, which
    the user did not set; nothing is written to the dataset store."""
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[3]
    nope = tmp_path / "nope.jsonl"
    mixture = [{"name": "std", "weight": 0.5, "source": "builtin"},
               {"name": "web", "weight": 0.5, "source": "files", "path": str(nope)}]
    res = subprocess.run([sys.executable, str(root / "pipeline" / "run.py"), "prepare", "--preset", "test",
                          f"--run.root={tmp_path / 'runs'}", f"--data.mixture={json.dumps(mixture)}"],
                         capture_output=True, text=True, timeout=300, cwd=root)
    assert res.returncode == 2, res.stdout + res.stderr
    assert res.stderr.strip().splitlines()[-1] == (f"error: data.mixture source 'web': path={str(nope)!r} does not "
                                                   "exist; give a file, a directory or a glob")
    assert "Traceback" not in res.stdout + res.stderr
    assert not (tmp_path / "runs" / "datasets").exists() or not any((tmp_path / "runs" / "datasets").rglob("*"))


# ------------------------------------------------------------------------------------------ racing prepares
def _prepare_cli(*args: str) -> "subprocess.Popen":
    import os
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[3]
    return subprocess.Popen([sys.executable, str(root / "pipeline" / "run.py"), "prepare", *args], cwd=root,
                            env={**os.environ, "PYTHONPATH": str(root)}, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


@pytest.mark.system
def test_two_mixture_prepares_racing_on_one_store_both_succeed_without_a_worker_traceback(ray_address, tmp_path):
    """Two `python pipeline/run.py prepare` of mixtures at once on one store, each preparing its sources side by side
    (2 tokenizer actors: 1 per source): one source is the same dataset in both (the same content raced), the others
    differ. Ray Data may construct a tokenize actor of a source after that source's build has ended and removed its
    parts (a pool's pending actor is released, not killed): that actor must not touch the build (it printed a
    FileNotFoundError traceback of `_parts/part-*.bin` while the prepare succeeded). Both succeed, neither console
    shows a traceback or an error, and the tokenizer each summary hints at is a file."""
    import re

    from tests.pipeline.data.helpers import make_tokenizer, sample_docs, write_jsonl

    docs = sample_docs(80, 3000)
    (tmp_path / "own").mkdir()
    shared = write_jsonl(tmp_path / "shared.jsonl", docs[:30])
    own = [write_jsonl(tmp_path / "own" / f"{name}.jsonl", part)
           for name, part in (("a", docs[30:55]), ("b", docs[55:80]))]
    tokenizer = make_tokenizer(tmp_path)
    procs = []
    for path in own:
        mixture = [{"name": "std", "weight": 0.4, "source": "builtin", "max_documents": 60},
                   {"name": "shared", "weight": 0.3, "source": "files", "path": str(shared)},
                   {"name": "own", "weight": 0.3, "source": "files", "path": str(path)}]
        procs.append(_prepare_cli("--preset", "test", f"--run.root={tmp_path / 'runs'}", "--address", ray_address,
                                  f"--data.mixture={json.dumps(mixture)}", f"--data.tokenizer={tokenizer}",
                                  "--data.max_documents=0", "--data.rows_per_shard=128", "--data.tokenize_actors=2"))
    outputs = []
    try:
        for proc in procs:
            out, err = proc.communicate(timeout=600)
            outputs.append((proc.returncode, out, err))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
    for rc, out, err in outputs:
        assert rc == 0, out + err
        assert not re.search(r"Traceback|\w+Error\b", out + err), out + err
        (hint,) = re.findall(r"--data\.tokenizer=(\S+)", out)
        assert Path(hint).is_file(), out
    assert not list((tmp_path / "runs").glob("datasets/*/build-*/_parts"))  # every build's parts removed


@pytest.mark.system  # docs/tests.md: over ~5 s (6.0 s in the quick tier on 2 idle cores)
def test_a_mixture_of_synthetic_datasets_hints_at_no_tokenizer_file(tmp_path):
    """Synthetic datasets are token ids without a tokenizer file: the summary says so instead of hinting at a
    --data.tokenizer that is a directory."""
    from pipeline.data.synthetic import write_synthetic_dataset

    for name in ("one", "two"):
        write_synthetic_dataset(tmp_path / name, n_train=64, n_val=8, seq_len=64, vocab_size=512)
    mixture = [{"name": n, "weight": 0.5, "dataset_dir": str(tmp_path / n)} for n in ("one", "two")]
    proc = _prepare_cli("--preset", "test", f"--run.root={tmp_path / 'runs'}", f"--data.mixture={json.dumps(mixture)}")
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, out + err
    assert "  no tokenizer file (synthetic sources, vocab 512)\n" in out and "--data.tokenizer=" not in out, out + err
