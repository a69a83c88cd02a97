"""NATS credentials and TLS: `$NATS_CREDS` and the TLS variables reach every connection (the
services' and the CLI's, all made by BusConnection.open from load_config), a user's real
creds-protected and TLS-only servers take them, and `duplexbus nats` (one server or a
cluster) makes credentials of its own as `duplexbus up` does."""

from __future__ import annotations

import asyncio
import base64
import hashlib
import json
import os
import re
import shutil
import signal
import socket
import ssl
import stat
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import msgspec
import nacl.utils
import nkeys
import pytest

from duplexbus.supervisor import UpOptions, run_up
from shared.bus import subjects
from shared.bus.connection import BusConnection, _connect_options
from shared.bus.embedded import NatsServer, free_port
from shared.runtime.config import ServingConfig, load_config
from shared.runtime.errors import BusDenied, BusError

NATS_ENV = ("NATS_URL", "NATS_CREDS", "NATS_CA", "NATS_CERT", "NATS_KEY", "DUPLEXBUS_CONFIG")


@pytest.fixture
def bare_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in NATS_ENV:
        monkeypatch.delenv(name, raising=False)


def cli(*argv: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if k not in NATS_ENV}
    return subprocess.run(
        [sys.executable, "-m", "duplexbus.cli", *argv], env={**base, **(env or {})}, capture_output=True, text=True, timeout=60
    )


