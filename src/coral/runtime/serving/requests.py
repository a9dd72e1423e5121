"""What the front end holds of a request: the served model's limits, the handle its tokens arrive on, a refusal."""

from __future__ import annotations

import queue
from collections.abc import Callable
from dataclasses import dataclass, field

from coral.errors import CoralError
from coral.runtime.protocol import SamplingParams, TokenOut
from coral.runtime.serving.window import WindowEntry

__all__ = ["ModelInfo", "RequestError", "RequestHandle"]


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelInfo:
    """A served model, as the front end needs to know it."""

    name: str
    max_context: int
    vocab_size: int
    eos_ids: tuple[int, ...] = ()
    # which instance emits a request's first token when prefill and decode are separate instances:
    # "prefill" as soon as it is sampled (the KV transfer counts in TPOT), "decode" once the decode
    # instance holds the KV (it counts in TTFT, as vLLM's P/D proxy); the plan file's `first_token`
    first_token: str = "prefill"

    def __post_init__(self) -> None:
        if self.max_context < 2 or self.vocab_size < 1:
            raise ValueError(f"model {self.name!r}: max_context must be >= 2 and vocab_size >= 1")
        if self.first_token not in ("prefill", "decode"):
            raise ValueError(f"model {self.name!r}: first_token must be prefill or decode, got {self.first_token!r}")


class RequestError(CoralError):
    """A request the coordinator refuses; carries the HTTP status and the offending field."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code


@dataclass(slots=True)
class RequestHandle:
    """One accepted request: where its tokens arrive, its timings, and where it runs now."""

    request_id: str
    model: str
    prompt_len: int
    queue: queue.Queue[TokenOut]
    t_start: float
    instance_id: str
    t_first: float = 0.0
    t_last: float = 0.0
    n_tokens: int = 0
    # coordinator side (under the coordinator's lock)
    prompt: tuple[int, ...] = ()
    max_tokens: int = 0
    temperature: float = 0.0
    seed: int = 0
    eos_ids: tuple[int, ...] = ()
    decode_instance: str = ""
    wire_id: str = ""  # the id of the current attempt (retries get a new one)
    generated: list[int] = field(default_factory=list)
    attempt_tokens: int = 0  # of ``generated``, the tokens the current attempt sent
    retries: int = 0
    done: bool = False
    retry_deadline: float = 0.0
    error_status: int = 500
    sampling: SamplingParams | None = None
    #: called (on the coordinator's thread) with each TokenOut instead of putting it on ``queue``
    sink: Callable[[TokenOut], None] | None = None
    window: WindowEntry | None = None  # its row in the live planner's window (settled when it is closed)

    def deliver(self, msg: TokenOut) -> None:
        """Hand one message to whoever reads this request."""
        if self.sink is not None:
            self.sink(msg)
        else:
            self.queue.put(msg)

