"""The configuration's sections: frozen dataclasses, one per ``config.yaml`` section.

Each field's ``help`` metadata is its documentation (with units); ``config.yaml`` in the
repository root shows every key (a test compares the two).
"""

from __future__ import annotations

import functools
import hashlib
import os
import re
import socket
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Optional, Union


def _f(default: Any, help: str, **kw: Any) -> Any:
    """A dataclass field with a documentation string (``help``) and optional checks.

    Keyword checks: ``choices`` (allowed values), ``min`` / ``max`` (inclusive bounds),
    ``nonempty`` (text that is not blank), ``path`` (a file or directory: not blank, no NUL),
    ``host`` (a host name or address: not blank, no spaces or '/'); ``hint`` is added to the error
    message of a value that fails them (e.g. ``"0 = unlimited"``). ``null`` in the file means the
    default (:mod:`appliance.config.loader`).
    """
    if isinstance(default, (list, dict, tuple)) and not isinstance(default, tuple):
        return field(default_factory=lambda: default, metadata={"help": help, **kw})
    return field(default=default, metadata={"help": help, **kw})


# --------------------------------------------------------------------------------------------
# sections
# --------------------------------------------------------------------------------------------


Lookahead = Union[Literal["auto", "exact"], int]
"""``stream.lookahead``: ``auto``, ``exact``, or a number of decode steps (an int; a YAML string of
digits is read as one)."""


@dataclass(frozen=True)
class ModelConfig:
    """Where the checkpoint is and how it runs."""

    path: str = _f("models/chattts", "Checkpoint directory holding asset/ (official 2Noise/ChatTTS layout). Relative paths are relative to the config file.", path=True)
    backend: str = _f("auto", "Inference backend: auto (tensorrt if plans are built and a GPU is there, else torch on CUDA, else llama (a GGUF export under model.engine_dir/llama/), else onnxruntime), tensorrt, llama, onnxruntime or torch.", choices=("auto", "tensorrt", "llama", "onnxruntime", "torch"))
    device: str = _f("auto", "Device for the torch backend: auto, cpu or cuda (llama backend: a CUDA build of llama.cpp puts the GPT on the GPU unless cpu).", choices=("auto", "cpu", "cuda"))
    dtype: str = _f("auto", "Weight/compute precision for the torch backend: auto (float16 on a GPU, float32 on a CPU), float32, float16, bfloat16. The Decoder and Vocos stay float32 on a GPU.", choices=("auto", "float32", "float16", "bfloat16"))
    threads: int = _f(0, "CPU threads for inference: one budget for the GPT, the Decoder and Vocos, which run one after another (onnxruntime / torch intra-op). 0 = from the CPU set the process may use: its cgroup CPU quota, rounded down (systemd CPUQuota=, docker --cpus), and its affinity mask (taskset, CPUAffinity=); the log and status say the count and where it came from.", min=0, max=256)
    max_batch: int = _f(3, "Batch slots of the static KV cache (= channels decoded together).", min=1, max=16)
    max_seq_len: int = _f(2048, "KV-cache length per slot, in tokens (prompt + generated codes).", min=64, max=4096)
    max_prompt_tokens: int = _f(256, "Longest prompt (text tokens incl. control tokens) fed to one prefill; longer text is split into sentences.", min=16, max=1024)
    engine_dir: str = _f("engines/build", "Directory holding ONNX graphs / TensorRT plans and their manifest (relative to the config file).", path=True)
    compile: str = _f("auto", "torch CUDA path: how the decode step inside its CUDA graphs is made fast. auto: the ahead-of-time compiled step (AOTInductor packages in model.engine_dir/aot, built once by 'chattts-appliance engines compile' for this GPU, checkpoint, torch and config) when one matches, else plain CUDA graphs with the reason logged: a start never compiles; a package set is loaded once in a child process first, and one that crashes torch's loader there (packages compiled by a C++ compiler other than the system's: build with CXX=/usr/bin/g++) is recorded beside it and skipped. off: plain CUDA graphs. default / max-autotune-no-cudagraphs: torch.compile at every start (minutes cold; kernels cached in model.engine_dir/torch_compile). H200: 0.82 ms/step compiled (torch.compile), 1.60 plain (bench/RESULTS.md).", choices=("auto", "off", "default", "max-autotune-no-cudagraphs"))
    spin_wait: bool = _f(False, "CPU (ONNX Runtime sessions: the GPT on onnxruntime, the vocoder on both CPU backends): true: worker threads spin between the parallel sections of a run and stop when it returns; false (default): they sleep when idle. Measured in the whole pipeline on the 2-core host (bench/RESULTS.md, four rounds interleaved, quiet to loaded): sleeping gave the lower RTF in every round (0.56 against 0.60 quiet, 0.80-1.39 against 1.32-2.46 loaded): spinning wins a step measured alone on an idle box, and loses as soon as anything else wants the cores.")
    llama_precision: str = _f("auto", "llama.cpp (CPU) GPT weights to load from model.engine_dir/llama/: auto (the first exported of q8_0, q4_k_m, q4_0, f16, f32), or one GGUF type; engines/README.md states each one's error and speed. The Decoder and Vocos run FP32 on ONNX Runtime.", choices=("auto", "q8_0", "q4_k_m", "q4_0", "f16", "f32"))
    llama_kv_cache: str = _f("auto", "llama.cpp KV cache: auto (default: q8_0 where the GPT is offloaded to a GPU, whose flash attention reads it at full speed; f16 on the CPU), f16 or q8_0 (0.53x the bytes, with flash attention: 3 x 2048 positions hold 191 instead of 360 MiB: the daemon's RSS was 787-790 MiB in bench/bench_service.py, 169 MiB less than with f16; but llama.cpp's attention over a q8_0 cache is slower on x86: at 512 positions a one-row step took 1.4-1.5x, a three-row step 1.7-1.8x the f16 cache's CPU time; its error against f16: hidden states -45 dB, PCM -41 dB). engines/README.md.", choices=("auto", "f16", "q8_0"))
    onnx_precision: str = _f("auto", "ONNX Runtime (CPU) weights to load from model.engine_dir/onnx/: auto (int8 if exported, else fp32), int8 (the GPT's weights 8-bit), int4 (4-bit, block 32: fewer bytes per step, a larger error; bench/RESULTS.md states both) or fp32. The Decoder and Vocos run FP32 in every one.", choices=("auto", "int8", "int4", "fp32"))
    rebuild_engines: bool = _f(True, "At start, a built engine (ONNX graphs, GGUF) that fails its sha256 or no longer matches the config or checkpoint is exported again into engine_dir when torch is installed (minutes on a small box); false, or no torch: the next backend that can run is used (health: engine_fallback).")

    def torch_dtype(self, gpu: bool) -> str:
        """``dtype`` with ``auto`` resolved: ``float16`` on a GPU, ``float32`` on a CPU."""
        if self.dtype != "auto":
            return self.dtype
        return "float16" if gpu else "float32"

    quant: str = _f("auto", "Weight-only quantization of the GPT linears on the torch CUDA path: auto (FP16/BF16 weights, INT8 where the memory fit needs them: service.memory_budget_mb), none, int8 or fp8 (fp8 needs sm >= 8.9). Saves weight memory; not faster there (bench/RESULTS.md).", choices=("auto", "none", "int8", "fp8"))


