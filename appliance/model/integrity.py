"""Checkpoint integrity: the sha256 of every checkpoint file the appliance reads, checked at load.

A flipped bit on an SD card, a truncated copy or an overwritten tensor does not always break a
safetensors file: the header stays intact and the weights load, then the model speaks NaN or
noise while every check passes. So before anything is loaded, each file the appliance reads
(:data:`VERIFIED_FILES`, relative to ``asset/``) is compared with a known sum:

* ``<checkpoint>/SHA256SUMS.json`` beside ``asset/`` when it exists (``{"asset/gpt/model.safetensors":
  "<hex>", ...}``): written by ``chattts-appliance model random`` for random checkpoints and by
  ``chattts-appliance model sums DIR`` for a checkpoint of your own (fine-tuned, converted);
* otherwise upstream's published map for the official ``2Noise/ChatTTS`` checkpoint
  (``ChatTTS/res/sha256_map.json``, kept in :data:`appliance.model.fetch.SHA256`).

Hashing 1.2 GB takes seconds on a desktop and tens of seconds on a Jetson's eMMC, so results are
cached (:class:`SumCache`, one JSON file) keyed by path, size, mtime and inode: an unchanged file
costs one ``stat`` at boot. A file rewritten in place gets a new mtime and is hashed again.

A mismatch raises :class:`~appliance.errors.CheckpointError` naming every bad file, the sums,
where the expected sum came from and what to do. No torch here.
"""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from ..errors import CheckpointError
from . import layout
from .fetch import SHA256 as UPSTREAM_SHA256
from .fetch import sha256_file

log = logging.getLogger(__name__)

SUMS_FILE = "SHA256SUMS.json"
"""Our own sums, beside ``asset/`` (keys relative to the checkpoint directory, e.g. ``asset/Embed.safetensors``)."""

CACHE_FILE = "checkpoint-sha256.json"
"""Name of the sum cache in ``safety.cache_dir``."""

#: Files read at run time, relative to ``asset/`` (DVAE is not loaded, so not checked).
VERIFIED_FILES = (layout.GPT_CONFIG, layout.GPT_FILE, layout.EMBED_FILE, layout.DECODER_FILE, layout.VOCOS_FILE,
                  *(f"{layout.TOKENIZER_DIR}/{n}" for n in layout.TOKENIZER_FILES))


@dataclass(frozen=True)
class Report:
    """Outcome of :func:`verify_checkpoint`.

    Attributes:
        source: where the expected sums came from (``SHA256SUMS.json`` path or ``upstream``).
        files: files checked. hashed: files actually read (the rest came from the cache).
        seconds: wall time of the check, s.
    """

    source: str
    files: int
    hashed: int
    seconds: float


class SumCache:
    """sha256 of files keyed by ``(path, size, mtime_ns, inode)``, kept in one JSON file.

    Args:
        path: the cache file (its directory is created when saved); None = no cache.

    An unreadable or malformed cache is ignored (everything is hashed again); a cache that
    cannot be written is logged once and the check still runs.
    """

    def __init__(self, path: Optional[Path]) -> None:
        self.path = path
        self._data: dict[str, dict] = {}
        self._dirty = False
        if path is not None:
            try:
                data = json.loads(path.read_text(encoding="utf-8"))
                if isinstance(data, dict):
                    self._data = {k: v for k, v in data.items() if isinstance(v, dict)}
            except (OSError, ValueError):
                pass

    @staticmethod
    def _key(st: os.stat_result) -> list:
        return [st.st_size, st.st_mtime_ns, st.st_ino]

    def sha256(self, f: Path) -> tuple[str, bool]:
        """``(hex sha256, True if the file was read)`` for ``f`` (which must exist)."""
        st = f.stat()
        k = str(f.resolve())
        hit = self._data.get(k)
        if hit is not None and hit.get("stat") == self._key(st) and isinstance(hit.get("sha256"), str):
            return hit["sha256"], False
        digest = sha256_file(f)
        st2 = f.stat()
        if self._key(st2) == self._key(st):       # not changed while it was read
            self._data[k] = {"stat": self._key(st2), "sha256": digest}
            self._dirty = True
        return digest, True

    def save(self) -> None:
        """Write the cache (atomically) if anything was added."""
        if self.path is None or not self._dirty:
            return
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_name(self.path.name + ".tmp")
            tmp.write_text(json.dumps(self._data, indent=0, sort_keys=True), encoding="utf-8")
            os.replace(tmp, self.path)
            self._dirty = False
        except OSError as e:
            log.warning("cannot write the checkpoint sum cache %s (%s); the next start hashes again", self.path, e)


def locate(path: str | Path) -> tuple[Path, Path]:
    """``(asset directory, directory of SHA256SUMS.json)`` of a checkpoint: ``path`` may hold
    ``asset/`` or be the asset directory itself (the sums then sit beside it when it is named
    ``asset``, else in it)."""
    p = Path(path)
    if (p / "asset" / layout.GPT_CONFIG).is_file() or not (p / layout.GPT_CONFIG).is_file():
        asset = p / "asset" if p.name != "asset" else p
    else:
        asset = p
    return asset, (asset.parent if asset.name == "asset" else asset)


