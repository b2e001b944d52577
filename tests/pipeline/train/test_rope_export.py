"""RoPE base and scaling through the Hugging Face export: for each scaling (none with a custom base, linear, YaRN,
Llama 3) a checkpoint written with those settings exports to a config.json from which transformers'
LlamaForCausalLM gives this project's logits (max relative error <= 1e-4) at positions up to 5x the original
length, and the same greedy tokens through both KV caches. Weights are random with std 0.5 (decisive logits), so
a wrong rotation anywhere shows; the same weights without the scaling differ by far more than the tolerance."""
from __future__ import annotations

import json

import pytest
import torch

from model.decode_loop import generate_ids
from pipeline.train.engine import Engine
from pipeline.train.handoff.hf_export import export_checkpoint
from pipeline.train.handoff.text_generation import load_for_generation
from tests.pipeline.train.hf_helpers import build_dataset, load_hf

ORIGINAL = 64  # the "trained" context the scalings extend from
POSITIONS = 320  # positions compared: 5x ORIGINAL
SCALINGS = {
    "none-theta": {"model.rope_theta": 20_000.0},
    "linear": {"model.rope_theta": 10_000.0, "model.rope_scaling": "linear", "model.rope_factor": 4.0},
    # theta 10,000 and head_dim 16: YaRN's ramp spans dimensions 0..3 (kept, two blended, interpolated), and
    # Llama 3's wavelengths fall in all three bands (kept, smoothly blended, divided by the factor)
    "yarn": {"model.rope_theta": 10_000.0, "model.rope_scaling": "yarn", "model.rope_factor": 4.0,
             "model.rope_original_max_len": ORIGINAL},
    "llama3": {"model.rope_theta": 10_000.0, "model.rope_scaling": "llama3", "model.rope_factor": 8.0,
               "model.rope_original_max_len": ORIGINAL, "model.rope_low_freq_factor": 1.0,
               "model.rope_high_freq_factor": 4.0},
}


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """scaling -> (checkpoint, export dir): one set of decisive weights saved under each RoPE setting."""
    root = tmp_path_factory.mktemp("rope_export")
    cfg, ds = build_dataset(root / "data")
    gen = torch.Generator().manual_seed(11)
    out = {}
    weights = None
    for name, over in SCALINGS.items():
        engine = Engine(cfg.replace(over), 400, torch.device("cpu"))
        decoder = engine.module.decoder
        if weights is None:
            weights = {k: (torch.randn(v.shape, generator=gen) * 0.5 if v.dim() == 2 else v.clone())
                       for k, v in decoder.state_dict().items()}
        decoder.load_state_dict(weights)
        ckpt = engine.save(root / name / "step_000000", extra={"dataset_dir": str(ds)})
        out[name] = (ckpt, export_checkpoint(ckpt, root / f"hf-{name}").out_dir)
    return out


def _ids(vocab: int, n: int) -> torch.Tensor:
    return torch.randint(4, vocab, (1, n), generator=torch.Generator().manual_seed(3))


@pytest.mark.parametrize("scaling", list(SCALINGS))
def test_transformers_gives_the_same_logits_past_the_original_length(exported, scaling):
    ckpt, hf_dir = exported[scaling]
    over = SCALINGS[scaling]
    config = json.loads((hf_dir / "config.json").read_text())
    params = config["rope_parameters"]
    assert config["rope_theta"] == params["rope_theta"] == over["model.rope_theta"]
    kind = over.get("model.rope_scaling", "none")
    assert params["rope_type"] == {"none": "default"}.get(kind, kind)
    if kind == "none":
        assert config["rope_scaling"] is None
    else:
        assert config["rope_scaling"] == {k: v for k, v in params.items() if k != "rope_theta"}
        assert params["factor"] == over["model.rope_factor"]
    if kind == "yarn":
        assert params["original_max_position_embeddings"] == ORIGINAL
        assert config["max_position_embeddings"] == ORIGINAL * 4  # transformers reads factor = max / original too

    model, _ = load_hf(hf_dir)
    assert model.config.rope_parameters["rope_type"] == params["rope_type"]
    decoder, _ = load_for_generation(ckpt, torch.device("cpu"))
    ids = _ids(config["vocab_size"], POSITIONS)
    with torch.no_grad():
        ours = decoder.logits(decoder(ids))  # (1, T, V)
        theirs = model(ids).logits.float()
    rel = float((ours - theirs).abs().max() / ours.abs().max())
    assert rel <= 1e-4, f"{scaling}: logits differ, max relative error {rel:.2e}"
    late = slice(ORIGINAL, None)  # and past the original length on its own, where the scalings act
    rel_late = float((ours[:, late] - theirs[:, late]).abs().max() / ours[:, late].abs().max())
    assert rel_late <= 1e-4

    # The check can fail: the same weights with the tier's plain base give clearly other logits.
    plain, _ = load_for_generation(exported["none-theta"][0], torch.device("cpu")) if scaling != "none-theta" \
        else (None, None)
    if plain is not None:
        with torch.no_grad():
            other = plain.logits(plain(ids))
        assert float((other - ours).abs().max() / ours.abs().max()) > 1e-2


@pytest.mark.parametrize("scaling", ["yarn", "llama3"])
def test_greedy_tokens_through_both_kv_caches_agree_past_the_original_length(exported, scaling):
    """The KV cache's tables (prefill, then the fixed-shape decode step) against transformers' cache: a prompt
    just short of the original length, then 32 new tokens, past it."""
    ckpt, hf_dir = exported[scaling]
    model, _ = load_hf(hf_dir)
    decoder, _ = load_for_generation(ckpt, torch.device("cpu"))
    prompt = _ids(model.config.vocab_size, ORIGINAL - 4)
    want = generate_ids(decoder, [prompt[0].tolist()], max_new_tokens=32, temperature=0.0)[0].tolist()
    assert len(set(want)) >= 8, "the reference generation is degenerate; the check would prove little"
    with torch.no_grad():
        got = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=32, do_sample=False,
                             eos_token_id=None, pad_token_id=0)[0, prompt.shape[1]:].tolist()
    assert got == want


def test_model_card_names_the_rope_settings(exported):
    _, hf_dir = exported["yarn"]
    assert "| RoPE | theta 10,000, yarn x4 from 64 |" in (hf_dir / "README.md").read_text()
