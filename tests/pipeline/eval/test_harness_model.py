"""longtrain's lm-evaluation-harness model (pipeline/eval/harness_model.py) against the harness's own Hugging Face
backend on the same tiny model exported: a local multiple-choice task and a local perplexity task (the ones made
from the dataset's held-out documents) give the same acc and acc_norm and log-likelihoods within 1e-4 (per scored
token for the rolling windows' sums). Also: contexts are run once for all their choices, long inputs are truncated
from the left as the HF backend does, the resonance family answers the same as its own plain forward, and a task
that cannot be scored is a FAILED line for that task alone.

One checkpoint (nano, 12 steps, no Ray) and its export serve every test of the module.
"""
from __future__ import annotations

import math

import pytest
import torch

pytest.importorskip("lm_eval")  # the eval extra; the dev extra installs it

pytestmark = pytest.mark.system


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(loaded checkpoint, tokenizer, Hugging Face export dir, the two builtin task configs)."""
    from pipeline.data.shards import dataset_tokenizer
    from pipeline.eval.builtin_tasks import builtin_task_config
    from pipeline.eval.harness_tasks import quiet_harness
    from pipeline.train.handoff.hf_export import export_checkpoint
    from pipeline.train.handoff.loaded_checkpoint import load_for_eval
    from pipeline.train.local import train_local
    from tests.pipeline.train.hf_helpers import build_dataset

    root = tmp_path_factory.mktemp("harness")
    cfg, ds = build_dataset(root / "data", seq_len=256)
    ckpt, _ = train_local(cfg.replace({"train.max_steps": 12, "train.checkpoint_every": 12, "train.eval_every": 12}),
                          ds, root / "run", None)
    loaded = load_for_eval(ckpt)
    tokenizer = dataset_tokenizer(loaded.dataset_dir, manifest=loaded.manifest)
    quiet_harness()
    tasks = {name: builtin_task_config(name, loaded.dataset_dir, loaded.manifest, tokenizer)
             for name in ("builtin_cloze", "builtin_docs")}
    return loaded, tokenizer, export_checkpoint(ckpt, root / "hf").out_dir, tasks


def _models(tiny, max_length: int):
    from lm_eval.models.huggingface import HFLM

    from pipeline.eval.harness_model import LongtrainLM

    loaded, tokenizer, hf_dir, _ = tiny
    ours = LongtrainLM(loaded.engine.module.decoder, tokenizer, max_length)
    theirs = HFLM(pretrained=str(hf_dir), backend="causal", add_bos_token=False, prefix_token_id=tokenizer.eos_id,
                  max_length=max_length, batch_size=8, device="cpu", dtype="float32")
    return ours, theirs


def _instances(config: dict, limit: int | None = None):
    from lm_eval.tasks import TaskManager

    (task,) = TaskManager(include_defaults=False).load([config])["tasks"].values()
    task.build_all_requests(limit=limit, rank=0, world_size=1)
    return task.instances


@pytest.mark.parametrize("max_length", [256, 96])  # 96: contexts truncated from the left
def test_multiple_choice_scores_equal_the_hf_backends(tiny, max_length):
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    ours, theirs = _models(tiny, max_length)
    config = tiny[3]["builtin_cloze"]
    instances = _instances(config)
    assert len(instances) >= 40 and len({i.doc_id for i in instances}) * 4 == len(instances)
    if max_length < 256:  # the inputs really are longer than the model's length
        assert max(len(ours.tok_encode(i.args[0] + i.args[1])) for i in instances) > max_length + 1
    a, b = ours.loglikelihood(instances), theirs.loglikelihood(instances)
    assert max(abs(x[0] - y[0]) for x, y in zip(a, b)) < 1e-4
    assert [x[1] for x in a] == [y[1] for y in b]
    assert ours.forwards <= 2 * math.ceil(len(instances) / 4)  # one context forward per question, not per choice
    runs = [simple_evaluate(model=lm, tasks=[config], task_manager=TaskManager(include_defaults=False),
                            log_samples=False, bootstrap_iters=0)["results"]["builtin_cloze"] for lm in (ours, theirs)]
    assert runs[0]["acc,none"] == runs[1]["acc,none"] and runs[0]["acc_norm,none"] == runs[1]["acc_norm,none"]


@pytest.mark.parametrize("max_length", [256, 64])  # 64: documents in several rolling windows
def test_perplexity_scores_equal_the_hf_backends(tiny, max_length):
    ours, theirs = _models(tiny, max_length)
    instances = _instances(tiny[3]["builtin_docs"])
    assert len(instances) >= 8
    a, b = ours.loglikelihood_rolling(instances), theirs.loglikelihood_rolling(instances)
    tokens = [len(ours.tok_encode(i.args[0])) for i in instances]
    assert max(tokens) > max_length  # some documents take several windows
    per_token = [abs(x - y) / n for x, y, n in zip(a, b, tokens)]
    assert max(per_token) < 1e-4, per_token


def test_greedy_generation_equals_the_hf_backends(tiny):
    """generate_until: greedy, cut at the stop string; contexts of several lengths in one batch (left-padded)."""
    from lm_eval.api.instance import Instance

    ours, theirs = _models(tiny, 256)
    texts = [json_line["context"] for json_line in _items(tiny[3]["builtin_cloze"])[:6]]
    requests = [Instance("generate_until", {}, (t[:40 + 25 * i], {"until": ["."], "max_gen_toks": 12}), i)
                for i, t in enumerate(texts)]
    got, want = ours.generate_until(requests), theirs.generate_until(requests)
    assert got == want and any(got)


def _items(config: dict) -> list[dict]:
    import json

    path = config["dataset_kwargs"]["data_files"]["test"]
    with open(path) as f:
        return [json.loads(line) for line in f]


def test_the_resonance_family_answers_as_its_own_plain_forward(tiny):
    """The shared-context path (a cache copied per choice) of a resonance model equals scoring each request by a
    plain forward over context + continuation."""
    import torch.nn.functional as F

    from model.decoder import build_model
    from pipeline.eval.harness_model import LongtrainLM

    loaded, tokenizer, _, tasks = tiny
    torch.manual_seed(0)
    model = build_model("nano", loaded.manifest.vocab_size, mixer="resonance").eval()
    lm = LongtrainLM(model, tokenizer, 256)
    instances = _instances(tasks["builtin_cloze"], limit=6)
    got = lm.loglikelihood(instances)
    for inst, (score, _) in zip(instances, got):
        ctx, cont = lm._encode_pair(*inst.args)
        ids = torch.tensor([ctx + cont])
        with torch.no_grad():
            logits = F.linear(model(ids[:, :-1]), model.output_weight)
        want = float(F.log_softmax(logits[0, len(ctx) - 1:], -1).gather(1, ids[0, len(ctx):, None]).sum())
        assert abs(score - want) < 1e-4


def test_a_task_that_cannot_be_scored_fails_alone(tiny, tmp_path):
    from pipeline.eval.harness_tasks import TaskSpec, resolve_tasks, score_tasks
    from pipeline.tracking.names import task_metric, task_status_tag

    loaded, tokenizer, _, tasks = tiny
    ours, _ = _models(tiny, 256)
    broken = tmp_path / "broken.yaml"
    broken.write_text("task: broken_local\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: "
                      f"{tmp_path / 'missing.jsonl'}\ntest_split: test\noutput_type: multiple_choice\n"
                      "doc_to_text: q\ndoc_to_choice: c\ndoc_to_target: 0\n")
    specs = resolve_tasks(f"builtin_cloze,{broken}", loaded.dataset_dir, loaded.manifest, tokenizer)
    lines: list[str] = []
    report = score_tasks(ours, specs + [TaskSpec("not_a_task_anywhere", "not_a_task_anywhere")], limit=8, step=12,
                         echo=lines.append)
    assert set(report.failures) == {"broken_local", "not_a_task_anywhere"}
    assert len(lines) == 2 and all("FAILED" in line and "\n" not in line for line in lines)
    assert task_metric("builtin_cloze", "acc") in report.metrics()
    assert report.tags()[task_status_tag("broken_local")].startswith("FAILED at step 12")
    assert report.tags()[task_status_tag("builtin_cloze")] == "ok at step 12"