def expected_sums(root: Path) -> tuple[dict[str, str], str]:
    """``({"asset/<file>": hex}, source)`` for the checkpoint at ``root`` (see module docstring).

    Raises:
        CheckpointError: ``SHA256SUMS.json`` exists but cannot be read.
    """
    f = root / SUMS_FILE
    if f.is_file():
        try:
            data = json.loads(f.read_text(encoding="utf-8"))
            if not isinstance(data, dict) or not all(isinstance(v, str) for v in data.values()):
                raise ValueError("not an object of strings")
        except (OSError, ValueError) as e:
            raise CheckpointError(f"{f} is unreadable ({e}); write it again with "
                                  f"'chattts-appliance model sums {root}' from a known-good copy") from e
        return data, str(f)
    return dict(UPSTREAM_SHA256), "upstream's published sums for 2Noise/ChatTTS"


def write_sums(root: str | Path) -> Path:
    """Hash the :data:`VERIFIED_FILES` present under ``root/asset`` into ``root/SHA256SUMS.json``.

    Raises:
        CheckpointError: ``root`` holds no ``asset/`` or the file cannot be written.
    """
    asset, root = locate(root)
    if not (asset / layout.GPT_CONFIG).is_file():
        raise CheckpointError(f"{asset} holds no {layout.GPT_CONFIG}: not a checkpoint in the official layout")
    sums = {f"asset/{rel}": sha256_file(asset / rel) for rel in VERIFIED_FILES if (asset / rel).is_file()}
    out = root / SUMS_FILE
    try:
        tmp = out.with_name(out.name + ".tmp")
        tmp.write_text(json.dumps(sums, indent=1, sort_keys=True) + "\n", encoding="utf-8")
        os.replace(tmp, out)
    except OSError as e:
        raise CheckpointError(f"cannot write {out}: {e}") from e
    return out


def verify_checkpoint(path: str | Path, cache_file: Optional[Path] = None) -> Report:
    """Check every :data:`VERIFIED_FILES` entry of the checkpoint at ``path`` against its sum.

    Args:
        path: the checkpoint directory (holding ``asset/``) or ``asset/`` itself.
        cache_file: the :class:`SumCache` file; None hashes every file.

    Raises:
        CheckpointError: a file is missing, has no known sum, or its sum differs (all such files
            listed, with the expected sum's source and what to do).
    """
    t0 = time.perf_counter()
    asset, root = locate(path)
    want, source = expected_sums(root)
    cache = SumCache(cache_file)
    bad: list[str] = []
    hashed = 0
    for rel in VERIFIED_FILES:
        key = f"asset/{rel}"
        f = asset / rel
        if not f.is_file():
            bad.append(f"{f}: missing")
            continue
        if key not in want:
            bad.append(f"{f}: no sum in {source}")
            continue
        got, read = cache.sha256(f)
        hashed += read
        if got != want[key]:
            bad.append(f"{f}: sha256 {got[:16]}..., expected {want[key][:16]}...")
    cache.save()
    if bad:
        own = source != str(root / SUMS_FILE)
        hint = ("copy the file(s) again from a good source (the official checkpoint: "
                f"'chattts-appliance model fetch {root}')")
        if own:
            hint += (f"; if this is a checkpoint of your own (fine-tuned or converted), record its sums once with "
                     f"'chattts-appliance model sums {root}'")
        else:
            hint += ("; a random checkpoint is written again with 'chattts-appliance model random DIR'")
        raise CheckpointError(f"checkpoint {root} failed its integrity check against {source}:\n  "
                              + "\n  ".join(bad) + f"\nThe file(s) are corrupted or were changed: {hint}. "
                              "(safety.verify_checkpoint: false skips this check.)")
    dt = time.perf_counter() - t0
    log.info("checkpoint %s: %d files match %s (%d hashed, %d from the cache, %.2f s)",
             root, len(VERIFIED_FILES), source, hashed, len(VERIFIED_FILES) - hashed, dt)
    return Report(source=source, files=len(VERIFIED_FILES), hashed=hashed, seconds=dt)


def verify_for_config(cfg, asset: Path) -> Optional[Report]:
    """:func:`verify_checkpoint` as configured (``safety.verify_checkpoint``, the cache in
    ``safety.cache_dir``); None when the check is off.

    Raises:
        CheckpointError: see :func:`verify_checkpoint`.
    """
    if not cfg.safety.verify_checkpoint:
        log.warning("checkpoint integrity check is off (safety.verify_checkpoint: false)")
        return None
    return verify_checkpoint(asset, cfg.resolve(cfg.safety.cache_dir) / CACHE_FILE)


def cli_main(args) -> int:
    """``chattts-appliance model sums DIR``: record the sums of a checkpoint of your own."""
    out = write_sums(args.dir)
    print(f"wrote {out}: the daemon now checks {locate(args.dir)[0]} against these sums at every start")
    return 0
