"""What a browser tab saw while a dashboard test drove it: for the failure message when a page never renders.

A page that does not render in time says little by itself (a Playwright timeout); the tab's console, its
failed requests and how long each Dash callback took (and how it answered) say why: a callback that kept
failing, one that was never answered, or answers slower than the page's refresh, each superseding the last.
"""

from __future__ import annotations

import json
import time
import weakref
from typing import Any

CALLBACK_PATH = "/_dash-update-component"
"""Where Dash's renderer posts each callback."""


class TabWatch:
    """Records a Playwright page's console lines, failed requests and Dash callbacks (with their durations)."""

    def __init__(self, page: Any, *, keep: int = 60) -> None:
        self._t0 = time.monotonic()
        self._keep = keep
        self._started: dict[int, float] = {}
        self.lines: list[str] = []
        """One line per event, oldest first (the newest ``keep``)."""
        page.on("console", lambda msg: self._note(f"console {msg.type}: {msg.text[:300]}"))
        page.on("pageerror", lambda exc: self._note(f"page error: {str(exc)[:300]}"))
        page.on("crash", lambda _page: self._note("the tab crashed"))
        page.on("request", self._request)
        page.on("requestfailed", lambda req: self._done(req, f"failed ({req.failure})"))
        page.on("requestfinished", self._finished)

    def _note(self, line: str) -> None:
        self.lines.append(f"{time.monotonic() - self._t0:7.1f}s {line}")
        del self.lines[:-self._keep]

    def _request(self, request: Any) -> None:
        self._started[id(request)] = time.monotonic()

    def _finished(self, request: Any) -> None:
        if CALLBACK_PATH not in request.url:
            self._started.pop(id(request), None)
            return
        response = request.response()
        self._done(request, f"HTTP {response.status if response else '?'}")

    def _done(self, request: Any, how: str) -> None:
        took = time.monotonic() - self._started.pop(id(request), time.monotonic())
        what = request.url
        if CALLBACK_PATH in request.url:
            try:
                what = "callback " + str(json.loads(request.post_data or "{}").get("output", "?"))[:80]
            except ValueError:
                what = "callback (unreadable body)"
        self._note(f"{what}: {how} after {took:.1f} s")

    def report(self) -> str:
        """The recorded events, one a line (for an assertion message)."""
        return "\n".join(self.lines) or "(the tab recorded nothing)"


_WATCHES: weakref.WeakKeyDictionary[Any, TabWatch] = weakref.WeakKeyDictionary()


def watch(page: Any) -> TabWatch:
    """Start recording what ``page`` sees (once per page; later calls return the same recorder)."""
    if page not in _WATCHES:
        _WATCHES[page] = TabWatch(page)
    return _WATCHES[page]


def seen(page: Any) -> str:
    """What ``page`` saw, if it is watched (for an assertion message)."""
    found = _WATCHES.get(page)
    return found.report() if found is not None else "(the tab was not watched)"
