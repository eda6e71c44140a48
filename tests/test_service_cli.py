"""WAV output, the ``say`` client end to end, socket activation, a missing sound device, and
the drain on SIGTERM – all against the real daemon subprocess."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys

import numpy as np
import pytest

from appliance.audio.wav import read_wav
from tests.fixtures_service import ROOT, alsa_home, expected_pcm, service_config


def _say(*args: str, timeout: float = 60.0) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "appliance", "say", *args], cwd=str(ROOT),
                          capture_output=True, text=True, timeout=timeout)


def test_wav_output_and_say_cli(tiny_ckpt, tmp_path, start_daemon, service_pipeline):
    cfg = service_config(tiny_ckpt, tmp_path)                       # audio.output: wav
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)       # a crashed daemon's socket file
    (tmp_path / "run").mkdir()
    stale.bind(cfg["service"]["socket"])
    stale.close()
    d = start_daemon(cfg)
    assert "removing stale socket" in d.log()
    text, seed = "Written to a file.", 21
    want = expected_pcm(service_pipeline, text, seed)

    # say, human output, audio returned over the socket into --wav
    r = _say("--socket", str(d.socket), "--seed", str(seed), "--wav", str(tmp_path / "said.wav"), text)
    assert r.returncode == 0, r.stderr
    assert "accepted" in r.stdout and "started" in r.stdout
    assert "TTFB" in r.stdout and "RTF" in r.stdout and " ms" in r.stdout
    got, rate = read_wav(tmp_path / "said.wav")
    assert rate == 24000 and len(got) == len(want)
    assert np.abs(got - np.clip(want, -1, 1)).max() <= 1.0 / 32767 + 1e-6

    # the daemon wrote its own WAV file named after the request id
    r = _say("--config", str(d.config_path), "--seed", str(seed), "--json", text)
    assert r.returncode == 0, r.stderr
    evs = [json.loads(line) for line in r.stdout.splitlines()]
    assert [e["type"] for e in evs] == ["accepted", "started", "done"]
    done = evs[-1]
    assert done["output"] == str(d.wav_dir / f"{done['id']}.wav") and done["seed"] == seed
    got, rate = read_wav(done["output"])
    assert rate == 24000 and len(got) == len(want)
    assert np.abs(got - np.clip(want, -1, 1)).max() <= 1.0 / 32767 + 1e-6

    # an error event: exit 1, message on stderr
    r = _say("--socket", str(d.socket), "。。。")
    assert r.returncode == 1 and "bad_text" in r.stderr

    # a second daemon on the same socket refuses to start, before loading the model, and
    # leaves the first one's socket alone
    r = subprocess.run([sys.executable, "-m", "appliance", "serve", "--config", str(d.config_path)], cwd=str(ROOT),
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "another daemon is listening" in r.stderr
    assert "pipeline loaded" not in r.stderr and d.socket.exists()

    # a path-like request id stays inside wav_dir
    evs = d.request({"type": "speak", "text": "Safe name.", "id": "../../escape"})
    assert evs[-1]["type"] == "done", evs
    assert os.path.dirname(evs[-1]["output"]) == str(d.wav_dir)


def test_say_without_daemon_exits_2_and_says_how_to_start_it(tmp_path):
    r = _say("--socket", str(tmp_path / "nobody.sock"), "hello")
    assert r.returncode == 2
    assert "not reachable" in r.stderr and "chattts-appliance serve" in r.stderr


def test_missing_sound_device_completes_to_wav(tiny_ckpt, tmp_path, start_daemon):
    alsa = alsa_home(tmp_path / "home", tmp_path / "played.raw")
    cfg = service_config(tiny_ckpt, tmp_path, audio={"output": "device", "device": "no-such-card"})
    d = start_daemon(cfg, alsa=alsa)
    (st,) = d.request({"type": "status"})
    main = st["channels"]["main"]
    assert main["ok"] is False and "no-such-card" in main["error"] and main["output"] != "device"
    evs = d.request({"type": "speak", "text": "Where did the speaker go?", "seed": 3, "id": "nodev"})
    assert evs[-1]["type"] == "done", evs
    assert evs[-1]["output"] == str(d.wav_dir / "nodev.wav")
    assert read_wav(evs[-1]["output"])[0].size > 0
    assert "no-such-card" in d.log()


def test_socket_activation_uses_the_inherited_socket(tiny_ckpt, tmp_path, start_daemon):
    path = tmp_path / "activated.sock"
    lst = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    lst.bind(str(path))
    lst.listen(8)
    ino = os.stat(path).st_ino
    cfg = service_config(tiny_ckpt, tmp_path, service={"socket": str(path)}, stream={"sample_format": "int16"},
                         health={"at_start": True})
    fd = lst.fileno()
    # what systemd does: the socket at fd 3, LISTEN_FDS=1, LISTEN_PID = the daemon's own pid
    wrapper = [sys.executable, "-c", f"import os, sys; os.dup2({fd}, 3); os.environ.update(LISTEN_FDS='1', "
               "LISTEN_PID=str(os.getpid())); os.execv(sys.argv[1], sys.argv[1:])"]
    d = start_daemon(cfg, argv_prefix=wrapper, pass_fds=(fd,))
    lst.close()
    evs = d.request({"type": "speak", "text": "Activated.", "seed": 5, "return_audio": True})
    assert evs[-1]["type"] == "done", evs
    audio = [e for e in evs if e["type"] == "audio"]       # stream.sample_format: int16 payloads
    assert audio and all(e["format"] == "int16" and e["rate"] == 24000 and len(e["_payload"]) == e["bytes"]
                         for e in audio)
    pcm = np.frombuffer(b"".join(e["_payload"] for e in audio), "<i2")
    assert abs(len(pcm) - evs[-1]["audio_s"] * 24000) <= 13 and np.abs(pcm).max() > 0   # audio_s has 3 decimals
    assert os.stat(path).st_ino == ino          # the daemon did not bind a socket of its own
    (h,) = d.request({"type": "health"}, until=("health", "error"))
    assert h["type"] == "health" and h["rtf"] > 0 and h["steps_per_s"] > 0, h
    assert "health ok" in d.log() or "health UNHEALTHY" in d.log()     # health.at_start ran too
    assert "passed by systemd" in d.log()


def test_sigterm_drains_the_running_request_and_exits_0(tiny_ckpt, tmp_path, start_daemon):
    alsa = alsa_home(tmp_path / "home", tmp_path / "played.raw")
    d = start_daemon(service_config(tiny_ckpt, tmp_path, audio={"output": "device"}), alsa=alsa)
    s = d.connect()
    long = {"max_new_tokens": 150}     # up to 3.2 s of audio to play out
    s.send({"type": "speak", "text": "Finish me before you go.", "seed": 8, "id": "drain-1", "params": long})
    s.send({"type": "speak", "text": "I was queued.", "seed": 9, "id": "drain-2"})
    s.events_until_ids({"drain-1", "drain-2"}, ("accepted",))
    d.proc.send_signal(signal.SIGTERM)
    evs, ends = s.events_until_ids({"drain-1", "drain-2"})
    s.close()
    # drain-2 is normally still queued at SIGTERM and spooled for the next start (see
    # test_service_spool.py); if it had already started, it drains too
    started2 = any(e["type"] == "started" and e["id"] == "drain-2" for e in evs)
    if started2:
        assert ends["drain-2"]["type"] == "done", evs
    else:
        assert ends["drain-2"]["type"] == "error" and ends["drain-2"]["code"] == "spooled", evs
    assert ends["drain-1"]["type"] == "done" and ends["drain-1"]["output"].startswith("device:")
    d.returncode = d.proc.wait(30)
    assert d.returncode == 0
    assert not d.socket.exists()
    log = d.log()
    assert "SIGTERM: stopping" in log and "stopped" in log


@pytest.mark.parametrize("bad", [{"audio": {"output": "speakers"}}, {"service": {"socket_mode": 0o1777}}])
def test_bad_config_fails_before_loading_anything(tmp_path, bad):
    import yaml

    cfg = tmp_path / "bad.yaml"
    cfg.write_text(yaml.safe_dump(bad))
    r = subprocess.run([sys.executable, "-m", "appliance", "serve", "--config", str(cfg)], cwd=str(ROOT),
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2
    key = "audio.output" if "audio" in bad else "service.socket_mode"
    assert key in r.stderr and "Traceback" not in r.stderr


def test_sigterm_during_start_up_exits_0(tiny_ckpt, tmp_path, start_daemon, notify_socket):
    d = start_daemon(service_config(tiny_ckpt, tmp_path), wait=False)   # NOTIFY_SOCKET: it says what it does
    msg = notify_socket.wait_for("STATUS", timeout=60)
    assert msg.fields["STATUS"] == "loading the model", msg.raw
    d.proc.send_signal(signal.SIGTERM)
    d.returncode = d.proc.wait(60)
    assert d.returncode == 0, d.log()[-3000:]
    assert "during start-up" in d.log() or "SIGTERM: stopping" in d.log()
    assert not d.socket.exists()


def _walk(parser, path=("chattts-appliance",)):
    """(command path, parser) for the parser and every sub-command below it."""
    import argparse
    yield path, parser
    for a in parser._actions:
        if isinstance(a, argparse._SubParsersAction):
            helps = {c.dest: c.help for c in a._choices_actions}
            for name, p in a.choices.items():
                assert helps.get(name), f"{' '.join(path)} {name}: the sub-command has no help line"
                yield from _walk(p, path + (name,))


def test_every_option_has_a_help_line():
    import argparse

    from appliance.cli.main import build_parser
    seen = 0
    for path, p in _walk(build_parser()):
        for a in p._actions:
            if isinstance(a, (argparse._HelpAction, argparse._SubParsersAction)):
                continue
            seen += 1
            assert a.help and a.help != argparse.SUPPRESS, f"{' '.join(path)} {a.option_strings or a.dest}: no help"
    assert seen > 60


def test_version_and_verbose_after_the_sub_command(tmp_path):
    from appliance.cli.main import build_parser
    from appliance.core import version
    r = subprocess.run([sys.executable, "-m", "appliance", "--version"], cwd=str(ROOT), capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0 and r.stdout.strip() == f"chattts-appliance {version()}", r
    p = build_parser()
    assert p.parse_args(["serve", "-v"]).verbose and p.parse_args(["-v", "serve"]).verbose
    assert not p.parse_args(["serve"]).verbose
    assert p.parse_args(["engines", "export", "--verbose"]).verbose
    # the real command: -v after serve is taken (the missing config is what stops it)
    r = subprocess.run([sys.executable, "-m", "appliance", "serve", "-v", "--config", str(tmp_path / "none.yaml")],
                       cwd=str(ROOT), capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "cannot read config file" in r.stderr and "unrecognized" not in r.stderr, r.stderr


@pytest.mark.parametrize("cmd", ["say", "normalize"])
def test_text_that_is_not_utf8_gets_a_clear_error(tmp_path, cmd):
    """A command-line argument in another encoding (here Latin-1 'café') reaches Python as
    surrogate escapes; the client names the byte instead of 'connection failed'."""
    env = dict(os.environ, LANG="C.UTF-8", LC_ALL="C.UTF-8")
    r = subprocess.run([sys.executable, "-m", "appliance", cmd, "--socket", str(tmp_path / "none.sock"),
                        b"caf\xe9 au lait"], cwd=str(ROOT), capture_output=True, text=True, timeout=60, env=env)
    assert r.returncode == 1, r
    assert f"{cmd}: the text is not valid UTF-8 (byte 0xe9 at character 4)" in r.stderr, r.stderr
    assert "connection" not in r.stderr and "iconv" in r.stderr
