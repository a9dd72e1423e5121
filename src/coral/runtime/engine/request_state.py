"""One request as its instance scheduler tracks it: where its KV is, what it feeds next, what it made."""

from __future__ import annotations

from dataclasses import dataclass, field

from coral.runtime.protocol import Submit, TokenOut

__all__ = ["RequestState"]


@dataclass(slots=True)
class RequestState:
    """A request held by the scheduler (its fields change as it is batched, preempted, handed off)."""

    submit: Submit
    route: tuple[str, ...] = ()
    position: int = 0  # tokens already in the KV cache
    pending: tuple[int, ...] = ()  # tokens to feed next
    generated: list[int] = field(default_factory=list)
    group: int = -1
    kv_layers: int = 0
    kv_deadline: float = 0.0
    kv_t0: float = 0.0  # when its KV hand-off was asked for (decode side)
    kv_bytes: int = 0  # KV bytes loaded for it so far
    history: tuple[int, ...] = ()  # tokens this route has not been fed (a decode hand-off), sent once
    t_arrived: float = 0.0
    queue_s: float = -1.0  # time from arrival to the first batch (-1 = not yet reported)
    kv_id: str = ""  # the engines' key for this request's KV (changes when it is recomputed)
    admitted: int = 0  # admission order: the youngest is preempted first
    preemptions: int = 0
    first_out: TokenOut | None = None  # decode side: the first token to send once the KV is in (first_token "decode")
