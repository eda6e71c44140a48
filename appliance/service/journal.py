"""The request journal: every accepted request is on disk before its client hears ``accepted``.

One append-only file, ``<service.spool_dir>/journal.log``, one record per line::

    <crc32 of the JSON, 8 hex digits> <JSON object>\\n

Records (``k``): ``a`` accepted (``n`` sequence number, ``t`` wall-clock time, ``o`` origin
``socket``/``mqtt``, ``req`` the ``speak`` request with its channel and resolved seed, ``tries``
crashes it was running during, carried over by a compaction; ``run`` 1: it was running when
the compaction wrote it); ``s`` started (synthesis began: running), ``w`` waiting (synthesis over
and not one sample played yet, or back in the queue after a preemption: not running), ``p``
playing (its first sample reached the sound device: running again); ``e`` ended (``ev``: the
terminal ``done``/``error`` event; ``ts``: :func:`text_sha` of its text);
``f`` finished (a compacted ``a`` + ``e`` pair with ``ts``, kept so a client that asks again after
a restart gets the outcome: :class:`~appliance.service.recovery.Recovery` gives it only to a
request of the same id *and* text).

Durability (``journal.fsync``): :meth:`Journal.accept` writes and ``fsync``\\ s the file (and the
directory when the file was created or replaced) before it returns, and the caller sends
``accepted`` only then; :meth:`Journal.end` does the same before the caller sends ``done`` or
``error``, so a request whose ``done`` a client saw is never spoken again. The state records
(``s``, ``w``, ``p``) are advisory (not fsynced).

Crash attempts (``journal.max_attempts``): a request counts one attempt for each crash during
which it was *running*, i.e. its last state record is ``s`` or ``p`` (synthesizing, or sounding
on the device). Requests that were only waiting (accepted and queued, or synthesized and
waiting in their channel's play-out queue behind the one that sounded) are not counted: they
did not take part in the crash. :meth:`Journal.open` adds the attempt.

Reading (:meth:`Journal.open`): a torn last record (power cut mid-write: no newline, bad CRC or
bad JSON) is dropped and the file truncated to the last good record; a bad record elsewhere
(corruption) is skipped and logged. Then the file is compacted: the unfinished requests and
the most recent finished ones are rewritten to ``journal.log.tmp``, fsynced, and renamed over
the journal.

Bounds: the file is compacted again whenever it grows past ``journal.max_bytes``; when the
unfinished requests alone take 90 % of it, :meth:`Journal.accept` refuses with
:class:`~appliance.errors.JournalError`. A write that fails (disk full, read-only file system, I/O
error) refuses the request with that error too, after truncating the partial record away;
requests already accepted keep being spoken (a failed ``e`` record is retried by the next
compaction; until then a crash would speak that request again).

No threads of its own; every method is thread-safe (one lock; the fsync happens under it).
"""

from __future__ import annotations

import collections
import errno
import logging
import os
import threading
import time
from pathlib import Path
from typing import Optional

from ..errors import JournalError
from ..files import fsync_dir
from .records import Entry, Recovered, decode, encode, slim

log = logging.getLogger(__name__)

FILE = "journal.log"
KEEP_FINISHED = 1024
"""Finished requests remembered (ids and outcomes) for clients that ask again after a restart."""
RUNNING = ("s", "p")
"""State records of a running request (synthesizing or sounding): a crash counts an attempt."""
FULL_FRACTION = 0.9
"""Unfinished requests may take this fraction of ``journal.max_bytes`` before new ones are refused."""


