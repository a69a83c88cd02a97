"""Guarded state transitions for the call and stream state enums."""

from __future__ import annotations

import enum
from collections.abc import Mapping, Set
from typing import TypeVar

S = TypeVar("S", bound=enum.Enum)


def checked(who: str, current: S, to: S, allowed: Mapping[S, Set[S]]) -> S:
    """`to` if the table allows current -> to; a programming error otherwise."""
    if to not in allowed[current]:
        raise RuntimeError(f"{who}: {current.value} -> {to.value} is not allowed")
    return to
