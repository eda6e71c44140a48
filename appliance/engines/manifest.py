"""The engine's contract, stored beside the engine and checked at load.

``manifest.json`` sits in every engine directory (``<engine_dir>/onnx/<precision>/`` for ONNX
graphs, ``<engine_dir>/trt/<precision>/`` for TensorRT plans). It records:

* ``kind`` (``onnx`` or ``tensorrt``), ``precision`` (fp32 / fp16 / int8 / fp8);
* ``runtime``: ``{"name": "onnx" | "tensorrt" | "tensorrt_rtx", "version": ...}``;
* ``device``: compute capability, GPU name, board (``/proc/device-tree/model``), L4T release
  (``/etc/nv_tegra_release``); for TensorRT the *target* the plans were built for;
* ``checkpoint``: sha256 over the checkpoint files that the graphs were made from, with their
  sizes and mtimes (so a load can skip re-hashing 1.2 GB when nothing changed);
* ``limits``: ``max_batch``, ``max_seq_len``, ``max_prompt_tokens``, ``window_tokens``;
* ``shapes``: the model dimensions (:class:`appliance.model.shapes.ModelShapes` fields);
* ``build``: flags (workspace MiB, timing cache, TensorRT flavour, opset, quantization);
* ``graphs``: per graph ``file``, ``inputs`` / ``outputs`` (name, shape with -1 or a symbol for
  dynamic dims, dtype), ``profile`` (min/opt/max per dynamic input) and, for plans,
  ``weights_bytes`` / ``activation_bytes`` as the builder reported them;
* ``files``: the sha256 of every file a runner maps (:func:`weight_files`: each graph's file,
  its ONNX external data ``<file>.data``, the host embedding tables), written by :func:`write`.

:func:`check` compares a manifest with what the loader expects and raises
:class:`~appliance.errors.EngineMismatchError` whose message ends in ``rebuild with: ...``;
:func:`verify_files` hashes the mapped files and raises :class:`~appliance.errors.IntegrityError`
for one whose bytes differ from ``files``.
"""

from __future__ import annotations

import datetime as _dt
import functools
import hashlib
import logging
import os
import re
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

from ..errors import EngineError, EngineMismatchError
from ..files import read_json, write_json
from ..model.integrity import mismatch

log = logging.getLogger(__name__)

MANIFEST = "manifest.json"
FORMAT = 1
#: ``build.vocoder`` of an ONNX Runtime export this version runs: one stateful graph per network
#: (first pass behind an ``If``), the Decoder's with its ``reach`` input (``stream-merged``: older,
#: without it)
ONNX_VOCODER = "stream-reach"

#: Checkpoint files the inference graphs are made of (relative to the checkpoint's asset/).
CHECKPOINT_FILES = ("gpt/config.json", "gpt/model.safetensors", "Embed.safetensors", "Decoder.safetensors", "Vocos.safetensors")


def _asset_dir(ckpt_dir: str | os.PathLike) -> Path:
    p = Path(ckpt_dir)
    return p / "asset" if (p / "asset").is_dir() else p


def checkpoint_files(ckpt_dir: str | os.PathLike) -> dict[str, dict[str, int]]:
    """``{relpath: {"size": bytes, "mtime_ns": int}}`` of the inference files present."""
    a = _asset_dir(ckpt_dir)
    out = {}
    for rel in CHECKPOINT_FILES:
        f = a / rel
        if f.is_file():
            st = f.stat()
            out[rel] = {"size": st.st_size, "mtime_ns": st.st_mtime_ns}
    return out


def checkpoint_sha256(ckpt_dir: str | os.PathLike) -> str:
    """sha256 over ``relpath NUL sha256(file)`` lines of :data:`CHECKPOINT_FILES` (sorted).

    Raises:
        EngineError: none of the files exist (not a checkpoint directory).
    """
    a = _asset_dir(ckpt_dir)
    h = hashlib.sha256()
    n = 0
    for rel in sorted(CHECKPOINT_FILES):
        f = a / rel
        if not f.is_file():
            continue
        h.update(rel.encode() + b"\0" + file_sha256(f).encode() + b"\n")
        n += 1
    if n == 0:
        raise EngineError(f"{ckpt_dir} holds none of {', '.join(CHECKPOINT_FILES)}: not a ChatTTS checkpoint "
                          "(set model.path or --checkpoint; get one with: chattts-appliance model fetch DIR)")
    return h.hexdigest()


