"""The catalog: GPU types, node configurations, regions and their prices, with loaders."""
from __future__ import annotations

import csv
import dataclasses
import difflib
import functools
import io
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

from coral.catalog.hardware import GpuType, LinkFit, NodeConfig, split_config_name, split_group_name
from coral.catalog.spot import SpotOffer, SpotProcess, fitted_process
from coral.errors import CoralError, unknown

_CONFIG_LIKE = re.compile(r"^\d+x")


def did_you_mean(name: str, valid: Iterable[str]) -> str:
    """`"; did you mean 'x'?"` for the closest of `valid`, or "" when none is close."""
    close = difflib.get_close_matches(name, list(valid), n=1)
    return f"; did you mean {close[0]!r}?" if close else ""

# Network of a VM whose bandwidth the catalog does not know (GCP N1 hosts of T4/V100):
# N1 VMs with 8+ vCPUs get 16 Gbps egress, smaller ones less; 10 is a conservative guess.
DEFAULT_NETWORK_GBPS = 10.0


@dataclass(frozen=True, slots=True, kw_only=True)
class Offer:
    """A configuration sold in a region: its cheapest instance type and $/h."""

    region: str
    config: str
    instance_type: str
    price_usd_per_h: float
    spot_usd_per_h: float | None = None
    network_gbps: float = DEFAULT_NETWORK_GBPS
    suspect: str = ""  # the data's `[SUSPECT ...]` note on the row this price comes from; "" when none
    vcpus: int = 0
    memory_gib: float = 0.0

    def __post_init__(self) -> None:
        if not self.price_usd_per_h >= 0 or self.price_usd_per_h == float("inf"):
            raise ValueError(f"offer {self.region}/{self.config}: price_usd_per_h must be a finite number >= 0")


@dataclass(frozen=True, slots=True, kw_only=True)
class Catalog:
    """GPU types, node configurations and per-region offers, looked up by name."""

    gpus: Mapping[str, GpuType]
    configs: Mapping[str, NodeConfig]
    offers: Mapping[tuple[str, str], Offer] = field(default_factory=dict)
    aliases: Mapping[str, str] = field(default_factory=dict)

    @property
    def regions(self) -> tuple[str, ...]:
        return tuple(sorted({r for r, _ in self.offers}))

    def gpu(self, name: str) -> GpuType:
        key = self.aliases.get(name, name)
        if key not in self.gpus:
            raise unknown("GPU", name, self.gpus)
        return self.gpus[key]

    def config(self, name: str) -> NodeConfig:
        node, tp = split_group_name(name)
        if tp is not None:
            base = self.config(node)
            try:
                return base.group(tp)
            except ValueError as exc:
                raise CoralError(str(exc)) from None
        if "@" in name:
            shape, _, itype = name.partition("@")
            try:
                base = self.config(shape)
            except CoralError:
                raise unknown("configuration", name, self.configs) from None
            key = f"{base.name}@{itype}"
            if key in self.configs:
                return self.configs[key]
            if any(o.instance_type == itype for (_, c), o in self.offers.items() if c == base.name):
                return base  # the shape's default (cheapest) type in some region
            sold = sorted({o.instance_type for (_, c), o in self.offers.items()
                           if c == base.name or c.startswith(base.name + "@")})
            raise CoralError(f"unknown instance type {itype!r} for {base.name}{did_you_mean(itype, sold)}; "
                             f"its sold types: {', '.join(sold) or '(none)'}")
        if not _CONFIG_LIKE.match(name.strip()):
            typed = self.by_instance_type(name.strip())
            if typed is not None:
                return typed
        try:
            count, gpu = split_config_name(name)
        except ValueError as exc:
            raise CoralError(f"{exc}; valid configurations: {', '.join(sorted(self.configs))}") from None
        key = f"{count}x{self.aliases.get(gpu, gpu)}"
        if key in self.configs:
            return self.configs[key]
        gpu_name = self.aliases.get(gpu, gpu)
        if gpu_name in self.gpus and count in (1, 2, 4, 8):
            # A shape no region sells (e.g. 2xL40S on AWS) is still a valid node; a scenario
            # must price it. It is a part of the nearest larger sold node of the same GPU (as its
            # derived price is), so it gets that node's NIC share; with none larger, the nearest
            # smaller node's NIC.
            nodes = sorted((c.count, c.network_gbps) for c in self.configs.values()
                           if c.gpu.name == gpu_name and not c.instance_type)
            larger = [x for x in nodes if x[0] > count]
            if larger:
                n, gbps = larger[0]
                nic = gbps * count / n
            else:
                nic = nodes[-1][1] if nodes else DEFAULT_NETWORK_GBPS
            return NodeConfig(gpu=self.gpus[gpu_name], count=count, network_gbps=nic)
        raise unknown("configuration", name, self.configs)

    def by_instance_type(self, itype: str) -> NodeConfig | None:
        """The configuration an instance type's offers are under (`g6e.4xlarge` -> `1xL40S@g6e.4xlarge`,
        or the shape itself where it is the cheapest), or None when no region sells it."""
        names = sorted({c for (_, c), o in self.offers.items() if o.instance_type == itype}, key=lambda c: ("@" not in c, c))
        return self.configs[names[0]] if names else None

    def types_of(self, shape: str, regions: Iterable[str] | None = None) -> tuple[str, ...]:
        """The configurations of `shape`'s other sold instance types (`<shape>@<type>`), in
        `regions` (default: any), cheapest first."""
        want = set(regions) if regions is not None else None
        found: dict[str, float] = {}
        for (region, name), offer in self.offers.items():
            if name.startswith(shape + "@") and (want is None or region in want):
                found[name] = min(found.get(name, float("inf")), offer.price_usd_per_h)
        return tuple(sorted(found, key=lambda n: (found[n], n)))

    def check_region(self, region: str) -> str:
        if region not in self.regions:
            raise unknown("region", region, self.regions)
        return region

    def offer(self, region: str, config: str) -> Offer | None:
        """The offer of `config` in `region`, or None where that region does not sell it."""
        return self.offers.get((self.check_region(region), self.config(config).name))

    def spot_offer(self, region: str, config: str, process: SpotProcess | None = None) -> SpotOffer | None:
        """The spot offer beside `config`'s on-demand one in `region`: its spot price and the spot
        process (`process`, default the region's fit, `coral.catalog.spot.fitted_process`); None
        where the region does not sell it or has no spot price for it."""
        offer = self.offer(region, config)
        if offer is None or offer.spot_usd_per_h is None:
            return None
        return SpotOffer(region=offer.region, config=offer.config, instance_type=offer.instance_type,
                         spot_usd_per_h=offer.spot_usd_per_h, on_demand_usd_per_h=offer.price_usd_per_h,
                         process=process or fitted_process(offer.region))

    def configs_in(self, region: str) -> tuple[str, ...]:
        self.check_region(region)
        return tuple(sorted(c for r, c in self.offers if r == region))


