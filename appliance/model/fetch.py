"""Download the official checkpoint (HF ``2Noise/ChatTTS``) and verify its sha256 sums
(``chattts-appliance model fetch OUT_DIR``).

Only the files that PyPI ``chattts`` 0.2.5 uses are fetched (``asset/gpt``, ``Embed``,
``Decoder``, ``DVAE``, ``Vocos``, ``tokenizer``), then every one is checked against the sums
upstream ships in ``ChatTTS/res/sha256_map.json`` (:data:`SHA256`). Before downloading, a quick
TCP probe of the hub (a few seconds) makes an unreachable hub fail fast with a
:class:`~appliance.errors.FetchError` that says how to use a local checkpoint instead.
No torch.
"""

from __future__ import annotations

import hashlib
import logging
import os
import socket
import threading
from pathlib import Path
from urllib.parse import urlparse

from ..errors import FetchError

log = logging.getLogger(__name__)

REPO_ID = "2Noise/ChatTTS"
PROBE_TIMEOUT_S = 3.0

#: sha256 of each file, from upstream chattts 0.2.5 ``ChatTTS/res/sha256_map.json`` (data).
SHA256: dict[str, str] = {
    "asset/Decoder.safetensors": "77aa55e0a977949c4733df3c6f876fa85860d3298cba63295a7bc6901729d4e0",
    "asset/DVAE.safetensors": "1d0b044a8368c0513100a2eca98456b289e6be6a18b7a63be1bcaa315ea874d9",
    "asset/Embed.safetensors": "2ff0be7134934155741b643b74e32fb6bf3eec41257984459b2ed60cdb4c48b0",
    "asset/Vocos.safetensors": "07e5561491cce41f7f90cfdb94b2ff263ff5742c3d89339db99b17ad82cc3f44",
    "asset/gpt/config.json": "0aaa1ecd96c49ad4f473459eb1982fa7ad79fa5de08cde2781bf6ad1f9a0c236",
    "asset/gpt/model.safetensors": "cd0806fd971f52f6a22c923ec64982b305e817bcc41ca83417fcf9141b984a0f",
    "asset/tokenizer/special_tokens_map.json": "bd0ac9d9bb1657996b5c5fbcaa7d80f8de530d01a283da97f89deae5b1b8d011",
    "asset/tokenizer/tokenizer_config.json": "43e9d658b554fa5ee8d8e1d763349323bfef1ed7a89c0794220ab8861387d421",
    "asset/tokenizer/tokenizer.json": "843838a64e121e23e774cc75874c6fe862198d9f7dd43747914633a8fd89c20e",
}

_HELP = ("Download it elsewhere (e.g. 'hf download 2Noise/ChatTTS --include \"asset/*\" "
         "--local-dir DIR') and set model.path in config.yaml to that directory (it must hold asset/ in "
         "the official layout), or write a random checkpoint with 'chattts-appliance model random --size "
         "full DIR' (random weights speak noise).")


def _endpoint() -> str:
    return os.environ.get("HF_ENDPOINT", "https://huggingface.co")


def probe_hub(endpoint: str | None = None, timeout: float = PROBE_TIMEOUT_S) -> None:
    """Open a TCP connection to the hub's host within ``timeout`` seconds (DNS included).

    Raises:
        FetchError: the host does not resolve or accept a connection in time.
    """
    url = urlparse(endpoint or _endpoint())
    host, port = url.hostname or "huggingface.co", url.port or (443 if url.scheme != "http" else 80)
    result: list[BaseException | None] = []

    def _try() -> None:
        try:
            socket.create_connection((host, port), timeout=timeout).close()
            result.append(None)
        except OSError as e:
            result.append(e)

    t = threading.Thread(target=_try, daemon=True)
    t.start()
    t.join(timeout + 0.5)
    if not result or result[0] is not None:
        why = "no answer" if not result else str(result[0])
        raise FetchError(f"the HuggingFace hub is unreachable ({host}:{port}: {why} within {timeout:.0f} s). " + _HELP)


def sha256_file(path: Path, chunk: int = 1 << 20) -> str:
    """Hex sha256 of a file, read in ``chunk``-byte pieces."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while b := f.read(chunk):
            h.update(b)
    return h.hexdigest()


def verify(root: str | Path, table: dict[str, str] | None = None) -> None:
    """Check every file of ``table`` (default :data:`SHA256`; paths relative to ``root``).

    Raises:
        FetchError: a file is missing or its sum differs (all such files are listed).
    """
    root = Path(root)
    bad = []
    for rel, want in (table or SHA256).items():
        p = root / rel
        if not p.is_file():
            bad.append(f"{rel}: missing")
        elif (got := sha256_file(p)) != want:
            bad.append(f"{rel}: sha256 {got} != expected {want}")
    if bad:
        raise FetchError(f"checkpoint in {root} failed verification:\n  " + "\n  ".join(bad))


def fetch(out_dir: str | Path, revision: str | None = None) -> Path:
    """Download ``2Noise/ChatTTS`` (the files of :data:`SHA256`) into ``out_dir`` and verify them.

    Returns ``out_dir`` (which then holds ``asset/``; point ``model.path`` at it).

    Raises:
        FetchError: hub unreachable (fast), download failed, or a checksum mismatch.
    """
    os.environ.setdefault("HF_HUB_ETAG_TIMEOUT", "5")
    os.environ.setdefault("HF_HUB_DOWNLOAD_TIMEOUT", "30")
    probe_hub()
    try:
        from huggingface_hub import snapshot_download
    except ImportError as e:
        raise FetchError("model fetch needs huggingface_hub: pip install 'chattts-appliance[fetch]'") from e
    out = Path(out_dir)
    try:
        snapshot_download(REPO_ID, revision=revision, allow_patterns=list(SHA256), local_dir=str(out))
    except Exception as e:  # huggingface_hub raises many types (HTTP, offline, OSError)
        raise FetchError(f"downloading {REPO_ID} failed: {e}. " + _HELP) from e
    verify(out)
    log.info("fetched and verified %s into %s", REPO_ID, out)
    return out


def cli_main(args) -> int:
    """``chattts-appliance model fetch OUT_DIR [--revision R]``."""
    out = fetch(args.out_dir, getattr(args, "revision", None))
    print(f"{REPO_ID} downloaded and verified in {out}; set model.path: {out} in config.yaml")
    return 0
