"""Write contrib/kubernetes/requirements.lock: the agent image's dependencies, exact, each with its files' hashes.

    .venv/bin/python scripts/lock_image.py        # resolves through pip (the package index pip is configured for)

What is locked: kvcached's runtime dependencies (pyproject.toml's `dependencies`) and what building it from
its source needs (setuptools, wheel), resolved by pip for every target the lock serves: CPython 3.12, the
image's base (contrib/kubernetes/Containerfile), on x86_64 and aarch64 (Grace nodes); and the CPython that
runs this script, on x86_64, because the suite runs the Containerfile's install steps with it
(tests/unit/test_containerfile.py). Each target's wheels are downloaded (`pip download --only-binary`) and
hashed here; the versions must agree across targets, or the script fails naming the package. Wheels only:
the image has no compiler, and a source build would run code the lock cannot pin.
"""

from __future__ import annotations

import hashlib
import re
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
LOCK = REPO / "contrib/kubernetes/requirements.lock"
IMAGE_PYTHON = "3.12"  # the Containerfile's base (python:3.12.x-slim-...): tests/unit/test_containerfile.py holds it
ARCHES = {"x86_64": ("manylinux_2_17_x86_64", "manylinux2014_x86_64", "manylinux_2_28_x86_64", "linux_x86_64"),
          "aarch64": ("manylinux_2_17_aarch64", "manylinux2014_aarch64", "manylinux_2_28_aarch64", "linux_aarch64")}
BUILD = ("setuptools>=65", "wheel")  # pyproject.toml's [build-system] requires
_WHEEL = re.compile(r"^(?P<name>[A-Za-z0-9_.]+?)-(?P<version>[^-]+)-")


def _requirements() -> list[str]:
    text = (REPO / "pyproject.toml").read_text()
    block = text.split("\ndependencies = [", 1)[1].split("\n]", 1)[0]
    return [*re.findall(r'^\s*"([^"]+)"', block, re.M), *BUILD]


def _targets() -> list[tuple[str, str]]:
    here = f"{sys.version_info.major}.{sys.version_info.minor}"
    out = [(IMAGE_PYTHON, arch) for arch in ARCHES]
    return out + ([(here, "x86_64")] if here != IMAGE_PYTHON else [])


def _download(python: str, arch: str, into: Path) -> dict[str, tuple[str, str]]:
    """{canonical name: (version, sha256)} of each wheel pip picks for the target."""
    abi = "cp" + python.replace(".", "")
    argv = [sys.executable, "-m", "pip", "download", "--quiet", "--disable-pip-version-check", "--only-binary=:all:",
            "--dest", str(into), "--python-version", python, "--implementation", "cp", "--abi", abi]
    for tag in ARCHES[arch]:
        argv += ["--platform", tag]
    subprocess.run([*argv, *_requirements()], check=True)
    found: dict[str, tuple[str, str]] = {}
    for wheel in sorted(into.glob("*.whl")):
        m = _WHEEL.match(wheel.name)
        assert m is not None, wheel.name
        name = re.sub(r"[-_.]+", "-", m.group("name")).lower()
        found.setdefault(name, (m.group("version"), ""))
        found[f"{name} {wheel.name}"] = (m.group("version"), hashlib.sha256(wheel.read_bytes()).hexdigest())
    return found


def main() -> None:
    versions: dict[str, str] = {}
    hashes: dict[str, set[str]] = {}
    targets = _targets()
    for python, arch in targets:
        with tempfile.TemporaryDirectory() as tmp:
            for key, (version, digest) in _download(python, arch, Path(tmp)).items():
                name = key.split(" ", 1)[0]
                if versions.setdefault(name, version) != version:
                    sys.exit(f"{name}: {versions[name]} for one target, {version} for CPython {python} {arch}")
                if digest:
                    hashes.setdefault(name, set()).add(digest)
    lines = [
        "# The kvctl agent image's Python dependencies, exact, with the sha256 of every wheel pip may install:",
        "# contrib/kubernetes/Containerfile installs them with `pip install --require-hashes --only-binary=:all:`,",
        "# then kvcached itself from the build context without dependencies or build isolation.",
        "# Written by scripts/lock_image.py; do not edit. Targets (CPython, machine): "
        + ", ".join(f"{p} {a}" for p, a in targets) + ".",
        f"# image-python: {IMAGE_PYTHON}",
    ]
    for name in sorted(versions):
        lines.append(f"{name}=={versions[name]} \\")
        digests = sorted(hashes[name])
        lines += [f"    --hash=sha256:{d}" + (" \\" if i < len(digests) - 1 else "") for i, d in enumerate(digests)]
    LOCK.write_text("\n".join(lines) + "\n")
    print(f"wrote {LOCK.relative_to(REPO)}: {len(versions)} packages for {len(targets)} targets")


if __name__ == "__main__":
    main()
