"""Offline stage: the placement problem, its solvers, and the template library."""
from coral.templates.exact import solve_exact
from coral.templates.library import TemplateSpec, build_library, specs_for
from coral.templates.problem import Placement, PlacementProblem, Stage, build_problem, evaluate
from coral.templates.template import LibraryStats, Template, TemplateLibrary, drop_dominated

__all__ = ["LibraryStats", "Placement", "PlacementProblem", "Stage", "Template", "TemplateLibrary", "TemplateSpec",
           "build_library", "build_problem", "drop_dominated", "evaluate", "solve_exact", "specs_for"]
