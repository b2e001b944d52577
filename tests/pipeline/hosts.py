"""Separate hosts on one machine, for tests that lose nodes for real: each host is a network namespace on a private
bridge, with a mount namespace, a PID namespace and a hostname (UTS namespace) of its own.

    hosts = Hosts(3, workdir, masked=[run_root])   # 10.77.0.1 .. 10.77.0.3, hostnames lt-h1 .. lt-h3
    hosts.boot(2)                                  # host 2 comes up (its own PID 1)
    proc = hosts.popen(2, ["ray", "start", ...])   # a command on host 2 (its network, files, hostname, PIDs)
    hosts.kill(2)                                  # the machine is gone: every process of it dies at once
    hosts.boot(2)                                  # and comes back, a new machine at the same address
    hosts.close()                                  # every process killed, every namespace and link deleted

Network: the bridge lives in a namespace of its own (the "switch"); each host has one veth to it (`eth0`,
10.77.0.<i>/24) and its own loopback. Nothing is added to the machine's own network namespace, so hosts reach each
other only by these addresses and reach nothing else, and concurrent test sessions (each with its own namespace
names) cannot collide. Files: every host sees the machine's filesystem (the venv and the repository, as a machine
with the same install would), except `masked` directories, which are empty tmpfs mounts on every host but the
first (the driver's host: its run root is its own disk). /etc/hosts maps each host's hostname to 127.0.0.1, as
this machine's own /etc/hosts (and cloud images that list the hostname on a loopback line) do; with
`loopback_hostname=False` it maps it to the host's address instead. /tmp/ray (Ray's default temp dir) is a
directory of the host's own under workdir, and so is every command's TMPDIR (Ray downloads a checkpoint once per
node into the temporary directory: hosts sharing one would share those downloads).

Teardown: `close` (call it in a finally), and `start` first reaps what a killed test process left behind.

Needs root (ip netns, unshare, nsenter). `Hosts.missing()` says why not, for a skip or a failure.
"""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from pathlib import Path
from typing import Sequence

SUBNET = "10.77.0"


