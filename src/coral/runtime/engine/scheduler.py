"""The instance scheduler's process shell: the transport and the clock around its decisions.

One process (or thread) per instance. :class:`Scheduler` receives each message, hands it with
the time to the pure :class:`~coral.runtime.engine.scheduling.InstanceScheduler`, sends what
that decides, then gives it the time again (deadlines, heartbeats, the next micro-batches):
the decisions themselves (batching, KV blocks, preemption, the prefill -> decode hand-off,
node loss) are described and tested in :mod:`coral.runtime.engine.scheduling`.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from coral.runtime.engine.scheduling import InstanceScheduler, NodeSlot, Send
from coral.runtime.transport import Transport

__all__ = ["NodeSlot", "Scheduler"]


class Scheduler:
    """The message loop of one instance's scheduler: sockets and the clock, nothing decided here."""

    def __init__(self, transport: Transport, *, clock: Callable[[], float] = time.monotonic, **options: Any) -> None:
        """Args:
        transport: the scheduler's inbox (its address is the instance's).
        clock: the time the decisions are given (seconds, monotonic).
        options: :class:`~coral.runtime.engine.scheduling.InstanceScheduler`'s arguments but
            ``address`` (instance_id, model, phase, region, throughput_tok_per_s, nodes,
            coordinator, micro_batches, batch limits, timeouts, step_trace).
        """
        self.t = transport
        self.clock = clock
        self.core = InstanceScheduler(address=transport.address, **options)
        self.stop_event = threading.Event()

    def run(self, poll_s: float = 0.05) -> None:
        """Serve messages until :class:`~coral.runtime.protocol.Shutdown`, a failure, or ``stop_event``."""
        while not self.stop_event.is_set():
            msg = self.t.recv(poll_s)
            if msg is not None:
                self._send(self.core.handle(msg, self.clock()))
            if self.core.stopped:
                break
            self._send(self.core.step(self.clock()))
            if self.core.stopped:
                break

    def _send(self, out: list[Send]) -> None:
        for address, msg in out:
            self.t.send(address, msg)
