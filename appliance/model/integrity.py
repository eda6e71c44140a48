"""Weight-file integrity: every file the appliance reads is compared with a recorded sha256.

A flipped bit on an SD card, a truncated copy or an overwritten tensor does not always break a
safetensors file: the header stays intact and the weights load, then the model speaks NaN, noise
or a periodic buzz while every other check passes. So every file is hashed *as it is read* and
the digest compared before the model is used:

* the checkpoint's weight files (``gpt/model.safetensors``, ``Embed``, ``Decoder``, ``Vocos``) by
  the torch loader, in the same pass that copies their tensors to the device
  (:mod:`appliance.model.tensorfile`, :func:`appliance.model.checkpoint.load_model`);
* the small files read beside them (``gpt/config.json``, the tokenizer) here, by
  :func:`verify_files`, before a backend loads;
* an engine's ONNX graphs, their external data, its embedding tables and TensorRT plans by the
  backend that maps them, against the sha256 its ``manifest.json`` records
  (:func:`appliance.engines.manifest.verify_files`).

The expected sums of a checkpoint (:data:`VERIFIED_FILES`, relative to ``asset/``) come from

* ``<checkpoint>/SHA256SUMS.json`` beside ``asset/`` when it exists (``{"asset/gpt/model.safetensors":
  "<hex>", ...}``): written by ``chattts-appliance model random`` for random checkpoints and by
  ``chattts-appliance model sums DIR`` for a checkpoint of your own (fine-tuned, converted);
* otherwise upstream's published map for the official ``2Noise/ChatTTS`` checkpoint
  (``ChatTTS/res/sha256_map.json``, kept in :data:`appliance.model.fetch.SHA256`).

No digest is cached: a cache keyed by size, mtime and inode cannot see a bit that rotted in place
(the file's metadata does not change), which is the failure this check exists for. Hashing costs
CPU time on bytes that the load reads anyway (measured in ``docs/integrity.md``).

A mismatch raises :class:`~appliance.errors.IntegrityError` naming the file, the expected and
the actual sum, where the expected sum came from and what to do. No torch here.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path

from ..errors import CheckpointError, IntegrityError
from ..files import write_atomic
from . import layout
from .fetch import SHA256 as UPSTREAM_SHA256
from .fetch import sha256_file

log = logging.getLogger(__name__)

SUMS_FILE = "SHA256SUMS.json"
"""Our own sums, beside ``asset/`` (keys relative to the checkpoint directory, e.g. ``asset/Embed.safetensors``)."""

#: Files read at run time, relative to ``asset/`` (DVAE is not loaded, so not checked).
VERIFIED_FILES = (layout.GPT_CONFIG, layout.GPT_FILE, layout.EMBED_FILE, layout.DECODER_FILE, layout.VOCOS_FILE,
                  *(f"{layout.TOKENIZER_DIR}/{n}" for n in layout.TOKENIZER_FILES))


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
        write_atomic(out, (json.dumps(sums, indent=1, sort_keys=True) + "\n").encode("utf-8"), 0o644)
    except OSError as e:
        raise CheckpointError(f"cannot write {out}: {e}") from e
    return out


def _hint(root: Path, source: str) -> str:
    """What to do about a checkpoint file that fails its check (depends on where the sums came from)."""
    hint = ("copy the file again from a good source (the official checkpoint: "
            f"'chattts-appliance model fetch {root}')")
    if source != str(root / SUMS_FILE):
        hint += (f"; if this is a checkpoint of your own (fine-tuned or converted), record its sums once with "
                 f"'chattts-appliance model sums {root}'")
    else:
        hint += "; a random checkpoint is written again with 'chattts-appliance model random DIR'"
    return hint + ". (safety.verify_checkpoint: false skips this check.)"


def mismatch(f: Path, got: str, want: str, source: str, todo: str) -> IntegrityError:
    """The error for a file whose sha256 ``got`` differs from ``want`` (recorded in ``source``)."""
    return IntegrityError(f"a weight file failed its integrity check: {f}: sha256 {got}, expected {want} (recorded "
                          f"in {source}). The file is corrupted or was changed: {todo}")


@dataclass(frozen=True)
class Sums:
    """The expected sums of one checkpoint: ``want`` (``{"asset/<rel>": hex}``), their ``source``
    and the checkpoint's ``root`` (the directory holding ``asset/``)."""

    root: Path
    want: dict[str, str]
    source: str

    @classmethod
    def of(cls, path: str | Path) -> "Sums":
        """The sums for the checkpoint at ``path`` (``path`` or ``path/asset``).

        Raises:
            CheckpointError: ``SHA256SUMS.json`` exists but cannot be read.
        """
        root = locate(path)[1]
        want, source = expected_sums(root)
        return cls(root, want, source)

    def expected(self, rel: str) -> str:
        """The recorded hex sha256 of ``asset/<rel>``.

        Raises:
            IntegrityError: no sum is recorded for it (says how to record one).
        """
        want = self.want.get(f"asset/{rel}")
        if want is None:
            raise IntegrityError(f"{self.root / 'asset' / rel} has no sha256 in {self.source}: {_hint(self.root, self.source)}")
        return want

    def check(self, rel: str, got: str) -> str:
        """Compare the digest ``got`` of ``asset/<rel>`` (hashed as it was read); returns it.

        Raises:
            IntegrityError: it differs (file, both digests, the source and what to do).
        """
        want = self.expected(rel)
        if got != want:
            raise mismatch(self.root / "asset" / rel, got, want, self.source, _hint(self.root, self.source))
        return got


