"""The resonance mixer (model/resonance.py): its three forms against each other and against the definition,
causality, document isolation, generation with the recurrent state, gradients, stability, tiers and FLOPs."""
from __future__ import annotations

import pytest
import torch

from model.decoder import build_model
from model.flops import resonance_core_flops_per_token, resonance_flops_per_token, resonance_matmul_params
from model.resonance import ResonanceLM, ResonanceMixer, eigen_log
from model.tiers import RESONANCE_TIERS, TIERS, ResonanceTier
from pipeline.config import ConfigError, load_config

VOCAB = 61
# chunk 4 with rows of 10..23 tokens: several chunks, a partial last chunk, documents that straddle chunks
TINY = ResonanceTier("tiny", d_model=16, n_layers=2, n_groups=2, n_eigen=3, d_ff=24, chunk_size=4, max_seq_len=256)


def tiny_mixer(seed: int = 0) -> ResonanceMixer:
    torch.manual_seed(seed)
    mixer = ResonanceMixer(8, n_groups=2, n_eigen=3, chunk_size=4).double()
    with torch.no_grad():  # varied decays and frequencies, some slow (long memory), some fast
        mixer.alpha.normal_(0.0, 2.0)
        mixer.omega.normal_(0.0, 3.0)
        mixer.log_dt.uniform_(-3.0, 0.0)
    return mixer


def tiny_model(**kw) -> ResonanceLM:
    torch.manual_seed(0)
    model = ResonanceLM(TINY, VOCAB, **kw).double().eval()
    with torch.no_grad():  # larger weights than init_weights' 0.02 make the comparisons sharper
        for name, p in model.named_parameters():
            if p.dim() > 1 and ".mixer." not in name:
                p.normal_(0.0, 0.3)
            elif name.endswith("log_dt"):
                p.uniform_(-3.0, 0.0)
    return model


def direct_convolution(mixer: ResonanceMixer, u: torch.Tensor) -> torch.Tensor:
    """y(t) = sum_{s<=t} h(t-s) u(s) with the materialised (T, G, P, P) kernel: O(T^2), the definition."""
    B, T, D = u.shape
    h = mixer.kernel(T)
    ug = u.view(B, T, mixer.G, mixer.P)
    y = torch.zeros_like(ug)
    for t in range(T):
        for s in range(t + 1):
            y[:, t] += torch.einsum("gpq,bgq->bgp", h[t - s], ug[:, s])
    return y.view(B, T, D)


# ------------------------------------------------------------------------------------------ the forms
def test_fft_form_equals_the_direct_convolution_with_the_materialised_kernel():
    mixer = tiny_mixer()
    u = torch.randn(2, 23, 8, dtype=torch.float64)
    y, _ = mixer(u, form="fft")  # (B, T, G, P)
    torch.testing.assert_close(y.flatten(2), direct_convolution(mixer, u), rtol=0, atol=1e-10)


@pytest.mark.parametrize("T", [1, 4, 13, 32])
def test_chunked_scan_and_recurrence_equal_the_fft_form_on_one_document(T):
    mixer = tiny_mixer(1)
    u = torch.randn(3, T, 8, dtype=torch.float64)
    y_fft, s_fft = mixer(u, form="fft")
    for form in ("scan", "recurrent"):
        y, s = mixer(u, form=form)
        torch.testing.assert_close(y, y_fft, rtol=0, atol=1e-12)
        torch.testing.assert_close(s, s_fft, rtol=0, atol=1e-12)  # the final state too (generation prefill)


def test_scan_resets_match_the_recurrence_with_resets():
    mixer = tiny_mixer(2)
    u = torch.randn(2, 19, 8, dtype=torch.float64)
    starts = torch.zeros(2, 19, dtype=torch.bool)
    starts[0, [3, 4, 11]] = True  # a one-token document, and a start in the middle of a chunk
    starts[1, [8, 16]] = True  # starts on chunk boundaries
    y_scan, _ = mixer(u, form="scan", starts=starts)
    y_rec, _ = mixer(u, form="recurrent", starts=starts)
    torch.testing.assert_close(y_scan, y_rec, rtol=0, atol=1e-12)
    with pytest.raises(ValueError, match="cannot reset"):
        mixer(u, form="fft", starts=starts)


