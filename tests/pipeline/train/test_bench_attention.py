"""bench/train_speed.py's table carries the attention backend, the document-length distribution and both MFU
conventions; bench/engine_throughput.py records them per row (tiny CPU runs)."""
from __future__ import annotations

import json

import pytest

from bench import engine_throughput, train_speed


@pytest.mark.system
def test_train_speed_table_has_backend_distribution_and_both_mfu_columns(tmp_path, capsys):
    assert train_speed.main(["--smoke", "--out", str(tmp_path), "--attention", "varlen", "sdpa",
                             "--doc-lens", "16", "lognormal:8:0.5"]) == 0
    res = json.loads(next(tmp_path.glob("train_speed-*.json")).read_text())
    rows = res["rows"]
    assert [(r["doc_len"], r["attention"], r["batch_size"]) for r in rows] == [
        (d, a, b) for d in ("16", "lognormal:8:0.5") for a in ("varlen", "sdpa") for b in (1, 2)]
    assert all(r["status"] == "ok" for r in rows)
    for r in rows:
        if r["attention"] == "sdpa":  # the plain-causal baseline: no document masking, the whole causal row
            assert r["doc_masking"] is False and r["attn_pairs_frac"] == pytest.approx(1 + 1 / 64)
        else:  # short documents: a small share of the causal pairs is computed
            assert r["doc_masking"] is True and 0 < r["attn_pairs_frac"] < 0.6
            assert r["executed_flops_per_token"] < r["flops_per_token"]
    header = res["markdown"].splitlines()[0]
    for column in ("doc_len", "attention", "doc_masking", "mfu", "mfu_causal_eq", "attn_pairs"):
        assert f"| {column} |" in header
    assert set(res["doc_lengths"]) == {"16", "lognormal:8:0.5"}
    assert "log-normal, median 8" in next(tmp_path.glob("train_speed-*.md")).read_text()


def test_train_speed_refuses_a_bad_distribution_before_running(tmp_path):
    with pytest.raises(ValueError, match="is not a document-length distribution"):
        train_speed.main(["--smoke", "--out", str(tmp_path), "--doc-lens", "web", "wide"])
    assert not list(tmp_path.glob("*.json"))


def test_engine_throughput_row_names_backend_and_distribution(tmp_path):
    assert engine_throughput.main(["--smoke", "--out", str(tmp_path), "--attention", "varlen", "--doc-len", "12"]) == 0
    row = json.loads(next(tmp_path.glob("engine_throughput-*.json")).read_text())["rows"][0]
    assert row["attention"] == "varlen" and row["doc_len"] == "12" and "geometric, mean 12" in row["doc_len_distribution"]
    assert 0 < row["attn_pairs_frac"] < 1 and row["mfu"] != row["mfu"]  # no peak for a CPU: MFU is NaN


def test_count_only_table_matches_the_flop_functions(tmp_path):
    from model.flops import flops_per_token
    from model.tiers import get_tier

    assert train_speed.main(["--count-only", "--tiers", "A", "--seq-lens", "256", "--doc-lens", "64", "100000",
                             "--out", str(tmp_path)]) == 0
    rows = json.loads(next(tmp_path.glob("flop_counts-*.json")).read_text())["rows"]
    short, whole = rows  # documents of ~64 tokens; documents far longer than the row (one per row)
    for r in rows:
        assert r["causal_equiv_gflop_per_token"] == pytest.approx(flops_per_token(get_tier("A"), 256, 32000) / 1e9)
    assert short["attn_pairs_frac"] < 0.5 < whole["attn_pairs_frac"]
    assert short["executed_over_causal_equiv"] < whole["executed_over_causal_equiv"] <= 1 + 1 / 256
