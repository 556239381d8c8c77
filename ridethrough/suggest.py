""""Did you mean …?" hints for an unknown name: config keys, scenario keys, fault kinds, targets."""

from __future__ import annotations

import difflib
from collections.abc import Iterable


def nearest(word: str, candidates: Iterable[str], *, prefix: bool = False) -> str | None:
    """The candidate closest to ``word``, or None if none is close.

    ``prefix``: a candidate that starts ``word`` or that ``word`` starts wins before the
    similarity match (``h`` → ``hosts``, ``link_down_after`` → ``link_down_after_s``).
    """
    options = list(candidates)
    if prefix and word:
        starts = [c for c in options if c.startswith(word) or word.startswith(c)]
        if starts:
            return starts[0]
    match = difflib.get_close_matches(word, options, n=1)
    return match[0] if match else None


def did_you_mean(word: str, candidates: Iterable[str], *, prefix: bool = False, quote: bool = True) -> str:
    """`` (did you mean 'x'?)`` for the `nearest` candidate (``x`` unquoted if not ``quote``), or ``""``."""
    match = nearest(word, candidates, prefix=prefix)
    if match is None:
        return ""
    return f" (did you mean {match!r}?)" if quote else f" (did you mean {match}?)"
