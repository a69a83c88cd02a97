"""The serving config: parse_config / load_config name the offending key, and a frontend
with a bad config (or a client_streams bound that raises or removes the model's) exits
non-zero at start-up with the key in its output."""

from __future__ import annotations

import asyncio
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from models.echo import EchoModel
from shared.runtime.config import (
    AuthConfig,
    RealtimeConfig,
    RetentionConfig,
    ServingConfig,
    StreamConfig,
    TLSConfig,
    load_config,
    parse_config,
)
from shared.runtime.errors import ConfigError
from tests.protocol_model import AUDIO_MAX, DuoModel, argv
from tests.support import REPO


def test_defaults() -> None:
    c = parse_config(None)
    assert c == ServingConfig()
    assert (c.max_concurrent_requests, c.max_queued_requests, c.request_timeout_s) == (512, 64, 30.0)
    assert c.max_call_input_bytes == 64 * 1024 * 1024
    assert (c.retention.max_age_s, c.retention.max_bytes, c.retention.replicas) == (86400, 2 * 1024**3, 1)


@pytest.mark.parametrize(
    ("data", "key"),
    [
        ({"bogus": 1}, "bogus"),
        ({"max_concurrent_requests": "many"}, "max_concurrent_requests"),
        ({"max_concurrent_requests": 2.5}, "max_concurrent_requests"),
        ({"max_concurrent_requests": 0}, "max_concurrent_requests"),
        ({"max_queued_requests": -1}, "max_queued_requests"),
        ({"max_queued_requests": True}, "max_queued_requests"),
        ({"max_call_input_mb": 0}, "max_call_input_mb"),
        ({"request_timeout_s": -1}, "request_timeout_s"),
        ({"max_call_duration_s": 0}, "max_call_duration_s"),
        ({"max_message_mb": 0}, "max_message_mb"),
        ({"placement_timeout_s": 0}, "placement_timeout_s"),
        ({"retention": {"max_age_s": "x"}}, "retention.max_age_s"),
        ({"retention": {"bogus": 1}}, "retention.bogus"),
        ({"retention": {"replicas": 0}}, "retention.replicas"),
        ({"nats_tls": {"ca_file": 5}}, "nats_tls.ca_file"),
        ({"nats_tls": {"bogus": "x"}}, "nats_tls.bogus"),
        ({"client_streams": [1]}, "client_streams"),
        ({"client_streams": {"audio_in": 5}}, "client_streams.audio_in"),
        ({"client_streams": {"audio_in": {"bogus": 1}}}, "client_streams.audio_in.bogus"),
        ({"client_streams": {"audio_in": {"max_items": "x"}}}, "client_streams.audio_in.max_items"),
        ({"client_streams": {"audio_in": {"max_items": 0}}}, "client_streams.audio_in.max_items"),
    ],
)
def test_parse_config_names_the_key(data: dict[str, Any], key: str) -> None:
    with pytest.raises(ConfigError) as e:
        parse_config(data)
    assert e.value.key == key and str(e.value).startswith(f"{key}: ")


def test_stream_limits_may_lower_never_raise_or_remove() -> None:
    duo = DuoModel()
    assert duo.topology.stream_limits(parse_config({}).max_items_overrides) == {"audio_in": AUDIO_MAX, "aux_in": 40, "text_in": 4}
    lowered = duo.topology.stream_limits(parse_config({"client_streams": {"audio_in": {"max_items": 8}}}).max_items_overrides)
    assert lowered["audio_in"] == 8
    # echo declares no bound: the config may set one, or say none.
    echo = EchoModel()
    assert echo.topology.stream_limits(parse_config({"client_streams": {"audio_in": {"max_items": 50}}}).max_items_overrides) == {
        "audio_in": 50
    }
    assert echo.topology.stream_limits(
        parse_config({"client_streams": {"audio_in": {"max_items": None}}}).max_items_overrides
    ) == {"audio_in": None}
    for streams, key in [
        ({"audio_in": {"max_items": AUDIO_MAX + 1}}, "client_streams.audio_in.max_items"),
        ({"audio_in": {"max_items": None}}, "client_streams.audio_in.max_items"),
        ({"audio_in": {}}, "client_streams.audio_in.max_items"),
        ({"nope": {"max_items": 1}}, "client_streams.nope"),
    ]:
        with pytest.raises(ConfigError) as e:
            duo.topology.stream_limits(parse_config({"client_streams": streams}).max_items_overrides)
        assert e.value.key == key


