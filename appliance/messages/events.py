"""Events the daemon sends to a client (one JSON object per line on the socket, the same objects
on MQTT): :class:`Accepted`, :class:`Started`, :class:`Preempted`, :class:`Replayed`,
:class:`AudioChunk`, :class:`Done`, :class:`ErrorEvent`, :class:`StatusReply`,
:class:`HealthReply`, :class:`Normalized`, :class:`CancelDone`; :data:`EVENT_TYPES` maps their
``type`` to the class, :data:`EventSink` is how they are delivered. The requests, parsing and JSON
helpers are in :mod:`appliance.messages.protocol` (which re-exports these names).
"""

from __future__ import annotations

import typing
from dataclasses import dataclass, field
from typing import Optional



@dataclass(frozen=True)
class Accepted:
    """The request is queued; ``queue_position`` 0 means it starts next. ``waiting``: why it
    cannot start at once (its channel is busy with another request, requests are queued before
    it, the memory budget, the throttle level), else None. ``not_crash_safe``: why it is not in
    the request journal (disk full, read-only, ...): it plays, but a crash or power cut before it
    ends loses it; None when it is journaled (or the journal is off by config)."""

    id: str
    channel: str
    queue_position: int = 0
    waiting: Optional[str] = None
    not_crash_safe: Optional[str] = None
    type: str = "accepted"


@dataclass(frozen=True)
class Preempted:
    """An ``alert`` (id ``by``) interrupted this request on its channel: its synthesis stopped and
    its unplayed audio was dropped. ``action``: ``resume`` (it is queued again and will start from
    the beginning after the alert; ``started`` follows again) or ``drop`` (an ``error`` event with
    code ``preempted`` follows)."""

    id: str
    channel: str
    by: str
    action: str
    type: str = "preempted"


@dataclass(frozen=True)
class Replayed:
    """After a restart, a request accepted before it is found again (see
    :mod:`appliance.service.recovery`): sent on MQTT when it is resubmitted, and to a socket
    client that sends a ``speak`` with its id again (instead of speaking it twice).

    Attributes:
        state: ``queued``, ``running``, ``playing`` (it is being spoken again from its beginning;
            its later events follow), ``done`` or ``error`` (it had ended; that event follows).
    """

    id: str
    channel: str
    state: str
    type: str = "replayed"


@dataclass(frozen=True)
class Started:
    """Synthesis of the request began (its prefill runs)."""

    id: str
    channel: str
    type: str = "started"


@dataclass(frozen=True)
class AudioChunk:
    """Header of a PCM chunk; on the socket ``bytes`` raw bytes follow the line.

    Attributes:
        rate: sample rate in Hz. format: ``float32`` or ``int16`` (little-endian, mono).
    """

    id: str
    bytes: int
    rate: int = 24000
    format: str = "float32"
    type: str = "audio"


