"""Offline stage: the placement problem, its solvers, and the template library.

The names below are loaded on first use (PEP 562), so reading a cached library (`coral plan`,
`coral templates show`) does not import the compiled search and numba."""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from coral.templates.exact import solve_exact
    from coral.templates.library import TemplateSpec, build_library, specs_for
    from coral.templates.problem import Placement, PlacementProblem, Stage, build_problem, evaluate
    from coral.templates.template import LibraryStats, Template, TemplateLibrary, drop_dominated

_WHERE = {
    "solve_exact": "exact", "TemplateSpec": "library", "build_library": "library", "specs_for": "library",
    "Placement": "problem", "PlacementProblem": "problem", "Stage": "problem", "build_problem": "problem",
    "evaluate": "problem", "LibraryStats": "template", "Template": "template", "TemplateLibrary": "template",
    "drop_dominated": "template",
}

__all__ = ["LibraryStats", "Placement", "PlacementProblem", "Stage", "Template", "TemplateLibrary", "TemplateSpec",
           "build_library", "build_problem", "drop_dominated", "evaluate", "solve_exact", "specs_for"]


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        return getattr(importlib.import_module(f"coral.templates.{_WHERE[name]}"), name)
    raise AttributeError(f"module 'coral.templates' has no attribute {name!r}")