@dataclass(frozen=True)
class SynthesisConfig:
    """Default sampling parameters (upstream InferCodeParams defaults); requests may override."""

    temperature: float = _f(0.3, "Sampling temperature for audio codes.", min=1e-4, max=5.0)
    top_p: float = _f(0.7, "Nucleus (top-P) probability mass kept (applied before top-K).", min=1e-4, max=1.0)
    top_k: int = _f(20, "Top-K codes kept (at least 3 are always kept, as upstream).", min=1, max=626)
    repetition_penalty: float = _f(1.05, "Multiplicative penalty per repeat over the last 16 codes of a codebook; 1 = off.", min=1.0, max=5.0)
    min_new_tokens: int = _f(0, "End-of-sequence is masked before this many codes.", min=0, max=4096)
    max_new_tokens: int = _f(2048, "Ceiling in decode steps for EACH SENTENCE, not for the whole request (46.875 steps = 1 s of audio). Each sentence gets a cap proportional to its length (twice its expected speech at 4.5 Chinese characters or 2.5 English words per second, at least 4 s), at most this; a longer text is cut into sentences that fit it (and model.max_prompt_tokens). A sentence that reaches its cap is cut there, logged and named in done.truncated. A request's params.max_new_tokens may lower it.", min=1, max=4096)
    prompt: str = _f("[speed_5]", "Control tokens put before every sentence (e.g. [speed_5][oral_2]).")
    voice: str = _f("seed:2", "Default voice: 'seed:N' (random speaker from upstream's spk_stat, reproducible), or an upstream speaker string.")
    seed: Optional[int] = _f(None, "Default sampling seed (0 <= seed < 2**63); None = a fresh seed per request (reported in the reply).", min=0, max=2**63 - 1)
    refine_text: bool = _f(False, "Run upstream's refine-text GPT pass first: the GPT in text mode rewrites each sentence, adding [uv_break]/[laugh]/[lbreak] (adds up to 384 decode steps of latency before the first audio; torch CPU backend only).")
    refine_prompt: str = _f("", "Control tokens for refine-text, e.g. [oral_2][laugh_0][break_6] (upstream RefineTextParams.prompt).")
    emoji: str = _f("drop", "Emoji, emoticons (:) ^_^ <3) and kaomoji in the text: drop (not spoken; each listed in done.unspeakable, an emoji as one cluster) or name (said by a short meaning in the language of the words beside it: a thumbs-up emoji is 'thumbs up' / 拇指向上, ^_^ 'smile' / 微笑).", choices=("drop", "name"))
    list_numbers: str = _f("speak", "The numbers of an ordered list's items (1. Hello): speak (said in their item's language, joined to its text: 'one, Hello', 二、你好) or drop.", choices=("speak", "drop"))


