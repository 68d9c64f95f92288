"""Loading the command processor (cp.c): built with the machine's C compiler on first use, cached on disk."""
from __future__ import annotations

import ctypes
import functools
from pathlib import Path

from hcq.toolchain import build_shared_object
from hcq.helpers import getenv
from hcq.queue import GUARD_DONE

CP_SOURCE = Path(__file__).with_name("cp.c")
CP_FLAGS = ("-O2", "-std=c11", "-pthread", "-fvisibility=hidden")

# Packet opcodes and header layout; they must match cp.c (checked against its hcq_abi() at load).
OP_WAIT, OP_SIGNAL, OP_TIMESTAMP, OP_BARRIER, OP_EXEC, OP_COPY, OP_WRITE, OP_POLL, OP_INDIRECT = range(1, 10)
FLAG_B64 = 1  # WRITE/POLL: 64-bit
FLAG_SIGNAL = 2  # WAIT/SIGNAL: the address is a 16-byte signal (poison in its timestamp word is checked / set)
FLAG_GUARD = 4  # COPY: a fifth word holds a guard word that makes the copy cancellable (see HCQAllocator)
POISON_MASK, POISON_TAG = 0xFFFF << 48, 0xDEAD << 48  # timestamp word of a signal a failed device stored
MAX_BLOCK_THREADS = 1 << 20
QUEUE_COMPUTE, QUEUE_COPY = 0, 1
SUBMIT_OK, SUBMIT_TIMEOUT, SUBMIT_STOPPED, SUBMIT_TOO_BIG, SUBMIT_NO_THREAD = range(5)


OP_NAMES = {OP_WAIT: "WAIT", OP_SIGNAL: "SIGNAL", OP_TIMESTAMP: "TIMESTAMP", OP_BARRIER: "BARRIER", OP_EXEC: "EXEC", OP_COPY: "COPY",
            OP_WRITE: "WRITE", OP_POLL: "POLL", OP_INDIRECT: "INDIRECT"}


def header(op: int, nwords: int, flags: int = 0) -> int:
    """Packet header word: opcode in bits 0-7, packet length in words (header included) in 8-15, flags in 16-23."""
    return op | (nwords << 8) | (flags << 16)


@functools.lru_cache(maxsize=None)
def engine() -> ctypes.CDLL:
    """The command-processor library, with its function signatures declared."""
    lib = ctypes.CDLL(str(build_shared_object(CP_SOURCE.read_text(), CP_FLAGS, "hcq-cp")))
    vp, u64, i64, i32 = ctypes.c_void_p, ctypes.c_uint64, ctypes.c_int64, ctypes.c_int
    sigs = {
        "hcq_set_tunables": (None, [i64, i64, i64, i64]),
        "hcq_abi": (None, [ctypes.POINTER(u64)]),
        "hcq_wait_ge": (i32, [vp, u64, i64]),
        "hcq_signal_store": (None, [vp, u64]),
        "hcq_cas64": (u64, [vp, u64, u64]),
        "hcq_fault_handlers_rearmed": (i32, []),
        "hcq_dev_create": (vp, [i32, ctypes.POINTER(i32)]),
        "hcq_dev_id": (ctypes.c_uint32, [vp]),
        "hcq_dev_pool_info": (None, [vp, ctypes.POINTER(i32)]),
        "hcq_dev_error": (i32, [vp, ctypes.c_char_p, i32]),
        "hcq_dev_stop": (None, [vp]),
        "hcq_dev_failed_flag": (vp, [vp]),
        "hcq_dev_fault": (i32, [vp, ctypes.POINTER(u64)]),
        "hcq_dev_recover": (None, [vp]),
        "hcq_queue_state": (None, [vp, ctypes.POINTER(u64)]),
        "hcq_queue_create": (i32, [vp, i32, i32, u64, i32, ctypes.POINTER(vp)]),
        "hcq_queue_start_error": (i32, [vp]),
        "hcq_queue_started": (i32, [vp]),
        "hcq_queue_submit": (i32, [vp, vp, u64, i64]),
        "hcq_queue_rptr": (u64, [vp]),
        "hcq_queue_pointers": (None, [vp, ctypes.POINTER(u64)]),
        "hcq_queue_wptr": (u64, [vp]),
        "hcq_queue_stop": (i32, [vp, i64]),
        "hcq_num_cpus": (i32, []),
        "hcq_now_ns": (u64, []),
    }
    for name, (res, args) in sigs.items():
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = res, args
    abi = (ctypes.c_uint64 * 8)()
    lib.hcq_abi(abi)
    expected = (OP_WAIT, OP_INDIRECT, FLAG_B64, FLAG_SIGNAL, FLAG_GUARD, GUARD_DONE, POISON_TAG, MAX_BLOCK_THREADS)
    if tuple(abi) != expected: raise RuntimeError(f"command processor library does not match hcq's packet format: {tuple(abi)} != {expected}")
    lib.hcq_set_tunables(*(_microseconds(name, default) * 1000 for name, default in
                           (("HCQ_CPU_QUEUE_SPIN_US", 50), ("HCQ_CPU_HOST_SPIN_US", 50), ("HCQ_CPU_WORKER_SPIN_US", 20), ("HCQ_CPU_WAKE_AFTER_US", 20))))
    return lib


def _microseconds(name: str, default: int) -> int:
    """A tunable in microseconds from the environment, range-checked before it crosses into C."""
    value = getenv(name, default)
    if not 0 <= value <= 10_000_000: raise ValueError(f"environment variable {name}={value} must be in [0, 10000000] microseconds")
    return value
