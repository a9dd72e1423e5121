"""`coral experiment NAME`: run one of the paper's studies and write its report, figures and summary."""
from __future__ import annotations

import datetime as _dt
import json
import math
import shlex
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click
from rich.progress import BarColumn, TextColumn, TimeElapsedColumn

from coral import __version__
from coral.atomic import building_dir
from coral.cli_support import (
    CoralGroup,
    check_output_path,
    err_console,
    pick_scenario,
    progress_display,
    stdout_console,
)
from coral.errors import CoralError
from coral.experiments.fidelity import QUICK, FidelityOptions, run_fidelity
from coral.experiments.report import render
from coral.experiments.runner import EXPERIMENTS, SETUPS, RunConfig, Session, run_experiment

console = stdout_console()


@click.group("experiment", cls=CoralGroup)
def experiment() -> None:
    """The paper's evaluation (§6) in simulation: one sub-command per study, or `all`.

    \b
      coral experiment cost core             §6.3 hourly cost, abundant GPUs
      coral experiment goodput core          §6.4 goodput, tight availability
      coral experiment skew core             §6.5 large-heavy / small-heavy demand
      coral experiment helix                 §6.6 Llama-2-70B on Helix's cluster
      coral experiment ablation core         §6.7 template-greedy vs Coral
      coral experiment sensitivity core      §6.8 n_max x rho sweep
      coral experiment spot core             spot capacity: cost and attainment (issue 30)
      coral experiment all core              all of them, one report

    Each writes report.md, summary.json and figures/*.png into --out
    (default runs/NAME-SETUP-TIMESTAMP).
    """


class _RichUi:
    """Progress on stderr: one bar for the current step, finished steps printed above it."""

    def __init__(self, progress: Any) -> None:
        self.progress = progress
        self.task: Any = None

    def start(self, description: str, total: float) -> None:
        if self.task is not None:
            self.progress.remove_task(self.task)
        self.task = self.progress.add_task(description, total=max(total, 1))

    def update(self, completed: float) -> None:
        if self.task is not None:
            self.progress.update(self.task, completed=completed)

    def note(self, message: str) -> None:
        self.progress.console.print(f"  {message}", highlight=False)


def _default_out(name: str, setup: str) -> Path:
    stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    return Path("runs") / f"{name}-{setup}-{stamp}"