class Journal:
    """The journal in ``directory`` (module docstring).

    Args:
        directory: ``service.spool_dir`` (created if missing).
        max_bytes: ``journal.max_bytes``.
        fsync: ``journal.fsync``.
    """

    def __init__(self, directory: Path, max_bytes: int = 4 << 20, fsync: bool = True) -> None:
        self.dir = Path(directory)
        self.path = self.dir / FILE
        self.max_bytes = int(max_bytes)
        self.fsync = fsync
        self._lock = threading.Lock()
        self._fd: Optional[int] = None
        self._size = 0
        self._next = 1
        self._live: dict[int, Entry] = {}
        self._live_bytes = 0
        self._finished: collections.OrderedDict[int, Entry] = collections.OrderedDict()
        self._dirty = False          # an 'e' record could not be written: compact as soon as possible

    # ------------------------------------------------------------------ start

    def open(self) -> Recovered:
        """Read the journal left by the last run, drop a torn tail, compact it, and return what
        was unfinished and what had finished.

        Raises:
            JournalError: the directory or the file cannot be created or written.
        """
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            data = self.path.read_bytes() if self.path.exists() else b""
        except OSError as e:
            raise JournalError(self._why("cannot open the request journal", e)) from e
        rec = Recovered()
        entries: dict[int, Entry] = {}
        pos = 0
        lines = data.split(b"\n")
        for i, line in enumerate(lines):
            last = i == len(lines) - 1
            if last and not line:
                break
            r = decode(line) if not last else None       # the last piece has no newline: torn
            if r is None:
                if last or i == len(lines) - 2 and not lines[-1]:
                    rec.torn += 1
                    log.warning("journal %s: dropping a torn last record (%d bytes; written when the daemon died)",
                                self.path, len(line))
                else:
                    rec.corrupt += 1
                    log.error("journal %s: skipping a damaged record at byte %d (%d bytes)", self.path, pos, len(line))
                pos += len(line) + 1
                continue
            pos += len(line) + 1
            self._apply(r, entries)
        for n in sorted(entries):
            e = entries[n]
            if e.ev is None:
                if e.running:            # running when the last run died: one more attempt
                    e.tries += 1
                    e.running = False
                rec.pending.append(e)
            else:
                rec.finished[e.id] = e.ev
        self._next = max(entries, default=0) + 1
        self._live = {e.n: e for e in rec.pending}
        done = sorted((e for e in entries.values() if e.ev is not None), key=lambda e: e.n)[-KEEP_FINISHED:]
        self._finished = collections.OrderedDict((e.n, e) for e in done)
        rec.finished = {e.id: e.ev for e in done}
        rec.finished_sha = {e.id: e.text_sha for e in done}
        with self._lock:
            self._compact()
        if rec.pending or rec.torn or rec.corrupt:
            log.info("journal %s: %d unfinished request(s), %d finished remembered, %d torn / %d damaged record(s) dropped",
                     self.path, len(rec.pending), len(rec.finished), rec.torn, rec.corrupt)
        return rec

    @staticmethod
    def _apply(r: dict, entries: dict[int, Entry]) -> None:
        k, n = r.get("k"), r.get("n")
        if not isinstance(n, int):
            return
        if k in ("a", "f"):
            req = r.get("req") if isinstance(r.get("req"), dict) else {"id": r.get("id", ""), "text_sha": str(r.get("ts", ""))}
            e = Entry(n=n, t=float(r.get("t", 0.0)), origin=str(r.get("o", "socket")), req=req,
                      tries=int(r.get("tries", 0)), running=bool(r.get("run")))
            if k == "f":
                e.ev = r.get("ev") if isinstance(r.get("ev"), dict) else {"type": "error", "code": "unknown"}
            entries[n] = e
        elif n in entries:
            if k in RUNNING:
                entries[n].running = True
            elif k == "w":
                entries[n].running = False
            elif k == "e":
                entries[n].ev = r.get("ev") if isinstance(r.get("ev"), dict) else {"type": "error", "code": "unknown"}

    # ------------------------------------------------------------------ records

    def accept(self, req: dict, origin: str = "socket") -> int:
        """Record an accepted request durably; returns its sequence number.

        Raises:
            JournalError: the journal is full of unfinished requests, or the write failed (the
                request must then be refused).
        """
        with self._lock:
            n = self._next
            e = Entry(n=n, t=time.time(), origin=origin, req=req)
            line = encode(self._accept_record(e))
            if self._live_bytes + len(line) > FULL_FRACTION * self.max_bytes:
                raise JournalError(
                    f"the request journal {self.path} holds {len(self._live)} unfinished request(s) "
                    f"({self._live_bytes} bytes, journal.max_bytes {self.max_bytes}); wait until some have played "
                    f"or raise journal.max_bytes")
            self._append(line, sync=True)
            self._next += 1
            e.size = len(line)
            self._live[n] = e
            self._live_bytes += len(line)
            self._maybe_compact()
            return n

    def started(self, n: int) -> None:
        """Synthesis of ``n`` began: it is running (a crash from now on counts an attempt;
        advisory, not fsynced). Never raises."""
        self._state(n, "s", sounded=False)

    def synthesized(self, n: int) -> None:
        """Synthesis of ``n`` is over: unless it already sounds, it only waits in its channel's
        play-out queue now (not running). Never raises."""
        self._state(n, "w", unless_sounded=True)

    def sounding(self, n: int) -> None:
        """The first sample of ``n`` reached the sound device (any thread): running until it
        ends. Never raises."""
        self._state(n, "p", sounded=True)

    def requeued(self, n: int) -> None:
        """``n`` is back in its queue (preempted, resumes later): not running. Never raises."""
        self._state(n, "w", sounded=False)

    def end(self, n: int, event: dict) -> None:
        """``n`` is over (played, written or failed): record its terminal event durably, so it
        is never replayed. A failed write is logged and retried by the next compaction. Never raises."""
        with self._lock:
            e = self._live.pop(n, None)
            if e is None:
                return
            self._live_bytes -= e.size
            e.ev = slim(event)
            sha = e.text_sha
            e.req = {"id": e.id, "channel": e.req.get("channel"), "text_sha": sha}   # the text itself is not needed any more
            self._finished[n] = e
            while len(self._finished) > KEEP_FINISHED:
                self._finished.popitem(last=False)
            try:
                self._append(encode({"k": "e", "n": n, "ev": e.ev, "ts": sha}), sync=True)
            except JournalError as err:
                self._dirty = True
                log.error("%s; request %s may be spoken again after a crash", err, e.id)
                return
            self._maybe_compact()

    def _state(self, n: int, k: str, sounded: Optional[bool] = None, unless_sounded: bool = False) -> None:
        with self._lock:
            e = self._live.get(n)
            if e is None or (unless_sounded and e.sounded):
                return
            if sounded is not None:
                e.sounded = sounded
            e.running = k in RUNNING
            try:
                self._append(encode({"k": k, "n": n}), sync=False)
            except JournalError as err:
                log.warning("%s", err)

    def pending_ids(self) -> list[str]:
        """Ids of the unfinished requests, in accept order."""
        with self._lock:
            return [self._live[n].id for n in sorted(self._live)]

    def close(self) -> None:
        """Close the file (records already written stay)."""
        with self._lock:
            if self._dirty:
                self._compact()
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None

    # ------------------------------------------------------------------ internals (lock held)

    @staticmethod
    def _accept_record(e: Entry) -> dict:
        r = {"k": "a", "n": e.n, "t": round(e.t, 3), "o": e.origin, "req": e.req}
        if e.tries:
            r["tries"] = e.tries
        if e.running:
            r["run"] = 1
        return r

    @staticmethod
    def _why(what: str, e: OSError) -> str:
        hint = {errno.ENOSPC: "the file system is full: free space there",
                errno.EDQUOT: "the disk quota is exhausted: free space there",
                errno.EROFS: "the file system is read-only: remount it read-write or move service.spool_dir",
                errno.EACCES: "no permission: the daemon's user must own service.spool_dir",
                errno.EFBIG: "the file grew past the process's file size limit"}.get(e.errno, "check the disk")
        return f"{what} ({e.strerror or e}); {hint} (service.spool_dir)"

    def _open_fd(self) -> None:
        if self._fd is None:
            created = not self.path.exists()
            self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o600)
            self._size = os.fstat(self._fd).st_size
            if created:
                self._sync_dir()

    def _sync_dir(self) -> None:
        if self.fsync:
            fsync_dir(self.dir)

    def _append(self, line: bytes, sync: bool) -> None:
        try:
            self._open_fd()
            done = 0
            while done < len(line):
                done += os.write(self._fd, line[done:])
            if sync and self.fsync:
                os.fdatasync(self._fd)
            self._size += len(line)
        except OSError as e:
            self._truncate_back()
            raise JournalError(self._why(f"cannot write the request journal {self.path}", e)) from e

    def _truncate_back(self) -> None:
        """Cut a partial record away (the next append must start on a fresh line)."""
        if self._fd is None:
            return
        try:
            os.ftruncate(self._fd, self._size)
        except OSError:
            os.close(self._fd)          # reopened (and re-measured) at the next append
            self._fd = None

    def _maybe_compact(self) -> None:
        if self._dirty or self._size > self.max_bytes:
            self._compact()

    def _compact(self) -> None:
        """Rewrite the journal as its live entries plus the remembered finished ones."""
        tmp = self.path.with_name(FILE + ".tmp")
        parts = []
        for e in sorted(self._live.values(), key=lambda e: e.n):
            parts.append(encode(self._accept_record(e)))
            e.size = len(parts[-1])
        self._live_bytes = sum(len(p) for p in parts)
        budget = self.max_bytes - self._live_bytes - 4096
        fin = []
        for e in reversed(self._finished.values()):
            line = encode({"k": "f", "n": e.n, "t": round(e.t, 3), "o": e.origin, "id": e.id, "ev": e.ev, "ts": e.text_sha})
            if len(line) > budget:
                break
            budget -= len(line)
            fin.append((e.n, line))
        body = b"".join(line for _, line in sorted(fin)) + b"".join(parts)
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
            try:
                done = 0
                while done < len(body):
                    done += os.write(fd, body[done:])
                if self.fsync:
                    os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, self.path)
            self._sync_dir()
        except OSError as e:
            try:
                tmp.unlink()
            except OSError:
                pass
            self._dirty = True
            log.error("%s", self._why(f"cannot compact the request journal {self.path}", e))
            return
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        self._size = len(body)
        self._dirty = False


def mark(journal: Optional[Journal], n: Optional[int], state: str) -> None:
    """``journal.<state>(n)`` (``started``, ``synthesized``, ``sounding``, ``requeued``) for a
    journaled request; nothing when the journal is off or the request is not journaled. Never raises."""
    if journal is not None and n is not None:
        getattr(journal, state)(n)
