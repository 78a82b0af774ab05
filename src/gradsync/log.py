"""The `gradsync` logger: quiet by default, detailed on request.

Set `GRADSYNC_DEBUG=INFO` to see construction, bucket rebuilds and stalls, or `GRADSYNC_DEBUG=DETAIL`
to also log every iteration's stats (in the spirit of torch's `TORCH_DISTRIBUTED_DEBUG`). Or
configure the `gradsync` logger with the standard `logging` module like any other.
"""

from __future__ import annotations

import logging
import os

__all__ = ["configure_from_env", "detail_enabled", "log"]

log = logging.getLogger("gradsync")
log.addHandler(logging.NullHandler())

_LEVELS = {"OFF": None, "INFO": logging.INFO, "DETAIL": logging.DEBUG}


def configure_from_env(value: str | None = None) -> int | None:
    """Apply `GRADSYNC_DEBUG` (or `value`); return the level set, None when off."""
    value = (value if value is not None else os.environ.get("GRADSYNC_DEBUG", "OFF")).upper()
    if value not in _LEVELS:
        raise ValueError(f"GRADSYNC_DEBUG={value!r}: expected one of {', '.join(_LEVELS)}")
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
