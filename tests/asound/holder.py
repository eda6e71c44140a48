"""A second process holding a sound device, for tests: ALSA's ``shm`` PCM plugin asks a server on a
UNIX socket to open the device for it; this server answers every open with ``-EBUSY`` (what a
sound card held by another player answers), so alsa-lib, PortAudio and ``aplay`` all see a busy
device. Usage: holder.py SOCKET_PATH; prints ``holding`` once it listens; ends at SIGTERM.

The ``.asoundrc`` side (tests/test_audio_devices.py writes it)::

    server.holder { host "localhost" socket "SOCKET_PATH" }
    pcm.NAME { type shm server "holder" pcm "held" }

The request is alsa-lib's ``snd_client_open_request_t`` (dev_type, transport, stream, mode: four
bytes; namelen: int; the name); the answer its ``snd_client_open_answer_t`` (result: long,
cookie: int, padded to 16 bytes on 64-bit).
"""

import errno
import os
import signal
import socket
import struct
import sys


def main() -> None:
    path = sys.argv[1]
    if os.path.exists(path):
        os.unlink(path)
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(path)
    srv.listen(16)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    print("holding", flush=True)
    answer = struct.pack("@li0l", -errno.EBUSY, 0)      # padded as the C struct (16 bytes on 64-bit)
    while True:
        conn, _ = srv.accept()
        with conn:
            head = conn.recv(8)
            if len(head) == 8:
                (namelen,) = struct.unpack("=i", head[4:])
                conn.recv(max(0, namelen))
                conn.sendall(answer)


if __name__ == "__main__":
    main()
