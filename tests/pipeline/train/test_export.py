"""Hugging Face export: nano trained a few steps (Ray-free), exported, and loaded with transformers'
Auto classes (no trust_remote_code) gives the project model's logits, its greedy generation and
SentencePiece's token ids; tied and untied embeddings, multi-head and grouped-query attention. Bad input
(not a checkpoint, a resonance model, an existing --out) is one line and exit code 2, with nothing written."""
from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers  # the dev extra installs it (pip install -e '.[dev]')

from model.tiers import TIERS, Tier
from pipeline.train.handoff.hf_export import ExportError, export_checkpoint
from pipeline.train.handoff.text_generation import generate_from_checkpoint
from pipeline.train.local import train_local
from tests.pipeline.train.hf_helpers import TOKENIZER_CHECK_TEXTS, assert_same_model, build_dataset, hf_greedy, load_hf


ROOT = Path(__file__).resolve().parents[3]
# No shipped tier uses grouped-query attention yet; this one (2 key/value heads for 4 query heads) is registered
# for this module only, so the GQA weight split and config are exercised.
GQA_TIER = Tier("nano_gqa_test", d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=192, max_seq_len=4096)
VARIANTS = {"nano-tied": {"model.tier": "nano"},
            "nano-untied": {"model.tier": "nano", "model.tie_embeddings": False},
            "gqa-tied": {"model.tier": GQA_TIER.name}}


@pytest.fixture(scope="module")
def gqa_tier():
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(TIERS, GQA_TIER.name, GQA_TIER)
        yield


@pytest.fixture(scope="module")
def trained(tmp_path_factory, gqa_tier):
    """variant -> (checkpoint, export dir): each trained 8 steps from the same dataset, then exported."""
    root = tmp_path_factory.mktemp("export")
    cfg, ds = build_dataset(root / "data")
    out = {}
    for name, over in VARIANTS.items():
        ckpt, stopped = train_local(cfg.replace({**over, "train.max_steps": 4}), ds, root / name, None)
        assert ckpt is not None and not stopped
        out[name] = (ckpt, export_checkpoint(ckpt, root / f"hf-{name}").out_dir)
    return out


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_transformers_loads_the_export_and_matches_the_model(trained, variant):
    ckpt, hf_dir = trained[variant]
    config = json.loads((hf_dir / "config.json").read_text())
    tier = TIERS[VARIANTS[variant]["model.tier"]]
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert (config["num_key_value_heads"], config["num_attention_heads"]) == (tier.n_kv_heads, tier.n_heads)
    assert config["tie_word_embeddings"] is VARIANTS[variant].get("model.tie_embeddings", True)
    assert (config["rope_theta"], config["rms_norm_eps"]) == (tier.rope_base, tier.norm_eps)
    assert (config["bos_token_id"], config["eos_token_id"], config["pad_token_id"]) == (2, 3, 0)
    assert not [p for p in hf_dir.parent.iterdir() if p.name.startswith(".hf-")], "a temporary directory was left"
    assert_same_model(ckpt, hf_dir)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_greedy_generation_matches_on_decisive_weights(trained, variant, tmp_path):
    """A few training steps give a model that repeats one token; random weights of std 0.5 make every step's
    argmax decisive and the sequence varied, so the KV cache and positions are really compared."""
    from safetensors.torch import load_file, save_file

    ckpt, _ = trained[variant]
    scrambled = tmp_path / "ckpt"
    shutil.copytree(ckpt, scrambled)
    gen = torch.Generator().manual_seed(7)
    state = {k: (torch.randn(v.shape, generator=gen) * 0.5 if v.dim() == 2 else v)
             for k, v in load_file(str(ckpt / "model.safetensors")).items()}
    save_file(state, str(scrambled / "model.safetensors"))
    hf_dir = export_checkpoint(scrambled, tmp_path / "hf").out_dir
    model, tok = load_hf(hf_dir)
    want = generate_from_checkpoint(scrambled, ["def "], max_new_tokens=32, temperature=0.0).token_ids[0]
    assert len(set(want)) >= 8, "the reference generation is degenerate; the check would prove little"
    assert hf_greedy(model, tok, "def ", 32) == want


def test_tokenizer_gives_sentencepiece_ids(trained):
    import sentencepiece as spm

    _, hf_dir = trained["nano-tied"]
    tok = transformers.AutoTokenizer.from_pretrained(hf_dir)
    assert type(tok).__name__ in ("TokenizersBackend", "PreTrainedTokenizerFast")  # a fast tokenizer
    sp = spm.SentencePieceProcessor(model_file=str(hf_dir / "tokenizer.model"))
    used_bytes = False
    for text in TOKENIZER_CHECK_TEXTS:
        want = sp.encode(text)
        used_bytes |= any(sp.is_byte(i) for i in want)
        assert tok(text, add_special_tokens=False)["input_ids"] == want, repr(text)
        assert tok(text)["input_ids"] == [sp.bos_id()] + want, repr(text)
        assert tok.decode(want) == sp.decode(want), repr(text)
    assert used_bytes, "no text needed byte fallback; the check would not cover it"
    # The whole corpus the tokenizer was trained on, document by document.
    from tests.pipeline.train.hf_helpers import corpus_texts

    for text in corpus_texts():
        assert tok(text, add_special_tokens=False)["input_ids"] == sp.encode(text)


