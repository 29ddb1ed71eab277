"""API keys: `Authorization: Bearer <key>`.

Keys come from $COTSERVE_API_KEYS (comma-separated) and/or a key file (one key a line, `#`
comments). With no key configured, authentication is off (the server then binds to a
non-loopback address only with --insecure)."""

from __future__ import annotations

import hmac
import ipaddress
import os
from pathlib import Path

from cotserve.errors import CotserveError


def load_keys(key_file: str | None = None, env: str = "COTSERVE_API_KEYS") -> list[str]:
    keys = [k.strip() for k in os.environ.get(env, "").split(",") if k.strip()]
    if key_file:
        path = Path(key_file).expanduser()
        if not path.is_file():
            raise CotserveError(f"--api-key-file {key_file} does not exist")
        for line in path.read_text().splitlines():
            line = line.strip()
            if line and not line.startswith("#"):
                keys.append(line)
    return keys


def check_key(header: str | None, keys: list[str]) -> bool:
    if not keys:
        return True
    if not header or not header.lower().startswith("bearer "):
        return False
    given = header[7:].strip().encode()
    return any(hmac.compare_digest(given, k.encode()) for k in keys)


def is_loopback(host: str) -> bool:
    """Whether `host` binds to loopback only. An empty host binds every interface: not loopback."""
    host = host.strip()
    if host == "localhost":
        return True
    if not host:
        return False
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_bind(host: str, keys: list[str], insecure: bool) -> None:
    """Refuse to serve on a non-loopback address without an API key (unless --insecure)."""
    if not is_loopback(host) and not keys and not insecure:
        shown = host or '"" (every interface)'
        raise CotserveError(
            f"refusing to serve on {shown} without an API key: set COTSERVE_API_KEYS or --api-key-file, "
            "or pass --insecure to serve without authentication")
