"""Coral: cost-efficient multi-LLM serving on heterogeneous cloud GPUs."""

__version__ = "0.1.0"

__all__ = ["__version__"]
