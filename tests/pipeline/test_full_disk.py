"""A disk that fills up, for real: a tmpfs the test mounts (root) as the run root, the dataset store or the export's
folder, sized to fill at a known write. Each command ends in one `error:` line naming the path, the bytes and the fix,
nothing is lost, and after the tmpfs is enlarged (`mount -o remount,size=`) the same command finishes: `--resume`
continues from the last complete checkpoint with the losses of a run that never stopped, `prepare` builds the
dataset, `export` writes the model. The injected cases (ENOSPC raised in the quick tier) are
tests/pipeline/test_disk_space.py.

    sudo .venv/bin/python -m pytest -q tests/pipeline/test_full_disk.py
"""
from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

import pytest

pytestmark = [pytest.mark.system,
              pytest.mark.skipif(os.geteuid() != 0, reason="mounting a small tmpfs needs root (mount -t tmpfs)")]


class SmallDisk:
    """A tmpfs of `size` at `path`; resize() enlarges it in place (what freeing space does), umount at the end."""

    def __init__(self, path: Path, size: str):
        self.path = path
        path.mkdir(parents=True)
        subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0755", "tmpfs", str(path)], check=True)

    def resize(self, size: str) -> None:
        subprocess.run(["mount", "-o", f"remount,size={size}", str(self.path)], check=True)

    def umount(self) -> None:
        subprocess.run(["umount", "-l", str(self.path)], check=False)


@pytest.fixture
def small_disk(tmp_path):
    disks: list[SmallDisk] = []

    def make(name: str, size: str) -> SmallDisk:
        disks.append(SmallDisk(tmp_path / name, size))
        return disks[-1]

    try:
        subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(tmp_path)], check=True,
                       capture_output=True)
        subprocess.run(["umount", str(tmp_path)], check=True)
    except (subprocess.CalledProcessError, FileNotFoundError) as exc:
        pytest.skip(f"this machine does not let the test mount a tmpfs ({exc})")
    yield make
    for disk in disks:
        disk.umount()


@pytest.fixture(scope="module")
def common(files_dataset, mlflow_server) -> list[str]:
    """The session's files dataset (prepared elsewhere) and MLflow server: the tmpfs holds the run's own files."""
    return ["--preset", "test", *files_dataset.overrides, "--train.sample_tokens=0", "--train.max_steps=16",
            "--train.checkpoint_every=4", "--train.log_every=1", "--train.eval_every=8",
            f"--tracking.tracking_uri={mlflow_server[0]}", "--tracking.experiment=full-disk",
            "--tracking.system_metrics=false"]


def _main(args: list[str], capfd) -> tuple[int, str, str]:
    from pipeline.run import main

    code = main(args)
    out, err = capfd.readouterr()
    assert "Traceback" not in out + err, out + err
    return code, out, err


def _losses(mlflow_uri: str, run_dir: Path) -> dict[int, float]:
    from mlflow.tracking import MlflowClient

    run_id = json.loads((run_dir / "run.json").read_text())["mlflow_run_id"]
    return {m.step: m.value for m in MlflowClient(mlflow_uri).get_metric_history(run_id, "train/loss")}


