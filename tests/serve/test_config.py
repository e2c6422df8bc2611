"""``kvevents serve`` configuration: engine specs, TOML, environment, errors."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvevents.errors import ConfigError
from kvevents.serve import EngineSpec, load_config, parse_engine_spec


def test_engine_spec_full() -> None:
    e = parse_engine_spec("gpu-a_1=http://h:8000/,tcp://h:5557,tcp://h:5558;dp=4;topic=kv")
    assert e == EngineSpec("gpu-a_1", "http://h:8000", "tcp://h:5557", "tcp://h:5558", 4, "kv")
    # vLLM's offset rule for data-parallel ranks, on both endpoints
    assert e.endpoints_for_rank(0) == ("tcp://h:5557", "tcp://h:5558")
    assert e.endpoints_for_rank(3) == ("tcp://h:5560", "tcp://h:5561")
    assert parse_engine_spec(e.spec()) == e


def test_engine_rank_from_a_toml_file(tmp_path: Path) -> None:
    """``rank`` in an ``[[engine]]`` table is ``;rank=R``; a bad one is refused with the
    file named."""
    f = tmp_path / "serve.toml"
    f.write_text(
        '[[engine]]\nname = "e2"\nurl = "http://h:1"\nevents = "tcp://h:5557"\nrank = 2\n'
        '[[engine]]\nname = "h"\nurl = "http://h:2"\nevents = "tcp://h:5557"\ndp = 2\n'
        "rank = 2\n"
    )
    e2, h = load_config(config_file=str(f), environ={}).engines
    assert e2 == parse_engine_spec("e2=http://h:1,tcp://h:5557;rank=2")
    assert (h.first_rank, list(h.ranks)) == (2, [2, 3])
    assert parse_engine_spec(h.spec()) == h and h.spec().endswith(";dp=2;rank=2")
    for value, message in (("-1", "rank must be >= 0"), ('"x"', "bad"), ("true", "not an integer")):
        f.write_text(
            f'[[engine]]\nname = "a"\nurl = "http://h:1"\nevents = "tcp://h:2"\nrank = {value}\n'
        )
        with pytest.raises(ConfigError, match=message) as info:
            load_config(config_file=str(f), environ={})
        assert str(f) in str(info.value)


def test_engine_spec_without_replay() -> None:
    e = parse_engine_spec("a=http://h:1,tcp://h:2")
    assert e.replay_endpoint is None and e.dp_size == 1 and e.topic == ""


@pytest.mark.parametrize(
    "bad",
    [
        "noequals",
        "a=",
        "a b=http://h:1,tcp://h:2",
        "a=ftp://h:1,tcp://h:2",
        "a=http://h:1,h:2",
        "a=http://h:1,tcp://h:2;dp=x",
        "a=http://h:1,tcp://h:2;dp=0",
        "a=http://h:1,tcp://h:2;weird=1",
        "a=http://h:1,tcp://h:2,tcp://h:3,tcp://h:4",
    ],
)
def test_engine_spec_errors(bad: str) -> None:
    with pytest.raises(ConfigError):
        parse_engine_spec(bad)


def test_an_engine_without_events_is_refused_unless_they_come_from_jetstream() -> None:
    """``NAME=HTTP_URL`` parses (``serve --nats``), but a service reading ZMQ refuses it."""
    assert parse_engine_spec("a=http://h:1").events_endpoint is None
    with pytest.raises(ConfigError, match="no events endpoint"):
        load_config(engines=["a=http://h:1"], environ={})
    config = load_config(
        engines=["a=http://h:1"], options={"nats_url": "nats://h:4222"}, environ={}
    )
    assert config.engines[0].http_url == "http://h:1" and config.nats_url == "nats://h:4222"


def test_toml_env_and_command_line(tmp_path: Path) -> None:
    f = tmp_path / "serve.toml"
    f.write_text(
        'port = 9000\npolicy = "round-robin"\n'
        '[[engine]]\nname = "a"\nurl = "http://h:1"\nevents = "tcp://h:2"\nreplay = "tcp://h:3"\n'
        '[[engine]]\nname = "b"\nurl = "http://h:4"\nevents = "tcp://h:5"\ndp = 2\n'
    )
    cfg = load_config(config_file=str(f), environ={})
    assert cfg.port == 9000 and cfg.policy == "round-robin"
    assert [e.name for e in cfg.engines] == ["a", "b"] and cfg.engines[1].dp_size == 2
    # the environment overrides the file, the command line overrides both
    env = {"KVEVENTS_SERVE_PORT": "9100", "KVEVENTS_SERVE_POLICY": "random"}
    cfg = load_config(config_file=str(f), environ=env)
    assert cfg.port == 9100 and cfg.policy == "random"
    cfg = load_config(config_file=str(f), environ=env, options={"port": 9200, "policy": None})
    assert cfg.port == 9200 and cfg.policy == "random"
    cfg = load_config(
        config_file=str(f), environ=env, engines=["c=http://h:7,tcp://h:8"], options={}
    )
    assert [e.name for e in cfg.engines] == ["c"]
    env2 = {"KVEVENTS_SERVE_ENGINES": "x=http://h:1,tcp://h:2 y=http://h:3,tcp://h:4"}
    assert [e.name for e in load_config(environ=env2).engines] == ["x", "y"]


@pytest.mark.parametrize(
    "text",
    [
        "port = 'x'\n[[engine]]\nname='a'\nurl='http://h:1'\nevents='tcp://h:2'\n",
        "bogus = 1\n",
        "[[engine]]\nname='a'\n",
        "not toml [",
        "policy = 'nope'\n[[engine]]\nname='a'\nurl='http://h:1'\nevents='tcp://h:2'\n",
    ],
)
def test_bad_toml(tmp_path: Path, text: str) -> None:
    f = tmp_path / "bad.toml"
    f.write_text(text)
    with pytest.raises(ConfigError):
        load_config(config_file=str(f), environ={})


def test_no_engines_and_duplicates() -> None:
    with pytest.raises(ConfigError, match="no engines"):
        load_config(environ={})
    with pytest.raises(ConfigError, match="unique"):
        load_config(environ={}, engines=["a=http://h:1,tcp://h:2", "a=http://h:3,tcp://h:4"])


def test_missing_extra_is_one_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import importlib.util

    from kvevents.cli import main

    real = importlib.util.find_spec

    def fake(name: str, *a: object, **k: object) -> object:
        return None if name == "uvicorn" else real(name, *a, **k)  # type: ignore[arg-type]

    monkeypatch.setattr(importlib.util, "find_spec", fake)
    assert main(["serve", "--engine", "a=http://h:1,tcp://h:2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "pip install 'kvevents[serve]'" in err[0] and "uvicorn" in err[0]
    assert main(["sim", "serve", "--engines", "1"]) == 2
    assert "pip install 'kvevents[serve]'" in capsys.readouterr().err


def test_library_imports_without_the_extra() -> None:
    import subprocess
    import sys

    code = (
        "import sys\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] in ('starlette', 'uvicorn', 'httpx', 'fastapi'):\n"
        "            raise ImportError(name)\n"
        "sys.meta_path.insert(0, Block())\n"
        "import kvevents, kvevents.consumers, kvevents.serve, kvevents.sim, kvevents.cli\n"
        "kvevents.cli.build_parser()\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "ok", out.stderr


def test_local_tokenizer_files(tmp_path: Path) -> None:
    from kvevents.serve.tokens import LocalTokenizer
    from kvevents.tokenizer import SimTokenizer

    with pytest.raises(ConfigError, match="cannot read"):
        LocalTokenizer(str(tmp_path / "missing.json"))
    bad = tmp_path / "bad.json"
    bad.write_text("not json")
    with pytest.raises(ConfigError):
        LocalTokenizer(str(bad))
    good = tmp_path / "sim.json"
    SimTokenizer(1000).save(str(good))
    tok = LocalTokenizer(str(good))
    assert tok.handles_chat and tok.encode("a b") == SimTokenizer(1000).encode("a b")


def test_scrape_timeout_and_failures(tmp_path: Path) -> None:
    eng = ["a=http://h:1,tcp://h:2"]
    default = load_config(environ={}, engines=eng)
    assert (default.scrape_timeout_s, default.scrape_failures) == (2.0, 3)
    f = tmp_path / "s.toml"
    f.write_text("scrape_timeout_s = 0.5\nscrape_failures = 2\n")
    c = load_config(config_file=str(f), environ={}, engines=eng)
    assert (c.scrape_timeout_s, c.scrape_failures) == (0.5, 2)
    for bad in ({"scrape_timeout_s": 0}, {"scrape_failures": 0}):
        with pytest.raises(ConfigError, match="scrape_timeout_s must be > 0"):
            load_config(environ={}, engines=eng, options=bad)
