"""The performance model: one interface (`PerfModel`), roofline and profile-table backends."""
from coral.perf.model import DEMAND_PHASES, PerfModel, Phase, Shape, SystemParams
from coral.perf.profile import ProfilePerf, load_profile_csv, profile_from_helix
from coral.perf.roofline import DEFAULT_EFFICIENCY, FITTED_EFFICIENCY, Efficiency, RooflinePerf

__all__ = [
    "DEFAULT_EFFICIENCY", "DEMAND_PHASES", "FITTED_EFFICIENCY", "Efficiency", "PerfModel", "Phase", "ProfilePerf", "RooflinePerf",
    "Shape", "SystemParams", "load_profile_csv", "profile_from_helix",
]
