"""GPU types, node configurations, regions, prices and model specs."""
from coral.catalog.catalog import (
    Catalog,
    Offer,
    builtin_catalog,
    load_prices_csv,
    load_skypilot_vms_csv,
)
from coral.catalog.hardware import GpuType, NodeConfig, split_config_name
from coral.catalog.models import (
    ModelSpec,
    builtin_model,
    builtin_model_names,
    from_hf_config,
    load_hf_config,
    resolve_model_spec,
)
from coral.catalog.spot import SpotOffer, SpotProcess, builtin_spot_fits, fitted_process

__all__ = [
    "Catalog", "GpuType", "ModelSpec", "NodeConfig", "Offer", "SpotOffer", "SpotProcess", "builtin_catalog",
    "builtin_model", "builtin_model_names", "builtin_spot_fits", "fitted_process", "from_hf_config", "load_hf_config", "load_prices_csv", "load_skypilot_vms_csv",
    "resolve_model_spec", "split_config_name",
]