def test_a_run_whose_disk_fills_at_its_third_checkpoint_says_so_keeps_the_two_and_resumes_exactly(
        common, small_disk, mlflow_server, tmp_path, capfd):
    disk = small_disk("disk", "4600k")  # two checkpoints of ~1.7 MB, and the run's record; not a third
    root = disk.path / "runs"
    code, out, err = _main(["train", "--no-ray", *common, f"--run.root={root}", "--run.name=full"], capfd)
    ckpts = root / "full" / "checkpoints" / "phase0"
    assert code == 2, out + err
    line = err.strip().splitlines()[-1]
    assert re.fullmatch(rf"error: no space left on {disk.path} for checkpoint {ckpts / 'step_000012'} \(needs ~1\.\d "
                        rf"MiB, \d+\.\d KiB free of 4\.5 MiB\); free space there, or point run\.root \(or "
                        rf"ray\.storage_path\) at a larger disk, or lower train\.keep_checkpoints; then continue with "
                        rf"--resume", line), err
    warning = next(ln for ln in out.splitlines() if ln.startswith("warning: "))
    assert out.index(warning) < out.index("train nano  step 1/16")  # before the first step
    assert re.match(rf"warning: {disk.path} has \d\.\d MiB free, and 2 checkpoint\(s\) kept "
                    rf"\(train\.keep_checkpoints\) and the one being written need room for 3 of ~1\.\d MiB", warning), \
        warning
    # nothing lost: the two complete checkpoints, no partial one, the record readable
    assert sorted(p.name for p in ckpts.iterdir()) == ["step_000004", "step_000008"]
    assert json.loads((root / "full" / "run.json").read_text())["status"] == "failed"
    # validate RUN takes the checkpoint --resume continues from
    code, out, err = _main(["validate", "full", f"--run.root={root}"], capfd)
    assert code == 0 and (f"checkpoint {ckpts / 'step_000008'} is whole: every recorded file matches meta.json, and "
                          "it loads") in out.strip().splitlines(), out + err  # then the run's spikes line
    code, out, _ = _main(["runs", f"--run.root={root}"], capfd)
    assert "full  failed   8/16" in out and str(ckpts / "step_000008") in out, out

    disk.resize("64m")  # space freed
    code, out, err = _main(["train", "--no-ray", "--resume", "full", f"--run.root={root}"], capfd)
    assert code == 0, out + err
    assert "steps 8..16 (resumed at step 8)" in out, out
    assert not [ln for ln in out.splitlines() if ln.startswith("warning: ")], out
    code, out, err = _main(["train", "--no-ray", *common, f"--run.root={tmp_path / 'ref'}", "--run.name=ref"], capfd)
    assert code == 0, out + err
    resumed, never_stopped = _losses(mlflow_server[0], root / "full"), _losses(mlflow_server[0], tmp_path / "ref" / "ref")
    assert sorted(resumed) == list(range(1, 17)) and sorted(never_stopped) == list(range(1, 17))
    assert {s: resumed[s] for s in range(9, 17)} == {s: never_stopped[s] for s in range(9, 17)}  # bit for bit

    # the model leaves as a Hugging Face folder: onto a disk too small for it, one line and nothing half-written
    out_disk = small_disk("export", "256k")
    code, out, err = _main(["export", "--resume", str(root / "full"), "--out", str(out_disk.path / "hf")], capfd)
    assert code == 2, out + err
    assert err.strip().splitlines()[-1].startswith(f"error: no space left on {out_disk.path} for the export "
                                                   f"{out_disk.path / 'hf'} (needs ~"), err
    assert err.strip().endswith("free space there, or pass --out a folder on a larger disk; then export again"), err
    assert list(out_disk.path.iterdir()) == []
    out_disk.resize("16m")
    code, out, err = _main(["export", "--resume", str(root / "full"), "--out", str(out_disk.path / "hf")], capfd)
    assert code == 0 and (out_disk.path / "hf" / "model.safetensors").is_file(), out + err


def test_a_prepare_whose_store_fills_says_so_leaves_no_dataset_and_finishes_when_run_again(files_dataset, small_disk,
                                                                                           tmp_path, capfd):
    store = small_disk("store", "64k")  # the session's files dataset takes ~200 KB
    args = ["prepare", "--preset", "test", *files_dataset.overrides, f"--data.dataset_store={store.path}",
            f"--run.root={tmp_path / 'runs'}"]
    code, out, err = _main(args, capfd)
    assert code == 2, out + err
    line = err.strip().splitlines()[-1]
    assert line.startswith(f"error: no space left on {store.path} for the dataset {store.path}/"), err
    assert line.endswith("free space there, or point data.dataset_store (or run.storage) at a larger disk; then run "
                         "it again"), err
    dataset = Path(line.split(" for the dataset ", 1)[1].split(" ", 1)[0])
    assert not (dataset / "manifest.json").exists()
    assert not [p for p in dataset.iterdir() if p.name.startswith("build-")], list(dataset.iterdir())  # abandoned
    store.resize("16m")
    code, out, err = _main(args, capfd)
    assert code == 0 and (dataset / "manifest.json").is_file(), out + err
    code, out, err = _main(["validate", str(dataset)], capfd)
    assert code == 0, out + err


def test_an_mlflow_store_on_a_full_disk_is_one_line_naming_it(files_dataset, small_disk, capfd):
    """The embedded store (SQLite under run.root) cannot even create its tables: one line naming mlflow.db."""
    disk = small_disk("mlflow", "96k")
    root = disk.path / "runs"
    code, out, err = _main(["train", "--no-ray", "--preset", "test", *files_dataset.overrides, f"--run.root={root}",
                            "--train.max_steps=2", "--tracking.system_metrics=false", "--run.name=m"], capfd)
    assert code == 2, out + err
    line = err.strip().splitlines()[-1]
    assert line.startswith(f"error: no space left on {disk.path} for MLflow's ") and f" {root}/mlflow.db (" in line \
        and line.endswith("point tracking.tracking_uri (or run.root) at a larger disk; then continue with --resume"), err


