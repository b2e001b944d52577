"""A real cluster with no shared filesystem: `ray start --head`, a second node joining with `ray start --address`
in a mount namespace of its own where the driver's run root and dataset caches are empty tmpfs mounts,
`ray job submit` of the main job training with one worker per node on a dataset that is only in the bucket
(the session's S3 server), and `ray stop`. Any read of a driver-local path on the second node fails the job.

It runs in a private PID namespace (unshare) with its own HOME and Ray temp dir, so `ray stop` stops those
nodes and nothing else on the machine (for example the test session's own Ray instance); it needs root for
unshare, as CI has.
"""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest

from pipeline import storage
from tests.conftest import _free_ports

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
PORT_TAKEN, PORT_ATTEMPTS = 6, 3  # the script's exit code when a node lost a port it was given; starts tried


def _unshare_ok() -> str | None:
    if shutil.which("unshare") is None:
        return "unshare (util-linux) is missing"
    probe = subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", "true"], capture_output=True)
    return None if probe.returncode == 0 else f"unshare --pid is not permitted: {probe.stderr.decode()[:200]}"


@pytest.mark.system
def test_ray_job_submit_runs_the_pipeline_on_a_two_node_cluster(tmp_path, test_runs_root, s3_dataset,
                                                                  mlflow_server):
    """`ray start --head`, a second node joining it with `ray start --address` unable to see the driver's files,
    `ray job submit` of the main job with one Train worker per node (STRICT_SPREAD), then `ray stop`. The job's
    run.storage is the bucket, where the session's `test` dataset already is (found by its content hash); it
    trains, evaluates and samples on the cluster, and tracks to the session's MLflow server."""
    why = _unshare_ok()
    if why:
        pytest.fail(f"cannot isolate `ray stop` from other Ray instances: {why}")
    job_root = tmp_path / "runs"  # the driver's run root: run.json and curves only, all else in the bucket
    job_root.mkdir()
    (job_root / "CANARY").write_text("the second node must not see this")
    hidden = [job_root, test_runs_root, s3_dataset.run_root]  # the driver's run roots and local dataset cache
    masks = " && ".join(f"mount -t tmpfs tmpfs {d}" for d in hidden)
    storage_root = next(o for o in s3_dataset.overrides if o.startswith("--run.storage=")).split("=", 1)[1]
    data_args = " ".join(o for o in s3_dataset.overrides if not o.startswith("--run.root="))
    # Every port these nodes would otherwise take at a fixed default is a free one: another Ray on this
    # machine (the test session's own, for one) already holds the dashboard agent's 52365 and the client
    # server's 10001, and a second agent that cannot bind has no job server ("No available agent"). The second
    # node needs agent ports of its own too, takes its workers' ports from the OS (as ray.cluster_utils does), and
    # has a temp dir of its own, as a machine of its own would: sharing the head's, its runtime-env agent deleted
    # the job's unpacked working dir (the driver's cwd) once its Train worker no longer used it.
    # A port is free when picked, and Ray binds it a moment later: another process on the machine may take it in
    # between ("Agent port ... failed to bind"). A start that lost one exits PORT_TAKEN and starts again on fresh
    # ports, in a fresh PID namespace (the failed start's processes died with its namespace).
    for _ in range(PORT_ATTEMPTS):
        scratch = Path(tempfile.mkdtemp(prefix="ljob-", dir="/tmp"))  # short: Ray's socket paths have a limit
        (port, dash, agent, agent_grpc, client, metrics, env_agent,
         agent2, agent_grpc2, metrics2, env_agent2) = _free_ports(11)
        script = textwrap.dedent(f"""
            set -u
            export HOME={scratch}/home PATH={BIN}:$PATH
            mkdir -p "$HOME"
            LOST="already in use|failed to bind"  # what a start that lost one of its ports says
            # A token in $HOME/.ray makes `ray start --head` turn token authentication on; clients then say so.
            ray get-auth-token --generate > /dev/null 2>&1 || {{ echo "no auth token"; exit 4; }}
            ray start --head --port={port} --num-cpus=8 --include-dashboard=true --dashboard-host=127.0.0.1 \\
                --dashboard-port={dash} --dashboard-agent-listen-port={agent} --dashboard-agent-grpc-port={agent_grpc} \\
                --ray-client-server-port={client} --metrics-export-port={metrics} --runtime-env-agent-port={env_agent} \\
                --temp-dir={scratch}/ray --disable-usage-stats > {scratch}/start.log 2>&1 \\
                || {{ cat {scratch}/start.log; grep -qiE "$LOST" {scratch}/start.log && exit {PORT_TAKEN}; exit 3; }}
            export RAY_AUTH_MODE=token  # clients of a token-authenticated cluster say so
            # The second node, as a machine of its own: a mount namespace where the driver's run roots are empty.
            unshare --mount --propagation private bash -c '{masks} && test ! -e {job_root}/CANARY && \\
                exec ray start --address=127.0.0.1:{port} --num-cpus=8 --min-worker-port=0 --max-worker-port=0 \\
                --dashboard-agent-listen-port={agent2} --dashboard-agent-grpc-port={agent_grpc2} \\
                --metrics-export-port={metrics2} --runtime-env-agent-port={env_agent2} --temp-dir={scratch}/ray2 \\
                --disable-usage-stats' > {scratch}/start2.log 2>&1 || {{ cat {scratch}/start2.log; ray stop --force > /dev/null 2>&1
                    grep -qiE "$LOST" {scratch}/start2.log && exit {PORT_TAKEN}; exit 5; }}
            cd {ROOT}
            A=http://127.0.0.1:{dash}
            # The job agent comes up a little after `ray start` returns: retry only that refusal, for 90 s at most.
            deadline=$((SECONDS + 90))
            while :; do
                timeout 420 ray job submit --address $A --working-dir . -- \\
                    python pipeline/run.py --preset test {data_args} --run.root={job_root} --run.name=job \\
                    --tracking.tracking_uri={mlflow_server[0]} --tracking.experiment=cluster \\
                    --ray.num_workers=2 --ray.placement_strategy=STRICT_SPREAD --audit-data \\
                    > {scratch}/submit.log 2>&1
                rc=$?
                grep -q "No available agent" {scratch}/submit.log || break
                if grep -qs "failed to bind" {scratch}/ray/session_latest/logs/dashboard_agent.log \\
                        {scratch}/ray2/session_latest/logs/dashboard_agent.log; then
                    echo "a node's dashboard agent lost its port; starting again on fresh ports"
                    ray stop --force > /dev/null 2>&1
                    exit {PORT_TAKEN}
                fi
                [ $SECONDS -lt $deadline ] || break
                sleep 2
            done
            cat {scratch}/submit.log
            if [ $rc -ne 0 ]; then  # say why: the agent's own log, and the job's
                tail -n 30 {scratch}/ray/session_latest/logs/dashboard_agent.log 2>/dev/null
                ray job logs --address $A "$(ray job list --address $A 2>/dev/null | grep -o "raysubmit_[A-Za-z0-9]*" \\
                    | head -n 1)" 2>/dev/null | tail -n 40
            fi
            ray job list --address $A > {scratch}/jobs.txt 2>&1
            ray list nodes --address $A --format json > {scratch}/nodes.json 2>/dev/null
            ray stop --force > /dev/null 2>&1
            exit $rc
        """)
        try:
            proc = subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", "--kill-child", "bash", "-c", script],
                                  capture_output=True, text=True, timeout=570)
            jobs = (scratch / "jobs.txt").read_text() if (scratch / "jobs.txt").exists() else ""
            nodes_json = (scratch / "nodes.json").read_text() if (scratch / "nodes.json").exists() else "[]"
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
        if proc.returncode != PORT_TAKEN:
            break
    assert proc.returncode == 0, f"rc={proc.returncode} jobs={jobs!r}\n{proc.stdout[-3000:]}\n{proc.stderr[-2000:]}"
    assert "SUCCEEDED" in jobs and "succeeded" in proc.stdout
    run_dir = job_root / "job"
    record = json.loads((run_dir / "run.json").read_text())
    assert record["status"] == "finished" and record["phases_done"] == 1
    assert record["checkpoint"].startswith(f"{storage_root}/job/ray/phase0/checkpoint_")
    assert storage.is_file(storage.join(record["checkpoint"], "model.safetensors"))
    assert "compare runs in the MLflow UI" in proc.stdout and "eval/loss=" in proc.stdout
    assert record["datasets"] == [s3_dataset.dataset]  # the bucket's, found by its content hash
    assert {p.name for p in job_root.iterdir()} == {"CANARY", "job"}  # no dataset, no checkpoint on the driver
    # One Train worker per node: each rank's audit (in the bucket) names the node it ran on, both of the nodes.
    alive = {n["node_id"] for n in json.loads(nodes_json) if n.get("state") == "ALIVE"}
    audits = storage.glob(f"{storage_root}/job/data_audit/rank_*.jsonl")
    per_rank = {int(a.rsplit("_", 1)[1].split(".")[0]): {json.loads(ln)["node"] for ln in
                                                         storage.read_text(a).splitlines() if ln.strip()}
                for a in audits}
    assert sorted(per_rank) == [0, 1], per_rank
    (n0,), (n1,) = per_rank[0], per_rank[1]
    assert n0 != n1, "both workers ran on the same node"
    assert len(alive) == 2 and {n0, n1} == alive, (alive, per_rank)
