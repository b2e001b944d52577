"""Losing a node is not losing the run, across separate hosts on one machine (tests/pipeline/hosts.py): three
network namespaces with their own mount, PID and UTS namespaces, each hostname mapped to 127.0.0.1 as this
machine's /etc/hosts does. Host 1 runs an S3 server (SeaweedFS), an MLflow server and the Ray head, each listening
on host 1's address; hosts 2 and 3 are Ray worker nodes that reach them only by that address and cannot see the
driver's run root or the prepared dataset's local copy.

One elastic run (`--ray.num_workers=2-3`, DDP, Gloo) goes through, in order:
  1. host 3 killed mid-run (its link pulled, every process of it killed): the run goes on with 2 workers from the
     latest checkpoint, the global batch kept by a larger grad_accum;
  2. host 3 back (a new machine at the same address, `ray start`): the group grows back to 3 at a resize check;
  3. SIGTERM to the training worker on host 2: a checkpoint at the next step boundary, that attempt ends, the next
     starts from that very checkpoint;
and ends at the planned step, with every row of the data read once, the redone steps' losses the same as before,
and MLflow (over the network) holding train/world_size and the lost work. Without the process group bound to the
node's interface, Gloo cannot connect across these hosts at all (the first test shows both).

Needs root (ip netns, unshare, nsenter), as CI has. The test prints the run's resize lines, the steps lost and the
time to resume (`pytest -s` shows them).
"""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import sys
import textwrap
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.pipeline.hosts import MLFLOW_PORT, S3_PORT, Hosts

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
PY = str(BIN / "python")
A1 = "10.77.0.1"
BUCKET = "elastic"
STORE = f"s3://{BUCKET}/store"
MAX_STEPS, KILL_AT, CKPT_EVERY, GLOBAL_BATCH = 16, 6, 4, 24  # test preset: batch 4; 3 workers x grad_accum 2
STAGE_S = 420  # the most a stage of the run may take (a loaded 2-core machine needs ~100 s for the slowest)
NCPU, CPUS_PER_WORKER = 6, 4  # logical CPUs per host; a worker takes 4, so one worker per host, 2 left for Ray Data
pytestmark = [pytest.mark.system, pytest.mark.timeout(1800)]


@pytest.fixture(scope="module")
def hosts(tmp_path_factory, test_runs_root):
    why = Hosts.missing()
    if why:
        pytest.fail(f"separate hosts need namespaces: {why}")
    work = tmp_path_factory.mktemp("hosts")
    (work / "runs").mkdir()  # the driver's run root: on host 1's disk only
    (work / "runs" / "CANARY").write_text("hosts 2 and 3 must not see this")
    env = {"PATH": f"{BIN}:{os.environ['PATH']}", "PYTHONPATH": str(ROOT), "RAY_AUTH_MODE": "token",
           "RAY_USAGE_STATS_ENABLED": "0", "RAY_DEDUP_LOGS": "0", "OMP_NUM_THREADS": "1",
           # host 1's S3 server, by address (the session's S3 settings point at this machine's 127.0.0.1)
           "AWS_ENDPOINT_URL": f"http://{A1}:{S3_PORT}", "RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S": "30",
           "LONGTRAIN_TRAIN_HOLD": str(work / "hold")}
    h = Hosts(3, work, masked=[work / "runs", test_runs_root], env=env)
    try:
        h.start()
        for i in (1, 2, 3):
            h.boot(i)
        yield h
    finally:
        h.close()