def test_gradients_equal_finite_differences():
    torch.manual_seed(3)
    mixer = ResonanceMixer(4, n_groups=2, n_eigen=2, chunk_size=2).double()  # small: 52 numbers to perturb
    with torch.no_grad():
        mixer.alpha.normal_(0.0, 2.0)
        mixer.log_dt.uniform_(-3.0, 0.0)
    names = [n for n, _ in mixer.named_parameters()]
    params = tuple(p.detach().clone().requires_grad_() for p in mixer.parameters())
    u = torch.randn(1, 7, 4, dtype=torch.float64, requires_grad=True)
    starts = torch.zeros(1, 7, dtype=torch.bool)
    starts[0, 3] = True

    def run(form, starts):
        def f(u, *ps):
            out, _ = torch.func.functional_call(mixer, dict(zip(names, ps)), (u,), {"form": form, "starts": starts})
            return out
        return f

    assert torch.autograd.gradcheck(run("fft", None), (u, *params), eps=1e-6, atol=1e-6)
    assert torch.autograd.gradcheck(run("scan", starts), (u, *params), eps=1e-6, atol=1e-6)


def test_the_fft_form_keeps_only_its_output_for_backward():
    """FFTConv (forward saves s, backward derives both gradients from it) gives autograd's gradients of the same
    ops, and the tape holds less than half of what plain autograd keeps for the FFT form (bench/mixer.py prints
    the ratio in a whole layer)."""
    from bench.common import saved_tensor_bytes
    from model.resonance import fft_conv

    g = torch.Generator().manual_seed(4)
    z = torch.randn(2, 37, 2, 3, 2, generator=g, dtype=torch.float64)
    log_lam = torch.stack([-torch.rand(2, 3, generator=g, dtype=torch.float64) * 0.3 - 1e-5,
                           torch.randn(2, 3, generator=g, dtype=torch.float64)], dim=-1)
    gs, state0 = torch.randn_like(z), torch.randn(2, 2, 3, 2, generator=g, dtype=torch.float64)
    grads, saved = {}, {}
    for plain in (False, True):
        a, b = z.clone().requires_grad_(), log_lam.clone().requires_grad_()
        out = {}
        saved[plain] = saved_tensor_bytes(lambda: out.update(s=fft_conv(a, b, state0, plain_autograd=plain)[0]))
        (out["s"] * gs).sum().backward()
        grads[plain] = (a.grad, b.grad)
    for got, want in zip(grads[False], grads[True]):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-10)
    assert saved[False] < 0.5 * saved[True], saved


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_eigenvalues_stay_inside_the_unit_circle_for_any_parameter_values(dtype):
    big = torch.finfo(dtype).max
    values = torch.tensor([-big, -1e30, -1e4, -50.0, -1.0, 0.0, 1e-30, 1.0, 50.0, 1e4, 1e30, big], dtype=dtype)
    alpha, omega, log_dt = torch.meshgrid(values, values, values, indexing="ij")
    log_lam, _ = eigen_log(alpha.flatten(), omega.flatten(), log_dt.flatten())
    modulus = torch.exp(log_lam).abs()
    assert torch.isfinite(log_lam.real).all() and torch.isfinite(modulus).all()
    assert modulus.max() < 1 - 0.99e-5  # |lambda| <= exp(-MIN_DECAY) ~ 1 - 1e-5, up to rounding
    g = torch.Generator().manual_seed(0)
    mixer = ResonanceMixer(8, 2, 3, 4).to(dtype)
    with torch.no_grad():
        for p in (mixer.alpha, mixer.omega, mixer.log_dt):
            p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float64).mul(1e3).to(dtype))
    assert (mixer.eigenvalues().abs() < 1).all()


