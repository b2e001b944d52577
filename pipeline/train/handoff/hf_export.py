"""Export a checkpoint to a Hugging Face directory that transformers loads unchanged: Llama, or for a mixture of
experts Mixtral or Qwen2-MoE (pipeline/train/handoff/hf_moe.py says which and why).

    python pipeline/run.py export --resume runs/<run> --out hf/nano-run
    python pipeline/run.py export --checkpoint runs/<run>/checkpoints/phase0/step_000200 --out hf/x --overwrite
    python pipeline/run.py export --resume runs/<run> --out hf/x --register my-model    # + MLflow Model Registry

    from pipeline.train.handoff.hf_export import export_checkpoint
    result = export_checkpoint("runs/<run>/checkpoints/phase0/step_000200", "hf/x")   # full or sharded (FSDP)
    # then, anywhere with transformers:  AutoModelForCausalLM.from_pretrained("hf/x"), AutoTokenizer...

What the directory holds: config.json (LlamaForCausalLM; MixtralForCausalLM or Qwen2MoeForCausalLM for a MoE
tier), model.safetensors, generation_config.json,
tokenizer.json + tokenizer_config.json (a fast tokenizer converted from the run's SentencePiece model), the
SentencePiece model itself as tokenizer.model, and README.md (a model card: tier, tokens seen, data manifest
hash, final val loss, commit).

Why this is only a mapping: the attention decoder (model/decoder.py) is Llama's architecture with Llama's
conventions. RoPE is the rotate-half form on (first half, second half) of each head with inverse frequencies
base^(-2i/head_dim), exactly transformers' `rotate_half` layout, so no q/k permutation is needed (Meta's
original checkpoints need one because they rotate interleaved pairs). RMSNorm normalises in fp32 and then
multiplies by the weight; SwiGLU is down(silu(gate) * up); no biases; attention scale 1/sqrt(head_dim).
Our fused weights split by rows: wqkv = [q (H*hd) | k (Hkv*hd) | v (Hkv*hd)], w_gate_up = [gate | up].

The tokenizer: SentencePiece BPE with byte fallback, identity normalisation, add_dummy_prefix and no
whitespace folding (pipeline/data/tokenizer.py). The fast tokenizer mirrors it step by step: normaliser
"prepend ▁, then every space -> ▁" (no pre-tokeniser: SentencePiece never splits the text before merging),
BPE over the same vocabulary with merges ranked by the merged piece's score (SentencePiece merges the pair
whose result scores highest), byte fallback to the <0xXX> pieces, and the four special pieces as special
tokens that are never matched inside text (`split_special_tokens`), because SentencePiece encodes the text
"<s>" as characters too. BOS is added in front, as `run.py generate` does.

Ray-free and MLflow-free: needs torch, safetensors, sentencepiece and `tokenizers` (the `hf` extra).
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from pipeline.tracking.names import VAL_LOSS

# SentencePiece ModelProto.SentencePiece.Type values
_SP_NORMAL, _SP_UNKNOWN, _SP_CONTROL, _SP_USER_DEFINED, _SP_UNUSED, _SP_BYTE = 1, 2, 3, 4, 5, 6
HF_ARTIFACT_DIR = "hf_model"  # where a registered export lives in the training run's artifacts


class ExportError(ValueError):
    """A checkpoint cannot be exported (not a checkpoint, no Hugging Face equivalent, output exists)."""


@dataclass
class ExportResult:
    out_dir: Path
    tier: str
    step: int
    tokens_seen: int
    val_loss: float | None
    manifest_hash: str | None
    commit: str | None
    architecture: str = "LlamaForCausalLM"  # the transformers class written


# ----------------------------------------------------------------------------------------------
# Checks


def checkpoint_mixer(meta: dict[str, Any]) -> str:
    """The model family a checkpoint holds ('attention' for checkpoints from before model.mixer existed)."""
    return str(meta.get("mixer") or meta.get("config", {}).get("model", {}).get("mixer") or "attention")


def check_exportable(meta: dict[str, Any], what: str) -> None:
    """ExportError unless `what` (a checkpoint's meta, or {"config": cfg.to_dict()}) is an attention model that a
    transformers architecture represents exactly (Llama; a mixture of experts: hf_moe.py)."""
    mixer = checkpoint_mixer(meta)
    if mixer != "attention":
        raise ExportError(f"{what} is a model.mixer={mixer} model; only attention models have a Hugging Face "
                          f"equivalent (LlamaForCausalLM), so it cannot be exported or registered")
    hf_architecture(_meta_tier(meta), what)


def _meta_tier(meta: dict[str, Any]):
    """The tier a checkpoint's meta (or {"config": ...}) trained, its mixture-of-experts settings applied."""
    from pipeline.config import from_dict, model_tier

    return model_tier(from_dict(meta["config"]))


def hf_architecture(tier, what: str = "the model") -> str:
    """The transformers class the export writes for `tier`; ExportError with the reason when none is exact."""
    if tier.moe is None:
        return "LlamaForCausalLM"
    from pipeline.train.handoff.hf_moe import UnrepresentableMoE, moe_architecture

    try:
        return moe_architecture(tier)
    except UnrepresentableMoE as exc:
        raise ExportError(f"{what} cannot be exported: {exc}") from None


def require_tokenizers() -> None:
    """ExportError naming the install command when the `tokenizers` library (the `hf` extra) is missing."""
    try:
        import tokenizers  # noqa: F401
    except ImportError:
        raise ExportError("exporting to Hugging Face format needs the `hf` extra; install it with "
                          "pip install -e '.[hf]'") from None


# ----------------------------------------------------------------------------------------------
# Weights and config


def hf_state_dict(state: dict[str, torch.Tensor], tier, tie_embeddings: bool) -> dict[str, torch.Tensor]:
    """Our Decoder's state dict -> LlamaForCausalLM's, or a MoE tier's architecture's (hf_moe.py) (contiguous
    copies; lm_head omitted when tied)."""
    from pipeline.train.handoff.hf_moe import expected_block_keys, moe_block_weights

    H, Hkv, hd, n_layers = tier.n_heads, tier.n_kv_heads, tier.head_dim, tier.n_layers
    arch = hf_architecture(tier)
    expected = {"tok_emb.weight", "norm.weight"} | ({"lm_head.weight"} if not tie_embeddings else set())
    for i in range(n_layers):
        expected |= {f"blocks.{i}.{n}.weight" for n in ("attn_norm", "attn.wqkv", "attn.wo", "mlp_norm")}
        expected |= (expected_block_keys(tier, i) if tier.moe is not None
                     else {f"blocks.{i}.mlp.w_gate_up.weight", f"blocks.{i}.mlp.w_down.weight"})
    missing, unexpected = sorted(expected - set(state)), sorted(set(state) - expected)
    if missing or unexpected:
        raise ExportError(f"the checkpoint's weights do not match tier {tier.name}: missing {missing[:3]}, "
                          f"unexpected {unexpected[:3]}; was it written by another model version?")
    out = {"model.embed_tokens.weight": state["tok_emb.weight"], "model.norm.weight": state["norm.weight"]}
    if not tie_embeddings:
        out["lm_head.weight"] = state["lm_head.weight"]
    for i in range(n_layers):
        src, dst = f"blocks.{i}.", f"model.layers.{i}."
        q, k, v = state[src + "attn.wqkv.weight"].split([H * hd, Hkv * hd, Hkv * hd], dim=0)  # rows: q | k | v
        out.update({
            dst + "input_layernorm.weight": state[src + "attn_norm.weight"],
            dst + "self_attn.q_proj.weight": q, dst + "self_attn.k_proj.weight": k,
            dst + "self_attn.v_proj.weight": v, dst + "self_attn.o_proj.weight": state[src + "attn.wo.weight"],
            dst + "post_attention_layernorm.weight": state[src + "mlp_norm.weight"],
        })
        if tier.moe is not None:
            out.update(moe_block_weights(state, tier, arch, i))
            continue
        gate, up = state[src + "mlp.w_gate_up.weight"].chunk(2, dim=0)  # rows: gate | up
        out.update({dst + "mlp.gate_proj.weight": gate, dst + "mlp.up_proj.weight": up,
                    dst + "mlp.down_proj.weight": state[src + "mlp.w_down.weight"]})
    return {k: t.detach().contiguous().clone() for k, t in out.items()}


def hf_rope(rope, tier) -> dict[str, Any]:
    """config.json's RoPE keys for model/rope.py's RopeConfig: rope_theta at the top level and rope_scaling
    (transformers 4.x: the scaling's parameters, None without one) and rope_parameters (5.x: the same with
    rope_theta; 5.x takes a non-null rope_scaling first, so the two always agree), and max_position_embeddings.
    The keys and formulas are those of transformers' modeling_rope_utils.py: linear {factor}; yarn {factor,
    original_max_position_embeddings, beta_fast, beta_slow} (its attention factor, 0.1 ln(factor) + 1, is derived
    from factor there as here, so it is not written); llama3 {factor, original_max_position_embeddings,
    low_freq_factor, high_freq_factor}. For yarn max_position_embeddings is the scaled context (factor x original)
    when that is a whole number, as transformers checks; otherwise the tier's longest context."""
    if rope is None:
        from model.rope import RopeConfig

        rope = RopeConfig(theta=tier.rope_base)
    scaling: dict[str, Any] | None = None
    max_len = tier.max_seq_len
    if rope.scaling == "linear":
        scaling = {"rope_type": "linear", "factor": rope.factor}
    elif rope.scaling == "yarn":
        scaling = {"rope_type": "yarn", "factor": rope.factor,
                   "original_max_position_embeddings": rope.original_max_len, "beta_fast": rope.beta_fast,
                   "beta_slow": rope.beta_slow}
        scaled = rope.factor * rope.original_max_len
        max_len = int(scaled) if float(scaled).is_integer() else max_len
    elif rope.scaling == "llama3":
        scaling = {"rope_type": "llama3", "factor": rope.factor,
                   "original_max_position_embeddings": rope.original_max_len,
                   "low_freq_factor": rope.low_freq_factor, "high_freq_factor": rope.high_freq_factor}
    parameters = {**(scaling or {"rope_type": "default"}), "rope_theta": rope.theta}
    return {"max_position_embeddings": max_len, "rope_theta": rope.theta, "rope_scaling": scaling,
            "rope_parameters": parameters}


def hf_config(tier, vocab_size: int, tie_embeddings: bool, special: dict[str, int],
              dtype: torch.dtype, rope=None) -> dict[str, Any]:
    """config.json for LlamaForCausalLM (a MoE tier: its architecture's keys on top, hf_moe.py); `rope`: the
    checkpoint's RoPE base and scaling (model/rope.py RopeConfig; None = the tier's base, unscaled), written as
    hf_rope says."""
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "vocab_size": vocab_size, "hidden_size": tier.d_model, "intermediate_size": tier.d_ff,
        "num_hidden_layers": tier.n_layers, "num_attention_heads": tier.n_heads,
        "num_key_value_heads": tier.n_kv_heads, "head_dim": tier.head_dim, "hidden_act": "silu",
        "rms_norm_eps": tier.norm_eps, **hf_rope(rope, tier),
        "attention_bias": False, "attention_dropout": 0.0, "mlp_bias": False, "pretraining_tp": 1,
        "tie_word_embeddings": tie_embeddings, "initializer_range": 0.02, "use_cache": True,
        "bos_token_id": special["bos_id"], "eos_token_id": special["eos_id"], "pad_token_id": special["pad_id"],
        "torch_dtype": str(dtype).removeprefix("torch."), "dtype": str(dtype).removeprefix("torch."),
    }
    if tier.moe is not None:
        from pipeline.train.handoff.hf_moe import moe_config

        config.update(moe_config(tier, hf_architecture(tier)))
    return config