@dataclass(frozen=True)
class StreamConfig:
    """How decode steps become PCM chunks."""

    chunk_tokens: int = _f(48, "Largest streamed chunk, in decode steps (48 steps = 1.02 s of audio); chunks grow from first_chunk_tokens up to this.", min=1, max=512)
    first_chunk_tokens: int = _f(4, "Decode steps in the first chunk of a request (smaller: earlier first audio; 4 steps = 85 ms of audio).", min=1, max=512)
    chunk_growth: float = _f(2.0, "Each next chunk is this many times the previous one (capped by chunk_tokens and by what the audio already queued can cover: the device never waits); 1 = fixed chunks.", min=1.0, max=8.0)
    realtime_share: float = _f(0.9, "Share of real time the stream may spend making audio when it sizes chunks (measured step and window times): a first chunk grows until the second one is made before it has played.", min=0.1, max=1.0)
    start_slack_ms: float = _f(80.0, "One scheduling hiccup that the start of a stream absorbs, ms: a request's first chunk covers the making of the second plus this, and the sound device starts a streaming request only once it holds one device wake-up plus this (a loaded box otherwise pauses right after the first syllable). Where the box cannot keep up with a request at all, the start waits further (done.start_hold_ms).", min=0.0, max=2000.0)
    max_chunk_gap_ms: float = _f(4000.0, "The longest one streamed chunk may take to make at the measured decode step and vocoder window times, ms: a client that receives audio as it is made (Wyoming: Home Assistant gives up after 10 s without any) never waits longer between two chunks, whatever the throttle's chunk_scale or a slow box asks for; 0 = no bound.", min=0.0, max=60000.0)
    lookahead: Lookahead = _f("auto", "Right context (decode steps) a chunk waits for before its audio is committed: auto (the value 'chattts-appliance calibrate' measured for this checkpoint, backend and precision; exact when there is none), exact (the Decoder's and Vocos' theoretical receptive field: 53 steps at full size), or a number of steps.")
    lookahead_threshold_db: float = _f(-60.0, "Calibration: the largest PCM error, relative to the signal peak, that a shorter look-ahead may cause (dB; -60 is inaudible).", min=-160.0, max=-20.0)
    calibrate_at_start: bool = _f(True, "With lookahead auto: a start that finds no calibration for its engines (a fresh box, engines rebuilt, another checkpoint) measures the look-ahead itself before it serves, records it beside the engines with the health check's reference, and streams with it (on the H200 20.6 s, 14 steps; a CPU box's installer calibrates when it exports). false: serve with the exact look-ahead until 'chattts-appliance calibrate' has run.")
    sample_format: str = _f("float32", "PCM sample format of chunks: float32 or int16.", choices=("float32", "int16"))


@dataclass(frozen=True)
class AudioConfig:
    """Where PCM goes."""

    output: str = _f("auto", "auto (sound device if one exists, else wav), device or wav.", choices=("auto", "device", "wav"))
    device: Optional[str] = _f(None, "Sound device: an ALSA card id or name (found under whatever card index it has now), or part of the PortAudio device name (its (hw:N,M) suffix ignored); None = the system default.")
    sample_rate: Optional[int] = _f(None, "Output rate in Hz; None = the device's default rate (PCM is resampled from 24000 Hz).", min=8000, max=192000)
    wav_dir: str = _f("out", "Directory for WAV output (relative to the config file).", path=True)
    latency_ms: float = _f(100.0, "Output stream latency (buffer) in ms.", min=5.0, max=2000.0)
    same_device: str = _f("mix", "Channels that share one sound device: mix (their requests sound at once, summed and clipped to [-1, 1]) or serialize (one request at a time, in start order).", choices=("mix", "serialize"))
    on_device_error: str = _f("wav", "A request whose sound device is down or busy (when it starts, or failing under it): wav (finish it into a WAV file), wait (hold it until the device returns, bounded by max_waiting and max_wait_s, then device_lost) or fail (end it at once with device_lost or device_busy).", choices=("wav", "wait", "fail"))
    max_waiting: int = _f(16, "on_device_error: wait: most requests held per device; one more ends at once with device_lost/device_busy.", min=0, max=1024)
    max_wait_s: float = _f(300.0, "on_device_error: wait: longest a request waits for its device, s; then it ends with device_lost/device_busy (nothing played or written).", min=1.0, max=86400.0)
    preroll_ms: float = _f(0.0, "Silence played when a device's stream (re)opens, before any request's audio, ms: for sinks that wake late (HDMI, Bluetooth, an amplifier in standby lose the first syllable otherwise); 0 for always-on hardware. Per channel: channels[].preroll_ms.", min=0.0, max=5000.0, hint="ms, e.g. 300")
    drain_ms: float = _f(0.0, "Silence that must follow the last audio before a device's stream is closed (idle, a re-listing, shutdown), ms: for sinks that cut their last buffer when closed; 0 for always-on hardware. Per channel: channels[].drain_ms.", min=0.0, max=5000.0, hint="ms, e.g. 200")
    idle_close_s: float = _f(30.0, "Close a sound device's stream after this long without a request, s (an open silent stream wakes the daemon every period); the next request opens it again, finding its route again, after preroll_ms of silence. 0 = keep it open.", min=0.0, max=86400.0, hint="s, e.g. 30; 0 = never")
    volume_db: float = _f(0.0, "Play-out gain on the sound devices, dB, added to each channel's volume_db (0 = as synthesized; a gain above 0 that would clip is clipped to [-1, 1]). Applied by a reload (SIGHUP) without a restart, also to the audio already queued; WAV files and clients (Wyoming, return_audio) get the synthesized level.", min=-60.0, max=12.0, hint="dB, e.g. -6")


