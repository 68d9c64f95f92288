"""What a remote client and an `hcq serve` server say to each other over the network engine (net.c). Every
message starts with a little-endian u32 type:

    CALL    (2)  a JSON request {"op": ..., ...}, answered with JSON {"ok": true, "result": ...} or
                 {"ok": false, "error": "...", "kind": "HCQError" | "CompileError" | ...}; handled by the server's
                 Python thread (opening devices, memory, programs, rings, ring states, failures: nothing per launch)
    SUBMIT  (3)  packet words for a ring, with the bytes of the mirrored ranges they read (serve.c: hs_exec_submit builds
                 it in the client, hs_on_submit handles it)
    STORE   (4)  a host store into a signal (serve.c, hs_on_store); clients send it one-way
    PUSH    (7)  one-way: bytes a packet (or a host store) put into a mirrored or forwarded range, or a signal's value
                 and timestamp: server -> client, server -> server over a link, client -> server for what local
                 devices store (serve.c: hs_store_hook sends it, hs_on_push applies it where it was accepted)
    WAKE    (8)  one-way, server -> client: a signal in memory the two share (one host) changed while the client
                 counted sleepers (serve.c: hs_on_wake wakes them)
    SYNC    (9)  a request, server -> client, answered empty once what was sent before it is applied (serve.c:
                 hs_on_sync): a window's bytes pushed to a client that shares memory precede the signal stored next

Besides these, the network engine's own AM_PLACE (net.c) carries bulk bytes straight into place: a client's large
copyin into its device memory, and a copy engine's window into the destination (another server's memory, or a local
CPU device's in the client) from 64 KiB on; the receiver's placer (serve.c, hs_place_ok) allows only the
connection's device memory and what was accepted for it. A large copyout is the CALL "read", answered with the raw
bytes (received straight into the caller's buffer).

SUBMIT, STORE, PUSH, WAKE and SYNC are handled in C on the server's progress thread, without Python (serve.c documents their layout
and the ordering rules). VERSION changes whenever any of this does; a server refuses a client of another version."""
from __future__ import annotations

import json
import struct
from typing import Any

VERSION = 4
CALL, SUBMIT, STORE, PUSH, WAKE, SYNC = 2, 3, 4, 7, 8, 9
STORE_RESET_TIMESTAMP = 1  # STORE flag: also zero the signal's timestamp (a fresh signal)
STORE_ONE_WAY = 2  # STORE flag: sent without waiting for an answer (in order with the SUBMITs that follow it)
DEFAULT_HOST = "127.0.0.1"
TOKEN_ENV = "HCQ_REMOTE_TOKEN"

_TYPE = struct.Struct("<I")
_STORE = struct.Struct("<IIQQ")


def call_message(op: str, **args: Any) -> bytes:
    return _TYPE.pack(CALL) + json.dumps({"op": op, **args}).encode()


def parse_call(msg: bytes) -> dict[str, Any]:
    if len(msg) < 4 or _TYPE.unpack_from(msg)[0] != CALL: raise ValueError("not a CALL message")
    req = json.loads(msg[4:])
    if not isinstance(req, dict) or not isinstance(req.get("op"), str): raise ValueError("a CALL needs a JSON object with an 'op'")
    return req


def store_message(addr: int, value: int, flags: int = 0) -> bytes:
    return _STORE.pack(STORE, flags, addr, value)
