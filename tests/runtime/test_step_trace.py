"""The scheduler's opt-in per-micro-batch trace (what the fidelity study compares simulated steps against)."""

from __future__ import annotations

from typing import Any

from coral.runtime.engine.inproc import start_inproc_instance
from coral.runtime.engine.model import BUILTIN_CONFIGS
from coral.runtime.protocol import Submit
from coral.runtime.transport import InprocHub, InprocTransport

from .test_pipeline_inproc import PROMPTS, collect


def test_every_micro_batch_is_traced_once_with_its_composition(threads: list) -> None:  # noqa: ARG001
    cfg = BUILTIN_CONFIGS["tiny-llama"]
    hub = InprocHub()
    inst = start_inproc_instance(hub, "M", config=cfg, seed=3, stages=[(0, 3, 1), (3, 6, 1)])
    rows: list[tuple[Any, ...]] = []
    assert inst.scheduler.step_trace is None  # off unless asked for
    inst.scheduler.step_trace = rows.append  # before the first request: nothing was dispatched yet
    client = InprocTransport(hub, "client")
    prompts = PROMPTS[:3]
    n = 4
    try:
        for i, p in enumerate(prompts):
            client.send("M", Submit(request_id=f"r{i}", prompt=tuple(p), max_tokens=n, temperature=0.0, seed=0, eos_ids=(), reply_to="client"))
        got = collect(client, len(prompts), timeout_s=60)
    finally:
        inst.stop()
    assert len(prompts) == len(got)
    # each request makes n passes: its prompt once, then one token at a time
    assert len(prompts) * n == sum(r[4] for r in rows)
    assert sum(len(p) for p in prompts) + len(prompts) * (n - 1) == sum(r[5] for r in rows)
    # context after a pass: the prompt, then one more token each pass
    assert sum(sum(len(p) + k for k in range(n)) for p in prompts) == sum(r[6] for r in rows)
    assert len(rows) == len({r[3] for r in rows})  # one row per batch id
    assert all(r[0] == "M" and r[2] in (0, 1) and r[7] <= r[8] for r in rows)
