"""The journal's records: one journaled request (:class:`Entry`), what a reopened journal found
(:class:`Recovered`), the line format (``<crc32, 8 hex digits> <JSON>[ <mark>]\\n``:
:func:`encode`, :func:`decode`), the clocks a request's age is measured on (:class:`Stamp`,
:func:`age_s`), the text digest a finished request keeps (:func:`text_sha`) and the slimmed
terminal event (:func:`slim`). Pure data; :mod:`appliance.service.journal` does the file I/O.

The *mark* is one byte after an accept record's JSON, outside its CRC, that the journal
overwrites in place (no new space on the disk): the request's state (:data:`MARKS`).

Age (:func:`age_s`): a request's age is measured on ``CLOCK_BOOTTIME`` (seconds since boot,
counting suspend; never stepped) when it was accepted in this boot (same ``boot_id``), so a wall
clock that reads 1970 until NTP sets it, or is stepped back or forward, changes nothing. A request
accepted in an earlier boot (power cut, reboot): the time it lived in that boot is known exactly
(the newest record of that boot minus its accept, both ``CLOCK_BOOTTIME``); the time between the
boots only from the wall clock, and only when both readings are plausible (after
:data:`WALL_FLOOR`) and in order, else it counts as 0 (a box without a real-time clock cannot
know how long it was off: it replays rather than drops).
"""

from __future__ import annotations

import hashlib
import json
import time
import zlib
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Optional

MARKS = {"-": "accepted (queued)", "s": "synthesizing", "w": "synthesized, waiting to sound", "p": "sounding",
         "D": "ended done", "X": "ended with an error"}
"""The mark byte of an accept record: its state, written in place (``D``/``X`` only when the
``e`` record with the terminal event could not be appended, e.g. on a full disk)."""
RUNNING = ("s", "p")
"""Marks (and old-style state records) of a running request: a crash counts an attempt."""
ENDED = ("D", "X")

WALL_FLOOR = 1_704_067_200.0
"""2024-01-01 UTC: a wall clock before this has not been set (no RTC, no NTP yet), s."""

_BOOT_ID: Optional[str] = None


def boot_id() -> str:
    """This boot's id (``/proc/sys/kernel/random/boot_id``, 32 hex digits; ``""`` where unreadable)."""
    global _BOOT_ID
    if _BOOT_ID is None:
        try:
            with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as f:
                _BOOT_ID = f.read().strip().replace("-", "")
        except OSError:
            _BOOT_ID = ""
    return _BOOT_ID


@dataclass(frozen=True)
class Stamp:
    """When something happened, on three clocks.

    Attributes:
        boot: :func:`boot_id`. up: ``CLOCK_BOOTTIME``, s (monotonic across suspend, never
            stepped; meaningful within one boot). wall: ``time.time()``, s (may be stepped).
    """

    boot: str
    up: float
    wall: float

    @classmethod
    def now(cls) -> "Stamp":
        return cls(boot_id(), time.clock_gettime(time.CLOCK_BOOTTIME), time.time())


def age_s(accepted: Stamp, last_of_its_boot: Stamp, now: Stamp) -> float:
    """Seconds since ``accepted`` (module docstring: Age); ``last_of_its_boot`` is the newest
    record written in the boot it was accepted in (>= ``accepted``). Never negative."""
    if accepted.boot and accepted.boot == now.boot:
        return max(0.0, now.up - accepted.up)
    if not accepted.boot:                # an older journal's record: the wall clock is all there is
        off = now.wall - accepted.wall
        return off if accepted.wall >= WALL_FLOOR and now.wall >= WALL_FLOOR and off >= 0 else 0.0
    lived = max(0.0, last_of_its_boot.up - accepted.up)
    off = now.wall - last_of_its_boot.wall
    sane = last_of_its_boot.wall >= WALL_FLOOR and now.wall >= WALL_FLOOR and off >= 0
    return lived + (off if sane else 0.0)


def text_sha(text: object) -> str:
    """The digest a finished request keeps of its text (16 hex digits of SHA-256; ``""`` for no text)."""
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()[:16] if isinstance(text, str) else ""