def test_a_ray_train_fsdp_run_whose_disk_fills_ends_at_once_and_validate_finds_its_last_sharded_checkpoint(
        files_dataset, small_disk, ray_address, tmp_path, capfd):
    """Two FSDP workers write sharded checkpoints into Ray Train's storage on the tmpfs: the third fills it. The run
    ends on the first attempt (Ray Train does not retry a full disk: each retry would redo the steps and fill it
    again), the partial folder is removed, and `validate RUN` finds the step-8 checkpoint Ray Train holds."""
    disk = small_disk("ray", "5200k")
    root = disk.path / "runs"
    code, out, err = _main(["train", "--preset", "test", *files_dataset.overrides, f"--run.root={root}",
                            "--run.name=fsdp", "--ray.address=" + ray_address, "--ray.num_workers=2",
                            "--train.parallel=fsdp", "--train.max_steps=16", "--train.checkpoint_every=4",
                            "--train.sample_tokens=0", "--tracking.enabled=false"], capfd)
    assert code == 2, out + err
    folder = root / "fsdp" / "ray" / "phase0"
    assert re.fullmatch(rf"error: no space left on {disk.path} for checkpoint {folder}/checkpoint_\S+ \(\d+\.\d "
                        rf"KiB free of 5\.1 MiB\); free space there, .* then continue with --resume",
                        err.strip().splitlines()[-1]), err
    assert "restart:" not in out + err and "resume:" not in out + err, out + err  # one attempt
    assert "the run ends: another attempt would fill it again" in out + err or "storage:" not in out + err
    names = sorted(p.name for p in folder.iterdir() if p.is_dir() and p.name.startswith("checkpoint_"))
    assert len(names) == 2, names  # steps 4 and 8, the partial third removed
    code, out, err = _main(["validate", "fsdp", f"--run.root={root}"], capfd)
    assert code == 0 and "step 8, layout sharded" in out and (
        f"checkpoint {folder / names[-1]} is whole: every recorded file matches meta.json, and it loads"
    ) in out.strip().splitlines(), out + err  # then the run's spikes line



def test_a_bucket_over_its_quota_refuses_a_checkpoint_in_one_line_and_never_holds_it_complete(s3_bucket, tmp_path):
    """A real S3 server's bucket over its quota (SeaweedFS: bench/s3_server.py set_quota) refuses the upload of a
    checkpoint (pipeline/train/checkpoints/index.py publish, Ray Train's upload): one line naming the file, the store
    and the quota, the checkpoint never complete (no meta.json: --resume and validate pass it by); once the quota is
    lifted, the same upload completes. SeaweedFS answers a bare 500 (no word of quota), so the line comes after the
    retry window and names the quota as a cause to check; a store that says "QuotaExceeded" (Ceph, MinIO) ends at once
    in pipeline/disk_space.py's line (tests/pipeline/test_disk_space.py)."""
    import torch

    from pipeline.storage import StorageError
    from pipeline.train.checkpoints.index import incomplete, publish
    from pipeline.train.engine import Engine
    from pipeline.train.checkpoints.local_dir import LocalCheckpoints
    from tests.conftest import S3
    from tests.pipeline.train.test_engine import VOCAB, make_cfg

    local = LocalCheckpoints(tmp_path, keep=1).save(Engine(make_cfg(), VOCAB, torch.device("cpu")))
    bucket = S3.create_bucket("over-quota")
    location = f"{bucket}/run/ray/phase0/checkpoint_2026-11-28_12-00-00.000000"
    S3.set_quota("over-quota", size_mb=1)
    try:
        with pytest.raises(StorageError) as refused:
            publish(local, location, window_s=2)
        line = str(refused.value)
        assert "\n" not in line and line.startswith("checkpoint file ") and f" could not be published to {location} (" \
            in line and "with a server error" in line and "its free space and the bucket's quota" in line, line
        assert line.endswith("the checkpoint is not registered"), line
        assert incomplete(location) is not None  # never counted as complete
    finally:
        S3.clear_quota("over-quota")
    publish(local, location, window_s=30)
    assert incomplete(location) is None
