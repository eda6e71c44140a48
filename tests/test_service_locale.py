"""Any locale: the daemon and the command line under ``en_US.ISO-8859-1`` (generated with
``localedef`` into a private ``LOCPATH``) and ``C``, with a non-ASCII WAV directory and text;
``PYTHONUTF8=0`` with a path the locale cannot represent is one error, exit 2; a closed standard
output is no traceback. Real daemon, real client processes."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from tests.fixtures_service import ROOT, launch_daemon, service_config


@pytest.fixture(scope="module")
def latin1(tmp_path_factory) -> dict:
    """The environment of a Latin-1 locale (skipped where localedef cannot make one)."""
    loc = tmp_path_factory.mktemp("locale")
    if shutil.which("localedef") is None:
        pytest.skip("localedef not installed")
    r = subprocess.run(["localedef", "-i", "en_US", "-f", "ISO-8859-1", str(loc / "en_US.ISO-8859-1")],
                       capture_output=True)
    if not (loc / "en_US.ISO-8859-1").exists():
        pytest.skip(f"localedef could not make en_US.ISO-8859-1: {r.stderr[-300:]!r}")
    return {"LOCPATH": str(loc), "LC_ALL": "en_US.ISO-8859-1", "LANG": "en_US.ISO-8859-1", "PYTHONUTF8": ""}


def _env(extra: dict) -> dict:
    e = dict(os.environ)
    e.pop("PYTHONUTF8", None)
    e.update(extra)
    return e


def _cli(args: list, env: dict, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "appliance", *args], cwd=str(ROOT), env=_env(env),
                          capture_output=True, timeout=300, **kw)


@pytest.mark.parametrize("which", ["latin1", "C"])
def test_daemon_and_cli_speak_a_non_ascii_path_and_text_in_any_locale(tiny_ckpt, tmp_path, latin1, which):
    env = latin1 if which == "latin1" else {"LC_ALL": "C", "LANG": "C", "PYTHONUTF8": ""}
    wav = tmp_path / "声音 wäv"
    cfg = service_config(tiny_ckpt, tmp_path, audio={"output": "wav", "wav_dir": str(wav)})
    cfg["voices"] = [{"name": "default", "voice": None, "description": ""},
                     {"name": "温柔", "voice": "seed:7", "description": "a voice named in Chinese"}]
    d = launch_daemon(tmp_path / "d", cfg, env=env)
    try:
        r = _cli(["say", "--socket", str(d.socket), "--json", "--voice", "温柔", "咖啡 café。"], env)
        assert r.returncode == 0, r.stderr.decode(errors="replace")
        done = json.loads(r.stdout.splitlines()[-1])
        assert done["type"] == "done" and done["audio_s"] > 0 and done["voice"] == "温柔", done
        spoken = " ".join(done["spoken"])
        assert "cafe" in spoken and "Ã" not in spoken, spoken           # é read as é (mojibake: Ã©)
        assert list(wav.glob("*.wav")), list(tmp_path.iterdir())
        # text bytes that are not UTF-8 (a terminal really in Latin-1) are read in the locale's encoding
        if which == "latin1":
            r = subprocess.run([os.fsencode(sys.executable), b"-m", b"appliance", b"normalize", b"--socket",
                                os.fsencode(str(d.socket)), b"--json", b"caf\xe9 au lait."],
                               cwd=str(ROOT), env=_env(env), capture_output=True, timeout=120)
            assert r.returncode == 0, r.stderr.decode(errors="replace")
            out = r.stdout.decode("utf-8")
            assert "cafe au lait" in out and "Ã" not in out and "\\udce9" not in out, out
        assert "Traceback" not in d.log()
    finally:
        assert d.stop() == 0, d.log()[-3000:]


def test_a_path_the_locale_cannot_represent_is_one_error_exit_2(tiny_ckpt, tmp_path, latin1):
    cfg = service_config(tiny_ckpt, tmp_path, audio={"output": "wav", "wav_dir": str(tmp_path / "声音")})
    d = launch_daemon(tmp_path / "d", cfg, env={**latin1, "PYTHONUTF8": "0"}, wait=False)
    assert d.proc.wait(120) == 2, d.log()[-3000:]
    log = d.log()
    assert "Traceback" not in log
    err = [x for x in log.splitlines() if "error" in x]
    assert len(err) == 1 and "audio.wav_dir" in err[0] and "PYTHONUTF8=1" in err[0], log[-2000:]


def test_status_into_a_closed_pipe_is_no_traceback(tiny_ckpt, tmp_path):
    d = launch_daemon(tmp_path / "d", service_config(tiny_ckpt, tmp_path))
    try:
        r, w = os.pipe()
        os.close(r)                                   # `status | head` once head has gone
        p = subprocess.run([sys.executable, "-m", "appliance", "status", "--socket", str(d.socket)],
                           cwd=str(ROOT), stdout=w, stderr=subprocess.PIPE, timeout=60)
        os.close(w)
        assert p.returncode == 141, p.stderr.decode(errors="replace")
        assert b"Traceback" not in p.stderr and b"BrokenPipe" not in p.stderr, p.stderr
    finally:
        assert d.stop() == 0, d.log()[-3000:]
