"""Clients that are hostile or broken: oversized bodies, idle and slowloris connections, guessed
API keys, model names that look like paths; and HTTPS (--ssl-*) and CORS (--allowed-origins).

Two real `pagedserve serve` subprocesses on 127.0.0.1 with the tiny random Llama: a plain one
with the limits turned tight, and an HTTPS one with a certificate authority made in the test.
"""
from __future__ import annotations

import asyncio
import datetime
import socket
import ssl
import time

import httpx
import pytest
from server_utils import RemoteServer

ENGINE = ["--max-model-len", 128, "--num-gpu-blocks-override", 64, "--num-threads", 1]
KEYS = ["key-one", "key-two", "key-three", "key-from-file"]
BODY_CAP = 64 * 1024
HEADER_TIMEOUT = 1.0


def _auth(key=KEYS[0]) -> dict:
    return {"Authorization": f"Bearer {key}"}


def _make_pki(d):
    """A CA, a server certificate for 127.0.0.1 and a client certificate, as PEM files in d."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
    import ipaddress

    now = datetime.datetime.now(datetime.timezone.utc)

    def name(cn):
        return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])

    def write_key(key, path):
        path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = (x509.CertificateBuilder().subject_name(name("test ca")).issuer_name(name("test ca"))
          .public_key(ca_key.public_key()).serial_number(x509.random_serial_number())
          .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
          .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
          .sign(ca_key, hashes.SHA256()))
    (d / "ca.pem").write_bytes(ca.public_bytes(serialization.Encoding.PEM))

    def leaf(cn, usage, san=None):
        key = ec.generate_private_key(ec.SECP256R1())
        b = (x509.CertificateBuilder().subject_name(name(cn)).issuer_name(ca.subject).public_key(key.public_key())
             .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
             .not_valid_after(now + datetime.timedelta(days=1))
             .add_extension(x509.ExtendedKeyUsage([usage]), critical=False))
        if san:
            b = b.add_extension(x509.SubjectAlternativeName(san), critical=False)
        cert = b.sign(ca_key, hashes.SHA256())
        (d / f"{cn}.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        write_key(key, d / f"{cn}.key")

    leaf("server", ExtendedKeyUsageOID.SERVER_AUTH, [x509.IPAddress(ipaddress.ip_address("127.0.0.1"))])
    leaf("client", ExtendedKeyUsageOID.CLIENT_AUTH)
    return d


@pytest.fixture(scope="module")
def servers(llama_dir, tmp_path_factory):
    d = tmp_path_factory.mktemp("pki")
    _make_pki(d)
    (d / "keys.txt").write_text(f"# one key per line\n{KEYS[3]}\n\n")
    plain = RemoteServer(llama_dir, [*ENGINE, "--api-key", KEYS[0], "--api-key", KEYS[1], "--api-key", KEYS[2],
                                     "--api-key-file", d / "keys.txt", "--max-request-body-bytes", BODY_CAP,
                                     "--timeout-request-header", HEADER_TIMEOUT,
                                     "--allowed-origins", '["https://ok.example"]'])
    tls = RemoteServer(llama_dir, [*ENGINE, "--ssl-keyfile", d / "server.key", "--ssl-certfile", d / "server.pem",
                                   "--ssl-ca-certs", d / "ca.pem", "--ssl-cert-reqs", 2])
    tls.base_url = f"https://{tls.host}:{tls.port}"
    try:
        plain.wait_ready()
        _wait_tls(tls, d)
        yield plain, tls, d
    finally:
        plain.stop()
        tls.stop()


def _client_ssl(d, with_cert=True) -> ssl.SSLContext:
    ctx = ssl.create_default_context(cafile=str(d / "ca.pem"))
    if with_cert:
        ctx.load_cert_chain(str(d / "client.pem"), str(d / "client.key"))
    return ctx


def _wait_tls(srv, d, timeout=180.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if srv.proc.poll() is not None:
            raise RuntimeError(f"server exited during startup:\n{srv.log()}")
        try:
            if httpx.get(srv.url("/health"), verify=_client_ssl(d), timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.25)
    raise TimeoutError(srv.log())


def _error(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, (r.status_code, r.text)
    err = r.json()["error"]
    assert err["message"] and err["type"] and "param" in err and "code" in err
    return err


# ------------------------------------------------------------------------------------------------
def test_body_over_the_cap_is_413_before_parsing(servers):
    srv = servers[0]
    url = srv.url("/v1/completions")
    big = b'{"prompt": "' + b"a" * BODY_CAP + b'", "max_tokens": 1}'
    err = _error(httpx.post(url, content=big, headers={**_auth(), "content-type": "application/json"}), 413)
    assert "--max-request-body-bytes" in err["message"]

    def chunks():  # no Content-Length: the cap applies while the body streams in
        yield b'{"prompt": "'
        for _ in range(BODY_CAP // 4096 + 2):
            yield b"a" * 4096
        yield b'"}'

    _error(httpx.post(url, content=chunks(), headers={**_auth(), "content-type": "application/json"}), 413)
    ok = httpx.post(url, json={"prompt": "hi", "max_tokens": 2}, headers=_auth(), timeout=30)
    assert ok.status_code == 200, ok.text


def test_several_api_keys_and_none_in_the_log(servers):
    srv = servers[0]
    url = srv.url("/v1/models")
    for k in KEYS:
        assert httpx.get(url, headers=_auth(k)).status_code == 200, k
    for bad in ("key-on", "key-one-", KEYS[0].upper(), KEYS[0] + KEYS[1], "x" * 5000):
        _error(httpx.get(url, headers=_auth(bad)), 401)
    _error(httpx.get(url, headers={"Authorization": f"Basic {KEYS[0]}"}), 401)
    r = httpx.post(srv.url("/v1/completions"), json={"prompt": "hi", "max_tokens": 2}, headers=_auth(KEYS[2]))
    assert r.status_code == 200
    log = srv.log(tail=10**7)
    assert "4 API key(s)" in log
    assert not any(k in log for k in KEYS), "an API key reached the log"


def test_key_check_does_the_same_work_for_every_key(monkeypatch):
    from pagedserve.server import auth

    mw = auth.APIKeyMiddleware(None, KEYS)
    calls = []
    real = auth.hmac.compare_digest
    monkeypatch.setattr(auth.hmac, "compare_digest", lambda a, b: calls.append((len(a), len(b))) or real(a, b))
    for token in (KEYS[0].encode(), KEYS[3].encode(), b"nope", b"y" * 999):
        calls.clear()
        mw._matches(token)
        assert calls == [(32, 32)] * len(KEYS)  # fixed-length digests, no early exit
    assert mw._matches(KEYS[1].encode()) and not mw._matches(b"key")


def test_model_names_are_never_opened_as_paths(servers, tmp_path):
    srv = servers[0]
    secret = tmp_path / "secret.txt"
    secret.write_text("TOPSECRET")
    for name in (str(secret), "../../../../../../etc/passwd", "/etc/passwd", "file:///etc/passwd", str(tmp_path)):
        r = httpx.post(srv.url("/v1/completions"), json={"model": name, "prompt": "hi", "max_tokens": 1},
                       headers=_auth())
        err = _error(r, 404)
        assert err["param"] == "model" and "TOPSECRET" not in r.text and "root:" not in r.text
        r = httpx.get(srv.url("/v1/models/" + name.lstrip("/")), headers=_auth())
        assert r.status_code == 404 and "TOPSECRET" not in r.text and "root:" not in r.text


def test_idle_and_slowloris_connections_do_not_starve_real_clients(servers):
    srv = servers[0]
    n_idle, n_slow = 150, 150
    socks = []
    for i in range(n_idle + n_slow):
        s = socket.create_connection((srv.host, srv.port), timeout=5)
        if i >= n_idle:
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
        socks.append(s)

    async def real_clients():
        async with httpx.AsyncClient(base_url=srv.base_url, headers=_auth(), timeout=30) as h:
            t0 = time.monotonic()
            rs = await asyncio.gather(*[h.post("/v1/completions", json={"prompt": "hi", "max_tokens": 4})
                                        for _ in range(8)])
            return rs, time.monotonic() - t0

    async def dribble(stop_at):
        while time.monotonic() < stop_at:  # one header byte each 0.2 s per slow socket
            for s in socks[n_idle:]:
                try:
                    s.send(b"X")
                except OSError:
                    pass
            await asyncio.sleep(0.2)

    async def main():
        stop_at = time.monotonic() + HEADER_TIMEOUT + 2.0
        d = asyncio.ensure_future(dribble(stop_at))
        rs, dt = await real_clients()
        await d
        return rs, dt

    rs, dt = asyncio.run(main())
    assert all(r.status_code == 200 for r in rs) and dt < 20, (dt, [r.status_code for r in rs])
    # by now every idle or slow socket has been closed by the server
    closed = 0
    for s in socks:
        s.settimeout(3)
        try:
            closed += s.recv(1024) == b""
        except (ConnectionResetError, BrokenPipeError):
            closed += 1
        except socket.timeout:
            pass
        s.close()
    assert closed == len(socks), f"{len(socks) - closed} of {len(socks)} connections still open"
    assert httpx.get(srv.url("/health")).status_code == 200


def test_cors_only_for_the_allowed_origins(servers):
    plain, tls, d = servers
    pre = {"Origin": "https://ok.example", "Access-Control-Request-Method": "POST",
           "Access-Control-Request-Headers": "authorization,content-type"}
    r = httpx.options(plain.url("/v1/completions"), headers=pre)
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "https://ok.example"
    r = httpx.options(plain.url("/v1/completions"), headers={**pre, "Origin": "https://evil.example"})
    assert "access-control-allow-origin" not in r.headers
    r = httpx.get(plain.url("/v1/models"), headers={**_auth(), "Origin": "https://evil.example"})
    assert r.status_code == 200 and "access-control-allow-origin" not in r.headers
    # no --allowed-origins: no CORS headers at all
    r = httpx.options(tls.url("/v1/completions"), headers=pre, verify=_client_ssl(d))
    assert "access-control-allow-origin" not in r.headers


def test_https_with_client_certificates(servers):
    import openai

    _, srv, d = servers
    with httpx.Client(verify=_client_ssl(d), timeout=30) as h:
        c = openai.OpenAI(base_url=srv.url("/v1"), api_key="EMPTY", http_client=h, max_retries=0)
        out = c.completions.create(model=c.models.list().data[0].id, prompt="hi", max_tokens=3)
        assert out.usage.completion_tokens == 3
    # the server's certificate is checked against the CA ...
    with pytest.raises(httpx.ConnectError):
        httpx.get(srv.url("/health"), verify=True)
    # ... the client's against --ssl-ca-certs (--ssl-cert-reqs 2: required)
    with pytest.raises((httpx.ConnectError, httpx.ReadError, httpx.RemoteProtocolError)):
        httpx.get(srv.url("/health"), verify=_client_ssl(d, with_cert=False))
    # and plain HTTP on the HTTPS port gets nowhere
    with pytest.raises(httpx.HTTPError):
        httpx.get(f"http://{srv.host}:{srv.port}/health", timeout=1)
