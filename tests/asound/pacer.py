"""Read stdin at a fixed byte rate and append it to a file (the clock of the test sound card).

Usage: pacer.py BYTES_PER_S OUT_FILE. Used by asoundrc.tmpl; exits at EOF (stream closed).
"""

import sys
import time


def main() -> None:
    rate = float(sys.argv[1])
    src = sys.stdin.buffer.raw
    with open(sys.argv[2], "ab", buffering=0) as out:
        t0 = time.monotonic()
        n = 0
        while True:
            b = src.read(4096)
            if not b:
                return
            out.write(b)
            n += len(b)
            ahead = n / rate - (time.monotonic() - t0)
            if ahead > 0:
                time.sleep(ahead)


if __name__ == "__main__":
    main()
