"""Profiling the runtime's layer-range module and its wire on this host (for `coral profile` and the fidelity study).

Per-layer latency is measured on the runtime's own shard (`coral.runtime.engine.model.load_shard`),
run the way the engine runs a micro-batch: one batched forward pass of all its requests over
the engine's paged KV cache (`Shard.forward_batch`, the step's index tensors built by
`PagedKvCache.prepare`), the packed hidden states put into a `TensorBlob` for the next stage,
the tokens picked on the last stage (`select_tokens`). For each shape four shards are timed:
one middle layer, `L-2` middle layers, the first layer (with the embedding) and the last layer
(with the final norm, LM head and sampling). Their differences give

* `layer_ms`: the time of one more layer for the whole micro-batch (what the profile table holds);
* `call_ms`: what every stage pays per micro-batch whatever its layer count (building the
  step's KV indices and masks, the rotary embedding, packing the output);
* `first_ms` / `last_ms`: the first stage's and the last stage's extra work per micro-batch.

The wire is measured by echoing real protocol messages (`ForwardBatch` with hidden states,
`KvPush` with a KV cache) over the runtime's `ZmqTransport` between two processes on
loopback; half the round trip is fitted as `latency_s + bytes / bytes_per_s`.
"""
from __future__ import annotations

import json
import multiprocessing as mp
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from coral.errors import CoralError

__all__ = [
    "EXTRA_CONFIGS",
    "LinkFit",
    "ProfileRow",
    "HostProfile",
    "measure_layers",
    "measure_links",
    "resolve_runtime_model",
    "write_profile",
]

#: A model between the runtime's tiny test configs and `small-llama`: compute dominates the
#: runtime's per-message overheads on a CPU, yet a request takes tens of ms, not seconds.
#: No EOS token, so greedy outputs always run to `max_tokens` (the fidelity study needs that).
EXTRA_CONFIGS: dict[str, dict[str, Any]] = {
    "fid-llama": {
        "model_type": "llama", "vocab_size": 2048, "hidden_size": 256, "intermediate_size": 768,
        "num_hidden_layers": 8, "num_attention_heads": 4, "num_key_value_heads": 2,
        "max_position_embeddings": 1024, "initializer_range": 0.02, "bos_token_id": 1,
    },
}  # fmt: skip

CSV_COLUMNS = ("config", "model", "phase", "tokens", "layer_ms", "batch", "context", "call_ms", "first_ms", "last_ms")


@dataclass(frozen=True, slots=True, kw_only=True)
class ProfileRow:
    """One measured shape: `batch` requests of `context` tokens (prompt, or decode context)."""

    config: str
    model: str
    phase: str
    batch: int
    context: int
    layer_ms: float  # one layer, whole micro-batch
    call_ms: float  # per-stage fixed cost, whole micro-batch
    first_ms: float  # first-stage extra, whole micro-batch
    last_ms: float  # last-stage extra, whole micro-batch

    @property
    def tokens(self) -> int:
        """The profile table's key: `b·P` for prefill, `b` for decode."""
        return self.batch * self.context if self.phase == "prefill" else self.batch


@dataclass(frozen=True, slots=True, kw_only=True)
class LinkFit:
    """One-way message time on this host: `latency_s + bytes / bytes_per_s`."""

    latency_s: float
    bytes_per_s: float
    points: tuple[tuple[float, float], ...]  # (bytes, measured one-way s)

    def time_s(self, nbytes: float) -> float:
        """Predicted one-way time of a message of `nbytes` payload bytes."""
        return self.latency_s + nbytes / self.bytes_per_s


@dataclass(frozen=True, slots=True, kw_only=True)
class HostProfile:
    """What `coral profile` writes next to the CSV (`<csv>.host.json`)."""

    node: str
    model: str
    device: str
    torch_threads: int
    dtype: str
    model_config: dict[str, Any]
    activation: LinkFit
    kv: LinkFit
    wall_s: float


def resolve_runtime_model(model: str) -> tuple[str, dict[str, Any]]:
    """A runtime model config by built-in name or from a config.json path.

    Returns:
        (name, HF-style config dict).

    Raises:
        CoralError: an unknown name or unreadable file.
    """
    from coral.runtime.engine.model import BUILTIN_CONFIGS

    if model in EXTRA_CONFIGS:
        return model, dict(EXTRA_CONFIGS[model])
    if model in BUILTIN_CONFIGS:
        return model, dict(BUILTIN_CONFIGS[model])
    p = Path(model)
    if p.is_dir():
        p = p / "config.json"
    if not p.is_file():
        names = sorted([*EXTRA_CONFIGS, *BUILTIN_CONFIGS])
        raise CoralError(f"model {model!r} is neither a built-in runtime config ({', '.join(names)}) nor a config.json file")
    try:
        cfg = json.loads(p.read_text())
    except json.JSONDecodeError as e:
        raise CoralError(f"{p}: not valid JSON: {e}") from None
    if "model_type" not in cfg:
        raise CoralError(f"{p}: needs a model_type (e.g. llama, qwen3)")
    return p.parent.name or p.stem, cfg


