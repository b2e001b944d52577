"""Real clusters: `ray start --head` + `ray job submit` + `ray stop`, and a two-node cluster
(ray.cluster_utils.Cluster) training with one worker per node.

Both run in their own processes. The job test runs in a private PID namespace (unshare) with its own
HOME and Ray temp dir, so `ray stop` stops that head and nothing else on the machine (for example the
test session's own Ray instance); it needs root for unshare, as CI has.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest

from tests.conftest import _free_ports

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent


def _unshare_ok() -> str | None:
    if shutil.which("unshare") is None:
        return "unshare (util-linux) is missing"
    probe = subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", "true"], capture_output=True)
    return None if probe.returncode == 0 else f"unshare --pid is not permitted: {probe.stderr.decode()[:200]}"


@pytest.mark.slow
def test_ray_job_submit_runs_the_pipeline(tmp_path):
    why = _unshare_ok()
    if why:
        pytest.fail(f"cannot isolate `ray stop` from other Ray instances: {why}")
    scratch = Path(tempfile.mkdtemp(prefix="ljob-", dir="/tmp"))  # short: Ray's socket paths have a length limit
    out = tmp_path / "out"
    # Every port this head would otherwise take at a fixed default is a free one: another Ray on this
    # machine (the test session's own, for one) already holds the dashboard agent's 52365 and the client
    # server's 10001, and a second agent that cannot bind has no job server ("No available agent").
    port, dash, agent, agent_grpc, client, metrics, env_agent = _free_ports(7)
    script = textwrap.dedent(f"""
        set -u
        export HOME={scratch}/home PATH={BIN}:$PATH
        mkdir -p "$HOME"
        # A token in $HOME/.ray makes `ray start --head` turn token authentication on; clients then say so.
        ray get-auth-token --generate > /dev/null 2>&1 || {{ echo "no auth token"; exit 4; }}
        ray start --head --port={port} --num-cpus=8 --include-dashboard=true --dashboard-host=127.0.0.1 \\
            --dashboard-port={dash} --dashboard-agent-listen-port={agent} --dashboard-agent-grpc-port={agent_grpc} \\
            --ray-client-server-port={client} --metrics-export-port={metrics} --runtime-env-agent-port={env_agent} \\
            --temp-dir={scratch}/ray --disable-usage-stats > {scratch}/start.log 2>&1 \\
            || {{ cat {scratch}/start.log; exit 3; }}
        cd {ROOT}
        export RAY_AUTH_MODE=token  # clients of a token-authenticated cluster say so
        A=http://127.0.0.1:{dash}
        # The job agent comes up a little after `ray start` returns: retry only that refusal, for 90 s at most.
        deadline=$((SECONDS + 90))
        while :; do
            timeout 420 ray job submit --address $A --working-dir . -- \\
                python pipeline/run.py --preset test --run.root={out}/runs --run.name=job --train.sample_tokens=0 \\
                > {scratch}/submit.log 2>&1
            rc=$?
            grep -q "No available agent" {scratch}/submit.log && [ $SECONDS -lt $deadline ] || break
            sleep 2
        done
        cat {scratch}/submit.log
        if [ $rc -ne 0 ]; then  # say why: the agent's own log, and the job's
            tail -n 30 {scratch}/ray/session_latest/logs/dashboard_agent.log 2>/dev/null
            ray job logs --address $A "$(ray job list --address $A 2>/dev/null | grep -o "raysubmit_[A-Za-z0-9]*" \\
                | head -n 1)" 2>/dev/null | tail -n 40
        fi
        ray job list --address $A > {scratch}/jobs.txt 2>&1
        ray stop --force > /dev/null 2>&1
        exit $rc
    """)
    try:
        proc = subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", "--kill-child", "bash", "-c", script],
                              capture_output=True, text=True, timeout=570)
        jobs = (scratch / "jobs.txt").read_text() if (scratch / "jobs.txt").exists() else ""
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    assert proc.returncode == 0, f"rc={proc.returncode} jobs={jobs!r}\n{proc.stdout[-3000:]}\n{proc.stderr[-2000:]}"
    assert "SUCCEEDED" in jobs and "succeeded" in proc.stdout
    record = json.loads((out / "runs" / "job" / "run.json").read_text())
    assert record["status"] == "finished" and record["phases_done"] == 1
    assert Path(record["checkpoint"], "model.safetensors").is_file()
    assert "compare runs in the MLflow UI" in proc.stdout and "eval/loss=" in proc.stdout


MULTI_NODE = """
import json, sys
from pathlib import Path
import ray
from ray.cluster_utils import Cluster
from pipeline.config import load_config
from pipeline.data.synthetic import write_synthetic_dataset
from pipeline.train.ray_train import run_training

out = Path(sys.argv[1])
write_synthetic_dataset(out / "ds", n_train=64, n_val=8, seq_len=32, vocab_size=128)
cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 3})
cluster.add_node(num_cpus=3)
cluster.wait_for_nodes()
ray.init(address=cluster.address)
cfg = load_config("cpu", {"model.tier": "nano", "data.seq_len": 32, "train.batch_size": 2, "train.max_steps": 6,
                          "train.eval_every": 3, "train.checkpoint_every": 3, "train.sample_tokens": 0,
                          "model.compile": "off", "ray.num_workers": 2, "ray.placement_strategy": "STRICT_SPREAD",
                          "tracking.enabled": False, "run.root": str(out)})
res = run_training(cfg, out / "ds", out / "run", audit_data=True)
nodes = {int(f.stem.split("_")[1]): {json.loads(l)["node"] for l in f.read_text().splitlines()}
         for f in (out / "run" / "data_audit").glob("rank_*.jsonl")}
print(json.dumps({"step": res.metrics["step"], "nodes": {k: sorted(v) for k, v in nodes.items()},
                  "cluster_nodes": len(ray.nodes())}))
ray.shutdown()
cluster.shutdown()
"""


@pytest.mark.slow
def test_two_node_cluster_one_worker_per_node(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-c", MULTI_NODE, str(tmp_path)], capture_output=True, text=True,
                          timeout=600, cwd=ROOT, env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["step"] == 6 and result["cluster_nodes"] == 2
    (n0,), (n1,) = result["nodes"]["0"], result["nodes"]["1"]
    assert n0 != n1, "both workers ran on the same node"
