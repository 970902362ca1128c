"""A runtime for `podman --runtime` on this machine kind: crun, less what the machine refuses (tests/fs/podman_pods.py).

crun here refuses `setrlimit` for RLIMIT_NPROC and RLIMIT_NOFILE even at
their current values, and refuses cgroups in hybrid mode: the bundle's
`process.rlimits` is dropped before crun reads it, and crun runs with
`--cgroup-manager=disabled`, its state in the directory given first (the
scratch node's, not /run/crun). Nothing else of the container changes.
"""

from __future__ import annotations

import json
import os
import sys


def _bundle(args: list[str]) -> str | None:
    for i, a in enumerate(args):
        if a in ("--bundle", "-b") and i + 1 < len(args):
            return args[i + 1]
        if a.startswith("--bundle="):
            return a.split("=", 1)[1]
    return None


def main() -> None:
    state, args = sys.argv[1], sys.argv[2:]
    bundle = _bundle(args)
    if bundle is not None:
        path = os.path.join(bundle, "config.json")
        try:
            with open(path) as f:
                config = json.load(f)
        except FileNotFoundError:
            config = None
        if config is not None and config.get("process", {}).pop("rlimits", None) is not None:
            with open(path, "w") as f:
                json.dump(config, f)
    # Its state under the scratch node too (crun's default is /run/crun): nothing of it outlives the test.
    os.execvp("crun", ["crun", "--cgroup-manager=disabled", "--root", state, *args])


if __name__ == "__main__":
    main()
