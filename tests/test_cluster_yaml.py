"""cluster.yaml: Ray's own cluster-config validation, the properties we promise (token auth, 127.0.0.1-only
dashboard and MLflow, one S3 bucket for datasets, checkpoints and artifacts, H100 worker types, every key
commented), and a real `ray up` of its
local-provider variant: a head on 127.0.0.1 reached over SSH, a job submitted to it, then `ray down`.

    .venv/bin/python -m pytest tests/test_cluster_yaml.py -q              # ~1-2 min with the e2e test
    .venv/bin/python -m pytest tests/test_cluster_yaml.py -q -m "not system"   # validation only, seconds

The e2e test needs `sshd` and `rsync` (Debian: apt-get install openssh-server rsync) and root (to run
sshd and `unshare`); without them it is skipped with the reason. Isolation: sshd runs in its own PID and
mount namespace, with a temporary directory mounted over /root and over /tmp/ray there, so the cluster's
`ray stop` (in head_start_ray_commands and in `ray down`) only sees the test's own processes, and nothing
is written to the real home directory. The head runs cluster.yaml's own setup and start commands with
the ports, the S3 location and the venv swapped for local ones.
"""
from __future__ import annotations

import copy
import os
import re
import shutil
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import yaml

from tests.conftest import _free_ports

ROOT = Path(__file__).resolve().parents[1]
CLUSTER_YAML = ROOT / "cluster.yaml"
VENV_BIN = Path(sys.executable).parent


def _load() -> dict:
    return yaml.safe_load(CLUSTER_YAML.read_text())


def test_cluster_yaml_passes_rays_validation():
    from ray.autoscaler._private.util import prepare_config, validate_config

    prepared = prepare_config(_load())
    validate_config(prepared)  # raises jsonschema.ValidationError / ValueError when invalid
    assert prepared["head_node_type"] == "head.cpu"


def test_cluster_yaml_promises():
    cfg = _load()
    types = cfg["available_node_types"]
    head = types[cfg["head_node_type"]]["node_config"]
    assert not head["InstanceType"].startswith(("p", "g"))  # a CPU head
    gpu = {name: t for name, t in types.items() if name != cfg["head_node_type"]}
    assert {t["node_config"]["InstanceType"] for t in gpu.values()} == {"p5.4xlarge", "p5.48xlarge"}  # 1x, 8x H100
    for t in gpu.values():
        assert 0 <= t["min_workers"] <= t["max_workers"] and t["node_config"]["IamInstanceProfile"]
    assert sum(t["max_workers"] for t in gpu.values()) <= cfg["max_workers"]
    # token auth on every `ray start`, and the token shipped to every node
    starts = [c for c in cfg["head_start_ray_commands"] + cfg["worker_start_ray_commands"] if "ray start" in c]
    assert len(starts) == 2 and all("RAY_AUTH_MODE=token ray start" in c for c in starts)
    assert cfg["file_mounts"]["~/.ray/auth_token"] == "~/.ray/auth_token"
    # dashboard and MLflow bound to 127.0.0.1 only; MLflow's artifacts in the bucket
    head_cmds = " ".join(cfg["head_start_ray_commands"])
    assert "--dashboard-host=127.0.0.1" in head_cmds and "0.0.0.0" not in CLUSTER_YAML.read_text()
    assert re.search(r"mlflow server --host 127\.0\.0\.1 --port 5000", head_cmds)
    assert "--artifacts-destination $LONGTRAIN_STORAGE/mlartifacts" in head_cmds
    assert "pip install -q -e ~/longtrain" in cfg["setup_commands"][1] and cfg["file_mounts"]["~/longtrain"] == "."


def test_the_spot_gpu_type_runs_elastic_jobs():
    """gpu.1xh100.spot: spot p5.4xlarge nodes (Ray's own validation accepts the AWS spot options), whose header job
    command is an elastic range the type can hold, kept at the same global batch by every count of it; a watcher of
    AWS's interruption notice drains the node for preemption."""
    from ray.autoscaler._private.util import prepare_config, validate_config

    from pipeline.run import build_config, parse_args

    prepared = prepare_config(_load())
    validate_config(prepared)
    spot = prepared["available_node_types"]["gpu.1xh100.spot"]
    market = spot["node_config"]["InstanceMarketOptions"]
    assert market["MarketType"] == "spot" and market["SpotOptions"]["InstanceInterruptionBehavior"] == "terminate"
    assert spot["node_config"]["InstanceType"] == "p5.4xlarge" and spot["min_workers"] == 0
    watch = " ".join(spot["worker_setup_commands"])
    assert "spot/instance-action" in watch and "ray drain-node --reason=DRAIN_NODE_REASON_PREEMPTION" in watch
    header = [line.lstrip("# ").rstrip("\\ ") for line in CLUSTER_YAML.read_text().splitlines()[:20]]
    command = next(line for line in header if "--ray.num_workers=" in line and "-" in line.split("--ray.num_workers=")[1])
    args, rest = parse_args(command.split("python pipeline/run.py", 1)[1].split())
    cfg = build_config(args, rest)  # refuses a range that cannot keep the global batch
    assert cfg.ray.min_workers >= 1 and cfg.ray.num_workers <= spot["max_workers"]
    assert cfg.ray.placement_strategy != "STRICT_SPREAD"