class Hosts:
    def __init__(self, n: int, workdir: str | Path, *, masked: Sequence[str | Path] = (),
                 loopback_hostname: bool = True, env: dict[str, str] | None = None):
        self.n, self.workdir = n, Path(workdir)
        self.masked = [str(m) for m in masked]
        self.loopback_hostname = loopback_hostname
        self.env = dict(env or {})
        tag = f"lt{os.getpid()}"
        self.switch = f"{tag}sw"
        self.netns = {i: f"{tag}h{i}" for i in range(1, n + 1)}
        self.init: dict[int, subprocess.Popen] = {}  # host -> the process whose child is the host's PID 1
        self.pid1: dict[int, int] = {}  # host -> PID 1 of the host, as this machine numbers it
        self._made: list[str] = []

    @staticmethod
    def missing() -> str | None:
        if os.geteuid() != 0:
            return "needs root (ip netns, unshare, nsenter)"
        for tool in ("ip", "unshare", "nsenter"):
            if shutil.which(tool) is None:
                return f"needs {tool} (iproute2, util-linux)"
        return None

    def address(self, i: int) -> str:
        return f"{SUBNET}.{i}"

    def hostname(self, i: int) -> str:
        return f"lt-h{i}"

    # ------------------------------------------------------------------------------------ network
    def start(self) -> "Hosts":
        """The switch and every host's network namespace and link (no process yet: `boot` starts one)."""
        reap_stale()
        Path("/tmp/ray").mkdir(exist_ok=True)  # the mount point for each host's own Ray temp dir
        self._ip("netns", "add", self.switch)
        self._made.append(self.switch)
        self._ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
        self._ip("-n", self.switch, "link", "set", "br0", "up")
        for i, ns in self.netns.items():
            self._ip("netns", "add", ns)
            self._made.append(ns)
            self._ip("-n", self.switch, "link", "add", f"v{i}", "type", "veth", "peer", "name", "eth0", "netns", ns)
            self._ip("-n", self.switch, "link", "set", f"v{i}", "master", "br0")
            self._ip("-n", self.switch, "link", "set", f"v{i}", "up")
            self._ip("-n", ns, "addr", "add", f"{self.address(i)}/24", "dev", "eth0")
            self._ip("-n", ns, "link", "set", "eth0", "up")
            self._ip("-n", ns, "link", "set", "lo", "up")
        return self

    def link(self, i: int, up: bool) -> None:
        """Plug host i's cable in or pull it out (at the switch)."""
        self._ip("-n", self.switch, "link", "set", f"v{i}", "up" if up else "down")

    @staticmethod
    def _ip(*args: str) -> None:
        subprocess.run(["ip", *args], check=True, capture_output=True, timeout=30)

    # ------------------------------------------------------------------------------------ machines
    def home(self, i: int) -> Path:
        return self.workdir / f"h{i}" / "home"

    def boot(self, i: int) -> None:
        """Host i's PID 1 in fresh PID, mount and UTS namespaces inside its network namespace."""
        if i in self.init and self.init[i].poll() is None:
            raise RuntimeError(f"host {i} is already up")
        root = self.workdir / f"h{i}"
        for d in ("home", "ray", "tmp"):
            (root / d).mkdir(parents=True, exist_ok=True)
        hosts_file = root / "hosts"
        own = "127.0.0.1" if self.loopback_hostname else self.address(i)
        hosts_file.write_text(f"127.0.0.1 localhost\n{own} {self.hostname(i)}\n")
        setup = [f"hostname {self.hostname(i)}", f"mount --bind {hosts_file} /etc/hosts",
                 f"mount --bind {root / 'ray'} /tmp/ray"]
        if i != 1:
            setup += [f"mount -t tmpfs tmpfs {m}" for m in self.masked]
        # PID 1 waits on its children (it reaps what is orphaned to it) until it is killed.
        script = " && ".join(setup) + " && echo up && exec sleep infinity"
        log = open(root / "init.log", "ab")
        self.init[i] = subprocess.Popen(
            ["nsenter", f"--net=/run/netns/{self.netns[i]}", "unshare", "--mount", "--uts", "--pid", "--fork",
             "--kill-child", "--mount-proc", "--propagation", "private", "bash", "-c", script],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        log.close()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            children = _children(self.init[i].pid)
            if children and b"up" in (root / "init.log").read_bytes().splitlines()[-1:]:
                self.pid1[i] = children[0]
                return
            if self.init[i].poll() is not None:
                break
            time.sleep(0.05)
        raise RuntimeError(f"host {i} did not boot: {(root / 'init.log').read_text()[-2000:]}")

    def command(self, i: int, argv: Sequence[str], cwd: str | Path | None = None) -> list[str]:
        """argv as run on host i (nsenter into its namespaces), in `cwd` (default: /)."""
        wd = [f"--wd={cwd}"] if cwd else []
        return ["nsenter", "-t", str(self.pid1[i]), "--net", "--mount", "--uts", "--pid", *wd, "--", *argv]

    def environ(self, i: int, env: dict[str, str] | None = None) -> dict[str, str]:
        """A command's environment on host i: this machine's, `self.env`, `env`, and the host's own HOME and TMPDIR
        (machines do not share a temporary directory: Ray's checkpoint downloads, for one, are per node there)."""
        root = self.workdir / f"h{i}"
        return {**os.environ, **self.env, "HOME": str(root / "home"), "TMPDIR": str(root / "tmp"), **(env or {})}

    def popen(self, i: int, argv: Sequence[str], *, env: dict[str, str] | None = None, log: Path | None = None,
              cwd: str | Path | None = None) -> subprocess.Popen:
        """Start argv on host i (environment: `environ`)."""
        full_env = self.environ(i, env)
        out = open(log, "ab") if log else subprocess.DEVNULL
        try:
            return subprocess.Popen(self.command(i, argv, cwd), env=full_env, stdout=out, stderr=subprocess.STDOUT,
                                    start_new_session=True)
        finally:
            if log:
                out.close()

    def run(self, i: int, argv: Sequence[str], *, env: dict[str, str] | None = None, timeout: float = 120,
            cwd: str | Path | None = None) -> subprocess.CompletedProcess:
        full_env = self.environ(i, env)
        return subprocess.run(self.command(i, argv, cwd), env=full_env, capture_output=True, text=True,
                              timeout=timeout)

    def pids(self, i: int) -> list[int]:
        """Every process in host i's network namespace, as this machine numbers them."""
        out = subprocess.run(["ip", "netns", "pids", self.netns[i]], capture_output=True, text=True, timeout=30)
        return [int(p) for p in out.stdout.split()]

    def kill(self, i: int) -> None:
        """Host i is gone: its PID 1 is killed, and with it every process of its PID namespace."""
        if i in self.pid1:
            _kill(self.pid1.pop(i))
        proc = self.init.pop(i, None)
        if proc is not None:
            _kill(proc.pid)
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        for pid in self.pids(i) if i in self.netns else []:  # a process that entered the network namespace alone
            _kill(pid)

    def close(self) -> None:
        """Every host killed, every namespace (and with them the links and the bridge) deleted."""
        for i in list(self.netns):
            try:
                self.kill(i)
            except Exception:  # noqa: BLE001 -- tear down the rest whatever happened to one host
                pass
        for ns in reversed(self._made):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)
        self._made.clear()


