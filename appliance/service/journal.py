"""The request journal: a safety net under every accepted request, never a gate in front of it.

One append-only file, ``<service.spool_dir>/journal.log``, one record per line::

    <crc32 of the JSON, 8 hex digits> <JSON object>[ <mark>]\\n

Records (``k``): ``a`` accepted (``n`` sequence number, ``t``/``b``/``u`` when:
:class:`~appliance.service.records.Stamp`, ``o`` origin ``socket``/``mqtt``, ``req`` the ``speak``
request with its channel and resolved seed, ``tries`` crashes it was running during, carried over
by a compaction), followed by its *mark*, one byte the journal overwrites in place as the request
moves (``-`` queued, ``s`` synthesizing, ``w`` synthesized and not sounding yet or re-queued, ``p``
sounding; ``D``/``X`` ended, written only when its ``e`` record could not be appended); ``e``
ended (``ev``: the terminal ``done``/``error`` event; ``ts``: :func:`text_sha` of its text);
``f`` finished (a compacted ``a`` + ``e`` pair with ``ts``, kept so a client that asks again after
a restart gets the outcome: :class:`~appliance.service.recovery.Recovery` gives it only to a
request of the same id *and* text). Journals of earlier versions (state records ``s``, ``w``,
``p`` appended, no marks, wall-clock times only) are read the same way.

Order and age: by the sequence number ``n`` (never by a clock), and by ``CLOCK_BOOTTIME`` within
a boot (:func:`~appliance.service.records.age_s`): a wall clock stepped back to 1970 or forward
neither drops nor replays an entry.

Durability (``journal.fsync``): :meth:`Journal.accept` writes and ``fsync``\\ s the file (and the
directory when the file was created or replaced) before it returns, and the caller sends
``accepted`` only then; :meth:`Journal.end` does the same before the caller sends ``done`` or
``error``, so a request whose ``done`` a client saw is never spoken again. Marks of the running
states are advisory (not fsynced).

When the disk is full or read-only (docs/guarantees.md restates this): :meth:`accept` raises
:class:`~appliance.errors.JournalError` and the caller plays the request anyway, telling its
client it is not crash-safe (``accepted.not_crash_safe``); :attr:`Journal.condition` says why
until a write succeeds again (health's reads try a compaction every :data:`RETRY_S` meanwhile),
and health says ``storage_degraded`` as long as the file system has less than
:data:`MIN_FREE_BYTES` free, write or not. A request that *ends* while the journal cannot append is marked
ended in place (its accept record's mark: an overwrite needs no free space on a file system that
does not copy on write), so it is never replayed, clean stop or crash, however long the disk stays
full; only if that overwrite fails too is it logged as "may be spoken again after a crash". A
journal that can be read but not written at start replays nothing (it could not mark a replay
ended: replaying would repeat the request at every start); one that cannot be read at all is set
aside and the box runs without it.

Crash attempts (``journal.max_attempts``): a request counts one attempt for each crash during
which it was *running* (mark ``s`` or ``p``: synthesizing, or sounding on the device). Requests
that were only waiting (queued, or synthesized and waiting behind the one that sounded) did not
take part in the crash. :meth:`Journal.open` adds the attempt.

Reading (:meth:`Journal.open`): a journal that cannot be read whole (a cut last line, a tail or
a body of NUL bytes, a bad checksum in the middle, a file truncated to zero: what a power cut
leaves) is set aside (renamed ``journal.log.<k>.corrupt`` and kept, the newest four), one WARNING
names the file, the byte offset of the damage, the records recovered and the bytes that could not
be read, and health says ``journal_recovered`` (degraded) until the next clean compaction (when the
journal next grows past ``journal.max_bytes``; a restart with a clean journal clears it too); every
intact record is used, under the replay policy.
Then the file is compacted (a header record, the unfinished and recently finished requests,
written to a private temporary file, fsynced, renamed over the journal: :mod:`appliance.files`),
again whenever it grows past ``journal.max_bytes`` (retried at most every :data:`RETRY_S` after a
failure). When unfinished requests alone take 90 % of it, :meth:`accept` raises as for a full
disk. Only the daemon that holds the spool's lock opens it (:mod:`.journal_lock`).

No threads of its own; every method is thread-safe (one lock; the fsync happens under it).
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from pathlib import Path
from typing import Callable, Optional

from ..core import Condition, ConditionFlag
from ..errors import JournalError
from ..files import space_problem
from .journal_file import JournalFile
from .records import RUNNING, Entry, Recovered, Stamp, apply_record, encode, scan, slim, sort_out

log = logging.getLogger(__name__)

FILE = "journal.log"
KEEP_FINISHED = 1024
"""Finished requests remembered (ids and outcomes) for clients that ask again after a restart."""
FULL_FRACTION = 0.9
"""Unfinished requests may take this fraction of ``journal.max_bytes`` before new ones are not journaled."""
RETRY_S = 5.0
"""Seconds (monotonic) between compactions after one failed (a full disk fails them all)."""
MIN_FREE_BYTES = 64 * 1024
"""Below this much free space on the spool's file system the journal counts as unable to take
the next record (health ``storage_degraded``), as the WAV directory's check does."""
HEADER = encode({"k": "h", "v": 1})
"""The first record of every compacted journal (so a written journal is never empty)."""


