"""Wire protocol and transports: round trips, and bad messages rejected without killing the receiver."""

from __future__ import annotations

import logging

import msgpack
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from coral.runtime.protocol import (
    BatchItem,
    DecodeAdmit,
    ForwardBatch,
    KvPush,
    KvSource,
    ProtocolError,
    Submit,
    TensorBlob,
    TokenOut,
    TokenOuts,
    decode,
    encode,
)
from coral.runtime.transport import InprocHub, InprocTransport, ZmqTransport


def _submit(**kw: object) -> Submit:
    base = dict(request_id="r1", prompt=(1, 2, 3), max_tokens=4, temperature=0.0, seed=1, eos_ids=(2,), reply_to="c")
    base.update(kw)
    return Submit(**base)  # type: ignore[arg-type]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_tensor_round_trip_bit_exact(dtype: torch.dtype) -> None:
    t = torch.randn(1, 3, 5).to(dtype)
    back = TensorBlob.from_torch(t).to_torch()
    assert dtype == back.dtype
    assert torch.equal(t, back)


def test_nested_messages_round_trip() -> None:
    blob = TensorBlob.from_torch(torch.arange(6, dtype=torch.float32).reshape(1, 2, 3))
    item = BatchItem(request_id="a", position=3, token_ids=(), hidden=blob, route=("x", "y"), temperature=0.5, seed=9, step=2)
    for msg in (
        ForwardBatch(batch_id=7, reply_to="s", items=(item,)),
        DecodeAdmit(submit=_submit(decode_to="d"), generated=(5,), sources=(KvSource(address="p", layer_start=0, layer_end=2),)),
        KvPush(request_id="a", layer_start=2, seq_len=3, keys=(blob,), values=(blob,), notify="n"),
        TokenOut(request_id="a", tokens=(1,), finished=True, finish_reason="stop"),
        TokenOuts(outs=(TokenOut(request_id="a", tokens=(1,), finished=False), TokenOut(request_id="b", tokens=(2,), finished=True))),
    ):
        assert msg == decode(encode(msg))


@given(prompt=st.lists(st.integers(0, 2**31), max_size=50), temp=st.floats(0, 2), rid=st.text(max_size=20))
def test_submit_round_trip_property(prompt: list[int], temp: float, rid: str) -> None:
    msg = _submit(prompt=tuple(prompt), temperature=temp, request_id=rid)
    assert msg == decode(encode(msg))


def _kv_push_with(key: object) -> bytes:
    body = {"@": "KvPush", "request_id": "a", "layer_start": 0, "seq_len": 1, "notify": "n", "values": [], "keys": [key]}
    return msgpack.packb(body)


@pytest.mark.parametrize(
    ("raw", "match"),
    [
        (b"\xc1\xc1garbage", "not msgpack"),
        (msgpack.packb([1, 2]), "Expected `object`, got `array`"),
        (msgpack.packb({"@": "Pickle", "x": 1}), "Invalid value 'Pickle'"),
        (msgpack.packb({"@": "TensorBlob", "dtype": "float32", "shape": [], "data": b"\0" * 4}), "Invalid value 'TensorBlob'"),
        (msgpack.packb({"@": "SamplingParams"}), "Invalid value 'SamplingParams'"),  # a value, not a message
        (msgpack.packb({"@": "Release", "request_ids": ["a"], "evil": 1}), "unknown field `evil`"),
        (msgpack.packb({"@": "Release", "request_ids": "a"}), "Expected `array`, got `str`"),
        (msgpack.packb({"@": "TokenOut", "request_id": "a", "tokens": [True], "finished": True}), "Expected `int`, got `bool`"),
        (msgpack.packb({"@": "Release"}), "missing required field `request_ids`"),
        (msgpack.packb({"@": "TokenOuts", "outs": [{"request_id": "a", "tokens": [1]}]}), "missing required field `finished`"),
        (msgpack.packb({"@": "TokenOuts", "outs": "a"}), "Expected `array`, got `str`"),
        (_kv_push_with(msgpack.ExtType(1, msgpack.packb(["float32", [4], b"\0" * 3]))), "needs 16 bytes"),
        (_kv_push_with(msgpack.ExtType(1, msgpack.packb(["object", [0], b""]))), "unsupported tensor dtype"),
        (_kv_push_with(msgpack.ExtType(1, msgpack.packb(["float32", [256], 1]))), "tensor frame 1 missing"),
        (_kv_push_with(msgpack.ExtType(7, b"")), "unknown msgpack extension 7"),
        (_kv_push_with({"@": "TensorBlob", "dtype": "float32", "shape": [1], "data": b"\0" * 4}), "expected a tensor"),
    ],
)  # fmt: skip
def test_malformed_messages_rejected(raw: bytes, match: str) -> None:
    with pytest.raises(ProtocolError, match=match):
        decode(raw)


