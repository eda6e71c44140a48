"""One exception tree for the whole appliance.

Every error a user or a sender can meet is an :class:`ApplianceError`. Each class carries a
short machine-readable ``code`` that the service layer sends back in ``error`` replies
(socket and MQTT alike), so a client can branch on it without parsing the message.
Messages name the limit or the bad value and say what to do.

Foreign errors (onnxruntime status codes, CUDA errors, OSError from audio devices) are turned
into these exceptions in one wrapper per foreign library, never scattered through the code.
"""

from __future__ import annotations


class ApplianceError(Exception):
    """Base of every error raised on purpose by the appliance."""

    code = "internal"


class ConfigError(ApplianceError):
    """``config.yaml`` is missing, unreadable, has an unknown key or a bad value.

    The message names the key (dotted path, e.g. ``synthesis.top_p``).
    """

    code = "bad_config"


class CheckpointError(ApplianceError):
    """A checkpoint directory does not have the ChatTTS layout, or a tensor is missing,
    unexpected or of the wrong shape. The message names the file and the key."""

    code = "bad_checkpoint"


class IntegrityError(CheckpointError):
    """A weight file's bytes differ from the sha256 recorded for it (a checkpoint file against
    ``SHA256SUMS.json`` or upstream's map, an ONNX graph, its external data or a TensorRT plan
    against the engine's ``manifest.json``): bit rot, a truncated or overwritten copy. The message
    names the file, the expected and the actual digest and what to do. Raised at load (the
    file is hashed as it is read) and reported by the background re-verification."""

    code = "integrity_error"


class FetchError(ApplianceError):
    """Downloading the official checkpoint failed (hub unreachable, checksum mismatch)."""

    code = "fetch_failed"


class RequestError(ApplianceError):
    """A request is malformed: bad JSON, not UTF-8, unknown field, wrong type."""

    code = "bad_request"


class TextError(RequestError):
    """The text cannot be spoken: empty, only punctuation, too long, or it holds characters
    that cannot be spoken (the message lists them)."""

    code = "bad_text"


class SpeakerError(RequestError):
    """A speaker string is malformed (not base16384, not LZMA, wrong length)."""

    code = "bad_speaker"


class UnknownChannelError(RequestError):
    """The request names a channel that config does not define."""

    code = "unknown_channel"


class BusyError(ApplianceError):
    """A queue is full or the memory budget does not admit the request now. Retry later."""

    code = "busy"


class RateLimitError(BusyError):
    """A client sent more requests than ``safety.max_requests_per_s`` (with
    ``safety.request_burst``) allows. Retry later."""

    code = "rate_limited"


class ThrottledError(BusyError):
    """A request held by the throttle (heat, memory, power, a slow box) for ``service.max_hold_s``
    without starting; the message names the level and the resource."""

    code = "throttled"


class InsufficientMemoryError(BusyError):
    """The box is short of memory (its free memory or the appliance's budget): only requests of
    the priorities it still serves are accepted; the message says which and what was read."""

    code = "insufficient_memory"


class SpoolBusyError(ApplianceError):
    """Another daemon owns ``service.spool_dir`` (its lock) and did not let go in time: this
    one exits without opening the journal, with :attr:`exit_status` (not 2: systemd may start
    it again once the other is gone)."""

    code = "spool_busy"
    exit_status = 75


class JournalError(ApplianceError):
    """The request journal cannot record a request durably (disk full, read-only, I/O error,
    or full of unfinished requests): the request is refused, accepted ones keep playing."""

    code = "journal_error"


class CancelledError(ApplianceError):
    """The request was cancelled (by id or by channel) before it finished."""

    code = "cancelled"


class PreemptedError(CancelledError):
    """An ``alert`` on the same channel interrupted the request and the channel's
    ``on_preempt`` is ``drop``."""

    code = "preempted"


class EmptyResultError(ApplianceError):
    """The model produced no audio code before end-of-sequence (reported, never retried in a
    loop)."""

    code = "empty_result"


class EngineError(ApplianceError):
    """An inference backend failed (foreign status code wrapped here) or an engine is
    unusable."""

    code = "engine_error"


class EngineMismatchError(EngineError):
    """An engine's manifest does not match this device, runtime version or checkpoint.
    The message says what to rebuild."""

    code = "engine_mismatch"


class CapacityError(ApplianceError):
    """A request exceeds an engine limit (prompt length, KV-cache length, batch)."""

    code = "over_capacity"


class AudioDeviceError(ApplianceError):
    """The sound device is missing, busy or failed."""

    code = "audio_device"


class DeviceLostError(AudioDeviceError):
    """The request's sound device is gone (unplugged, or never found) and ``audio.on_device_error``
    does not complete it elsewhere: it was not played. The message says what was looked for and
    what was found."""

    code = "device_lost"


class DeviceBusyError(AudioDeviceError):
    """The request's sound device is there but another process holds it (retried, then given up):
    it was not played. The message says which device and what holds it, where known."""

    code = "device_busy"


class NoSpaceError(ApplianceError):
    """A file the request needs (its WAV file) cannot be written: the disk is full or the quota is
    exhausted. No partial file is left under its name."""

    code = "no_space"
