"""Every message the runtime's processes exchange, and their wire encoding (msgspec msgpack, never pickle).

A message is a frozen :class:`msgspec.Struct`; the top-level messages form one tagged union
(the tag is the class name, in field ``"@"``), decoded by one typed msgspec decoder that
checks the tag, the field names and every field's type, so a malformed or hostile message
raises :class:`ProtocolError` and never reaches a handler.

A message travels as a list of frames (ZeroMQ multipart): frame 0 is the msgpack body;
every tensor of at least :data:`INLINE_TENSOR_BYTES` is a msgpack extension in the body
(dtype, shape, frame index) and its bytes are a frame of their own, sent and received
without a copy (a received :class:`TensorBlob` is a view on the frame). Smaller tensors
are inlined, where a frame would cost more than the copy (vLLM's engine core does the same).
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Sequence
from enum import StrEnum
from typing import Any, Union

import msgspec

from coral.policy.lifecycle import Lifecycle

__all__ = [
    "DEFAULT_MAX_MESSAGE_BYTES",
    "INLINE_TENSOR_BYTES",
    "ITERATION_TOKEN_BUCKETS",
    "KV_TRANSFER_SECONDS_BUCKETS",
    "BatchItem",
    "Cancel",
    "DecodeAdmit",
    "Drain",
    "EngineHello",
    "ForwardBatch",
    "ForwardResult",
    "Frames",
    "Heartbeat",
    "InstanceHello",
    "InstancePhase",
    "InstanceStats",
    "KvLoaded",
    "KvPush",
    "KvSend",
    "KvTarget",
    "KvSource",
    "Message",
    "ProtocolError",
    "Release",
    "Role",
    "SamplingParams",
    "Shutdown",
    "Submit",
    "TOKEN_ERROR",
    "TOKEN_NO_KV",
    "TensorBlob",
    "TokenItem",
    "TokenLogprob",
    "TokenOut",
    "TokenOuts",
    "TopLogprob",
    "decode",
    "encode",
]

class InstancePhase(StrEnum):
    """What an instance runs: prefill only (hands the KV over), decode only, or both (no hand-off)."""

    PREFILL = "prefill"
    DECODE = "decode"
    MIXED = "mixed"


class Role(StrEnum):
    """Who sends a :class:`Heartbeat`."""

    ENGINE = "engine"
    SCHEDULER = "scheduler"
    COORDINATOR = "coordinator"


#: Messages larger than this are rejected by every transport (a KV push of a long prompt
#: of a large model is the biggest legitimate message; raise it for such deployments).
DEFAULT_MAX_MESSAGE_BYTES = 256 * 1024 * 1024
#: Tensors smaller than this travel inside the body; larger ones in their own frame.
INLINE_TENSOR_BYTES = 1024

#: :attr:`TokenItem.token` when the request failed on an engine (the result's ``error`` says why).
TOKEN_ERROR = -1
#: :attr:`TokenItem.token` when an engine had no KV blocks left for the request: not a
#: failure, the scheduler puts it back in its queue (it is recomputed later).
TOKEN_NO_KV = -2

_WIDTH = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8, "int64": 8, "int32": 4}
_DTYPES = tuple(_WIDTH)
_TENSOR_EXT = 1

#: What a transport carries: the body and the tensor frames.
Frames = Sequence[bytes | bytearray | memoryview]


class ProtocolError(ValueError):
    """A message that cannot be decoded: bad msgpack, unknown tag, wrong fields or types."""


class _Msg(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True, tag_field="@", tag=True):
    """Base of every wire struct: frozen, keyword-only, unknown fields refused, tagged by class name."""


# ---------------------------------------------------------------------------- values


class TensorBlob:
    """A tensor on the wire: dtype name, shape and the raw bytes (C order, native little-endian).

    ``data`` may be a read-only view on a received frame (no copy); :meth:`to_torch` on the
    CPU returns a tensor sharing that memory, which callers must not modify in place.
    """

    __slots__ = ("data", "dtype", "shape")

    def __init__(self, *, dtype: str, shape: tuple[int, ...], data: bytes | bytearray | memoryview) -> None:
        if dtype not in _DTYPES:
            raise ValueError(f"unsupported tensor dtype {dtype!r}; supported: {', '.join(_DTYPES)}")
        shape = tuple(shape)
        if any(not isinstance(d, int) or isinstance(d, bool) or d < 0 for d in shape):
            raise ValueError(f"bad dimension in shape {shape}")
        n = 1
        for d in shape:
            n *= d
        size = memoryview(data).nbytes
        if n * _WIDTH[dtype] != size:
            raise ValueError(f"tensor of shape {shape} and dtype {dtype} needs {n * _WIDTH[dtype]} bytes, got {size}")
        self.dtype, self.shape, self.data = dtype, shape, data

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, TensorBlob):
            return NotImplemented
        return (self.dtype, self.shape) == (other.dtype, other.shape) and memoryview(self.data).cast("B") == memoryview(other.data).cast("B")

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"TensorBlob(dtype={self.dtype!r}, shape={self.shape})"

    @staticmethod
    def from_torch(t: Any) -> TensorBlob:
        """Wrap a torch tensor (a CPU contiguous one without a copy).

        Args:
            t: any torch tensor of a supported dtype, on any device.

        Returns:
            The blob; its bytes are a view on a contiguous CPU tensor (copied from the device if needed).
        """
        # lazy: torch (runtime extra; processes without layers never load it)
        import torch

        c = t.detach().to("cpu").contiguous()
        name = str(c.dtype).removeprefix("torch.")
        if c.numel() == 0:
            return TensorBlob(dtype=name, shape=tuple(c.shape), data=b"")
        return TensorBlob(dtype=name, shape=tuple(c.shape), data=memoryview(c.view(torch.uint8).reshape(-1).numpy()))

    def to_torch(self, device: str = "cpu") -> Any:
        """Rebuild the torch tensor.

        Args:
            device: where to put it.

        Returns:
            On the CPU, a tensor over the blob's memory (no copy; do not modify it in place);
            elsewhere, a copy on ``device``.
        """
        # lazy: torch (runtime extra; processes without layers never load it)
        import torch

        dt = getattr(torch, self.dtype)
        if memoryview(self.data).nbytes == 0:
            return torch.empty(self.shape, dtype=dt, device=device)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # read-only frame memory: we never write to it
            raw = torch.frombuffer(self.data, dtype=torch.uint8)
        return raw.view(dt).reshape(self.shape).to(device)


class SamplingParams(_Msg, frozen=True):
    """How the last stage picks a request's tokens (see :mod:`coral.runtime.engine.sampling`)."""

    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    min_p: float = 0.0
    seed: int = 0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    logprobs: int = -1  # -1 = none; k >= 0 = the sampled token's logprob and the top k
    min_tokens: int = 0
    stop_ids: tuple[int, ...] = ()  # masked until min_tokens are out
    prompt_len: int = 0  # the original prompt's length: tokens after it are the output

    def __post_init__(self) -> None:
        if not (self.temperature >= 0 and 0 < self.top_p <= 1 and 0 <= self.min_p <= 1 and self.repetition_penalty > 0):
            raise ValueError("temperature >= 0, 0 < top_p <= 1, 0 <= min_p <= 1 and repetition_penalty > 0 are required")
        if self.top_k < 0 or self.logprobs < -1 or self.min_tokens < 0 or self.prompt_len < 0:
            raise ValueError("top_k, min_tokens and prompt_len must be >= 0; logprobs >= -1")

    @property
    def needs_history(self) -> bool:
        """Whether the sampler needs the sequence's tokens (a penalty is on)."""
        return self.repetition_penalty != 1.0 or bool(self.frequency_penalty) or bool(self.presence_penalty)


