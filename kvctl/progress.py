"""gc's progress on a terminal: a transient count of entries on stderr while it removes (rich)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvcached.node import Action

if TYPE_CHECKING:
    from kvcached.node import Entry

_GONE = (Action.REMOVED, Action.WOULD_REMOVE)


class Progress:
    """Counts the entries gc reports (`progress(entry)`) and shows the count every 64 entries."""

    def __init__(self) -> None:
        from rich.console import Console
        from rich.progress import Progress as Bar
        from rich.progress import SpinnerColumn, TextColumn, TimeElapsedColumn

        self.bar = Bar(SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(),
                       console=Console(stderr=True), transient=True)
        self.task = self.bar.add_task("gc: starting")
        self.seen = self.removed = 0

    def __call__(self, e: Entry) -> None:
        self.seen += 1
        self.removed += e.action in _GONE
        if self.seen % 64 == 0:
            self.bar.update(self.task, description=f"gc: {self.seen} entries, {self.removed} removed")

    def __enter__(self) -> Progress:
        self.bar.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.bar.stop()