def test_one_bucket_holds_datasets_checkpoints_and_artifacts_by_default(monkeypatch, tmp_path):
    """The one CHANGE-ME bucket, exported to every node as LONGTRAIN_STORAGE, is where a job's datasets, Ray Train
    checkpoints, run storage and MLflow artifacts go with no storage option on its command line."""
    from pipeline import storage
    from pipeline.config import load_config

    cfg = _load()
    text = "\n".join(line for line in CLUSTER_YAML.read_text().splitlines() if not line.lstrip().startswith("#"))
    buckets = set(re.findall(r"s3://[\w.\-/]+", text))
    assert buckets == {"s3://CHANGE-ME-longtrain-bucket/longtrain"}  # one bucket setting, nothing else to edit
    (bucket,) = buckets
    assert f"export {storage.STORAGE_ENV}={bucket}" in cfg["setup_commands"][0]
    head_cmds = " ".join(cfg["head_start_ray_commands"] + cfg["worker_start_ray_commands"])
    assert head_cmds.count("source ~/longtrain.env") >= 3  # every `ray start` (so every worker) and MLflow see it
    monkeypatch.setenv(storage.STORAGE_ENV, bucket)
    job = storage.pin(load_config("gpu", {"run.root": str(tmp_path)}))  # what a submitted job's session does
    run_dir = tmp_path / "gpu-run"
    assert storage.dataset_store(job) == f"{bucket}/datasets"
    assert storage.ray_storage(job, run_dir) == f"{bucket}/gpu-run/ray"
    assert storage.run_storage(job, run_dir) == f"{bucket}/gpu-run"
    assert storage.artifact_location(job) == f"{bucket}/mlartifacts"  # as the head's MLflow server: same place


def test_every_key_in_cluster_yaml_is_commented():
    """Each key carries a comment on its line or the line above (at least where it first appears)."""
    lines = CLUSTER_YAML.read_text().splitlines()
    key_re = re.compile(r"^\s*(?:-\s+)?([A-Za-z_~][\w.~/\-]*):(\s|$)")
    seen, commented = set(), set()
    for i, line in enumerate(lines):
        m = key_re.match(line)
        if line.lstrip().startswith("#") or not m:
            continue
        seen.add(m.group(1))
        if "#" in line.split(":", 1)[1] or (i and lines[i - 1].strip().startswith("#")):
            commented.add(m.group(1))
    assert len(seen) > 30 and seen == commented, sorted(seen - commented)


# ------------------------------------------------------------------------------ ray up, for real
def _missing_tools() -> str | None:
    if os.geteuid() != 0:
        return "needs root (sshd and unshare)"
    for tool in ("sshd", "ssh", "ssh-keygen", "rsync", "unshare"):
        if shutil.which(tool) is None and not Path(f"/usr/sbin/{tool}").exists():
            return f"needs {tool} (Debian: apt-get install openssh-server rsync)"
    if subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", "true"], capture_output=True).returncode:
        return "unshare --pid --mount-proc is not permitted here"
    return None