# --------------------------------------------------------------------------- layers


def _run_items(shard: Any, kv: Any, seqs: list[str], position: int, n_new: int, hidden_size: int, vocab: int) -> None:
    """One micro-batch through a shard, as the engine does it: one batched pass over its KV pool."""
    import torch

    from coral.runtime.engine.model import select_tokens
    from coral.runtime.protocol import TensorBlob

    spec = shard.spec
    b = len(seqs)
    meta = kv.prepare([(s, position, n_new) for s in seqs])
    if spec.is_first:
        ids = torch.tensor([3 + (7 * i + 13 * k) % (vocab - 3) for i in range(b) for k in range(n_new)], dtype=torch.long)
        out = shard.forward_batch(meta, ids, None)
    else:
        hidden = TensorBlob.from_torch(torch.randn(b * n_new, hidden_size)).to_torch(spec.device)
        out = shard.forward_batch(meta, None, hidden)
    if spec.is_last:
        select_tokens(out, [0.0] * b, [0] * b, [position] * b)
    else:
        TensorBlob.from_torch(out)


class _CacheFlush:
    """Evicts the CPU caches before a timed run: in the runtime an engine shares its core with other
    processes, so its weights are rarely still cached when its next micro-batch comes (measured on
    this host: ~15-20 % slower decode than back-to-back runs)."""

    def __init__(self, nbytes: int) -> None:
        import numpy as np

        self.buf = np.ones(max(nbytes, 8) // 8) if nbytes > 0 else None

    def __call__(self) -> None:
        if self.buf is not None:
            self.buf += 1.0


def _time_shape(shard: Any, phase: str, batch: int, context: int, reps: int, hidden_size: int, vocab: int,
                flush: _CacheFlush, clock: Callable[[], float] = time.perf_counter) -> float:
    """Median seconds (of `clock`) of one micro-batch of `batch` requests through `shard`."""
    times = []
    kv = shard.new_kv_cache(max_tokens_wanted=(batch + 1) * (context + reps + 4 + 16))  # + a block of rounding per sequence
    if phase == "prefill":
        _run_items(shard, kv, ["warm"], 0, context, hidden_size, vocab)  # warm the kernels for this length
        kv.free("warm")
        for r in range(reps):
            seqs = [f"p{r}.{i}" for i in range(batch)]
            flush()
            t0 = clock()
            _run_items(shard, kv, seqs, 0, context, hidden_size, vocab)
            times.append(clock() - t0)
            for s in seqs:
                kv.free(s)
    else:
        seqs = [f"d{i}" for i in range(batch)]
        _run_items(shard, kv, seqs, 0, context, hidden_size, vocab)  # fill the KV caches (untimed)
        pos = context
        _run_items(shard, kv, seqs, pos, 1, hidden_size, vocab)
        pos += 1
        for _ in range(reps):
            flush()
            t0 = clock()
            _run_items(shard, kv, seqs, pos, 1, hidden_size, vocab)
            times.append(clock() - t0)
            pos += 1
    return statistics.median(times)


def measure_layers(
    config: dict[str, Any],
    *,
    node: str,
    model: str,
    batches: Sequence[int],
    prompt_tokens: Sequence[int],
    decode_batches: Sequence[int],
    contexts: Sequence[int],
    device: str = "cpu",
    dtype: str = "float32",
    reps: int = 3,
    flush_bytes: int = 64 * 2**20,
    progress: Any = None,
) -> list[ProfileRow]:
    """Time the runtime's shard over a grid of prefill and decode shapes.

    Args:
        config: the HF-style model config (at least 4 layers).
        node, model: the CSV's `config` and `model` keys.
        batches, prompt_tokens: the prefill grid (micro-batch sizes x prompt lengths).
        decode_batches, contexts: the decode grid (sequences x context lengths).
        device, dtype: where and how the shard runs.
        reps: timed repetitions per point (median kept). On the CPU with one torch thread, a
            run is timed in this process's CPU seconds, not wall seconds, so that other processes
            on the host do not inflate the table (how the cores are shared is the simulator's
            host model's business, not the profile's).
        flush_bytes: memory touched before every timed run to evict the caches (0 = time warm runs).
        progress: optional callable(str) told about each point.

    Returns:
        One row per grid point, prefill first.

    Raises:
        CoralError: a model with fewer than 4 layers, or lengths beyond its context.
    """
    from coral.runtime.engine.model import ShardSpec, load_shard

    n_layers = int(config["num_hidden_layers"])
    if n_layers < 4:
        raise CoralError(f"profiling needs a model of at least 4 layers (to separate per-layer and per-stage costs), got {n_layers}")
    ctx_max = int(config.get("max_position_embeddings", 2048))
    longest = max([*prompt_tokens, *(c + reps + 2 for c in contexts)])
    if longest > ctx_max:
        raise CoralError(f"lengths up to {longest} exceed the model's context {ctx_max}")
    hidden, vocab = int(config["hidden_size"]), int(config["vocab_size"])
    k = n_layers - 2
    shards = {
        name: load_shard(ShardSpec(config=config, layer_start=lo, layer_end=hi, seed=0, device=device, dtype=dtype))
        for name, (lo, hi) in {"mid1": (1, 2), "midk": (1, 1 + k), "first": (0, 1), "last": (n_layers - 1, n_layers)}.items()
    }
    grid = [("prefill", b, p) for p in prompt_tokens for b in batches] + [("decode", b, c) for c in contexts for b in decode_batches]
    flush = _CacheFlush(flush_bytes)
    import torch

    clock = time.process_time if device == "cpu" and torch.get_num_threads() == 1 else time.perf_counter
    rows = []
    for phase, b, ctx in grid:
        t = {name: _time_shape(sh, phase, b, ctx, reps, hidden, vocab, flush, clock) for name, sh in shards.items()}
        layer = max((t["midk"] - t["mid1"]) / (k - 1), 1e-7)
        call = max(t["mid1"] - layer, 0.0)
        first = max(t["first"] - t["mid1"], 0.0)
        last = max(t["last"] - t["mid1"], 0.0)
        row = ProfileRow(config=node, model=model, phase=phase, batch=b, context=ctx, layer_ms=layer * 1e3,
                         call_ms=call * 1e3, first_ms=first * 1e3, last_ms=last * 1e3)
        rows.append(row)
        if progress:
            progress(f"{phase:7s} b={b:<3d} len={ctx:<5d} layer {row.layer_ms:7.3f} ms  stage call {row.call_ms:6.3f} ms  "
                     f"first +{row.first_ms:6.3f}  last +{row.last_ms:6.3f}")
    return rows


# --------------------------------------------------------------------------- links


def _echo_main(conn: Any, host: str) -> None:
    """Child process: bounce every ForwardBatch / KvPush back to its sender until Shutdown."""
    from coral.runtime.protocol import ForwardBatch, KvPush, Shutdown
    from coral.runtime.transport import ZmqTransport

    t = ZmqTransport(host=host)
    conn.send(t.address)
    try:
        while True:
            msg = t.recv(5.0)
            if msg is None or isinstance(msg, Shutdown):
                break
            if isinstance(msg, ForwardBatch):
                t.send(msg.reply_to, msg)
            elif isinstance(msg, KvPush):
                t.send(msg.notify, msg)
    finally:
        t.close()


def _fit(points: list[tuple[float, float]]) -> tuple[float, float]:
    """Least squares `t = a + x / bw` (a >= 0, bw > 0)."""
    import numpy as np

    x = np.array([p[0] for p in points])
    y = np.array([p[1] for p in points])
    slope, a = np.polyfit(x, y, 1) if len(set(x.tolist())) > 1 else (0.0, float(y.mean()))
    slope = max(float(slope), 1e-12)
    return max(float(a), 0.0), 1.0 / slope


def measure_links(config: dict[str, Any], *, host: str = "127.0.0.1", reps: int = 15,
                  tokens: Sequence[int] = (1, 16, 128, 512), kv_tokens: Sequence[int] = (16, 128, 512)) -> tuple[LinkFit, LinkFit]:
    """Echo real protocol messages over ZeroMQ loopback to a child process.

    Args:
        config: the model config (sizes the hidden states and KV caches).
        host: loopback interface.
        reps: round trips per size (median kept).
        tokens: hidden-state sizes (tokens) of the `ForwardBatch` messages.
        kv_tokens: sequence lengths of the `KvPush` messages (all layers).

    Returns:
        (activation fit, KV fit), one-way times.
    """
    from coral.runtime.protocol import BatchItem, ForwardBatch, KvPush, Shutdown, TensorBlob
    from coral.runtime.transport import ZmqTransport

    hidden, n_layers = int(config["hidden_size"]), int(config["num_hidden_layers"])
    kv_heads = int(config.get("num_key_value_heads") or config["num_attention_heads"])
    head_dim = int(config.get("head_dim") or hidden // int(config["num_attention_heads"]))
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_echo_main, args=(child, host), daemon=True)
    proc.start()
    me = ZmqTransport(host=host)
    try:
        if not parent.poll(60):
            raise CoralError("the echo process did not start")
        peer = parent.recv()

        def rtt(msg: Any) -> float:
            out = []
            for i in range(reps + 2):
                t0 = time.perf_counter()
                me.send(peer, msg)
                if me.recv(10.0) is None:
                    raise CoralError("loopback echo timed out")
                if i >= 2:
                    out.append(time.perf_counter() - t0)
            return statistics.median(out)

        act = []
        for n in tokens:
            blob = TensorBlob(dtype="float32", shape=(1, n, hidden), data=bytes(4 * n * hidden))
            item = BatchItem(request_id="r", position=0, token_ids=(1,), hidden=blob, route=(peer, peer), temperature=0.0, seed=0, step=0)
            msg = ForwardBatch(batch_id=1, reply_to=me.address, items=(item,))
            act.append((4.0 * n * hidden, rtt(msg) / 2))
        kv = []
        for n in kv_tokens:
            blob = TensorBlob(dtype="float32", shape=(1, kv_heads, n, head_dim), data=bytes(4 * kv_heads * n * head_dim))
            msg2 = KvPush(request_id="r", layer_start=0, seq_len=n, keys=(blob,) * n_layers, values=(blob,) * n_layers, notify=me.address)
            kv.append((2.0 * n_layers * 4 * kv_heads * n * head_dim, rtt(msg2) / 2))
        me.send(peer, Shutdown())
    finally:
        me.close()
        proc.join(10)
        if proc.is_alive():
            proc.terminate()
    a1, bw1 = _fit(act)
    a2, bw2 = _fit(kv)
    return (LinkFit(latency_s=a1, bytes_per_s=bw1, points=tuple(act)),
            LinkFit(latency_s=a2, bytes_per_s=bw2, points=tuple(kv)))


# --------------------------------------------------------------------------- files


def write_profile(rows: Sequence[ProfileRow], host: HostProfile, out: str | Path) -> tuple[Path, Path]:
    """Write the profile CSV (`load_profile_csv` reads it) and `<out>.host.json`.

    The CSV has the table's columns `config,model,phase,tokens,layer_ms` and, for the
    engine-aware reader (`coral.experiments.fidelity_perf`), `batch,context,call_ms,first_ms,last_ms`.
    `load_profile_csv` keys rows by tokens only, so where two prefill shapes share `b·P` the
    later row wins there; the rows are written with batch 1 last so that it does.

    Returns:
        (CSV path, host JSON path).
    """
    p = Path(out)
    p.parent.mkdir(parents=True, exist_ok=True)
    ordered = sorted(rows, key=lambda r: (r.phase != "prefill", -r.batch, r.context))
    lines = [",".join(CSV_COLUMNS)]
    for r in ordered:
        lines.append(f"{r.config},{r.model},{r.phase},{r.tokens},{r.layer_ms:.6f},{r.batch},{r.context},"
                     f"{r.call_ms:.6f},{r.first_ms:.6f},{r.last_ms:.6f}")
    tmp = p.with_name(p.name + ".tmp")
    tmp.write_text("\n".join(lines) + "\n")
    tmp.replace(p)
    hp = host_path(p)
    hp.write_text(json.dumps(asdict(host), indent=2) + "\n")
    return p, hp


def host_path(csv_path: str | Path) -> Path:
    """Where the host measurements of a profile CSV live."""
    p = Path(csv_path)
    return p.with_name(p.name + ".host.json")


def read_host(csv_path: str | Path) -> HostProfile:
    """Read `<csv>.host.json`.

    Raises:
        CoralError: missing or malformed.
    """
    hp = host_path(csv_path)
    if not hp.is_file():
        raise CoralError(f"{hp} not found (written by `coral profile` next to the CSV)")
    try:
        d = json.loads(hp.read_text())
        links = {k: LinkFit(latency_s=float(d[k]["latency_s"]), bytes_per_s=float(d[k]["bytes_per_s"]),
                            points=tuple(tuple(x) for x in d[k]["points"])) for k in ("activation", "kv")}
        return HostProfile(node=d["node"], model=d["model"], device=d["device"], torch_threads=int(d["torch_threads"]),
                           dtype=d["dtype"], model_config=dict(d["model_config"]), activation=links["activation"],
                           kv=links["kv"], wall_s=float(d["wall_s"]))
    except (KeyError, TypeError, ValueError, json.JSONDecodeError) as e:
        raise CoralError(f"{hp}: malformed host profile: {e}") from None
