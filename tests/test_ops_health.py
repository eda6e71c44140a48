"""Field health check on the real pipeline with the random tiny checkpoint; the CLI in-process,
locally and against a socket that answers like the daemon."""

from __future__ import annotations

import dataclasses
import json
import os
import socket
import tempfile
import threading
import time

import pytest
import yaml

from appliance.cli.main import build_parser
from appliance.config import replace
from appliance.ops.health import (
    EXIT_ERROR,
    EXIT_HEALTHY,
    EXIT_UNHEALTHY,
    cli_main,
    run_health_check,
)


@pytest.fixture(scope="module")
def pipeline(tiny_config):
    from appliance.synth.pipeline import Pipeline

    p = Pipeline.from_config(tiny_config)
    p.warmup()
    yield p
    p.close()


def _with_health(cfg, **kw):
    return dataclasses.replace(cfg, health=replace(cfg.health, **kw))


def test_healthy_with_generous_thresholds(pipeline, tiny_config):
    cfg = _with_health(tiny_config, max_rtf=100.0, max_ttfb_ms=60_000.0, min_steps_per_s=1.0, max_memory_mib=100_000.0)
    r = run_health_check(pipeline, cfg)
    assert r.healthy, r.reasons
    assert r.reasons == []
    assert 0 < r.rtf < 100 and 0 < r.ttfb_ms < 60_000 and r.steps_per_s > 1
    assert r.memory_mib > 50                                   # this process's RSS, with torch loaded


def test_unhealthy_names_every_limit(pipeline, tiny_config):
    cfg = _with_health(tiny_config, max_rtf=1e-4, max_ttfb_ms=0.0, min_steps_per_s=1e6, max_memory_mib=1.0)
    r = run_health_check(pipeline, cfg)
    assert not r.healthy
    assert [x.split()[0] for x in r.reasons] == ["rtf", "ttfb", "steps/s", "memory"]
    assert "> max 0.00" in r.reasons[0] and "> max 1 MiB" in r.reasons[3]
    assert r.rtf is not None                                   # measurements still reported


def test_memory_limit_defaults_to_the_service_budget(pipeline, tiny_config):
    cfg = _with_health(tiny_config, max_rtf=100.0, max_ttfb_ms=60_000.0)
    cfg = dataclasses.replace(cfg, service=replace(cfg.service, memory_budget_mb=64))
    r = run_health_check(pipeline, cfg)
    assert r.reasons == [f"memory {r.memory_mib:.0f} MiB > max 64 MiB"]


def test_pipeline_error_is_unhealthy_with_its_code(pipeline, tiny_config):
    # "。。。" passes the config's check (not blank) but leaves nothing to say: the pipeline refuses it
    r = run_health_check(pipeline, _with_health(tiny_config, sentence="。。。"))
    assert not r.healthy and r.rtf is None
    assert r.reasons[0].startswith("bad_text: ")


class _SlowConsumer:
    """The real pipeline, with a slow reader of its chunks (like a stalled run)."""

    def __init__(self, p):
        self.p = p

    def prepare(self, speak):
        return self.p.prepare(speak)

    def run(self, job, cancel, **kw):
        return _Slowly(self.p.run(job, cancel, **kw))


class _Slowly:
    """The real run, its chunks taken slowly; its report is the run's."""

    def __init__(self, run):
        self._run = run

    @property
    def report(self):
        return self._run.report

    def __iter__(self):
        for pcm in self._run:
            time.sleep(0.6)
            yield pcm


def test_timeout_cancels_and_is_unhealthy(pipeline, tiny_config):
    cfg = _with_health(tiny_config, timeout_s=1.0)
    t = time.monotonic()
    r = run_health_check(_SlowConsumer(pipeline), cfg)
    assert not r.healthy and r.reasons[0].startswith("timeout")
    assert time.monotonic() - t < 10


@pytest.fixture
def config_file(tiny_config, tmp_path):
    def write(**health):
        data = {"model": {"path": str(tiny_config.resolve(tiny_config.model.path)), "backend": "torch",
                          "device": "cpu", "dtype": "float32", "threads": 1, "max_batch": 3,
                          "max_seq_len": 512, "max_prompt_tokens": 128},
                "health": {"max_rtf": 100.0, "max_ttfb_ms": 60000.0, "max_memory_mib": 100000.0, **health}}
        p = tmp_path / f"config-{len(list(tmp_path.iterdir()))}.yaml"
        p.write_text(yaml.safe_dump(data, allow_unicode=True))
        return str(p)
    return write


def _args(*argv):
    return build_parser().parse_args(["health", *argv])


def test_cli_local_json_and_table(config_file, capsys):
    assert cli_main(_args("--config", config_file(), "--json")) == EXIT_HEALTHY
    out = json.loads(capsys.readouterr().out)
    assert out["type"] == "health" and out["healthy"] is True and out["rtf"] > 0
    assert cli_main(_args("--config", config_file(max_rtf=1e-4))) == EXIT_UNHEALTHY
    text = capsys.readouterr().out
    assert "DEGRADED" in text and "rtf (degraded" in text and "RTF" in text   # slower than its limit: degraded


def test_cli_errors_exit_2(tmp_path, capsys):
    assert cli_main(_args("--config", str(tmp_path / "missing.yaml"))) == EXIT_ERROR
    assert "cannot read config file" in capsys.readouterr().err
    assert cli_main(_args("--socket", str(tmp_path / "no.sock"), "--config", str(tmp_path / "none.yaml"))) == EXIT_ERROR
    assert "is chattts-appliance running" in capsys.readouterr().err


def _answer_once(reply: bytes):
    """A UNIX socket that reads one request line and answers it (as the daemon would)."""
    d = tempfile.mkdtemp(prefix="hc", dir="/tmp")
    path = os.path.join(d, "s.sock")
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(path)
    srv.listen(1)
    got = []

    def serve():
        conn, _ = srv.accept()
        with conn:
            got.append(conn.makefile("rb").readline())
            conn.sendall(b'{"type":"accepted","id":"x","channel":"main"}\n' + reply)
        srv.close()

    th = threading.Thread(target=serve, daemon=True)
    th.start()
    return path, got, th


def test_cli_asks_the_daemon(capsys):
    path, got, th = _answer_once(b'{"type":"health","healthy":false,"rtf":1.5,"ttfb_ms":200.0,'
                                 b'"steps_per_s":30.0,"memory_mib":900.0,"reasons":["rtf 1.50 > max 1.00"]}\n')
    assert cli_main(_args("--socket", path, "--json", "--config", "/nonexistent.yaml")) == EXIT_UNHEALTHY
    th.join(5)
    assert json.loads(got[0]) == {"type": "health"}
    assert json.loads(capsys.readouterr().out)["reasons"] == ["rtf 1.50 > max 1.00"]
    path, got, th = _answer_once(b'{"type":"error","code":"bad_request","message":"not served"}\n')
    assert cli_main(_args("--socket", path)) == EXIT_ERROR
    th.join(5)
    assert "bad_request: not served" in capsys.readouterr().err
