"""Access control and TLS on a real server: API keys from the option, the environment and a key file (401 without
or with a wrong key, /health open, /metrics open or closed by flag), the openai client over HTTPS with a key, and
the one-line refusals of options that cannot work."""

from __future__ import annotations

import os
import subprocess
import sys

import httpx
import pytest

from tests.serve.conftest import REPO, ServerProcess

pytestmark = pytest.mark.xdist_group("serve")

KEY, FILE_KEY, ENV_KEY = "sk-test-0123456789", "client-b-key", "env-key-42"


def _get(server, path: str, key: str | None = None) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key is not None else {}
    return httpx.get(server.url + path, headers=headers, verify=server.verify, timeout=10)


def _refused(response: httpx.Response) -> None:
    assert response.status_code == 401, response.text
    assert response.headers["www-authenticate"] == "Bearer"
    error = response.json()["error"]
    assert error["code"] == 401 and error["type"] == "authentication_error" and "API key" in error["message"]


@pytest.fixture(scope="module")
def keyed_server(serve_engines, tmp_path_factory):
    """The none engine with a key on the command line, one in SPECBUILD_API_KEY and one in a key file."""
    root = tmp_path_factory.mktemp("keyed")
    key_file = root / "keys"
    key_file.write_text(f"# one key per client\n\n{FILE_KEY}\n")
    os.environ["SPECBUILD_API_KEY"] = ENV_KEY  # read by the subprocess only
    try:
        server = ServerProcess(serve_engines["none"], root / "log", "--api-key-file", str(key_file), key=ENV_KEY)
    finally:
        del os.environ["SPECBUILD_API_KEY"]
    yield server.wait_ready()
    server.close()


def test_requests_without_a_valid_key_get_401_and_health_stays_open(keyed_server):
    assert keyed_server.health().status_code == 200
    assert _get(keyed_server, "/metrics").status_code == 200  # open unless --protect-metrics
    for path in ("/v1/models", "/v1/nothing"):
        _refused(_get(keyed_server, path))
        _refused(_get(keyed_server, path, key="wrong"))
        _refused(_get(keyed_server, path, key=ENV_KEY[:-1]))
    _refused(httpx.get(keyed_server.url + "/v1/models", headers={"Authorization": f"Basic {ENV_KEY}"}))
    body = {"model": keyed_server.model, "prompt": "abc", "max_tokens": 2}
    _refused(httpx.post(keyed_server.url + "/v1/completions", json=body))
    for key in (ENV_KEY, FILE_KEY):
        assert _get(keyed_server, "/v1/models", key=key).status_code == 200
    assert keyed_server.metric("specbuild:request_errors_total") >= 8  # refusals counted like any error
    assert "2 API key(s)" in keyed_server.log


def test_the_openai_client_with_its_key(keyed_server, reference_engine):
    want = reference_engine.generate(prompt="abcab", max_new_tokens=12)
    got = keyed_server.client().completions.create(
        model=keyed_server.model, prompt="abcab", max_tokens=12, temperature=0
    )
    assert got.choices[0].text == want.text
    import openai

    keyed_server.key = "wrong"
    with pytest.raises(openai.AuthenticationError):
        keyed_server.client().models.list()
    keyed_server.key = ENV_KEY


def test_https_with_a_key_and_protected_metrics(serve_engines, reference_engine, tmp_path):
    trustme = pytest.importorskip("trustme")
    ca = trustme.CA()
    certificate = ca.issue_cert("127.0.0.1", "localhost")
    cert_file, key_file, ca_file = tmp_path / "cert.pem", tmp_path / "key.pem", tmp_path / "ca.pem"
    certificate.private_key_pem.write_to_path(str(key_file))
    certificate.cert_chain_pems[0].write_to_path(str(cert_file))
    ca.cert_pem.write_to_path(str(ca_file))
    args = ("--api-key", KEY, "--protect-metrics", "--ssl-certfile", str(cert_file), "--ssl-keyfile", str(key_file))
    server = ServerProcess(serve_engines["none"], tmp_path / "log", *args, ca_file=ca_file, key=KEY)
    try:
        server.wait_ready()
        assert f"ready on https://127.0.0.1:{server.port}" in server.log
        want = reference_engine.generate(prompt="Hello", chat=True, max_new_tokens=10)
        chat = server.client().chat.completions.create(
            model=server.model, messages=[{"role": "user", "content": "Hello"}], max_tokens=10, temperature=0
        )
        assert chat.choices[0].message.content == want.text
        _refused(_get(server, "/metrics"))
        assert _get(server, "/metrics", key=KEY).status_code == 200
        assert server.health().status_code == 200
        with pytest.raises(httpx.TransportError):  # plain http to the TLS port
            httpx.get(f"http://127.0.0.1:{server.port}/health", timeout=5)
        with pytest.raises(httpx.ConnectError):  # a client that does not trust the certificate
            httpx.get(server.url + "/health", timeout=5)
    finally:
        server.close()


@pytest.mark.parametrize(
    "args, message",
    [
        (["--ssl-keyfile", "k.pem"], "--ssl-keyfile needs --ssl-certfile"),
        (["--ssl-certfile", "missing.pem"], "cannot load the certificate"),
        (["--protect-metrics"], "--protect-metrics needs an API key"),
        (["--api-key", "two words"], "printable ASCII without spaces"),
        (["--api-key-file", "empty"], "no key in it"),
        (["--api-key-file", "absent"], "cannot read it"),
        (["--triton", "--api-key", "k"], "Triton's own controls"),
    ],
)
def test_options_that_cannot_work_are_refused_in_one_line(serve_engines, tmp_path, args, message):
    (tmp_path / "empty").write_text("# nothing\n\n")
    command = [sys.executable, "-m", "specbuild.cli.main", "serve", "--engine-dir", str(serve_engines["none"])]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop("SPECBUILD_API_KEY", None)
    result = subprocess.run(command + args, capture_output=True, text=True, cwd=tmp_path, env=env, timeout=60)
    assert result.returncode != 0
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and message in lines[0], result.stderr
