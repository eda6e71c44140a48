"""Fixtures: service (see conftest.py). Real parts only: the real daemon in a subprocess, a
real UNIX socket, real PortAudio/ALSA output into a file.

* :func:`alsa_home` / fixture ``alsa_file`` – a HOME whose ``.asoundrc`` makes ALSA's default
  PCM a ``file`` plugin over ``null`` piped through ``tests/asound/pacer.py`` (real-time
  clock), so every frame the daemon plays lands, raw float32 LE at the stream's rate, in
  ``AlsaFile.raw``. The daemon gets ``HOME`` pointed there (alsa-lib reads ``~/.asoundrc``).
* :func:`service_config` – a config dict for the tiny checkpoint (torch CPU, 1 thread) with the
  socket and WAV directory in a temp dir, no warm-up and no health check at start.
* fixture ``start_daemon`` – a factory that writes the config as YAML, starts
  ``python -m appliance serve --config <it>`` and waits until the socket accepts; at teardown
  each daemon still running gets SIGTERM and must exit 0.
* fixture ``service_pipeline`` – the same Pipeline in the test process, to compute the PCM the
  daemon should have played (same seed, voice, text => identical PCM).
"""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import numpy as np
import pytest

from appliance.core import SynthesisRequest

ROOT = Path(__file__).resolve().parent.parent
ASOUND = Path(__file__).resolve().parent / "asound"
DEFAULT_RATE = 44100
"""Rate ALSA's default PCM reports through PortAudio (the daemon's device rate in tests), Hz."""


# ---------------------------------------------------------------- ALSA file device