@dataclass(frozen=True)
class Done:
    """The request finished.

    Attributes:
        ttfb_ms: time to first audio where the user hears it: from the request's arrival (its line
            read from the socket, its MQTT message, its Wyoming event) to its first sample written
            to the sound device (or to the WAV file / the client's audio), ms; queue wait included.
        synthesis_ttfb_ms: the pipeline's own part: from the start of its synthesis to its first
            PCM chunk, ms.
        rtf: synthesis seconds per second of audio.
        audio_s: seconds of audio produced.
        steps: decode steps run; steps_per_s: their rate.
        output: ``device:<name>`` or the WAV path written.
        seed: the sampling seed used (for reproduction).
        spoken: the text that was spoken, sentence by sentence (after normalization; a sentence
            rewritten by refine-text as rewritten).
        unspeakable: characters of the text that could not be spoken and were skipped;
            unspeakable_names: the same with code point and Unicode name.
        voice: the voice used: its name in config ``voices`` (a request without ``voice``: the
            first name standing for ``synthesis.voice``), else ``seed:N``, ``none`` or
            ``speaker:<first 12 hex digits of the speaker string's sha256>``.
        silent_sentences: indices into ``spoken`` of the sentences that produced no audio (the
            model ended them at their first step); empty when every sentence sounded.
        truncated: each sentence that reached its decode-step cap and was cut there (its end may
            be missing): ``{"sentence": index into spoken, "text": what it was to say, "steps": the
            cap it reached}``; the cap is proportional to the sentence's length (twice its expected
            speech, at least 4 s, at most ``synthesis.max_new_tokens`` or the request's
            ``params.max_new_tokens``); empty when every sentence ended by itself.
        predicted_rtf: the real-time factor its synthesis was predicted to run at when its first
            chunk was made; start_hold_ms: the audio its player held beyond one device wake-up
            before it started (``stream.start_slack_ms``, more where the box could not keep up:
            a later start instead of gaps); start_delay_ms: from its first chunk to its first
            sample at the device, ms (:mod:`appliance.service.startpolicy`; None where unknown).
        pauses: every silence inside its audio at the sound device after it started, in order:
            ``{"sentence": k, "at_s": audio played before it, s, "ms": its length, "where":
            "sentence_boundary" (it held for sentence k because synthesis fell behind) or
            "mid_sentence" (it ran dry inside sentence k: an underrun), "cause": cpu_busy,
            channels, slow or late_sentence}`` (:data:`appliance.service.startpolicy.CAUSES`), with
            ``"whole_sentence": true`` on a boundary pause that waited for the whole sentence (the CPU was gone);
            pause_ms: their sum, ms ([] and 0 where it did not play on a device).
    """

    id: str
    channel: str
    ttfb_ms: float
    rtf: float
    audio_s: float
    steps: int
    steps_per_s: float
    output: str = ""
    seed: Optional[int] = None
    synthesis_ttfb_ms: Optional[float] = None
    spoken: list = field(default_factory=list)
    unspeakable: list = field(default_factory=list)
    unspeakable_names: list = field(default_factory=list)
    voice: Optional[str] = None
    silent_sentences: list = field(default_factory=list)
    truncated: list = field(default_factory=list)
    predicted_rtf: Optional[float] = None
    start_hold_ms: Optional[float] = None
    start_delay_ms: Optional[float] = None
    pauses: list = field(default_factory=list)
    pause_ms: float = 0.0
    type: str = "done"


@dataclass(frozen=True)
class Normalized:
    """Reply to :class:`NormalizeRequest`: ``spoken`` sentences (one generation each) with the
    prompt ``tokens`` of each (limit ``model.max_prompt_tokens``), the decode-step cap of each
    (``steps``), ``unspeakable`` characters and their ``unspeakable_names``, and ``notes``: what
    the normalizer decided (list numbers, emoji, Roman numerals, runs collapsed, codes and links
    shortened), one line each."""

    id: str
    spoken: list = field(default_factory=list)
    tokens: list = field(default_factory=list)
    steps: list = field(default_factory=list)
    notes: list = field(default_factory=list)
    unspeakable: list = field(default_factory=list)
    unspeakable_names: list = field(default_factory=list)
    type: str = "normalized"


@dataclass(frozen=True)
class ErrorEvent:
    """A request failed or was refused. ``code`` is the exception's ``code`` (e.g. ``bad_text``)."""

    code: str
    message: str
    id: Optional[str] = None
    type: str = "error"


@dataclass(frozen=True)
class CancelDone:
    """The end of the reply to a ``cancel``: ``cancelled`` requests were hit (their ids in
    ``ids``). Each of them also ends with an ``error`` ``cancelled`` on its own client's
    connection; the canceller gets that event too (before this one) for requests that are not
    its own. ``id`` / ``channel``: what the cancel asked for; ``scope``: what a cancel by channel
    hit (``current``, ``queue`` or ``all``: ``cancel.scope``, or the default). A cancel that hits
    nothing is answered with one ``error`` (``bad_request``) instead."""

    cancelled: int
    ids: list = field(default_factory=list)
    id: Optional[str] = None
    channel: Optional[str] = None
    scope: Optional[str] = None
    type: str = "cancel_done"