# --- certificates and a creds file --------------------------------------------------------


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A CA, a server certificate for 127.0.0.1 and a client certificate, made with openssl."""
    if shutil.which("openssl") is None:
        pytest.skip("needs the openssl command to make test certificates")
    d = tmp_path_factory.mktemp("certs")
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]

    def run(*args: str) -> None:
        subprocess.run(["openssl", *args], cwd=d, check=True, capture_output=True, timeout=30)

    run("req", "-x509", *ec, "-keyout", "ca.key", "-out", "ca.pem", "-days", "2", "-subj", "/CN=duplexbus test CA",
        "-addext", "basicConstraints=critical,CA:TRUE", "-addext", "keyUsage=critical,keyCertSign,cRLSign")  # fmt: skip
    for name, ext in (
        ("server", "subjectAltName=IP:127.0.0.1\nextendedKeyUsage=serverAuth"),
        ("client", "extendedKeyUsage=clientAuth"),
    ):
        (d / f"{name}.ext").write_text(f"{ext}\nauthorityKeyIdentifier=keyid\nbasicConstraints=CA:FALSE\n")
        run("req", *ec, "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN={name}")
        run("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
            "-out", f"{name}.pem", "-days", "2", "-extfile", f"{name}.ext")  # fmt: skip
    return {n: d / n for n in ("ca.pem", "server.pem", "server.key", "client.pem", "client.key")}


def _keypair(prefix: int) -> nkeys.KeyPair:
    return nkeys.from_seed(bytearray(nkeys.encode_seed(nacl.utils.random(32), prefix)))


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _jwt(issuer: nkeys.KeyPair, subject: nkeys.KeyPair, name: str, claims: dict[str, object]) -> str:
    """A NATS JWT (v2) about `subject`, signed by `issuer`, as `nsc` would make it."""
    body: dict[str, object] = {
        "iat": int(time.time()), "iss": issuer.public_key.decode(), "name": name, "sub": subject.public_key.decode(),
        "nats": {**claims, "version": 2},
    }  # fmt: skip
    body["jti"] = base64.b32encode(hashlib.sha256(json.dumps(body, sort_keys=True).encode()).digest()).decode().rstrip("=")
    signed = _b64(json.dumps({"typ": "JWT", "alg": "ed25519-nkey"}).encode()) + "." + _b64(json.dumps(body).encode())
    return signed + "." + _b64(issuer.sign(signed.encode()))


@pytest.fixture(scope="module")
def creds_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[NatsServer, Path]]:
    """A nats-server in operator mode (JWT accounts, as a user's managed NATS is), and a .creds
    file of a user of its one account, which may use JetStream."""
    d = tmp_path_factory.mktemp("creds")
    operator, account, system = (_keypair(nkeys.PREFIX_BYTE_OPERATOR), _keypair(nkeys.PREFIX_BYTE_ACCOUNT),
                                 _keypair(nkeys.PREFIX_BYTE_ACCOUNT))  # fmt: skip
    user = _keypair(nkeys.PREFIX_BYTE_USER)
    limits = {"subs": -1, "data": -1, "payload": -1, "imports": -1, "exports": -1, "wildcards": True, "conn": -1, "leaf": -1}
    jetstream = {"mem_storage": -1, "disk_storage": -1, "streams": -1, "consumer": -1}
    accounts = {
        account.public_key.decode(): _jwt(operator, account, "duplexbus", {"type": "account", "limits": {**limits, **jetstream}}),
        system.public_key.decode(): _jwt(operator, system, "SYS", {"type": "account", "limits": limits}),
    }
    preload = "".join(f"  {key}: {json.dumps(token)}\n" for key, token in accounts.items())
    config = (
        f"operator: {json.dumps(_jwt(operator, operator, 'test', {'type': 'operator'}))}\n"
        f"system_account: {system.public_key.decode()}\nresolver: MEMORY\nresolver_preload: {{\n{preload}}}\n"
    )
    user_jwt = _jwt(account, user, "service", {"type": "user", "pub": {}, "sub": {}, "subs": -1, "data": -1, "payload": -1})
    creds = d / "service.creds"
    creds.write_text(
        f"-----BEGIN NATS USER JWT-----\n{user_jwt}\n------END NATS USER JWT------\n\n"
        f"-----BEGIN USER NKEY SEED-----\n{user.seed.decode()}\n------END USER NKEY SEED------\n"
    )
    with NatsServer(d / "store", config=config) as server:
        yield server, creds


# --- the environment reaches the connect options (pure) -----------------------------------


def test_nats_creds_and_tls_variables_reach_the_connect_options(
    bare_env: None, monkeypatch: pytest.MonkeyPatch, certs: dict[str, Path], tmp_path: Path
) -> None:
    plain = _connect_options(load_config(nats_url="nats://n1:4222"), "svc")
    assert "user_credentials" not in plain and "tls" not in plain
    monkeypatch.setenv("NATS_URL", "nats://n1:4222,nats://n2:4222")
    monkeypatch.setenv("NATS_CREDS", "/etc/duplexbus/service.creds")
    monkeypatch.setenv("NATS_CA", str(certs["ca.pem"]))
    opts = _connect_options(load_config(), "svc")
    assert opts["servers"] == ["nats://n1:4222", "nats://n2:4222"]
    assert opts["user_credentials"] == "/etc/duplexbus/service.creds"
    tls = opts["tls"]
    assert isinstance(tls, ssl.SSLContext) and tls.verify_mode == ssl.CERT_REQUIRED
    assert [c["subject"] for c in tls.get_ca_certs()] == [((("commonName", "duplexbus test CA"),),)]
    # The variables go over the file's keys one by one: its CA stays, the client certificate is added.
    cfg = tmp_path / "serving.yaml"
    cfg.write_text(f"nats_creds: /from/the/file.creds\nnats_tls:\n  ca_file: {certs['ca.pem']}\n")
    monkeypatch.delenv("NATS_CA")
    monkeypatch.setenv("NATS_CERT", str(certs["client.pem"]))
    monkeypatch.setenv("NATS_KEY", str(certs["client.key"]))
    loaded = load_config(cfg)
    assert loaded.nats_creds == "/etc/duplexbus/service.creds"
    assert loaded.nats_tls is not None and loaded.nats_tls.ca_file == str(certs["ca.pem"])
    assert (loaded.nats_tls.cert_file, loaded.nats_tls.key_file) == (str(certs["client.pem"]), str(certs["client.key"]))
    assert isinstance(_connect_options(loaded, "svc")["tls"], ssl.SSLContext)  # the chain loads


# --- real servers ---------------------------------------------------------------------------


async def _store_and_read(cfg: ServingConfig, read_for_s: float = 0.0) -> list[bytes]:
    """What a service does first (the stream made, a message stored) and a read back.
    `read_for_s`: read again while the read finds nothing, for so long. A cluster's node that
    leads the reading consumer may not have applied the message yet when the write is
    acknowledged (a quorum of two of three did): its consumer then counts nothing pending."""
    bus = await BusConnection.open(cfg, "auth-test", connect_timeout=5)
    try:
        await bus.store(subjects.open_("c1"), b"open")
        deadline = asyncio.get_running_loop().time() + read_for_s
        while True:
            got = [b async for _, b, _ in bus.read_stored([subjects.call_all("c1")])]
            if got or asyncio.get_running_loop().time() >= deadline:
                return got
            await asyncio.sleep(0.1)
    finally:
        await bus.close()


def test_a_creds_protected_server_takes_nats_creds_from_services_and_the_cli(
    bare_env: None, monkeypatch: pytest.MonkeyPatch, creds_server: tuple[NatsServer, Path]
) -> None:
    server, creds = creds_server
    with pytest.raises(BusError, match="Authorization Violation"):
        asyncio.run(_store_and_read(load_config(nats_url=server.url)))
    monkeypatch.setenv("NATS_CREDS", str(creds))
    assert asyncio.run(_store_and_read(load_config(nats_url=server.url))) == [b"open"]
    # The CLI's bus command: refused without the file, connected with it (and finds no such call).
    refused = cli("replay", "--nats-url", server.url, "nope")
    assert refused.returncode == 1 and "Authorization Violation" in refused.stderr, refused.stderr
    taken = cli("replay", "--nats-url", server.url, "nope", env={"NATS_CREDS": str(creds)})
    assert "Authorization" not in taken.stdout + taken.stderr and "nope" in taken.stdout + taken.stderr, taken


def test_a_tls_server_that_wants_client_certificates_takes_them_from_the_environment(
    bare_env: None, monkeypatch: pytest.MonkeyPatch, certs: dict[str, Path], tmp_path: Path
) -> None:
    tls = (
        f"tls {{\n  cert_file: {json.dumps(str(certs['server.pem']))}\n  key_file: {json.dumps(str(certs['server.key']))}\n"
        f"  ca_file: {json.dumps(str(certs['ca.pem']))}\n  verify: true\n}}\n"
    )
    with NatsServer(tmp_path / "store", config=tls) as server:
        with pytest.raises(BusError):  # no TLS at all
            asyncio.run(_store_and_read(load_config(nats_url=server.url)))
        monkeypatch.setenv("NATS_CA", str(certs["ca.pem"]))
        with pytest.raises(BusError):  # the server's certificate verified, but no certificate of ours
            asyncio.run(_store_and_read(load_config(nats_url=server.url)))
        monkeypatch.setenv("NATS_CERT", str(certs["client.pem"]))
        monkeypatch.setenv("NATS_KEY", str(certs["client.key"]))
        assert asyncio.run(_store_and_read(load_config(nats_url=server.url))) == [b"open"]


def test_up_refuses_credentials_meant_for_a_server_it_was_not_given(
    bare_env: None, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("NATS_CREDS", str(tmp_path / "service.creds"))
    opts = UpOptions(
        config=None, model="echo", frontends=1, workers=1, port=free_port(), host="127.0.0.1", run_dir=tmp_path / "run"
    )
    assert run_up(opts, ["Encoder", "Talker"], load_config(model="echo")) == 2
    assert "no NATS URL: they are for your own NATS server" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()  # nothing started


# --- duplexbus nats makes credentials -------------------------------------------------------


class NatsCommand:
    """`duplexbus nats ...` in the background: what it printed, stopped with SIGTERM."""

    def __init__(self, *argv: str) -> None:
        base = {k: v for k, v in os.environ.items() if k not in NATS_ENV}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "duplexbus.cli", "nats", *argv], env=base, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            text=True,
        )  # fmt: skip
        assert self.proc.stdout is not None and self.proc.stderr is not None
        self.urls = self.proc.stdout.readline().strip().split(",")
        self.said = self.proc.stderr.readline()

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        code = self.proc.wait(30)
        self.proc.communicate()
        return code


async def _refused_and_let_in(plain: list[str], saved: str, replicas: int) -> list[bytes]:
    for url in plain:  # no node lets in a client without the password
        with pytest.raises(BusError, match="Authorization Violation"):
            await BusConnection.open(load_config(nats_url=url), "no-password", stream=False, connect_timeout=5)
    cfg = load_config(nats_url=saved, retention={"replicas": replicas})
    for _ in range(100):  # a cluster just up may not take a replicated stream at once
        try:
            return await _store_and_read(cfg, read_for_s=10.0)
        except BusError:
            await asyncio.sleep(0.2)
    return await _store_and_read(cfg, read_for_s=10.0)


@pytest.mark.parametrize("cluster", [False, True], ids=["one server", "cluster"])
def test_duplexbus_nats_wants_the_credentials_it_saves_for_this_user_alone(bare_env: None, tmp_path: Path, cluster: bool) -> None:
    port = free_port()
    nats = NatsCommand("--store", str(tmp_path / "nats"), "--port", str(port), *(["--cluster"] if cluster else []))
    saved = tmp_path / "nats.url"  # beside the store, named after it
    try:
        assert f"credentials in {saved}" in nats.said, nats.said
        assert stat.S_IMODE(saved.stat().st_mode) == 0o600
        url = saved.read_text().strip()
        assert len(url.split(",")) == len(nats.urls) == (3 if cluster else 1)
        assert all("@127.0.0.1:" in u for u in url.split(",")) and not any("@" in u for u in nats.urls)
        assert asyncio.run(_refused_and_let_in(nats.urls, url, 3 if cluster else 1)) == [b"open"]
        if cluster:  # nor do the routes between the nodes let in a process that would join as a node
            conf = (tmp_path / "nats" / "duplexbus-a" / "auth.conf").read_text()
            assert stat.S_IMODE((tmp_path / "nats" / "duplexbus-a" / "auth.conf").stat().st_mode) == 0o600
            match = re.search(r'listen: "127\.0\.0\.1:(\d+)"', conf)
            assert match is not None, conf
            with socket.create_connection(("127.0.0.1", int(match.group(1))), timeout=5) as route:
                route.recv(4096)  # its INFO
                route.sendall(b'CONNECT {"verbose":false,"pedantic":false,"name":"rogue","cluster":"duplexbus"}\r\nPING\r\n')
                assert b"Authorization Violation" in route.recv(4096)
    finally:
        assert nats.stop() == 0
    assert not saved.exists()  # the credentials go with the server


async def test_a_missing_credentials_file_is_said_before_any_server_is_asked(bare_env: None, tmp_path: Path) -> None:
    """Before, with no server up, it said "no server answered" and nothing of the file."""
    missing = tmp_path / "nowhere.creds"
    config = load_config(nats_url="nats://127.0.0.1:1")
    config = msgspec.structs.replace(config, nats_creds=str(missing))
    with pytest.raises(BusDenied, match=r"no credentials file at .*nowhere\.creds"):
        await BusConnection.open(config, "svc", connect_timeout=2.0)
