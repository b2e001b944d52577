"""Hugging Face export of mixture-of-experts models (pipeline/train/handoff/hf_moe.py): nano-moe trained a few steps
and exported loads in transformers (no download, no trust_remote_code) as Mixtral (routed experts only) or
Qwen2-MoE (shared experts, dense first layers, unnormalised top-k) with logits within 1e-5 (relative, fp32) of the
project model's and the same greedy tokens; a setting no architecture holds is one line, and nothing is written.

    .venv/bin/python -m pytest tests/pipeline/train/test_moe_export.py -q
"""
from __future__ import annotations

import json
import shutil

import pytest
import torch

from pipeline.train.handoff.hf_export import ExportError, export_checkpoint
from pipeline.train.handoff.text_generation import generate_from_checkpoint, load_for_generation
from pipeline.train.local import train_local
from tests.pipeline.train.hf_helpers import TOKENIZER_CHECK_TEXTS, build_dataset, hf_greedy, load_hf

pytestmark = pytest.mark.system  # docs/tests.md: trains and exports three models (~1 min)

VARIANTS = {
    "mixtral": ({"model.tier": "nano-moe"}, "MixtralForCausalLM"),
    "qwen2-shared": ({"model.tier": "nano-moe", "model.shared_experts": 1, "model.tie_embeddings": False},
                     "Qwen2MoeForCausalLM"),
    "qwen2-dense-first": ({"model.tier": "nano-moe", "model.shared_experts": 2, "model.dense_first_layers": 1,
                           "model.moe_renormalize": False}, "Qwen2MoeForCausalLM"),
}


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """variant -> (checkpoint, export dir), each trained 3 steps on one dataset and exported."""
    root = tmp_path_factory.mktemp("moe-export")
    cfg, ds = build_dataset(root / "data")
    out = {}
    for name, (over, _) in VARIANTS.items():
        ckpt, stopped = train_local(cfg.replace({**over, "train.max_steps": 3, "train.eval_every": 3,
                                                 "train.checkpoint_every": 3}), ds, root / name, None)
        assert ckpt is not None and not stopped
        out[name] = (ckpt, export_checkpoint(ckpt, root / f"hf-{name}").out_dir)
    return out


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_transformers_loads_the_export_with_the_models_logits(trained, variant):
    ckpt, hf_dir = trained[variant]
    over, arch = VARIANTS[variant]
    config = json.loads((hf_dir / "config.json").read_text())
    assert config["architectures"] == [arch]
    model, _ = load_hf(hf_dir)
    assert type(model).__name__ == arch
    decoder, sp = load_for_generation(ckpt, torch.device("cpu"))
    ids = torch.tensor([[sp.bos_id] + sp.encode(" ".join(TOKENIZER_CHECK_TEXTS[:5]))])
    with torch.no_grad():
        ours, theirs = decoder.logits(decoder(ids)), model(ids).logits.float()
    rel = float((ours - theirs).abs().max() / ours.abs().max())
    assert rel <= 1e-5, f"logits differ: max relative error {rel:.2e}"
    card = (hf_dir / "README.md").read_text()
    assert f"`{arch}`" in card and "8 experts (2 per token)" in card


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_greedy_generation_matches_on_decisive_weights(trained, variant, tmp_path):
    """A few training steps give a model that repeats one token; random weights of std 0.5 make every step's argmax
    (and every token's routing) decisive and the sequence varied, so the KV cache and the experts are compared
    step by step (at std 0.5 the logits themselves differ by fp32 rounding grown large, as a dense model's do)."""
    from safetensors.torch import load_file, save_file

    ckpt, _ = trained[variant]
    scrambled = tmp_path / "ckpt"
    shutil.copytree(ckpt, scrambled)
    gen = torch.Generator().manual_seed(7)
    state = {k: (torch.randn(v.shape, generator=gen) * 0.5 if v.dim() >= 2 else v)
             for k, v in load_file(str(ckpt / "model.safetensors")).items()}
    save_file(state, str(scrambled / "model.safetensors"))
    model, tok = load_hf(export_checkpoint(scrambled, tmp_path / "hf").out_dir)
    want = generate_from_checkpoint(scrambled, ["def "], max_new_tokens=24, temperature=0.0).token_ids[0]
    assert len(set(want)) >= 6, "the reference generation is degenerate; the check would prove little"
    assert hf_greedy(model, tok, "def ", 24) == want


@pytest.mark.parametrize("change,reason", [
    ({"moe_balance": "bias"}, "selection bias (model.moe_balance=bias)"),
    ({"dense_first_layers": 1}, "dense first layers and no shared experts"),
    ({"moe_renormalize": False}, "top-k weights without renormalisation and no shared experts"),
])
def test_a_setting_no_architecture_holds_is_refused_in_one_line(trained, tmp_path, change, reason, capsys):
    from pipeline.run import main

    ckpt, _ = trained["mixtral"]
    changed = tmp_path / "ckpt"
    shutil.copytree(ckpt, changed)
    meta = json.loads((changed / "meta.json").read_text())
    meta["config"]["model"].update(change)
    (changed / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(ExportError, match="cannot be exported"):
        export_checkpoint(changed, tmp_path / "hf")
    assert main(["export", "--checkpoint", str(changed), "--out", str(tmp_path / "hf")]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and reason in lines[0], lines
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"], "something was written"