class TopLogprob(_Msg, frozen=True):
    """One alternative token and its log-probability."""

    token: int
    logprob: float


class TokenLogprob(_Msg, frozen=True):
    """A generated token's log-probability and the most likely alternatives at its step."""

    logprob: float
    top: tuple[TopLogprob, ...] = ()


class BatchItem(_Msg, frozen=True):
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
    #: the full sampling parameters (None = temperature and seed above, nothing else)
    sampling: SamplingParams | None = None
    #: tokens already in the sequence that this route has not seen fed (a decode hand-off
    #: sends the prompt and earlier output once, for the sampler's penalties)
    history: tuple[int, ...] = ()


class TokenItem(_Msg, frozen=True):
    """One sampled token for one request, from the last stage (or :data:`TOKEN_ERROR` / :data:`TOKEN_NO_KV` from any stage)."""

    request_id: str
    token: int
    logprob: float = 0.0
    top_logprobs: tuple[TopLogprob, ...] = ()


class KvTarget(_Msg, frozen=True):
    """A decode node that should receive a layer range of one request's KV cache."""

    address: str
    layer_start: int
    layer_end: int


class KvSource(_Msg, frozen=True):
    """A prefill node that holds a layer range of one request's KV cache."""

    address: str
    layer_start: int
    layer_end: int