def generation_config(special: dict[str, int]) -> dict[str, Any]:
    """The sampling `run.py generate` uses by default (temperature 0.8, top-p 0.95)."""
    return {"bos_token_id": special["bos_id"], "eos_token_id": special["eos_id"], "pad_token_id": special["pad_id"],
            "do_sample": True, "temperature": 0.8, "top_p": 0.95}


# ----------------------------------------------------------------------------------------------
# Tokenizer


def convert_sentencepiece(model_path: str | Path):
    """A `tokenizers.Tokenizer` giving the SentencePiece model's ids for every input (see module docstring).

    Refuses models this conversion does not reproduce exactly (unigram, a normalisation rule other than
    identity, whitespace folding, user-defined pieces)."""
    from sentencepiece import sentencepiece_model_pb2
    from tokenizers import AddedToken, Tokenizer, decoders, normalizers, processors
    from tokenizers.models import BPE

    proto = sentencepiece_model_pb2.ModelProto()
    proto.ParseFromString(Path(model_path).read_bytes())
    ts, ns = proto.trainer_spec, proto.normalizer_spec
    problems = []
    if ts.model_type != ts.BPE:
        problems.append("model_type is not BPE")
    if ns.precompiled_charsmap or ns.name not in ("identity", ""):
        problems.append(f"normalization rule {ns.name!r} (only identity converts exactly)")
    if ns.remove_extra_whitespaces:
        problems.append("remove_extra_whitespaces is on")
    if ts.treat_whitespace_as_suffix:
        problems.append("treat_whitespace_as_suffix is on")
    if any(p.type == _SP_USER_DEFINED for p in proto.pieces):
        problems.append("it has user-defined pieces")
    if problems:
        raise ExportError(f"tokenizer {model_path} cannot be converted exactly: {'; '.join(problems)}")

    pieces = list(proto.pieces)
    vocab = {p.piece: i for i, p in enumerate(pieces)}
    normal = {p.piece for p in pieces if p.type == _SP_NORMAL}
    # SentencePiece merges the adjacent pair whose concatenation is the highest-scoring piece; a BPE merge list
    # ranked by that score reproduces it. Only normal pieces take part (never control or byte pieces).
    ranked = []
    for i, p in enumerate(pieces):
        if p.type != _SP_NORMAL or len(p.piece) < 2:
            continue
        splits = [(p.piece[:k], p.piece[k:]) for k in range(1, len(p.piece))
                  if p.piece[:k] in normal and p.piece[k:] in normal]
        ranked += [(-p.score, i, vocab[a], vocab[b], a, b) for a, b in splits]
    merges = [(a, b) for *_, a, b in sorted(ranked)]

    unk = pieces[ts.unk_id].piece
    tok = Tokenizer(BPE(vocab=vocab, merges=merges, unk_token=unk, fuse_unk=True,
                        byte_fallback=ts.byte_fallback, dropout=None))
    steps = ([normalizers.Prepend("▁")] if ns.add_dummy_prefix else []) + [normalizers.Replace(" ", "▁")]
    tok.normalizer = normalizers.Sequence(steps)
    decode_steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    if ns.add_dummy_prefix:
        decode_steps.append(decoders.Strip(" ", 1, 0))  # SentencePiece drops the dummy prefix's space
    tok.decoder = decoders.Sequence(decode_steps)
    specials = [pieces[i].piece for i in (ts.pad_id, ts.unk_id, ts.bos_id, ts.eos_id) if i >= 0]
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in specials])
    if ts.bos_id >= 0:
        bos = pieces[ts.bos_id].piece
        tok.post_processor = processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A {bos} $B",
                                                           special_tokens=[(bos, ts.bos_id)])
    tok.encode_special_tokens = True  # "<s>" in text is three characters, as in SentencePiece
    return tok


