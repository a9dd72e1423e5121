"""How runtime processes send each other messages: one interface, in-process and ZeroMQ implementations.

Every process owns one inbox (an address others send to) and sends one-way messages to
other inboxes; replies are ordinary messages to the sender's address, which messages
carry. A message is a list of frames (:func:`coral.runtime.protocol.encode`): the msgpack
body, then one frame per large tensor. ZeroMQ sends them as one multipart message without
copying the tensor frames, and receives them without a copy either. The in-process
transport still encodes every message, so unit tests exercise the same wire format as the
ZeroMQ one (PUSH/PULL over tcp on 127.0.0.1).

Malformed or oversized messages are logged and dropped by :meth:`Transport.recv`; they
never raise into the receiving loop.

Security: with :class:`CurveKeys` every ZeroMQ socket uses CurveZMQ (encryption and
authentication). All processes of a cluster share one keypair made by ``coral keys``; the
inbox accepts a peer only if the peer proves it holds that keypair's secret key (a ZAP
handler checks the client's public key), so a process without the key can neither read
nor send control messages.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from coral.errors import CoralError
from coral.runtime.protocol import DEFAULT_MAX_MESSAGE_BYTES, Frames, ProtocolError, decode, encode

__all__ = ["CurveKeys", "InprocHub", "InprocTransport", "Transport", "ZmqTransport", "generate_keys"]

log = logging.getLogger(__name__)

#: File names written by :func:`generate_keys` (ZeroMQ certificate format).
PUBLIC_KEY_FILE = "cluster.key"
SECRET_KEY_FILE = "cluster.key_secret"


@dataclass(frozen=True, slots=True, kw_only=True)
class CurveKeys:
    """The cluster's CurveZMQ keypair (Z85 text, 40 characters each)."""

    public: bytes
    secret: bytes

    def __post_init__(self) -> None:
        if len(self.public) != 40 or len(self.secret) != 40:
            raise ValueError("Curve keys must be 40-character Z85 strings")

    def __repr__(self) -> str:  # never print the secret
        return f"CurveKeys(public={self.public.decode()!r})"

    @staticmethod
    def load(folder: str | Path) -> CurveKeys:
        """Read the keypair written by :func:`generate_keys` from ``folder``.

        Raises:
            CoralError: if the files are missing or not ZeroMQ certificates.
        """
        # lazy: zmq.auth (only with CurveZMQ keys)
        import zmq.auth

        path = Path(folder) / SECRET_KEY_FILE
        if not path.is_file():
            raise CoralError(f"no Curve secret key at {path}; create one with `coral keys --dir {folder}`")
        try:
            public, secret = zmq.auth.load_certificate(str(path))
        except Exception as e:  # malformed certificate file
            raise CoralError(f"{path}: not a ZeroMQ certificate: {e}") from None
        if not secret:
            raise CoralError(f"{path} holds no secret key")
        return CurveKeys(public=public, secret=secret)


def generate_keys(folder: str | Path) -> tuple[Path, Path]:
    """Create the cluster's keypair in ``folder`` (created with mode 0700; the secret file 0600).

    Args:
        folder: where to write ``cluster.key`` and ``cluster.key_secret``.

    Returns:
        (public key file, secret key file).

    Raises:
        CoralError: if a keypair already exists there (never overwritten).
    """
    # lazy: zmq.auth (only with CurveZMQ keys)
    import zmq.auth

    d = Path(folder)
    d.mkdir(parents=True, exist_ok=True, mode=0o700)
    if (d / SECRET_KEY_FILE).exists() or (d / PUBLIC_KEY_FILE).exists():
        raise CoralError(f"{d} already holds a Curve keypair; delete it first to make a new one")
    public, secret = zmq.auth.create_certificates(str(d), "cluster")
    Path(secret).chmod(0o600)
    return Path(public), Path(secret)


class _ClusterKeys:
    """ZAP credentials check: a client is admitted only with the public key of a cluster this
    process serves (one per deployment; a process serving two, e.g. a test run, admits each's)."""

    def __init__(self) -> None:
        self.publics: set[bytes] = set()

    def callback(self, domain: str, key: bytes) -> bool:
        return key in self.publics