def reap_stale() -> None:
    """Namespaces of Hosts whose test process is gone (it was killed before it could tear down): their processes
    killed, the namespaces deleted. Only this module's names (lt<pid>sw, lt<pid>h<i>) of dead pids."""
    import re

    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=30).stdout
    for name in (line.split()[0] for line in out.splitlines() if line.strip()):
        m = re.fullmatch(r"lt(\d+)(sw|h\d+)", name)
        if not m or Path(f"/proc/{m.group(1)}").exists():
            continue
        pids = subprocess.run(["ip", "netns", "pids", name], capture_output=True, text=True, timeout=30).stdout
        for pid in pids.split():
            _kill(int(pid))
        subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=30)


def _children(pid: int) -> list[int]:
    try:
        text = Path(f"/proc/{pid}/task/{pid}/children").read_text()
    except OSError:
        return []
    return [int(p) for p in text.split()]


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


# ------------------------------------------------------------------------------------ host 1's services
S3_PORT, MLFLOW_PORT = 8333, 5000  # each host has its own network namespace: every port is free there


def serve(workdir: str, address: str, bucket: str, uploads: list[tuple[str, str]]) -> None:
    """Run on a host: an S3 server (SeaweedFS) and an MLflow server listening on `address`, the bucket created and
    each local directory of `uploads` copied to its URI; prints `ready` and waits until killed."""
    import sys
    import urllib.request

    from bench.s3_server import SeaweedS3

    root = Path(workdir)
    s3 = SeaweedS3(root / "s3", port=S3_PORT, host=address).start()
    os.environ.update(s3.env)
    s3.create_bucket(bucket)
    from pipeline import storage

    for local, uri in uploads:
        for f in sorted(Path(local).rglob("*")):
            if f.is_file():
                storage.write_bytes(storage.join(uri, str(f.relative_to(local))), f.read_bytes())
    mlflow_log = open(root / "mlflow.log", "ab")
    env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false", "MLFLOW_DISABLE_TELEMETRY": "true"}
    subprocess.Popen([sys.executable, "-m", "mlflow", "server", "--host", address, "--port", str(MLFLOW_PORT),
                      "--backend-store-uri", f"sqlite:///{root / 'mlflow.db'}", "--serve-artifacts",
                      "--artifacts-destination", str(root / "mlartifacts"), "--workers", "1"],
                     stdout=mlflow_log, stderr=subprocess.STDOUT, env=env, cwd=root)
    deadline = time.monotonic() + 120
    while True:
        try:
            with urllib.request.urlopen(f"http://{address}:{MLFLOW_PORT}/health", timeout=2) as r:
                if r.status == 200:
                    break
        except OSError:
            if time.monotonic() > deadline:
                raise RuntimeError(f"mlflow server not ready: {(root / 'mlflow.log').read_text()[-2000:]}")
            time.sleep(0.3)
    print("ready", flush=True)
    while True:
        time.sleep(3600)


def dump(pattern: str) -> None:
    """Run on a host: print {uri: text} of every object matching `pattern` as JSON (the test's view of the bucket)."""
    import json

    from pipeline import storage

    print(json.dumps({uri: storage.read_text(uri) for uri in storage.glob(pattern)}))


if __name__ == "__main__":
    import json
    import sys

    if sys.argv[1] == "serve":
        serve(sys.argv[2], sys.argv[3], sys.argv[4], json.loads(sys.argv[5]))
    elif sys.argv[1] == "dump":
        dump(sys.argv[2])