def write_tokenizer(model_path: str | Path, out_dir: Path, special: dict[str, int], max_len: int) -> None:
    tok = convert_sentencepiece(model_path)
    tok.save(str(out_dir / "tokenizer.json"))
    names = {k: tok.id_to_token(v) for k, v in special.items() if v is not None and v >= 0}
    config = {
        # the generic fast class: it loads tokenizer.json as written (LlamaTokenizer would rebuild its own
        # pre-tokeniser and differ from SentencePiece on spaces)
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": names.get("bos_id"), "eos_token": names.get("eos_id"), "unk_token": names.get("unk_id"),
        "pad_token": names.get("pad_id"), "add_bos_token": True, "add_eos_token": False,
        "split_special_tokens": True, "clean_up_tokenization_spaces": False, "model_max_length": max_len,
        "padding_side": "left",
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    (out_dir / "special_tokens_map.json").write_text(json.dumps(
        {k.replace("_id", "_token"): v for k, v in names.items()}, indent=2) + "\n")
    shutil.copyfile(model_path, out_dir / "tokenizer.model")


# ----------------------------------------------------------------------------------------------
# Model card


def model_card(r: ExportResult, vocab_size: int, tie: bool, tier, dataset: str | None, rope=None) -> str:
    val = f"{r.val_loss:.4f}" if r.val_loss is not None else "not evaluated"
    arch = hf_architecture(tier)
    spec = tier.moe
    ffn = (f"d_ff {tier.d_ff}" if spec is None else
           f"{spec.num_experts} experts ({spec.experts_per_token} per token) of width {spec.expert_ffn}"
           + (f", {spec.shared_experts} shared" if spec.shared_experts else "")
           + (f", first {spec.dense_first_layers} layers dense (d_ff {tier.d_ff})" if spec.dense_first_layers else ""))
    return f"""---
library_name: transformers
pipeline_tag: text-generation
tags: [longtrain, {"llama" if spec is None else "mixture-of-experts"}]
---
# longtrain {r.tier} (step {r.step})

A causal language model trained with longtrain and exported to the Hugging Face format (`{arch}`, loads with
`AutoModelForCausalLM.from_pretrained` without `trust_remote_code`).

| | |
|---|---|
| tier | {r.tier}: d_model {tier.d_model}, {tier.n_layers} layers, {tier.n_heads} heads ({tier.n_kv_heads} key/value), {ffn} |
| vocabulary | {vocab_size} (SentencePiece BPE with byte fallback), embeddings {'tied' if tie else 'untied'} |
| RoPE | {rope.describe() if rope is not None else f"theta {tier.rope_base:,.0f}"} |
| tokens seen | {r.tokens_seen:,} |
| optimizer steps | {r.step:,} |
| data manifest hash | {r.manifest_hash or 'unknown'} |
| dataset | {dataset or 'unknown'} |
| final val loss | {val} |
| longtrain commit | {r.commit or 'unknown'} |

The tokenizer gives the same ids as the SentencePiece model it was converted from (`tokenizer.model`);
BOS is prepended, as during longtrain's own generation.
"""


# ----------------------------------------------------------------------------------------------
# The export


def _umask() -> int:
    mask = os.umask(0o022)  # the only way to read it is to set it; put it straight back
    os.umask(mask)
    return mask


def _normal_permissions(directory: Path) -> None:
    """The modes any new directory and file would have under this process's umask (0755 / 0644 with umask 022):
    tempfile.mkdtemp makes the directory 0700 and safetensors writes its file 0600, so others on the machine
    could not read the exported model."""
    mask = _umask()
    for path in [directory, *directory.rglob("*")]:
        if not path.is_symlink():
            path.chmod((0o777 if path.is_dir() else 0o666) & ~mask)


def _atomic_publish(tmp: Path, out: Path, overwrite: bool) -> None:
    """Rename the finished temp dir to `out`; an old `out` (overwrite) is moved aside first, removed after."""
    if out.exists() or out.is_symlink():
        if not overwrite:
            raise ExportError(f"--out {out} already exists; pass --overwrite to replace it or choose another "
                              f"directory")
        old = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.parent))
        os.replace(out, old / out.name)
        os.replace(tmp, out)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, out)