_AUTH: dict[int, tuple[Any, _ClusterKeys]] = {}  # one ZAP authenticator per (process, context)
_AUTH_LOCK = threading.Lock()


def _authenticator(ctx: Any, keys: CurveKeys) -> None:
    """Start (once per context) the ZAP handler that admits only peers holding a served cluster's
    keys, and add ``keys``' public key to those it admits. Before, the first keypair a process
    served with was the only one, so a second deployment in the same process (the test suite)
    had every peer refused, silently: its engines never dialled in."""
    # lazy: zmq.auth (only with CurveZMQ keys)
    import zmq.auth.thread

    with _AUTH_LOCK:
        hit = _AUTH.get(id(ctx))
        if hit is not None:
            hit[1].publics.add(keys.public)
            return
        creds = _ClusterKeys()
        creds.publics.add(keys.public)
        auth = zmq.auth.thread.ThreadAuthenticator(ctx, log=logging.getLogger("coral.runtime.zap"))
        auth.start()
        auth.configure_curve_callback(domain="*", credentials_provider=creds)
        _AUTH[id(ctx)] = (auth, creds)


class Transport(ABC):
    """A process's inbox plus the ability to send to other inboxes."""

    address: str
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
    #: Messages dropped because they were malformed or too large (for tests and metrics).
    rejected: int = 0

    @abstractmethod
    def send(self, address: str, msg: Any) -> None:
        """Send one message; never blocks for long (drops and logs if the peer is saturated).

        Args:
            address: the receiving inbox.
            msg: a top-level protocol message.
        """

    @abstractmethod
    def _recv_raw(self, timeout_s: float) -> Frames | None:
        """Wait up to ``timeout_s`` for the next raw message (its frames); None on timeout."""

    @abstractmethod
    def close(self) -> None:
        """Release sockets; the transport cannot be used afterwards."""

    def recv(self, timeout_s: float) -> Any | None:
        """Receive the next valid message.

        Args:
            timeout_s: the longest to wait, in seconds.

        Returns:
            The decoded message, or None if none arrived in time.
        """
        deadline = time.monotonic() + timeout_s
        while True:
            raw = self._recv_raw(max(0.0, deadline - time.monotonic()))
            if raw is None:
                return None
            try:
                return decode(raw, self.max_message_bytes)
            except ProtocolError as e:
                self.rejected += 1
                size = sum(memoryview(f).nbytes for f in raw)
                log.warning("%s: dropped a bad message (%d bytes, %d frames): %s", self.address, size, len(raw), e)
            if time.monotonic() >= deadline:
                return None


class InprocHub:
    """The shared switchboard of in-process transports (one per test)."""

    def __init__(self) -> None:
        self._queues: dict[str, queue.Queue[Frames]] = {}
        self._lock = threading.Lock()

    def register(self, address: str) -> queue.Queue[Frames]:
        """Create the inbox for ``address``.

        Raises:
            ValueError: if the address is taken.
        """
        with self._lock:
            if address in self._queues:
                raise ValueError(f"in-process address {address!r} already registered")
            q: queue.Queue[Frames] = queue.Queue()
            self._queues[address] = q
            return q

    def deliver(self, address: str, frames: Frames) -> bool:
        """Put a raw message (its frames) in an inbox; False if nobody listens there."""
        q = self._queues.get(address)
        if q is None:
            return False
        q.put(frames)
        return True

    def unregister(self, address: str) -> None:
        """Remove an inbox."""
        with self._lock:
            self._queues.pop(address, None)


