"""The wait between two streamed chunks is bounded (``stream.max_chunk_gap_ms``): on a box slower
than real time, with the throttle multiplying the chunk cap, no chunk carries more decode steps
than can be made within the bound at the measured step and window times (Home Assistant's
Wyoming client gives up after 10 s without audio)."""

from __future__ import annotations

from appliance.synth.schedule import ChunkSchedule, start_plan


def test_a_slow_box_with_a_throttled_cap_never_makes_a_chunk_longer_than_the_bound():
    # 3 channels on a slow CPU: 60 ms per step, 300 ms per window; throttle x2: cap 96 steps
    free, bounded = ChunkSchedule(4, 48, 2.0, 0.9), ChunkSchedule(4, 48, 2.0, 0.9, max_gap_s=4.0)
    assert free.next(48, buffered_s=30.0, step_s=0.06, window_s=0.3, scale=2) == 96       # 6.06 s to make
    c = bounded.next(48, buffered_s=30.0, step_s=0.06, window_s=0.3, scale=2)
    assert c == bounded.gap_cap(0.06, 0.3) == 61 and c * 0.06 + 0.3 <= 4.0 < (c + 1) * 0.06 + 0.3
    # short of audio the stream asks for the keep-up size (the cap here): the bound still wins
    assert bounded.next(8, buffered_s=0.1, step_s=0.06, window_s=0.3, scale=4) == 61
    assert bounded.first_chunk(0.06, 0.3) == 48                                          # under the bound
    assert ChunkSchedule(4, 48, 2.0, 0.9, max_gap_s=1.0).first_chunk(0.06, 0.3) == 11   # (1 - 0.3) / 0.06
    # a fast box never meets it, and nothing measured yet means nothing to bound
    assert bounded.next(32, buffered_s=10.0, step_s=0.0008, window_s=0.003, scale=2) == 64
    assert bounded.gap_cap(0.0, 0.0) is None and bounded.next(4, 0.0, 0.0) == 8


def test_the_start_plan_counts_the_bounded_chunks():
    """Smaller chunks at the cap shorten the last chunk's wait: the start hold follows the bound."""
    free, bounded = ChunkSchedule(4, 96, 2.0, 0.9), ChunkSchedule(4, 96, 2.0, 0.9, max_gap_s=2.0)
    a, b = start_plan(free, 0.03, 0.2, 600, 14), start_plan(bounded, 0.03, 0.2, 600, 14)
    assert b.hold_s < a.hold_s and b.predicted_rtf > a.predicted_rtf    # more windows, less held per chunk


def test_the_config_bound_reaches_the_engine(tiny_config):
    import dataclasses

    from appliance.synth.pipeline import Pipeline

    cfg = dataclasses.replace(tiny_config, stream=dataclasses.replace(tiny_config.stream, max_chunk_gap_ms=2500.0))
    p = Pipeline.from_config(cfg)
    try:
        assert p.engine.schedule.max_gap_s == 2.5
    finally:
        p.close()
