"""Progress of ``python -m bench``: a live bar with rich on a terminal, plain lines otherwise.

A full benchmark runs for many minutes (far longer inside the test host), so a terminal shows which
measurement is running, how many are done and an estimate of the time left, with each result printed above
the bar as it comes. When stderr is not a terminal (CI logs, pipes) or rich is not installed, every line is
printed as ``bench: ...``, exactly as before, one per measurement.
"""

from __future__ import annotations

import os
import sys
from typing import Any, Protocol, TextIO

__all__ = ["Display", "PlainDisplay", "RichDisplay", "make_display"]


class Display(Protocol):
    """Where the benchmark reports its progress."""

    def message(self, text: str) -> None:
        """A line of news: a measurement's result, or a status message."""

    def started(self, index: int, total: int, label: str) -> None:
        """Measurement ``index`` of ``total`` (1-based) is starting."""

    def close(self) -> None:
        """The benchmark is over (or interrupted): leave the terminal clean."""


class PlainDisplay:
    """One ``bench: ...`` line per message; nothing for a measurement that starts."""

    def __init__(self, stream: TextIO) -> None:
        self._stream = stream

    def message(self, text: str) -> None:
        """Print ``bench: text``."""
        print(f"bench: {text}", file=self._stream, flush=True)

    def started(self, index: int, total: int, label: str) -> None:
        """Nothing: the line comes when the measurement ends."""

    def close(self) -> None:
        """Nothing to clean up."""


class RichDisplay:
    """A rich progress bar over the measurements, with the messages scrolling above it."""

    def __init__(self, stream: TextIO) -> None:
        from rich.console import Console
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeElapsedColumn,
            TimeRemainingColumn,
        )

        self._progress: Any = Progress(
            TextColumn("[bold]bench[/]"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            TextColumn("left"),
            TimeRemainingColumn(),
            TextColumn("{task.description}"),
            console=Console(file=stream),
            transient=True,  # the bar goes when done; the result lines and the table stay
        )
        self._task: Any = None
        self._progress.start()

    def message(self, text: str) -> None:
        """Print the line above the bar."""
        self._progress.console.print(text, markup=False, highlight=False)

    def started(self, index: int, total: int, label: str) -> None:
        """Move the bar to ``index - 1`` done and name the measurement that runs."""
        if self._task is None:
            self._task = self._progress.add_task(label, total=total)
        self._progress.update(self._task, completed=index - 1, total=total, description=label)

    def close(self) -> None:
        """Stop the live display."""
        self._progress.stop()


def make_display(stream: TextIO | None = None, *, live: bool | None = None) -> Display:
    """The display for ``stream`` (stderr by default): rich when it is a terminal and rich is installed.

    ``live`` forces the choice (True still falls back to plain lines without rich).
    """
    stream = sys.stderr if stream is None else stream
    if live is None:
        live = stream.isatty() and os.environ.get("TERM") != "dumb"
    if live:
        try:
            return RichDisplay(stream)
        except ImportError:
            pass
    return PlainDisplay(stream)
