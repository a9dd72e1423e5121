"""A coordinator, three in-process instances and the HTTP front end on 127.0.0.1: the server the
HTTP, OpenAI-client, bounded-input and Grafana tests talk to, with their raw-socket helper."""

from __future__ import annotations

import socket
from dataclasses import dataclass

from coral.runtime.engine.inproc import InprocInstance, start_inproc_instance
from coral.runtime.serving.app import ApiServer, ServerOptions
from coral.runtime.serving.coordinator import Coordinator, ModelInfo
from coral.runtime.transport import InprocHub, InprocTransport

from .conftest import wait_until

WEIRD = 'we"ird\\name'


@dataclass
class Api:
    """A running front end: its base URL, the coordinator, the server and the instances behind it."""

    url: str
    coord: Coordinator
    server: ApiServer
    insts: list[InprocInstance]


def start_api(options: ServerOptions) -> Api:
    """Models a, b, long (one instance each) and WEIRD (none: 503) behind a server with `options`."""
    hub = InprocHub()
    coord = Coordinator(InprocTransport(hub, "coord"), [
        ModelInfo(name="a", max_context=64, vocab_size=512, eos_ids=()),
        ModelInfo(name="b", max_context=64, vocab_size=512, eos_ids=()),
        ModelInfo(name="long", max_context=100_000, vocab_size=512, eos_ids=()),
        ModelInfo(name=WEIRD, max_context=64, vocab_size=512),  # no instance: 503
    ])  # fmt: skip
    coord.start()
    insts = [
        start_inproc_instance(hub, "a1", config=None, stages=[(0, 2, 1), (2, 4, 1)], model="a", coordinator="coord"),
        start_inproc_instance(hub, "b1", config=None, stages=[(0, 4, 1)], model="b", coordinator="coord"),
        start_inproc_instance(hub, "l1", config=None, stages=[(0, 4, 1)], model="long", coordinator="coord"),
    ]
    server = ApiServer(coord, options=options)
    server.start()
    assert wait_until(lambda: len(coord.instances) == 3, 10)
    return Api(server.url, coord, server, insts)


def stop_api(api: Api) -> None:
    """Stop the server, the coordinator and every instance."""
    api.server.stop()
    api.coord.stop()
    for i in api.insts:
        i.stop()


AUTH = {"Authorization": "Bearer sekret"}


def noop_tokens(prompt_len: int, n: int) -> list[int]:
    """The tokens the weightless in-process engine emits for a prompt of `prompt_len` tokens."""
    return [3] + [3 + (prompt_len + 2 * k - 1) % 250 for k in range(1, n)]


def raw_request(host: str, port: int, data: bytes, wait_s: float = 2.0) -> bytes:
    """Send bytes on a fresh connection; return everything read until it closes or goes quiet."""
    s = socket.create_connection((host, port), timeout=wait_s)
    s.sendall(data)
    out = b""
    try:
        while chunk := s.recv(65536):
            out += chunk
    except TimeoutError:
        pass
    s.close()
    return out
