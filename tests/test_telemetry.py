"""Opt-in local telemetry: off by default, schema v2, nothing identifying,
never breaks wrap, never touches the network."""

from __future__ import annotations

import getpass
import json
import logging
import os
import socket
import stat
from pathlib import Path

import pytest
import torch
from conftest import CNN, FORCE, hook_count, mlp, tiny_gpt2, token_batch
from torch import nn

import memscale
from memscale import _telemetry


@pytest.fixture(autouse=True)
def clean(monkeypatch):
    monkeypatch.delenv(_telemetry.ENV_ENABLE, raising=False)
    monkeypatch.delenv(_telemetry.ENV_FILE, raising=False)
    _telemetry._use_environment()
    yield
    _telemetry._use_environment()


def events(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines()]


class AcmeSecretNet(nn.Module):
    """A model whose names must never leave the process."""

    def __init__(self) -> None:
        super().__init__()
        self.zz_private_encoder = nn.Sequential(*[nn.Linear(16, 16) for _ in range(3)])
        with torch.no_grad():
            for p in self.parameters():
                p.fill_(0.123456789)

    def forward(self, x):
        return self.zz_private_encoder(x)


def test_off_by_default(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert not _telemetry.is_enabled()
    model = mlp()
    memscale.wrap(model, FORCE, sample_input=torch.randn(4, 32))
    memscale.detach(model)
    assert list(tmp_path.iterdir()) == []


def test_enable_writes_a_schema_v2_event(tmp_path):
    sink = tmp_path / "events.jsonl"
    _telemetry.enable(sink)
    model = tiny_gpt2()
    memscale.wrap(model, FORCE, sample_input={"input_ids": token_batch()})
    memscale.detach(model)
    (event,) = events(sink)
    assert set(event) == set(_telemetry.SCHEMA)
    assert event["schema"] == 2 and event["event"] == "wrap_called"
    assert event["arch_class"] == "transformer"
    assert event["param_bucket"] == "<1M"
    assert event["device_type"] == "cpu" and event["device_count_bucket"] == "1"
    assert event["mode"] == "conservative" and event["techniques"] == ["checkpoint"]
    assert event["planned"] is True and event["skipped"] is False
    assert event["decision_source"] == "user_config"
    assert event["strategy"] == "as_configured"
    assert event["profiling"] in ("static", "empirical")
    assert event["layer_count_bucket"] == "1-4"
    _telemetry.validate(event)


def test_environment_opt_in(tmp_path, monkeypatch, caplog):
    sink = tmp_path / "env.jsonl"
    monkeypatch.setenv(_telemetry.ENV_ENABLE, "1")
    with caplog.at_level(logging.WARNING, logger="memscale"):
        model = mlp()
        memscale.wrap(model, FORCE, sample_input=torch.randn(4, 32))  # no file named
        memscale.detach(model)
    assert "MEMSCALE_TELEMETRY_FILE is not set" in caplog.text
    monkeypatch.setenv(_telemetry.ENV_FILE, str(sink))
    model = CNN()
    memscale.wrap(model, FORCE, sample_input=torch.randn(2, 3, 8, 8))
    memscale.detach(model)
    assert [e["arch_class"] for e in events(sink)] == ["cnn"]
    # disable() wins over the environment.
    _telemetry.disable()
    memscale.wrap(model, FORCE, sample_input=torch.randn(2, 3, 8, 8))
    memscale.detach(model)
    assert len(events(sink)) == 1
    monkeypatch.setenv(_telemetry.ENV_ENABLE, "maybe")
    _telemetry._use_environment()
    assert not _telemetry.is_enabled()


def test_warmup_wrap_emits_plan_built(tmp_path):
    sink = tmp_path / "warm.jsonl"
    _telemetry.enable(str(sink))
    model = mlp()
    memscale.wrap(model, memscale.Config(mode="conservative", force_optimize=True, warmup_steps=1))
    model._memscale_executor.measure_real_steps()  # real steps measured, unoptimized
    x = torch.randn(4, 32)
    for _ in range(2):
        model(x).sum().backward()
    memscale.detach(model)
    wrap_called, plan_built = events(sink)
    assert wrap_called["event"] == "wrap_called" and wrap_called["planned"] is False
    assert wrap_called["techniques"] is None and wrap_called["profiling"] == "first_step"
    assert plan_built["event"] == "plan_built" and plan_built["planned"] is True
    assert plan_built["techniques"] == ["checkpoint"] and plan_built["arch_class"] == "mlp"


def test_first_step_wrap_emits_plan_built(tmp_path):
    sink = tmp_path / "first.jsonl"
    _telemetry.enable(str(sink))
    model = mlp()
    memscale.wrap(model, memscale.Config(mode="conservative", force_optimize=True))
    model(torch.randn(4, 32)).sum().backward()
    memscale.detach(model)
    wrap_called, plan_built = events(sink)
    assert wrap_called["planned"] is False and wrap_called["profiling"] == "first_step"
    assert plan_built["profiling"] == "static"
    assert plan_built["event"] == "plan_built" and plan_built["planned"] is True
    assert plan_built["techniques"] == ["checkpoint"] and plan_built["arch_class"] == "mlp"


def test_payload_holds_nothing_identifying(tmp_path, monkeypatch):
    secret_dir = tmp_path / "user-secret-project"
    secret_dir.mkdir()
    sink = secret_dir / "telemetry.jsonl"
    monkeypatch.chdir(secret_dir)
    _telemetry.enable(sink)
    model = AcmeSecretNet()
    x = torch.full((4, 16), 987.654321)
    memscale.wrap(
        model,
        memscale.Config(
            mode="conservative", force_optimize=True, log_file=str(secret_dir / "run.log")
        ),
        sample_input=x,
    )
    out = model(x)
    memscale.detach(model)
    text = sink.read_text()
    forbidden = {
        "paths": [
            str(tmp_path),
            str(secret_dir),
            "user-secret-project",
            "telemetry.jsonl",
            "run.log",
            str(Path.home()),
            os.getcwd(),
        ],
        "names": [
            "AcmeSecretNet",
            "zz_private_encoder",
            "Linear",
            "Sequential",
            "zz_private_encoder.0",
        ],
        "host and user": [socket.gethostname(), getpass.getuser()],
        "tensor values": ["987.65", "0.12345", f"{out.flatten()[0].item():.4f}"],
    }
    for what, needles in forbidden.items():
        for needle in needles:
            if len(needle) >= 3:  # a one-letter user name would match anything
                assert needle not in text, f"{what}: {needle!r} leaked into telemetry"
    (event,) = events(sink)
    _telemetry.validate(event)
    # Every string value is from the schema's closed vocabularies.
    for key, value in event.items():
        allowed = _telemetry.SCHEMA[key]
        if isinstance(allowed, tuple):
            assert value in allowed, key


def test_validate_rejects_anything_outside_the_schema(tmp_path):
    sink = tmp_path / "v.jsonl"
    _telemetry.enable(sink)
    model = mlp()
    memscale.wrap(model, FORCE, sample_input=torch.randn(4, 32))
    event = events(sink)[0]
    memscale.detach(model)
    for bad in (
        {**event, "model_name": "gpt2"},
        {**event, "arch_class": "/home/me/model.py"},
        {**event, "techniques": ["checkpoint", "secret"]},
        {**event, "torch_version": "2.13 on my-laptop"},
        {k: v for k, v in event.items() if k != "mode"},
        {**event, "planned": 1},
    ):
        with pytest.raises(ValueError):
            _telemetry.validate(bad)
        assert _telemetry.emit(bad) is False
    assert len(events(sink)) == 1


@pytest.mark.parametrize("breakage", ["directory", "write", "event"])
def test_a_failing_sink_never_breaks_wrap(tmp_path, monkeypatch, caplog, breakage):
    if breakage == "directory":
        _telemetry.enable(tmp_path)  # a directory: open() raises IsADirectoryError
    else:
        _telemetry.enable(tmp_path / "t.jsonl")

        def boom(*args, **kwargs):
            raise RuntimeError("sink exploded")

        monkeypatch.setattr(_telemetry, "_write" if breakage == "write" else "_event", boom)
    model = mlp()
    x = torch.randn(4, 32)
    with caplog.at_level(logging.WARNING, logger="memscale"):
        memscale.wrap(model, FORCE, sample_input=x)
    assert model._memscale_executor.plan.technique_counts["checkpoint"] == 4
    model(x).sum().backward()
    assert "telemetry: an event was dropped" in caplog.text
    memscale.detach(model)
    assert hook_count(model) == 0


def test_never_opens_a_network_socket(tmp_path, monkeypatch):
    """With telemetry on, wrap and detach create no socket at all."""
    _telemetry.enable(tmp_path / "n.jsonl")
    created = []
    real = socket.socket

    class Spy(real):
        def __init__(self, *args, **kwargs):
            created.append(args)
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(socket, "socket", Spy)
    model = mlp()
    memscale.wrap(model, FORCE, sample_input=torch.randn(4, 32))
    memscale.detach(model)
    assert created == []
    assert len(events(tmp_path / "n.jsonl")) == 1
    source = Path(_telemetry.__file__).read_text()
    for module in ("socket", "urllib", "http", "requests"):
        assert f"import {module}" not in source


def test_enable_checks_its_argument():
    with pytest.raises(TypeError, match="local file"):
        _telemetry.enable("")
    with pytest.raises(TypeError):
        _telemetry.enable(None)


def test_a_symlink_at_the_path_is_refused(tmp_path, caplog):
    """A link planted at the telemetry path must not redirect the writes
    (issue 20): the event is dropped with a warning, the target untouched."""
    target = tmp_path / "victim"
    target.write_text("precious\n")
    os.chmod(target, 0o644)
    link = tmp_path / "t.jsonl"
    link.symlink_to(target)
    _telemetry.enable(link)
    model = mlp()
    x = torch.randn(4, 32)
    with caplog.at_level(logging.WARNING, logger="memscale"):
        memscale.wrap(model, FORCE, sample_input=x)
    memscale.detach(model)
    assert target.read_text() == "precious\n"
    assert link.is_symlink()
    assert "is a symbolic link" in caplog.text
    assert "point it at a regular file" in caplog.text


def test_a_new_file_is_private(tmp_path):
    sink = tmp_path / "t.jsonl"
    _telemetry.enable(sink)
    old = os.umask(0o022)
    try:
        model = mlp()
        memscale.wrap(model, FORCE, sample_input=torch.randn(4, 32))
        memscale.detach(model)
    finally:
        os.umask(old)
    assert stat.S_IMODE(sink.stat().st_mode) == 0o600
    assert len(events(sink)) == 1


def test_a_fifo_at_the_path_is_refused(tmp_path, caplog):
    """Only a regular file takes events (a FIFO without a reader would block
    wrap forever; one with a reader would send events to another process)."""
    fifo = tmp_path / "t.jsonl"
    os.mkfifo(fifo)
    reader = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)
    try:
        _telemetry.enable(fifo)
        model = mlp()
        with caplog.at_level(logging.WARNING, logger="memscale"):
            memscale.wrap(model, FORCE, sample_input=torch.randn(4, 32))
        memscale.detach(model)
        assert os.read(reader, 4096) == b""  # nothing was written
    finally:
        os.close(reader)
    assert "is not a regular file" in caplog.text