@dataclass(frozen=True)
class ChannelConfig:
    """One output channel (e.g. driver, passenger, cabin)."""

    name: str = _f("main", "Channel name used in requests.", nonempty=True)
    device: Optional[str] = _f(None, "Sound device for this channel (as audio.device: ALSA card id or name, or part of the device name); None = audio.device.")
    queue_len: int = _f(16, "Queued requests per channel before 'busy'.", min=1, max=1024)
    on_preempt: str = _f("resume", "What an alert does to the item it interrupts: resume (play it again after) or drop.", choices=("resume", "drop"))
    on_disconnect: str = _f("cancel", "What happens to a socket client's queued, running or playing requests when it closes its connection: cancel (synthesis stops within a decode step, unplayed audio is dropped) or finish (they are spoken anyway). A client that only half-closes (shutdown of its write side) and still reads is not gone.", choices=("cancel", "finish"))
    volume_db: float = _f(0.0, "This channel's play-out gain on its sound device, dB, added to audio.volume_db; applied by a reload (SIGHUP) without a restart.", min=-60.0, max=12.0, hint="dB, e.g. -6")
    preroll_ms: Optional[float] = _f(None, "audio.preroll_ms for this channel's device (channels on one device: the largest); None = audio.preroll_ms.", min=0.0, max=5000.0)
    drain_ms: Optional[float] = _f(None, "audio.drain_ms for this channel's device (channels on one device: the largest); None = audio.drain_ms.", min=0.0, max=5000.0)


@dataclass(frozen=True)
class ServiceConfig:
    """The daemon's local interface and limits."""

    socket: str = _f("/run/chattts-appliance/appliance.sock", "UNIX socket path (relative paths: to the config file).", path=True)
    socket_mode: int = _f(0o660, "File mode of the socket (write it as octal in YAML: 0660).", min=0, max=0o777)
    socket_group: Optional[str] = _f(None, "Group of the socket file (a name or a number): its members may connect (with socket_mode 0660); the socket's directory, where the daemon's user owns it, is made 0750 with this group. The daemon's user must be a member (SupplementaryGroups= in the unit). None = the daemon's own group.")
    max_connections: int = _f(64, "Most socket connections open at once; one more is answered with one 'busy' error line and closed.", min=1, max=65536)
    max_connections_per_client: int = _f(16, "Most socket connections one client process (its pid, from the kernel) may hold open at once, so that one client cannot take every place; one more is answered 'busy' and closed.", min=1, max=65536)
    idle_timeout_s: float = _f(300.0, "A socket connection with no request in flight that sends nothing for this long is closed, s; 0 = never.", min=0.0, max=86400.0)
    max_bad_lines_per_min: int = _f(30, "Malformed request lines (not JSON, unknown fields, too long) one socket connection may send per minute, each answered bad_request; beyond it the first is answered rate_limited and the rest are dropped unanswered until the budget refills. 0 = no budget.", min=0, max=1 << 20)
    bad_input_log_s: float = _f(60.0, "Repeated bad input (malformed lines, rate-limited requests, refused or idle connections) is logged as one summary line per client per this many seconds, with counts; each single malformed line only at DEBUG.", min=1.0, max=86400.0)
    max_text_chars: int = _f(4000, "Longest accepted text in characters.", min=1, max=100000)
    max_line_bytes: int = _f(65536, "Longest accepted request line in bytes.", min=256, max=16 * 1024 * 1024)
    max_buffered_ms: int = _f(30000, "Most return_audio audio one socket connection holds that its client has not read yet, ms (appliance.audio.stream: the same rule as wyoming.max_buffered_ms). A client that stops reading has the request that goes over it cancelled (logged); synthesis never waits for a client. One chunk longer than this is still sent.", min=1000, max=600000, hint="ms of audio, e.g. 30000")
    channels: tuple = _f((ChannelConfig(),), "Output channels (list of {name, device, queue_len, on_preempt, on_disconnect, volume_db, preroll_ms, drain_ms}).")
    memory_budget_mb: int = _f(1500, "Memory budget, MiB, counted as the hardware holds it: on a Jetson (unified memory) RSS + NvMap (the GPU's allocations); on a desktop GPU the process's device memory (NVML: weights, KV caches, activations and the CUDA context); on a CPU the RSS. At start, before anything is compiled or captured, max_seq_len (then max_batch) is lowered to fit or the start refused.", min=64, max=1 << 20)
    host_rss_limit_mb: int = _f(2048, "Desktop GPUs only: the limit of the daemon's host RSS, MiB (torch's CUDA libraries alone hold about 0.7 GiB of host memory). Reported by status and health; health is unhealthy above it. Jetson and CPU boxes count RSS in memory_budget_mb instead.", min=64, max=1 << 20)
    warmup: bool = _f(True, "Synthesize a short sentence before READY.")
    wav_keep_files: int = _f(200, "WAV output: most request files (<id>.wav) kept in audio.wav_dir; after each file is written (and at start) the oldest beyond this are deleted. 0 = unlimited.", min=0, max=1 << 30, hint="a number of files; 0 = unlimited")
    wav_max_mib: float = _f(512.0, "WAV output: most MiB the request files (<id>.wav) in audio.wav_dir may take together; the oldest beyond it are deleted (the file just written is always kept). 0 = unlimited.", min=0.0, max=float(1 << 30), hint="MiB, e.g. 512; 0 = unlimited")
    max_hold_s: float = _f(120.0, "Longest a request waits held by the throttle (a hot box, low memory, power, a slow RTF) before it ends with error 'throttled' naming the level and the resource, s (monotonic clock; time queued behind another request on its channel does not count).", min=1.0, max=86400.0)
    spool_dir: str = _f("spool", "Directory of the request journal (journal.log): every accepted request is written there durably before 'accepted' and kept until it has played, so it survives a stop, a crash or a power cut (relative to the config file; systemd: under /var/lib/chattts-appliance).", path=True)
    spool_lock_wait_s: float = _f(60.0, "One daemon owns service.spool_dir (a lock file, spool.lock, taken before the journal is opened, whatever the socket): a second one waits this long for it (e.g. while the first drains after SIGTERM), then exits with status 75 naming the owner's pid. Keep it below the unit's TimeoutStopSec, s.", min=0.0, max=3600.0)


