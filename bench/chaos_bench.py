"""Chaos soak: `coral bench` against `coral serve` while a random engine is killed (SIGKILL) every minute.

`coral serve` runs a two-model tiny cluster (tiny-llama: a 2-stage prefill instance and a 3-stage
decode instance with a data-parallel middle stage; tiny-qwen3: a 2-stage colocated (`mixed`) instance
whose steps carry at most 8 prompt tokens beside their decodes, so most prompts span several steps) as
a user would start it; one `coral bench --json` per model streams Poisson load at a moderate rate; every
`kill_every_s` a random engine process of the cluster gets SIGKILL. Nobody touches the server:
self-repair must bring every model back. Measured:

- sent = completed + refused (with an error) + cut; the target: 0 cut, every failure a clear refusal;
- per kill, the seconds until every model's /health is `ok` again (target: <= 30 s);
- RSS growth of `coral serve`'s process tree and of its own process between warm-up and the end
  (target: <= 5 %);
- `coral serve` then stops on SIGTERM with exit code 0.

Run: `python bench/chaos_bench.py [--quick]` (quick: 60 s, a kill every 20 s; else 10 minutes, a
kill every 60 s); `make bench` runs it as the `chaos` section. `soak(...)` is what tests/runtime/test_chaos.py runs (36 s; 60 s under `make test-long`).
"""
from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import yaml

CLUSTER = """\
coordinator: {host: 127.0.0.1, port: 0, heartbeat_s: 0.1, heartbeat_timeout_s: 1.0, max_retries: 3}
device: cpu
torch_threads: 1
models:
  - {name: tiny-llama, builtin: tiny-llama, weights: {seed: 0}}
  - {name: tiny-qwen3, builtin: tiny-qwen3, weights: {seed: 1}}
instances:
  - {name: llama-prefill, model: tiny-llama, phase: prefill, throughput_tok_per_s: 200,
     stages: [{layers: [0, 2]}, {layers: [2, 6]}]}
  - {name: llama-decode, model: tiny-llama, phase: decode, throughput_tok_per_s: 100,
     stages: [{layers: [0, 1]}, {layers: [1, 4], nodes: [1.0, 2.0]}, {layers: [4, 6]}]}
  - {name: qwen3-mixed, model: tiny-qwen3, phase: mixed, chunk_tokens: 8, stages: [{layers: [0, 3]}, {layers: [3, 6]}]}
"""


def _children(pid: int) -> list[int]:
    out = []
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        if ppid == pid:
            out.append(int(d))
    return out