# ------------------------------------------------------------------------------------- the model
def test_causality_a_token_changes_no_output_before_it():
    model = tiny_model()
    tokens = torch.randint(0, VOCAB, (2, 21))
    doc_ids = torch.zeros(2, 21, dtype=torch.int32)
    changed = tokens.clone()
    changed[:, 9] = (changed[:, 9] + 1) % VOCAB
    with torch.no_grad():
        for doc in (None, doc_ids):  # the FFT form, and the chunked scan (doc masking on, one document)
            a, b = model(tokens, doc), model(changed, doc)
            if doc is None:  # FFT: the earlier outputs move by rounding only
                torch.testing.assert_close(a[:, :9], b[:, :9], rtol=0, atol=1e-12)
            else:  # the scan never reads a later position: bit for bit
                assert torch.equal(a[:, :9], b[:, :9])
            assert (a[:, 9:] - b[:, 9:]).abs().amax(dim=-1).min() > 1e-6  # and every later output changes


def test_each_document_equals_that_document_alone():
    model = tiny_model()
    lengths = [5, 1, 9, 7]  # straddles chunk boundaries (chunk 4), a one-token document
    tokens = torch.randint(0, VOCAB, (2, sum(lengths)))
    doc_ids = torch.cat([torch.full((n,), i, dtype=torch.int32) for i, n in enumerate(lengths)]).expand(2, -1)
    with torch.no_grad():
        packed = model(tokens, doc_ids)
        start = 0
        for n in lengths:
            alone = model(tokens[:, start:start + n])  # a row of one document: the FFT form
            torch.testing.assert_close(packed[:, start:start + n], alone, rtol=0, atol=1e-12)
            start += n
        # exact isolation: whatever the other documents hold, a document's outputs do not change by one bit
        other = tokens.clone()
        other[:, :5] = (other[:, :5] + 7) % VOCAB
        other[:, 15:] = (other[:, 15:] + 3) % VOCAB
        assert torch.equal(model(other, doc_ids)[:, 5:15], packed[:, 5:15])
    no_mask = tiny_model(doc_masking=False)
    with torch.no_grad():  # doc masking off: the FFT form over the whole row, documents see each other
        assert not torch.allclose(no_mask(tokens, doc_ids)[:, 5:], packed[:, 5:])


def test_generation_with_the_recurrent_state_equals_the_full_forward():
    model = tiny_model()
    tokens = torch.randint(0, VOCAB, (2, 17))
    with torch.no_grad():
        full = model(tokens)  # (2, 17, D): FFT over the whole row
        cache = model.new_kv_cache(batch_size=2, max_len=17)
        steps = [model(tokens[:, :6], kv_cache=cache)]  # prefill (FFT, returns the state)
        for t in range(6, 17):
            steps.append(model(tokens[:, t:t + 1], kv_cache=cache))  # recurrent, one token
    torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=0, atol=1e-10)
    assert cache.length == 17 and int(cache.pos) == 17
    assert len(cache.state) == TINY.n_layers  # one state per layer: (re, im) per row and channel
    assert all(s.shape == (2, TINY.n_groups, TINY.n_eigen, 2) for s in cache.state)


def test_left_padded_rows_equal_each_prompt_alone():
    model = tiny_model()
    prompts = [torch.randint(0, VOCAB, (n,)) for n in (7, 3, 5)]
    P, N = 7, 6
    pad = torch.tensor([P - len(p) for p in prompts])
    idx = torch.stack([torch.cat([torch.full((P - len(p),), 11), p]) for p in prompts])  # pad slots hold junk
    cont = torch.randint(0, VOCAB, (3, N))
    with torch.no_grad():
        cache = model.new_kv_cache(batch_size=3, max_len=P + N, left_pad=pad)
        out = [model(idx, kv_cache=cache)[:, -1]]
        for t in range(N):
            out.append(model(cont[:, t:t + 1], kv_cache=cache)[:, -1])
        batched = torch.stack(out, dim=1)  # (3, N + 1, D)
        for b, p in enumerate(prompts):
            alone = model(torch.cat([p, cont[b]])[None])[0, len(p) - 1:]  # (N + 1, D)
            torch.testing.assert_close(batched[b], alone, rtol=0, atol=1e-10)
        cache = model.new_kv_cache(batch_size=3, max_len=P)
        model(idx, kv_cache=cache)
        with pytest.raises(ValueError, match="full"):
            model(cont[:, :1], kv_cache=cache)


