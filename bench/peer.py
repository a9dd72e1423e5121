"""`make bench` section `peer`: Coral's best single-node template next to aiconfigurator's vLLM estimate.

Issue 25's target: for three models at one ISL/OSL and SLA, on L40S and H100, the per-GPU
throughput of Coral's best single-node template should be within 25 % of aiconfigurator's vLLM
estimate for the same node, or the difference explained (`docs/results/peer.md`).

What is compared, per (model, node, phase), disaggregated as Coral's templates are:

- **prefill**: prompt tokens/s per GPU of one prefill worker layout that brings a batch of
  ISL-token prompts to its first token within the prefill budget;
- **decode**: output tokens/s per GPU of one decode worker layout whose step (TPOT) stays within
  the decode budget, at contexts ISL..ISL+OSL.

Both tools get the same budget: Coral's planner default, `ttft_headroom x TTFT` (0.5) for
prefill and `tpot_headroom x TPOT` (0.9) for decode (`coral.templates.budget`). aiconfigurator's
own disagg picker uses about the same prefill share (TTFT / 1.8 for queueing) and the full TPOT.
Each tool searches its own layouts inside the node: Coral the TP groups vLLM accepts as
data-parallel replicas or in-node pipeline stages, micro-batches up to 8 prompts (prefill) or
128 sequences (decode); aiconfigurator TP x PP (and EP for MoE) with its own batch sweep (up to 8
prompts, 512 sequences), both per GPU so the replica count does not matter. aiconfigurator's
rate-matching degradation factors (0.9 / 0.92) apply to a whole P/D system, not to one worker, and
are left out.

aiconfigurator-core (Apache-2.0) is optional: `pip install '.[bench]'` (`make bench` does). Without
it only Coral's side runs and the section says how to install it.
"""
from __future__ import annotations

import dataclasses
import importlib.metadata
import importlib.util
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ISL, OSL = 2048, 256
TTFT_MS, TPOT_MS = 1000.0, 50.0
WITHIN = 0.25  # |Coral - aiconfigurator| / aiconfigurator
# Coral's catalog name, the HF id aiconfigurator models (its shipped config). Coral's llama-3-70b
# has Llama 3.1 70B's shapes (80 layers, 8192 hidden, 64/8 heads, 28672 MLP, 128256 vocabulary).
MODELS = (("qwen3-32b", "Qwen/Qwen3-32B"), ("gpt-oss-20b", "openai/gpt-oss-20b"),
          ("llama-3-70b", "meta-llama/Meta-Llama-3.1-70B"))
NODES = (("8xL40S", "l40s"), ("8xH100", "h100_sxm"))  # Coral's node shape, aiconfigurator's system
AIC_PACKAGE = "aiconfigurator-core"
AIC_BACKEND = "vllm"
INSTALL_HINT = "pip install -e '.[bench]' installs it; make bench does"
# aiconfigurator's disagg sweep (inference_session.find_best_disagg_result_under_constraints):
# prefill batches up to max_num_tokens // ISL (16384 by default), decode batches below.
AIC_PREFILL_MAX_TOKENS = 16384
AIC_DECODE_BATCHES = (list(range(1, 16)) + list(range(16, 32, 2)) + list(range(32, 128, 4))
                      + list(range(128, 512, 8)) + [512])


@dataclass(frozen=True, slots=True, kw_only=True)
class Best:
    """One tool's best layout of a node for one phase."""

    tok_per_s_per_gpu: float  # prompt tokens (prefill) or output tokens (decode) per second per GPU
    layout: str  # e.g. "4x tp2" (four data-parallel TP-2 engines) or "pp2[tp2|tp2] x2"
    batch: int  # micro-batch (prompts or sequences) of one engine
    latency_ms: float  # the budgeted latency: TTFT of the batch (prefill) or TPOT (decode)
    tp: int = 0  # aiconfigurator only: the engine's TP, PP and EP degrees
    pp: int = 0
    ep: int = 1
    detail: str = ""  # aiconfigurator only: the largest op's share of the step and its data source


def phase_budget_ms(phase: Any, ttft_ms: float = TTFT_MS, tpot_ms: float = TPOT_MS) -> float:
    """The latency Coral's planner holds a template of `phase` to, by default (the same for both tools)."""
    from coral.scenario.schema import PlannerEntry
    from coral.slo import Slo
    from coral.templates.budget import latency_budget_ms

    d = PlannerEntry()
    return latency_budget_ms(Slo(ttft_ms=ttft_ms, tpot_ms=tpot_ms), phase, ttft_headroom=d.ttft_headroom,
                             tpot_headroom=d.tpot_headroom)