def test_load_config_file_env_and_overrides(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("NATS_URL", raising=False)
    monkeypatch.delenv("DUPLEXBUS_CONFIG", raising=False)
    path = tmp_path / "serving.yaml"
    path.write_text(
        "model: echo\nmax_concurrent_requests: 7\nretention:\n  max_age_s: 60\nclient_streams:\n  audio_in:\n    max_items: 10\n"
    )
    c = load_config(path)
    assert (c.model, c.max_concurrent_requests, c.retention.max_age_s) == ("echo", 7, 60)
    assert c.client_streams["audio_in"].max_items == 10
    monkeypatch.setenv("DUPLEXBUS_CONFIG", str(path))
    monkeypatch.setenv("NATS_URL", "nats://example:4222")
    c = load_config(None, model="duo", port=None)  # None overrides are ignored
    assert (c.model, c.nats_url, c.max_concurrent_requests) == ("duo", "nats://example:4222", 7)
    empty = tmp_path / "empty.yaml"
    empty.write_text("")
    assert load_config(empty, model="echo").max_concurrent_requests == 512  # an empty file is all defaults


@pytest.mark.parametrize(
    ("text", "key"),
    [
        ("- 1\n- 2\n", "config"),
        ("max_concurrent_requests: [\n", "config"),
        ("retention:\n  max_bytes: -5\n", "retention.max_bytes"),
        ("retention:\n  max_bytes: 100\n  hard_max_bytes: 99\n", "retention.hard_max_bytes"),
        ("max_call_duraton_s: 10\n", "max_call_duraton_s"),
    ],
)
def test_load_config_errors_name_the_key(tmp_path: Path, text: str, key: str) -> None:
    path = tmp_path / "serving.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as e:
        load_config(path)
    assert e.value.key == key
    with pytest.raises(ConfigError) as e:
        load_config(tmp_path / "missing.yaml")
    assert e.value.key == "config" and "missing.yaml" in str(e.value)


def run_frontend(tmp_path: Path, config: dict[str, Any]) -> subprocess.CompletedProcess[str]:
    path = tmp_path / "serving.yaml"
    path.write_text(yaml.safe_dump(config))
    env = {k: v for k, v in os.environ.items() if k != "DUPLEXBUS_CONFIG"}
    env.update(PYTHONPATH=str(REPO), NATS_URL="nats://127.0.0.1:1")
    return subprocess.run(
        argv("frontend", "--config", str(path), "--port", "0"),
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
        cwd=REPO,
    )


@pytest.mark.parametrize(
    ("config", "key"),
    [
        ({"model": "duo", "client_streams": {"audio_in": {"max_items": AUDIO_MAX + 1}}}, "client_streams.audio_in.max_items"),
        ({"model": "duo", "client_streams": {"aux_in": {"max_items": None}}}, "client_streams.aux_in.max_items"),
        ({"model": "echo", "client_streams": {"nope": {"max_items": 3}}}, "client_streams.nope"),
        ({"model": "echo", "max_call_duraton_s": 10}, "max_call_duraton_s"),
        ({"model": "no_such_model"}, "model"),
    ],
)
async def test_frontend_exits_at_start_up_naming_the_key(tmp_path: Path, config: dict[str, Any], key: str) -> None:
    proc = await asyncio.to_thread(run_frontend, tmp_path, config)
    assert proc.returncode != 0, proc.stdout + proc.stderr
    assert f"config error: {key}:" in proc.stderr, proc.stderr[-2000:]


def documented_defaults() -> dict[str, object]:
    """`key` -> default from the table in docs/serving.md."""
    rows: dict[str, object] = {}
    for line in (REPO / "docs" / "serving.md").read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 3 and cells[0].startswith("`") and cells[0].endswith("`"):
            rows[cells[0].strip("`")] = yaml.safe_load(cells[1].strip("`")) if cells[1] else ...
    return rows


def test_every_config_key_is_documented() -> None:
    """Each key of ServingConfig (nested ones dotted) is a row of docs/serving.md with its default."""
    docs = documented_defaults()
    expected: dict[str, object] = {}
    defaults = ServingConfig()
    for name in ServingConfig.__struct_fields__:
        value = getattr(defaults, name)
        if isinstance(value, RetentionConfig | RealtimeConfig | AuthConfig):
            expected[name] = ...
            for sub in type(value).__struct_fields__:
                expected[f"{name}.{sub}"] = getattr(value, sub)
        else:
            expected[name] = value
    for sub in TLSConfig.__struct_fields__:
        expected[f"nats_tls.{sub}"] = getattr(TLSConfig(), sub)
    for sub in StreamConfig.__struct_fields__:
        expected[f"client_streams.<stream>.{sub}"] = getattr(StreamConfig(), sub)
    assert docs == expected