def file_sha256(path: str | os.PathLike, chunk: int = 1 << 22) -> str:
    """sha256 hex digest of one file, read in 4 MiB chunks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while True:
            b = f.read(chunk)
            if not b:
                break
            h.update(b)
    return h.hexdigest()


def checkpoint_identity(ckpt_dir: str | os.PathLike, known: dict | None = None) -> dict:
    """``{"sha256", "files"}`` of a checkpoint; re-uses ``known["sha256"]`` when every file's
    size and mtime equal ``known["files"]`` (no re-hash of unchanged files)."""
    files = checkpoint_files(ckpt_dir)
    if known and known.get("files") == files and known.get("sha256"):
        return {"sha256": known["sha256"], "files": files}
    return {"sha256": checkpoint_sha256(ckpt_dir), "files": files}


@functools.lru_cache(maxsize=1)
def device_facts() -> dict[str, Any]:
    """What is known about this machine's accelerator: ``compute_capability`` (``"8.7"``),
    ``gpu``, ``board`` (Jetson device-tree model), ``l4t`` (``"36.4.0"``); None where unknown."""
    facts: dict[str, Any] = {"compute_capability": None, "gpu": None, "board": None, "l4t": None}
    model = Path("/proc/device-tree/model")
    if model.is_file():
        try:
            facts["board"] = model.read_bytes().rstrip(b"\0").decode(errors="replace").strip() or None
        except OSError:
            pass
    rel = Path("/etc/nv_tegra_release")
    if rel.is_file():
        m = re.search(r"R(\d+)\s*\(release\),\s*REVISION:\s*([\d.]+)", rel.read_text(errors="replace"))
        if m:
            facts["l4t"] = f"{m.group(1)}.{m.group(2)}"
    if facts["board"] and "orin" in facts["board"].lower():
        facts["compute_capability"] = "8.7"
        facts["gpu"] = "Orin (nvgpu)"
    elif facts["board"] and "xavier" in facts["board"].lower():
        facts["compute_capability"] = "7.2"
        facts["gpu"] = "Xavier (nvgpu)"
    elif shutil.which("nvidia-smi"):
        try:
            out = subprocess.run(
                ["nvidia-smi", "--query-gpu=name,compute_cap", "--format=csv,noheader"],
                capture_output=True, text=True, timeout=10, check=True,
            ).stdout.strip().splitlines()
            if out:
                name, cc = [x.strip() for x in out[0].split(",")[:2]]
                facts["gpu"], facts["compute_capability"] = name, cc
        except (OSError, subprocess.SubprocessError, ValueError):
            pass
    return facts


def cc_tuple(cc: str | None) -> tuple[int, int] | None:
    """``"8.9"`` -> (8, 9); None -> None."""
    if cc is None:
        return None
    major, _, minor = str(cc).partition(".")
    return int(major), int(minor or 0)


def now_iso() -> str:
    """UTC time, ISO 8601, seconds."""
    return _dt.datetime.now(_dt.timezone.utc).replace(microsecond=0).isoformat()


def find_built(engine_dir: str | os.PathLike, kind: str, precisions: tuple[str, ...]) -> Path | None:
    """The first ``<engine_dir>/<kind>/<precision>`` (in the order of ``precisions``) holding a
    manifest, e.g. ``kind="onnx"`` or ``"trt"``; None when nothing is built."""
    base = Path(engine_dir) / kind
    for p in precisions:
        if (base / p / MANIFEST).is_file():
            return base / p
    return None


def expect_common(cfg: Any, manifest: dict, kind: str) -> dict:
    """What every engine (``kind`` ``onnx`` or ``tensorrt``) must match at load: the KV-cache and
    prompt limits of ``cfg.model``, the three graphs, and the checkpoint's sha256 when the
    checkpoint is present (its identity cached in ``manifest`` avoids re-hashing)."""
    mc = cfg.model
    expect: dict[str, Any] = {
        "kind": kind,
        "limits": {"max_batch": mc.max_batch, "max_seq_len": mc.max_seq_len,
                   "max_prompt_tokens": min(mc.max_prompt_tokens, mc.max_seq_len - 1)},
        "graphs": ("gpt", "decoder", "vocos"),
    }
    ckpt = cfg.resolve(mc.path)
    if checkpoint_files(ckpt):
        expect["checkpoint_sha256"] = checkpoint_identity(ckpt, manifest.get("checkpoint"))["sha256"]
    else:
        log.warning("checkpoint %s not found: the engine's checkpoint identity is not checked", ckpt)
    return expect


def weight_files(d: Path, manifest: dict) -> list[str]:
    """Names (relative to ``d``) of the files a runner of this engine maps: each graph's ``file``,
    its external data ``<file>.data`` where that exists (the name our ONNX exports give it), and
    the host tables (``embed.file``; a llama export's ``head_text.file``)."""
    names = []
    for e in manifest.get("graphs", {}).values():
        names += [n for n in (e["file"], e["file"] + ".data") if n == e["file"] or (d / n).is_file()]
    for key in ("embed", "head_text"):  # host tables: the embeddings, the llama export's text head
        f = manifest.get(key, {}).get("file")
        if f:
            names.append(f)
    return names


def write(directory: str | os.PathLike, manifest: dict) -> Path:
    """Write ``manifest`` (adds ``format``, ``created`` and ``files``: the sha256 of each of its
    :func:`weight_files`) as ``<directory>/manifest.json``."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    files = {n: file_sha256(d / n) for n in weight_files(d, manifest) if (d / n).is_file()}
    m = {"format": FORMAT, "created": now_iso(), **manifest, "files": files}
    p = d / MANIFEST
    write_json(p, m, 0o644)
    return p


def read(directory: str | os.PathLike, rebuild_hint: str = "") -> dict:
    """Read ``<directory>/manifest.json``.

    Raises:
        EngineMismatchError: missing or unreadable (message says how to rebuild).
    """
    p = Path(directory) / MANIFEST
    try:
        m = read_json(p, "engine manifest")     # empty, NUL-filled, unparsable: as missing, one warning
    except OSError as e:
        raise EngineMismatchError(f"unreadable engine manifest {p}: {e}" + (f"; rebuild with: {rebuild_hint}" if rebuild_hint else "")) from e
    if m is None:
        raise EngineMismatchError(f"no usable engine manifest at {p}" + (f"; rebuild with: {rebuild_hint}" if rebuild_hint else ""))
    if m.get("format") != FORMAT:
        raise EngineMismatchError(f"{p}: manifest format {m.get('format')!r}, this version reads {FORMAT}" + (f"; rebuild with: {rebuild_hint}" if rebuild_hint else ""))
    return m


def verify_files(d: Path, manifest: dict, rebuild_hint: str, names: list[str] | None = None) -> list[tuple[Path, str]]:
    """Hash the files ``names`` (default: all :func:`weight_files`) of the engine in ``d`` and
    compare each with the sha256 its manifest records; before a runtime maps them. Returns
    ``[(file, sha256)]`` (for a later re-verification).

    Raises:
        EngineMismatchError: the manifest records no sum for a file (an export by an older
            version, or a file added since): rebuild.
        EngineError: a file is missing or unreadable.
        IntegrityError: a file's sha256 differs (names the file, both sums, and the rebuild command).
    """
    rec = manifest.get("files")
    if not isinstance(rec, dict):
        raise EngineMismatchError(f"{d / MANIFEST} records no sha256 of its files (written by an older version); "
                                  f"rebuild with: {rebuild_hint}")
    t0, n_bytes, out = time.perf_counter(), 0, []
    for name in names if names is not None else weight_files(d, manifest):
        f = d / name
        want = rec.get(name)
        if want is None:
            raise EngineMismatchError(f"{d / MANIFEST} records no sha256 of {name}; rebuild with: {rebuild_hint}")
        try:
            got = file_sha256(f)
            n_bytes += f.stat().st_size
        except OSError as e:
            raise EngineError(f"cannot read the engine file {f}: {e}; rebuild with: {rebuild_hint}") from e
        if got != want:
            raise mismatch(f, got, want, str(d / MANIFEST), f"rebuild the engine with: {rebuild_hint}. "
                                                            "(safety.verify_checkpoint: false skips this check.)")
        out.append((f, got))
    dt = time.perf_counter() - t0
    log.info("%s: %d engine files match their manifest (%.0f MiB hashed in %.2f s)", d, len(out), n_bytes / 2**20, dt)
    return out


def check(manifest: dict, expect: dict, rebuild_hint: str) -> None:
    """Compare ``manifest`` with ``expect`` and refuse a mismatch.

    ``expect`` may hold: ``kind``, ``precision``, ``runtime`` ({name, version}), ``device``
    ({compute_capability, board, l4t}: only keys whose expected value is not None are compared),
    ``checkpoint_sha256``, ``limits`` (dict; every key compared), ``graphs`` (names that must be
    present).

    Raises:
        EngineMismatchError: listing every difference, then ``rebuild with: <rebuild_hint>``.
    """
    diffs: list[str] = []

    def cmp(what: str, have: Any, want: Any) -> None:
        if have != want:
            diffs.append(f"{what} is {have!r}, expected {want!r}")

    for k in ("kind", "precision"):
        if k in expect:
            cmp(k, manifest.get(k), expect[k])
    if "runtime" in expect:
        rt = manifest.get("runtime", {})
        for k, v in expect["runtime"].items():
            cmp(f"runtime.{k}", rt.get(k), v)
    if "device" in expect:
        dev = manifest.get("device", {})
        for k, v in expect["device"].items():
            if v is not None:
                cmp(f"device.{k}", dev.get(k), v)
    if "checkpoint_sha256" in expect:
        have = manifest.get("checkpoint", {}).get("sha256")
        if have != expect["checkpoint_sha256"]:
            diffs.append(f"checkpoint sha256 is {str(have)[:12]}..., the configured checkpoint's is {str(expect['checkpoint_sha256'])[:12]}...")
    if "limits" in expect:
        lim = manifest.get("limits", {})
        for k, v in expect["limits"].items():
            cmp(f"limits.{k}", lim.get(k), v)
    for g in expect.get("graphs", ()):
        if g not in manifest.get("graphs", {}):
            diffs.append(f"graph {g} is missing")
    if diffs:
        raise EngineMismatchError("engine does not match: " + "; ".join(diffs) + f"; rebuild with: {rebuild_hint}")


def rebuild_hint(config_path: str | None, precision: str, tensorrt: bool) -> str:
    """The commands that remake an engine directory for ``config_path`` at ``precision``."""
    c = f" --config {config_path}" if config_path else ""
    if not tensorrt:
        return f"chattts-appliance engines export{c} --precision {precision}"
    exp = "fp32" if precision == "fp32" else "fp16"
    return f"chattts-appliance engines export{c} --precision {exp} && chattts-appliance engines build{c} --precision {precision}"
