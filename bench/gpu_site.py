"""The Ray + MLflow site a bare GPU machine lacks, packed here into one tarball that bench/gpu_check.py unpacks there.

    python bench/gpu_check.py --pack             # builds .gpu/site.tar.xz (~50 MiB): run it here, then carry .gpu
    python bench/gpu_site.py --dest .gpu         # the same, on its own

A lent GPU machine has torch, numba-cuda and the CUDA stack but neither Ray nor MLflow, and no network. The default
run and the sweep need both, so they travel with the checkout: wheels for CPython 3.12 on x86-64 (the machine's
interpreter) of the exact versions below, downloaded by pip here and installed into a folder with --target (no
dependency resolution: the list is the closure of what the machine's image lacks), console scripts made to run with
the machine's python3, Ray's Java support (35 MB) left out, packed as xz. bench/gpu_check.py extracts it into the
temporary site first on every step's PYTHONPATH. The tarball must stay under the device's 64 MiB limit on what a
call carries, with the checkout beside it; `pack` refuses one over LIMIT_BYTES.
"""
from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DEFAULT_DEST = ".gpu"
TARBALL = "site.tar.xz"
LIMIT_BYTES = 56 * 2**20  # of the 64 MiB a device call carries; the checkout itself takes a few MiB
PYTHON_VERSION = "3.12"
PLATFORMS = ("manylinux_2_17_x86_64", "manylinux2014_x86_64", "manylinux_2_27_x86_64", "manylinux_2_28_x86_64",
             "manylinux_2_31_x86_64", "manylinux_2_34_x86_64", "any")
# Ray 2.60 (train, data, tune), MLflow 3.17 and every package of theirs the GPU image lacks, pinned
PACKAGES = """alembic==1.20.1 annotated_types==0.8.0 blinker==1.9.0 cachetools==7.3.2 cffi==2.1.1 cryptography==50.0.2
databricks_sdk==0.156.0 docker==7.2.0 fastapi==0.165.0 flask==3.1.3 flask_cors==6.0.5 gitdb==4.0.12 gitpython==3.2.1
google_auth==2.62.2 graphene==3.4.3 graphql_core==3.2.14 graphql_relay==3.2.0 gunicorn==26.2.0 huey==3.5.4
importlib_metadata==9.1.0 itsdangerous==2.2.0 jsonschema==4.26.0 jsonschema_specifications==2025.9.1 mako==1.4.3
mlflow==3.17.2 mlflow_skinny==3.17.2 mlflow_tracing==3.17.2 opentelemetry_api==1.45.2 opentelemetry_proto==1.45.2
opentelemetry_sdk==1.45.2 opentelemetry_semantic_conventions==0.66b2 prettytable==3.18.0 pyasn1==0.6.5
pyasn1_modules==0.4.2 pycparser==3.12 pydantic==2.14.3 pydantic_core==2.50.4 python_dotenv==1.2.4 ray==2.60.0
referencing==0.37.0 rpds_py==2026.9.1 skops==0.16.0 smmap==5.0.3 sqlalchemy==2.1.9 sqlparse==0.6.1 starlette==1.10.0
tensorboardx==2.6.5 typing_inspection==0.4.5 uvicorn==0.54.0 wcwidth==0.9.4""".split()


def pip_commands(wheels: Path, site: Path, python_version: str = PYTHON_VERSION) -> list[list[str]]:
    """The two pip calls: download the pinned wheels for the machine's platform, install them into `site`."""
    platform = ["--only-binary=:all:", "--python-version", python_version, "--implementation", "cp",
                "--abi", f"cp{python_version.replace('.', '')}", "--abi", "abi3", "--abi", "none"]
    for p in PLATFORMS:
        platform += ["--platform", p]
    pip = [sys.executable, "-m", "pip"]
    return [pip + ["download", "-q", "--no-deps", *platform, "-d", str(wheels), *PACKAGES],
            pip + ["install", "-q", "--no-deps", "--no-compile", *platform, "--target", str(site),
                   "--find-links", str(wheels), "--no-index", *PACKAGES]]


def _portable_scripts(site: Path) -> None:
    """Console scripts (ray, mlflow) start with this interpreter's path: make them run the machine's python3."""
    for script in (site / "bin").glob("*") if (site / "bin").is_dir() else ():
        lines = script.read_bytes().split(b"\n", 1)
        if lines[0].startswith(b"#!") and b"python" in lines[0]:
            script.write_bytes(b"#!/usr/bin/env python3\n" + (lines[1] if len(lines) > 1 else b""))


def _exclude_from_git(dest: Path) -> None:
    """Keep the tarball out of commits: dest goes into this checkout's info/exclude (a worktree's too)."""
    try:
        rel = dest.resolve().relative_to(REPO)
        path = subprocess.run(["git", "rev-parse", "--git-path", "info/exclude"], cwd=REPO, capture_output=True,
                              text=True, check=True).stdout.strip()
    except (ValueError, OSError, subprocess.CalledProcessError):
        return  # not inside this checkout, or no git: nothing to exclude it from
    exclude = (REPO / path)
    line = f"/{rel.as_posix()}/"
    exclude.parent.mkdir(parents=True, exist_ok=True)
    if line not in (exclude.read_text().splitlines() if exclude.exists() else []):
        with exclude.open("a") as f:
            f.write(line + "\n")


def pack(dest: Path = REPO / DEFAULT_DEST, python_version: str = PYTHON_VERSION) -> Path:
    """Build dest/site.tar.xz; returns its path. Raises RuntimeError with pip's last lines when a download fails."""
    dest.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="gpu_site-") as tmp:
        wheels, site = Path(tmp) / "whl", Path(tmp) / "site"
        for cmd in pip_commands(wheels, site, python_version):
            proc = subprocess.run(cmd, capture_output=True, text=True)
            if proc.returncode != 0:
                tail = "\n".join((proc.stderr or proc.stdout).strip().splitlines()[-5:])
                raise RuntimeError(f"pip {cmd[3]} failed (exit {proc.returncode}); it needs PyPI, from here, not "
                                   f"from the GPU machine:\n{tail}")
        _portable_scripts(site)
        shutil.rmtree(site / "ray" / "jars", ignore_errors=True)  # Ray skips Java when the folder is absent
        out = dest / TARBALL
        part = dest / f".{TARBALL}.part"
        with tarfile.open(part, "w:xz") as tar:
            for child in sorted(site.iterdir()):
                tar.add(child, arcname=child.name)
        size = part.stat().st_size
        if size > LIMIT_BYTES:
            part.unlink()
            raise RuntimeError(f"the site packs to {size / 2**20:.1f} MiB, over the {LIMIT_BYTES / 2**20:.0f} MiB "
                               "a device call can carry beside the checkout: trim PACKAGES")
        part.replace(out)
    _exclude_from_git(dest)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dest", type=Path, default=REPO / DEFAULT_DEST, help=f"folder (default {DEFAULT_DEST})")
    p.add_argument("--python-version", default=PYTHON_VERSION, help="the GPU machine's CPython (default 3.12)")
    args = p.parse_args(argv)
    try:
        path = pack(args.dest, args.python_version)
    except RuntimeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(f"wrote {path} ({path.stat().st_size / 2**20:.1f} MiB): carry {args.dest.name} with the device call")
    return 0


if __name__ == "__main__":
    sys.exit(main())
