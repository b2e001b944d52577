"""How many storage requests does one `python pipeline/run.py eval` of a checkpoint in a bucket make? A SeaweedFS S3
server started here, behind the counting proxy (bench/fault_proxy.py); a tiny dataset prepared into the bucket and
a tiny checkpoint trained on it (the test preset, --no-ray, then copied into the bucket beside the dataset); then
one eval of that checkpoint, whose requests are counted by kind (GET, HEAD, LIST) and by object key. With --base, a
second checkout (another commit) evaluates the same checkpoint first, so the two counts come from one run.

    python bench/eval_command_reads.py                                   # this checkout's eval
    python bench/eval_command_reads.py --base ../longtrain-21697b6       # that checkout's eval, then this one's
    python bench/eval_command_reads.py --base ../longtrain-21697b6 --eval-args="" --eval-args="--by-position --seq-len 2x"
                                                      # a plain eval, then one with long-context measures

The eval's own output is kept in the result. Writes bench/results/eval_command_reads-<device>-<date>.json.
"""
from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path
from urllib.parse import parse_qs, unquote, urlsplit

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.common import write_result  # noqa: E402
from bench.fault_proxy import FaultProxy  # noqa: E402
from bench.s3_server import SeaweedS3  # noqa: E402

BUCKET = "longtrain-bench"


def classify(line: str) -> tuple[str, str]:
    """("GET" | "HEAD" | "LIST" | other method, object key or listed prefix + "*") of a request line."""
    method, target = line.split()[:2]
    parts = urlsplit(target)
    query = parse_qs(parts.query)
    key = unquote(parts.path.lstrip("/"))
    key = key.split("/", 1)[1] if "/" in key else ""  # the bucket's name off
    if method == "GET" and ("list-type" in query or "prefix" in query or not key):
        return "LIST", query.get("prefix", [""])[0] + "*"
    return method, key


def shorten(key: str, dataset: str, checkpoint: str) -> str:
    """A key with the dataset's and the checkpoint's locations named, not spelled out."""
    return key.replace(checkpoint, "<checkpoint>").replace(dataset, "<dataset>")


def count_eval(code: Path, argv: list[str], env: dict, proxy: FaultProxy, dataset: str, checkpoint: str) -> dict:
    """Run `python <code>/pipeline/run.py eval ...` (that checkout's code) and count the requests it made."""
    proxy.reset_log()
    proc = subprocess.run([sys.executable, str(code / "pipeline" / "run.py"), "eval", *argv], cwd=code,
                          env={**env, "PYTHONPATH": str(code)}, capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        raise RuntimeError(f"eval ({code}) exited {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    seen = [classify(s.line) for s in proxy.requests()]
    by_key = Counter(f"{kind} {shorten(key, dataset, checkpoint)}" for kind, key in seen)
    kinds = Counter(kind for kind, _ in seen)
    commit = subprocess.run(["git", "-C", str(code), "rev-parse", "HEAD"], capture_output=True, text=True).stdout
    return {"code": str(code), "commit": commit.strip(), "requests_total": len(seen), "by_kind": dict(kinds),
            # a read is a GET (pyarrow opens each object with a HEAD first, counted under by_kind)
            "manifest_reads": sum(n for k, n in by_key.items() if k.startswith("GET ") and k.endswith("/manifest.json")),
            "meta_reads": by_key.get("GET <checkpoint>/meta.json", 0),
            "by_key": dict(sorted(by_key.items())), "eval_output": proc.stdout[-2000:]}


def run(cmd: list[str], env: dict, what: str) -> str:
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        raise RuntimeError(f"{what} exited {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return proc.stdout


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--base", type=Path, help="another checkout whose eval is counted first, on the same checkpoint")
    p.add_argument("--eval-args", action="append", help="more eval flags, e.g. \"--by-position --seq-len 2x\"; "
                                                         "repeatable: each is one more eval counted (default: none)")
    p.add_argument("--out", type=Path, default=None)
    a = p.parse_args(argv)
    variants = a.eval_args or [""]
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        server = SeaweedS3(tmp / "s3").start()
        proxy = FaultProxy("127.0.0.1", server.port).start()
        try:
            bucket = server.create_bucket(BUCKET)
            # a busy machine starts Ray slowly: the prepare waits for it rather than failing
            env = {"LONGTRAIN_RAY_START_WAIT_S": "600", **os.environ, **server.env, "AWS_ENDPOINT_URL": proxy.endpoint,
                   "PYTHONPATH": str(ROOT)}
            run_root = tmp / "runs"
            common = ["--preset", "test", f"--run.root={run_root}", f"--run.storage={bucket}/store"]
            run([sys.executable, str(ROOT / "pipeline" / "run.py"), "train", "--no-ray", *common, "--run.name=r1",
                 "--tracking.enabled=false"], env, "train")
            local = sorted((run_root / "r1" / "checkpoints").glob("phase*/step_*"))[-1]
            checkpoint = f"{bucket}/store/r1/checkpoints/{local.parent.name}/{local.name}"
            os.environ.update({**server.env, "AWS_ENDPOINT_URL": proxy.endpoint})
            from pipeline import storage
            from pipeline.train.checkpoints.state import read_checkpoint_meta

            for f in sorted(x for x in local.rglob("*") if x.is_file()):  # meta.json last, as a checkpoint publishes
                if f.name != "meta.json":
                    storage.write_bytes(storage.join(checkpoint, f.relative_to(local).as_posix()), f.read_bytes())
            storage.write_bytes(storage.join(checkpoint, "meta.json"), (local / "meta.json").read_bytes())
            dataset = read_checkpoint_meta(checkpoint, weights_only=True)["dataset_dir"]
            key_of = lambda uri: uri.split("://", 1)[1].split("/", 1)[1]  # noqa: E731
            evals = {}
            for variant in variants:
                eval_argv = ["--checkpoint", checkpoint, "--resume", "r1", f"--run.root={run_root}",
                             *shlex.split(variant)]
                sides = evals[variant or "(plain)"] = {
                    "eval_command": "python pipeline/run.py eval " + " ".join(eval_argv)}
                for side, code in (("base", a.base), ("this", ROOT)):
                    if code is None:
                        continue
                    r = count_eval(code.resolve(), eval_argv, env, proxy, key_of(dataset), key_of(checkpoint))
                    sides[side] = r
                    print(f"eval {variant or '(plain)'}, {side} ({r['commit'][:7]}): {r['requests_total']} requests "
                          f"{r['by_kind']}; manifest.json {r['manifest_reads']} GETs, the checkpoint's meta.json "
                          f"{r['meta_reads']} GETs", flush=True)
                    for k, n in r["by_key"].items():
                        print(f"  {n:3d}  {k}")
        finally:
            proxy.stop()
            server.stop()
    for variant, sides in evals.items():
        if "base" in sides:
            b, t = sides["base"], sides["this"]
            print(f"one eval {variant} of a checkpoint in the bucket: {b['requests_total']} -> {t['requests_total']} "
                  f"requests; manifest.json GETs {b['manifest_reads']} -> {t['manifest_reads']}, meta.json GETs "
                  f"{b['meta_reads']} -> {t['meta_reads']}")
    payload = {"evals": evals, "s3": "local SeaweedFS behind bench/fault_proxy.py (same machine)",
               "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(a).items()}}
    path = write_result("eval_command_reads", payload, a.out)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
