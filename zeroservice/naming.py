"""How error messages name a list of parameters: the first few and how many more."""

from __future__ import annotations


def some_names(names: list[str], shown: int = 3) -> str:
    """``"a, b, c and 4 more"``: a message stays readable for a model of thousands."""
    more = f" and {len(names) - shown} more" if len(names) > shown else ""
    return ", ".join(names[:shown]) + more