@dataclass(frozen=True)
class MQTTConfig:
    """MQTT input (paho-mqtt 2.x)."""

    enabled: bool = _f(False, "Connect to a broker.")
    host: str = _f("localhost", "Broker host.", host=True)
    port: int = _f(1883, "Broker port.", min=1, max=65535)
    username: Optional[str] = _f(None, "User name.")
    password: Optional[str] = _f(None, "Password (never logged, nor shown in error messages).", secret=True)
    tls: bool = _f(False, "Use TLS.")
    ca_file: Optional[str] = _f(None, "CA bundle for TLS.", path=True)
    topic_prefix: str = _f("chattts", "Topics are <prefix>/<device_id>/{say,cancel,health,status,event,availability} (no '+', '#', NUL; not empty).")
    device_id: Optional[str] = _f(None, "This box's id in topics and Home Assistant's device registry; unique per box (no '/', '+', '#', NUL). None = derived once per box: <hostname>-<6 hex digits of a digest of /etc/machine-id> (see MQTTConfig.box_id).")
    keepalive_s: int = _f(30, "MQTT keepalive in seconds.", min=5, max=3600)
    max_payload_bytes: int = _f(65536, "Largest accepted command payload.", min=64, max=16 * 1024 * 1024)
    client_id: Optional[str] = _f(None, "MQTT client id; None = chattts-<device_id>.", nonempty=True)
    clean_session: bool = _f(False, "False: the broker keeps subscriptions and queues QoS 1 commands while the daemon is disconnected (they are spoken after the reconnect).")
    reconnect_min_s: int = _f(1, "First reconnect delay after losing the broker, s (doubles up to reconnect_max_s).", min=1, max=3600)
    reconnect_max_s: int = _f(60, "Longest reconnect delay, s.", min=1, max=3600)
    status_interval_s: float = _f(30.0, "Retained status is republished at least this often, s (and at once on change).", min=1.0, max=86400.0)
    dedup_ids: int = _f(1024, "Recent say ids remembered to drop redelivered duplicates.", min=16, max=1 << 20)
    discovery: bool = _f(True, "Publish Home Assistant MQTT discovery configs (retained): the box as one device with say, stop, voice, sensors (service.mqtt_discovery).")
    discovery_prefix: str = _f("homeassistant", "Home Assistant's discovery prefix; its <prefix>/status 'online' makes the box publish the configs again.")
    suggested_area: Optional[str] = _f(None, "Home Assistant discovery: the area the device is put in when it is first added (e.g. Kitchen); None = none suggested.")
    configuration_url: Optional[str] = _f(None, "Home Assistant discovery: a link shown on the device page (http://, https:// or homeassistant://), e.g. the box's admin page; None = no link.")

    @property
    def box_id(self) -> str:
        """``device_id``, or the derived default when it is None (:func:`default_device_id`)."""
        return self.device_id if self.device_id is not None else default_device_id()


_ID_UNSAFE = re.compile(r"[^A-Za-z0-9_-]+")


