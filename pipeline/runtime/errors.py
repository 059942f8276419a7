"""Walking an exception's causes: the error itself, then what raised it, as Python chains them.

Retry rules and engine-death detection both ask "is this error, or anything that led to it, of
kind X"; ``cause_chain`` is the one walk they share (explicit ``raise ... from`` first, else the
implicit context), and it stops at a cycle.
"""

from __future__ import annotations

from collections.abc import Iterator


def cause_chain(err: BaseException) -> Iterator[BaseException]:
    """``err``, then its ``__cause__`` (else ``__context__``), and so on; each exception once."""
    seen: set[int] = set()
    current: BaseException | None = err
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        yield current
        current = current.__cause__ or current.__context__
