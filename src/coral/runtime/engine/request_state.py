"""One request as its instance scheduler tracks it: where its KV is, what it feeds next, what it made.

Also the chunked-prefill rule (vLLM's ``--enable-chunked-prefill``, Sarathi-Serve): a step carries every
running decode plus at most ``chunk_tokens`` prompt tokens, so a long prompt is fed over several steps,
its KV built chunk by chunk, and the decodes sharing those steps are never held up by a whole prompt.
"""

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
    chunk: int = 0  # tokens of `pending` its next (or in-flight) step carries

    @property
    def prefilling(self) -> bool:
        """Its next step feeds its prompt (or, recomputed, its prompt and output), not one generated token."""
        return len(self.pending) > 1 or not self.generated

    def plan_chunk(self, budget: int | None) -> int:
        """Set :attr:`chunk` for the next step and return it.

        Args:
            budget: prompt tokens the step may still carry (None: no chunking, a prompt goes whole).
                A decode (one generated token) is not charged: it always goes.

        Returns:
            The tokens the step carries for this request (0: it waits for the next step).
        """
        whole = len(self.pending)
        self.chunk = whole if budget is None or not self.prefilling else min(whole, budget)
        return self.chunk

    @property
    def chunk_is_partial(self) -> bool:
        """The step carries only part of `pending`: no token comes of it (the sampled one is dropped)."""
        return self.chunk < len(self.pending)