def test_gloo_across_hosts_with_loopback_hostnames_needs_the_node_interface(hosts):
    """Each hostname resolves to 127.0.0.1: a plain Gloo group across two hosts fails (every rank announces its
    loopback address); bound by pipeline/train/distributed/node_network.py to the interface holding the node's address, the
    same group all-reduces."""
    script = textwrap.dedent("""
        import datetime, sys, torch, torch.distributed as dist
        from pipeline.train.distributed.node_network import bind_process_group
        rank, bind, port = int(sys.argv[1]), sys.argv[2] == "bind", sys.argv[3]
        if bind:
            print("interface", bind_process_group(f"10.77.0.{rank + 1}"), flush=True)
        dist.init_process_group("gloo", init_method=f"tcp://10.77.0.1:{port}", rank=rank, world_size=2,
                                timeout=datetime.timedelta(seconds=10))
        t = torch.tensor([rank + 1.0]); dist.all_reduce(t); print("sum", t.item(), flush=True)
        dist.destroy_process_group()
    """)
    procs = {(mode, r): hosts.popen(r + 1, [PY, "-c", script, str(r), mode, port], cwd=ROOT,
                                    log=hosts.workdir / f"gloo-{mode}-{r}.log")
             for mode, port in (("plain", "29511"), ("bind", "29512")) for r in (0, 1)}  # both groups at once
    for p in procs.values():
        p.wait(timeout=180)
    out = {mode: ([procs[mode, r].returncode for r in (0, 1)],
                  [(hosts.workdir / f"gloo-{mode}-{r}.log").read_text() for r in (0, 1)]) for mode in ("plain", "bind")}
    rcs, logs = out["plain"]
    assert any(rc != 0 for rc in rcs), logs
    assert any("connectFullMesh failed" in log and "Connection refused, remote=[127.0.0.1]" in log for log in logs), logs
    rcs, logs = out["bind"]
    assert rcs == [0, 0], logs
    assert all("interface eth0" in log and "sum 3.0" in log for log in logs), logs


# ------------------------------------------------------------------------------------------ the elastic run
@dataclass
class ElasticRun:
    rc: int
    lines: list[tuple[float, str]]  # (seconds since the run started, line) as the driver printed them
    events: dict[str, float] = field(default_factory=dict)  # what the test did, when
    steps: dict[str, int] = field(default_factory=dict)  # rank 0's step when the test did it
    record: dict = field(default_factory=dict)  # run.json
    audit: dict[str, str] = field(default_factory=dict)
    metrics: dict[str, list[tuple[int, float, int]]] = field(default_factory=dict)  # name: [(step, value, ts ms)]

    def find(self, pattern: str) -> list[str]:
        return [line for _, line in self.lines if re.search(pattern, line)]

    def text(self) -> str:
        return "\n".join(line for _, line in self.lines)


def _ray_start(hosts: Hosts, i: int) -> None:
    common = [f"--num-cpus={NCPU}", "--disable-usage-stats", f"--node-ip-address=10.77.0.{i}",
              "--temp-dir=/tmp/ray"]  # the host's own (tests/pipeline/hosts.py); short, for Ray's socket paths
    if i == 1:
        cmd = ["ray", "start", "--head", "--port=6379", "--include-dashboard=true", "--dashboard-host=127.0.0.1",
               # a node that stops answering is declared dead after 5 checks of 1 s period and 5 s timeout each
               # (~30 s; Ray's defaults ~65 s). 3 checks of 1 s timeout declared a live node dead on a loaded
               # machine (load ~20 as the suite's other process started its S3 fixtures): its raylet exited before
               # step 1, and the run's shrink came at step 0 instead of where the test pulls the cable
               '--system-config={"health_check_period_ms": 1000, "health_check_failure_threshold": 5, '
               '"health_check_timeout_ms": 5000}', *common]
    else:
        cmd = ["ray", "start", f"--address={A1}:6379", *common]
    r = hosts.run(i, cmd, timeout=300)
    assert r.returncode == 0, f"ray start on host {i}: {r.stdout[-2000:]}\n{r.stderr[-3000:]}"


def _step(line: str) -> int | None:
    m = re.search(r"train nano  step (\d+)/", line)
    return int(m.group(1)) if m else None


