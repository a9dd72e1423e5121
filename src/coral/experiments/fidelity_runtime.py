"""The real side of the fidelity study: a local cluster through `coral serve`, and a trace replayed over its HTTP API."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from coral.errors import CoralError

__all__ = ["CpuMeter", "runtime_overhead", "Served", "StageLayout", "InstanceLayout", "RealRequest", "cluster_file", "default_layout", "replay"]


@dataclass(frozen=True, slots=True, kw_only=True)
class StageLayout:
    """Layers [start, end) on `nodes` data-parallel engine nodes."""

    start: int
    end: int
    nodes: int = 1


@dataclass(frozen=True, slots=True, kw_only=True)
class InstanceLayout:
    """One serving instance of the study's cluster."""

    name: str
    phase: str  # prefill or decode
    stages: tuple[StageLayout, ...]


def default_layout(num_layers: int) -> tuple[InstanceLayout, ...]:
    """Two prefill and two decode instances with uneven pipelines (PD disaggregated).

    For 8 layers: prefill [0,3)+[3,8) and [0,8); decode [0,5)+[5,8) and [0,3)+[3,8)x2.
    """
    a, c = max(1, num_layers * 3 // 8), max(1, num_layers * 5 // 8)
    L = num_layers
    return (
        InstanceLayout(name="prefill-a", phase="prefill", stages=(StageLayout(start=0, end=a), StageLayout(start=a, end=L))),
        InstanceLayout(name="prefill-b", phase="prefill", stages=(StageLayout(start=0, end=L),)),
        InstanceLayout(name="decode-a", phase="decode", stages=(StageLayout(start=0, end=c), StageLayout(start=c, end=L))),
        InstanceLayout(name="decode-b", phase="decode", stages=(StageLayout(start=0, end=a), StageLayout(start=a, end=L, nodes=2))),
    )


def cluster_file(model: str, config: dict[str, Any], layout: Sequence[InstanceLayout], throughputs: dict[str, float],
                 *, threads: int = 1, dtype: str = "float32", device: str = "cpu", max_context: int | None = None) -> dict[str, Any]:
    """The cluster YAML document (`coral serve --config`) of the study's cluster.

    The model's EOS token is removed so that greedy outputs always run to `max_tokens`.
    """
    cfg = {k: v for k, v in config.items() if k != "eos_token_id"}
    cfg["eos_token_id"] = None
    return {
        "coordinator": {"host": "127.0.0.1", "port": 0},
        "device": device,
        "dtype": dtype,
        "torch_threads": threads,
        "models": [{"name": model, "hf_config": cfg, "weights": {"seed": 0},
                    **({"max_context": max_context} if max_context else {})}],
        "instances": [
            {"name": i.name, "model": model, "phase": i.phase, "region": "local",
             "throughput_tok_per_s": float(throughputs[i.name]),
             "stages": [{"layers": [s.start, s.end], "nodes": s.nodes} for s in i.stages]}
            for i in layout
        ],
    }  # fmt: skip


class Served:
    """`coral serve` in a child process (its own interpreter, so the client here does not share its GIL)."""

    def __init__(self, cluster: dict[str, Any], workdir: Path, startup_timeout_s: float = 240.0,
                 step_trace_dir: Path | None = None) -> None:
        """Args:
        cluster: the cluster document (written to `workdir`/cluster.yaml).
        workdir: where the cluster file and serve.log go.
        startup_timeout_s: how long `coral serve` may take to become ready.
        step_trace_dir: if given, every instance scheduler writes `<instance>.steps.csv` there, one
            row per micro-batch (`Scheduler(step_trace=...)`, switched on by `$CORAL_STEP_TRACE`).
        """
        self.cluster = cluster
        self.step_trace_dir = step_trace_dir
        self.workdir = workdir
        self.startup_timeout_s = startup_timeout_s
        self.proc: subprocess.Popen[bytes] | None = None
        self._log: Any = None
        self.url = ""

    def __enter__(self) -> Served:
        self.workdir.mkdir(parents=True, exist_ok=True)
        cfg = self.workdir / "cluster.yaml"
        cfg.write_text(yaml.safe_dump(self.cluster, sort_keys=False))
        ready = Path(tempfile.mkdtemp(prefix="coral-fid-")) / "url"
        log = open(self.workdir / "serve.log", "wb")  # noqa: SIM115 - closed in __exit__ via the process
        self._log = log
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        env.pop("CORAL_STEP_TRACE", None)
        if self.step_trace_dir is not None:
            self.step_trace_dir.mkdir(parents=True, exist_ok=True)
            for old in self.step_trace_dir.glob("*.steps.csv"):
                old.unlink()
            env["CORAL_STEP_TRACE"] = str(self.step_trace_dir.resolve())
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "coral.runtime.deploy.serve_cli", "--config", str(cfg), "--port", "0", "--ready-file", str(ready),
             "--startup-timeout", str(self.startup_timeout_s)],
            stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=env,
        )  # fmt: skip
        deadline = time.monotonic() + self.startup_timeout_s + 30
        while not (ready.is_file() and ready.read_text().strip()):
            if self.proc.poll() is not None:
                self.__exit__()
                tail = (self.workdir / "serve.log").read_text(errors="replace")[-2000:]
                raise CoralError(f"coral serve exited during start-up:\n{tail}")
            if time.monotonic() > deadline:
                self.__exit__()
                raise CoralError("coral serve did not become ready in time")
            time.sleep(0.2)
        self.url = ready.read_text().strip()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=40)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        self.proc = None
        if self._log is not None:
            self._log.close()
            self._log = None


