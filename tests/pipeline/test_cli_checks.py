"""Command lines as users type them, refused (or taken) in one line before anything loads, Ray-free:
generate's sampling flags and --prompts-file (pipeline/train/handoff/generation_flags.py), YAML booleans for fields whose
choices are a yes/no pair, and the names other projects give to config fields and sweep keys.

    .venv/bin/python -m pytest -q tests/pipeline/test_cli_checks.py
"""
from __future__ import annotations

import gzip
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
RUN = [sys.executable, str(ROOT / "pipeline" / "run.py")]


def run_cli(*args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    """The command in a subprocess; a hang fails the test at `timeout` (subprocess.TimeoutExpired names it)."""
    return subprocess.run([*RUN, *args], capture_output=True, text=True, timeout=timeout, cwd=ROOT)


def one_error_line(res: subprocess.CompletedProcess) -> str:
    assert res.returncode == 2, res.stdout + res.stderr
    assert "Traceback" not in res.stdout + res.stderr, res.stderr
    err = res.stderr.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: "), res.stderr
    return err[0]


@pytest.mark.parametrize("flags, line", [
    (["--top-p", "90"], "error: --top-p 90: give the nucleus probability mass as a fraction in (0, 1], e.g. 0.9 for "
                        "90% (1 = off; default 0.95)"),
    (["--max-new-tokens", "0"], "error: --max-new-tokens 0: give the number of tokens to generate per prompt, at "
                                "least 1 (default 64)"),
    (["--temperature", "-1"], "error: --temperature -1: give a finite number >= 0 (0 = greedy, 1 = the model's own "
                              "distribution; default 0.8)"),
    (["--temperature", "nan"], "error: --temperature nan: give a finite number >= 0"),
    (["--top-k", "-5"], "error: --top-k -5: give the number of likeliest tokens to sample from, >= 0 (0 = all"),
    (["--min-p", "5"], "error: --min-p 5: give a fraction in [0, 1] of the likeliest token's probability, e.g. 0.05 "
                       "for 5% (0 = off; default 0)"),
])
def test_generate_sampling_flags_are_checked_before_the_checkpoint_is_even_looked_for(flags, line):
    # The checkpoint does not exist: the flag's line comes first, so no model was located, let alone loaded
    res = run_cli("generate", "--checkpoint", "/nonexistent/run/checkpoints/phase0/step_000008", *flags)
    assert one_error_line(res).startswith(line)
    assert "==> generate" not in res.stdout  # the stage (and its model load) never began


@pytest.mark.system
def test_a_prompts_file_that_is_not_text_gets_its_own_line_never_the_checkpoints(tmp_path):
    ckpt = "/nonexistent/run/checkpoints/phase0/step_000008"
    gz = tmp_path / "prompts.txt.gz"
    gz.write_bytes(gzip.compress(b"Once upon a time\ndef main\n"))
    res = run_cli("generate", "--checkpoint", ckpt, "--prompts-file", str(gz))
    assert one_error_line(res) == (f"error: --prompts-file {gz} is gzip-compressed; it must be a UTF-8 text file with "
                                   f"one prompt per line: decompress it first (gunzip -k {gz})")
    latin = tmp_path / "prompts-latin1.txt"
    latin.write_bytes("caf\xe9 au lait\n".encode("latin-1"))
    res = run_cli("generate", "--checkpoint", ckpt, "--prompts-file", str(latin))
    assert one_error_line(res) == (f"error: --prompts-file {latin} is not UTF-8 text (byte 3 is 0xe9); it must be a "
                                   f"UTF-8 text file with one prompt per line")
    blank = tmp_path / "blank.txt"
    blank.write_text("\n  \n")
    res = run_cli("generate", "--checkpoint", ckpt, "--prompts-file", str(blank))
    assert "holds no prompt (every line is blank)" in one_error_line(res)
    res = run_cli("generate", "--checkpoint", ckpt, "--prompts-file", str(tmp_path / "missing.txt"))
    assert one_error_line(res) == (f"error: --prompts-file {tmp_path / 'missing.txt'} does not exist; give a UTF-8 "
                                   f"text file with one prompt per line")


@pytest.mark.system
def test_yaml_booleans_and_true_false_words_are_taken_for_yes_no_choices(tmp_path):
    """ray.use_gpu (auto | true | false) and model.compile (auto | on | off) from a YAML preset, from the command
    line in any case, and from a sweep file's resources_per_trial and fixed."""
    preset = tmp_path / "preset.yaml"
    preset.write_text("ray: {use_gpu: false}\nmodel: {compile: off}\n")  # YAML reads both as the boolean False
    plan = ["-m", "pipeline.train.max_batch", "--workers", "1", "--device", "cpu", "--memory-limit-gib", "1",
            "--tier", "nano", "--seq-len", "256"]
    res = subprocess.run([sys.executable, *plan, "--preset", str(preset)], capture_output=True, text=True,
                         timeout=300, cwd=ROOT)
    assert res.returncode == 0 and "memory plan" in res.stdout, res.stderr
    res = subprocess.run([sys.executable, *plan, "--preset", "cpu", "--ray.use_gpu=False", "--model.compile=yes"],
                         capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert res.returncode == 0 and "memory plan" in res.stdout, res.stderr

    from pipeline.config import Config
    from pipeline.sweep.space import load_space

    space = tmp_path / "space.yaml"
    space.write_text("resources_per_trial: {num_workers: 1, use_gpu: false}\nfixed: {model.compile: off}\n"
                     "params: {train.lr: {grid: [0.001, 0.003]}}\n")
    loaded = load_space(space, Config())
    assert loaded.resources["ray.use_gpu"] == "false" and loaded.fixed["model.compile"] == "off"
    # through the CLI: the space's booleans pass, and the line is about what is really wrong in it (no params)
    space.write_text("resources_per_trial: {num_workers: 1, use_gpu: false}\nfixed: {model.compile: off}\n")
    res = run_cli("tune", "--space", str(space), "--preset", "test", f"--run.root={tmp_path}")
    assert one_error_line(res).startswith(f"error: search space {space}: params is empty")
    # a word that is neither still gets the field's own line
    res = run_cli("train", "--ray.use_gpu=maybe")
    assert one_error_line(res) == "error: ray.use_gpu='maybe' is not allowed; choose one of: auto, true, false"


@pytest.mark.parametrize("field, meant", [("train.learning_rate", "train.lr"),
                                          ("train.gradient_accumulation_steps", "train.grad_accum"),
                                          ("data.block_size", "data.seq_len"), ("max_iters", "train.max_steps"),
                                          ("train.warmup_iters", "train.warmup_steps")])
def test_another_projects_name_for_a_field_gets_did_you_mean(field, meant):
    res = run_cli("train", f"--{field}=8")
    assert one_error_line(res) == (f"error: unknown config field {field!r}; did you mean {meant!r}? `python "
                                   f"pipeline/run.py --help` lists every field with its type, default and meaning")


@pytest.mark.parametrize("key, hint", [("num_sample", "did you mean 'num_samples' (for 'num_sample')?"),
                                       ("param_space", "did you mean 'params' (for 'param_space')?"),
                                       ("max_concurrent", "did you mean 'max_concurrent_trials' (for "
                                                          "'max_concurrent')?"),
                                       ("train.lr", "'train.lr' is a config field: put it under params (searched) "
                                                    "or fixed;")])
@pytest.mark.system
def test_a_misspelled_sweep_key_gets_did_you_mean(tmp_path, key, hint):
    space = tmp_path / "space.yaml"
    space.write_text(f"{key}: 2\nparams: {{train.lr: {{grid: [0.001, 0.003]}}}}\n")
    res = run_cli("tune", "--space", str(space), "--preset", "test", f"--run.root={tmp_path}")
    assert one_error_line(res) == (f"error: search space {space}: unknown key(s) [{key!r}]; {hint} valid keys: "
                                   f"description, metric, mode, num_samples, max_concurrent_trials, token_budget, "
                                   f"skip_unfit_batch, scheduler, resources_per_trial, fixed, params, rank_by, rank_mode")
    assert not (tmp_path / "tune").exists()


@pytest.mark.system
def test_rope_settings_for_the_resonance_family_are_refused_not_ignored(tmp_path):
    """README: a setting the command would not use is refused in one line, never ignored (docs/long-context.md)."""
    res = run_cli("train", "--model.mixer=resonance", "--model.rope_theta=10000", f"--run.root={tmp_path}")
    assert one_error_line(res) == ("error: model.rope_theta is set, but model.mixer=resonance has no RoPE (its kernel "
                                   "is its position code), so no RoPE setting is used; drop model.rope_theta, or "
                                   "train model.mixer=attention")
    preset = tmp_path / "res.yaml"
    preset.write_text("model: {mixer: resonance, rope_scaling: linear, rope_factor: 2}\n")
    res = run_cli("train", "--preset", str(preset), f"--run.root={tmp_path}")
    assert "model.rope_scaling is set, but model.mixer=resonance has no RoPE" in one_error_line(res)
    phases = tmp_path / "phases.yaml"
    phases.write_text("- steps: 2\n- steps: 2\n  overrides: {data.seq_len: 512, model.rope_scaling: yarn, "
                      "model.rope_factor: 4, model.rope_original_max_len: 256}\n")
    res = run_cli("train", "--no-ray", "--preset", "test", "--model.mixer=resonance", "--phases", str(phases),
                     f"--run.root={tmp_path}")
    assert one_error_line(res) == (f"error: --phases {phases}: phase 1 overrides: model.rope_scaling is set, but "
                                   f"model.mixer=resonance has no RoPE (its kernel is its position code), so no RoPE "
                                   f"setting is used; drop model.rope_scaling, or train model.mixer=attention")
    assert not list(tmp_path.glob("*/run.json"))  # nothing trained


def test_rope_settings_on_resume_of_a_resonance_run_are_refused(tmp_path):
    import json

    from pipeline.config import load_config

    run = tmp_path / "res-run"
    run.mkdir()
    record = {"config": load_config("test", {"model.mixer": "resonance", "run.root": str(tmp_path)}).flat(),
              "status": "stopped", "phases": [{"steps": 4}], "phases_done": 0}
    (run / "run.json").write_text(json.dumps(record))
    before = (run / "run.json").read_text()
    res = run_cli("train", "--resume", str(run), "--no-ray", "--model.rope_theta=10000")
    assert one_error_line(res) == (f"error: run {run}: model.rope_theta is set, but model.mixer=resonance has no RoPE "
                                   f"(its kernel is its position code), so no RoPE setting is used; drop "
                                   f"model.rope_theta, or train model.mixer=attention")
    assert (run / "run.json").read_text() == before and sorted(p.name for p in run.iterdir()) == ["run.json"]


# Command lines refused before anything loads: none of them may import torch, Ray or MLflow on the way to its line
# (each costs seconds: torch ~3 s on 2 cores). One process runs them in turn, so one import by any fails the test.
REFUSED_LIGHT = [
    ["train", "--train.batch_size=0"],  # no --preset: the default preset is chosen without importing torch
    ["train", "--train.learning_rate=8"],
    ["tune", "--space", "/nonexistent/space.yaml", "--preset", "test"],
    ["eval", "--resume", "/nonexistent/run"],
    ["generate", "--resume", "/nonexistent/run"],
    ["generate", "--checkpoint", "/nonexistent/run/checkpoints/phase0/step_000008", "--top-p", "90"],
    ["export", "--resume", "/nonexistent/run", "--out", "/nonexistent/hf"],
    ["train", "--no-ray", "--train.context_parallel_degree=2", "--preset", "test"],
]
LIGHT_DRIVER = """
import contextlib, io, json, sys
from pipeline.run import main
out = []
for args in json.loads(sys.argv[1]):
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = main(args)
    out.append([args, code, err.getvalue(), sorted(m for m in ("torch", "ray", "mlflow") if m in sys.modules)])
print(json.dumps(out))
"""


def test_refused_command_lines_load_neither_torch_nor_ray_nor_mlflow():
    import json

    res = subprocess.run([sys.executable, "-c", LIGHT_DRIVER, json.dumps(REFUSED_LIGHT)], capture_output=True,
                         text=True, timeout=300, cwd=ROOT)
    assert res.returncode == 0, res.stderr
    for args, code, err, loaded in json.loads(res.stdout.splitlines()[-1]):  # the last line: after any banner
        assert code == 2 and err.startswith("error: ") and len(err.strip().splitlines()) == 1, (args, err)
        assert loaded == [], f"{' '.join(args)} loaded {loaded} before its line: {err}"


def test_the_default_preset_is_told_from_torchs_version_file_without_importing_torch():
    import torch

    from pipeline.config import _torch_version_text, default_preset, torch_build_has_gpu

    cpu = "cuda: Optional[str] = None\nhip: Optional[str] = None\n"
    assert not torch_build_has_gpu(cpu)
    assert torch_build_has_gpu("cuda: Optional[str] = '12.8'\nhip: Optional[str] = None\n")
    assert torch_build_has_gpu("cuda: Optional[str] = None\nhip: Optional[str] = '6.2.41133'\n")  # ROCm: torch.cuda
    assert torch_build_has_gpu("__version__ = '9.0'\n") and torch_build_has_gpu(None)  # unknown: torch is asked
    # on this machine: the same answer as torch's own
    assert default_preset() == ("gpu" if torch.cuda.is_available() else "cpu")
    assert torch_build_has_gpu(_torch_version_text()) == (torch.version.cuda is not None or torch.version.hip
                                                           is not None)


def test_no_ray_with_a_context_degree_gets_advice_that_is_itself_taken(tmp_path):
    """`train --no-ray --train.context_parallel_degree=2` names --no-ray and what to run instead; that command line
    (Ray Train on 2 workers) is accepted, where the old advice (--no-ray --ray.num_workers=2) was refused in turn."""
    from pipeline.cli.unused_settings import settle_fields
    from pipeline.config import load_config

    res = run_cli("train", "--no-ray", "--train.context_parallel_degree=2", "--preset", "test",
                  f"--run.root={tmp_path}")
    assert one_error_line(res) == ("error: train.context_parallel_degree=2 splits each row over 2 workers, and --no-ray "
                                   "trains in one process; drop --no-ray and train on Ray with --ray.num_workers=2 (or "
                                   "a multiple of it), or set train.context_parallel_degree=1")
    assert not any(tmp_path.iterdir())  # refused: no run directory
    typed = {"train.context_parallel_degree": 2, "ray.num_workers": 2}
    cfg = load_config("test", typed)
    assert settle_fields("train", typed, cfg, no_ray=False)[0].train.context_parallel_degree == 2


@pytest.mark.parametrize("how", ["preset", "phases"])
def test_a_later_phase_that_splits_rows_is_refused_with_no_ray_before_the_first_step(tmp_path, how):
    """A phase with train.context_parallel_degree > 1 under --no-ray is refused before the first phase trains (it
    used to train phase 0 to its end, prepare again, and only then fail), and before the run's directory is made."""
    root = tmp_path / "runs"
    if how == "preset":
        args, where = ["--preset", "long-131k"], "preset long-131k: phase 1"
    else:
        phases = tmp_path / "phases.yaml"
        phases.write_text("- {steps: 4}\n- {steps: 4, overrides: {train.context_parallel_degree: 2, "
                          "data.seq_len: 64}}\n")
        args, where = ["--preset", "test", "--phases", str(phases)], f"--phases {phases}: phase 1"
    res = run_cli("train", "--no-ray", *args, f"--run.root={root}")
    line = one_error_line(res)
    assert line.startswith(f"error: {where} overrides: train.context_parallel_degree=") and "drop --no-ray" in line
    assert "==> train" not in res.stdout and "==> prepare" not in res.stdout
    assert not root.exists() or not any(root.glob("*/run.json"))
