"""A new user's first commands against the real daemon: every subcommand finds the socket from
the same config file (no ``--socket``), ``status`` prints numbers a person reads, ``health``
shows the daemon's limits, ``accepted.waiting`` says why a request waits, and ``cancel`` ends
its reply with ``cancel_done``."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import yaml

from tests.fixtures_service import ROOT, service_config


def _cli(*args: str, cwd=ROOT, env=None, timeout: float = 120.0) -> subprocess.CompletedProcess:
    e = dict(os.environ)
    e.pop("CHATTTS_APPLIANCE_CONFIG", None)
    e["PYTHONPATH"] = str(ROOT)
    e.update(env or {})
    return subprocess.run([sys.executable, "-m", "appliance", *args], cwd=str(cwd), env=e,
                          capture_output=True, text=True, timeout=timeout)


def test_every_client_finds_the_socket_from_the_local_config(tiny_ckpt, tmp_path, start_daemon):
    cfg = service_config(tiny_ckpt, tmp_path, synthesis={"max_new_tokens": 60})
    d = start_daemon(cfg)
    # where a user meets the tiny checkpoint's small vocabulary: the daemon's random-weights warning
    assert "RANDOM weights" in d.log() and "knows only 336 common Chinese characters" in d.log()
    work = tmp_path / "checkout"          # a directory with config.local.yaml, as after quickstart
    work.mkdir()
    (work / "config.local.yaml").write_text(yaml.safe_dump(cfg))
    (work / "config.yaml").write_text(yaml.safe_dump({"service": {"socket": str(tmp_path / "not-here.sock")}}))

    r = _cli("status", cwd=work)
    assert r.returncode == 0, r.stderr
    # no request yet: numbers the daemon does not have are n/a, never "None"
    assert "last RTF n/a, last TTFB n/a" in r.stdout and "None" not in r.stdout, r.stdout

    r = _cli("say", "--seed", "3", "Found by the config.", cwd=work)
    assert r.returncode == 0 and "done" in r.stdout, (r.stdout, r.stderr)

    r = _cli("status", cwd=work)
    line = r.stdout.splitlines()[0]
    rtf = line.split("last RTF ")[1].split(",")[0]
    assert len(rtf.split(".")[1]) == 3, line                     # 0.131, not 0.13054268864776045
    assert line.split("last TTFB ")[1].split(",")[0].endswith(" ms") and "None" not in r.stdout

    r = _cli("health", "--daemon", cwd=work)
    assert r.returncode in (0, 1), r.stderr
    assert "<= 1" in r.stdout and "<= 1500" in r.stdout, r.stdout    # the daemon's max_rtf and memory limit

    r = _cli("cancel", "--channel", "main", cwd=work)
    assert r.returncode == 1 and "nothing to cancel" in r.stderr

    # the environment variable wins over the files in the directory
    r = _cli("status", cwd=work, env={"CHATTTS_APPLIANCE_CONFIG": str(work / "config.yaml")})
    assert r.returncode == 2 and "not-here.sock" in r.stderr
    # and --config wins over everything
    r = _cli("status", "--config", str(d.config_path), cwd=work,
             env={"CHATTTS_APPLIANCE_CONFIG": str(work / "config.yaml")})
    assert r.returncode == 0 and "state ready" in r.stdout


def test_health_socket_shows_the_daemons_limits(tiny_ckpt, tmp_path, start_daemon):
    d = start_daemon(service_config(tiny_ckpt, tmp_path, health={"max_rtf": 50.0, "max_ttfb_ms": 90000.0}))
    r = _cli("health", "--socket", str(d.socket), "--config", str(tmp_path / "no-such.yaml"))
    assert r.returncode in (0, 1), r.stderr
    assert "<= 50" in r.stdout and "<= 90000" in r.stdout and "not checked" in r.stdout, r.stdout
    r = _cli("health", "--socket", str(d.socket), "--json")
    ev = json.loads(r.stdout)
    assert ev["limits"] == {"max_rtf": 50.0, "max_ttfb_ms": 90000.0, "min_steps_per_s": 0.0, "max_memory_mib": 1500}


def test_waiting_reason_and_cancel_done(tiny_ckpt, tmp_path, start_daemon):
    d = start_daemon(service_config(tiny_ckpt, tmp_path, synthesis={"max_new_tokens": 400, "min_new_tokens": 400}))
    a, b = d.connect(), d.connect()
    try:
        a.send({"text": "你好", "id": "first", "seed": 1})
        a.events(("started",))
        b.send({"text": "你好", "id": "second", "seed": 2})
        (acc,) = b.events(("accepted",))
        assert acc["queue_position"] == 0
        assert acc["waiting"] == "channel 'main' is busy with request first", acc
        b.send({"text": "你好", "id": "third", "seed": 3})
        (acc,) = b.events(("accepted",))
        assert acc["queue_position"] == 1
        assert acc["waiting"] == "channel 'main' is busy with request first and 1 queued before it", acc

        c = d.connect()
        try:
            c.send({"type": "cancel", "channel": "main"})
            evs = c.events(("cancel_done",))
        finally:
            c.close()
        assert [e["type"] for e in evs] == ["error", "error", "error", "cancel_done"], evs
        assert {e["id"] for e in evs[:3]} == {"first", "second", "third"} and {e["code"] for e in evs[:3]} == {"cancelled"}
        done = evs[-1]
        assert done["cancelled"] == 3 and sorted(done["ids"]) == ["first", "second", "third"]
        assert done["channel"] == "main" and done["id"] is None
        _, ends = a.events_until_ids({"first"})
        assert ends["first"]["code"] == "cancelled"

        # the canceller's own request: no second 'cancelled', just the end marker
        a.send({"text": "你好", "id": "own", "seed": 4})
        a.events(("started",))
        a.send({"type": "cancel", "id": "own"})
        evs = a.events(("cancel_done",))
        assert evs[-1]["cancelled"] == 1 and evs[-1]["ids"] == ["own"]
        assert sum(1 for e in evs if e.get("code") == "cancelled") <= 1
    finally:
        a.close()
        b.close()


def test_third_party_noise_is_quiet_without_verbose():
    """The ONNX exporter's INFO lines, torch's own warnings and Python warnings from inside torch
    are not shown to a user (they look like failures); ``--verbose`` keeps them."""
    code = (
        "import logging, warnings\n"
        "from appliance.ops.logsetup import setup_logging\n"
        "import sys; setup_logging(verbose=sys.argv[1] == 'v')\n"
        "import torch\n"
        "logging.getLogger('onnxscript.optimizer._constant_folding').info('Skipping constant folding')\n"
        "logging.getLogger('torch.onnx._internal.exporter._registration').warning('torchvision is not installed')\n"
        "warnings.warn_explicit('deprecated thing', FutureWarning, 'copyreg.py', 105, module='copyreg')\n"
        "logging.getLogger('appliance.build.export').info('exported gpt')\n"
        "logging.getLogger('appliance.x').info('done', extra={'rtf': 0.2659693373526134, 'steps': 531})\n"
    )
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    env.pop("TORCH_LOGS", None)
    quiet = subprocess.run([sys.executable, "-c", code, "q"], capture_output=True, text=True, env=env, timeout=120)
    assert "exported gpt" in quiet.stderr, quiet.stderr
    assert "done [rtf=0.266 steps=531]" in quiet.stderr, quiet.stderr          # fields readable, not 0.2659693373526134
    for noise in ("Skipping constant folding", "torchvision", "deprecated thing"):
        assert noise not in quiet.stderr, quiet.stderr
    loud = subprocess.run([sys.executable, "-c", code, "v"], capture_output=True, text=True, env=env, timeout=120)
    for noise in ("Skipping constant folding", "torchvision", "deprecated thing"):
        assert noise in loud.stderr, loud.stderr


def test_a_config_copied_away_from_its_paths_fails_before_it_creates_anything(tmp_path):
    """Relative paths are relative to the config file: a copy of ``config.local.yaml`` elsewhere
    (as a user makes to turn Wyoming on) names the missing checkpoint, exits 2, and leaves no
    socket, spool, WAV or cache directory behind."""
    away = tmp_path / "away"
    away.mkdir()
    (away / "wy.yaml").write_text((ROOT / "config.local.yaml").read_text())
    r = _cli("serve", "--config", str(away / "wy.yaml"), cwd=away)
    assert r.returncode == 2 and "holds no ChatTTS checkpoint" in r.stderr, r.stderr
    assert str(away / "models") in r.stderr, r.stderr
    assert sorted(p.name for p in away.iterdir()) == ["wy.yaml"]