def _coral_layout(stages: Any) -> str:
    """`4x tp2` for one stage of four TP-2 groups; `pp3[tp1|tp1|4x tp1]` for a pipeline."""
    from coral.catalog.hardware import split_group_name

    parts = []
    for st in stages:
        degrees = []
        for e in st.nodes:
            node, tp = split_group_name(e)
            degrees.append(tp or int(node.split("x", 1)[0]))
        width = f"{len(degrees)}x " if len(degrees) > 1 else ""
        parts.append(f"{width}tp{degrees[0]}" if len(set(degrees)) == 1 else "+".join(f"tp{t}" for t in degrees))
    return parts[0] if len(parts) == 1 else f"pp{len(parts)}[{'|'.join(parts)}]"


def coral_best_node(model: str, phase: Any, node: str, *, isl: float = ISL, osl: float = OSL,
                    ttft_ms: float = TTFT_MS, tpot_ms: float = TPOT_MS, perf: Any = None,
                    batches: tuple[int, ...] | None = None) -> Best | None:
    """Coral's best template of `model`'s `phase` on one `node`, per GPU: the template library of
    that single (model, phase) on that single node shape, with in-node layouts (TP groups vLLM
    accepts, as data-parallel engines or pipeline stages), solved as `coral templates build` does.

    Args:
        model: a built-in model name (`coral catalog models`).
        phase: `coral.perf.Phase`.
        node: a node configuration name, e.g. `8xH100`.
        isl, osl: the request's prompt and output tokens.
        ttft_ms, tpot_ms: the SLO; the budget is the planner's default share of it (`phase_budget_ms`).
        perf: the performance model (default: `RooflinePerf()`, what the built-in scenarios use).
        batches: micro-batches to try (default: the planner's grid; prefill up to its prefill_max_batch).

    Returns:
        The best template's realized tok/s over the node's GPUs, or None where no layout meets the
        budget (memory or latency).
    """
    from coral.catalog import builtin_catalog, resolve_model_spec
    from coral.perf import Phase, RooflinePerf
    from coral.templates.library import build_one, single_template_spec

    cfg = builtin_catalog().config(node)
    grid = batches or coral_grid(phase)
    slo = ttft_ms if phase is Phase.PREFILL else tpot_ms
    spec = single_template_spec(resolve_model_spec(model), phase, slo, phase_budget_ms(phase, ttft_ms, tpot_ms),
                                (cfg,), (cfg.name,), prompt_tokens=isl, output_tokens=osl, n_max=1, batches=grid)
    spec = dataclasses.replace(spec, layouts=True)  # a library build's layouts: the node's TP groups
    found, _ = build_one(spec, perf or RooflinePerf())
    if not found:
        return None
    best = max(found, key=lambda t: t.throughput_tok_per_s)
    p = best.placement
    return Best(tok_per_s_per_gpu=best.throughput_tok_per_s / cfg.count, layout=_coral_layout(p.stages),
                batch=p.micro_batch, latency_ms=p.latency_s * 1e3)


def coral_at(model: str, phase: Any, node: str, tp: int, batch: int, *, isl: float = ISL,
             osl: float = OSL, perf: Any = None) -> float:
    """Coral's perf model at one given engine layout (TP `tp`, no pipeline) and micro-batch:
    tok/s per GPU, memory and latency not checked. Used to tell a layout choice from a
    difference in the physics."""
    from coral.catalog import builtin_catalog, resolve_model_spec
    from coral.perf import RooflinePerf
    from coral.perf.model import Shape

    perf = perf or RooflinePerf()
    cfg = builtin_catalog().config(node)
    group = cfg.group(tp)
    spec = resolve_model_spec(model)
    shape = Shape(phase=phase, batch=batch, prompt_tokens=isl, output_tokens=osl)
    t = perf.node_time_s(group, spec, shape, spec.num_layers, first=True, last=True)
    return shape.work_tokens / t / tp


def aic_installed() -> bool:
    return importlib.util.find_spec("aiconfigurator_core") is not None


def aic_version() -> str:
    return importlib.metadata.version(AIC_PACKAGE)


def _aic_parallel(gpus: int, moe: bool) -> Iterator[tuple[int, int, int]]:
    """(tp, pp, ep) engines that fit in a node of `gpus`; MoE models also with expert parallelism
    over the TP ranks (vLLM's --enable-expert-parallel)."""
    for tp in (1, 2, 4, 8):
        for pp in (1, 2, 4, 8):
            if tp * pp <= gpus and gpus % (tp * pp) == 0:
                yield tp, pp, 1
                if moe and tp > 1:
                    yield tp, pp, tp