@pytest.fixture(scope="module")
def elastic_run(hosts, test_runs_root) -> ElasticRun:
    from bench.s3_server import ACCESS_KEY, REGION, SECRET_KEY

    work = hosts.workdir
    hosts.env.update({"AWS_ACCESS_KEY_ID": ACCESS_KEY, "AWS_SECRET_ACCESS_KEY": SECRET_KEY, "AWS_REGION": REGION})
    token = hosts.run(1, ["ray", "get-auth-token", "--generate"])
    assert token.returncode == 0, token.stderr
    for i in (2, 3):  # the cluster's shared secret on every node, as cluster.yaml's file_mounts ship it
        (hosts.home(i) / ".ray").mkdir(parents=True, exist_ok=True)
        shutil.copy(hosts.home(1) / ".ray/auth_token", hosts.home(i) / ".ray/auth_token")
    dataset = next((test_runs_root / "datasets").iterdir())  # the session's `test` dataset, into host 1's bucket
    services = hosts.popen(1, [PY, "-m", "tests.pipeline.hosts", "serve", str(work / "services"), A1, BUCKET,
                               json.dumps([[str(dataset), f"{STORE}/datasets/{dataset.name}"]])],
                           log=work / "services.log", cwd=ROOT)
    _ray_start(hosts, 1)
    errors: list[BaseException] = []

    def join(i: int) -> None:
        try:
            _ray_start(hosts, i)
        except BaseException as exc:  # noqa: BLE001 -- raised below, in the test's thread
            errors.append(exc)

    workers = [threading.Thread(target=join, args=(i,)) for i in (2, 3)]  # two machines booting at once
    for t in workers:
        t.start()
    for t in workers:
        t.join()
    if errors:
        raise errors[0]
    deadline = time.monotonic() + 180
    while b"ready" not in (work / "services.log").read_bytes():
        assert services.poll() is None and time.monotonic() < deadline, (work / "services.log").read_text()[-3000:]
        time.sleep(0.3)
    job_root, hold = work / "runs", work / "hold"
    for i in (2, 3):
        assert hosts.run(i, ["ls", str(job_root)]).stdout == "", f"host {i} sees the driver's run root"
    driver_log = work / "driver.log"
    driver = hosts.popen(1, [PY, "pipeline/run.py", "train", "--preset", "test", f"--run.root={job_root}",
                             "--run.name=elastic", f"--run.storage={STORE}", f"--address={A1}:6379",
                             f"--tracking.tracking_uri=http://{A1}:{MLFLOW_PORT}", "--tracking.experiment=elastic",
                             "--ray.num_workers=2-3", "--train.grad_accum=2", f"--ray.cpus_per_worker={CPUS_PER_WORKER}",
                             "--ray.resize_check_s=2", f"--train.max_steps={MAX_STEPS}", "--train.log_every=1",
                             f"--train.checkpoint_every={CKPT_EVERY}", "--train.eval_every=1000",
                             "--train.sample_tokens=0", "--audit-data"],
                         log=driver_log, cwd=ROOT, env={"LONGTRAIN_INTERACTIVE": "0"})
    run = ElasticRun(rc=-1, lines=[])
    t0, seen, stage, last_step, fresh = time.monotonic(), 0, "kill", 0, 0
    deadline = t0 + STAGE_S  # each stage gets STAGE_S to happen; then the test goes on to report what did
    try:
        while driver.poll() is None and time.monotonic() < deadline:
            before = stage
            text = driver_log.read_text(errors="replace")
            now = time.monotonic() - t0
            for line in text[seen:].splitlines():
                run.lines.append((now, line))
                if "shrank from 3 to 2" in line or "grew from 2 to 3" in line:
                    fresh = 0  # steps logged by the group that just started
                if _step(line):
                    last_step, fresh = _step(line), fresh + 1
            seen = len(text)
            if stage == "kill" and last_step >= KILL_AT:  # 1. a node lost, no notice
                hosts.link(3, False)
                hosts.kill(3)
                run.events["kill"], run.steps["kill"], stage = now, last_step, "shrink"
                run.events["kill_wall"] = time.time()
            elif stage == "shrink" and "shrank from 3 to 2" in text and fresh >= 5:  # 2 workers passed a checkpoint
                hold.touch()  # the survivors wait at a step boundary while the node comes back
                run.events["held"], run.steps["held"] = now, last_step
                hosts.boot(3)  # 2. the node returns: a new machine at the same address
                hosts.link(3, True)
                _ray_start(hosts, 3)
                run.events["rejoined"], stage = time.monotonic() - t0, "grow"
            elif stage == "grow" and "grew from 2 to 3" in text:
                hold.unlink()
                run.events["grew"], stage = now, "sigterm"
            elif stage == "sigterm" and fresh >= 2:
                workers = [p for p in hosts.pids(2) if b"RayTrainWorker" in _cmdline(p)]
                assert workers, "no training worker on host 2"
                for pid in workers:  # 3. a preemption notice to the worker on host 2
                    os.kill(pid, signal.SIGTERM)
                run.events["sigterm"], run.steps["sigterm"], stage = now, last_step, "finish"
            if stage != before:
                deadline = time.monotonic() + STAGE_S
            time.sleep(0.2)
    finally:
        hold.unlink(missing_ok=True)
        if driver.poll() is None:
            driver.kill()
        driver.wait(timeout=60)
    text = driver_log.read_text(errors="replace")
    run.lines += [(time.monotonic() - t0, line) for line in text[seen:].splitlines()]
    run.rc = driver.returncode
    run.events["end"] = time.monotonic() - t0
    run.steps["stage"] = {"kill": 0, "shrink": 1, "grow": 2, "sigterm": 3, "finish": 4}[stage]
    record = job_root / "elastic" / "run.json"
    run.record = json.loads(record.read_text()) if record.exists() else {}
    dump = hosts.run(1, [PY, "-m", "tests.pipeline.hosts", "dump", f"{STORE}/elastic/data_audit/rank_*.jsonl"],
                     cwd=ROOT)
    run.audit = json.loads(dump.stdout) if dump.returncode == 0 else {}
    run.metrics = _metric_history(work / "services" / "mlflow.db", run.record.get("mlflow_run_id"))
    _report(run)
    return run


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def _metric_history(db: Path, run_id: str | None) -> dict[str, list[tuple[int, float, int]]]:
    """Every value the run logged, straight from the MLflow server's store (sqlite)."""
    import sqlite3

    if not run_id or not db.exists():
        return {}
    with sqlite3.connect(db) as con:
        rows = con.execute("SELECT key, step, value, timestamp FROM metrics WHERE run_uuid = ? ORDER BY timestamp",
                           (run_id,)).fetchall()
    out: dict[str, list[tuple[int, float, int]]] = {}
    for key, step, value, ts in rows:
        out.setdefault(key, []).append((step, value, ts))
    return out