@functools.lru_cache(maxsize=1)
def default_device_id(machine_id_file: str = "/etc/machine-id") -> str:
    """This box's default ``mqtt.device_id``: the host name (characters outside
    ``[A-Za-z0-9_-]`` become ``-``, lower case) and, when ``machine_id_file`` is readable, ``-`` and
    the first 6 hex digits of ``sha256("chattts-appliance:" + machine id)``. The host name alone
    collides where boxes keep the image's name (``ubuntu``); the machine id is unique per install
    and is hashed with an application key, as ``machine-id(5)`` asks, instead of being published.
    Stable across restarts; changes when the host name or the machine id changes."""
    host = _ID_UNSAFE.sub("-", socket.gethostname()).strip("-").lower() or "box"
    try:
        mid = open(machine_id_file, encoding="ascii", errors="replace").read().strip()
    except OSError:
        mid = ""
    if not mid:
        return host
    return f"{host}-{hashlib.sha256(f'chattts-appliance:{mid}'.encode()).hexdigest()[:6]}"


@dataclass(frozen=True)
class TelemetryConfig:
    """Temperature, memory and power readings that drive throttling."""

    source: str = _f("auto", "auto, tegrastats, jtop, nvml, sysfs or none.", choices=("auto", "tegrastats", "jtop", "nvml", "sysfs", "none"))
    interval_s: float = _f(2.0, "Seconds between readings.", min=0.1, max=3600)
    root: str = _f("/", "Filesystem root under which /sys and /proc are read (a container that mounts the host's at /host sets /host; relative paths: to the config file).", path=True)


@dataclass(frozen=True)
class HealthConfig:
    """Field health check thresholds."""

    sentence: str = _f("今天天气很好，我们去公园散步吧。", "Reference sentence.", nonempty=True)
    max_rtf: float = _f(1.0, "Unhealthy above this real-time factor.", min=0.0, max=1000)
    max_ttfb_ms: float = _f(1500.0, "Unhealthy above this time to first audio byte, ms.", min=0.0, max=1e7)
    at_start: bool = _f(True, "Run the check once after warm-up.")
    min_steps_per_s: float = _f(0.0, "Unhealthy below this many decode steps per second (46.875 = real time at batch 1); 0 = not checked.", min=0.0, max=1e6)
    max_memory_mib: Optional[float] = _f(None, "Unhealthy above this memory use (RSS, plus GPU memory on a GPU), MiB; None = service.memory_budget_mb.", min=1.0, max=1 << 22)
    timeout_s: float = _f(300.0, "Give up (unhealthy) when the check takes longer than this, s.", min=1.0, max=86400.0)


@dataclass(frozen=True)
class ThrottleConfig:
    """Self-throttling with hysteresis (:mod:`appliance.ops.throttle`): levels normal ->
    reduced_channels -> queue_low_priority -> alerts_only, driven by temperature, memory, power
    and measured RTF. Thresholds go up at once and come down once the signals have been below
    the level for ``min_dwell_s``."""

    enabled: bool = _f(True, "Throttle at all (False: always 'normal').")
    trip_c: Optional[float] = _f(None, "Temperature where the board throttles its own clocks, C; None = the lowest passive trip point of the tj/gpu/cpu/soc thermal zones (read from /sys/class/thermal), else fallback_trip_c.", min=20.0, max=150.0)
    fallback_trip_c: float = _f(95.0, "trip_c when the board reports no passive trip point, C.", min=20.0, max=150.0)
    reduce_margin_c: float = _f(15.0, "reduced_channels at trip_c - this, C.", min=0.0, max=100.0)
    queue_margin_c: float = _f(8.0, "queue_low_priority at trip_c - this, C.", min=0.0, max=100.0)
    alerts_margin_c: float = _f(3.0, "alerts_only at trip_c - this, C.", min=0.0, max=100.0)
    temp_hysteresis_c: float = _f(5.0, "A temperature level is left only this far below its threshold, C.", min=0.0, max=50.0)
    mem_reduce_frac: float = _f(0.85, "reduced_channels when the appliance uses this fraction of service.memory_budget_mb.", min=0.0, max=10.0)
    mem_queue_frac: float = _f(0.95, "queue_low_priority at this fraction of the memory budget.", min=0.0, max=10.0)
    mem_alerts_frac: float = _f(1.05, "alerts_only at this fraction of the memory budget.", min=0.0, max=10.0)
    mem_hysteresis_frac: float = _f(0.05, "Hysteresis of the memory-budget fraction.", min=0.0, max=1.0)
    min_available_mb: float = _f(256.0, "Free memory as the box sees it (MemAvailable, tegrastats RAM, or a cgroup's limit less its use, whichever is least) below this -> queue_low_priority, below half of it -> alerts_only, MiB (GPU allocations cannot use swap). The threshold is the larger of this and min_available_frac of the memory total.", min=0.0, max=1 << 20)
    min_available_frac: float = _f(0.10, "The same threshold as a fraction of the memory total (the cgroup's limit when smaller): 0.10 on a 7.6 GB Jetson is 778 MiB; 0 = min_available_mb alone.", min=0.0, max=0.9)
    power_limit_mw: Optional[float] = _f(None, "Input power (VDD_IN, or the sum of the rails) at which channels are reduced, mW; 10% above it queue_low_priority; None = power not used.", min=100.0, max=1e7)
    power_hysteresis_mw: float = _f(500.0, "Hysteresis of the power thresholds, mW.", min=0.0, max=1e6)
    rtf_reduce: float = _f(0.9, "Measured RTF (compute s per audio s, per channel) above this -> reduced_channels.", min=0.01, max=100.0)
    rtf_queue: float = _f(1.2, "Measured RTF above this -> queue_low_priority.", min=0.01, max=100.0)
    rtf_hysteresis: float = _f(0.3, "Hysteresis of the RTF thresholds.", min=0.0, max=100.0)
    min_dwell_s: float = _f(2.0, "Seconds every signal must stay below the current level before the level comes down, straight to the level the signals ask for (going up is immediate; each signal's hysteresis band keeps a value at a threshold from flapping).", min=0.0, max=86400.0)
    reduced_channels: int = _f(1, "Channels synthesized at once at reduced_channels and above.", min=1, max=16)
    chunk_scale: int = _f(2, "stream.chunk_tokens is multiplied by this at queue_low_priority and above (fewer, larger chunks).", min=1, max=16)


