"""The sending side of ``sluice bench handoff``, in a process of its own (as a prefill engine is).

Serves one payload at a time two ways: a ``HandoffServer`` (the gRPC transport, as a prefill
engine actor runs it) and a plain TCP socket (the physical peer: the kernel's loopback copy
with no framing). Commands on stdin, one per line; answers on stdout, one JSON line each:

* ``put N``: make an N-byte payload (seeded bytes), hold it in the outbox and behind the
  socket; answers ``{"ticket": <wire ticket>, "tcp": "host:port"}``;
* ``quit``.

The TCP server answers each 1-byte request with the current payload's length (u64) and bytes.
"""

from __future__ import annotations

import json
import socket
import struct
import sys
import threading

import numpy as np

from engine.kvconnector.handoff_server import HandoffOutbox, HandoffServer


def _serve_tcp(sock: socket.socket, current: dict[str, bytes]) -> None:
    while True:
        conn, _ = sock.accept()
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        threading.Thread(target=_answer, args=(conn, current), daemon=True).start()


def _answer(conn: socket.socket, current: dict[str, bytes]) -> None:
    with conn:
        while conn.recv(1):
            payload = current["payload"]
            conn.sendall(struct.pack("<Q", len(payload)))
            conn.sendall(payload)


def main() -> None:
    outbox = HandoffOutbox(max_bytes=4 << 30, ttl_s=3600)
    server = HandoffServer(outbox)
    sock = socket.create_server(("127.0.0.1", 0))
    current = {"payload": b""}
    threading.Thread(target=_serve_tcp, args=(sock, current), daemon=True).start()
    tcp = f"127.0.0.1:{sock.getsockname()[1]}"
    for line in sys.stdin:
        cmd = line.split()
        if not cmd or cmd[0] == "quit":
            break
        n = int(cmd[1])
        payload = np.random.default_rng(n).integers(0, 256, n, dtype=np.uint8).tobytes()
        current["payload"] = payload
        ticket = outbox.put(f"bench-{n}", payload, server.address)
        print(json.dumps({"ticket": ticket.to_wire(), "tcp": tcp}), flush=True)
    server.stop()


if __name__ == "__main__":
    main()
