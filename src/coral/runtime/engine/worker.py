"""Process entry point of the runtime's child processes: ``python -m coral.runtime.engine.worker ROLE JSON``.

ROLE is ``engine``, ``scheduler`` or ``zygote``; JSON is the process's spec, written by
the provisioner (see :mod:`coral.runtime.deploy.provisioner`). A child exits on
:class:`Shutdown`, on SIGTERM, or when its parent process goes away, so no process
outlives ``coral serve``.

Importing torch and transformers costs several seconds of CPU per process, so the local
provisioner starts engines through a *zygote*: one process that imports them once, then
forks one engine process per line of JSON read on stdin (and answers with the pid).
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import threading
import time
from typing import Any

from coral.runtime.engine import EngineNode, NoopShard, model
from coral.runtime.engine.scheduler import NodeSlot, Scheduler
from coral.runtime.protocol import DEFAULT_MAX_MESSAGE_BYTES
from coral.runtime.transport import CurveKeys, ZmqTransport

__all__ = ["main", "run_engine", "run_scheduler"]


def _watch_parent(stop: threading.Event, parent: int) -> None:
    """Set ``stop`` when the parent dies (we get re-parented)."""

    def loop() -> None:
        while not stop.is_set():
            if os.getppid() != parent:
                stop.set()
                return
            time.sleep(0.5)

    threading.Thread(target=loop, daemon=True).start()


def _device(name: str, index: int = 0) -> str:
    """The engine's device: ``auto`` and ``cuda`` take GPU ``index`` (modulo the host's GPUs), ``cuda:N`` is kept."""
    if name not in ("auto", "cuda"):
        return name
    # lazy: torch (runtime extra; processes without layers never load it)
    import torch

    if not torch.cuda.is_available():
        if name == "cuda":
            raise RuntimeError("device cuda requested but torch sees no CUDA device")
        return "cpu"
    return f"cuda:{index % torch.cuda.device_count()}"


def _transport(spec: dict[str, Any], port: int = 0) -> Any:
    keys = spec.get("curve_keys_dir")
    return ZmqTransport(
        host=spec.get("host", "127.0.0.1"), port=port, curve=CurveKeys.load(keys) if keys else None,
        max_message_bytes=int(spec.get("max_message_bytes", DEFAULT_MAX_MESSAGE_BYTES)),
    )  # fmt: skip


def run_engine(spec: dict[str, Any], parent: int) -> None:
    """Load one node's layers and serve until told to stop.

    Args:
        spec: instance_id, stage, node_index, scheduler, host, threads, and either
            ``noop`` (layer_start, layer_end, num_layers) or ``shard`` (ShardSpec fields);
            ``device_index`` (the GPU this engine gets on its host) and, on a tensor-parallel
            node, ``tp`` (rank, world, init_method): rank 0 serves, the others follow.
        parent: the provisioner's pid.
    """
    if "noop" in spec:
        n = spec["noop"]
        shard: Any = NoopShard(n["layer_start"], n["layer_end"], n["num_layers"])
    else:
        # lazy: torch (runtime extra; processes without layers never load it)
        import torch

        # lazy: torch (a scheduler or no-op engine never loads it)
        from coral.runtime.engine.model import ShardSpec, load_shard

        torch.set_num_threads(int(spec.get("threads", 1)))
        s = dict(spec["shard"])
        tp_spec = spec.get("tp")
        rank = int(tp_spec["rank"]) if tp_spec else 0
        s["device"] = _device(s.get("device", "auto"), int(spec.get("device_index", 0)) + rank)
        shard = load_shard(ShardSpec(**s))
        if tp_spec:
            # lazy: torch (a scheduler or no-op engine never loads it)
            from coral.runtime.engine.tp import TpGroup, run_follower, split_for_tp

            tp = TpGroup(rank=rank, world=int(tp_spec["world"]), init_method=tp_spec["init_method"], device=s["device"])
            split_for_tp(shard, rank, tp.world)
            if rank > 0:
                stop = threading.Event()
                _watch_parent(stop, parent)
                threading.Thread(target=lambda: (stop.wait(), os._exit(0)), daemon=True).start()
                try:
                    run_follower(shard, tp)
                finally:
                    tp.close()
                return
            spec = {**spec, "_tp": tp}
    t = _transport(spec)
    beats = _transport(spec)  # heartbeats go out from a thread, on their own socket
    hb = float(spec.get("heartbeat_s", 0.25))
    node = EngineNode(
        t, shard, instance_id=spec["instance_id"], stage=spec["stage"], node_index=spec["node_index"], scheduler=spec["scheduler"],
        heartbeat_s=hb, heartbeat_timeout_s=2 * float(spec.get("heartbeat_timeout_s", 2.0)),
        kv_cache_gib=float(spec.get("kv_cache_gib", 0.0)) / (spec["_tp"].world if "_tp" in spec else 1), tp=spec.get("_tp"), beat_transport=beats,
    )  # fmt: skip
    _watch_parent(node.stop_event, parent)
    signal.signal(signal.SIGTERM, lambda *_: node.stop_event.set())
    try:
        node.run()
    finally:
        node.stop_event.set()
        beats.close()
        t.close()


def run_scheduler(spec: dict[str, Any], parent: int) -> None:
    """Run one instance's scheduler until told to stop.

    Args:
        spec: instance fields, ``nodes`` (NodeSlot fields), ``coordinator``, ``host``, ``port``.
        parent: the provisioner's pid.
    """
    t = _transport(spec, int(spec.get("port", 0)))
    trace_dir = os.environ.get("CORAL_STEP_TRACE", "")  # opt-in: one CSV of micro-batch times per instance
    trace_file = open(os.path.join(trace_dir, f"{spec['instance_id']}.steps.csv"), "a", buffering=1) if trace_dir else None  # noqa: SIM115

    def step_trace(row: tuple[Any, ...]) -> None:
        assert trace_file is not None
        trace_file.write(",".join(map(str, row)) + "\n")

    sch = Scheduler(
        t, instance_id=spec["instance_id"], model=spec["model"], phase=spec["phase"], region=spec["region"],
        throughput_tok_per_s=float(spec["throughput_tok_per_s"]), nodes=[NodeSlot(**n) for n in spec["nodes"]],
        coordinator=spec.get("coordinator", ""), micro_batches=int(spec.get("micro_batches", 0)),
        chunk_tokens=int(spec.get("chunk_tokens") or 0),
        heartbeat_s=float(spec.get("heartbeat_s", 0.25)), heartbeat_timeout_s=float(spec.get("heartbeat_timeout_s", 2.0)),
        step_trace=step_trace if trace_file is not None else None,
    )  # fmt: skip
    _watch_parent(sch.stop_event, parent)
    signal.signal(signal.SIGTERM, lambda *_: sch.stop_event.set())
    try:
        sch.run()
    finally:
        t.close()
        if trace_file is not None:
            trace_file.close()


def run_zygote(spec: dict[str, Any]) -> None:
    """Pre-import the engine's libraries, then fork an engine per stdin line until stdin closes.

    Each stdin line is an engine spec (JSON); the zygote answers ``<pid>\\n`` on stdout.
    On SIGTERM or end of input it terminates its engines, waits for them, and exits.

    Args:
        spec: ``model_types`` to pre-import (e.g. ["llama", "qwen3"]).
    """
    # lazy: transformers (runtime extra; processes without layers never load it)
    import transformers  # noqa: F401 - the point is to import it once
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    for mt in spec.get("model_types", []):
        try:
            cfg = model.make_config({"model_type": mt})
            MODEL_FOR_CAUSAL_LM_MAPPING[type(cfg)]
        except Exception:  # an unknown type fails later, in the engine, with a clear error
            pass
    children: set[int] = set()
    me = os.getpid()

    def reap(*_: Any) -> None:
        while True:
            try:
                pid, _status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            children.discard(pid)

    def stop_children() -> None:
        for pid in list(children):
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                children.discard(pid)
        deadline = time.monotonic() + 5
        while children and time.monotonic() < deadline:
            reap()
            time.sleep(0.05)
        for pid in list(children):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        reap()

    signal.signal(signal.SIGCHLD, reap)
    def on_term(*_: Any) -> None:
        stop_children()
        os._exit(0)

    signal.signal(signal.SIGTERM, on_term)
    while True:
        line = sys.stdin.readline()
        if not line:
            break
        child = json.loads(line)
        pid = os.fork()
        if pid == 0:  # the engine
            code = 0
            try:
                signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                signal.signal(signal.SIGTERM, signal.SIG_DFL)
                devnull = os.open(os.devnull, os.O_RDWR)
                os.dup2(devnull, 0)
                os.dup2(devnull, 1)
                run_engine(child, me)
            except BaseException:
                logging.getLogger(__name__).exception("engine process failed")
                code = 1
            finally:
                os._exit(code)
        children.add(pid)
        sys.stdout.write(f"{pid}\n")
        sys.stdout.flush()
    stop_children()


def main(argv: list[str] | None = None) -> int:
    """Run the role named in ``argv`` (default ``sys.argv[1:]``)."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2 or args[0] not in ("engine", "scheduler", "zygote"):
        print("usage: python -m coral.runtime.engine.worker {engine|scheduler|zygote} SPEC_JSON", file=sys.stderr)
        return 2
    spec = json.loads(args[1])
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C goes to `coral serve`, which stops us in order
    logging.basicConfig(level=spec.get("log_level", "WARNING"), format=f"%(asctime)s {args[0]} %(name)s %(levelname)s %(message)s")
    parent = int(spec.get("parent_pid", os.getppid()))
    if args[0] == "zygote":
        run_zygote(spec)
    else:
        (run_engine if args[0] == "engine" else run_scheduler)(spec, parent)
    return 0


if __name__ == "__main__":
    sys.exit(main())