def _tree(pid: int) -> list[int]:
    todo, seen = [pid], []
    while todo:
        p = todo.pop()
        seen.append(p)
        todo += _children(p)
    return seen


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _rss_kib(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
    except (OSError, StopIteration, ValueError):
        return 0


def _engines(serve_pid: int) -> list[int]:
    """The engine processes: the children of the engine launcher (the zygote forks one per node)."""
    zygotes = [p for p in _children(serve_pid) if "worker zygote" in _cmdline(p)]
    return [c for z in zygotes for c in _children(z)]


def _health(url: str) -> dict[str, str]:
    try:
        with urllib.request.urlopen(url + "/health", timeout=5) as r:
            return json.loads(r.read())["models"]
    except urllib.error.HTTPError as e:
        return json.loads(e.read())["models"]
    except (OSError, ValueError, KeyError):
        return {}


def soak(duration_s: float, kill_every_s: float, rate_per_s: float = 4.0, seed: int = 0, workdir: Path | None = None,
         cluster: str = CLUSTER) -> dict[str, Any]:
    """Run the soak (on `cluster`, a cluster file's text: one `coral bench` per model); returns its figures
    (see the module docstring)."""
    rng = random.Random(seed)
    tmp = Path(workdir or tempfile.mkdtemp(prefix="coral-chaos-"))
    (tmp / "cluster.yaml").write_text(cluster)
    models = [m["name"] for m in yaml.safe_load(cluster)["models"]]
    ready = tmp / "ready"
    coral = [str(Path(sys.executable).parent / "coral")]  # the command a user runs
    log = open(tmp / "serve.log", "wb")  # noqa: SIM115 - closed below
    serve = subprocess.Popen([*coral, "serve", "--config", str(tmp / "cluster.yaml"), "--ready-file", str(ready),
                              "--log-level", "WARNING"], stdout=log, stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
    out: dict[str, Any] = {"kills": []}
    try:
        deadline = time.monotonic() + 180
        while not ready.exists():
            if serve.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"coral serve did not start: {(tmp / 'serve.log').read_text()[-2000:]}")
            time.sleep(0.1)
        url = ready.read_text().strip()
        benches = {m: subprocess.Popen([*coral, "bench", "--url", url, "--model", m, "--rate", str(rate_per_s), "--duration-s",
                                        str(duration_s), "--prompt-tokens", "16", "--output-tokens", "24", "--json",
                                        "--seed", str(seed + k), "--timeout-s", "60"],
                                       stdout=subprocess.PIPE, stderr=subprocess.PIPE)
                   for k, m in enumerate(models)}  # fmt: skip
        t0 = time.monotonic()
        rss0: tuple[int, int] | None = None
        next_kill = t0 + kill_every_s
        while any(b.poll() is None for b in benches.values()):
            now = time.monotonic()
            if rss0 is None and now - t0 > min(20.0, duration_s / 4):  # after warm-up
                rss0 = (sum(_rss_kib(p) for p in _tree(serve.pid)), _rss_kib(serve.pid))
            if now >= next_kill and now - t0 < duration_s - 5:
                engines = _engines(serve.pid)
                victim = rng.choice(engines)
                os.kill(victim, signal.SIGKILL)
                t_kill = time.monotonic()
                # back to ok: every model's /health, after the loss was seen (or 5 s, for a loss routed around)
                seen_loss, back = False, None
                while time.monotonic() - t_kill < 60:
                    h = _health(url)
                    if any(v != "ok" for v in h.values()):
                        seen_loss = True
                    elif h and (seen_loss or time.monotonic() - t_kill > 5):
                        back = time.monotonic() - t_kill
                        break
                    time.sleep(0.1)
                out["kills"].append({"at_s": round(t_kill - t0, 1), "pid": victim, "back_to_ok_s": back, "loss_seen": seen_loss})
                next_kill = t_kill + kill_every_s
            time.sleep(0.2)
        rss1 = (sum(_rss_kib(p) for p in _tree(serve.pid)), _rss_kib(serve.pid))
        reports = {}
        for m, b in benches.items():
            stdout, stderr = b.communicate(timeout=60)
            try:
                reports[m] = json.loads(stdout)
            except json.JSONDecodeError:
                raise RuntimeError(f"coral bench {m} printed no report: {stderr.decode()[-2000:]}") from None
        out["sent"] = sum(r["sent"] for r in reports.values())
        out["completed"] = sum(r["completed"] for r in reports.values())
        out["refused"] = sum(r["refused"] for r in reports.values())
        out["cut"] = sum(r["cut"] for r in reports.values())
        out["errors"] = [e for r in reports.values() for e in r["errors"]][:10]
        out["lost"] = [f"{m}: {e}" for m, r in reports.items() for e in r.get("lost", [])]  # every cut or unanswered one
        if rss0:
            out["rss_growth_tree"] = rss1[0] / rss0[0] - 1
            out["rss_growth_serve"] = rss1[1] / rss0[1] - 1
        serve.send_signal(signal.SIGTERM)
        out["serve_exit"] = serve.wait(timeout=60)
    finally:
        if serve.poll() is None:
            os.killpg(serve.pid, signal.SIGKILL)
            serve.wait(timeout=10)
        log.close()
    out["serve_log_tail"] = (tmp / "serve.log").read_text()[-1500:]
    return out


def run(quick: bool) -> list[dict[str, Any]]:
    """`make bench`'s rows: 10 minutes with a kill every 60 s (quick: 60 s, every 20 s)."""
    duration, every = (60.0, 20.0) if quick else (600.0, 60.0)
    r = soak(duration, every)
    worst = max((k["back_to_ok_s"] if k["back_to_ok_s"] is not None else float("inf")) for k in r["kills"])
    rows = [
        {"bench": f"chaos {duration:.0f} s: requests sent", "value": r["sent"], "unit": f"{len(r['kills'])} engines killed"},
        {"bench": "chaos: sent - completed - refused (lost: cut + unanswered)", "value": r["sent"] - r["completed"] - r["refused"],
         "goal": "<= 0", "unit": "; ".join(r["lost"])[:300]},
        {"bench": "chaos: cut streams", "value": r["cut"], "goal": "<= 0"},
        {"bench": "chaos: refused with an error", "value": r["refused"], "unit": "; ".join(r["errors"][:2])[:150]},
        {"bench": "chaos: worst seconds back to ok after a kill", "value": worst, "goal": "<= 30"},
        {"bench": "chaos: RSS growth of coral serve's process tree", "value": r.get("rss_growth_tree", float("nan")), "goal": "<= 0.05"},
        {"bench": "chaos: RSS growth of the coral serve process", "value": r.get("rss_growth_serve", float("nan")), "goal": "<= 0.05"},
        {"bench": "chaos: coral serve exit code on SIGTERM", "value": r["serve_exit"], "goal": "<= 0"},
    ]
    return rows


def main() -> None:
    quick = "--quick" in sys.argv
    for row in run(quick):
        print(json.dumps(row))


if __name__ == "__main__":
    main()