@dataclass
class AlsaFile:
    """A HOME with an ``.asoundrc`` whose default PCM writes raw float32 frames to ``raw``."""

    home: Path
    raw: Path

    def size(self) -> int:
        return self.raw.stat().st_size if self.raw.exists() else 0

    def read(self, offset_bytes: int = 0) -> np.ndarray:
        """The float32 samples played so far (from byte ``offset_bytes``, a multiple of 4)."""
        if not self.raw.exists():
            return np.zeros(0, np.float32)
        data = self.raw.read_bytes()[offset_bytes:]
        return np.frombuffer(data[: len(data) // 4 * 4], dtype="<f4")

    def pacers(self) -> list[int]:
        """Pids of the pacer processes writing this file (one per open PCM stream)."""
        pids = []
        for d in Path("/proc").iterdir():
            if d.name.isdigit():
                try:
                    cmd = (d / "cmdline").read_bytes().decode(errors="replace")
                except OSError:
                    continue
                if "pacer.py" in cmd and str(self.raw) in cmd:
                    pids.append(int(d.name))
        return pids

    def set_speed(self, factor: float) -> None:
        """Run the card's clock at ``factor`` x real time (1.0: back to real time), from the
        pacers' next read of 4096 bytes on (tests/asound/pacer.py). The stream keeps being called
        back, only less often: a test that needs "a request still sounding while others
        synthesize" slows the clock so that the sounding request outlasts the test's own timeout,
        instead of racing the synthesis on a loaded machine."""
        control = self.raw.with_name(self.raw.name + ".speed")
        if factor == 1.0:
            control.unlink(missing_ok=True)
            return
        tmp = control.with_name(control.name + ".tmp")
        tmp.write_text(f"{factor:g}\n")
        os.replace(tmp, control)

    def unplug(self) -> None:
        """The "card" goes away as a pulled USB speaker does: its ``.asoundrc`` entry disappears
        (renamed aside: ALSA and PortAudio no longer list it) and its pacers die (the open stream
        gets EPIPE). :meth:`replug` brings it back."""
        os.replace(self.home / ".asoundrc", self.home / ".asoundrc.unplugged")
        for pid in self.pacers():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def replug(self) -> None:
        """Undo :meth:`unplug`: the device is listed again (a fresh pacer starts when it opens)."""
        os.replace(self.home / ".asoundrc.unplugged", self.home / ".asoundrc")

    def wait_flushed(self, timeout_s: float = 30.0) -> int:
        """Wait until every pacer of this file has exited (its stream was closed, or the daemon
        died, and it wrote what was left in its pipe: the file is final); returns its size."""
        deadline = time.monotonic() + timeout_s
        for pid in self.pacers():     # each pacer's exit, as the kernel reports it (a pidfd turns readable)
            try:
                fd = os.pidfd_open(pid)
            except ProcessLookupError:
                continue
            try:
                ready, _, _ = select.select([fd], [], [], max(0.0, deadline - time.monotonic()))
            finally:
                os.close(fd)
            assert ready, f"the pacers of {self.raw} are still running after {timeout_s} s"
        return self.size()


def alsa_home(home: Path, raw: Path, rate: int = DEFAULT_RATE) -> AlsaFile:
    """Write ``home/.asoundrc`` from ``tests/asound/asoundrc.tmpl`` (float32 mono at ``rate`` Hz)."""
    home.mkdir(parents=True, exist_ok=True)
    text = (ASOUND / "asoundrc.tmpl").read_text()
    for k, v in {"@PYTHON@": sys.executable, "@PACER@": str(ASOUND / "pacer.py"),
                 "@BYTES_PER_S@": str(rate * 4), "@RAW@": str(raw)}.items():
        text = text.replace(k, v)
    (home / ".asoundrc").write_text(text)
    return AlsaFile(home=home, raw=raw)


@pytest.fixture
def alsa_file(tmp_path) -> AlsaFile:
    """A fresh ALSA file device (function scope)."""
    return alsa_home(tmp_path / "home", tmp_path / "played.raw")


# ---------------------------------------------------------------- config


def service_config(tiny_ckpt: Path, tmp: Path, **sections: dict) -> dict:
    """Config dict for a test daemon; ``sections`` update (shallowly) each top-level section."""
    cfg: dict[str, dict] = {
        "model": {"path": str(tiny_ckpt), "backend": "torch", "device": "cpu", "dtype": "float32",
                  "threads": 1, "max_batch": 3, "max_seq_len": 512, "max_prompt_tokens": 128},
        "synthesis": {"max_new_tokens": 200, "voice": "seed:2"},
        "audio": {"output": "wav", "wav_dir": str(tmp / "wav"), "latency_ms": 50.0},
        "service": {"socket": str(tmp / "run" / "appliance.sock"), "warmup": False, "max_text_chars": 300},
        # off in tests (it synthesizes its sentence twice at every start); the tests of the check at
        # start turn it on: test_service_cli (socket activation), test_ops_daemon_notify
        "health": {"at_start": False},
        # off in tests (a fresh engine dir would calibrate at every start); test_daemon_first_start
        # turns it on
        "stream": {"calibrate_at_start": False},
        # the RTF ladder off (its thresholds at their maximum): a test daemon's RTF is the host's
        # load (other suites on the same two cores), so a compute throttle would make every status,
        # health and channel-count assertion depend on it; the ladder's own tests set these
        "throttle": {"rtf_reduce": 100.0, "rtf_queue": 100.0},
    }
    for k, v in sections.items():
        cfg.setdefault(k, {}).update(v)
    return cfg


# ---------------------------------------------------------------- the daemon


@dataclass
class DaemonProc:
    """A running ``chattts-appliance serve`` subprocess."""

    proc: subprocess.Popen
    config: dict
    config_path: Path
    socket: Path
    log_path: Path
    wav_dir: Path
    alsa: Optional[AlsaFile] = None
    returncode: Optional[int] = field(default=None)

    def connect(self, timeout_s: float = 60.0) -> Conn:
        return Conn(self.socket, timeout_s)

    def request(self, obj: Any, timeout_s: float = 60.0, until: tuple = ("done", "error", "status")) -> list[dict]:
        """Send one line (a dict as JSON, or raw bytes without newline) and return the events up
        to the first whose type is in ``until`` (audio payloads stored under ``"_payload"``)."""
        c = self.connect(timeout_s)
        try:
            c.send(obj)
            return c.events(until)
        finally:
            c.close()

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def alive(self) -> bool:
        """The daemon process has not exited (``tests.waits.wait_log(d.log, ..., alive=d.alive)``)."""
        return self.proc.poll() is None

    def stop(self, timeout_s: float = 60.0) -> int:
        """SIGTERM and wait; returns the exit status."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            self.returncode = self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.returncode = self.proc.wait()
        return self.returncode


class Conn:
    """A test client connection that keeps its read buffer between calls."""

    def __init__(self, path: Path, timeout_s: float = 60.0) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(timeout_s)
        self.sock.connect(str(path))
        self.buf = bytearray()

    def send(self, obj: Any) -> None:
        """Send a dict as one JSON line, or raw bytes (a newline is added)."""
        line = obj if isinstance(obj, bytes) else json.dumps(obj, ensure_ascii=False).encode()
        self.sock.sendall(line + b"\n")

    def sendall(self, data: bytes) -> None:
        self.sock.sendall(data)

    def _fill(self) -> bool:
        data = self.sock.recv(65536)
        self.buf += data
        return bool(data)

    def events(self, until: tuple = ("done", "error", "status")) -> list[dict]:
        """Events up to the first whose type is in ``until`` (or EOF); audio payloads are stored
        under ``"_payload"``."""
        out: list[dict] = []
        while True:
            i = self.buf.find(b"\n")
            if i < 0:
                if not self._fill():
                    return out
                continue
            ev = json.loads(bytes(self.buf[:i]))
            del self.buf[:i + 1]
            if ev.get("type") == "audio":
                while len(self.buf) < ev["bytes"]:
                    if not self._fill():
                        raise ConnectionError("EOF inside an audio payload")
                ev["_payload"] = bytes(self.buf[:ev["bytes"]])
                del self.buf[:ev["bytes"]]
            out.append(ev)
            if ev.get("type") in until:
                return out

    def events_until_ids(self, ids: set, kinds: tuple = ("done", "error")) -> tuple[list[dict], dict]:
        """Read until every id in ``ids`` had an event of a type in ``kinds``; (all events, id -> that event)."""
        evs: list[dict] = []
        ends: dict = {}
        while not ids <= set(ends):
            new = self.events(kinds)
            if not new:
                raise ConnectionError(f"EOF before {ids - set(ends)} ended: {evs}")
            evs += new
            ends.update({e["id"]: e for e in new if e["type"] in kinds and e.get("id") in ids})
        return evs, ends

    def close(self) -> None:
        self.sock.close()


def _wait_socket(d: DaemonProc, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if d.proc.poll() is not None:
            raise RuntimeError(f"daemon exited with {d.proc.returncode} during start-up:\n{d.log()}")
        if d.socket.exists():
            try:
                d.connect(1.0).close()
                return
            except OSError:
                pass
        time.sleep(0.1)
    raise RuntimeError(f"daemon socket {d.socket} not accepting after {timeout_s} s:\n{d.log()}")


def launch_daemon(tmp: Path, config: dict, alsa: Optional[AlsaFile] = None, env: Optional[dict] = None,
                  argv_prefix: Optional[list] = None, pass_fds: tuple = (), wait: bool = True,
                  timeout_s: float = 120.0) -> DaemonProc:
    """Write ``config`` to ``tmp/config.yaml`` and start the daemon on it."""
    import yaml

    tmp.mkdir(parents=True, exist_ok=True)
    cfg_path = tmp / "config.yaml"
    cfg_path.write_text(yaml.safe_dump(config))
    e = dict(os.environ)
    e.pop("LISTEN_FDS", None)
    e.pop("LISTEN_PID", None)
    e["PYTHONUNBUFFERED"] = "1"
    if alsa is not None:
        e["HOME"] = str(alsa.home)
    e.update(env or {})
    log_path = tmp / "daemon.log"
    cmd = (argv_prefix or []) + [sys.executable, "-m", "appliance", "-v", "serve", "--config", str(cfg_path)]
    with open(log_path, "wb") as logf:
        proc = subprocess.Popen(cmd, cwd=str(ROOT), env=e, stdout=logf, stderr=subprocess.STDOUT,
                                pass_fds=pass_fds)
    d = DaemonProc(proc=proc, config=config, config_path=cfg_path, socket=Path(config["service"]["socket"]),
                   log_path=log_path, wav_dir=Path(config["audio"]["wav_dir"]), alsa=alsa)
    if wait:
        _wait_socket(d, timeout_s)
    return d


@pytest.fixture
def start_daemon(tmp_path):
    """Factory ``start_daemon(config, alsa=None, name="d", **kw) -> DaemonProc``; every daemon
    still running at teardown is stopped with SIGTERM and must exit 0."""
    started: list[DaemonProc] = []

    def start(config: dict, alsa: Optional[AlsaFile] = None, name: str = "d", **kw) -> DaemonProc:
        d = launch_daemon(tmp_path / name, config, alsa=alsa, **kw)
        started.append(d)
        return d

    yield start
    for d in started:
        if d.returncode is None:
            rc = d.stop()
            assert rc == 0, f"daemon exited with {rc}:\n{d.log()[-4000:]}"


@pytest.fixture(scope="session")
def service_pipeline(tiny_ckpt, tmp_path_factory):
    """A Pipeline in the test process built from :func:`service_config` (same model settings)."""
    from appliance.config import config_from_dict
    from appliance.synth.pipeline import Pipeline

    tmp = tmp_path_factory.mktemp("svc_pipe")
    return Pipeline.from_config(config_from_dict(service_config(tiny_ckpt, tmp), base_dir=str(tmp)))


def expected_pcm(pipeline, text: str, seed: int, voice: Optional[str] = None) -> np.ndarray:
    """The float32 PCM (24000 Hz) the pipeline produces for this text/seed/voice."""

    job = pipeline.prepare(SynthesisRequest(text=text, id="expected", seed=seed, voice=voice))
    return np.concatenate([c.samples for c in pipeline.run(job)])


def resample_like_daemon(pcm: np.ndarray, rate: int) -> np.ndarray:
    """24000 Hz -> ``rate`` exactly as :mod:`appliance.audio.output` does (soxr HQ stream)."""
    if rate == 24000:
        return pcm
    import soxr

    rs = soxr.ResampleStream(24000, rate, 1, dtype="float32", quality="HQ")
    return np.concatenate([rs.resample_chunk(pcm), rs.resample_chunk(np.zeros(0, np.float32), last=True)])


def find_start(p: np.ndarray, e: np.ndarray, probe: int = 64) -> Optional[int]:
    """Index in ``p`` where ``e`` begins (its first ``probe`` samples equal exactly), or None."""
    probe = min(probe, len(e))
    for k in np.flatnonzero(p == e[0]):
        if len(p) - k >= probe and np.array_equal(p[k:k + probe], e[:probe]):
            return int(k)
    return None


def wait_played(alsa: AlsaFile, expected: np.ndarray, timeout_s: float = 30.0) -> tuple[np.ndarray, np.ndarray]:
    """Wait until the ALSA file holds all of ``expected`` (float32 at the device rate) and return
    ``(played, expected)`` aligned, both with exact zeros removed: idle silence between requests
    and underrun gaps are zeros written by the daemon's callback, real speech samples are not.
    A wrong, missing or interleaved chunk leaves a mismatch for the caller to find.

    Raises:
        AssertionError: the start of ``expected`` never appeared, or not all of it, in time.
    """
    e = expected[expected != 0]
    assert len(e) > 0, "expected PCM is all zeros"
    deadline = time.monotonic() + timeout_s
    while True:
        p = alsa.read()
        p = p[p != 0]
        k = find_start(p, e)
        if k is not None and len(p) - k >= len(e):
            return p[k:k + len(e)], e
        if time.monotonic() > deadline:
            raise AssertionError(f"played audio not found in {alsa.raw} after {timeout_s} s: {len(p)} non-zero "
                                 f"samples played, start {'not found' if k is None else f'at {k}, {len(p) - k} of {len(e)} present'}")
        time.sleep(0.2)