def test_model_card_names_tier_tokens_data_and_loss(trained):
    ckpt, hf_dir = trained["nano-tied"]
    meta = json.loads((ckpt / "meta.json").read_text())
    manifest = json.loads((Path(meta["dataset_dir"]) / "manifest.json").read_text())
    card = (hf_dir / "README.md").read_text()
    assert "| tier | nano" in card and f"| tokens seen | {meta['counters']['tokens_seen']:,} |" in card
    assert manifest["settings_hash"] in card
    assert f"| final val loss | {meta['metrics']['val/loss']:.4f} |" in card
    assert "| longtrain commit |" in card and "| longtrain commit | unknown |" not in card
    assert json.loads((hf_dir / "generation_config.json").read_text())["eos_token_id"] == 3


def test_overwrite_replaces_atomically(trained, tmp_path):
    ckpt, _ = trained["nano-tied"]
    out = tmp_path / "hf"
    export_checkpoint(ckpt, out)
    (out / "stale.txt").write_text("from before")
    with pytest.raises(ExportError, match="already exists; pass --overwrite"):
        export_checkpoint(ckpt, out)
    assert (out / "stale.txt").exists()
    export_checkpoint(ckpt, out, overwrite=True)
    assert not (out / "stale.txt").exists() and (out / "model.safetensors").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"], "temporary directories were left behind"


def test_others_on_the_machine_can_read_an_export(trained, tmp_path):
    """An export under the usual umask 022 was a 0700 directory holding a 0600 model.safetensors: nobody else could
    load it. Now it has the modes any new directory and file get under the umask."""
    ckpt, _ = trained["nano-tied"]
    previous = os.umask(0o022)
    try:
        out = export_checkpoint(ckpt, tmp_path / "hf").out_dir
    finally:
        os.umask(previous)
    assert stat.S_IMODE(out.stat().st_mode) == 0o755
    files = [p for p in out.rglob("*") if p.is_file()]
    assert "model.safetensors" in {p.name for p in files}
    assert {p.name: oct(stat.S_IMODE(p.stat().st_mode)) for p in files} == {p.name: "0o644" for p in files}


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "pipeline" / "run.py"), *args], capture_output=True,
                          text=True, timeout=300, cwd=ROOT)


def test_cli_export_bad_input_is_one_line_and_exit_2(trained, tmp_path, capsys):
    """The first case runs `python pipeline/run.py` as a process (its exit status); the others call the same
    main() in this process, which is what the process returns."""
    from pipeline.run import main
    ckpt, _ = trained["nano-tied"]
    not_a_checkpoint = tmp_path / "empty"
    not_a_checkpoint.mkdir()
    resonance = tmp_path / "resonance"
    shutil.copytree(ckpt, resonance)
    meta = json.loads((resonance / "meta.json").read_text())
    meta["config"]["model"]["mixer"] = "resonance"
    (resonance / "meta.json").write_text(json.dumps(meta))
    existing = tmp_path / "existing"
    existing.mkdir()
    (existing / "keep.txt").write_text("mine")
    cases = [((not_a_checkpoint, tmp_path / "o1"), "is not a checkpoint"),
             ((resonance, tmp_path / "o2"), "model.mixer=resonance"),
             ((ckpt, existing), "already exists; pass --overwrite")]
    for k, ((src, out), message) in enumerate(cases):
        if k == 0:
            res = run_cli("export", "--checkpoint", str(src), "--out", str(out))
            code, err = res.returncode, res.stderr
        else:
            code, err = main(["export", "--checkpoint", str(src), "--out", str(out)]), capsys.readouterr().err
        assert code == 2, err[-2000:]
        lines = err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty", "existing", "resonance"], "something was written"
    assert [p.name for p in existing.iterdir()] == ["keep.txt"]


def test_cli_export_of_a_checkpoint(trained, tmp_path, capsys):
    """`export --checkpoint` through the CLI's main() writes a directory transformers loads."""
    from pipeline.run import main

    ckpt, _ = trained["nano-untied"]
    assert main(["export", "--checkpoint", str(ckpt), "--out", str(tmp_path / "hf")]) == 0
    assert "exported" in capsys.readouterr().out
    model, _ = load_hf(tmp_path / "hf")
    assert model.config.tie_word_embeddings is False