def test_generate_ids_runs_the_resonance_model():
    from model.decode_loop import generate_ids

    model = tiny_model().float()
    out = generate_ids(model, [[1, 2, 3, 4], [5, 6]], max_new_tokens=5, temperature=0.0)
    assert out.shape == (2, 5)
    alone = generate_ids(model, [[5, 6]], max_new_tokens=5, temperature=0.0)
    assert torch.equal(out[1], alone[0])  # greedy: the padded row generates what it generates alone


def test_activation_checkpointing_and_compile_keep_the_numbers():
    tokens = torch.randint(0, VOCAB, (2, 12))
    doc_ids = torch.tensor([[0] * 5 + [1] * 7] * 2, dtype=torch.int32)
    from bench.common import saved_tensor_bytes

    ref = tiny_model().train()
    ref(tokens, doc_ids).square().sum().backward()
    saved = {"none": saved_tensor_bytes(lambda: ref(tokens, doc_ids), list(ref.parameters()))}
    for spec in ("all", "mixer"):  # whole blocks; only each block's mixer half (resonance's own option)
        ckpt = tiny_model(activation_checkpointing=spec).train()
        ckpt(tokens, doc_ids).square().sum().backward()
        for (n, a), b in zip(ref.named_parameters(), ckpt.parameters()):
            torch.testing.assert_close(a.grad, b.grad, rtol=1e-10, atol=1e-12, msg=f"{spec} {n}")
        saved[spec] = saved_tensor_bytes(lambda: ckpt(tokens, doc_ids), list(ckpt.parameters()))
    assert saved["all"] < saved["mixer"] < 0.7 * saved["none"], saved
    compiled = tiny_model().float().compile_blocks(backend="eager")
    plain = tiny_model().float()
    with torch.no_grad():
        torch.testing.assert_close(compiled(tokens, doc_ids), plain(tokens, doc_ids))


# ------------------------------------------------------------------ bf16: the projections on tensor cores
@pytest.fixture
def one_thread():
    """Tiny CPU models run fastest on one thread, and far faster than on two when other work shares the cores."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_the_three_forms_agree_under_bf16_autocast(one_thread):
    """Under autocast the mixer's projections run in bf16 and only the core keeps fp32, so the forms may differ by
    no more than bf16 rounding of what they hand the output projection: here they agree to 1e-3 of the hidden
    states' RMS (they are bit-equal on this row), and each is within 3% RMS of the fp64 model, the error of
    running the whole block's matmuls in bf16."""
    model64 = tiny_model()
    model = tiny_model().float()
    tokens = torch.randint(0, VOCAB, (2, 40))
    doc_ids = torch.tensor([[0] * 13 + [1] * 27] * 2)
    with torch.no_grad():
        for docs, forms in ((None, ("fft", "scan", "recurrent")), (doc_ids, ("scan", "recurrent"))):
            want = model64(tokens, docs)
            rms = want.pow(2).mean().sqrt()
            outs = []
            for form in forms:
                model.form = form
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    outs.append(model(tokens, docs).double())
                assert (outs[-1] - want).pow(2).mean().sqrt() < 0.03 * rms, (form, docs is None)
            for out in outs[1:]:
                assert (out - outs[0]).abs().max() < 1e-3 * rms


def test_bf16_autocast_trains_like_fp32(one_thread):
    """40 AdamW steps on one batch (the loss falls from 4.1 to ~0.4), one document per row (FFT form) and two
    (the scan): the bf16-autocast loss stays within 0.05 of the fp32 loss at every step (0.021 / 0.013 measured)."""
    import torch.nn.functional as F

    def losses(amp: bool, doc_ids) -> torch.Tensor:
        torch.manual_seed(0)
        model = ResonanceLM(TINY, VOCAB)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        data = torch.randint(0, VOCAB, (4, 33), generator=torch.Generator().manual_seed(1))
        out = []
        for _ in range(40):
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
                hidden = model(data[:, :-1], doc_ids)
                loss = F.cross_entropy(model.logits(hidden).flatten(0, 1), data[:, 1:].flatten())
            loss.backward()
            opt.step()
            opt.zero_grad()
            out.append(loss.item())
        return torch.tensor(out)

    for doc_ids in (None, torch.tensor([[0] * 10 + [1] * 22] * 4)):
        fp32, bf16 = losses(False, doc_ids), losses(True, doc_ids)
        assert fp32[-1] < 0.15 * fp32[0], fp32  # it learned
        assert (fp32 - bf16).abs().max() < 0.05, (fp32, bf16)