def export_checkpoint(checkpoint: str | Path, out_dir: str | Path, *, overwrite: bool = False,
                      commit: str | None = None) -> ExportResult:
    """Write the Hugging Face directory for `checkpoint` to `out_dir` (temp dir, then rename).

    Raises ExportError (or CheckpointError) with one line: not a checkpoint, a model without a Hugging Face
    equivalent, `out_dir` exists without overwrite, tokenizer missing; DiskFullError (pipeline/disk_space.py) when the
    disk fills, with nothing of the export left."""
    from pipeline.disk_space import EXPORT_FIX, one_line_when_full
    from pipeline.config import from_dict
    from pipeline.data.shards import DatasetError, dataset_tokenizer, load_manifest, tokenizer_location
    from pipeline.train.engine import model_rope
    from pipeline.storage import local_copy
    from pipeline.train.checkpoints.state import load_model_state, read_checkpoint_meta

    out = Path(out_dir).resolve()
    if (out.exists() or out.is_symlink()) and not overwrite:  # before any work
        raise ExportError(f"--out {out} already exists; pass --overwrite to replace it or choose another directory")
    with local_copy(checkpoint) as local:  # a checkpoint on object storage: a temporary local copy
        meta = read_checkpoint_meta(local, weights_only=True)
        check_exportable(meta, f"checkpoint {checkpoint}")
        require_tokenizers()
        dataset_dir = meta.get("dataset_dir", "")
        try:  # the dataset the checkpoint names (local or on object storage): its manifest and tokenizer
            manifest = load_manifest(dataset_dir).to_dict()
            sp_location = tokenizer_location(dataset_dir)
        except (DatasetError, FileNotFoundError) as exc:
            raise ExportError(f"tokenizer for checkpoint {checkpoint} not found ({exc}); the checkpoint names its "
                              f"dataset, which must still exist") from None
        dataset_tokenizer(dataset_dir, checkpoint)  # a broken tokenizer model: one line naming it, before any work
        state = load_model_state(local, meta)  # either layout: a sharded (FSDP) checkpoint is consolidated here
    tier, tie, vocab = _meta_tier(meta), bool(meta.get("tie_embeddings", True)), int(meta["vocab_size"])
    rope = model_rope(from_dict(meta["config"]))  # the RoPE base and scaling the checkpoint's last phase used
    special = {k: int(manifest.get(k, d)) for k, d in (("pad_id", 0), ("unk_id", 1), ("bos_id", 2), ("eos_id", 3))}
    if commit is None:
        from pipeline.tracking.tracker import git_commit  # imports no MLflow at module level

        commit = git_commit()
    counters, metrics = meta.get("counters", {}), meta.get("metrics") or {}
    result = ExportResult(out, meta["tier"], int(counters.get("step", 0)), int(counters.get("tokens_seen", 0)),
                          float(metrics[VAL_LOSS]) if VAL_LOSS in metrics else None,
                          manifest.get("settings_hash"), commit, hf_architecture(tier))

    weights = hf_state_dict(state, tier, tie)
    dtype = state["tok_emb.weight"].dtype
    needed = sum(t.numel() * t.element_size() for t in weights.values()) + (1 << 20)  # + the tokenizer's files
    with one_line_when_full(out, "the export", EXPORT_FIX, needed=needed):  # the temp dir removed: nothing half
        out.parent.mkdir(parents=True, exist_ok=True)
        _write_export(out, overwrite, weights, result, manifest, sp_location, tier, vocab, tie, special, dtype, rope)
    return result


