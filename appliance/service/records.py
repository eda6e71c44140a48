"""The journal's records: one journaled request (:class:`Entry`), what a reopened journal found
(:class:`Recovered`), the line format (``<crc32, 8 hex digits> <JSON>\\n``: :func:`encode`,
:func:`decode`), the text digest a finished request keeps (:func:`text_sha`) and the slimmed
terminal event (:func:`slim`). Pure data; :mod:`appliance.service.journal` does the file I/O.
"""

from __future__ import annotations

import hashlib
import json
import zlib
from dataclasses import dataclass, field
from typing import Optional


def text_sha(text: object) -> str:
    """The digest a finished request keeps of its text (16 hex digits of SHA-256; ``""`` for no text)."""
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()[:16] if isinstance(text, str) else ""


@dataclass
class Entry:
    """One journaled request.

    Attributes:
        n: journal sequence number (unique across restarts). t: wall-clock accept time, s.
        origin: ``socket`` or ``mqtt``. req: the ``speak`` object (with ``channel`` and ``seed``).
        tries: crashes during which it was running (synthesizing or sounding), in earlier runs.
        running: it is running now (its last state record is ``s`` or ``p``).
        sounded: its first sample reached the sound device since it last started (this run).
        ev: its terminal event (``done``/``error`` dict) once ended.
    """

    n: int
    t: float
    origin: str
    req: dict
    tries: int = 0
    running: bool = False
    sounded: bool = False
    ev: Optional[dict] = None
    size: int = 0               # bytes of its accept record (the journal's bound counts them)

    @property
    def id(self) -> str:
        return str(self.req.get("id", ""))

    @property
    def text_sha(self) -> str:
        """:func:`text_sha` of its text (kept as ``req["text_sha"]`` once it ended)."""
        return self.req.get("text_sha") or text_sha(self.req.get("text"))


@dataclass
class Recovered:
    """What :meth:`~appliance.service.journal.Journal.open` found: the unfinished requests (accept order), the finished
    ones (id -> terminal event; id -> :func:`text_sha` of their text, ``""`` where an older
    journal did not record it), and how many records were dropped as torn or corrupt."""

    pending: list[Entry] = field(default_factory=list)
    finished: dict[str, dict] = field(default_factory=dict)
    finished_sha: dict[str, str] = field(default_factory=dict)
    torn: int = 0
    corrupt: int = 0


def encode(rec: dict) -> bytes:
    """One journal line for ``rec``."""
    body = json.dumps(rec, ensure_ascii=False, separators=(",", ":")).encode("utf-8")
    return b"%08x " % zlib.crc32(body) + body + b"\n"


def decode(line: bytes) -> Optional[dict]:
    """The record of one line (without its newline), or None when it is damaged."""
    if len(line) < 10 or line[8:9] != b" ":
        return None
    body = line[9:]
    try:
        if int(line[:8], 16) != zlib.crc32(body):
            return None
        rec = json.loads(body)
    except ValueError:
        return None
    return rec if isinstance(rec, dict) and rec.get("k") in ("a", "s", "w", "p", "e", "f") else None


def slim(event: dict) -> dict:
    """The terminal event as kept in the journal (the fields a returning client needs)."""
    keep = ("type", "id", "channel", "code", "message", "output", "seed", "audio_s", "ttfb_ms", "rtf",
            "steps", "steps_per_s", "unspeakable")
    out = {k: v for k, v in event.items() if k in keep}
    if isinstance(out.get("message"), str) and len(out["message"]) > 500:
        out["message"] = out["message"][:500]
    return out