# ------------------------------------------------------------------------- tiers, config, FLOPs, CLI
def test_resonance_tiers_share_the_attention_names_and_parameter_budgets():
    dense = [n for n, t in TIERS.items() if t.moe is None]
    moe = [n for n, t in TIERS.items() if t.moe is not None]
    assert list(RESONANCE_TIERS) == [*dense, "small_32k", *moe]  # the mixture-of-experts tiers too, last
    for name, tier in TIERS.items():
        with torch.device("meta"):
            att = build_model(name, 32000).num_params()
            res = build_model(name, 32000, mixer="resonance").num_params()
        assert abs(res / att - 1) < 0.01, (name, res, att)
    small = RESONANCE_TIERS["small_32k"]
    assert (small.d_model, small.n_layers, small.eigen_per_layer, small.chunk_size) == (1024, 8, 128, 256)
    with torch.device("meta"):
        assert 120e6 < build_model("small_32k", 32000, mixer="resonance").num_params() < 130e6
    with pytest.raises(ValueError, match="choose attention or resonance"):
        build_model("nano", 100, mixer="mamba")


def test_model_mixer_is_a_validated_config_field():
    cfg = load_config("cpu", ["--model.mixer=resonance", "--model.tier=small_32k", "--data.seq_len=32768"])
    assert cfg.model.mixer == "resonance" and cfg.flat()["model.mixer"] == "resonance"
    assert load_config("cpu").model.mixer == "attention"
    with pytest.raises(ConfigError, match=r"model.mixer='rnn' is not allowed; choose one of: attention, resonance"):
        load_config("cpu", ["--model.mixer=rnn"])
    with pytest.raises(ConfigError, match=r"model.tier='small_32k' is not allowed; choose one of: nano, A, B, C, D, "
                                          r"E, F, nano-moe, A-moe, B-moe, C-moe$"):
        load_config("cpu", ["--model.tier=small_32k"])
    assert load_config("cpu", ["--model.mixer=resonance", "--model.activation_checkpointing=mixer"])
    with pytest.raises(ConfigError, match="activation_checkpointing=mixer recomputes the resonance mixer"):
        load_config("cpu", ["--model.activation_checkpointing=mixer"])
    assert load_config("cpu", ["--model.mixer=resonance", "--model.tier=B", "--data.seq_len=262144"])
    with pytest.raises(ConfigError, match="allowed 8..262144"):  # resonance tiers are configured up to 256k
        load_config("cpu", ["--model.mixer=resonance", "--model.tier=B", "--data.seq_len=524288"])


def test_fp32_forms_stay_exact_over_a_262144_token_row():
    """The tiers are configured up to 262,144 tokens: over a whole row that long the fp32 FFT and chunked-scan forms
    (the CPU training paths; the CUDA kernel keeps the same fp32 state) agree with the fp64 recurrence to 2e-3 of the
    output's RMS, also for an oscillator that barely decays (|lambda| = 1 - 6e-6, so the phase of lambda^t matters at
    every lag). Measured here: FFT 2.3e-6, scan 9.2e-4."""
    torch.manual_seed(0)
    mixer = ResonanceMixer(8, n_groups=2, n_eigen=3, chunk_size=256)
    with torch.no_grad():
        mixer.alpha.normal_(0.0, 2.0)
        mixer.omega.normal_(0.0, 3.0)
        mixer.log_dt.uniform_(-6.0, 0.0)
        mixer.alpha[0], mixer.log_dt[0] = -12.0, 0.0  # softplus(-12) = 6e-6: the slowest decay
    u = torch.randn(1, 262144, 8)
    exact = ResonanceMixer(8, n_groups=2, n_eigen=3, chunk_size=256).double()
    exact.load_state_dict(mixer.state_dict())
    with torch.no_grad():
        y_ref, _ = exact(u.double(), form="recurrent")
        scale = y_ref.pow(2).mean().sqrt()
        for form in ("fft", "scan"):
            y, _ = mixer(u, form=form)
            assert ((y.double() - y_ref).abs().max() / scale) < 2e-3, form


