"""pipeline/storage.py and pipeline/data/builds.py without a server: locations, globs, the storage root and what a
cleanup may remove (the object-storage end to end is tests/pipeline/test_object_storage.py)."""
from __future__ import annotations

import os
import subprocess
import sys
import time

from pipeline import storage
from pipeline.config import load_config
from pipeline.data.builds import LEASE_TTL_S, Build, machine_id, remove_stale, removable
from pipeline.data.shards import MANIFEST_FILE


def test_locations_join_and_glob_like_paths(tmp_path):
    assert storage.join("s3://b/p/", "datasets", "ab") == "s3://b/p/datasets/ab"
    assert storage.join(str(tmp_path), "x") == str(tmp_path / "x")
    assert storage.is_uri("file:///x") and storage.is_local("file:///x") and not storage.is_uri("/x")
    assert not storage.is_uri("C:/x")  # a drive letter is no scheme
    regex = storage._glob_regex
    assert regex("c/*.jsonl".split("/")).fullmatch("c/a.jsonl") and not regex(["c", "*.jsonl"]).fullmatch("c/d/a.jsonl")
    assert regex("c/**/x.json".split("/")).fullmatch("c/x.json") and regex("c/**/x.json".split("/")).fullmatch("c/d/e/x.json")
    assert regex("c/[!a]?.txt".split("/")).fullmatch("c/bz.txt") and not regex("c/[!a]?.txt".split("/")).fullmatch("c/az.txt")
    for name in ("a/1.txt", "a/b/2.txt", "a/b/3.md"):
        storage.write_text(storage.join(f"file://{tmp_path}", name), name)
    assert storage.read_text(f"file://{tmp_path}/a/b/2.txt") == "a/b/2.txt"
    assert [p.rsplit("/", 1)[1] for p in storage.glob(str(tmp_path / "a" / "**" / "*.txt"))] == ["1.txt", "2.txt"]


def test_one_storage_root_places_everything_and_each_place_can_be_set_apart(tmp_path, monkeypatch):
    cfg = load_config("test", {"run.root": str(tmp_path)})
    run_dir = tmp_path / "r1"
    assert storage.dataset_store(cfg) == str(tmp_path / "datasets")  # a laptop: all under run.root, as before
    assert storage.ray_storage(cfg, run_dir) == str(run_dir / "ray") and storage.artifact_location(cfg) == ""
    monkeypatch.setenv(storage.STORAGE_ENV, "s3://bkt/lt")
    cfg = storage.pin(cfg)
    assert cfg.run.storage == "s3://bkt/lt"  # recorded, shipped to workers that lack this environment
    assert storage.dataset_store(cfg) == "s3://bkt/lt/datasets" and storage.artifact_location(cfg) == "s3://bkt/lt/mlartifacts"
    assert storage.ray_storage(cfg, run_dir) == "s3://bkt/lt/r1/ray"
    assert storage.run_storage(cfg, tmp_path / "tune" / "sw" / "trials" / "t1") == "s3://bkt/lt/tune/sw/trials/t1"
    apart = cfg.replace({"data.dataset_store": "gs://other/ds", "ray.storage_path": "s3://ckpt/x",
                         "tracking.artifact_location": "s3://art"})
    assert (storage.dataset_store(apart), storage.ray_storage(apart, run_dir), storage.artifact_location(apart)) == \
        ("gs://other/ds", "s3://ckpt/x", "s3://art")


def test_a_build_is_removed_only_when_nothing_can_still_need_it():
    now = time.time()
    me = {"machine": machine_id(), "pid": os.getpid(), "pid_start": _start(os.getpid()), "time": now}
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    assert removable(None, "k", now)  # no lease: a build half removed already
    assert not removable({**me, "state": "running"}, "k", now)  # a live prepare on this machine
    assert removable({**me, "state": "running", "pid": int(gone.stdout)}, "k", now)  # its process is gone
    assert not removable({**me, "state": "running", "machine": "elsewhere"}, "k", now)  # elsewhere: only the TTL
    assert removable({**me, "state": "running", "machine": "elsewhere"}, "k", now + LEASE_TTL_S + 1)
    assert not removable({**me, "state": "finished", "key": "k"}, "k", now)  # may have just won a race
    assert removable({**me, "state": "finished", "key": "k"}, "k", now + LEASE_TTL_S + 1)
    assert removable({**me, "state": "finished", "key": "old"}, "k", now)  # another dataset's, retired


def test_cleanup_keeps_the_published_and_the_live_build_and_removes_the_rest(tmp_path):
    out = str(tmp_path / "ds")
    live = Build(out, "k")  # this process: alive
    try:
        storage.write_text(storage.join(live.dir, "train-00000.parquet"), "x")
        storage.write_text(storage.join(out, "build-dead", "train-00000.parquet"), "x")
        storage.write_text(storage.join(out, "train-00000.parquet"), "an old layout's shard, named by no manifest")
        assert sorted(remove_stale(out)) == ["build-dead", "train-00000.parquet"]
        assert sorted(os.listdir(out)) == sorted([live.name, live.name + ".lease"])
        assert not storage.exists(storage.join(out, MANIFEST_FILE))
    finally:
        live.abandon()
    assert os.listdir(out) == []


def _start(pid: int) -> float:
    import psutil

    return psutil.Process(pid).create_time()


def test_the_s3_endpoint_comes_from_where_the_aws_sdks_look(tmp_path, monkeypatch):
    """AWS_ENDPOINT_URL_S3, then AWS_ENDPOINT_URL, then the profile's endpoint_url in the config file (its
    `services` section's s3 entry before the profile's own), none when AWS_IGNORE_CONFIGURED_ENDPOINT_URLS."""
    for k in (*storage.ENDPOINT_ENVS, "AWS_PROFILE", "AWS_DEFAULT_PROFILE", "AWS_IGNORE_CONFIGURED_ENDPOINT_URLS"):
        monkeypatch.delenv(k, raising=False)
    config = tmp_path / "config"
    config.write_text("[default]\nendpoint_url = http://default-store:9000\n\n"
                      "[profile lab]\nendpoint_url = http://lab-any:9000\nservices = lab-services\n\n"
                      "[services lab-services]\ns3 =\n  endpoint_url = http://lab-s3:8333\n")
    monkeypatch.setenv("AWS_CONFIG_FILE", str(config))
    assert storage.endpoint() == "http://default-store:9000"
    monkeypatch.setenv("AWS_PROFILE", "lab")
    assert storage.endpoint() == "http://lab-s3:8333"
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://env-any:9000")
    assert storage.endpoint() == "http://env-any:9000"
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", "http://env-s3:9000")
    assert storage.endpoint() == "http://env-s3:9000"
    for k in storage.ENDPOINT_ENVS:
        monkeypatch.delenv(k)
    monkeypatch.setenv("AWS_IGNORE_CONFIGURED_ENDPOINT_URLS", "true")
    assert storage.endpoint() == ""
    monkeypatch.delenv("AWS_IGNORE_CONFIGURED_ENDPOINT_URLS")
    monkeypatch.setenv("AWS_PROFILE", "no-such-profile")  # the credential lookup names a missing profile, not this
    assert storage.endpoint() == ""
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "absent"))
    assert storage.endpoint() == ""
