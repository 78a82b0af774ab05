"""The `gradsync` logger: quiet by default, detailed on request.

Set `GRADSYNC_DEBUG=INFO` to see construction, bucket rebuilds and stalls, or
`GRADSYNC_DEBUG=DETAIL` to also log every iteration's stats (in the spirit of torch's
`TORCH_DISTRIBUTED_DEBUG`). Or configure the `gradsync` logger with the standard `logging` module
like any other.
"""

from __future__ import annotations

import functools
import logging
import os
import warnings

from ..engine.timeline import IterationTimeline
from .stats import IterationStats

__all__ = ["IterationLog", "configure_from_env", "detail_enabled", "log"]

log = logging.getLogger("gradsync")
log.addHandler(logging.NullHandler())

_LEVELS = {"OFF": None, "INFO": logging.INFO, "DETAIL": logging.DEBUG}


def configure_from_env(value: str | None = None, strict: bool = True) -> int | None:
    """Apply `GRADSYNC_DEBUG` (or `value`); return the level set, None when off. A value not
    understood raises, or with `strict=False` (at import) warns and leaves logging off."""
    value = (value if value is not None else os.environ.get("GRADSYNC_DEBUG", "OFF")).upper()
    if value not in _LEVELS:
        message = f"GRADSYNC_DEBUG={value!r}: expected one of {', '.join(_LEVELS)}"
        if strict:
            raise ValueError(message)
        warnings.warn(message + "; gradsync logging stays off", stacklevel=2)
        return None
    level = _LEVELS[value]
    if level is not None:
        log.setLevel(level)
        if not any(getattr(h, "_gradsync", False) for h in log.handlers):
            handler = logging.StreamHandler()
            handler.setFormatter(logging.Formatter("[gradsync %(levelname)s] %(message)s"))
            handler._gradsync = True  # type: ignore[attr-defined]
            log.addHandler(handler)
    return level


def detail_enabled() -> bool:
    return log.isEnabledFor(logging.DEBUG)


class IterationLog:
    """A Reducer iteration listener: one line of stats per iteration at GRADSYNC_DEBUG=DETAIL.
    `wanted` says when, asked before each call: on a GPU a timeline is resolved (its events
    asked) only for a listener that wants it, and with logging off nothing is called at all."""

    def __init__(self) -> None:
        # the logger's own check, so an iteration with logging off costs one call into logging
        self.wanted = functools.partial(log.isEnabledFor, logging.DEBUG)

    def __call__(self, rank: int, timeline: IterationTimeline) -> None:
        log.debug("rank %d: %s", rank, IterationStats.from_timeline(timeline))