# -------------------------------------------------------------------------- messages


class EngineHello(_Msg, frozen=True):
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


class ForwardBatch(_Msg, frozen=True):
    """Scheduler or previous stage -> engine: run these items through your layers.

    Between stages the items' hidden states travel packed in ``hidden``
    (``[sum of the items' token counts, hidden size]``, items in order) rather than per item.
    """

    batch_id: int
    reply_to: str  # the scheduler, which gets the sampled tokens from the last stage
    items: tuple[BatchItem, ...]
    hidden: TensorBlob | None = None


class ForwardResult(_Msg, frozen=True):
    """Last stage -> scheduler: sampled tokens for (part of) a micro-batch."""

    batch_id: int
    items: tuple[TokenItem, ...]
    error: str = ""


class Release(_Msg, frozen=True):
    """Scheduler -> engine: drop these requests' KV caches."""

    request_ids: tuple[str, ...]


class KvSend(_Msg, frozen=True):
    """Decode scheduler -> prefill engine: push your part of a request's KV to these nodes, then drop it."""

    request_id: str
    targets: tuple[KvTarget, ...]
    notify: str  # the decode scheduler, told by each receiving node what it loaded
    kv_id: str = ""  # the KV's key on the prefill node ("" = request_id; differs after a recompute)


class KvPush(_Msg, frozen=True):
    """Prefill engine -> decode engine: KV of global layers [layer_start, layer_start + len(keys))."""

    request_id: str
    layer_start: int
    seq_len: int
    keys: tuple[TensorBlob, ...]
    values: tuple[TensorBlob, ...]
    notify: str


class KvLoaded(_Msg, frozen=True):
    """Decode engine -> decode scheduler: these global layers of a request's KV are in place."""

    request_id: str
    layer_start: int
    layer_end: int
    error: str = ""
    nbytes: int = 0  # KV bytes received for them


class Submit(_Msg, frozen=True):
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
    sampling: SamplingParams | None = None  # None = temperature and seed above, nothing else
    # which instance sends the first token to ``reply_to``: "prefill" as soon as it is sampled, "decode"
    # once the decode instance holds the KV (with ``decode_to`` only; see the plan file's first_token)
    first_token: str = "prefill"


class DecodeAdmit(_Msg, frozen=True):
    """Prefill scheduler -> decode scheduler: continue this request; its KV sits on ``sources``."""

    submit: Submit
    generated: tuple[int, ...]
    sources: tuple[KvSource, ...]
    kv_id: str = ""  # the KV's key on the sources ("" = the request id)
    # the first token's message, held back by the prefill side (``Submit.first_token`` "decode"): the decode
    # scheduler sends it to the client once the KV has arrived; None = it went out already
    first_out: TokenOut | None = None


