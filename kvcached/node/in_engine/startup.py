"""What an engine does with its own name at start-up (docs/NODE.md §1).

Upstream's uniqueness probe never runs, so a relaunch that reuses a PGID meets
the dead predecessor's segment of the same name. We decide it with the shared
path: join it if it is alive, replace it if it is provably stale, refuse with
a clear error otherwise.
"""

from __future__ import annotations

import logging

from ..base.errors import KvcachedError
from ..base.layout import Layout
from ..clean.cleanup import execute, plan
from ..clean.decide import Policy, State
from ..clean.scan import Kind
from ..state.lease import SegmentLease
from ..state.segment import SegmentInfo, create_segment, read_segment

log = logging.getLogger(__name__)


class SegmentConflict(KvcachedError):
    """A same-name segment exists that we can neither join nor prove stale."""


def claim_segment(layout: Layout, name: str, total: int) -> tuple[SegmentLease, SegmentInfo, str]:
    """Create (or join, or replace) the deployment's segment and hold its lease.

    Returns (lease, values, how) with `how` one of created / joined / replaced.
    """
    path = layout.segment_path(name)
    replaced = False
    for _ in range(3):
        try:
            info = create_segment(path, total)
        except FileExistsError:
            p = plan(layout, Policy(grace=0), names=[name], globs=[name], kinds=[Kind.SEGMENT])
            d = p.decisions.get(path)
            if d is None:
                continue  # vanished between create and scan
            if d.state is State.LIVE:
                lease = SegmentLease(path)
                lease.acquire()
                return lease, read_segment(path), "joined"
            if d.state is State.STALE:
                execute(p, dry_run=False)
                log.info("replaced stale segment %s (%s)", path, d.detail)
                replaced = True
                continue
            raise SegmentConflict(f"{path}: a same-name segment exists and is {d.state} ({d.detail}); "
                                  f"run `kvctl inspect {name}`") from None
        lease = SegmentLease(path)
        lease.acquire()
        return lease, info, "replaced" if replaced else "created"
    raise SegmentConflict(f"{path}: keeps appearing and disappearing; another process is racing us")
