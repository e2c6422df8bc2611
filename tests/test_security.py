"""CURVE key files: loading, and the one-line errors for every way they can be wrong."""

from __future__ import annotations

from pathlib import Path

import pytest
import zmq
import zmq.auth

from kvevents.errors import ConfigError
from kvevents.security import (
    CurveClientConfig,
    CurveServerConfig,
    apply_curve_client,
    apply_curve_server,
    load_public_key,
    load_secret_key,
)


@pytest.fixture
def keys(tmp_path: Path) -> Path:
    zmq.auth.create_certificates(tmp_path, "server")
    zmq.auth.create_certificates(tmp_path, "client")
    return tmp_path


def test_load_keys(keys: Path) -> None:
    public, secret = load_secret_key(str(keys / "server.key_secret"))
    assert len(public) == 40 and len(secret) == 40
    assert load_public_key(str(keys / "server.key")) == public


@pytest.mark.parametrize(
    ("content", "needle"),
    [
        (None, "does not exist"),
        ("nothing here\n", "not a ZMQ certificate"),
        ('curve\n    public-key = "short"\n', "not a 40-character"),
    ],
)
def test_bad_files_are_one_line_config_errors(
    tmp_path: Path, content: str | None, needle: str
) -> None:
    path = tmp_path / "bad.key_secret"
    if content is not None:
        path.write_text(content)
    with pytest.raises(ConfigError) as info:
        load_secret_key(str(path))
    assert needle in str(info.value) and "\n" not in str(info.value)


def test_public_file_where_a_secret_is_needed(keys: Path) -> None:
    sock = zmq.Context.instance().socket(zmq.PUB)
    try:
        with pytest.raises(ConfigError, match="holds no secret key"):
            apply_curve_server(sock, CurveServerConfig(str(keys / "server.key")))
    finally:
        sock.close(0)


def test_authorized_dir_must_hold_keys(keys: Path, tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    sock = zmq.Context.instance().socket(zmq.ROUTER)
    try:
        with pytest.raises(ConfigError, match="holds no"):
            apply_curve_server(sock, CurveServerConfig(str(keys / "server.key_secret"), str(empty)))
        with pytest.raises(ConfigError, match="does not exist"):
            apply_curve_server(
                sock, CurveServerConfig(str(keys / "server.key_secret"), str(tmp_path / "nope"))
            )
    finally:
        sock.close(0)


def test_none_leaves_the_socket_alone() -> None:
    sock = zmq.Context.instance().socket(zmq.PUB)
    try:
        apply_curve_server(sock, None)()
        apply_curve_client(sock, None)
        assert sock.getsockopt(zmq.CURVE_SERVER) == 0
    finally:
        sock.close(0)


def _exchange(keys: Path, client_key: str, *, authorized: bool) -> list[bytes]:
    """A CURVE ROUTER and a DEALER with ``client_key``; what the ROUTER receives."""
    ctx = zmq.Context()
    auth_dir = keys / "authorized"
    auth_dir.mkdir(exist_ok=True)
    (auth_dir / "client.key").write_bytes((keys / "client.key").read_bytes())
    router = ctx.socket(zmq.ROUTER)
    release = apply_curve_server(
        router,
        CurveServerConfig(str(keys / "server.key_secret"), str(auth_dir) if authorized else None),
    )
    port = router.bind_to_random_port("tcp://127.0.0.1")
    dealer = ctx.socket(zmq.DEALER)
    apply_curve_client(dealer, CurveClientConfig(str(keys / client_key), str(keys / "server.key")))
    dealer.connect(f"tcp://127.0.0.1:{port}")
    dealer.send_multipart([b"", b"hello"])
    got: list[bytes] = []
    if router.poll(1500):
        got = router.recv_multipart()
    for s in (router, dealer):
        s.close(0)
    release()
    ctx.term()
    return got


def test_only_authorized_clients_get_through(keys: Path) -> None:
    zmq.auth.create_certificates(keys, "stranger")
    assert _exchange(keys, "client.key_secret", authorized=True)[-1] == b"hello"
    assert _exchange(keys, "stranger.key_secret", authorized=True) == []
    # Without an authorized list any client that knows the server key gets through.
    assert _exchange(keys, "stranger.key_secret", authorized=False)[-1] == b"hello"