@dataclass(frozen=True)
class StatusReply:
    """Daemon status: channels busy, queues, last timings, throttle level, temperature (C);
    ``memory_mib`` (what counts against the budget on this ``memory_kind`` of box: RSS + NvMap
    on a Jetson ``unified``, the process's device memory on a ``discrete`` GPU, RSS on a ``cpu``;
    MiB) against ``memory_budget_mib`` (``service.memory_budget_mb``); on a discrete GPU also
    ``host_rss_mib`` against ``host_rss_limit_mib`` (``service.host_rss_limit_mb``) and the bare
    CUDA context left out of the budget (``cuda_context_mib``); and
    ``memory_note`` when the runner was sized down at start to fit, or host RSS is over its limit;
    ``memory_all_in_mib``: host RSS + device memory with the CUDA context (RSS + NvMap on a Jetson,
    RSS on a CPU), the one figure comparable across backends and boxes, MiB; ``torch_loaded``:
    whether torch is in the daemon's process (never on the llama.cpp, ONNX Runtime and TensorRT
    paths); ``networks``: which runtime runs each network (``gpt``, ``decoder``, ``vocos``) where,
    and why; ``backend_reason``: why the backend was chosen;
    ``health``: the one verdict (``healthy``, ``degraded``, ``unhealthy``) and ``conditions``, what
    makes it so (each ``name``, ``severity``, ``reason``, ``for_s``: :mod:`appliance.ops.verdict`);
    ``threads``: the CPU threads the runner computes with (None on a GPU) and ``threads_source``
    where that number came from (``model.threads``, the cgroup CPU quota, the affinity mask)."""

    state: str
    backend: str
    channels: dict = field(default_factory=dict)
    last_rtf: Optional[float] = None
    last_ttfb_ms: Optional[float] = None
    throttle: str = "normal"
    temperature_c: Optional[float] = None
    memory_mib: Optional[float] = None
    memory_budget_mib: Optional[float] = None
    memory_kind: Optional[str] = None
    host_rss_mib: Optional[float] = None
    host_rss_limit_mib: Optional[float] = None
    cuda_context_mib: Optional[float] = None
    memory_note: Optional[str] = None
    memory_all_in_mib: Optional[float] = None
    torch_loaded: Optional[bool] = None
    networks: dict = field(default_factory=dict)
    backend_reason: Optional[str] = None
    health: str = "healthy"
    conditions: list = field(default_factory=list)
    threads: Optional[int] = None
    threads_source: Optional[str] = None
    type: str = "status"


@dataclass(frozen=True)
class HealthReply:
    """Result of the field health check (see :mod:`appliance.ops.health`).

    ``limits``: the thresholds it was judged against (``max_rtf``, ``max_ttfb_ms`` in ms,
    ``min_steps_per_s`` (0 = not checked), ``max_memory_mib`` in MiB), from the daemon's own
    config, so a client can show them without reading that config. ``reference``: how the audio
    compared with the reference ``calibrate`` recorded, or why it was not compared (one line).
    ``verdict``: ``healthy``, ``degraded`` or ``unhealthy``; ``conditions``: what makes it so (each
    ``name``, ``severity``, ``reason``, ``for_s``), the check's findings and, from a daemon, every
    condition of the box (:mod:`appliance.ops.verdict`); ``reasons``: their reasons, one line each;
    ``healthy``: no condition."""

    healthy: bool
    rtf: Optional[float] = None
    ttfb_ms: Optional[float] = None
    steps_per_s: Optional[float] = None
    memory_mib: Optional[float] = None
    host_rss_mib: Optional[float] = None
    reasons: list = field(default_factory=list)
    limits: dict = field(default_factory=dict)
    reference: Optional[str] = None
    verdict: str = "healthy"
    conditions: list = field(default_factory=list)
    type: str = "health"


EVENT_TYPES: dict[str, type] = {
    "accepted": Accepted, "preempted": Preempted, "replayed": Replayed, "started": Started, "audio": AudioChunk,
    "done": Done, "error": ErrorEvent, "status": StatusReply, "health": HealthReply, "normalized": Normalized,
    "cancel_done": CancelDone,
}

Event = typing.Union[Accepted, Preempted, Replayed, Started, AudioChunk, Done, ErrorEvent, StatusReply, HealthReply,
                     Normalized, CancelDone]
"""An event the daemon sends to a client."""

EventSink = typing.Callable[[Event], None]
"""``sink(event)``: deliver an event. Thread-safe, never blocks on the network, never raises; a
gone client makes it a no-op. A request's PCM reaches its client through its audio sink
(:mod:`appliance.audio.stream`), which the transport encodes, never through this."""
