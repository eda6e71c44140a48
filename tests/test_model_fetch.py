"""model fetch: fails fast when the hub is unreachable (as here); sha256 verification."""

from __future__ import annotations

import hashlib
import subprocess
import sys
import time

import pytest

from appliance.errors import FetchError
from appliance.model import fetch


def _hub_reachable() -> bool:
    try:
        fetch.probe_hub(timeout=2.0)
        return True
    except FetchError:
        return False


@pytest.mark.skipif(_hub_reachable(), reason="the hub is reachable here; this test checks the offline path")
def test_fetch_fails_fast_with_help(tmp_path):
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-m", "appliance", "model", "fetch", str(tmp_path / "ck")],
                       capture_output=True, text=True, timeout=60)
    dt = time.monotonic() - t0
    assert r.returncode == 2, r.stderr
    assert "unreachable" in r.stderr and "model.path" in r.stderr
    assert dt < 10.0, f"fetch took {dt:.1f} s to fail"


def test_sha_table_is_upstreams():
    assert len(fetch.SHA256) == 9
    assert fetch.SHA256["asset/gpt/model.safetensors"].startswith("cd0806fd")
    assert all(len(v) == 64 for v in fetch.SHA256.values())


def test_verify(tmp_path):
    (tmp_path / "asset").mkdir()
    (tmp_path / "asset" / "a.bin").write_bytes(b"hello")
    good = {"asset/a.bin": hashlib.sha256(b"hello").hexdigest()}
    fetch.verify(tmp_path, good)
    with pytest.raises(FetchError, match=r"asset/a.bin: sha256 .* != expected"):
        fetch.verify(tmp_path, {"asset/a.bin": "0" * 64})
    with pytest.raises(FetchError, match=r"asset/b.bin: missing"):
        fetch.verify(tmp_path, {**good, "asset/b.bin": "0" * 64})