def local_variant(cfg: dict, *, key: Path, ssh_port: int, ports: dict[str, int], artifacts: Path) -> dict:
    """cluster.yaml turned into a local-provider cluster on 127.0.0.1: same setup and start commands,
    with local ports, a local artifacts directory and this venv instead of S3 and a fresh install."""
    local = copy.deepcopy(cfg)
    for k in ("available_node_types", "head_node_type", "max_workers", "cluster_synced_files"):
        local.pop(k, None)  # the local provider defines its own single node type
    local["cluster_name"] = f"longtrain-local-{os.getpid()}"
    local["provider"] = {"type": "local", "head_ip": "127.0.0.1", "worker_ips": []}
    jump = (f"ssh -i {key} -p {ssh_port} -o StrictHostKeyChecking=no -o UserKnownHostsFile=/dev/null "
            f"-o LogLevel=ERROR -W 127.0.0.1:{ssh_port} root@127.0.0.1")
    local["auth"] = {"ssh_user": "root", "ssh_private_key": str(key), "ssh_proxy_command": jump}
    local["file_mounts"] = {"~/longtrain": str(ROOT), "~/.ray/auth_token": str(Path.home() / ".ray/auth_token")}

    def swap(cmd: str) -> str:
        cmd = re.sub(r"s3://[\w.\-/]+", artifacts.as_uri(), cmd)
        for old, new in (("6379", ports["gcs"]), ("8076", ports["object"]), ("8265", ports["dashboard"]),
                         ("5000", ports["mlflow"])):
            cmd = cmd.replace(old, str(new))
        if "ray start --head" in cmd:  # default ports another Ray head on this machine may hold
            cmd += (f" --ray-client-server-port={ports['client']} --dashboard-agent-listen-port={ports['agent']}"
                    f" --num-cpus=4")
        return cmd

    setup = [swap(local["setup_commands"][0]), f"ln -sfn {VENV_BIN.parent} ~/venv"]  # the install is this venv
    local["setup_commands"] = setup
    local["head_start_ray_commands"] = [swap(c) for c in cfg["head_start_ray_commands"]]
    local["worker_start_ray_commands"] = []
    return local


@pytest.fixture
def sshd_namespace(tmp_path):
    """sshd on 127.0.0.1:<port> inside its own PID + mount namespace; /root and /tmp/ray there are temp dirs."""
    reason = _missing_tools()
    if reason:
        pytest.skip(reason)
    home, raytmp = tmp_path / "home", tmp_path / "raytmp"
    (home / ".ssh").mkdir(parents=True)
    raytmp.mkdir()
    os.chmod(home, 0o700)
    key, hostkey = tmp_path / "id_ed25519", tmp_path / "hostkey"
    for k in (key, hostkey):
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(k)], check=True)
    (home / ".ssh/authorized_keys").write_text(Path(f"{key}.pub").read_text())
    os.chmod(home / ".ssh/authorized_keys", 0o600)
    port = _free_ports(1)[0]
    conf = tmp_path / "sshd_config"
    conf.write_text(f"Port {port}\nListenAddress 127.0.0.1\nHostKey {hostkey}\nPidFile {tmp_path}/sshd.pid\n"
                    "PermitRootLogin prohibit-password\nPasswordAuthentication no\nKbdInteractiveAuthentication no\n"
                    "UsePAM no\nStrictModes no\nAuthorizedKeysFile /root/.ssh/authorized_keys\n"
                    "Subsystem sftp internal-sftp\n")
    Path("/run/sshd").mkdir(exist_ok=True)  # sshd's privilege-separation directory
    Path("/tmp/ray").mkdir(exist_ok=True)  # the mount point (Ray's default temp dir)
    sshd = shutil.which("sshd") or "/usr/sbin/sshd"
    mounts = [f"mount --bind {home} /root", f"mount --bind {raytmp} /tmp/ray"]
    python_home = Path(sys.base_prefix).resolve()
    if python_home.is_relative_to("/root"):  # e.g. pyenv's Python under /root: keep it visible
        rel = python_home.relative_to("/root")
        (home / rel).mkdir(parents=True)
        real = tmp_path / "realroot"
        real.mkdir()
        mounts = [f"mount --bind /root {real}", *mounts, f"mount --bind {real / rel} /root/{rel}"]
    inner = " && ".join(mounts + [f"exec {sshd} -D -e -f {conf}"])
    log = open(tmp_path / "sshd.log", "wb")
    # --kill-child: when this unshare process ends, the namespace's first process gets SIGKILL, and with
    # it every process of the namespace (the Ray head, MLflow, ...).
    ns = subprocess.Popen(["unshare", "--pid", "--fork", "--mount-proc", "--kill-child", "bash", "-c", inner],
                          stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 30
        while True:
            probe = subprocess.run(["ssh", "-i", str(key), "-p", str(port), "-o", "StrictHostKeyChecking=no",
                                    "-o", "UserKnownHostsFile=/dev/null", "-o", "BatchMode=yes", "-o", "LogLevel=ERROR",
                                    "root@127.0.0.1", "echo $HOME; ls /tmp/ray | wc -l"],
                                   capture_output=True, text=True, timeout=20)
            if probe.returncode == 0:
                assert probe.stdout.split() == ["/root", "0"]  # the namespace's own (empty) /tmp/ray
                break
            if ns.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"sshd did not come up: {probe.stderr}\n{(tmp_path / 'sshd.log').read_text()[-2000:]}")
            time.sleep(0.5)
        yield key, port, home
    finally:
        ns.kill()  # PR_SET_PDEATHSIG (--kill-child) takes the whole namespace down with it
        ns.wait(timeout=10)
        log.close()