class AicSide:
    """aiconfigurator's vLLM estimate for one node: its perf database for the system (measured
    kernels and collectives), its model builder, and its static prefill/decode worker runs."""

    def __init__(self) -> None:
        logging.getLogger("aiconfigurator_core").setLevel(logging.ERROR)  # its fallback-row notices
        from aiconfigurator_core.sdk.backends.factory import get_backend

        self.backend = get_backend(AIC_BACKEND)
        self.databases: dict[str, Any] = {}
        self.sources: dict[str, set[str]] = {}  # system -> the data sources of the ops it used

    def database(self, system: str) -> Any:
        if system not in self.databases:
            from aiconfigurator_core.sdk import perf_database

            self.databases[system] = perf_database.get_database(system, AIC_BACKEND, "current")
            if self.databases[system] is None:
                raise RuntimeError(f"aiconfigurator has no {AIC_BACKEND} data for {system}")
        return self.databases[system]

    def provenance(self, system: str) -> str:
        """The package version, backend data version and where its system files are."""
        import aiconfigurator_core

        db = self.database(system)
        root = Path(aiconfigurator_core.__file__).parent / "systems"
        families = sorted(p.parent.parent.name for p in (root / "data" / system).glob(f"*/{AIC_BACKEND}/{db.version}"))
        used = ", ".join(sorted(self.sources.get(system, ()))) or "-"
        return (f"{AIC_PACKAGE} {aic_version()}: systems/{system}.yaml, systems/data/{system}/"
                f"{{{','.join(families)}}}/{AIC_BACKEND}/{db.version} (older versions and comm/nccl fill gaps); "
                f"the chosen runs' ops came from {used} data; root {root}")

    def best_node(self, hf_id: str, system: str, phase: Any, gpus: int, *, budget_ms: float, moe: bool = False,
                  isl: int = ISL, osl: int = OSL) -> Best | None:
        """aiconfigurator's best worker of `phase` in a node of `gpus`, per GPU, under `budget_ms`.

        As its disagg search builds worker candidates: static prefill (`static_ctx`) or decode
        (`static_gen`) runs per (TP, PP, EP) and batch, stopping a layout's sweep at the first batch
        that runs out of memory or KV cache; kept where the TTFT (prefill) or TPOT (decode) meets
        the budget; `moe` adds expert-parallel layouts. Returns None where no layout does.
        """
        from aiconfigurator_core.sdk import config, models

        from coral.perf import Phase

        db = self.database(system)
        prefill = phase is Phase.PREFILL
        mode = "static_ctx" if prefill else "static_gen"
        batches = range(1, AIC_PREFILL_MAX_TOKENS // isl + 1) if prefill else AIC_DECODE_BATCHES
        best: Best | None = None
        for tp, pp, ep in _aic_parallel(gpus, moe):
            mc = config.ModelConfig(tp_size=tp, pp_size=pp, moe_tp_size=tp // ep, moe_ep_size=ep)
            try:
                model = models.get_model(hf_id, mc, AIC_BACKEND)
            except Exception:  # a layout its model builder refuses (heads, experts) is not a candidate
                continue
            for b in batches:
                rc = config.RuntimeConfig(batch_size=b, isl=isl, osl=1 if prefill else osl)
                s = self.backend.run_static(model, db, rc, mode)
                if s.check_oom() or s.check_kv_cache_oom():
                    break  # a larger batch needs more memory still
                r = s.get_summary_df().iloc[0]
                lat = float(r["ttft"] if prefill else r["tpot"])
                if lat > budget_ms:
                    if prefill:
                        break  # prefill latency only grows with the batch
                    continue
                rate = float(r["seq/s/gpu"]) * isl if prefill else float(r["tokens/s/gpu"])
                if best is None or rate > best.tok_per_s_per_gpu:
                    ops = s.get_context_latency_dict() if prefill else s.get_generation_latency_dict()
                    src = s.get_context_source_dict() if prefill else s.get_generation_source_dict()
                    kinds: dict[str, float] = {}  # ar_1 + ar_2 -> ar: the two all-reduces of a layer
                    for op, ms in ops.items():
                        kinds[_op_kind(op)] = kinds.get(_op_kind(op), 0.0) + ms
                    name = max(kinds, key=lambda k: kinds[k])
                    share = kinds[name] / sum(kinds.values())
                    where = sorted({v for k, v in src.items() if _op_kind(k) == name})
                    self.sources.setdefault(system, set()).update(src.values())
                    replicas = gpus // (tp * pp)
                    layout = (f"{replicas}x " if replicas > 1 else "") + f"tp{tp}" + (f"pp{pp}" if pp > 1 else "") \
                        + (f"ep{ep}" if ep > 1 else "")
                    best = Best(tok_per_s_per_gpu=rate, layout=layout, batch=b, latency_ms=lat, tp=tp, pp=pp, ep=ep,
                                detail=f"{name} {share:.0%} of the step ({'/'.join(where) or '?'} data)")
        return best


def coral_grid(phase: Any) -> tuple[int, ...]:
    """The micro-batches Coral's planner tries by default for `phase` (prefill: up to prefill_max_batch)."""
    from coral.perf import Phase
    from coral.scenario.schema import PlannerEntry

    d = PlannerEntry()
    return tuple(b for b in d.batch_grid if phase is Phase.DECODE or b <= d.prefill_max_batch)


def _op_kind(op: str) -> str:
    """`generation_ar_2` -> `ar`, `context_gate_ffn1_gemm` -> `gate_ffn1_gemm`."""
    name = op.split("_", 1)[1] if op.startswith(("context_", "generation_")) else op
    stem, _, tail = name.rpartition("_")
    return stem if stem and tail.isdigit() else name


def _reason(model: str, phase: Any, node: str, coral: Best | None, aic: Best | None) -> str:
    """Why the two differ, from what each chose: which side found nothing; Coral's perf model at
    aiconfigurator's engine (TP, batch; one pipeline stage, which has the same rate per GPU), the
    physics alone; whether aiconfigurator's batch is off Coral's grid; its largest op."""
    if coral is None and aic is None:
        return "both: no layout meets the budget"
    if coral is None:
        return "Coral: no layout meets the budget"
    if aic is None:
        return "aiconfigurator: no layout meets the budget"
    parts = []
    if aic.ep == 1:
        same = coral_at(model, phase, node, aic.tp, aic.batch) / aic.tok_per_s_per_gpu
        parts.append(f"Coral's model at aic's tp{aic.tp} b{aic.batch}: {same:.2f}x")
    grid = coral_grid(phase)
    if aic.batch > max(grid):
        parts.append(f"aic's batch {aic.batch} > Coral's grid max {max(grid)}")
    elif aic.batch > coral.batch and aic.batch not in grid:
        parts.append(f"aic's batch {aic.batch} is off Coral's grid {','.join(map(str, grid))}")
    parts.append(f"aic: {aic.detail}")
    return "; ".join(parts)


def compare(aic: AicSide | None, *, quick: bool = False) -> list[dict[str, Any]]:
    """One row per (model, node, phase): both tools' best per-GPU figure, their ratio and why.

    Args:
        aic: aiconfigurator's side, or None (not installed: Coral's side only).
        quick: only the first model.
    """
    from coral.catalog import resolve_model_spec
    from coral.perf import Phase

    rows = []
    for model, hf_id in MODELS[:1] if quick else MODELS:
        moe = resolve_model_spec(model).num_experts > 0
        for node, system in NODES:
            gpus = int(node.split("x", 1)[0])
            for phase in (Phase.PREFILL, Phase.DECODE):
                c = coral_best_node(model, phase, node)
                a = aic.best_node(hf_id, system, phase, gpus, budget_ms=phase_budget_ms(phase), moe=moe) if aic else None
                ratio = c.tok_per_s_per_gpu / a.tok_per_s_per_gpu if c and a else None
                within = ratio is not None and abs(ratio - 1.0) <= WITHIN
                rows.append({
                    "model": model, "node": node, "system": system, "phase": phase.value, "coral": c, "aic": a,
                    "ratio": ratio, "within": within,
                    "agree_none": c is None and a is None and aic is not None,  # neither meets the budget
                    "reason": "" if within or aic is None else _reason(model, phase, node, c, a)})
    return rows


def table(rows: list[dict[str, Any]]) -> list[str]:
    """The rows as text lines: model x node x phase, both figures, ratio, within 25 %, reason."""
    out = [f"  {'model':12s} {'node':7s} {'phase':7s} {'Coral tok/s/GPU':>15s} {'aic tok/s/GPU':>13s} "
           f"{'ratio':>6s} {'<=25%':5s} Coral layout | aic layout | reason"]
    for r in rows:
        c, a = r["coral"], r["aic"]
        cs = f"{c.tok_per_s_per_gpu:,.0f}" if c else "none"
        aics = f"{a.tok_per_s_per_gpu:,.0f}" if a else "none"
        ratio = f"{r['ratio']:.2f}" if r["ratio"] is not None else "-"
        lay = f"{c.layout} b{c.batch}" if c else "-"
        alay = f"{a.layout} b{a.batch}" if a else "-"
        out.append(f"  {r['model']:12s} {r['node']:7s} {r['phase']:7s} {cs:>15s} {aics:>13s} {ratio:>6s} "
                   f"{'yes' if r['within'] else '-' if r['agree_none'] else 'no':5s} {lay} | {alay}" + (f" | {r['reason']}" if r["reason"] else ""))
    return out
