"""Workloads: trace loaders, synthetic generators, rate scaling, demand shifts and the workload spec."""
from coral.workload.arrivals import gamma_arrivals, poisson_arrivals, synthesize
from coral.workload.datasets import (
    BUILTIN_DATASET_FILES,
    BUILTIN_DATASET_MEANS_TOK,
    DATA_DIR_ENV,
    DATASET_NAMES,
    SYNTHETIC_FITS,
    data_dir_candidates,
    dataset_path,
    load_dataset,
)
from coral.workload.lengths import (
    AZURE_CODE_LENGTHS,
    AZURE_CONV_LENGTHS,
    EmpiricalLengths,
    LengthModel,
    Lognormal,
    LognormalLengths,
)
from coral.workload.loaders import load_azure, load_burstgpt, load_csv, load_trace_file
from coral.workload.shift import (
    ConstantShift,
    DiurnalShift,
    ProductShift,
    Shift,
    StepShift,
    apply_shift,
    combine,
    heavy_split_multipliers,
)
from coral.workload.spec import (
    CsvColumnsSpec,
    DiurnalShiftSpec,
    HeavySplitSpec,
    NoShiftSpec,
    StepShiftSpec,
    WorkloadSpec,
    build_workload,
    model_seed,
    parse_workload_spec,
)
from coral.workload.trace import LoadedTrace, Trace
from coral.workload.transform import (
    assign_datasets,
    cut,
    replay,
    rotate,
    scale_time,
    scale_to_rate,
    thin,
    tile,
)

__all__ = [
    "AZURE_CODE_LENGTHS", "AZURE_CONV_LENGTHS", "BUILTIN_DATASET_FILES", "BUILTIN_DATASET_MEANS_TOK", "DATASET_NAMES", "DATA_DIR_ENV",
    "SYNTHETIC_FITS", "ConstantShift", "CsvColumnsSpec", "DiurnalShift", "DiurnalShiftSpec", "EmpiricalLengths",
    "HeavySplitSpec", "LengthModel", "LoadedTrace", "Lognormal", "LognormalLengths", "NoShiftSpec", "ProductShift",
    "Shift", "StepShift", "StepShiftSpec", "Trace", "WorkloadSpec", "apply_shift", "assign_datasets",
    "build_workload", "combine", "cut", "data_dir_candidates", "dataset_path", "gamma_arrivals",
    "heavy_split_multipliers", "load_azure", "load_burstgpt", "load_csv", "load_dataset", "load_trace_file",
    "model_seed", "parse_workload_spec", "poisson_arrivals", "replay", "rotate", "scale_time", "scale_to_rate",
    "synthesize", "thin", "tile",
]
