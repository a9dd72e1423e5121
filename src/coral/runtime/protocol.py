"""Every message the runtime's processes exchange, and their msgpack encoding (never pickle).

A message is a frozen dataclass registered here. On the wire it is a msgpack map
``{"@": tag, field: value, ...}``; nested messages are maps of the same shape, tuples are
arrays, tensors are :class:`TensorBlob` (dtype name, shape, raw little-endian bytes).
:func:`decode` checks the tag, the field names and every field's type against the
dataclass annotations, and raises :class:`ProtocolError` on anything else, so a malformed
or hostile message never reaches a handler.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import dataclass
from typing import Any

import msgpack

__all__ = [
    "DEFAULT_MAX_MESSAGE_BYTES",
    "BatchItem",
    "Cancel",
    "DecodeAdmit",
    "Drain",
    "EngineHello",
    "ForwardBatch",
    "ForwardResult",
    "Heartbeat",
    "InstanceHello",
    "KvLoaded",
    "KvPush",
    "KvSend",
    "KvTarget",
    "KvSource",
    "Message",
    "ProtocolError",
    "Release",
    "Shutdown",
    "Submit",
    "TOKEN_ERROR",
    "TOKEN_NO_KV",
    "TensorBlob",
    "TokenItem",
    "TokenOut",
    "decode",
    "encode",
]

#: Messages larger than this are rejected by every transport (a KV push of a long prompt
#: of a large model is the biggest legitimate message; raise it for such deployments).
DEFAULT_MAX_MESSAGE_BYTES = 256 * 1024 * 1024

#: :attr:`TokenItem.token` when the request failed on an engine (the result's ``error`` says why).
TOKEN_ERROR = -1
#: :attr:`TokenItem.token` when an engine had no KV blocks left for the request: not a
#: failure, the scheduler puts it back in its queue (it is recomputed later).
TOKEN_NO_KV = -2

_DTYPES = ("float32", "float16", "bfloat16", "float64", "int64", "int32")


class ProtocolError(ValueError):
    """A message that cannot be decoded: bad msgpack, unknown tag, wrong fields or types."""


_REGISTRY: dict[str, type] = {}
_HINTS: dict[type, dict[str, Any]] = {}


def _message(cls: type) -> type:
    """Register a frozen dataclass as a wire message under its class name."""
    _REGISTRY[cls.__name__] = cls
    return cls


# ---------------------------------------------------------------------------- values


@_message
@dataclass(frozen=True, slots=True, kw_only=True)
class TensorBlob:
    """A tensor on the wire: dtype name, shape and the raw bytes (C order, native little-endian)."""

    dtype: str
    shape: tuple[int, ...]
    data: bytes

    def __post_init__(self) -> None:
        if self.dtype not in _DTYPES:
            raise ValueError(f"unsupported tensor dtype {self.dtype!r}; supported: {', '.join(_DTYPES)}")
        if any(d < 0 for d in self.shape):
            raise ValueError(f"negative dimension in shape {self.shape}")
        n = 1
        for d in self.shape:
            n *= d
        width = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8, "int64": 8, "int32": 4}[self.dtype]
        if n * width != len(self.data):
            raise ValueError(f"tensor of shape {self.shape} and dtype {self.dtype} needs {n * width} bytes, got {len(self.data)}")

    @staticmethod
    def from_torch(t: Any) -> TensorBlob:
        """Copy a torch tensor into a blob.

        Args:
            t: any torch tensor of a supported dtype, on any device.

        Returns:
            The blob holding a contiguous CPU copy of ``t``.
        """
        import torch

        c = t.detach().to("cpu").contiguous()
        name = str(c.dtype).removeprefix("torch.")
        return TensorBlob(dtype=name, shape=tuple(c.shape), data=c.view(torch.uint8).numpy().tobytes())

    def to_torch(self, device: str = "cpu") -> Any:
        """Rebuild the torch tensor.

        Args:
            device: where to put it.

        Returns:
            A new tensor (it owns its memory).
        """
        import torch

        dt = getattr(torch, self.dtype)
        if not self.data:
            return torch.empty(self.shape, dtype=dt, device=device)
        raw = torch.frombuffer(bytearray(self.data), dtype=torch.uint8)
        return raw.view(dt).reshape(self.shape).to(device)


@_message
@dataclass(frozen=True, slots=True, kw_only=True)
class BatchItem:
    """One request's slice of a micro-batch, as it travels through the pipeline.

    The first stage gets ``token_ids`` (the prompt on prefill, one token on decode); later
    stages get ``hidden`` (the previous stage's output for those positions).
    """

    request_id: str
    position: int  # position of the first token of this slice in the sequence
    token_ids: tuple[int, ...]
    hidden: TensorBlob | None
    route: tuple[str, ...]  # engine node address chosen for each stage, in stage order
    temperature: float
    seed: int
    step: int  # index of the token being produced (0 = first token), seeds the sampler


@_message
@dataclass(frozen=True, slots=True, kw_only=True)
class TokenItem:
    """One sampled token for one request, from the last stage (or :data:`TOKEN_ERROR` / :data:`TOKEN_NO_KV` from any stage)."""

    request_id: str
    token: int


@_message
@dataclass(frozen=True, slots=True, kw_only=True)
class KvTarget:
    """A decode node that should receive a layer range of one request's KV cache."""

    address: str
    layer_start: int
    layer_end: int


@_message
@dataclass(frozen=True, slots=True, kw_only=True)
class KvSource:
    """A prefill node that holds a layer range of one request's KV cache."""

    address: str
    layer_start: int
    layer_end: int


# -------------------------------------------------------------------------- messages


@_message
@dataclass(frozen=True, slots=True, kw_only=True)
class EngineHello:
    """Engine -> scheduler: the node is up, its layers are loaded, it takes work."""

    instance_id: str
    stage: int
    node_index: int
    address: str
    layer_start: int
    layer_end: int
    #: the node's KV pool (blocks of ``kv_block_size`` tokens); 0 = unbounded (no-op engines)
    kv_blocks: int = 0
    kv_block_size: int = 0


@_message
@dataclass(frozen=True, slots=True, kw_only=True)
class ForwardBatch:
    """Scheduler or previous stage -> engine: run these items through your layers.

    Between stages the items' hidden states travel packed in ``hidden``
    (``[sum of the items' token counts, hidden size]``, items in order) rather than per item.
    """

    batch_id: int
    reply_to: str  # the scheduler, which gets the sampled tokens from the last stage
    items: tuple[BatchItem, ...]
    hidden: TensorBlob | None = None


@_message
@dataclass(frozen=True, slots=True, kw_only=True)
class ForwardResult:
    """Last stage -> scheduler: sampled tokens for (part of) a micro-batch."""

    batch_id: int
    items: tuple[TokenItem, ...]
    error: str = ""


@_message
@dataclass(frozen=True, slots=True, kw_only=True)
class Release:
    """Scheduler -> engine: drop these requests' KV caches."""

    request_ids: tuple[str, ...]


@_message
@dataclass(frozen=True, slots=True, kw_only=True)
class KvSend:
    """Decode scheduler -> prefill engine: push your part of a request's KV to these nodes, then drop it."""

    request_id: str
    targets: tuple[KvTarget, ...]
    notify: str  # the decode scheduler, told by each receiving node what it loaded
    kv_id: str = ""  # the KV's key on the prefill node ("" = request_id; differs after a recompute)


@_message
@dataclass(frozen=True, slots=True, kw_only=True)
class KvPush:
    """Prefill engine -> decode engine: KV of global layers [layer_start, layer_start + len(keys))."""

    request_id: str
    layer_start: int
    seq_len: int
    keys: tuple[TensorBlob, ...]
    values: tuple[TensorBlob, ...]
    notify: str


@_message
@dataclass(frozen=True, slots=True, kw_only=True)
class KvLoaded:
    """Decode engine -> decode scheduler: these global layers of a request's KV are in place."""

    request_id: str
    layer_start: int
    layer_end: int
    error: str = ""


@_message
@dataclass(frozen=True, slots=True, kw_only=True)
class Submit:
    """Coordinator -> (prefill) scheduler: serve this request.

    ``decode_to`` names the decode instance's scheduler; empty means decode here too.
    """

    request_id: str
    prompt: tuple[int, ...]
    max_tokens: int
    temperature: float
    seed: int
    eos_ids: tuple[int, ...]
    reply_to: str
    decode_to: str = ""


@_message
@dataclass(frozen=True, slots=True, kw_only=True)
class DecodeAdmit:
    """Prefill scheduler -> decode scheduler: continue this request; its KV sits on ``sources``."""

    submit: Submit
    generated: tuple[int, ...]
    sources: tuple[KvSource, ...]
    kv_id: str = ""  # the KV's key on the sources ("" = the request id)


@_message
@dataclass(frozen=True, slots=True, kw_only=True)
class TokenOut:
    """Scheduler -> coordinator: new tokens of a request, and whether it has ended."""

    request_id: str
    tokens: tuple[int, ...]
    finished: bool
    finish_reason: str = ""  # "stop" | "length" | "error"
    error: str = ""
    #: the instance failed under the request (not the request's fault): the coordinator may retry it elsewhere
    retryable: bool = False


@_message
@dataclass(frozen=True, slots=True, kw_only=True)
class InstanceHello:
    """Scheduler -> coordinator: the instance (all its nodes) is up and takes traffic."""

    instance_id: str
    model: str
    phase: str
    region: str
    throughput_tok_per_s: float
    address: str


@_message
@dataclass(frozen=True, slots=True, kw_only=True)
class Heartbeat:
    """Liveness, every ``heartbeat_s``: engine <-> scheduler, scheduler <-> coordinator.

    A scheduler's heartbeat to the coordinator carries its :class:`InstanceHello` (so a
    restarted coordinator rebuilds its registry from them), its lifecycle ``state``
    (``starting``, ``active``, ``draining`` or ``failed``) and the requests it holds.
    """

    sender: str  # the sender's inbox address
    role: str  # "engine" | "scheduler" | "coordinator"
    instance_id: str = ""
    state: str = ""
    in_flight: int = 0
    hello: InstanceHello | None = None
    reason: str = ""  # why a scheduler reports "failed"


@_message
@dataclass(frozen=True, slots=True, kw_only=True)
class Drain:
    """Coordinator -> scheduler: take no new request; finish the ones held (then expect :class:`Shutdown`)."""

    reason: str = ""


@_message
@dataclass(frozen=True, slots=True, kw_only=True)
class Cancel:
    """Coordinator -> scheduler: drop these requests (retried elsewhere, or the client left); no reply."""

    request_ids: tuple[str, ...]


@_message
@dataclass(frozen=True, slots=True, kw_only=True)
class Shutdown:
    """Anyone -> process: stop the main loop and exit."""

    reason: str = ""


Message = (
    EngineHello
    | ForwardBatch
    | ForwardResult
    | Release
    | KvSend
    | KvPush
    | KvLoaded
    | Submit
    | DecodeAdmit
    | TokenOut
    | InstanceHello
    | Heartbeat
    | Drain
    | Cancel
    | Shutdown
)
_TOP_LEVEL: tuple[type, ...] = typing.get_args(Message)


# -------------------------------------------------------------------------- encoding


def _to_wire(obj: Any) -> Any:
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        out: dict[str, Any] = {"@": type(obj).__name__}
        for f in dataclasses.fields(obj):
            out[f.name] = _to_wire(getattr(obj, f.name))
        return out
    if isinstance(obj, (list, tuple)):
        return [_to_wire(x) for x in obj]
    return obj


def encode(msg: Any) -> bytes:
    """Encode a top-level message to bytes.

    Args:
        msg: an instance of one of the message classes.

    Returns:
        The msgpack bytes.

    Raises:
        TypeError: if ``msg`` is not a top-level message.
    """
    if not isinstance(msg, _TOP_LEVEL):
        raise TypeError(f"not a top-level runtime message: {type(msg).__name__}")
    return msgpack.packb(_to_wire(msg), use_bin_type=True)


def _hints(cls: type) -> dict[str, Any]:
    h = _HINTS.get(cls)
    if h is None:
        h = typing.get_type_hints(cls)
        _HINTS[cls] = h
    return h


def _from_wire(value: Any, tp: Any, where: str) -> Any:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        errors = []
        for a in args:
            if a is type(None):
                continue
            try:
                return _from_wire(value, a, where)
            except ProtocolError as e:
                errors.append(str(e))
        raise ProtocolError("; ".join(errors) or f"{where}: bad value")
    if origin is tuple:
        if not isinstance(value, list):
            raise ProtocolError(f"{where}: expected an array, got {type(value).__name__}")
        (elem, _ellipsis) = typing.get_args(tp)
        return tuple(_from_wire(v, elem, f"{where}[{i}]") for i, v in enumerate(value))
    if isinstance(tp, type) and tp in _REGISTRY.values():
        return _build(value, tp, where)
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ProtocolError(f"{where}: expected a number, got {type(value).__name__}")
        return float(value)
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ProtocolError(f"{where}: expected an integer, got {type(value).__name__}")
        return value
    if tp in (str, bytes, bool):
        if type(value) is not tp:
            raise ProtocolError(f"{where}: expected {tp.__name__}, got {type(value).__name__}")
        return value
    raise ProtocolError(f"{where}: unsupported field type {tp!r}")  # pragma: no cover - schema bug


def _build(value: Any, cls: type, where: str) -> Any:
    if not isinstance(value, dict):
        raise ProtocolError(f"{where}: expected a map, got {type(value).__name__}")
    tag = value.get("@")
    if tag != cls.__name__:
        raise ProtocolError(f"{where}: expected a {cls.__name__}, got tag {tag!r}")
    hints = _hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    extra = set(value) - names - {"@"}
    if extra:
        raise ProtocolError(f"{where}: unknown fields {sorted(map(str, extra))} in {cls.__name__}")
    kwargs = {k: _from_wire(v, hints[k], f"{where}.{k}") for k, v in value.items() if k != "@"}
    try:
        return cls(**kwargs)
    except (TypeError, ValueError) as e:
        raise ProtocolError(f"{where}: bad {cls.__name__}: {e}") from None


def decode(data: bytes, max_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> Any:
    """Decode and validate a top-level message.

    Args:
        data: the bytes received.
        max_bytes: reject anything larger.

    Returns:
        The message dataclass.

    Raises:
        ProtocolError: if the bytes are too large, not msgpack, or not a valid message.
    """
    if len(data) > max_bytes:
        raise ProtocolError(f"message of {len(data)} bytes exceeds the limit of {max_bytes}")
    try:
        value = msgpack.unpackb(data, raw=False, strict_map_key=True)
    except Exception as e:  # msgpack raises several unrelated types on garbage
        raise ProtocolError(f"not msgpack: {type(e).__name__}: {e}") from None
    if not isinstance(value, dict) or not isinstance(value.get("@"), str):
        raise ProtocolError("not a runtime message (no tag)")
    cls = _REGISTRY.get(value["@"])
    if cls is None or cls not in _TOP_LEVEL:
        raise ProtocolError(f"unknown message tag {value['@']!r}")
    return _build(value, cls, cls.__name__)
