"""How the demo shows itself: a live status line per act on a terminal, plain lines in a log (CI, pipes).

    view = View(Console())
    with view.act("act 1", "a spine link degrades", 60.0) as status:
        status("waiting for an incident (3 s)")
    view.result(result)
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from ridethrough.demo_act_base import ActResult

_MARK = {"ok": "[green]✔[/]", "missing": "[yellow]∅[/]", "fail": "[red]✘[/]", "info": "[cyan]·[/]"}
PLAIN_EVERY_S = 5.0
"""Without a terminal, a changed status line is printed at most this often."""


class View:
    """The demo's output."""

    def __init__(self, console: Console) -> None:
        self.console = console

    def say(self, text: str) -> None:
        """One line of narration."""
        self.console.print(text, soft_wrap=True, highlight=False)

    @contextlib.contextmanager
    def act(self, label: str, title: str, budget_s: float) -> Iterator[Callable[[str], None]]:
        """A heading, then a status function for the act's live line (a spinner on a terminal)."""
        self.console.rule(f"[bold]{label}[/]: {title} (up to {budget_s:.0f} s)")
        started = time.monotonic()
        if self.console.is_terminal:
            with self.console.status(f"{label}: starting") as live:
                yield lambda text: live.update(escape(f"{label} [{time.monotonic() - started:4.0f} s] {text}"))
            return
        last: dict[str, Any] = {"text": "", "at": 0.0}

        def plain(text: str) -> None:
            now = time.monotonic()
            if text != last["text"] and now - last["at"] >= PLAIN_EVERY_S:
                self.say(escape(f"  [{now - started:4.0f} s] {text}"))
                last.update(text=text, at=now)
        yield plain

    def result(self, res: ActResult) -> None:
        """The act's outcome, line by line."""
        for status, text in res.lines:
            # the texts quote the store (summaries, entity names): brackets there are not markup
            self.console.print(f"  {_MARK.get(status, '?')} {escape(text)}", soft_wrap=True, highlight=False)

    def table(self, title: str, columns: Sequence[str], rows: Sequence[Sequence[str]]) -> None:
        """A small table (the summaries)."""
        table = Table(title=title, title_justify="left")
        for col in columns:
            table.add_column(col)
        for row in rows:
            table.add_row(*row)
        self.console.print(table)