def _host_busy_s() -> float:
    """CPU seconds the whole host has been busy (all cores; idle and iowait excluded), from /proc/stat."""
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:9]]
    user, nice, system, _idle, _iowait, irq, softirq, steal = v
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def proc_cpu_s(pid: int) -> float:
    """CPU seconds (user + system, all threads, not its children) of one process, from /proc; 0 off Linux."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            data = f.read()
    except OSError:
        return 0.0
    rest = data[data.rfind(")") + 2:].split()
    return (int(rest[11]) + int(rest[12])) / os.sysconf("SC_CLK_TCK")


def _tree(root: int) -> tuple[dict[int, float], set[int]]:
    """(pid -> CPU ticks of every process, the pids of `root` and its live descendants), from /proc."""
    parent: dict[int, int] = {}
    cpu: dict[int, float] = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                data = f.read()
        except OSError:
            continue  # gone meanwhile
        rest = data[data.rfind(")") + 2:].split()  # after "pid (comm) ": state ppid ... utime stime cutime cstime
        parent[int(d)] = int(rest[1])
        cpu[int(d)] = float(sum(int(x) for x in rest[11:15]))
    keep = {root}
    changed = True
    while changed:
        changed = False
        for pid, pp in parent.items():
            if pp in keep and pid not in keep:
                keep.add(pid)
                changed = True
    return cpu, keep


def _running(paths: list[str]) -> int:
    """How many of these /proc/.../stat tasks are runnable now (state R)."""
    n = 0
    for p in paths:
        try:
            with open(p) as f:
                data = f.read()
        except OSError:
            continue
        n += data[data.rfind(")") + 2] == "R"
    return n


def _ticks(pids: Sequence[int]) -> float:
    """CPU ticks (user + system, with reaped children) of these processes, from /proc; a gone one counts 0."""
    n = 0.0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                data = f.read()
        except OSError:
            continue
        n += float(sum(int(x) for x in data[data.rfind(")") + 2:].split()[11:15]))
    return n


def _schedstat(tasks: Sequence[str]) -> tuple[float, float]:
    """(seconds on a CPU, seconds runnable but waiting for one) summed over these /proc/.../task/<tid> folders."""
    run = wait = 0.0
    for t in tasks:
        try:
            with open(f"{t}/schedstat") as f:
                a, b = f.read().split()[:2]
        except (OSError, ValueError):
            continue
        run += int(a) / 1e9
        wait += int(b) / 1e9
    return run, wait


class CpuMeter:
    """What other processes on the host (not this one and its descendants) did over a period.

    * `steps`: their runnable threads, sampled every `period_s` (the kernel's running count in
      /proc/loadavg minus this tree's runnable tasks) as (seconds since entering, threads): the
      competitors a fair CPU scheduler shares the cores with; `background` is their mean.
    * `taken`: the cores they used in each `window_s` window, as (seconds since entering, cores):
      the host's busy time (/proc/stat) minus this tree's, per second of wall time. This is the
      capacity the runtime did not get (`Hosts.taken` in the simulator).
    * `others_cores` / `ours_cores`: CPU they / this tree used (cores, averaged over the period).
      CPU-bound neighbours soak up whatever is idle, so `others_cores` is not capacity taken away
      from a runtime that was idle; in a window where the runtime is busy, it is.
    * `ours_wait_share`: of the time this tree's threads were runnable, the share they spent
      waiting for a core (/proc/<pid>/task/<tid>/schedstat): how much the host slowed them.

    Linux only (reads /proc); elsewhere everything stays 0.
    """

    def __init__(self, period_s: float = 0.1, window_s: float = 1.0) -> None:
        self.period_s = period_s
        self.window_s = window_s
        self.others_cores = 0.0
        self.ours_cores = 0.0
        self.background = 0.0
        self.ours_wait_share = 0.0
        self.samples = 0
        self.steps: list[tuple[float, float]] = []
        self.taken: list[tuple[float, float]] = []
        self._t0 = self._host0 = self._ours0 = 0.0
        self._sched0 = (0.0, 0.0)
        self._pids: list[int] = []
        self._tasks: list[str] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._sum = 0.0

    def _sample(self, tasks: list[str]) -> None:
        me = f"/proc/{os.getpid()}/task"
        hz = os.sysconf("SC_CLK_TCK")
        w_t, w_host, w_ours = 0.0, self._host0, self._ours0
        while not self._stop.wait(self.period_s):
            now = time.perf_counter() - self._t0
            try:
                with open("/proc/loadavg") as f:
                    running = int(f.read().split()[3].split("/")[0])
                ours = _running(tasks + [f"{me}/{t}/stat" for t in os.listdir(me)])
                if now - w_t >= self.window_s:
                    host, mine = _host_busy_s(), _ticks(self._pids) / hz
                    self.taken.append((w_t, max(0.0, (host - w_host - (mine - w_ours)) / (now - w_t))))
                    w_t, w_host, w_ours = now, host, mine
            except (OSError, ValueError, IndexError):
                continue
            n = max(0, running - ours)
            self.steps.append((now, float(n)))
            self._sum += n
            self.samples += 1

    def __enter__(self) -> CpuMeter:
        self._t0 = time.perf_counter()
        try:
            _, tree = _tree(os.getpid())
            self._pids = sorted(tree)
            self._host0, self._ours0 = _host_busy_s(), _ticks(self._pids) / os.sysconf("SC_CLK_TCK")
            self._tasks = [f"/proc/{p}/task/{t}" for p in self._pids
                           for t in (os.listdir(f"/proc/{p}/task") if os.path.isdir(f"/proc/{p}/task") else ())]
            self._sched0 = _schedstat(self._tasks)
            tasks = [f"{t}/stat" for t in self._tasks if not t.startswith(f"/proc/{os.getpid()}/")]
        except (OSError, ValueError, IndexError):
            self._t0 = -1.0
            return self
        self._thread = threading.Thread(target=self._sample, args=(tasks,), daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._t0 < 0:
            return
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        if self.samples:
            self.background = self._sum / self.samples
        wall = time.perf_counter() - self._t0
        try:
            host, ours = _host_busy_s() - self._host0, _ticks(self._pids) / os.sysconf("SC_CLK_TCK") - self._ours0
            run, wait = (b - a for a, b in zip(self._sched0, _schedstat(self._tasks), strict=True))
        except (OSError, ValueError, IndexError):
            return
        if wall > 0:
            self.ours_cores = max(0.0, ours / wall)
            self.others_cores = max(0.0, (host - ours) / wall)
        if run + wait > 0:
            self.ours_wait_share = wait / (run + wait)


@dataclass(slots=True)
class RealRequest:
    """What the client saw of one request (times in seconds from the replay's start)."""

    index: int
    arrival_s: float  # scheduled
    prompt_tokens: int
    output_tokens: int  # asked (max_tokens)
    sent_s: float = float("nan")
    first_s: float = float("nan")
    last_s: float = float("nan")
    received: int = 0
    error: str = ""

    @property
    def ttft_s(self) -> float:
        return self.first_s - self.sent_s

    @property
    def tpot_s(self) -> float:
        if self.received <= 1:
            return 0.0
        return (self.last_s - self.first_s) / (self.received - 1)


def replay(url: str, model: str, arrival_s: np.ndarray, prompt_tokens: np.ndarray, output_tokens: np.ndarray, *,
           vocab_size: int, seed: int = 0, timeout_s: float = 300.0) -> list[RealRequest]:
    """Send every request at its arrival offset (open loop, :func:`coral.runtime.serving.loadgen.replay`), streaming, greedy.

    Prompts are random token ids (seeded); `max_tokens` is the trace's output length (the
    served model has no EOS token, so every request produces exactly that many tokens).

    Returns:
        One record per request, in trace order.
    """
    from coral.runtime.serving.loadgen import replay as load_replay

    rng = np.random.default_rng(seed)
    recs = [RealRequest(index=i, arrival_s=float(a), prompt_tokens=int(p), output_tokens=int(d))
            for i, (a, p, d) in enumerate(zip(arrival_s, prompt_tokens, output_tokens, strict=True))]
    prompts = [rng.integers(3, vocab_size, size=int(p)).tolist() for p in prompt_tokens]
    # the one async load generator of `coral bench`, open loop (no concurrency bound)
    results = load_replay(url, model, arrival_s, prompts, output_tokens, max_concurrency=0, timeout_s=timeout_s, ignore_eos=False)
    for rec, res in zip(recs, results, strict=True):
        rec.sent_s, rec.first_s, rec.last_s = res.sent_at_s, res.first_at_s, res.last_at_s
        rec.received = res.output_tokens
        rec.error = "" if res.ok else res.error
    for rec in recs:
        if not rec.error and rec.received != rec.output_tokens:
            rec.error = f"received {rec.received} tokens, asked {rec.output_tokens}"
    return recs


def runtime_overhead(cluster: dict[str, Any], *, requests: int = 16, prompt_tokens: int = 16, output_tokens: int = 8) -> tuple[float, float]:
    """Median TTFT and TPOT of isolated requests on the cluster with no-maths engines (the runtime's own costs).

    Uses the public entry points only: the cluster file, `LocalProvisioner(noop_engines=True)`,
    the HTTP API.

    Returns:
        (median TTFT s, median TPOT s).
    """
    from coral.runtime.deploy.cluster_config import parse_cluster
    from coral.runtime.deploy.deployment import Deployment
    from coral.runtime.deploy.provisioner import LocalProvisioner

    spec = parse_cluster(cluster, "fidelity cluster")
    vocab = int(cluster["models"][0]["hf_config"]["vocab_size"])
    with Deployment(spec, LocalProvisioner(noop_engines=True), http_port=0) as dep:
        recs = replay(dep.url, spec.models[0].name, np.arange(requests) * 0.1, np.full(requests, prompt_tokens),
                      np.full(requests, output_tokens), vocab_size=vocab, seed=7)
    good = [r for r in recs[2:] if not r.error]
    if not good:
        raise CoralError("the no-maths cluster answered no request: " + "; ".join(r.error for r in recs[:3]))
    return float(np.median([r.ttft_s for r in good])), float(np.median([r.tpot_s for r in good]))