def _ray(*args: str, env: dict, timeout: int = 300, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    return subprocess.run([str(VENV_BIN / "ray"), *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=timeout)


@pytest.mark.system
def test_ray_up_local_variant_job_submit_and_down(sshd_namespace, tmp_path):
    key, ssh_port, home = sshd_namespace
    names = ("gcs", "object", "dashboard", "mlflow", "client", "agent")
    ports = dict(zip(names, _free_ports(len(names))))
    artifacts = tmp_path / "artifacts"
    local = local_variant(_load(), key=key, ssh_port=ssh_port, ports=ports, artifacts=artifacts)
    cfg_path = tmp_path / "cluster-local.yaml"
    cfg_path.write_text(yaml.safe_dump(local, sort_keys=False))
    env = {**os.environ, "PATH": f"{VENV_BIN}:{os.environ['PATH']}", "RAY_AUTH_MODE": "token",
           "RAY_USAGE_STATS_ENABLED": "0"}
    env.pop("RAY_ADDRESS", None)
    # The client's token: the one this machine already has (created only if there is none).
    assert _ray("get-auth-token", "--generate", env=env, timeout=60).returncode == 0
    up = _ray("up", str(cfg_path), "-y", "--no-config-cache", env=env, timeout=400)
    try:
        assert up.returncode == 0, (up.stdout + up.stderr)[-12000:]
        # cluster.yaml's setup ran on the head: its env file, the synced project and token
        assert "export RAY_AUTH_MODE=token" in (home / "longtrain.env").read_text()
        assert (home / "longtrain/pipeline/sweep/tune.py").is_file()
        assert (home / ".ray/auth_token").read_text() == (Path.home() / ".ray/auth_token").read_text()
        dash = f"http://127.0.0.1:{ports['dashboard']}"
        with urllib.request.urlopen(f"http://127.0.0.1:{ports['mlflow']}/health", timeout=10) as r:
            assert r.status == 200  # MLflow on the head, on 127.0.0.1

        job = ("import os, urllib.request, ray; ray.init(); "
               "print('CPUS', ray.cluster_resources()['CPU']); "
               f"print('MLFLOW', urllib.request.urlopen('http://127.0.0.1:{ports['mlflow']}/health').status); "
               "import pipeline.sweep.tune, pipeline.config; print('PROJECT', pipeline.config.load_config('test').model.tier); "
               "print('AUTH', os.environ.get('RAY_AUTH_MODE'))")
        sub = _ray("job", "submit", "--address", dash, "--working-dir", str(ROOT), "--", "python", "-c", job,
                   env=env, timeout=300)
        assert sub.returncode == 0, (sub.stdout + sub.stderr)[-4000:]
        assert "CPUS 4.0" in sub.stdout and "MLFLOW 200" in sub.stdout and "PROJECT nano" in sub.stdout
        assert "AUTH token" in sub.stdout and "succeeded" in sub.stdout

        # Token auth is on: a client that sends no token is refused.
        anon = _ray("job", "list", "--address", dash, env={**env, "RAY_AUTH_MODE": "disabled"}, timeout=60)
        assert anon.returncode != 0
        assert re.search(r"401|[Uu]nauthori[sz]ed|authenticat", anon.stdout + anon.stderr)
    finally:
        down = _ray("down", str(cfg_path), "-y", env=env, timeout=180)
        for suffix in ("state", "lock"):  # the local provider's bookkeeping on this ("laptop") side
            Path(f"/tmp/ray/cluster-{local['cluster_name']}.{suffix}").unlink(missing_ok=True)
    assert down.returncode == 0, (down.stdout + down.stderr)[-3000:]
    deadline = time.monotonic() + 60  # `ray down` returns as the head's processes are told to stop
    while True:  # the head's dashboard goes away
        try:
            urllib.request.urlopen(f"{dash}/api/version", timeout=5).close()
        except OSError:
            break
        assert time.monotonic() < deadline, f"the head's dashboard {dash} still answers a minute after `ray down`"
        time.sleep(0.2)