def _write_export(out: Path, overwrite: bool, weights, result, manifest, sp_location, tier, vocab, tie, special,
                  dtype, rope) -> None:
    from safetensors.torch import save_file

    from pipeline.storage import local_copy

    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        save_file(weights, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(hf_config(tier, vocab, tie, special, dtype, rope), indent=2) + "\n")
        (tmp / "generation_config.json").write_text(json.dumps(generation_config(special), indent=2) + "\n")
        with local_copy(sp_location) as sp_model:
            write_tokenizer(sp_model, tmp, special, tier.max_seq_len)
        source = manifest.get("source", {})
        dataset = source.get("name") or source.get("path") or source.get("kind")
        (tmp / "README.md").write_text(model_card(result, vocab, tie, tier, dataset, rope))
        _normal_permissions(tmp)
        _atomic_publish(tmp, out, overwrite)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def register_export(result: ExportResult, tracking_uri: str, run_id: str, name: str):
    """Log the exported directory to the training run and register it as a version of model `name`,
    tagged with tier, tokens seen, step, val loss and data manifest hash. Returns the ModelVersion."""
    from pipeline.tracking.lineage import register_model_dir

    tags = {"tier": result.tier, "tokens_seen": result.tokens_seen, "step": result.step,
            "val_loss": "" if result.val_loss is None else f"{result.val_loss:.6f}",
            "manifest_hash": result.manifest_hash or "", "format": f"transformers/{result.architecture}"}
    return register_model_dir(tracking_uri, run_id, result.out_dir, name, tags,
                              description=f"longtrain {result.tier}, step {result.step}, "
                                          f"{result.tokens_seen:,} tokens seen; Hugging Face format (transformers)")
