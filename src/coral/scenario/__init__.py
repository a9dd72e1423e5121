"""Scenarios: the YAML schema, the built-ins (core, extended, helix) and their resolution."""
from coral.scenario.resolve import (
    Scenario,
    ServedModel,
    builtin_scenario_names,
    load_scenario,
    parse_scenario,
    read_scenario_file,
    resolve,
    with_demand_scale,
    with_spot,
)
from coral.scenario.schema import ScenarioFile

__all__ = ["Scenario", "ScenarioFile", "ServedModel", "builtin_scenario_names", "load_scenario", "parse_scenario",
           "read_scenario_file", "resolve", "with_demand_scale", "with_spot"]
