"""How every process reaches Redis: a URL (its password included) plus optional TLS files, turned into redis-py
clients in one place; `redact` keeps the password out of every log line and error message.

    redis://:PASSWORD@host:6379/0           AUTH with a password (redis://USER:PASSWORD@... for an ACL user)
    rediss://:PASSWORD@host:6380/0          TLS; the server's certificate is checked against `RedisTLS.ca_file`
                                            (else the system's CAs), its host name included
The embedded Redis (deployments/embedded_redis.py) hands out a URL of the first form with its generated password.
"""

from __future__ import annotations

import re
import ssl
from dataclasses import dataclass
from typing import Any, Optional
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

from deployments.config import RedisTLS


class RedisUnavailable(RuntimeError):
    """Redis cannot be reached or started; the message says where and why."""


@dataclass(frozen=True)
class RedisAddress:
    """Where a Redis is and how to talk to it: the URL (with its password) and, for rediss://, the TLS files."""

    url: str
    tls: Optional[RedisTLS] = None

    def __str__(self) -> str:
        return redact(self.url)


def client_options(url: str, tls: Optional[RedisTLS] = None) -> dict[str, Any]:
    """redis-py keyword arguments (beyond the URL's own) for `url`: the TLS files for a rediss:// URL."""
    if tls is None or not url.startswith("rediss://"):
        return {}
    opts: dict[str, Any] = {"ssl_cert_reqs": "required", "ssl_check_hostname": tls.check_hostname}
    if tls.ca_file:
        opts["ssl_ca_certs"] = tls.ca_file
    if tls.cert_file:
        opts["ssl_certfile"] = tls.cert_file
        opts["ssl_keyfile"] = tls.key_file
    return opts


def sync_client(url: str, tls: Optional[RedisTLS] = None, timeout_s: float = 2.0):
    import redis

    return redis.Redis.from_url(url, socket_connect_timeout=timeout_s, socket_timeout=timeout_s,
                                **client_options(url, tls))


def ping(url: str, timeout_s: float = 2.0, tls: Optional[RedisTLS] = None) -> bool:
    import redis

    try:
        client = sync_client(url, tls, timeout_s)
        try:
            return bool(client.ping())
        finally:
            client.close()
    except (redis.exceptions.RedisError, OSError):
        return False


def check_reachable(url: str, timeout_s: float = 3.0, tls: Optional[RedisTLS] = None) -> None:
    """Raise RedisUnavailable, with a one-line message and no password, if `url` does not answer PING."""
    import redis

    try:
        client = sync_client(url, tls, timeout_s)
        try:
            client.ping()
        finally:
            client.close()
    except (redis.exceptions.RedisError, OSError, ValueError, ssl.SSLError) as err:
        raise RedisUnavailable(
            f"Redis at {redact(url)} is unreachable ({describe(err, url)}). Start it, fix REDIS_URL (redis_url, "
            "redis_tls), or unset REDIS_URL to use the embedded Redis."
        ) from None


def describe(err: BaseException, url: str = "") -> str:
    """`err` as one line without the URL's password: what a log line or a start-up error may show."""
    text = f"{type(err).__name__}: {err}"
    if isinstance(err, ssl.SSLError) or "CERTIFICATE_VERIFY_FAILED" in text:
        text += " (the server's certificate does not verify against redis_tls.ca_file)"
    secret = urlsplit(url).password if "://" in url else None
    if secret:
        text = text.replace(secret, "***")
    return re.sub(r"\s+", " ", text).strip()


def redact(url: str) -> str:
    """The URL without its password (in the user-info part or a `password=` query argument)."""
    if "://" not in url:
        return url
    parts = urlsplit(url)
    if "@" in parts.netloc:
        userinfo, host = parts.netloc.rsplit("@", 1)
        user = userinfo.split(":", 1)[0]
        parts = parts._replace(netloc=f"{user}:***@{host}" if user else f"***@{host}")
    pairs = parse_qsl(parts.query)
    if any(k.lower() == "password" for k, _ in pairs):
        parts = parts._replace(query=urlencode([(k, "***" if k.lower() == "password" else v) for k, v in pairs],
                                               safe="*"))
    return urlunsplit(parts) if parts != urlsplit(url) else url
