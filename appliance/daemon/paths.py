"""The directories the daemon writes to, checked (and created) once at start, before the model loads.

``service.socket`` (its directory), ``service.spool_dir`` (the journal), ``audio.wav_dir`` and
``safety.cache_dir`` come from config. A missing directory is created only where that is safe:

* under a directory systemd made for the unit (``$RUNTIME_DIRECTORY``, ``$STATE_DIRECTORY``,
  ``$CACHE_DIRECTORY``, ``$LOGS_DIRECTORY``: ``RuntimeDirectory=`` etc.), or under the config
  file's own directory (where relative paths point);
* otherwise only below an existing directory that is not a system location (``/``, ``/run``,
  ``/var``, ``/etc``, ``/usr``, ``/tmp``, ... and their first level, e.g. ``/run/foo``): a typo
  like ``/run/chattts-applaince/appliance.sock`` is refused with :class:`~appliance.errors.ConfigError`
  naming the key, instead of silently creating ``/run/chattts-applaince`` as root.

The spool, WAV and cache directories must be the box's own: one that other users can write into
(group or other write bit) could hold a planted symlink or a forged journal, so its mode is made
private at start with a warning (:func:`appliance.files.fix_dir_mode`), or, where that is not
allowed (another owner), the start is refused naming the key.

Every path must also be writable by the daemon's user (checked with ``os.access``). A storage
directory that is not (a read-only file system, a wrong owner) does not stop the start, it
degrades the box (:data:`DEGRADED_WITHOUT`, logged as an error): the journal's directory (requests
play, not crash-safe: health ``storage_degraded``), the WAV directory (a request that needs a WAV
file ends with an error naming it), the cache directory (the daemon runs without a cache).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from ..config import Config
from ..errors import ConfigError
from ..files import fix_dir_mode

log = logging.getLogger(__name__)

SYSTEM_DIRS = ("/", "/bin", "/boot", "/dev", "/etc", "/home", "/lib", "/lib64", "/media", "/mnt", "/opt",
               "/proc", "/root", "/run", "/sbin", "/srv", "/sys", "/tmp", "/usr", "/var", "/var/run",
               "/var/lib", "/var/cache", "/var/log", "/var/tmp", "/usr/local", "/usr/share", "/run/user")
"""A missing directory is never created directly in one of these (nor in them, for the top ones)."""

SYSTEMD_DIRS = ("RUNTIME_DIRECTORY", "STATE_DIRECTORY", "CACHE_DIRECTORY", "LOGS_DIRECTORY")

DEGRADED_WITHOUT = {
    "service.spool_dir": "the request journal cannot write there: requests play but are not crash-safe",
    "audio.wav_dir": "a request that needs a WAV file there ends with an error naming it",
    "safety.cache_dir": "running without a cache",
}
"""Directories the box runs without when they cannot be written (module docstring), and what that costs."""

PRIVATE = ("service.spool_dir", "audio.wav_dir", "safety.cache_dir")
"""Directories no other user may write into (:func:`appliance.files.fix_dir_mode`)."""


class NotWritable(ConfigError):
    """A directory exists (or could be made) but this user cannot write it."""


def allowed_roots(cfg: Config, environ=None) -> list[Path]:
    """Directories under which missing directories may be created."""
    env = os.environ if environ is None else environ
    roots = [Path(cfg.base_dir).resolve()]
    for k in SYSTEMD_DIRS:
        for p in (env.get(k) or "").split(":"):
            if p:
                roots.append(Path(p).resolve())
    return roots


def _under(p: Path, root: Path) -> bool:
    return p == root or root in p.parents


def ensure_dir(key: str, d: Path, roots: list[Path]) -> Path:
    """Make sure directory ``d`` (from config key ``key``) exists and is writable.

    Raises:
        ConfigError: it is missing where it may not be created, is not a directory, cannot be
            created, or is not writable (the message names the key and what to do).
    """
    d = Path(os.path.abspath(d))
    if d.is_dir():
        if not os.access(d, os.W_OK | os.X_OK):
            if os.statvfs(d).f_flag & os.ST_RDONLY:
                raise NotWritable(f"{key}: directory {d} is on a read-only file system; remount it read-write "
                                  "or choose another path")
            raise NotWritable(f"{key}: directory {d} is not writable by this user (uid {os.getuid()}); "
                              "fix its owner or choose another path")
        return d
    if d.exists():
        raise ConfigError(f"{key}: {d} exists and is not a directory")
    anc = d.parent
    while not anc.exists():
        anc = anc.parent
    safe = any(_under(d, r) for r in roots)
    if not safe:
        sysdir = str(anc) in SYSTEM_DIRS or str(anc.parent) in ("/", "/etc", "/var", "/usr", "/run")
        safe = not sysdir and anc.is_dir()
    if not safe:
        raise ConfigError(
            f"{key}: directory {d} does not exist and is not created here ({anc} is a system location); "
            f"check the path for a typo, create the directory (owned by the daemon's user), or use a path under "
            f"the unit's RuntimeDirectory/StateDirectory/CacheDirectory (e.g. /run/chattts-appliance, "
            f"/var/lib/chattts-appliance)")
    try:
        d.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise NotWritable(f"{key}: cannot create directory {d}: {e.strerror or e}") from e
    log.info("%s: created %s", key, d)
    return d


def prepare_dirs(cfg: Config, socket_inherited: bool = False, environ=None) -> None:
    """Check and create every directory the daemon writes to (module docstring).

    Raises:
        ConfigError: see :func:`ensure_dir` (not for the directories of :data:`DEGRADED_WITHOUT`
            that only cannot be written: logged).
    """
    roots = allowed_roots(cfg, environ)
    dirs = [("service.spool_dir", cfg.resolve(cfg.service.spool_dir)),
            ("audio.wav_dir", cfg.resolve(cfg.audio.wav_dir))]
    if not socket_inherited:
        dirs.insert(0, ("service.socket", cfg.resolve(cfg.service.socket).parent))
    if cfg.safety.verify_checkpoint:
        dirs.append(("safety.cache_dir", cfg.resolve(cfg.safety.cache_dir)))
    for key, d in dirs:
        try:
            ensure_dir(key, d, roots)
        except NotWritable as e:
            if key not in DEGRADED_WITHOUT:
                raise
            log.error("%s; the box starts anyway: %s", e, DEGRADED_WITHOUT[key])
            continue
        if key in PRIVATE:
            try:
                fix_dir_mode(d, key)
            except PermissionError as e:
                raise ConfigError(str(e)) from e