def _read_csv(text: str) -> list[dict[str, str]]:
    lines = [ln for ln in text.splitlines() if ln.strip() and not ln.lstrip().startswith("#")]
    return list(csv.DictReader(io.StringIO("\n".join(lines))))


def _float(row: Mapping[str, str], key: str, where: str, required: bool = True) -> float | None:
    raw = (row.get(key) or "").strip()
    if not raw:
        if required:
            raise CoralError(f"{where}: column {key!r} is empty")
        return None
    try:
        value = float(raw)
    except ValueError:
        raise CoralError(f"{where}: column {key!r} is {raw!r}, not a number") from None
    if value != value or value in (float("inf"), float("-inf")) or value < 0:
        raise CoralError(f"{where}: column {key!r} must be a finite number >= 0, got {raw!r}")
    return value


def load_gpus_csv(text: str, where: str = "gpus.csv") -> tuple[dict[str, GpuType], dict[str, str]]:
    """Parse our GPU table (`name,memory_gib,hbm_gb_per_s,bf16_tflops,fp8_tflops,intra_node_gb_per_s,
    [interconnect,]aliases`); `interconnect` names the GPU's row group in interconnects.csv (default
    pcie-helix, the PCIe link of GPUs without a measured collective)."""
    gpus: dict[str, GpuType] = {}
    aliases: dict[str, str] = {}
    for i, row in enumerate(_read_csv(text), start=2):
        at = f"{where} row {i}"
        try:
            gpu = GpuType(
                name=row["name"].strip(),
                memory_gib=_float(row, "memory_gib", at) or 0.0,
                hbm_gb_per_s=_float(row, "hbm_gb_per_s", at) or 0.0,
                bf16_tflops=_float(row, "bf16_tflops", at) or 0.0,
                fp8_tflops=_float(row, "fp8_tflops", at, required=False),
                intra_node_gb_per_s=_float(row, "intra_node_gb_per_s", at) or 0.0,
                interconnect=(row.get("interconnect") or "").strip() or "pcie-helix",
            )
        except (KeyError, ValueError) as exc:
            raise CoralError(f"{at}: {exc}") from None
        gpus[gpu.name] = gpu
        for alias in (row.get("aliases") or "").split("|"):
            if alias.strip():
                aliases[alias.strip()] = gpu.name
    return gpus, aliases