class TokenOut(_Msg, frozen=True):
    """Scheduler -> coordinator: new tokens of a request, and whether it has ended."""

    request_id: str
    tokens: tuple[int, ...]
    finished: bool
    finish_reason: str = ""  # "stop" | "length" | "error"
    error: str = ""
    #: the instance failed under the request (not the request's fault): the coordinator may retry it elsewhere
    retryable: bool = False
    #: one entry per token when the request asked for logprobs
    logprobs: tuple[TokenLogprob, ...] = ()
    #: seconds the request waited in the scheduler before its first forward pass (on its first TokenOut)
    queue_s: float = 0.0


class InstanceHello(_Msg, frozen=True):
    """Scheduler -> coordinator: the instance (all its nodes) is up and takes traffic."""

    instance_id: str
    model: str
    phase: InstancePhase
    region: str
    throughput_tok_per_s: float
    address: str


#: Upper bounds of the schedulers' histogram buckets (a count per bound, then one above the last):
#: tokens per micro-batch (vLLM's ``vllm:iteration_tokens_total``) and seconds per KV hand-off.
ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
KV_TRANSFER_SECONDS_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class InstanceStats(_Msg, frozen=True):
    """In a scheduler's heartbeat: its counters since it started (cumulative), its KV pools, the nodes it lost.

    Histograms are counts per bucket of :data:`ITERATION_TOKEN_BUCKETS` /
    :data:`KV_TRANSFER_SECONDS_BUCKETS` (one more for values above the last bound), not cumulative.
    """

    preemptions: int = 0
    iteration_tokens: tuple[int, ...] = ()
    iteration_tokens_sum: int = 0
    kv_transfers: int = 0  # decode hand-offs whose every layer arrived
    kv_transfer_bytes: int = 0
    kv_transfer_seconds: tuple[int, ...] = ()
    kv_transfer_seconds_sum: float = 0.0
    kv_block_size: int = 0  # tokens per KV block (0: no-op engines, no pool)
    kv_blocks: int = 0  # blocks of the smallest node pool
    lost_nodes: tuple[str, ...] = ()  # "stage/index" of every engine node the instance runs without


class Heartbeat(_Msg, frozen=True):
    """Liveness, every ``heartbeat_s``: engine <-> scheduler, scheduler <-> coordinator.

    A scheduler's heartbeat to the coordinator carries its :class:`InstanceHello` (so a
    restarted coordinator rebuilds its registry from them), its lifecycle ``state`` (a
    :class:`~coral.policy.Lifecycle`: starting, active, draining or failed) and the requests it holds.
    """

    sender: str  # the sender's inbox address
    role: Role
    instance_id: str = ""
    state: Lifecycle | None = None  # a scheduler's; engines and the coordinator send none
    in_flight: int = 0
    hello: InstanceHello | None = None
    reason: str = ""  # why a scheduler reports "failed"
    waiting: int = 0  # of ``in_flight``, requests not yet in a running batch
    kv_cache_usage: float = 0.0  # fraction of the instance's KV-cache capacity in use (0 to 1)
    stats: InstanceStats | None = None  # a scheduler's counters and lost nodes


class Drain(_Msg, frozen=True):
    """Coordinator -> scheduler: take no new request; finish the ones held (then expect :class:`Shutdown`)."""

    reason: str = ""


class TokenOuts(_Msg, frozen=True):
    """Scheduler -> coordinator: the :class:`TokenOut` of every request one forward step advanced, in one
    message (a batch-16 decode step is one message, not 16); handled as those messages in order."""

    outs: tuple[TokenOut, ...]


class Cancel(_Msg, frozen=True):
    """Coordinator -> scheduler: drop these requests (retried elsewhere, or the client left); no reply."""

    request_ids: tuple[str, ...]


class Shutdown(_Msg, frozen=True):
    """Anyone -> process: stop the main loop and exit."""

    reason: str = ""


Message = Union[  # noqa: UP007 - a runtime value (the decoder's type), not only an annotation
    EngineHello,
    ForwardBatch,
    ForwardResult,
    Release,
    KvSend,
    KvPush,
    KvLoaded,
    Submit,
    DecodeAdmit,
    TokenOut,
    TokenOuts,
    InstanceHello,
    Heartbeat,
    Drain,
    Cancel,
    Shutdown,
]
_TOP_LEVEL: tuple[type, ...] = Message.__args__  # type: ignore[attr-defined]