class InprocTransport(Transport):
    """A transport whose messages go through a :class:`InprocHub` (same process, any thread)."""

    def __init__(self, hub: InprocHub, address: str, max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> None:
        self.hub = hub
        self.address = address
        self.max_message_bytes = max_message_bytes
        self._inbox = hub.register(address)

    def send(self, address: str, msg: Any) -> None:  # noqa: D102 - documented on the interface
        if not self.hub.deliver(address, encode(msg)):
            log.warning("%s: no in-process inbox at %s; dropped %s", self.address, address, type(msg).__name__)

    def send_raw(self, address: str, data: bytes | Frames) -> None:
        """Deliver arbitrary bytes or frames (for tests of malformed input)."""
        self.hub.deliver(address, [data] if isinstance(data, (bytes, bytearray, memoryview)) else data)

    def _recv_raw(self, timeout_s: float) -> Frames | None:
        try:
            return self._inbox.get(timeout=timeout_s) if timeout_s > 0 else self._inbox.get_nowait()
        except queue.Empty:
            return None

    def close(self) -> None:  # noqa: D102
        self.hub.unregister(self.address)


class ZmqTransport(Transport):
    """ZeroMQ PULL inbox bound on tcp, PUSH sockets to peers (created on first send, then kept).

    ``send`` may be called from any thread (a lock serialises the PUSH sockets); ``recv``
    from one thread only.
    """

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        send_hwm: int = 10_000,
        curve: CurveKeys | None = None,
    ) -> None:
        """Bind the inbox.

        Args:
            host: interface to bind (keep 127.0.0.1 unless the cluster spans machines).
            port: tcp port; 0 picks a free one.
            max_message_bytes: larger messages are rejected (ZeroMQ drops them at the
                socket, above twice this; the decoder below it).
            send_hwm: messages queued per peer before ``send`` drops and logs.
            curve: the cluster keypair; None = plain tcp (a trusted loopback only).
        """
        # lazy: zmq.auth (only with CurveZMQ keys)
        import zmq

        self._zmq = zmq
        self.ctx: Any = zmq.Context.instance()
        self.max_message_bytes = max_message_bytes
        self._send_hwm = send_hwm
        self.curve = curve
        self._pull = self.ctx.socket(zmq.PULL)
        self._pull.setsockopt(zmq.LINGER, 0)
        if curve is not None:
            _authenticator(self.ctx, curve)
            self._pull.curve_secretkey = curve.secret
            self._pull.curve_publickey = curve.public
            self._pull.curve_server = True
        self._pull.setsockopt(zmq.MAXMSGSIZE, 2 * max_message_bytes)
        try:
            if port == 0:
                port = self._pull.bind_to_random_port(f"tcp://{host}")
            else:
                self._pull.bind(f"tcp://{host}:{port}")
        except BaseException:
            self._pull.close(0)
            raise
        self.address = f"tcp://{host}:{port}"
        self._push: dict[str, Any] = {}
        self._lock = threading.Lock()
        self._poller = zmq.Poller()
        self._poller.register(self._pull, zmq.POLLIN)

    def send(self, address: str, msg: Any) -> None:  # noqa: D102
        self.send_raw(address, encode(msg))

    def send_raw(self, address: str, data: bytes | Frames) -> None:
        """Send already-encoded bytes or frames (for tests of malformed input and for fan-out)."""
        zmq = self._zmq
        frames = [data] if isinstance(data, (bytes, bytearray, memoryview)) else list(data)
        with self._lock:
            sock = self._push.get(address)
            if sock is None:
                sock = self.ctx.socket(zmq.PUSH)
                sock.setsockopt(zmq.LINGER, 0)
                sock.setsockopt(zmq.SNDHWM, self._send_hwm)
                if self.curve is not None:
                    sock.curve_secretkey = self.curve.secret
                    sock.curve_publickey = self.curve.public
                    sock.curve_serverkey = self.curve.public
                sock.connect(address)
                self._push[address] = sock
            try:
                # small frames are copied (cheaper than pinning); tensor frames go as they are
                last = len(frames) - 1
                for i, f in enumerate(frames):
                    size = memoryview(f).nbytes
                    sock.send(f, flags=zmq.NOBLOCK | (zmq.SNDMORE if i < last else 0), copy=size < 65536)
            except zmq.Again:
                log.warning("%s: peer %s saturated; dropped a %d-frame message", self.address, address, len(frames))

    def _recv_raw(self, timeout_s: float) -> Frames | None:
        events = dict(self._poller.poll(int(timeout_s * 1000)))
        if self._pull in events:
            return [f.buffer for f in self._pull.recv_multipart(copy=False)]
        return None

    def close(self) -> None:  # noqa: D102
        with self._lock:
            for s in self._push.values():
                s.close(0)
            self._push.clear()
        self._pull.close(0)

    def forget(self, address: str) -> None:
        """Close the PUSH socket to a peer that is gone (its queued messages are dropped)."""
        with self._lock:
            sock = self._push.pop(address, None)
        if sock is not None:
            sock.close(0)
