"""Bind vs connect: each command refuses the endpoint form that would reach nobody."""

from __future__ import annotations

import json
import socket
import threading
import time
from pathlib import Path

import pytest
from _ports import free_port_block

from kvevents.capture import read_capture
from kvevents.cli import main
from kvevents.events import KVEventBatch
from kvevents.publishers import ZmqEventPublisher


def _one_line_error(capsys: pytest.CaptureFixture[str]) -> str:
    err = capsys.readouterr().err.strip()
    assert err.startswith("kvevents: error:") and "\n" not in err, err
    return err


def test_record_refuses_a_listening_address(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = str(tmp_path / "x.kvcap")
    assert main(["record", "tcp://*:5557", "-o", out, "--count", "1"]) == 2
    err = _one_line_error(capsys)
    assert "tcp://HOST:5557" in err and "--listen" in err
    assert main(["record", "tcp://127.0.0.1:1", "--replay-endpoint", "tcp://*:6", "-o", out]) == 2
    assert "tcp://HOST:6" in _one_line_error(capsys)
    assert main(["record", "--listen", "tcp://127.0.0.1:5557", "-o", out]) == 2
    assert "tcp://*:PORT" in _one_line_error(capsys)


def test_replay_publish_refuses_a_connecting_address(
    sim_capture: tuple[Path, list[bytes]], capsys: pytest.CaptureFixture[str]
) -> None:
    path, _ = sim_capture
    assert main(["replay", str(path), "--publish", "tcp://127.0.0.1:6700", "-q"]) == 2
    err = _one_line_error(capsys)
    assert "would connect" in err and "tcp://*:6700" in err


def test_demo_binds_the_address_it_is_given(capsys: pytest.CaptureFixture[str]) -> None:
    """The demo's engines always listen: ``tcp://127.0.0.1:P`` binds loopback (it used to
    connect out under vLLM's rule, index nothing and still print a table).

    The demo binds ``P`` and the ports above it (one per engine and rank), so ``P`` is
    the base of a block that was free a moment ago, taken below the kernel's ephemeral
    range; should another process still take one in between, the run is refused with
    "Address already in use" and tried again on another block."""
    for _attempt in range(5):
        port = free_port_block(16)
        args = ["demo", "--quick", "--policy", "kv-aware", "--endpoint", f"tcp://127.0.0.1:{port}"]
        rc = main([*args, "--json", "-q", "--plot", ""])
        captured = capsys.readouterr()
        if rc == 2 and "Address already in use" in captured.err:
            continue
        assert rc == 0, captured.err
        break
    else:
        pytest.fail("no free block of ports in five tries")
    (policy,) = json.loads(captured.out)["policies"]
    assert policy["events"] > 0 and policy["tokens_saved"] > 0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_record_listen_receives_from_an_engine_that_connects_out(tmp_path: Path) -> None:
    port = _free_port()
    out = tmp_path / "listen.kvcap"
    rc: list[int] = []
    recorder = threading.Thread(
        target=lambda: rc.append(
            main(["record", "--listen", f"tcp://*:{port}", "-o", str(out), "--count", "3", "-q"])
        )
    )
    recorder.start()
    pub = ZmqEventPublisher(endpoint=f"tcp://127.0.0.1:{port}")
    try:
        assert not pub.binds
        # Connect mode loses what is sent before the subscription arrives: keep
        # publishing until the recorder has its three batches.
        deadline = time.monotonic() + 20
        while recorder.is_alive() and time.monotonic() < deadline:
            pub.publish(KVEventBatch(time.time(), [], None))
            recorder.join(0.05)
    finally:
        pub.shutdown()
        recorder.join(10)
    assert rc == [0]
    assert len(read_capture(out).records) == 3