def parse_offers(rows: Iterable[Mapping[str, str]], gpus: Mapping[str, GpuType], aliases: Mapping[str, str],
                 where: str) -> list[tuple[Offer, str, int]]:
    """Rows of our price CSV (the columns of `gpu_nodes.csv`) -> offers: per region, the cheapest
    instance type of each shape as `<n>x<GPU>`, and every other sold type of it as
    `<n>x<GPU>@<type>` (its own NIC, vCPUs, memory and price)."""
    every: dict[tuple[str, str, str], tuple[Offer, str, int]] = {}
    for i, row in enumerate(rows, start=2):
        at = f"{where} row {i}"
        missing = [k for k in ("cloud", "region", "instance_type", "gpu", "gpu_count", "price_per_hour") if k not in row]
        if missing:
            raise CoralError(f"{where}: missing columns {missing}; expected the columns of gpu_nodes.csv")
        gpu = aliases.get(row["gpu"].strip(), row["gpu"].strip())
        if gpu not in gpus:
            continue  # a GPU the catalog has no specs for cannot be modelled; skip it
        try:
            count = int(row["gpu_count"])
        except ValueError:
            raise CoralError(f"{at}: gpu_count {row['gpu_count']!r} is not an integer") from None
        if count not in (1, 2, 4, 8):
            continue
        region = f"{row['cloud'].strip()}:{row['region'].strip()}"
        config = f"{count}x{gpu}"
        offer = Offer(
            region=region, config=config, instance_type=row["instance_type"].strip(),
            price_usd_per_h=_float(row, "price_per_hour", at) or 0.0,
            spot_usd_per_h=_float(row, "spot_price_per_hour", at, required=False),
            network_gbps=_float(row, "network_gbps", at, required=False) or DEFAULT_NETWORK_GBPS,
            suspect=(row.get("suspect") or "").strip(),
            vcpus=int(_float(row, "vcpus", at, required=False) or 0),
            memory_gib=_float(row, "memory_gib", at, required=False) or 0.0,
        )
        key = (region, config, offer.instance_type)
        if key not in every or offer.price_usd_per_h < every[key][0].price_usd_per_h:
            every[key] = (offer, gpu, count)
    cheapest: dict[tuple[str, str], Offer] = {}
    for (region, config, _), (offer, _, _) in sorted(every.items()):
        if (region, config) not in cheapest or offer.price_usd_per_h < cheapest[(region, config)].price_usd_per_h:
            cheapest[(region, config)] = offer
    out = []
    for (region, config, itype), (offer, gpu, count) in sorted(every.items()):
        if cheapest[(region, config)] is not offer:
            offer = dataclasses.replace(offer, config=f"{config}@{itype}")
        out.append((offer, gpu, count))
    return out


def build_catalog(gpus: Mapping[str, GpuType], aliases: Mapping[str, str],
                  offers: Iterable[tuple[Offer, str, int]]) -> Catalog:
    """Assemble a catalog; a shape's network is the lowest of its cheapest offers over the regions
    (an instance type's is its own)."""
    offer_map: dict[tuple[str, str], Offer] = {}
    network: dict[str, float] = {}
    shape: dict[str, tuple[str, int, Offer]] = {}
    for offer, gpu, count in offers:
        offer_map[(offer.region, offer.config)] = offer
        network[offer.config] = min(network.get(offer.config, float("inf")), offer.network_gbps)
        shape[offer.config] = (gpu, count, offer)
    configs = {}
    for name, (g, n, o) in sorted(shape.items(), key=lambda kv: (kv[1][0], kv[1][1], kv[0])):
        typed = "@" in name
        configs[name] = NodeConfig(gpu=gpus[g], count=n, network_gbps=network[name],
                                   instance_type=o.instance_type if typed else "",
                                   vcpus=o.vcpus if typed else 0, host_memory_gib=o.memory_gib if typed else 0.0)
    return Catalog(gpus=dict(gpus), configs=configs, offers=offer_map, aliases=dict(aliases))


