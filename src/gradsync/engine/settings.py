"""What the Reducer's phases read of its settings, in one object they share.

The frozen `ReducerConfig` says what the user asked for; `Settings` adds what follows from it
and from the calls that change between iterations (`Reducer.configure`, `register_comm_hook`,
`set_static_graph`): the clock in use, whether reports are read back deferred, the hook, the
static graph. The Reducer owns it and changes it only between iterations; the phases
(`reductions.Reductions`, `prepare`) are handed it at construction and read it, never the
Reducer.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable

import torch.distributed as dist

from .comm import CommHook
from .config import RUNTIME_FIELDS, ReducerConfig
from .device import host_runs_collectives
from .events import EventClock
from .static_graph import StaticGraph

__all__ = ["Settings", "changed_config", "no_clock"]


def no_clock() -> int:
    return 0


@dataclasses.dataclass(eq=False)
class Settings:
    """The Reducer's settings as the phases read them."""

    config: ReducerConfig
    device_clock: EventClock | None
    """CUDA-event time, with parameters on a GPU (or a clock given as one)."""
    clock: Callable[[], int] = no_clock
    """The timeline's clock: the device's, the configured one, or none (not recording)."""
    defer: bool = False
    """Reports read back once landed, not at the end of backward."""
    comm_hook: tuple[object, CommHook] | None = None
    static: StaticGraph | None = None
    find_unused: bool = False
    casts_to_reduce_dtype: bool = False
    """Buckets are cast to `config.reduce_dtype` to be reduced (mixed precision)."""
    divides_after_sum: bool = False
    """Mixed precision: gradients go in undivided, each bucket's sum is divided once landed."""
    device_timed: bool = False
    """The timeline is timed by the device's clock (`clock is device_clock`)."""

    @classmethod
    def of(cls, config: ReducerConfig, group: dist.ProcessGroup, device_clock: EventClock | None,
           param_dtype: object, n_params: int) -> Settings:
        settings = cls(config, device_clock, find_unused=config.find_unused_parameters,
                       static=StaticGraph(n_params) if config.static_graph else None,
                       casts_to_reduce_dtype=config.casts_to_reduce(param_dtype),  # type: ignore[arg-type]
                       divides_after_sum=(config.bucket_dtype is not None
                                          or config.reduce_dtype is not None))
        settings.reconfigure(config, group)
        return settings

    def reconfigure(self, config: ReducerConfig, group: dist.ProcessGroup) -> None:
        """Take a changed config (`RUNTIME_FIELDS`): the clock and the read-back follow it."""
        self.config = config
        self.clock = recording_clock(config, self.device_clock)
        self.device_timed = self.clock is self.device_clock
        self.defer = (not host_runs_collectives(group) if config.read_back == "auto"
                      else config.read_back == "deferred")

    def make_static(self, n_params: int) -> ReducerConfig:
        """static_graph on (it replaces the unused-parameter search); the new config."""
        self.config = dataclasses.replace(self.config, static_graph=True,
                                          find_unused_parameters=False)
        self.static, self.find_unused = StaticGraph(n_params), False
        return self.config


def changed_config(config: ReducerConfig, changes: dict[str, object]) -> ReducerConfig:
    """`config` with `changes` (`RUNTIME_FIELDS` only: the rest shapes the buckets), validated
    as the frozen config validates itself."""
    fixed = sorted(set(changes) - RUNTIME_FIELDS)
    if fixed:
        raise ValueError(
            f"Reducer.configure: {', '.join(fixed)} cannot change after construction "
            f"(they shape the buckets); changeable: {', '.join(sorted(RUNTIME_FIELDS))}"
        )
    return dataclasses.replace(config, **changes)  # type: ignore[arg-type]


def recording_clock(config: ReducerConfig, device_clock: EventClock | None) -> Callable[[], int]:
    if not config.record_events:
        return no_clock
    # not the user's own
    if device_clock is not None and config.clock in (time.perf_counter_ns, device_clock):
        return device_clock
    return config.clock