# -------------------------------------------------------------------------- encoding

_local = threading.local()  # the frames of the message being encoded / decoded on this thread
_packer = msgspec.msgpack.Encoder()


def _enc_hook(obj: Any) -> Any:
    if isinstance(obj, TensorBlob):
        mv = memoryview(obj.data).cast("B")
        frames: list[Any] = _local.out
        if mv.nbytes >= INLINE_TENSOR_BYTES:
            frames.append(mv)
            ref: Any = len(frames) - 1
        else:
            ref = bytes(mv)
        return msgspec.msgpack.Ext(_TENSOR_EXT, _packer.encode((obj.dtype, obj.shape, ref)))
    raise TypeError(f"cannot put a {type(obj).__name__} on the wire")


_header_decoder = msgspec.msgpack.Decoder(tuple[str, tuple[int, ...], int | bytes])


def _ext_hook(code: int, data: memoryview) -> Any:
    if code != _TENSOR_EXT:
        raise ValueError(f"unknown msgpack extension {code}")
    dtype, shape, ref = _header_decoder.decode(data)
    if isinstance(ref, bytes):
        payload: Any = ref
    else:
        frames = _local.frames
        if not 1 <= ref < len(frames):
            raise ValueError(f"tensor frame {ref} missing (message has {len(frames)} frames)")
        payload = frames[ref]
        _local.used.add(ref)
    return TensorBlob(dtype=dtype, shape=shape, data=payload)


def _dec_hook(tp: type, obj: Any) -> Any:
    if tp is TensorBlob and isinstance(obj, TensorBlob):
        return obj
    raise msgspec.ValidationError(f"expected a tensor, got {type(obj).__name__}")


_encoder = msgspec.msgpack.Encoder(enc_hook=_enc_hook)
_decoder = msgspec.msgpack.Decoder(Message, ext_hook=_ext_hook, dec_hook=_dec_hook)


def encode(msg: Any) -> list[bytes | memoryview]:
    """Encode a top-level message to its frames.

    Args:
        msg: an instance of one of the message classes.

    Returns:
        ``[body, tensor frames...]``; the tensor frames are views on the tensors' memory
        (keep them alive until sent).

    Raises:
        TypeError: if ``msg`` is not a top-level message.
    """
    if not isinstance(msg, _TOP_LEVEL):
        raise TypeError(f"not a top-level runtime message: {type(msg).__name__}")
    frames: list[bytes | memoryview] = [b""]
    _local.out = frames
    try:
        frames[0] = _encoder.encode(msg)
    finally:
        _local.out = None
    return frames


def decode(frames: bytes | bytearray | memoryview | Frames, max_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> Any:
    """Decode and validate a top-level message.

    Args:
        frames: the frames received (or one bytes object: a message without tensor frames).
        max_bytes: reject anything larger (all frames together).

    Returns:
        The message struct; its tensors are views on ``frames``.

    Raises:
        ProtocolError: if the frames are too large, not msgpack, or not a valid message.
    """
    parts: Frames = [frames] if isinstance(frames, (bytes, bytearray, memoryview)) else frames
    if not parts:
        raise ProtocolError("empty message (no frames)")
    total = sum(memoryview(f).nbytes for f in parts)
    if total > max_bytes:
        raise ProtocolError(f"message of {total} bytes exceeds the limit of {max_bytes}")
    _local.frames, _local.used = parts, set()
    try:
        msg = _decoder.decode(parts[0])
        unused = set(range(1, len(parts))) - _local.used
        if unused:
            raise ProtocolError(f"{len(unused)} frame(s) not referenced by the message")
        return msg
    except msgspec.ValidationError as e:
        raise ProtocolError(f"invalid message: {e}") from None
    except msgspec.DecodeError as e:
        raise ProtocolError(f"not msgpack: {e}") from None
    except (ValueError, TypeError) as e:
        raise ProtocolError(f"bad message: {e}") from None
    finally:
        _local.frames, _local.used = None, None