def _report(run: ElasticRun) -> None:
    """The resize lines, the steps lost and the time to resume, on the test's output."""
    print(f"\nelastic run: rc {run.rc}; events (s since start): "
          + ", ".join(f"{k} {v:.1f}" for k, v in run.events.items() if k != "kill_wall")
          + f"; rank 0's step at them: {run.steps}")
    if "kill" in run.events:  # by the test's own clock: from pulling host 3's cable to the next step on the console
        after = [(t, _step(line)) for t, line in run.lines if t > run.events["kill"] and _step(line)]
        shrink = next((t for t, line in run.lines if "shrank from 3 to 2" in line), None)
        if shrink is not None:
            t, step = next(((t, s) for t, s in after if t >= shrink), (None, None))
            if t is not None:
                print(f"  node loss: host 3 killed after step {run.steps['kill']} was on the console; step {step} on "
                      f"the console {t - run.events['kill']:.1f} s later, on 2 workers")
    for t, line in run.lines:
        if re.search(r"elastic:|restart:|resume:|preemption:|was lost", line) and "File " not in line:
            print(f"  [{t:6.1f} s] {line.strip()[:400]}")
    for name in ("train/steps_redone", "train/resume_s", "train/world_size"):
        print(f"  {name}: {[(s, round(v, 1)) for s, v, _ in run.metrics.get(name, [])][:40]}")
    losses: dict[int, list[float]] = {}
    for step, value, _ in run.metrics.get("train/loss", []):
        losses.setdefault(step, []).append(value)
    print(f"  train/loss of the steps run twice: {({s: v for s, v in losses.items() if len(v) > 1})}")


def test_a_lost_node_costs_the_steps_since_the_last_checkpoint_and_the_run_succeeds(elastic_run):
    run = elastic_run
    assert run.rc == 0 and run.steps["stage"] == 4, run.text()[-6000:]
    assert run.record["status"] == "finished" and run.record["phases_done"] == 1
    shrank = run.find(r"elastic: the worker group shrank from 3 to 2 worker\(s\) at step (\d+): rank \d's worker on "
                      r"10\.77\.0\.3 was lost")
    assert len(shrank) == 1, run.text()[-6000:]
    resumed_at = int(re.search(r"at step (\d+)", shrank[0]).group(1))
    assert resumed_at % CKPT_EVERY == 0 and resumed_at <= run.steps["kill"]
    assert "train.grad_accum 3 keeps 24 sequences per step" in shrank[0]  # 2 workers x 4 x 3 = 3 x 4 x 2
    # the lost work: the steps between that checkpoint and the last step logged before the loss, and the seconds
    # from that step to the first one after (rank 0 logs both, once per resume)
    resume = run.find(rf"resume: from the checkpoint of step {resumed_at}; the last step logged before was (\d+) "
                      rf"\((\d+) step\(s\) to redo\)")
    last, redo = map(int, re.search(r"was (\d+) \((\d+)", resume[0]).groups())
    assert last >= run.steps["kill"] >= KILL_AT and redo == last - resumed_at > 0
    assert run.metrics["train/steps_redone"][0][1] == redo and run.metrics["train/resume_s"][0][1] > 0
    final = max(s for s, _, _ in run.metrics["train/loss"])
    assert final == MAX_STEPS and run.find(rf"step {MAX_STEPS}/{MAX_STEPS}")