def _clean(x: Any) -> Any:
    """JSON-safe: NaN / inf become null."""
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {str(k): _clean(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [_clean(v) for v in x]
    return x


def _command(name: str, setup: str, out: Path, jobs: int, seed: int, duration_s: float | None, quick: bool,
             extra: list[str]) -> str:
    parts = ["coral", "experiment", name, setup, "--out", str(out), "--jobs", str(jobs), "--seed", str(seed)]
    if duration_s is not None:
        parts += ["--duration-s", f"{duration_s:g}"]
    if quick:
        parts.append("--quick")
    return shlex.join(parts + extra)


def _run(name: str, setup: str, out: str | None, jobs: int, seed: int, duration_s: float | None, quick: bool,
         cache_dir: str | None, data_dir: str | None, arrival: str | None = None, n_max: int | None = None) -> None:
    try:
        cfg = RunConfig.make(setup, quick=quick, duration_s=duration_s, seed=seed, jobs=jobs,
                             cache_dir=Path(cache_dir) if cache_dir else None,
                             data_dir=Path(data_dir) if data_dir else None, arrival=arrival,
                             **({"n_max": n_max} if n_max is not None else {}))
    except ValueError as exc:
        raise CoralError(str(exc)) from None
    out_dir = check_output_path(out, "--out", folder=True) if out else _default_out(name, setup)
    extra = [a for opt, v in (("--cache-dir", cache_dir), ("--data-dir", data_dir), ("--arrival", arrival),
                              ("--n-max", str(n_max) if n_max is not None else None)) if v
             for a in (opt, v)]
    meta: dict[str, Any] = {
        "experiment": name, "setup": setup,
        "scenario": "helix" if name == "helix" else (f"{setup} (+ helix for §6.6)" if name == "all" else setup),
        "command": _command(name, setup, out_dir, jobs, seed, duration_s, quick, extra),
        "argv": sys.argv, "version": __version__, "seed": seed, "duration_s": cfg.duration_s,
        "epoch_s": cfg.epoch_s if cfg.epoch_s is not None else 360.0, "quick": quick, "n_max": cfg.n_max,
        "jobs": jobs, "started_at": _dt.datetime.now().astimezone().isoformat(timespec="seconds"),
        "python": sys.version.split()[0], "arrival": arrival or "scenario default (trace replay)",
    }
    names = list(EXPERIMENTS) if name == "all" else [name]
    t0 = time.perf_counter()
    with progress_display(TextColumn("{task.description}"), BarColumn(),
                          TextColumn("{task.completed:,.0f}/{task.total:,.0f}"), TimeElapsedColumn(),
                          console=err_console, transient=True) as progress:
        session = Session(config=cfg, ui=_RichUi(progress))
        results: dict[str, Any] = {}
        for n in names:
            progress.console.print(f"[bold]experiment {n}[/] ({setup})")
            results[n] = run_experiment(n, session)
    meta["wall_s"] = time.perf_counter() - t0
    result = {"experiments": results} if name == "all" else results[name]
    _write(out_dir, name, meta, result, render)
    console.print(f"report: {out_dir / 'report.md'}  (summary: {out_dir / 'summary.json'}, "
                  f"figures: {out_dir / 'figures'}/) in {meta['wall_s']:.0f} s", soft_wrap=True)


def _write(out_dir: Path, name: str, meta: dict[str, Any], result: dict[str, Any],
           render: Callable[[str, Any, Any, Path], str]) -> None:
    """Write everything into a temporary sibling folder, then move it into place."""
    with building_dir(out_dir) as tmp:
        text = render(name, result, meta, tmp)
        (tmp / "report.md").write_text(text)
        (tmp / "summary.json").write_text(json.dumps(_clean({**meta, **result}), indent=2, default=str) + "\n")


def _command_for(name: str, doc: str) -> click.Command:
    @click.command(name, help=doc)
    @click.argument("setup_arg", metavar="[SETUP]", type=click.Choice(SETUPS), required=False)
    @click.option("--setup", "setup_flag", type=click.Choice(SETUPS), default=None,
                  help="The same as the SETUP argument: the paper's core or extended setup, default core "
                       "(ignored by `helix`, which has its own scenario).")
    @click.option("--out", type=click.Path(file_okay=False), default=None,
                  help="Output folder (default runs/NAME-SETUP-TIMESTAMP); replaced atomically.")
    @click.option("--jobs", type=click.IntRange(min=1), default=2, show_default=True,
                  help="Processes for template-library builds.")
    @click.option("--seed", type=int, default=0, show_default=True, help="Workload seed.")
    @click.option("--duration-s", type=click.FloatRange(min=0, min_open=True), default=None,
                  help="Simulated seconds per run (default 1800; 360 with --quick).")
    @click.option("--quick", is_flag=True,
                  help="Smoke run: 360 s, 120 s epochs, templates of at most 2 nodes, a 2x2 sensitivity grid.")
    @click.option("--cache-dir", type=click.Path(file_okay=False), default=None,
                  help="Template cache folder (default $CORAL_CACHE_DIR or ~/.cache/coral/templates).")
    @click.option("--data-dir", type=click.Path(file_okay=False), default=None,
                  help="Folder holding traces/ for the built-in datasets (default: $CORAL_DATA_DIR, else the copy shipped with Coral).")
    @click.option("--arrival", type=click.Choice(["trace", "poisson"]), default=None,
                  help="Override every model's arrival process (default: the scenario's, trace replay); "
                       "poisson keeps the traces' request lengths.")
    @click.option("--n-max", type=click.IntRange(1, 8), default=None,
                  help="Override the scenario's n_max for the template libraries (recorded in the report); "
                       "e.g. 4 for `extended`, whose n_max 6 library takes about an hour to build here.")
    def cmd(setup_arg: str | None, setup_flag: str | None, out: str | None, jobs: int, seed: int,
            duration_s: float | None, quick: bool, cache_dir: str | None, data_dir: str | None, arrival: str | None,
            n_max: int | None) -> None:
        setup = pick_scenario(setup_arg, setup_flag, what="SETUP", flag_name="--setup", default="core")
        _run(name, setup, out, jobs, seed, duration_s, quick, cache_dir, data_dir, arrival, n_max)

    return cmd


_DOCS = {
    "cost": "§6.3: hourly cost per method over 5 epochs with abundant GPUs, per model, with solve times and "
            "the heterogeneous templates Coral picked.",
    "goodput": "§6.4: goodput and goodput-normalized cost per method with tight availability.",
    "skew": "§6.5: large-heavy and small-heavy demand (80 % of the total rate to the large / small models).",
    "helix": "§6.6: Llama-2-70B on Helix's 64-GPU cluster (4 req/s, SLOs 2090/730 ms) vs Helix's reported "
             "459.8 tok/s and the whole cluster's $/h.",
    "ablation": "§6.7: template-greedy vs Coral, abundant and tight availability.",
    "sensitivity": "§6.8: template count, build time, best efficiency and plan cost over an n_max x rho grid.",
    "spot": "Issue 30: spot capacity in the plan. Coral and a spot-aware Homo with spot off, on at the fitted "
            "preemption rates, and at x0.5 / x2 / x4 those rates; preemptions replayed with the cloud's "
            "notice. Cost, attainment per model and epoch, preemptions, against the issue's targets.",
    "all": "Every study above, one report.",
}
for _name, _doc in _DOCS.items():
    experiment.add_command(_command_for(_name, _doc))


@experiment.command("fidelity")
@click.option("--out", "out_dir", required=True, type=click.Path(file_okay=False), help="Folder for summary.json, report.md, the PNG and CSVs.")
@click.option("--model", default="fid-llama", show_default=True, help="Runtime model (built-in config name or config.json path).")
@click.option("--node", default="1xL4", show_default=True, help="Catalog configuration used as the label of this host's nodes.")
@click.option("--profile", "profile_csv", type=click.Path(dir_okay=False, exists=True), default=None,
              help="Reuse this `coral profile` CSV (with its .host.json) instead of profiling first.")
@click.option("--data-dir", type=click.Path(file_okay=False), default=None, help="Folder holding traces/ (default: $CORAL_DATA_DIR, else the copy shipped with Coral).")
@click.option("--dataset", default="azure-conv", show_default=True, help="Trace: azure-conv, azure-code, burstgpt or a CSV path.")
@click.option("--duration", "duration_s", type=click.FloatRange(min=1), default=None, help="Seconds of trace to replay [150; quick 25].")
@click.option("--load", type=click.FloatRange(0, 1, min_open=True), default=0.35, show_default=True,
              help="Offered load as a share of this host's CPU cores (sizes the arrival rate).")
@click.option("--max-prompt", type=click.IntRange(min=1), default=None, help="Clip prompts to this many tokens [384; quick 128].")
@click.option("--max-output", type=click.IntRange(min=2), default=None, help="Clip outputs to this many tokens [48; quick 16].")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--quick", is_flag=True, help="A ~1-minute run (tests): short trace, short sequences, small profile grid.")
@click.option("--repeat", is_flag=True, help="Replay the trace twice on the runtime and report the run-to-run error "
              "(the floor for any simulator on this host); adds one trace duration.")
def fidelity(out_dir: str, model: str, node: str, profile_csv: str | None, data_dir: str | None, dataset: str,
             duration_s: float | None, load: float, max_prompt: int | None, max_output: int | None, seed: int, quick: bool,
             repeat: bool) -> None:
    """Replay a trace through the real local runtime and through the simulator (timed by a profile of the same
    engine), match requests one to one and report the TTFT / TPOT errors (the paper's Fig. 6)."""
    dflt = {**{"duration_s": 150.0, "max_prompt": 384, "max_output": 48}, **(QUICK if quick else {})}
    opts = FidelityOptions(
        out=Path(out_dir), model=model, node=node, profile=Path(profile_csv) if profile_csv else None,
        data_dir=Path(data_dir) if data_dir else None, dataset=dataset,
        duration_s=duration_s if duration_s is not None else dflt["duration_s"], load=load,
        max_prompt=max_prompt if max_prompt is not None else int(dflt["max_prompt"]),
        max_output=max_output if max_output is not None else int(dflt["max_output"]), seed=seed, quick=quick,
        repeat=repeat,
    )  # fmt: skip
    s = run_fidelity(opts, progress=lambda m: click.echo(m, err=True))
    t, p = s["ttft"], s["tpot"]
    click.echo(f"TTFT: MAPE {t['mape']:.1%}, p90 APE {t['p90_ape']:.1%}, CDF MAPE {t['cdf_mape']:.1%}; "
               f"TPOT: MAPE {p['mape']:.1%}, p90 APE {p['p90_ape']:.1%}, CDF MAPE {p['cdf_mape']:.1%} "
               f"({s['requests']['matched']} requests matched; {s['wall_s']:.0f} s)")
    if s.get("repeatability"):
        r = s["repeatability"]
        click.echo(f"run-to-run (real vs real): TTFT MAPE {r['ttft_mape']:.1%}, TPOT MAPE {r['tpot_mape']:.1%}")
    click.echo(f"wrote {opts.out}/summary.json, report.md, fidelity_cdf.png, requests.csv, calibration.csv, host_load.json")
