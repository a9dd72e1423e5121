"""An optional host model for the simulator: engine nodes that share a machine's CPU cores."""
from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from coral.policy.routing import InstanceSpec

# (instance spec, stage index, node index in the stage) -> host name
PlaceFn = Callable[[InstanceSpec, int, int], str]
# a constant number of outside runnable threads, or steps (from_s, threads) in time order
Background = float | Sequence[tuple[float, float]]


@dataclass(frozen=True, slots=True, kw_only=True)
class Hosts:
    """Hosts with a number of cores each, and which host every simulated engine node runs on.

    With a host model, a busy node runs at speed `min(1, (cores - taken) / (busy nodes on its
    host + background))` (processor sharing, as a fair CPU scheduler shares cores between
    runnable threads); without one (the default) every node is its own server. Use it when
    engine processes share a machine, as the local runtime does in the fidelity study; a cloud
    cluster with one engine per accelerator does not need it.

    Attributes:
        cores: host name -> cores (a float, so that measured effective cores can be used); > 0.
        place: (instance spec, stage, node index in the stage) -> host name. None: every node
            runs on the only host (then `cores` must name exactly one).
        background: host name -> runnable threads from outside the simulated cluster competing
            for its cores (other jobs on the machine): a number, or steps `((from_s, threads),
            ...)` in increasing time (0 before the first step); default 0.
        taken: host name -> cores that processes outside the simulated cluster were measured to
            use (other jobs on the machine): a number, or steps `((from_s, cores), ...)` in
            increasing time (0 before the first step), each in [0, cores); default 0. Unlike
            `background` (competitors that take a fair share whatever the cluster does), this is
            capacity gone: the cluster's busy nodes share only `cores - taken`.
        frontend_work: CPU seconds a serving front end (HTTP, coordinator, the schedulers'
            per-token work, the client) spends `(per request on arrival, per token)`, on the
            `frontend` host: one more runnable thread there while it has work, so it competes
            with the engine nodes for the same cores (it delays no token itself). Default (0, 0).
        frontend: the host the front end runs on (None: the only host, or the first one).
    """

    cores: Mapping[str, float] = field(default_factory=dict)
    place: PlaceFn | None = None
    background: Mapping[str, Background] = field(default_factory=dict)
    taken: Mapping[str, Background] = field(default_factory=dict)
    frontend_work: tuple[float, float] = (0.0, 0.0)
    frontend: str | None = None

    def __post_init__(self) -> None:
        if not self.cores:
            raise ValueError("Hosts needs at least one host in cores")
        for name, c in self.cores.items():
            if not (isinstance(c, int | float) and math.isfinite(c) and c > 0):
                raise ValueError(f"host {name!r}: cores must be a finite number > 0, got {c!r}")
        if self.place is None and len(self.cores) != 1:
            raise ValueError(f"Hosts with {len(self.cores)} hosts needs a place function")
        bg = {name: self._steps(name, b, "background", math.inf) for name, b in self.background.items()}
        tk = {name: self._steps(name, b, "taken", self.cores.get(name, 0.0)) for name, b in self.taken.items()}
        if len(self.frontend_work) != 2 or not all(isinstance(v, int | float) and math.isfinite(v) and v >= 0
                                                   for v in self.frontend_work):
            raise ValueError(f"frontend_work must be two finite numbers >= 0 (per request, per token), got {self.frontend_work!r}")
        if self.frontend is not None and self.frontend not in self.cores:
            raise ValueError(f"frontend host {self.frontend!r} is not in cores")
        object.__setattr__(self, "frontend_work", (float(self.frontend_work[0]), float(self.frontend_work[1])))
        object.__setattr__(self, "cores", dict(self.cores))
        object.__setattr__(self, "background", bg)
        object.__setattr__(self, "taken", tk)

    def _steps(self, name: str, b: Background, what: str, below: float) -> Background:
        """Validate one host's constant or steps of `what` (each value in [0, below))."""
        if name not in self.cores:
            raise ValueError(f"{what} for unknown host {name!r}")
        steps = [(0.0, b)] if isinstance(b, int | float) else list(b)
        last = -math.inf
        for t, v in steps:
            if not (isinstance(v, int | float) and math.isfinite(v) and 0 <= v < below):
                bound = "" if below == math.inf else f" and < its {below:g} cores"
                raise ValueError(f"host {name!r}: {what} must be a finite number >= 0{bound}, got {v!r}")
            if not t > last:
                raise ValueError(f"host {name!r}: {what} steps must be in increasing time, got {t!r} after {last!r}")
            last = t
        return b if isinstance(b, int | float) else tuple((float(t), float(v)) for t, v in steps)

    @classmethod
    def single(cls, cores: float, name: str = "host", background: Background = 0.0,
               frontend_work: tuple[float, float] = (0.0, 0.0), taken: Background = 0.0) -> Hosts:
        """Every node on one host with `cores` cores (`background` outside threads competing for them,
        `taken` of them used by outside processes)."""
        return cls(cores={name: cores}, background={name: background}, frontend_work=frontend_work, taken={name: taken})

    @property
    def frontend_host(self) -> str:
        return self.frontend if self.frontend is not None else next(iter(self.cores))

    def background_steps(self, name: str) -> tuple[tuple[float, float], ...]:
        """The host's background as steps (from_s, threads); a constant is one step at 0."""
        b = self.background.get(name, 0.0)
        return ((0.0, float(b)),) if isinstance(b, int | float) else tuple(b)  # type: ignore[arg-type]

    def taken_steps(self, name: str) -> tuple[tuple[float, float], ...]:
        """The cores outside processes take from the host, as steps (from_s, cores)."""
        b = self.taken.get(name, 0.0)
        return ((0.0, float(b)),) if isinstance(b, int | float) else tuple(b)  # type: ignore[arg-type]

    def host_of(self, spec: InstanceSpec, stage: int, node: int) -> str:
        """The host of node `node` of stage `stage` of an instance of `spec`.

        Raises:
            ValueError: the place function named a host that `cores` lacks.
        """
        if self.place is None:
            return next(iter(self.cores))
        name = self.place(spec, stage, node)
        if name not in self.cores:
            raise ValueError(f"place() put a node of {spec.key} on unknown host {name!r}; hosts: {', '.join(self.cores)}")
        return name
