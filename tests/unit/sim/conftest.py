"""Fixtures for the simulator tests."""
from __future__ import annotations

import dataclasses

import pytest
from sim_helpers import ConstPerf

from coral.scenario import load_scenario


@pytest.fixture(scope="session")
def core():  # noqa: ANN201
    return load_scenario("core")


@pytest.fixture
def const_scenario(core):  # noqa: ANN001, ANN201
    return dataclasses.replace(core, perf=ConstPerf(0.01))
