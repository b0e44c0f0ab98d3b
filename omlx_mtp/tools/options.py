"""Range checks for the command line's numeric options: one place, one message shape.

argparse checks types only, so ``--seed -1``, ``--temp nan`` or ``--max-tokens 0`` would reach mlx
(or a division) and end in a traceback.  Each command lists its options' ranges; ``check_args``
refuses the first value out of range with an ``MTPError`` that names the option and the range."""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..errors import MTPError


@dataclass(frozen=True)
class Range:
    """Inclusive ``low``/``high`` bounds (None: unbounded); ``above``: an exclusive lower bound."""

    low: float | None = None
    high: float | None = None
    above: float | None = None

    def describe(self, integer: bool) -> str:
        kind = "an integer" if integer else "a finite number"
        if self.above is not None:
            return f"{kind} greater than {self.above}" + (f" and at most {self.high}" if self.high is not None else "")
        if self.low is not None and self.high is not None:
            return f"{kind} between {self.low} and {self.high}"
        if self.low is not None:
            return f"{kind} of at least {self.low}"
        if self.high is not None:
            return f"{kind} of at most {self.high}"
        return kind

    def holds(self, value) -> bool:
        return ((self.low is None or value >= self.low) and (self.high is None or value <= self.high)
                and (self.above is None or value > self.above))


def check(option: str, value, allowed: Range):
    """``value`` when it is finite and within ``allowed``, else an MTPError naming ``option``
    (None, an option left unset, passes)."""
    if value is None:
        return value
    integer = isinstance(value, int)
    # NaN compares false with everything, so it is tested first rather than left to the bounds
    if not integer and not math.isfinite(value) or not allowed.holds(value):
        raise MTPError(f"{option}: expected {allowed.describe(integer)}, got {value}")
    return value


def check_args(args, ranges: dict[str, Range]) -> None:
    """Check each ``args.<dest>`` named in ``ranges``; the option is spelled ``--dest-with-dashes``."""
    for dest, allowed in ranges.items():
        check("--" + dest.replace("_", "-"), getattr(args, dest, None), allowed)