def verify_files(path: str | Path, rels: tuple[str, ...]) -> list[tuple[Path, str]]:
    """Hash the files ``rels`` (relative to ``asset/``) of the checkpoint at ``path`` and compare.

    For files read whole by other code (``gpt/config.json``, the tokenizer): they are small.
    Returns ``[(file, sha256)]`` (for a later re-verification).

    Raises:
        CheckpointError: a file is missing. IntegrityError: a sum is missing or differs. Either
            lists every bad file.
    """
    asset = locate(path)[0]
    sums = Sums.of(path)
    bad: list[str] = []
    missing = False
    out = []
    for rel in rels:
        f = asset / rel
        want = sums.want.get(f"asset/{rel}")
        if not f.is_file():
            bad.append(f"{f}: missing")
            missing = True
        elif want is None:
            bad.append(f"{f}: no sum in {sums.source}")
        elif (got := sha256_file(f)) != want:
            bad.append(f"{f}: sha256 {got}, expected {want}")
        else:
            out.append((f, got))
    if bad:
        raise (CheckpointError if missing else IntegrityError)(
            f"checkpoint {sums.root} failed its integrity check against {sums.source}:\n  " + "\n  ".join(bad)
            + f"\nThe file(s) are corrupted or were changed: {_hint(sums.root, sums.source)}")
    return out


def verify_checkpoint(path: str | Path) -> list[tuple[Path, str]]:
    """Hash every :data:`VERIFIED_FILES` entry of the checkpoint at ``path`` (whole files, no cache)
    and compare each with its sum; returns ``[(file, sha256)]``. Used by ``model sums``-style checks
    and tests; a backend verifies what it reads while reading it.

    Raises:
        CheckpointError: a file is missing. IntegrityError: a sum is missing or differs (all listed).
    """
    t0 = time.perf_counter()
    out = verify_files(path, VERIFIED_FILES)
    log.info("checkpoint %s: %d files match their sums (%.2f s)", locate(path)[1], len(out), time.perf_counter() - t0)
    return out


#: Files of a checkpoint that are read whole by other code than the weight loader (checked by
#: :func:`verify_for_config` before a backend loads).
SMALL_FILES = (layout.GPT_CONFIG, *(f"{layout.TOKENIZER_DIR}/{n}" for n in layout.TOKENIZER_FILES))


def verify_for_config(cfg, asset: Path) -> list[tuple[Path, str]]:
    """:func:`verify_files` of :data:`SMALL_FILES` as configured (``safety.verify_checkpoint``);
    ``[]`` when the check is off. The weight files are verified by the backend that reads them.

    Raises:
        CheckpointError, IntegrityError: see :func:`verify_files`.
    """
    if not cfg.safety.verify_checkpoint:
        log.warning("checkpoint integrity check is off (safety.verify_checkpoint: false): no weight file is "
                    "compared with its sha256")
        return []
    return verify_files(asset, SMALL_FILES)


def cli_main(args) -> int:
    """``chattts-appliance model sums DIR``: record the sums of a checkpoint of your own."""
    out = write_sums(args.dir)
    print(f"wrote {out}: the daemon now checks {locate(args.dir)[0]} against these sums at every start")
    return 0
