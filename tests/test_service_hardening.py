"""Hardening of the daemon's edges: directories from config are created only where that is safe,
socket clients are rate limited and logged with their kernel-checked credentials, and secrets
never reach the log or an error message. Real daemon, real socket."""

from __future__ import annotations

import os
import re
import uuid
from pathlib import Path

import pytest

from appliance.config import config_from_dict
from appliance.errors import ConfigError, RateLimitError
from appliance.daemon.paths import ensure_dir
from appliance.service.peers import Peer, RateLimiter
from tests.fixtures_service import launch_daemon, service_config

SECRET = "S3cr3t-" + uuid.uuid4().hex[:8]


def test_missing_directories_are_created_only_where_safe(tmp_path):
    roots = [tmp_path / "base"]
    assert ensure_dir("k", tmp_path / "base" / "a" / "b", roots).is_dir()          # under the config dir
    assert ensure_dir("k", tmp_path / "elsewhere" / "c", []).is_dir()             # below a non-system dir
    typo = Path(f"/run/chattts-applaince-{uuid.uuid4().hex[:6]}")
    with pytest.raises(ConfigError, match="service.socket: directory .* is not created here"):
        ensure_dir("service.socket", typo, [])
    assert not typo.exists()
    with pytest.raises(ConfigError, match="is not created here"):
        ensure_dir("k", Path(f"/etc/x-{uuid.uuid4().hex[:6]}"), [])
    assert ensure_dir("k", typo, [typo]).is_dir()                                 # e.g. $RUNTIME_DIRECTORY
    typo.rmdir()
    (tmp_path / "file").write_text("x")
    with pytest.raises(ConfigError, match="not a directory"):
        ensure_dir("audio.wav_dir", tmp_path / "file", [])


def test_a_socket_under_a_missing_system_directory_refuses_to_start(tiny_ckpt, tmp_path):
    typo = Path(f"/run/chattts-applaince-{uuid.uuid4().hex[:6]}")
    cfg = service_config(tiny_ckpt, tmp_path, service={"socket": str(typo / "appliance.sock")})
    d = launch_daemon(tmp_path / "d", cfg, wait=False)
    assert d.proc.wait(120) == 2, d.log()[-3000:]
    assert f"service.socket: directory {typo} does not exist and is not created here" in d.log()
    assert not typo.exists()


def test_rate_limiter_is_a_token_bucket_per_client_process():
    rl = RateLimiter(rate=2.0, burst=3)
    a, b = Peer("#1", pid=100, uid=0, gid=0), Peer("#2", pid=100, uid=0, gid=0)   # same process, 2 connections
    for _ in range(3):
        rl.check(a, now=10.0)
    with pytest.raises(RateLimitError, match="retry in 0.5 s") as e:
        rl.check(b, now=10.0)
    assert e.value.code == "rate_limited"
    rl.check(Peer("#3", pid=101), now=10.0)             # another process has its own bucket
    rl.check(a, now=10.5)                               # one token back after 0.5 s at 2/s
    RateLimiter(rate=0, burst=1).check(a)               # 0 = off


def test_secret_values_stay_out_of_error_messages():
    with pytest.raises(ConfigError) as e:
        config_from_dict({"mqtt": {"password": 1234.56789}})        # a float is no password: refused
    assert "1234.56789" not in str(e.value) and "mqtt.password" in str(e.value)


def test_daemon_logs_peer_credentials_limits_rate_and_never_logs_secrets(tiny_ckpt, tmp_path):
    cfg = service_config(tiny_ckpt, tmp_path, safety={"max_requests_per_s": 0.5, "request_burst": 2},
                         synthesis={"max_new_tokens": 20},
                         mqtt={"enabled": True, "host": "127.0.0.1", "port": 9, "username": "u", "password": SECRET})
    d = launch_daemon(tmp_path / "d", cfg)
    try:
        c = d.connect()
        codes = []
        for i in range(3):
            c.send({"type": "speak", "text": "你好", "seed": i, "id": f"rl{i}"})
            codes.append(c.events(("done", "error"))[-1].get("code", "done"))
        c.send({"type": "status"})                      # not rate limited
        assert c.events(("status",))[-1]["type"] == "status"
        c.close()
        assert codes == ["done", "done", "rate_limited"], codes
        log = d.log()
        me = f"(pid {os.getpid()}, uid {os.getuid()}, gid {os.getgid()})"
        assert re.search(rf"request rl0 from client #\d+ {re.escape(me)}", log), log[-2000:]
        assert re.search(r"refused: client #\d+ \(pid", log) and "safety.max_requests_per_s" in log
    finally:
        assert d.stop() == 0
    assert SECRET not in d.log()                        # -v: debug logging was on
