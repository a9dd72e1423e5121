"""GPU types and node configurations (a cloud VM shape: n GPUs of one type)."""
from __future__ import annotations

import re
from dataclasses import dataclass

GIB = 1024**3

_CONFIG_NAME = re.compile(r"^(\d+)x(.+)$")


def gbps_bytes_per_s(gbps: float) -> float:
    """A network bandwidth in Gbit/s (as clouds quote a VM's NIC) as bytes/s: the one conversion."""
    return gbps * 1e9 / 8


@dataclass(frozen=True, slots=True, kw_only=True)
class GpuType:
    """One GPU model and the datasheet figures the performance model needs."""

    name: str
    memory_gib: float
    hbm_gb_per_s: float
    bf16_tflops: float
    fp8_tflops: float | None = None
    intra_node_gb_per_s: float  # nominal (datasheet) link figure; the TP model uses the measured `interconnect`
    interconnect: str = "pcie-helix"  # key into the catalog's interconnects.csv (measured all-reduce fits)

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("GpuType.name must not be empty")
        for field in ("memory_gib", "hbm_gb_per_s", "bf16_tflops", "intra_node_gb_per_s"):
            value = getattr(self, field)
            if not value > 0:
                raise ValueError(f"GpuType {self.name}: {field} must be > 0, got {value}")

    @property
    def memory_bytes(self) -> float:
        return self.memory_gib * GIB


@dataclass(frozen=True, slots=True, kw_only=True)
class NodeConfig:
    """A node configuration `c = (g, n)`: a VM with `count` GPUs of type `gpu`."""

    gpu: GpuType
    count: int
    network_gbps: float
    # > count: this is one tensor-parallel group of `count` GPUs on a node of `node_count` GPUs
    # (the node runs node_count / count such engines); its NIC share is network_gbps.
    node_count: int = 0
    # The cloud instance type this configuration is, where the shape has several sold types and
    # this is not the shape's default (cheapest) one: its name is then `<n>x<GPU>@<type>`.
    instance_type: str = ""
    vcpus: int = 0  # the instance's vCPUs and host memory (0: unknown)
    host_memory_gib: float = 0.0

    def __post_init__(self) -> None:
        if self.count not in (1, 2, 4, 8, 16):
            raise ValueError(f"NodeConfig {self.gpu.name}: GPU count must be 1, 2, 4, 8 or 16, got {self.count}")
        if not self.network_gbps > 0:
            raise ValueError(f"NodeConfig {self.name}: network_gbps must be > 0, got {self.network_gbps}")
        if self.node_count and (self.node_count < self.count or self.node_count % self.count):
            raise ValueError(f"NodeConfig {self.name}: a TP group of {self.count} GPUs must divide its node's "
                             f"{self.node_count}")

    @property
    def name(self) -> str:
        """`4xL40S` for a whole node; `4xL40S/tp1` for one 1-GPU tensor-parallel group of it."""
        return f"{self.node_name}/tp{self.count}" if self.is_group else self.node_name

    @property
    def node_name(self) -> str:
        """The node this configuration runs on (itself unless it is a TP group of a larger node)."""
        typed = f"@{self.instance_type}" if self.instance_type else ""
        return f"{self.node_count if self.is_group else self.count}x{self.gpu.name}{typed}"

    @property
    def shape(self) -> str:
        """`<n>x<GPU>` of the node, without its instance type or TP group."""
        return f"{self.node_count if self.is_group else self.count}x{self.gpu.name}"

    @property
    def is_group(self) -> bool:
        return self.node_count > self.count

    @property
    def groups_per_node(self) -> int:
        return self.node_count // self.count if self.is_group else 1

    def group(self, tp: int) -> NodeConfig:
        """One tensor-parallel group of `tp` of this node's GPUs, with its share of the NIC."""
        if self.is_group:
            raise ValueError(f"{self.name} is already a TP group")
        if tp == self.count:
            return self
        if tp < 1 or self.count % tp:
            raise ValueError(f"TP {tp} does not divide the {self.count} GPUs of {self.name}")
        return NodeConfig(gpu=self.gpu, count=tp, network_gbps=self.network_gbps * tp / self.count,
                          node_count=self.count, instance_type=self.instance_type, vcpus=self.vcpus,
                          host_memory_gib=self.host_memory_gib)

    @property
    def memory_bytes(self) -> float:
        return self.count * self.gpu.memory_bytes

    @property
    def network_bytes_per_s(self) -> float:
        return gbps_bytes_per_s(self.network_gbps)


# All-reduce sizes are referenced to 32 MiB: Llama-70B's activations of a 2,048-token prefill.
LINK_REF_BYTES = 32 * 2**20


@dataclass(frozen=True, slots=True, kw_only=True)
class LinkFit:
    """Measured all-reduce cost on `gpus` GPUs of one node joined by `interconnect`.

    `t(s) = max(floor_s, latency_s + 2(n-1)/n · R/bus · (s/R)^size_exponent)` with `R` = 32 MiB:
    a ring all-reduce whose bus bandwidth (at `R`) and growth with message size are fitted to
    measurements (NCCL reaches more of the link on larger messages), above a latency floor.
    """

    interconnect: str
    gpus: int
    floor_s: float
    latency_s: float
    bus_gb_per_s: float
    size_exponent: float = 1.0
    source: str = ""

    def __post_init__(self) -> None:
        if self.gpus < 2:
            raise ValueError(f"link {self.interconnect}: gpus must be >= 2, got {self.gpus}")
        if not (self.floor_s >= 0 and self.latency_s >= 0):
            raise ValueError(f"link {self.interconnect} x{self.gpus}: floor_s and latency_s must be >= 0")
        if not self.bus_gb_per_s > 0:
            raise ValueError(f"link {self.interconnect} x{self.gpus}: bus_gb_per_s must be > 0")
        if not 0.2 <= self.size_exponent <= 2.0:
            raise ValueError(f"link {self.interconnect} x{self.gpus}: size_exponent must be in [0.2, 2], "
                             f"got {self.size_exponent}")

    def allreduce_s(self, nbytes: float) -> float:
        """Seconds for one all-reduce of `nbytes` (per GPU) over the node's `gpus` GPUs."""
        if nbytes <= 0:
            return 0.0
        ring = 2.0 * (self.gpus - 1) / self.gpus
        t = self.latency_s + ring * LINK_REF_BYTES / (self.bus_gb_per_s * 1e9) * (nbytes / LINK_REF_BYTES) ** self.size_exponent
        return max(self.floor_s, t)


def split_group_name(name: str) -> tuple[str, int | None]:
    """Split `'4xL40S/tp1'` into `('4xL40S', 1)`; a whole node's name gives `(name, None)`."""
    node, sep, tp = name.strip().partition("/tp")
    if not sep:
        return node, None
    if not tp.isdigit():
        raise ValueError(f"TP group {name!r} is not of the form '<n>x<GPU>/tp<t>', e.g. '4xL40S/tp1'")
    return node, int(tp)


def split_config_name(name: str) -> tuple[int, str]:
    """Split `'2xL40S'` into `(2, 'L40S')` (a TP group `'4xL40S/tp1'` gives its node's, an instance
    type `'1xL40S@g6e.4xlarge'` its shape's); raise ValueError on another shape."""
    match = _CONFIG_NAME.match(split_group_name(name)[0].split("@", 1)[0])
    if not match:
        raise ValueError(f"node configuration {name!r} is not of the form '<n>x<GPU>', e.g. '1xL4' or '8xH100'")
    return int(match.group(1)), match.group(2)
