"""What the front end's parts share: its client-facing options, and the state its handlers read."""

from __future__ import annotations

from dataclasses import dataclass, field

from coral.runtime.serving.admin import PlanAdmin
from coral.runtime.serving.coordinator import Coordinator
from coral.runtime.serving.metrics import FleetStats, ServingMetrics
from coral.runtime.serving.tokenizer import ByteTokenizer, Tokenizer

__all__ = ["MAX_BODY_BYTES", "ServerOptions", "ServerState"]

MAX_BODY_BYTES = 8 * 1024 * 1024


@dataclass(frozen=True, slots=True, kw_only=True)
class ServerOptions:
    """How the front end treats clients."""

    api_key: str | None = None  # if set, /v1/* needs "Authorization: Bearer <api_key>"
    admin_key: str | None = None  # bearer key of /admin/* (default api_key)
    metrics_require_key: bool = False  # /metrics is open by default (Prometheus scrapes it)
    max_body_bytes: int = MAX_BODY_BYTES  # larger bodies get 413 and the connection is closed
    token_timeout_s: float = 60.0  # longest wait for a request's next token (then 504)
    idle_timeout_s: float = 5.0  # a connection without a request this long is closed
    header_timeout_s: float = 10.0  # a request head must arrive within this
    body_timeout_s: float = 30.0  # each read of a request body must complete within this
    body_deadline_s: float = 30.0  # the whole body must arrive within this of its head (else 408)
    backlog: int = 4096  # listen queue (the kernel caps it at net.core.somaxconn)
    retry_after_s: int = 5  # the Retry-After of a 503 while the server drains to stop

    def __post_init__(self) -> None:
        for name in ("token_timeout_s", "idle_timeout_s", "header_timeout_s", "body_timeout_s", "body_deadline_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.max_body_bytes < 1024 or self.backlog < 1:
            raise ValueError("max_body_bytes must be >= 1024 and backlog >= 1")


@dataclass(slots=True)
class ServerState:
    """The handlers' shared state (the coordinator is swapped in when a restarted one takes over)."""

    coord: Coordinator
    options: ServerOptions
    metrics: ServingMetrics
    tokenizers: dict[str, Tokenizer]
    admin: PlanAdmin | None
    created: int
    default_tokenizer: Tokenizer = field(default_factory=ByteTokenizer)

    def tokenizer(self, model: str) -> Tokenizer:
        return self.tokenizers.get(model, self.default_tokenizer)

    def fleet_stats(self) -> FleetStats:
        """What /metrics reports of the fleet: the plan controller's view, else the coordinator's alone."""
        return self.admin.fleet_stats() if self.admin is not None else self.coord.fleet_stats()

    def health(self) -> dict[str, str]:
        """model -> ok | degraded | unavailable | starting (the controller knows the repairs under way)."""
        return self.admin.health() if self.admin is not None else self.coord.health()
