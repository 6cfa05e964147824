"""Run tokens for tests, written once per process by `new_token` into a private temporary
directory (a token is a secret plus the pin of the coordinator's certificate, whose key file
lies beside it)."""

from __future__ import annotations

import atexit
import dataclasses
import shutil
import socket
import tempfile
import time
from pathlib import Path

from frugaltrain.cluster import tls
from frugaltrain.cluster.auth import TOKEN_BYTES, RunToken, new_token

_DIR = Path(tempfile.mkdtemp(prefix="frugaltrain-tokens-"))
atexit.register(shutil.rmtree, _DIR, ignore_errors=True)

TOKEN = new_token(_DIR / "run.token")
# This run's coordinator, the wrong secret: gets through TLS, then refused as a "wrong token".
WRONG_SECRET = dataclasses.replace(TOKEN, secret=bytes(reversed(range(TOKEN_BYTES))))
# Another run altogether: its pin is not this coordinator's certificate.
OTHER_RUN = new_token(_DIR / "other.token")


def tls_connection(
    port: int, token: RunToken = TOKEN, timeout_s: float = 10.0, source: str = "127.0.0.1"
) -> tls.TlsSocket:
    """A TLS connection from `source` to a gateway on 127.0.0.1, before the token handshake:
    what a client speaks inside it is up to the test."""
    raw = socket.create_connection(
        ("127.0.0.1", port), timeout=timeout_s, source_address=(source, 0)
    )
    return tls.open_client(raw, token.pin, time.monotonic() + timeout_s, f"127.0.0.1:{port}")
