"""The benchmarks: what each one asks, how it measures, and the line that reruns it.

``python -m bench list`` prints :data:`BENCHES`; ``python -m bench NAME [options]`` runs one (its
module's ``main(argv)``); every record goes through :mod:`bench.harness`. ``retired`` entries have
records under ``bench/results/`` but no runnable module any more (the history keeps the script).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Bench:
    """One benchmark: ``name`` (the command and the records' ``bench``), ``module`` (under
    ``bench``; None: retired or written by another script), the ``question`` it answers, its
    ``method`` in a paragraph, ``command``: the one line that reproduces its cited figures, ``key``:
    the fields that tell its configurations apart, ``figures``: the fields its table shows,
    ``gpu_command``: the line for its records from a GPU machine (``bench/gpu.sh SUITE``)."""

    name: str
    module: str | None
    question: str
    method: str
    command: str
    key: tuple[str, ...]
    figures: tuple[str, ...]
    where: str = "cpu"
    gpu_command: str = ""


CKPT = "chattts-appliance model random --size full /tmp/ckpt_full"
BENCHES: tuple[Bench, ...] = (
    Bench("step", "step", "How fast is the GPT's decode step on a CPU, per runtime and weight type?",
          "Each candidate (ONNX Runtime INT8/INT4 graphs, OpenVINO, llama.cpp GGUFs) runs the full-size GPT for one "
          "new token per row after P cached positions; candidates are timed in turns (rounds of steps) so a busy "
          "neighbour slows all alike; the host's read bandwidth is measured in the same run with the same threads, "
          "and each step's weight bytes over it give `bandwidth_frac`.",
          "python -m bench step --engines ENG/onnx --llama ENG/llama --work /tmp/step "
          "--candidates ort-int8,llama-q8_0 --positions 64 --batches 1,3 --threads 2",
          ("candidate", "positions", "batch", "threads"), ("ms_per_step", "ratio_vs_first", "bandwidth_frac")),
    Bench("upstream", "upstream", "How fast is upstream ChatTTS 0.2.5's own GPT loop on the same CPU?",
          "Upstream's `GPT.generate` from the unpacked sdist on the same checkpoint, EOS masked; ms per step = "
          "(t(N+2) - t(2)) / N so the prefill cancels. Run it in the same session as `step` or `cpu`.",
          "python -m bench upstream --checkpoint /tmp/ckpt_full --src /tmp/chattts-0.2.5 --batches 1,3",
          ("batch",), ("ms_per_step", "rtf")),
    Bench("cpu", "cpu", "What does the production pipeline do on a CPU: step, first audio, real-time factor, memory?",
          "`Pipeline.from_config` (the backend `select` picks) and its warm-up, then decode steps alone (median of "
          "100), `Pipeline.run` to the first PCM chunk (median of the TTFB runs), the RTF of a long utterance with "
          "where its time went (stages timed in the run and alone), peak RSS; the host's read bandwidth before and "
          "after. Alternate `--tree` checkouts in one session for a side-by-side.",
          "python -m bench cpu --checkpoint /tmp/ckpt_full --engine-dir ENG --backend llama --threads 2",
          ("backend", "precision", "threads"), ("ms_per_step", "ttfb_ms", "rtf", "peak_mem_mib")),
    Bench("service", "service", "When does speech start at a sound device, does it underrun, and how soon does a "
          "third channel join?",
          "The real daemon into a paced ALSA file device (44.1 kHz, the real clock): single-channel sentences "
          "(first audio at the device, underruns, start holds), then two long requests with a third joining; "
          "optionally beside busy loops. One record per `stream.lookahead` mode.",
          "python -m bench service --checkpoint /tmp/ckpt_full --engine-dir ENG --backend llama --runs 5",
          ("backend", "stream_lookahead"), ("ttfb_ms", "synthesis_ttfb_ms", "rtf", "third_ttfb_ms", "underruns_single",
                                            "vmrss_mib"), gpu_command="bench/gpu.sh service"),
    Bench("wyoming", "wyoming_tts", "What does Home Assistant hear over Wyoming, and what does one event announcing "
          "300 MB cost?",
          "The real daemon with its Wyoming server; `wyoming-bench tts --mode both` (its four texts, rounds after a "
          "warm-up) gives time to first audio and RTF; then one hostile event's peak RSS before and after "
          "(`wyoming_payload` records).",
          "python -m bench wyoming --steps 94 --rounds 3",
          ("backend", "mode"), ("ttfb_ms", "total_ms", "rtf", "n")),
    Bench("shipped", "shipped", "What does the box as shipped hold and how fast does it answer, per backend, on one "
          "machine in one run?",
          "`config.yaml` as shipped (paths, Wyoming on, fixed sentence length), a fresh engine dir per candidate "
          "(torch CUDA, llama.cpp + ONNX Runtime), in turns: fresh start (READY incl. calibration, status, all-in "
          "memory = host RSS + NVML GPU memory of the daemon's process tree, libtorch mapped or not), 100 requests, "
          "wyoming-bench; restart: READY and wyoming-bench again; the runner's decode step at B=1/B=3.",
          "bench/gpu.sh shipped",
          ("backend",), ("torch_imported", "memory_mib_all_in_at_ready", "memory_mib_all_in_after_100",
                         "memory_mib_at_ready", "channels_at_ready", "throttle_at_ready", "ready_s",
                         "ready_s_calibrated", "ttfa_ms_fresh", "ttfa_ms_median", "decode_ms_b1", "decode_ms_b3"),
          where="gpu"),
    Bench("memory", "memory", "How much memory does each backend take at each stage of a start, and how long to ready?",
          "Each stage (import, context, loaded, warm, 10 requests) in a fresh process, so `ru_maxrss` is the peak up "
          "to it; RSS and anonymous memory from smaps_rollup; on CUDA the device memory through NVML.",
          "python -m bench memory --checkpoint /tmp/ckpt_full --engine-dir ENG --backends onnxruntime torch-cpu",
          ("backend", "compile"), ("load_peak_rss_mib", "rss_mib", "device_mib", "ready_s"),
          gpu_command="bench/gpu.sh memory"),
    Bench("precision", "precision", "How far is each quantized GPT from FP32 (hidden dB, greedy agreement, PCM)?",
          "Both runners teacher-forced on FP32's greedy codes for the same steps: hidden-state and logit error in dB, "
          "greedy agreement, the first free-running divergence, and the PCM through the FP32 vocoder.",
          "python -m bench precision --checkpoint /tmp/ckpt_full --engine-dir ENG --precisions int8,int4,llama-q8_0",
          ("precision", "reference"), ("hidden_err_db", "logits_err_db", "greedy_agreement", "pcm_err_db_of_peak")),
    Bench("soak", "soak", "Does the daemon lose, duplicate or corrupt anything, or grow, over 1,000 requests?",
          "The real daemon on three paced ALSA file devices, a deterministic mixed workload with cancels, alerts and "
          "bad lines; every returned PCM must appear exactly once in its channel's played stream; RSS against "
          "requests finished.",
          "python -m bench soak --requests 1000",
          ("checkpoint", "precision"), ("requests", "lost", "duplicated", "rss_growth_pct", "ttfb_ms")),
    Bench("throttle", "throttle", "How soon does a box that cooled down speak what it deferred?",
          "The real daemon reading a fixture board: hot (background requests held), then cooled; time to the "
          "request's `started` and to `healthy`, per `throttle.min_dwell_s`, runs interleaved.",
          "python -m bench throttle --runs 3 --dwells 3 30",
          ("telemetry_interval_s",), ("modes",)),
    Bench("gpu", "gpu", "The torch CUDA path: step, first audio, RTF with 1 and 3 channels, copies, FP16 fidelity.",
          "The production path on random full weights (select -> CudaRunner, Pipeline, BatchEngine): start-up, "
          "`runner.step` wall per step at B=1/B=3 and graph replay, TTFB median of 5, RTF per channel, a third "
          "channel joining, the profiler's kernels and copies per chunk, FP16/BF16 greedy codes against FP32.",
          "bench/gpu.sh latency",
          ("backend", "batch"), ("ms_per_step", "ttfb_ms", "rtf", "peak_mem_mib"), where="gpu"),
    Bench("llama", "llama", "Does llama.cpp's CUDA build load with every layer offloaded, and compute the CPU's step?",
          "The GGUF of each type in two contexts of the production shape, all layers on the GPU and none; the same "
          "prefill and step input; step time and the GPU's error against the CPU on logits and hidden states.",
          "bench/gpu.sh llama",
          ("type", "positions", "batch"), ("ms_per_step_gpu", "ms_per_step_cpu", "hidden_db_gpu_vs_cpu",
                                           "greedy_agreement"), where="gpu"),
    Bench("arm64_emulated", None, "Does the whole install and first speech work on arm64 (emulated)?",
          "scripts/arm64_emulated.sh: an arm64 Ubuntu under QEMU user emulation runs the installer's steps and speaks.",
          "scripts/arm64_emulated.sh", ("qemu_cpu",), ("all_ok", "ready_s", "rtf", "emulation_slowdown")),
)
RETIRED = {"aot": "the ahead-of-time compiled step's ready and step time (bench_aot.py)",
           "channels": "1-3 channels in one decode loop on the CPU (bench_channels.py)",
           "engines": "TensorRT builder memory and ONNX Runtime step on the CPU (bench_engines.py)",
           "vocoder_stream": "the vocoder's cost per chunk plan (bench_vocoder.py)",
           "wyoming_payload": "written by `wyoming` (one hostile event)",
           "rebuild_rss": "RSS at READY after a start that exported a corrupt engine again (in a child "
                          "process, or in the daemon as before) against a plain start, in turns (measured by "
                          "hand with the daemon's status, tiny and full-size checkpoints, 2026-12-06)"}
"""Record names without a module of their own: retired benchmarks (their scripts are in the history)."""

BY_NAME = {b.name: b for b in BENCHES}

_H200, _CPU = {"machine": "h200"}, {"machine": "cpu-2core"}
_PLAIN, _COMP = {**_H200, "backend": "torch-cuda"}, {**_H200, "backend": "torch-cuda-compiled"}
_Q8 = {**_CPU, "candidate": "llama-q8_0", "positions": 64, "threads": 2}
_ORT = {**_CPU, "candidate": "ort-int8", "positions": 64, "threads": 2}
_PIPE = {**_CPU, "backend": "llama.cpp", "precision": "q8_0", "threads": 2}
_BOX = {**_H200, "backend": "torch-cuda"}
_H100_LLAMA, _H100_TORCH = ({"machine": "h100", "backend": "llama.cpp"}, {"machine": "h100", "backend": "torch-cuda"})
README_TABLE: tuple = (
    ("newest records (`python -m bench latest`)", "one NVIDIA GPU (H200 unless named), torch 2.11+cu130",
     "2-core x86 CPU, llama.cpp q8_0"),
    ("decode step, B=1 / B=3",
     [("gpu", {**_PLAIN, "batch": 1}, "{ms_per_step:.2f}"), " / ", ("gpu", {**_PLAIN, "batch": 3}, "{ms_per_step:.2f}"),
      " ms (plain CUDA graphs); ", ("gpu", {**_COMP, "batch": 1}, "{ms_per_step:.2f}"), " / ",
      ("gpu", {**_COMP, "batch": 3}, "{ms_per_step:.2f} ms (compiled)")],
     [("step", {**_Q8, "batch": 1}, "{ms_per_step:.1f}"), " / ", ("step", {**_Q8, "batch": 3}, "{ms_per_step:.1f}"),
      " ms at 64 positions (ONNX Runtime INT8: ", ("step", {**_ORT, "batch": 1}, "{ms_per_step:.1f}"), " / ",
      ("step", {**_ORT, "batch": 3}, "{ms_per_step:.1f})")]),
    ("upstream `chattts` 0.2.5, its decode step", [],
     [("upstream", {**_CPU, "batch": 1}, "{ms_per_step:.0f} ms ({date:.10})")]),
    ("first audio, pipeline",
     [("gpu", {**_PLAIN, "batch": 1}, "{ttfb_ms:.1f} ms plain, "), ("gpu", {**_COMP, "batch": 1}, "{ttfb_ms:.1f} ms "
                                                                     "compiled (look-ahead calibrated)")],
     [("cpu", _PIPE, "{ttfb_ms:.0f} ms")]),
    ("first audio at a sound device (the daemon)",
     [("service", {**_H200, "backend": "torch-cuda float16 compile=default", "stream_lookahead": "auto"},
       "{ttfb_ms:.0f} ms compiled, "),
      ("service", {**_H200, "backend": "torch-cuda float16 compile=off", "stream_lookahead": "auto"},
       "{ttfb_ms:.0f} ms plain ({date:.10})")],
     [("service", {**_CPU, "backend": "llama", "precision": "q8_0"},
       "{ttfb_ms:.0f} ms; a third channel {third_ttfb_ms:.0f} ms")]),
    ("Wyoming, `synthesize` to first `audio-chunk`",
     [("shipped", _BOX, "{ttfa_ms_fresh} ms on a fresh box (shipped config), {ttfa_ms_median} ms restarted; first "
                        "request {first_request_ms} ms against a {steady_median_ms} ms median")], []),
    ("real-time factor, one channel", [], [("cpu", _PIPE, "{rtf:.2f} (pipeline)")]),
    ("memory",
     [("shipped", _BOX, "shipped config: {memory_mib_at_ready:.0f} of {budget_mib} MiB at READY, "
                        "{memory_mib_after_100:.0f} after 100 requests, throttle {throttle_after_100}; host RSS "
                        "{host_rss_mib_at_ready:.0f} MiB")],
     [("cpu", _PIPE, "peak RSS {peak_mem_mib:.0f} MiB (pipeline)")]),
    ("the box as shipped on one H100 (`bench/gpu.sh shipped`): all-in memory (host RSS + GPU with its context) "
     "at READY / after 100 requests; Wyoming first audio restarted",
     [("shipped", _H100_LLAMA, "llama.cpp CUDA + ONNX Runtime, no torch: {memory_mib_all_in_at_ready:.0f} / "
                               "{memory_mib_all_in_after_100:.0f} MiB, {ttfa_ms_median:.0f} ms, step "
                               "{decode_ms_b1} / {decode_ms_b3} ms; "),
      ("shipped", _H100_TORCH, "torch CUDA: {memory_mib_all_in_at_ready:.0f} / {memory_mib_all_in_after_100:.0f} "
                               "MiB, {ttfa_ms_median:.0f} ms, step {decode_ms_b1} / {decode_ms_b3} ms ({date:.10})")],
     []),
    ("soak: requests on three channels, lost, duplicated, RSS growth", [],
     [("soak", {**_CPU, "requests": 1000}, "{requests}: {lost} lost, {duplicated} duplicated, RSS {rss_growth_pct:+.2f} %")]),
)
"""README's benchmark table: a header row, then (label, GPU cell, CPU cell); a cell is text pieces and
``(bench, filters, format)`` pieces, each the newest record of ``bench`` whose fields equal ``filters``
formatted with its fields (``python -m bench results`` renders it, a test keeps it current)."""
