"""Integer fields of a frozen config dataclass that declare their own bounds, and the one check of them.

A config declares ``iters: int = bounded(20, low=20)`` and calls ``check_bounds(self)`` from its
``__post_init__``; rules that tie several fields together stay written out there.
"""

from __future__ import annotations

import dataclasses
from typing import Any


def bounded(default: int, *, low: int, power_of_two: bool = False, why: str = "") -> Any:
    """A dataclass field with ``default`` that ``check_bounds`` requires to be an int >= ``low`` and,
    with ``power_of_two``, a power of two; ``why`` (the rule's reason) goes into the error."""
    return dataclasses.field(default=default, metadata={"low": low, "power_of_two": power_of_two, "why": why})


def check_bounds(config: Any) -> None:
    """Raise ``ValueError`` naming the first ``bounded`` field of the dataclass instance ``config``
    that is out of its bounds (``Config.name must be an int >= low, got value``)."""
    for field in dataclasses.fields(config):
        if "low" not in field.metadata:
            continue
        value, low, power_of_two = getattr(config, field.name), field.metadata["low"], field.metadata["power_of_two"]
        if not isinstance(value, int) or value < low or (power_of_two and value & (value - 1)):
            kind = "a power of two" if power_of_two else "an int"
            why = f" ({field.metadata['why']})" if field.metadata["why"] else ""
            raise ValueError(f"{type(config).__name__}.{field.name} must be {kind} >= {low}{why}, got {value!r}")