def load_prices_csv(path: str | Path, catalog: Catalog) -> Catalog:
    """Replace the catalog's offers with those of a price CSV in our format (`gpu_nodes.csv` columns).

    Raises:
        CoralError: if the file is missing or malformed, naming the row and column.
    """
    p = Path(path)
    if not p.exists():
        raise CoralError(f"price file {p} does not exist")
    rows = _read_csv(p.read_text())
    if rows and "AcceleratorName" in rows[0]:
        return load_skypilot_vms_csv(p, catalog)
    return build_catalog(catalog.gpus, catalog.aliases, parse_offers(rows, catalog.gpus, catalog.aliases, str(p)))


# SkyPilot's accelerator names -> ours.
_SKYPILOT_GPU = {"A100": "A100-40GB", "A100-80GB": "A100-80GB", "V100": "V100-16GB", "V100-32GB": "V100-32GB",
                 "H100": "H100", "H100-MEGA": "H100", "H200": "H200", "B200": "B200", "L4": "L4",
                 "L40S": "L40S", "A10G": "A10G", "T4": "T4"}


def load_skypilot_vms_csv(path: str | Path, catalog: Catalog, cloud: str | None = None) -> Catalog:
    """Read a SkyPilot catalog `vms.csv` (columns InstanceType, AcceleratorName, AcceleratorCount,
    Price, SpotPrice, Region, ...). AWS-style rows carry the whole VM price; the per-zone rows are
    reduced to one offer per (region, configuration): the cheapest instance type.
    """
    p = Path(path)
    rows = _read_csv(p.read_text())
    cloud_name = cloud or ("gcp" if "gcp" in str(p).lower() else "aws")
    converted = []
    for row in rows:
        acc = (row.get("AcceleratorName") or "").strip()
        if not acc or not (row.get("Price") or "").strip() or not (row.get("InstanceType") or "").strip():
            continue
        count_raw = (row.get("AcceleratorCount") or "0").strip()
        converted.append({
            "cloud": cloud_name, "region": row.get("Region", "").strip(), "instance_type": row["InstanceType"],
            "gpu": _SKYPILOT_GPU.get(acc, acc), "gpu_count": str(int(float(count_raw))),
            "price_per_hour": row["Price"], "spot_price_per_hour": row.get("SpotPrice", ""),
        })
    return build_catalog(catalog.gpus, catalog.aliases, parse_offers(converted, catalog.gpus, catalog.aliases, str(p)))


def load_interconnects_csv(text: str, where: str = "interconnects.csv") -> dict[tuple[str, int], LinkFit]:
    """Parse the all-reduce fits (`interconnect,gpus,floor_us,latency_us,bus_gb_per_s,size_exponent,source`).

    Raises:
        CoralError: naming the row and column of a missing or bad value, or a repeated (interconnect, gpus).
    """
    out: dict[tuple[str, int], LinkFit] = {}
    for i, row in enumerate(_read_csv(text), start=2):
        at = f"{where} row {i}"
        try:
            gpus = int((row.get("gpus") or "").strip())
        except ValueError:
            raise CoralError(f"{at}: column 'gpus' is {row.get('gpus')!r}, not an integer") from None
        name = (row.get("interconnect") or "").strip()
        if not name:
            raise CoralError(f"{at}: column 'interconnect' is empty")
        if (name, gpus) in out:
            raise CoralError(f"{at}: {name} x{gpus} is listed twice")
        try:
            out[(name, gpus)] = LinkFit(
                interconnect=name, gpus=gpus, floor_s=(_float(row, "floor_us", at) or 0.0) * 1e-6,
                latency_s=(_float(row, "latency_us", at) or 0.0) * 1e-6, bus_gb_per_s=_float(row, "bus_gb_per_s", at) or 0.0,
                size_exponent=_float(row, "size_exponent", at, required=False) or 1.0,
                source=(row.get("source") or "").strip())
        except ValueError as exc:
            raise CoralError(f"{at}: {exc}") from None
    return out


@functools.cache
def builtin_links() -> dict[tuple[str, int], LinkFit]:
    """The shipped all-reduce fits per (interconnect, GPUs per node); see docs/reference/perf.md for their provenance."""
    data = resources.files("coral.catalog").joinpath("data")
    return load_interconnects_csv(data.joinpath("interconnects.csv").read_text())


def builtin_catalog() -> Catalog:
    """The catalog shipped with Coral: GPU specs and on-demand prices in four regions."""
    data = resources.files("coral.catalog").joinpath("data")
    gpus, aliases = load_gpus_csv(data.joinpath("gpus.csv").read_text(), "gpus.csv")
    offers = parse_offers(_read_csv(data.joinpath("prices.csv").read_text()), gpus, aliases, "prices.csv")
    return build_catalog(gpus, aliases, offers)