@pytest.mark.parametrize("name", list(RESONANCE_TIERS))
def test_resonance_matmul_params_are_the_model_matrices(name):
    with torch.device("meta"):
        model = ResonanceLM(RESONANCE_TIERS[name], 32000, tie_embeddings=False)
    in_matmuls = sum(p.numel() for n, p in model.named_parameters() if p.dim() >= 2 and n != "tok_emb.weight")
    assert resonance_matmul_params(RESONANCE_TIERS[name], 32000, active=False) == in_matmuls  # MoE: every expert
    if RESONANCE_TIERS[name].moe is None:
        assert resonance_matmul_params(RESONANCE_TIERS[name], 32000) == in_matmuls


def test_training_form_and_its_flops_follow_the_device(monkeypatch):
    from cuda_ops import dispatch
    from model.flops import KERNEL_TRAINING_FLOPS

    tier, V = RESONANCE_TIERS["B"], 32000
    with torch.device("meta"):
        masked, whole = ResonanceLM(tier, V), ResonanceLM(tier, V, doc_masking=False)
    assert (masked.training_form("cpu"), whole.training_form("cpu")) == ("scan", "fft")
    monkeypatch.setattr(dispatch, "numba_cuda_status", lambda: (True, "test"))
    assert masked.training_form("cuda") == whole.training_form("cuda") == "kernel"  # the kernel runs every row
    kernel = resonance_flops_per_token(tier, 32768, V, form="kernel")
    channels = tier.n_layers * tier.n_groups * tier.n_eigen
    assert kernel == 6 * resonance_matmul_params(tier, V) + channels * KERNEL_TRAINING_FLOPS
    assert kernel == resonance_flops_per_token(tier, 262144, V, form="kernel")  # the scan's cost is flat in T


def test_resonance_flops_are_matmuls_plus_a_log_t_core():
    tier, V = RESONANCE_TIERS["B"], 32000
    channels = tier.n_layers * tier.n_groups * tier.n_eigen
    fft = resonance_core_flops_per_token(tier, 32768, "fft")
    assert fft == channels * (30 * 16 + 12)  # 2T = 65,536 = 2^16
    assert resonance_core_flops_per_token(tier, 32768, "scan") == channels * (14 * 8 + 8)  # chunk 256
    assert resonance_flops_per_token(tier, 32768, V, doc_masking=False) == 6 * resonance_matmul_params(tier, V) + 3 * fft
    # doubling the context adds 3 * 30 FLOPs per channel (FFT) where attention adds 6 * L * d * T
    assert resonance_flops_per_token(tier, 65536, V, False) - resonance_flops_per_token(tier, 32768, V, False) == 90 * channels


def test_python_m_model_lists_both_families(capsys):
    from model.__main__ import main

    main([])
    out = capsys.readouterr().out
    attention, resonance, moe = out.strip().split("\n\n")  # the mixture-of-experts tiers in a third table
    assert [line.split()[0] for line in attention.splitlines()[2:]] == [n for n, t in TIERS.items() if t.moe is None]
    lines = resonance.splitlines()
    assert lines[0].startswith("model.mixer=resonance")
    rows = {line.split()[0]: line.split() for line in lines[2:]}
    assert list(rows) == [n for n, t in RESONANCE_TIERS.items() if t.moe is None]
    assert moe.splitlines()[0].startswith("mixture of experts")
    with torch.device("meta"):
        n = ResonanceLM(RESONANCE_TIERS["small_32k"], 32000).num_params()
    assert rows["small_32k"][8] == f"{n:,}"
