"""A deployment's secrets: the HTTP API key and the cluster's CurveZMQ keypair, made once per export.

`coral export` makes them for every deployment and writes them only under ``<out>/secrets`` (folders
0700, files 0600, and a ``.gitignore`` there that ignores everything); the exported task files refer
to them by path (SkyPilot ``file_mounts``, a `vllm serve` script's ``VLLM_API_KEY`` read from the
file), never by value. Re-exporting into the same folder keeps them, so the processes of a running
deployment and the ones a re-export adds share one key.
"""
from __future__ import annotations

import os
import secrets as _random
import tempfile
from dataclasses import dataclass
from pathlib import Path

from coral.errors import CoralError

__all__ = ["API_KEY_FILE", "CURVE_DIR", "SECRETS_DIR", "DeploymentSecrets", "load_secrets", "make_secrets", "write_secrets"]

SECRETS_DIR = "secrets"  # inside an export folder
API_KEY_FILE = "api_key"
CURVE_DIR = "curve"  # the keypair folder `coordinator.curve_keys_dir` points at
# the file names coral.runtime.transport.CurveKeys.load reads (ZeroMQ certificates of `coral keys`)
_PUBLIC, _SECRET = "cluster.key", "cluster.key_secret"


@dataclass(frozen=True, slots=True, kw_only=True)
class DeploymentSecrets:
    """The API key clients send (``Authorization: Bearer``) and the CurveZMQ certificate files' text."""

    api_key: str
    curve_public: str  # the text of cluster.key
    curve_secret: str  # the text of cluster.key_secret

    def __post_init__(self) -> None:
        if len(self.api_key) < 32 or not self.curve_public.strip() or "secret-key" not in self.curve_secret:
            raise ValueError("a deployment needs an API key of 32+ characters and a CurveZMQ keypair with its secret key")

    def __repr__(self) -> str:  # never print a secret
        return "DeploymentSecrets(<hidden>)"


def make_secrets() -> DeploymentSecrets:
    """A fresh API key (256 random bits) and CurveZMQ keypair.

    Raises:
        CoralError: pyzmq (which makes Curve keys) is not installed.
    """
    try:
        import zmq.auth  # lazy: zmq (runtime extra); a missing one is this error, not an import failure
    except ImportError:
        raise CoralError("making the deployment's CurveZMQ keys needs pyzmq: pip install pyzmq") from None
    with tempfile.TemporaryDirectory() as tmp:
        public, secret = zmq.auth.create_certificates(tmp, "cluster")
        return DeploymentSecrets(api_key=_random.token_urlsafe(32), curve_public=Path(public).read_text(),
                                 curve_secret=Path(secret).read_text())


def load_secrets(out: str | Path) -> DeploymentSecrets | None:
    """The secrets an earlier export wrote into folder `out`, or None when it holds none (or only part of them)."""
    d = Path(out) / SECRETS_DIR
    files = (d / API_KEY_FILE, d / CURVE_DIR / _PUBLIC, d / CURVE_DIR / _SECRET)
    if not all(f.is_file() for f in files):
        return None
    try:
        return DeploymentSecrets(api_key=files[0].read_text().strip(), curve_public=files[1].read_text(),
                                 curve_secret=files[2].read_text())
    except (OSError, UnicodeDecodeError, ValueError):
        return None


def write_secrets(s: DeploymentSecrets, out: Path) -> None:
    """Write `s` under ``out/secrets``: folders 0700, files 0600 (created so, never world-readable in between)."""
    d = out / SECRETS_DIR
    (d / CURVE_DIR).mkdir(parents=True, mode=0o700)
    d.chmod(0o700)
    (d / CURVE_DIR).chmod(0o700)
    for path, text in ((d / ".gitignore", "# a deployment's keys: never commit them\n*\n"), (d / API_KEY_FILE, s.api_key + "\n"),
                       (d / CURVE_DIR / _PUBLIC, s.curve_public), (d / CURVE_DIR / _SECRET, s.curve_secret)):
        with open(path, "x", opener=_private) as f:
            f.write(text)


def _private(path: str, flags: int) -> int:
    return os.open(path, flags, 0o600)
