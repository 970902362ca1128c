"""`python -m kvcached.integration.detect [--json]`: what kvcached's integrations find here (kvcached.detect/1).

One section per engine installed (`vllm`, `sglang`), each built by that
engine's integration; with no engine installed the
document has no sections and is still valid. `kvctl doctor` runs this in the
serve's interpreter and reads the document strictly
(`kvcached.node.ops.detectdoc.parse`, `kvcached/schemas/detect.json`). Exit status
0 whenever a document was printed, whatever it says; 2 for a bad command line.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import sys
from collections.abc import Iterator, Sequence

from ..node import DetectDocument, EngineSection

USAGE = "usage: python -m kvcached.integration.detect [--json]"


def installed(package: str) -> bool:
    """The engine's top-level package can be found here (not imported)."""
    try:
        return importlib.util.find_spec(package) is not None
    except (ImportError, ValueError):
        return False


def document() -> DetectDocument:
    """Every installed engine's section. Imports each installed engine; never raises."""
    engines: dict[str, EngineSection] = {}
    if installed("vllm"):
        from .vllm.detect import section

        engines["vllm"] = section()
    if installed("sglang"):
        from .sglang.detect import section as sglang_section

        engines["sglang"] = sglang_section()
    return DetectDocument(engines=engines)


def _text(doc: DetectDocument) -> str:
    if not doc.engines:
        return "no engine kvcached integrates with is installed here"
    lines = []
    for name, eng in doc.engines.items():
        state = "enabled" if eng.plugin.enabled else "not enabled"
        state += "" if eng.plugin.allowed else f", but {eng.plugin.allow_list_var} excludes kvcached"
        lines.append(f"{name} {eng.version or '?'}: kvcached {state}" + (f" ({eng.error})" if eng.error else ""))
        lines += [f"  patch {p.name}: {p.status} ({p.reason})" for p in eng.patches]
        lines += [f"  condition {c.name}: {c.present} ({c.detail})" for c in eng.conditions]
        lines += [f"  hazard {h.name}: {h.present}" + (f" ({h.detail})" if h.detail else "") for h in eng.hazards]
    return "\n".join(lines)


@contextlib.contextmanager
def _stdout_to_stderr() -> Iterator[None]:
    """Everything written to stdout in the block goes to stderr: the document alone is stdout.

    vLLM's log handler writes to the stdout of the moment it is configured (at
    its import), and native code may write to fd 1; both move, for the block
    and for the handler's life.
    """
    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(2, 1)
    try:
        with contextlib.redirect_stdout(sys.stderr):
            yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)


def main(argv: Sequence[str] | None = None) -> int:
    """Print the document (`--json`, one line on stdout) or a summary of it; the exit status."""
    args = list(sys.argv[1:] if argv is None else argv)
    if args not in ([], ["--json"]):
        print(USAGE, file=sys.stderr)
        return 2
    with _stdout_to_stderr():
        doc = document()
    print(json.dumps(doc.to_dict()) if args else _text(doc), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