@dataclass(frozen=True)
class VoiceConfig:
    """One named voice (top-level ``voices``): a request's ``voice`` may be its name on every
    transport (socket, MQTT, ``say --voice``, Wyoming; the MQTT voice select's options)."""

    name: str = _f("default", "Voice name used in requests and shown to clients (1-64 letters of any script, digits, '-', '_', '.').")
    voice: Optional[str] = _f(None, "'seed:N' (random speaker from upstream's spk_stat) or an upstream speaker string; None = synthesis.voice.")
    description: str = _f("", "Text shown beside the name; '' = the voice string (or 'synthesis.voice').")


WyomingVoiceConfig = VoiceConfig
"""The old name of :class:`VoiceConfig` (the table was ``wyoming.voices``)."""


@dataclass(frozen=True)
class WyomingConfig:
    """A Wyoming TTS server (Home Assistant's Wyoming integration), :mod:`appliance.transports.wyoming_server`.
    Its requests go through the same scheduler as socket and MQTT requests, on ``channel``."""

    enabled: bool = _f(False, "Serve the Wyoming protocol on the URIs below.")
    uris: tuple = _f(("tcp://0.0.0.0:10200",), "Where to listen: tcp://HOST:PORT and/or unix://PATH (relative paths: to the config file). 10200 is the port Home Assistant suggests for TTS.")
    channel: Optional[str] = _f(None, "Channel (service.channels[].name) whose queue Wyoming requests join; None = the first channel.")
    priority: str = _f("normal", "Priority of Wyoming requests on that channel: alert, normal or background.", choices=("alert", "normal", "background"))
    play: bool = _f(False, "Also play the audio on the channel's sound device (or WAV file); False = it only goes back to the Wyoming client.")
    streaming: bool = _f(True, "Advertise supports_synthesize_streaming: text streamed in synthesize-chunk events is spoken sentence by sentence as it arrives. False: streamed text is collected and spoken at synthesize-stop (the events are always answered).")
    zeroconf: bool = _f(False, "Advertise the first tcp:// URI as _wyoming._tcp.local. over mDNS so Home Assistant discovers it (needs the zeroconf package). A loopback address (tcp://127.0.0.1:...) is advertised with a warning: Home Assistant on another machine needs tcp://0.0.0.0:PORT or the box's LAN address.")
    zeroconf_name: Optional[str] = _f(None, "mDNS service name; None = chattts-<hostname>. Another box already advertising it: this one takes the name with a number added (logged, and in health while it differs).", nonempty=True)
    max_payload_bytes: int = _f(1 << 20, "Most bytes of data + payload one Wyoming event may announce (clients send text, a few KB); a bigger event is refused with an error and its connection closed before any of it is read. Its header line is bounded by service.max_line_bytes.", min=1024, max=64 * 1024 * 1024, hint="bytes, e.g. 1048576")
    max_buffered_ms: int = _f(30000, "Most audio one connection holds for its client that the client has not read yet, ms (float32 at 24 kHz until written: 96 bytes per ms, 2.8 MiB at 30000; appliance.audio.stream). A client that stops reading has the request that goes over it cancelled (logged) and the rest of that utterance is not spoken; synthesis never waits for a client. One chunk longer than this is still sent.", min=1000, max=600000, hint="ms of audio, e.g. 30000")
    start_timeout_s: float = _f(5.0, "A request the box cannot start within this long (held by the throttle, queued behind other requests on its channel) is cancelled and answered with an error event naming why (throttled, busy), s: Home Assistant gives up after 10 s without a word (its satellites after about 2 s of silence). 0 = wait as other requests do (service.max_hold_s).", min=0.0, max=86400.0)
    write_timeout_s: float = _f(10.0, "A client that takes no data for this long while the box has some for it (frozen, or gone without closing) is disconnected and its requests cancelled, s; also the kernel's bound on unacknowledged data (TCP_USER_TIMEOUT).", min=1.0, max=3600.0)
    keepalive_s: float = _f(15.0, "TCP keepalive of Wyoming connections: the first probe after this many idle seconds, then every third of it; three unanswered probes close the connection (a client gone without a word is found in about twice this).", min=1.0, max=7200.0)