@dataclass
class Entry:
    """One journaled request.

    Attributes:
        n: journal sequence number (unique across restarts: the journal's order).
        at: when it was accepted (:class:`Stamp`; its age is measured with :func:`age_s`).
        origin: ``socket`` or ``mqtt``. req: the ``speak`` object (with ``channel`` and ``seed``).
        tries: crashes during which it was running (synthesizing or sounding), in earlier runs.
        running: it is running now (its mark or last state record is ``s`` or ``p``).
        sounded: its first sample reached the sound device since it last started (this run).
        ev: its terminal event (``done``/``error`` dict) once ended.
        pos: file offset of its accept record's mark byte (-1: none in the file yet).
        mark: its state as last marked (:data:`MARKS`).
    """

    n: int
    at: Stamp
    origin: str
    req: dict
    tries: int = 0
    running: bool = False
    sounded: bool = False
    ev: Optional[dict] = None
    size: int = 0               # bytes of its accept record (the journal's bound counts them)
    pos: int = -1
    mark: str = "-"

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
    journal did not record it), how many records were dropped as torn or corrupt, and the
    newest record's :class:`Stamp` per boot id (:func:`age_s`). A damaged journal: the offset of
    its first damaged byte (-1: none), the records read intact, the bytes that could not be read,
    and where the damaged file was set aside (None: not damaged, or it could not be moved)."""

    pending: list[Entry] = field(default_factory=list)
    last_of_boot: dict[str, Stamp] = field(default_factory=dict)
    finished: dict[str, dict] = field(default_factory=dict)
    finished_sha: dict[str, str] = field(default_factory=dict)
    torn: int = 0
    corrupt: int = 0
    damaged_at: int = -1
    records: int = 0
    lost_bytes: int = 0
    set_aside: Optional[str] = None


def encode(rec: dict, mark: Optional[str] = None) -> bytes:
    """One journal line for ``rec``; ``mark`` (one of :data:`MARKS`) is appended after the JSON,
    outside the CRC, where :meth:`~appliance.service.journal.Journal` overwrites it in place: the
    mark is the line's second-to-last byte."""
    body = json.dumps(rec, ensure_ascii=False, separators=(",", ":")).encode("utf-8")
    tail = b"\n" if mark is None else b" " + mark.encode("ascii") + b"\n"
    return b"%08x " % zlib.crc32(body) + body + tail


def decode(line: bytes) -> Optional[dict]:
    """The record of one line (without its newline), or None when it is damaged; an accept
    record's mark (if it has one) is returned under the key ``"mark"``."""
    if len(line) < 10 or line[8:9] != b" ":
        return None
    body, mark = line[9:], None
    if len(body) > 2 and body[-2:-1] == b" " and chr(body[-1]) in MARKS:
        body, mark = body[:-2], chr(body[-1])
    try:
        if int(line[:8], 16) != zlib.crc32(body):
            return None
        rec = json.loads(body)
    except ValueError:
        return None
    if not (isinstance(rec, dict) and rec.get("k") in ("h", "a", "s", "w", "p", "e", "f")):
        return None
    if mark is not None:
        rec["mark"] = mark
    return rec


def stamp_of(rec: dict) -> Stamp:
    """The :class:`Stamp` a record carries (``b`` boot id, ``u`` ``CLOCK_BOOTTIME`` s, ``t`` wall
    s); an older journal's records carry only ``t`` (boot ``""``: their age comes from the wall clock)."""
    return Stamp(str(rec.get("b", "")), float(rec.get("u", 0.0)), float(rec.get("t", 0.0)))


def slim(event: dict) -> dict:
    """The terminal event as kept in the journal (the fields a returning client needs)."""
    keep = ("type", "id", "channel", "code", "message", "output", "seed", "audio_s", "ttfb_ms", "rtf",
            "steps", "steps_per_s", "unspeakable")
    out = {k: v for k, v in event.items() if k in keep}
    if isinstance(out.get("message"), str) and len(out["message"]) > 500:
        out["message"] = out["message"][:500]
    return out


@dataclass
class Scan:
    """What :func:`scan` read from a journal file's bytes.

    Attributes:
        records: the intact records, each with the file offset of its mark byte (-1: none).
        good_len: bytes before the torn last piece (the whole file when there is none).
        torn: 1 when the last piece (no newline: a cut last line, a NUL tail) is damaged.
        corrupt: damaged lines before it (a bad checksum, NUL bytes in the middle).
        damaged_at: file offset of the first damaged byte (-1: none).
        lost_bytes: bytes that could not be read as records (damaged lines and tail).
    """

    records: list[tuple[dict, int]]
    good_len: int = 0
    torn: int = 0
    corrupt: int = 0
    damaged_at: int = -1
    lost_bytes: int = 0

    def damage(self, size: int) -> Optional[str]:
        """One clause saying what was damaged in a file of ``size`` bytes (None: nothing)."""
        if size == 0:
            return "the file is empty (truncated to zero, or left empty by an older version)"
        if self.damaged_at < 0:
            return None
        what = []
        if self.corrupt:
            what.append(f"{self.corrupt} damaged line(s)")
        if self.torn:
            what.append("a cut or unreadable end")
        return " and ".join(what)


