"""The engine nodes of one instance as its scheduler knows them: which said hello, which went silent,
and which node of each stage a new request's route takes (smooth WRR in proportion to node throughput).

Pure bookkeeping, no clock and no socket: :class:`~coral.runtime.engine.scheduling.InstanceScheduler`
passes the time in and decides what a lost node means for its requests.
"""

from __future__ import annotations

from dataclasses import dataclass

from coral.policy import SmoothWRR

__all__ = ["NodeKey", "NodeRoster", "NodeSlot"]

#: (stage, index of the node in its stage)
NodeKey = tuple[int, int]


@dataclass(frozen=True, slots=True, kw_only=True)
class NodeSlot:
    """An engine node the scheduler expects: stage, index in the stage, layers and weight."""

    stage: int
    node_index: int
    layer_start: int
    layer_end: int
    throughput_tok_per_s: float = 1.0


class NodeRoster:
    """Every node of a placement: its address once it said hello, when it was last heard, and the
    nodes each stage still routes to.

    Args:
        nodes: every engine node of the placement (at least one).
    """

    def __init__(self, nodes: list[NodeSlot]) -> None:
        self.slots: dict[NodeKey, NodeSlot] = {(n.stage, n.node_index): n for n in nodes}
        self.num_stages = 1 + max(n.stage for n in nodes)
        self.num_layers = max(n.layer_end for n in nodes)
        self.addresses: dict[NodeKey, str] = {}
        # per stage: node indices in order, and the shared policy's smooth WRR over their throughputs
        self.stage_nodes = [sorted(n.node_index for n in nodes if n.stage == s) for s in range(self.num_stages)]
        self.wrr = [self._wrr(s) for s in range(self.num_stages)]
        self.dead: set[NodeKey] = set()  # nodes lost; their stage still has others
        self.dead_addrs: set[str] = set()
        self.seen: dict[NodeKey, float] = {}  # when each node was last heard

    def _wrr(self, stage: int) -> SmoothWRR:
        return SmoothWRR([self.slots[(stage, k)].throughput_tok_per_s for k in self.stage_nodes[stage]])

    @property
    def complete(self) -> bool:
        """Every expected node said hello."""
        return len(self.addresses) == len(self.slots)

    def hello(self, key: NodeKey, layers: tuple[int, int], address: str, now: float) -> bool:
        """A node's hello: whether it is one the placement expects (stage, index and layers); if so it is
        recorded as heard at ``now``."""
        slot = self.slots.get(key)
        if slot is None or (slot.layer_start, slot.layer_end) != layers:
            return False
        self.addresses[key] = address
        self.seen[key] = now
        return True

    def heard(self, address: str, now: float) -> None:
        """A heartbeat from the node at ``address``."""
        for key, addr in self.addresses.items():
            if addr == address:
                self.seen[key] = now

    def silent(self, now: float, timeout_s: float) -> list[NodeKey]:
        """Live nodes not heard for over ``timeout_s``."""
        return [k for k, t in self.seen.items() if k not in self.dead and now - t > timeout_s]

    def alive(self, key: NodeKey, now: float, timeout_s: float) -> bool:
        """Whether a node said hello and was heard within ``timeout_s`` (worth telling to shut down)."""
        return key in self.seen and now - self.seen[key] <= timeout_s

    def stages_left_empty(self, dead: list[NodeKey]) -> list[int]:
        """The stages that would have no node left were ``dead`` lost too."""
        lost = set(dead) | self.dead
        return [s for s in range(self.num_stages) if all((s, k) in lost for k in self.stage_nodes[s])]

    def remove(self, dead: list[NodeKey]) -> set[str]:
        """Route around ``dead`` from now on (their stages keep other nodes); returns their addresses."""
        self.dead |= set(dead)
        gone = {self.addresses[k] for k in dead if k in self.addresses}
        self.dead_addrs |= gone
        for s in {k[0] for k in dead}:
            self.stage_nodes[s] = [k for k in self.stage_nodes[s] if (s, k) not in self.dead]
            self.wrr[s] = self._wrr(s)
        return gone

    def pick_route(self) -> tuple[str, ...]:
        """A new request's route: one node per stage, each stage's by its smooth WRR."""
        return tuple(self.addresses[(s, self.stage_nodes[s][self.wrr[s].pick()])] for s in range(self.num_stages))

    def stage_layers(self, route: tuple[str, ...]) -> list[tuple[str, int, int]]:
        """Each node of ``route`` with its layer range."""
        by_addr = {a: self.slots[k] for k, a in self.addresses.items()}
        return [(a, by_addr[a].layer_start, by_addr[a].layer_end) for a in route]