def test_the_group_grows_back_when_the_node_returns(elastic_run):
    run = elastic_run
    grew = run.find(r"elastic: the worker group grew from 2 to 3 worker\(s\) at step \d+: a resize check found "
                    r"resources for 3 workers")
    assert len(grew) == 1 and "train.grad_accum 2 keeps 24 sequences per step" in grew[0], run.text()[-6000:]
    sizes = [int(v) for _, v, _ in run.metrics["train/world_size"]]  # as logged, in time order
    changes = [w for i, w in enumerate(sizes) if i == 0 or w != sizes[i - 1]]
    assert changes == [3, 2, 3], changes


def test_sigterm_to_a_worker_checkpoints_at_the_next_step_and_the_next_attempt_starts_there(elastic_run):
    run = elastic_run
    stopped = run.find(r"preemption: rank \d: SIGTERM to the worker on lt-h2 \(pid \d+\); checkpointed step (\d+)")
    assert len(stopped) == 1, run.text()[-6000:]
    at = int(re.search(r"checkpointed step (\d+)", stopped[0]).group(1))
    assert run.steps["sigterm"] <= at <= run.steps["sigterm"] + 3  # the handler runs at the worker's next poll
    restarted = run.find(rf"restart: 3 worker\(s\) again at step {at}: a preemption notice: rank \d: SIGTERM to the "
                         rf"worker on lt-h2 \(pid \d+\); checkpointed step {at}, stopping this attempt")
    assert len(restarted) == 1, run.text()[-6000:]
    assert run.metrics["train/steps_redone"][-1][1] == 0  # nothing lost: it resumed from that very step


def test_every_row_once_and_the_redone_steps_repeat_the_same_losses(elastic_run, test_runs_root):
    """Each step's rows are those of the last attempt that ran it (flushed at its checkpoints: a restart's lost
    steps never reached the audit); over the run they are the first MAX_STEPS x 24 rows of the epoch's order, each
    once. A step run twice (before a loss and after it, on another worker count) logged the same loss."""
    from pipeline.data.shards import ShardReader

    run = elastic_run
    by_step: dict[int, list[dict]] = {}
    for text in run.audit.values():
        for line in text.splitlines():
            if line.strip():
                r = json.loads(line)
                by_step.setdefault(r["step"], []).append(r)
    assert sorted(by_step) == list(range(1, MAX_STEPS + 1)), sorted(by_step)
    consumed = []
    for step, recs in sorted(by_step.items()):
        recs.sort(key=lambda r: r["time"])
        last = recs[-recs[-1]["world_size"]:]  # the last attempt that ran the step: one record per rank
        assert len({r["pid"] for r in last}) == len(last) == last[0]["world_size"], (step, recs)
        consumed += [i for r in last for i in r["seq_ids"]]
    assert {len(recs[-1]["seq_ids"]) * recs[-1]["world_size"] for recs in by_step.values()} == {GLOBAL_BATCH}
    assert len(consumed) == len(set(consumed)) == MAX_STEPS * GLOBAL_BATCH, "a row was read twice"
    dataset = next((test_runs_root / "datasets").iterdir())
    order = [int(i) for b in ShardReader(dataset, "train", GLOBAL_BATCH, seed=1234, epoch=0, start=0)
             for i in b["seq_id"]][:MAX_STEPS * GLOBAL_BATCH]
    assert sorted(consumed) == sorted(order), "the rows read are not the epoch's first rows"
    assert {r["world_size"] for recs in by_step.values() for r in recs} == {2, 3}
    losses: dict[int, list[float]] = {}
    for step, value, _ in run.metrics["train/loss"]:
        losses.setdefault(step, []).append(value)
    twice = {s: v for s, v in losses.items() if len(v) > 1}
    assert twice, "no step was redone"
    for step, values in twice.items():
        assert values == pytest.approx([values[0]] * len(values), rel=1e-4), (step, values)