def test_tensors_travel_in_their_own_frames_without_a_copy() -> None:
    big = torch.arange(1024, dtype=torch.float32).reshape(1, 4, 256)
    small = torch.arange(4, dtype=torch.float32)
    msg = KvPush(request_id="a", layer_start=0, seq_len=4, keys=(TensorBlob.from_torch(big),),
                 values=(TensorBlob.from_torch(small),), notify="n")  # fmt: skip
    frames = encode(msg)
    assert [4096] == [memoryview(f).nbytes for f in frames[1:]]  # the small tensor is inlined
    assert big.data_ptr() == torch.frombuffer(frames[1], dtype=torch.float32).data_ptr()  # sent without a copy
    received = [bytes(frames[0]), bytearray(frames[1])]
    back = decode(received)
    assert msg == back
    t = back.keys[0].to_torch()
    received[1][0:4] = torch.tensor([-1.0]).numpy().tobytes()
    assert -1.0 == float(t[0, 0, 0])  # the tensor is a view on the received frame
    with pytest.raises(ProtocolError, match="not referenced"):
        decode([*frames, b"stray"])


_ext = st.builds(lambda c, b: msgpack.ExtType(c, b), st.integers(0, 3), st.binary(max_size=20))
_values = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(-5, 2**40), st.floats(allow_nan=False), st.text(max_size=8), st.binary(max_size=8), _ext),
    lambda c: st.lists(c, max_size=4) | st.dictionaries(st.sampled_from(["@", "keys", "hidden", "items", "sampling", "x"]), c, max_size=4),
    max_leaves=12,
)
_tags = st.sampled_from(["KvPush", "ForwardBatch", "Submit", "TokenOut", "Heartbeat", "SamplingParams"])


@given(body=st.builds(lambda tag, d: msgpack.packb({"@": tag, **d}), _tags, st.dictionaries(st.text(max_size=10), _values, max_size=6)),
       extra=st.lists(st.binary(max_size=64), max_size=3))  # fmt: skip
def test_fuzzed_frames_raise_only_protocol_errors(body: bytes, extra: list[bytes]) -> None:
    try:
        decode([body, *extra])
    except ProtocolError:
        pass


def test_oversized_message_rejected() -> None:
    with pytest.raises(ProtocolError, match="exceeds the limit"):
        decode(encode(_submit(prompt=tuple(range(1000)))), max_bytes=100)


def test_encode_refuses_non_messages() -> None:
    with pytest.raises(TypeError, match="not a top-level"):
        encode(TensorBlob(dtype="float32", shape=(0,), data=b""))


def test_inproc_transport_drops_bad_and_keeps_going(caplog: pytest.LogCaptureFixture) -> None:
    hub = InprocHub()
    a, b = InprocTransport(hub, "a"), InprocTransport(hub, "b", max_message_bytes=1000)
    a.send_raw("b", b"junk")
    a.send("b", _submit(prompt=tuple(range(2000))))  # too big for b
    a.send("b", _submit())
    with caplog.at_level(logging.WARNING):
        assert _submit() == b.recv(1.0)
    assert 2 == b.rejected
    assert "dropped a bad message" in caplog.text


def test_zmq_transport_round_trip_and_rejects(caplog: pytest.LogCaptureFixture) -> None:
    a = ZmqTransport()
    b = ZmqTransport(max_message_bytes=10_000)
    try:
        assert b.address.startswith("tcp://127.0.0.1:")
        a.send_raw(b.address, b"\x00not msgpack")
        a.send_raw(b.address, b"x" * 15_000)  # over the decoder limit, under the socket's (2x)
        a.send(b.address, _submit(request_id="first"))  # same connection: arrives after the bad two
        with caplog.at_level(logging.WARNING):
            assert _submit(request_id="first") == b.recv(5.0)
        assert 2 == b.rejected
        assert "dropped a bad message" in caplog.text
        a3, a2 = ZmqTransport(), ZmqTransport()
        a3.send_raw(b.address, b"x" * 50_000)  # over the socket limit: ZeroMQ drops that connection
        a2.send(b.address, _submit(request_id="after"))
        assert _submit(request_id="after") == b.recv(5.0)
        a2.close()
        a3.close()
    finally:
        a.close()
        b.close()


def test_phases_roles_and_lifecycle_states_travel_as_enums_and_unknown_ones_are_refused() -> None:
    from coral.policy import Lifecycle
    from coral.runtime.protocol import Heartbeat, InstanceHello, InstancePhase, Role

    beat = decode(encode(Heartbeat(sender="s", role=Role.SCHEDULER, state=Lifecycle.DRAINING)))
    assert Role.SCHEDULER is beat.role and Lifecycle.DRAINING is beat.state
    hello = decode(encode(InstanceHello(instance_id="i", model="m", phase=InstancePhase.DECODE, region="r",
                                        throughput_tok_per_s=1.0, address="a")))
    assert InstancePhase.DECODE is hello.phase
    for bad in ({"@": "Heartbeat", "sender": "s", "role": "nobody"},
                {"@": "Heartbeat", "sender": "s", "role": "scheduler", "state": "asleep"},
                {"@": "InstanceHello", "instance_id": "i", "model": "m", "phase": "both", "region": "r",
                 "throughput_tok_per_s": 1.0, "address": "a"}):
        with pytest.raises(ProtocolError, match="Invalid enum value"):
            decode([msgpack.packb(bad)])