@dataclass(frozen=True)
class JournalConfig:
    """Crash-safe accepted requests (:mod:`appliance.service.journal`): what is replayed after a
    restart. The journal file lives in ``service.spool_dir``."""

    enabled: bool = _f(True, "Journal accepted requests (fsync before 'accepted') and speak the unfinished ones after a restart; false: a stop or crash loses queued and running requests.")
    max_bytes: int = _f(4 * 1024 * 1024, "Largest journal file, bytes: it is compacted (finished requests dropped) when it grows past this; when the unfinished requests alone fill 90 % of it, new requests are played without being journaled (accepted.not_crash_safe).", min=65536, max=1 << 30)
    max_age_s: float = _f(3600.0, "An unfinished request accepted longer ago than this is not replayed after a restart (logged), s.", min=1.0, max=30 * 86400.0)
    alert_max_age_s: float = _f(30.0, "An unfinished alert accepted longer ago than this is not replayed (a stale warning is worse than none), s.", min=0.0, max=30 * 86400.0)
    max_attempts: int = _f(3, "A request that was synthesizing or playing during this many crashes in a row is not replayed again (it may be what crashes the daemon).", min=1, max=100)
    fsync: bool = _f(True, "fsync the journal file (and its directory) before 'accepted' and before 'done'; false trades the power-cut guarantee for fewer writes.")


@dataclass(frozen=True)
class SafetyConfig:
    """Integrity checks, the per-request watchdog and client limits."""

    verify_checkpoint: bool = _f(True, "Check the sha256 of every weight file as it is loaded: the checkpoint's files against SHA256SUMS.json beside asset/ (else upstream's published sums), ONNX graphs, their data and TensorRT plans against their manifest.json; a mismatch refuses to start and names the file.")
    cache_dir: str = _f("cache", "A directory for the daemon's caches; relative to the config file; systemd: /var/cache/chattts-appliance. (Checkpoint sums are no longer cached: a cache keyed by size and mtime cannot see bit rot.)", path=True)
    stall_s: float = _f(60.0, "A request that is synthesizing but made no progress (no decode step, no audio) for this long is ended with engine_error and its slot freed, s.", min=1.0, max=86400.0)
    max_requests_per_s: float = _f(5.0, "Requests (speak, health) one socket client (peer process) may send per second on average; more get 'rate_limited'. 0 = no limit.", min=0.0, max=1e6)
    request_burst: int = _f(20, "Requests a client may send at once before max_requests_per_s applies.", min=1, max=1 << 20)
    reverify_mib_per_s: float = _f(8.0, "While the daemon runs, re-hash the weight files the backend verified at load (checkpoint, ONNX data, TensorRT plans) at this rate, MiB/s, and fail the health check naming a file that changed (8: the 1.2 GB checkpoint every ~2.5 min, ~1 % of a core). 0 = off.", min=0.0, max=4096.0)


@dataclass(frozen=True)
class Config:
    """The whole configuration. Build it with :func:`load_config` or ``Config()`` for defaults."""

    model: ModelConfig = field(default_factory=ModelConfig)
    synthesis: SynthesisConfig = field(default_factory=SynthesisConfig)
    stream: StreamConfig = field(default_factory=StreamConfig)
    audio: AudioConfig = field(default_factory=AudioConfig)
    service: ServiceConfig = field(default_factory=ServiceConfig)
    mqtt: MQTTConfig = field(default_factory=MQTTConfig)
    telemetry: TelemetryConfig = field(default_factory=TelemetryConfig)
    health: HealthConfig = field(default_factory=HealthConfig)
    throttle: ThrottleConfig = field(default_factory=ThrottleConfig)
    wyoming: WyomingConfig = field(default_factory=WyomingConfig)
    journal: JournalConfig = field(default_factory=JournalConfig)
    safety: SafetyConfig = field(default_factory=SafetyConfig)
    voices: tuple = _f((VoiceConfig(),), "Named voices (list of {name, voice, description}), the same names on every transport: a request's voice may be a name; Wyoming offers them (the first is its default) and they are the options of the MQTT voice select. wyoming.voices is accepted as an old name for this list.")
    base_dir: str = field(default=".", metadata={"help": "Directory that relative paths are resolved against (set by load_config; not a YAML key)."})
    source: str = field(default="", metadata={"help": "The file this config was read from ('' when built in code; set by load_config; not a YAML key)."})

    @property
    def file_hint(self) -> str:
        """The config file to name in messages (``source``, else ``<base_dir>/config.yaml``)."""
        return self.source or str(Path(self.base_dir) / "config.yaml")

    def resolve(self, p: str) -> Path:
        """Return ``p`` as an absolute path, relative paths taken from :attr:`base_dir`."""
        q = Path(os.path.expanduser(p))
        return q if q.is_absolute() else (Path(self.base_dir) / q).resolve()


