"""TLS, mutual TLS and the plaintext rule of the Python client, against the real server with
certificates made here by openssl."""

import subprocess

import pytest

import gradwire
from conftest import ServerProcess


def test_loopback_detection():
    for address in ["127.0.0.1:1", "localhost:50051", "[::1]:9", "127.3.4.5:80", "unix:/tmp/s"]:
        assert gradwire.is_loopback(address), address
    for address in ["10.0.0.1:50051", "example.com:443", "[2001:db8::1]:1", "0.0.0.0:1"]:
        assert not gradwire.is_loopback(address), address


def test_plaintext_to_a_network_address_is_refused_unless_insecure():
    with pytest.raises(ValueError, match="not a loopback address"):
        gradwire.Client("10.1.2.3:50051")
    gradwire.Client("10.1.2.3:50051", insecure=True).close()  # no call is made
    with pytest.raises(ValueError, match="tls_cert and tls_key"):
        gradwire.Client("10.1.2.3:50051", tls_ca="ca.crt", tls_cert="c.crt")


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    d = tmp_path_factory.mktemp("pki")

    def run(*args):
        subprocess.run(["openssl", *args], check=True, cwd=d, capture_output=True)

    def self_signed(name):
        run("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
            "-days", "2", "-subj", f"/CN=gradwire python test {name}", "-keyout", f"{name}.key",
            "-out", f"{name}.crt")

    def signed(name, ca, ext):
        run("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
            "-subj", f"/CN={name}", "-keyout", f"{name}.key", "-out", f"{name}.csr")
        (d / f"{name}.ext").write_text(ext)
        run("x509", "-req", "-in", f"{name}.csr", "-CA", f"{ca}.crt", "-CAkey", f"{ca}.key",
            "-CAcreateserial", "-days", "2", "-extfile", f"{name}.ext", "-out", f"{name}.crt")

    self_signed("ca")
    self_signed("stranger")
    signed("server", "ca", "subjectAltName=IP:127.0.0.1,DNS:gradwire.test\n"
           "extendedKeyUsage=serverAuth\n")
    signed("client", "ca", "extendedKeyUsage=clientAuth\n")
    signed("impostor", "stranger", "extendedKeyUsage=clientAuth\n")
    return {p.stem + p.suffix: str(p) for p in d.iterdir()}


def served(client):
    try:
        client.server_info()
        return True
    except gradwire.GradwireError:
        return False
    finally:
        client.close()


def refusal(client):
    """The error of a call that the server's TLS settings refuse."""
    try:
        with pytest.raises(gradwire.GradwireError) as e:
            client.server_info()
        return e.value
    finally:
        client.close()


def test_tls(pki):
    server = ServerProcess("--tls-cert", pki["server.crt"], "--tls-key", pki["server.key"])
    try:
        a = server.address
        assert served(gradwire.Client(a, tls_ca=pki["ca.crt"], timeout=5))
        assert served(gradwire.Client(a, tls_ca=pki["ca.crt"], tls_server_name="gradwire.test",
                                      timeout=5))
        assert not served(gradwire.Client(a, tls_ca=pki["ca.crt"], tls_server_name="other.test",
                                          timeout=5))
        assert not served(gradwire.Client(a, tls_ca=pki["stranger.crt"], timeout=5))
        plaintext = refusal(gradwire.Client(a, timeout=5))  # plaintext to a TLS server
        assert plaintext.code == "UNAVAILABLE" and "server expects TLS?" in str(plaintext)
        wrong_ca = refusal(gradwire.Client(a, tls_ca=pki["stranger.crt"], timeout=5))
        assert "tls_ca is not the CA of the server's certificate" in str(wrong_ca)
        # A training step over TLS.
        with gradwire.Client(a, tls_ca=pki["ca.crt"], wire_dtype="bf16") as c:
            import torch
            layer = gradwire.RemoteLinear(c, 8, 4)
            x = torch.randn(3, 8, requires_grad=True)
            layer(x).sum().backward()
            assert x.grad is not None and torch.isfinite(x.grad).all()
    finally:
        server.stop()


def test_mutual_tls(pki):
    server = ServerProcess("--tls-cert", pki["server.crt"], "--tls-key", pki["server.key"],
                           "--tls-client-ca", pki["ca.crt"])
    try:
        a = server.address
        assert served(gradwire.Client(a, tls_ca=pki["ca.crt"], tls_cert=pki["client.crt"],
                                      tls_key=pki["client.key"], timeout=5))
        no_cert = refusal(gradwire.Client(a, tls_ca=pki["ca.crt"], timeout=5))
        assert "client certificate required?" in str(no_cert), no_cert
        assert not served(gradwire.Client(a, tls_ca=pki["ca.crt"], tls_cert=pki["impostor.crt"],
                                          tls_key=pki["impostor.key"], timeout=5))
    finally:
        server.stop()


def test_unreadable_tls_file_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="cannot read tls_ca"):
        gradwire.Client("127.0.0.1:1", tls_ca=str(tmp_path / "missing.crt"))


def test_nothing_listening_is_named():
    import socket
    with socket.socket() as s:  # a port that was free a moment ago
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    e = refusal(gradwire.Client(f"127.0.0.1:{port}", timeout=5))
    assert e.code == "UNAVAILABLE" and "is gradwire-server running there?" in str(e)
