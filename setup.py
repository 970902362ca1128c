"""Build of the kvcached.runtime._kvpages extension; the metadata lives in pyproject.toml.

The extension needs only a C++17 compiler and the CPython headers. The CUDA
backend is compiled in when cuda.h is found (CUDA_HOME, CUDA_PATH or
/usr/local/cuda), but libcuda is loaded at run time, so the same build works
on machines without a GPU. Environment switches:

- ``KVCACHED_NO_CUDA=1``: never compile the CUDA backend.
- ``KVCACHED_REQUIRE_EXT=1``: fail the install when the extension does not
  build (by default a failed build only warns, so that ``kvctl``, which never
  needs the extension, still installs on a machine without a compiler).
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path
from types import ModuleType

from setuptools import Extension, setup

HERE = Path(__file__).resolve().parent


def _settings() -> ModuleType:
    """kvcached/settings.py, loaded by its path (the package is not installed yet; the file is stdlib only)."""
    spec = importlib.util.spec_from_file_location("_kvcached_build_settings", HERE / "kvcached" / "settings.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the file runs
    spec.loader.exec_module(module)
    return module


SETTINGS = _settings()


def _cuda_include_dir() -> str | None:
    """Return the first directory holding cuda.h, or None."""
    if SETTINGS.NO_CUDA.get():
        return None
    roots = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"]
    for root in roots:
        if root and (Path(root) / "include" / "cuda.h").is_file():
            return str(Path(root) / "include")
    return None


def _extension() -> Extension:
    sources = sorted(str(p.relative_to(HERE)) for p in (HERE / "csrc").glob("*.cpp"))
    include_dirs = ["csrc"]
    macros: list[tuple[str, str | None]] = []
    cuda_include = _cuda_include_dir()
    if cuda_include is not None:
        include_dirs.append(cuda_include)
        macros.append(("KVPAGES_WITH_CUDA", "1"))
    return Extension(
        "kvcached.runtime._kvpages",
        sources=sources,
        include_dirs=include_dirs,
        define_macros=macros,
        extra_compile_args=["-std=c++17", "-O2", "-fvisibility=hidden", "-Wall"],
        # dlopen lives in libc from glibc 2.34; older systems need libdl.
        libraries=["dl"],
        language="c++",
        optional=not SETTINGS.REQUIRE_EXT.get(),  # strict: a bad value fails the build (settings.py says why)
    )


try:
    EXTENSIONS = [_extension()]
except SETTINGS.SettingError as e:
    sys.exit(f"setup.py: {e}")
setup(ext_modules=EXTENSIONS)
