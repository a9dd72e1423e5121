"""What vLLM can run of a template: one node per pipeline stage, one tensor-parallel degree for all.

vLLM splits a model into `--pipeline-parallel-size` stages (uneven ones through
`VLLM_PP_LAYER_PARTITION`), each stage `--tensor-parallel-size` GPUs wide, with no data
parallelism inside a stage. A Coral template whose stage holds several nodes (data parallel),
or whose nodes have different GPU counts, has no vLLM equivalent.
"""
from __future__ import annotations

from collections.abc import Sequence

from coral.catalog.hardware import split_config_name
from coral.templates.template import Template


def vllm_reason(stages: Sequence[Sequence[str]]) -> str | None:
    """Why vLLM cannot run a placement, or None when it can.

    Args:
        stages: per pipeline stage, the node configuration names of its nodes (e.g. [["4xL4"], ["4xL40S"]]).

    Returns:
        None, or a one-line reason naming the stage or the GPU counts at fault.
    """
    for s, nodes in enumerate(stages):
        if len(nodes) != 1:
            return (f"stage {s} has {len(nodes)} data-parallel nodes ({' + '.join(nodes)}); "
                    "vLLM runs one node per pipeline stage")
    counts = sorted({split_config_name(nodes[0])[0] for nodes in stages})
    if len(counts) > 1:
        return (f"its stages have {' and '.join(str(c) for c in counts)} GPUs per node; "
                "vLLM uses one tensor-parallel degree for every stage")
    return None


def template_reason(t: Template) -> str | None:
    """:func:`vllm_reason` of a template's placement."""
    return vllm_reason([s.nodes for s in t.placement.stages])


def vllm_templates(templates: Sequence[Template]) -> tuple[Template, ...]:
    """The templates vLLM can run, in their order."""
    return tuple(t for t in templates if template_reason(t) is None)


__all__ = ["template_reason", "vllm_reason", "vllm_templates"]