def scan(data: bytes) -> Scan:
    """Read a journal file's bytes (:class:`Scan`). A last piece without its newline is torn (a
    power cut mid-write, or a tail of NUL bytes: the blocks a lost page cache leaves; the good
    length ends before it); a bad line elsewhere is corrupt (skipped). A line of the header kind
    ``h`` (what a compaction writes first, so that a written journal is never empty) is read and
    not returned."""
    out = Scan([])
    pos = 0
    lines = data.split(b"\n")
    for i, line in enumerate(lines):
        last = i == len(lines) - 1
        if last and not line:
            break
        r = decode(line) if not last else None       # the last piece has no newline: torn
        if r is None:
            if out.damaged_at < 0:
                out.damaged_at = pos
            out.lost_bytes += len(line) + (0 if last else 1)
            if last:
                out.torn += 1
                break
            out.corrupt += 1
        else:
            if r["k"] != "h":
                out.records.append((r, pos + len(line) - 1 if "mark" in r else -1))
        pos += len(line) + 1
    out.good_len = pos
    return out


def apply_record(r: dict, pos: int, entries: dict[int, "Entry"], last_of_boot: dict[str, "Stamp"]) -> None:
    """Apply one record read from the journal (``pos``: its mark's offset) to ``entries`` (n -> Entry)
    and to the newest :class:`Stamp` of each boot."""
    k, n = r.get("k"), r.get("n")
    if not isinstance(n, int):
        return
    if k in ("a", "e", "f") and ("u" in r or "t" in r):
        at = stamp_of(r)
        if at.up >= last_of_boot.get(at.boot, at).up:
            last_of_boot[at.boot] = at
    if k in ("a", "f"):
        req = r.get("req") if isinstance(r.get("req"), dict) else {"id": r.get("id", ""), "text_sha": str(r.get("ts", ""))}
        mark = r.get("mark")
        e = Entry(n=n, at=stamp_of(r), origin=str(r.get("o", "socket")), req=req, tries=int(r.get("tries", 0)),
                  running=bool(r.get("run")) or mark in RUNNING, pos=pos)
        if k == "f":
            e.ev = r.get("ev") if isinstance(r.get("ev"), dict) else {"type": "error", "code": "unknown"}
        elif mark in ENDED:
            e.ev = ended_in_place(e, mark)
        entries[n] = e
    elif n in entries:
        if k in RUNNING:
            entries[n].running = True
        elif k == "w":
            entries[n].running = False
        elif k == "e":
            entries[n].ev = r.get("ev") if isinstance(r.get("ev"), dict) else {"type": "error", "code": "unknown"}


def sort_out(entries: dict[int, Entry], rec: Recovered, keep: int) -> tuple[dict[int, Entry], "OrderedDict[int, Entry]"]:
    """Split the entries read at start (n -> Entry) into ``rec.pending`` (unfinished, accept
    order: one more attempt for those running at the crash) and the newest ``keep`` finished ones
    (``rec.finished``, ``rec.finished_sha``); returns ``(live by n, finished by n)``."""
    for n in sorted(entries):
        e = entries[n]
        if e.ev is None:
            if e.running:            # running when the last run died: one more attempt
                e.tries += 1
                e.running = False
            e.mark = "-"
            rec.pending.append(e)
    done = sorted((e for e in entries.values() if e.ev is not None), key=lambda e: e.n)[-keep:]
    rec.finished = {e.id: e.ev for e in done}
    rec.finished_sha = {e.id: e.text_sha for e in done}
    return {e.n: e for e in rec.pending}, OrderedDict((e.n, e) for e in done)


def ended_in_place(e: "Entry", mark: str) -> dict:
    """The terminal event of a request whose end is known only from its mark (``D``/``X``)."""
    why = "its end was marked in place: the journal could not append its outcome (disk full?)"
    if mark == "D":
        return {"type": "done", "id": e.id, "channel": e.req.get("channel") or "", "ttfb_ms": 0.0, "rtf": 0.0,
                "audio_s": 0.0, "steps": 0, "steps_per_s": 0.0, "output": f"unknown ({why})"}
    return {"type": "error", "id": e.id, "code": "unknown", "message": f"it ended with an error ({why})"}