class Journal:
    """The journal in ``directory`` (module docstring).

    Args:
        directory: ``service.spool_dir`` (created if missing).
        max_bytes: ``journal.max_bytes``.
        fsync: ``journal.fsync``.
        clock: monotonic clock, s (tests).
    """

    def __init__(self, directory: Path, max_bytes: int = 4 << 20, fsync: bool = True,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.dir = Path(directory)
        self.path = self.dir / FILE
        self.max_bytes = int(max_bytes)
        self.fsync = fsync
        self._lock = threading.Lock()
        self._file = JournalFile(self.path, fsync)
        self._next = 1
        self._live: dict[int, Entry] = {}
        self._live_bytes = 0
        self._finished: collections.OrderedDict[int, Entry] = collections.OrderedDict()
        self._dirty = False          # compact as soon as possible (an end is not in the file yet)
        self._clock = clock
        self._retry_at = 0.0         # clock() before which a failed compaction is not retried
        self._fault: Optional[str] = None
        self._flag = ConditionFlag("storage_degraded")
        self._damage = ConditionFlag("journal_recovered")
        self._dead = False           # unreadable at start: set aside

    @property
    def condition(self) -> Optional[str]:
        """Why the journal cannot write now (disk full, read-only, full of unfinished requests,
        unreadable at start), or None while it writes. Requests still play meanwhile, not
        crash-safe (health: ``storage_degraded``)."""
        return self._fault

    def conditions(self) -> tuple[Condition, ...]:
        """Health's view (a :data:`~appliance.core.ConditionSource`): ``storage_degraded`` while
        :attr:`condition` is set or the spool's file system cannot take the next record (less
        than :data:`MIN_FREE_BYTES` free, read-only: :func:`~appliance.files.space_problem`, one
        ``statvfs``); ``journal_recovered`` after a damaged journal was set aside at start, until
        the next clean compaction. While :attr:`condition` is set and the file system has room,
        at most every :data:`RETRY_S`, the journal is compacted (rewritten whole, fsynced: the
        write it needs anyway), so the condition clears once the disk takes writes again, with no
        request in between; not while a request holds the journal, nor for a journal set aside
        at start or full of unfinished requests."""
        space = None if self._dead else space_problem(self.dir, MIN_FREE_BYTES)
        if self._fault is not None and space is None and not self._dead and self._clock() >= self._retry_at \
                and self._lock.acquire(blocking=False):
            try:
                if self._fault is not None and self._live_bytes <= FULL_FRACTION * self.max_bytes:
                    dirty = self._dirty
                    self._compact()
                    if self._fault is None:
                        log.info("request journal %s writes again", self.path)
                    else:
                        self._dirty = dirty
            finally:
                self._lock.release()
        if self._fault is None:
            self._flag.update(None if space is None else
                              f"{space}: the request journal may not take the next request; requests play but may "
                              f"not be crash-safe")
        return self._flag() + self._damage()

    def _set_fault(self, reason: Optional[str]) -> None:
        self._fault = reason
        self._flag.update(None if reason is None else f"{reason}; requests play but are not crash-safe")

    # ------------------------------------------------------------------ start

    def open(self) -> Recovered:
        """Read the journal left by the last run, set a damaged one aside, compact it, and return
        what was unfinished and what had finished. Never raises: a journal that cannot be read or
        written is reported (:attr:`condition`) and replays nothing (module docstring)."""
        try:
            data = self._file.read()
        except JournalError as e:
            self._dead = True
            self._set_fault(str(e))
            log.error("%s; running without it: requests play but are not crash-safe", self._fault)
            return Recovered()
        sc = scan(data or b"")
        damage = sc.damage(len(data)) if data is not None else None
        rec = Recovered(torn=sc.torn, corrupt=sc.corrupt, damaged_at=max(sc.damaged_at, 0) if damage else -1,
                        records=len(sc.records), lost_bytes=sc.lost_bytes)
        entries: dict[int, Entry] = {}
        for r, pos in sc.records:
            apply_record(r, pos, entries, rec.last_of_boot)
        self._live, self._finished = sort_out(entries, rec, KEEP_FINISHED)
        self._next = max(entries, default=0) + 1
        self._live_bytes = sum(e.size for e in rec.pending)
        with self._lock:
            self._file.size = sc.good_len
            if damage:
                self._set_aside(rec, damage, len(data or b""))
            self._compact(at_open=True)
            writable = self._fault is None or (not damage and self._file.truncate(sc.good_len))
        if rec.pending and not writable:
            log.error("journal %s: %d unfinished request(s) NOT replayed: the journal cannot record that they "
                      "ended (%s), so each would be spoken again at every start", self.path, len(rec.pending), self._fault)
            rec.pending = []
        if rec.pending or damage:
            log.info("journal %s: %d unfinished request(s), %d finished remembered", self.path, len(rec.pending),
                     len(rec.finished))
        return rec

    def _set_aside(self, rec: Recovered, damage: str, size: int) -> None:
        """A damaged journal (lock held): rename it ``.corrupt`` (kept), one WARNING with the
        figures, health ``journal_recovered`` until the next clean compaction."""
        try:
            rec.set_aside = str(self._file.set_aside())
            kept = f"set aside as {rec.set_aside}"
        except OSError as e:
            kept = f"could not be set aside ({e.strerror or e})"
        what = (f"request journal {self.path} ({size} bytes) is damaged at byte {rec.damaged_at}: {damage}; "
                f"{rec.records} record(s) recovered, {rec.lost_bytes} byte(s) could not be read")
        log.warning("%s; %s; %d unfinished request(s) recovered are handled once (a power cut?)", what, kept,
                    sum(1 for e in self._live.values()))
        self._damage.set(f"{what}; {kept}; clears at the next clean compaction of the journal")

    # ------------------------------------------------------------------ records

    def accept(self, req: dict, origin: str = "socket") -> int:
        """Record an accepted request durably; returns its sequence number.

        Raises:
            JournalError: it could not be recorded (full of unfinished requests, disk full,
                read-only, I/O error; :attr:`condition` says so until a write succeeds): the
                caller plays the request anyway, not crash-safe.
        """
        with self._lock:
            if self._dead:
                raise JournalError(self._fault or "the request journal is off")
            n = self._next
            e = Entry(n=n, at=Stamp.now(), origin=origin, req=req)
            line = encode(self._accept_record(e), "-")
            if self._live_bytes + len(line) > FULL_FRACTION * self.max_bytes:
                self._set_fault(f"the request journal {self.path} holds {len(self._live)} unfinished request(s) "
                                f"({self._live_bytes} bytes, journal.max_bytes {self.max_bytes}); raise journal.max_bytes")
                raise JournalError(self._fault)
            e.pos = self._append(line, sync=True) + len(line) - 2
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
        is never replayed; when that cannot be appended, mark it ended in place (module
        docstring). Never raises."""
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
            now = Stamp.now()
            try:
                self._append(encode({"k": "e", "n": n, "ev": e.ev, "ts": sha, "t": round(now.wall, 3),
                                     "b": now.boot, "u": round(now.up, 3)}), sync=True)
            except JournalError as err:
                if self._mark(e, "D" if e.ev.get("type") == "done" else "X", sync=True):
                    log.warning("%s; request %s is marked ended in place (it will not be spoken again)", err, e.id)
                else:
                    self._dirty = True
                    log.error("%s; request %s may be spoken again after a crash", err, e.id)
                return
            self._maybe_compact()

    def _state(self, n: int, mark: str, sounded: Optional[bool] = None, unless_sounded: bool = False) -> None:
        with self._lock:
            e = self._live.get(n)
            if e is None or (unless_sounded and e.sounded):
                return
            if sounded is not None:
                e.sounded = sounded
            e.running, e.mark = mark in RUNNING, mark
            if e.pos < 0:                # an entry of an older journal not compacted yet: a state record
                try:
                    self._append(encode({"k": mark, "n": n}), sync=False)
                except JournalError as err:
                    log.debug("%s", err)
            else:
                self._mark(e, mark, sync=False)

    def pending_ids(self) -> list[str]:
        """Ids of the unfinished requests, in accept order."""
        with self._lock:
            return [self._live[n].id for n in sorted(self._live)]

    def close(self) -> None:
        """Close the file (records already written stay)."""
        with self._lock:
            if self._dirty and not self._dead:
                self._compact()
            self._file.close()

    # ------------------------------------------------------------------ internals (lock held)

    @staticmethod
    def _accept_record(e: Entry) -> dict:
        r = {"k": "a", "n": e.n, "t": round(e.at.wall, 3), "b": e.at.boot, "u": round(e.at.up, 3),
             "o": e.origin, "req": e.req}
        if e.tries:
            r["tries"] = e.tries
        return r

    def _append(self, line: bytes, sync: bool) -> int:
        """:meth:`JournalFile.append`, keeping :attr:`condition` (set on a failure, cleared by a success)."""
        try:
            at = self._file.append(line, sync)
        except JournalError as e:
            self._set_fault(str(e))
            raise
        if self._fault is not None:
            log.info("request journal %s writes again (it failed: %s)", self.path, self._fault)
            self._set_fault(None)
        return at

    def _mark(self, e: Entry, mark: str, sync: bool) -> bool:
        """Overwrite ``e``'s mark byte in place (no new space); False where that failed."""
        return e.pos >= 0 and self._file.overwrite(e.pos, mark.encode("ascii"), sync)

    def _maybe_compact(self) -> None:
        if (self._dirty or self._file.size > self.max_bytes) and self._clock() >= self._retry_at:
            self._compact()

    def _compact(self, at_open: bool = False) -> None:
        """Rewrite the journal as a header record, the remembered finished requests and the
        live entries; a success after the one at :meth:`open` clears ``journal_recovered``."""
        fin = []
        budget = self.max_bytes - sum(e.size for e in self._live.values()) - 4096
        for e in reversed(self._finished.values()):
            line = encode({"k": "f", "n": e.n, "t": round(e.at.wall, 3), "b": e.at.boot, "u": round(e.at.up, 3),
                           "o": e.origin, "id": e.id, "ev": e.ev, "ts": e.text_sha})
            if len(line) > budget:
                break
            budget -= len(line)
            fin.append((e.n, line))
        body = bytearray(HEADER + b"".join(line for _, line in sorted(fin)))
        pos = {}
        for e in sorted(self._live.values(), key=lambda e: e.n):
            line = encode(self._accept_record(e), e.mark)
            body += line
            pos[e.n] = (len(body) - 2, len(line))
        try:
            self._file.rewrite(bytes(body))
        except JournalError as e:
            self._dirty = True
            self._retry_at = self._clock() + RETRY_S
            if str(e) != self._fault:            # retried every RETRY_S: said once
                log.error("%s", e)
            self._set_fault(str(e))
            return
        for n, (p, size) in pos.items():
            self._live[n].pos, self._live[n].size = p, size
        self._live_bytes = sum(size for _, size in pos.values())
        self._dirty = False
        self._set_fault(None)
        if self._damage() and not at_open:
            log.info("request journal %s compacted cleanly after the damage found at start", self.path)
            self._damage.clear()


def mark(journal: Optional[Journal], n: Optional[int], state: str) -> None:
    """``journal.<state>(n)`` (``started``, ``synthesized``, ``sounding``, ``requeued``) for a
    journaled request; nothing when the journal is off or the request is not journaled. Never raises."""
    if journal is not None and n is not None:
        getattr(journal, state)(n)


def storage_conditions(journal: Optional[Journal]) -> Callable[[], tuple[Condition, ...]]:
    """The journal's :meth:`Journal.conditions` as a health source; nothing when the journal is off."""
    return journal.conditions if journal is not None else tuple
