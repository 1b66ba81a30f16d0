"""The progress bar of ``sfq simulate``: rich, on stderr, drawn only on a terminal (so
piped output and ``--json`` stay byte-identical)."""

from __future__ import annotations

from types import TracebackType
from typing import TYPE_CHECKING, Callable

from .scenarios import Progress

if TYPE_CHECKING:
    from rich.console import Console

__all__ = ["RichProgress"]


class RichProgress(Progress):
    """A rich progress bar on stderr (terminals only): one line per run."""

    def __init__(self, console: Console) -> None:
        from rich.progress import BarColumn, TaskProgressColumn, TextColumn
        from rich.progress import Progress as Bar

        self.bar = Bar(
            TextColumn("{task.description:<22}"),
            BarColumn(),
            TaskProgressColumn(),
            TextColumn("{task.fields[runs]} runs done"),
            console=console,
            transient=True,
            disable=not console.is_terminal,
        )
        self.task = self.bar.add_task("simulating", total=None, runs=0)
        self.runs = 0

    def __enter__(self) -> RichProgress:
        self.bar.__enter__()
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.bar.__exit__(kind, exc, tb)

    def begin(self, label: str, horizon: int | None) -> Callable[[int], None]:
        self.bar.reset(self.task, total=horizon, description=label, runs=self.runs)

        def update(t: int) -> None:
            self.bar.update(self.task, completed=t)

        return update

    def end(self) -> None:
        self.runs += 1
        self.bar.update(self.task, runs=self.runs)
