"""Every streamed event reaches a client on one line, whatever text the model generates.

The 10-minute chaos soak's one cut stream was no engine kill: tiny-llama (seed 0) answers the soak's
request 1015 with token ids 194, 389, which the byte tokenizer renders as C2 85, U+0085 (NEL). JSON
leaves that character raw, and ``str.splitlines``, with which httpx's ``aiter_lines`` (so ``coral
bench``) reads the event stream, breaks a line there: the client got half an event and a
``JSONDecodeError``. A scripted instance replays such tokens here, deterministically.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Iterator

import httpx
import pytest

from coral.runtime.protocol import InstanceHello, InstancePhase, Submit, TokenOut
from coral.runtime.serving.app import ApiServer, ServerOptions
from coral.runtime.serving.coordinator import Coordinator, ModelInfo
from coral.runtime.serving.loadgen import one_request
from coral.runtime.transport import InprocHub, InprocTransport

#: token ids -> the text the byte tokenizer renders (id % 256): U+0085 from the soak's request, and
#: U+2028 / U+2029, the two other characters JSON keeps raw and ``str.splitlines`` breaks at
SCRIPTS = {
    "nel, as in the soak": ([113, 194, 389, 110, 68], "q\u0085nD"),
    "line separator": ([72, 226, 128, 168, 105], "H\u2028i"),
    "paragraph separator": ([72, 226, 128, 169, 105], "H\u2029i"),
}


class ScriptedInstance:
    """A mixed instance that answers every Submit with the tokens of the script its prompt's first id names."""

    def __init__(self, hub: InprocHub, coord: Coordinator) -> None:
        self.t = InprocTransport(hub, "scripted")
        self.stop = threading.Event()
        coord.register(InstanceHello(instance_id="scripted", model="m", phase=InstancePhase.MIXED, region="r",
                                     throughput_tok_per_s=1.0, address="scripted"))  # fmt: skip
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.thread.start()

    def run(self) -> None:
        scripts = list(SCRIPTS.values())
        while not self.stop.is_set():
            msg = self.t.recv(0.05)
            if not isinstance(msg, Submit):
                continue
            ids = scripts[msg.prompt[0]][0][: msg.max_tokens]
            for k, t in enumerate(ids):  # one message a token, as a decode step sends them
                last = k == len(ids) - 1
                self.t.send(msg.reply_to, TokenOut(request_id=msg.request_id, tokens=(t,), finished=last,
                                                   finish_reason="length" if last else ""))  # fmt: skip


@pytest.fixture
def server() -> Iterator[str]:
    hub = InprocHub()
    coord = Coordinator(InprocTransport(hub, "coord"), [ModelInfo(name="m", max_context=64, vocab_size=512)],
                        heartbeat_timeout_s=3600.0)  # fmt: skip
    coord.start()
    inst = ScriptedInstance(hub, coord)
    api = ApiServer(coord, options=ServerOptions(token_timeout_s=10))
    api.start()
    yield api.url
    api.stop()
    inst.stop.set()
    coord.stop()


async def _texts(url: str, script: int, n: int) -> tuple[list[str], bytes]:
    """The texts of every event, read as ``coral bench`` reads them (``aiter_lines``), and the raw body."""
    body = {"model": "m", "prompt": [script], "max_tokens": n, "stream": True}
    texts, raw = [], b""
    async with httpx.AsyncClient(timeout=10) as client:
        async with client.stream("POST", url + "/v1/completions", json=body) as r:
            assert 200 == r.status_code
            async for line in r.aiter_lines():
                if line.startswith("data:") and line[5:].strip() != "[DONE]":
                    texts.append(json.loads(line[5:])["choices"][0]["text"])  # raises on half an event
        async with client.stream("POST", url + "/v1/completions", json=body) as r:
            raw = await r.aread()
    return texts, raw


@pytest.mark.parametrize("name", list(SCRIPTS))
def test_an_event_whose_text_holds_a_character_splitlines_breaks_at_arrives_whole(server: str, name: str) -> None:
    k = list(SCRIPTS).index(name)
    ids, text = SCRIPTS[name]
    texts, raw = asyncio.run(_texts(server, k, len(ids)))
    assert text == "".join(texts)
    assert all(line.startswith("data: ") for line in raw.decode().splitlines() if line)  # no event broken
    # the way the soak counts it: one completed request, every token accounted for
    res = one_request(server, "m", [k], len(ids), timeout_s=10)
    assert ("completed", len(ids), "") == (res.outcome, res.output_tokens, res.error)
