"""kvcached: a KV-cache runtime for LLM serving engines (core layer: stdlib + psutil only)."""

from __future__ import annotations


def __getattr__(name: str) -> str:
    """`kvcached.__version__`: the installed package's version, read from its metadata (pyproject.toml's), on use."""
    if name != "__version__":
        raise AttributeError(f"module 'kvcached' has no attribute {name!r}")
    # importlib.metadata costs start-up (a few ms): only `kvctl --version` and the integrations' documents ask.
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("kvcached")
    except PackageNotFoundError:  # a source tree on sys.path, never installed
        return "0+unknown"
