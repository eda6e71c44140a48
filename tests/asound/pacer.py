"""Read stdin at a fixed byte rate and append it to a file (the clock of the test sound card).

Usage: pacer.py BYTES_PER_S OUT_FILE. Used by asoundrc.tmpl; exits at EOF (stream closed).

The card's clock can be slowed by the test: while ``OUT_FILE.speed`` exists, its content (a float,
e.g. ``0.1``) scales the rate (:meth:`AlsaFile.set_speed <tests.fixtures_service.AlsaFile.set_speed>`).
The card stays alive (the stream is still called back, only less often), so a request plays for as
long as the test needs a state to hold instead of racing the synthesis. The file is looked at
before every read of 4096 bytes; a change restarts the pacing from that moment (no catch-up burst).
"""

import sys
import time


def speed_of(path: str) -> float:
    """The speed factor in ``path`` (1.0 when it is missing or unreadable)."""
    try:
        with open(path) as f:
            v = float(f.read().strip() or "1")
    except (OSError, ValueError):
        return 1.0
    return v if v > 0 else 1.0


def main() -> None:
    nominal = float(sys.argv[1])
    control = sys.argv[2] + ".speed"
    src = sys.stdin.buffer.raw
    with open(sys.argv[2], "ab", buffering=0) as out:
        speed = speed_of(control)
        t0 = time.monotonic()
        n = 0
        while True:
            now_speed = speed_of(control)
            if now_speed != speed:
                speed, t0, n = now_speed, time.monotonic(), 0
            b = src.read(4096)
            if not b:
                return
            out.write(b)
            n += len(b)
            ahead = n / (nominal * speed) - (time.monotonic() - t0)
            if ahead > 0:
                time.sleep(ahead)


if __name__ == "__main__":
    main()
