"""Loading the command processor (cp.c): built with the machine's C compiler on first use, cached on disk."""
from __future__ import annotations

import ctypes
import functools
from pathlib import Path

from hcq import packet_queue, packets
from hcq.helpers import env_flag, getenv
from hcq.hostcopy import HEADER as HOSTCOPY_HEADER
from hcq.interfaces import COMPUTE, COPY
from hcq.toolchain import build_shared_object, inline_include

CP_SOURCE = Path(__file__).with_name("cp.c")
CP_FLAGS = ("-O2", "-std=c11", "-pthread", "-fvisibility=hidden")
MAX_BLOCK_THREADS = 1 << 20  # threads in one block (cp.c refuses larger EXECs)
QUEUE_KINDS = {COMPUTE: 0, COPY: 1}  # the ring kinds of cp.c's hcq_queue_create
# Records cp.c fills for Python, word by word (their sizes and indices are generated into cp.c from these).
CUR_PKT_WORDS = 4  # words of the packet being run that a ring keeps for hang reports
QUEUE_STATE = ("rptr", "wptr", "packets_done", "position", "indirect_index") + tuple(f"pkt{i}" for i in range(CUR_PKT_WORDS))
FAULT = ("signal", "addr", "entry", "block", "op", "peer")
POOL_INFO = ("wanted", "started", "start_error", "woken", "inline")  # (woken, inline: grids of several blocks, counted)
SPIN_STATE = ("budget", "wakes", "idle", "last_spin", "asleep")  # hcq_queue_spin_state (see queue_spin_state)
WAIT_COUNTS = ("host_sleeps", "store_wakes")  # hcq_wait_counts (see wait_counts)




def shared_header() -> str:
    """What cp.c shares with Python: the packet format, the submit statuses, the queue kinds, the block limit."""
    return "\n".join([packet_queue.c_header(),
                      "enum { " + ", ".join(f"QUEUE_{k.upper()} = {v}" for k, v in QUEUE_KINDS.items()) + " };",
                      f"#define MAX_BLOCK_THREADS {MAX_BLOCK_THREADS}ULL",
                      f"#define CUR_PKT_WORDS {CUR_PKT_WORDS}",
                      _record("QSTATE", QUEUE_STATE), _record("FAULT", FAULT), _record("POOL", POOL_INFO),
                      _record("SPIN", SPIN_STATE), _record("WAIT", WAIT_COUNTS), ""])


def _record(prefix: str, fields: tuple[str, ...]) -> str:
    """A C enum naming each word of a record, and its size: enum { FAULT_SIGNAL, ..., FAULT_WORDS }."""
    return "enum { " + ", ".join(f"{prefix}_{f.upper()}" for f in fields) + f", {prefix}_WORDS }};"


def cp_source() -> str:
    """cp.c with its headers (the shared one, generated; relax.h; the core's hostcopy.h and ring.h) put in place of the
    lines that include them."""
    source = inline_include(CP_SOURCE.read_text(), "hcq_shared.h", shared_header(), "cp.c")
    source = inline_include(source, "hostcopy.h", HOSTCOPY_HEADER.read_text(), "cp.c")
    source = inline_include(source, "ring.h", packets.RING_HEADER.read_text(), "cp.c")
    return inline_include(source, "relax.h", packets.RELAX_HEADER.read_text(), "cp.c")


@functools.lru_cache(maxsize=None)
def engine() -> ctypes.CDLL:
    """The command-processor library, with its function signatures declared."""
    lib = ctypes.CDLL(str(build_shared_object(cp_source(), CP_FLAGS, "hcq-cp")))
    vp, u64, i64, i32 = ctypes.c_void_p, ctypes.c_uint64, ctypes.c_int64, ctypes.c_int
    sigs = {
        "hcq_set_tunables": (None, [i64, i64, i64, i64, i64, i32]),
        "hcq_wait_ge": (i32, [vp, u64, i64]),
        "hcq_signal_store": (None, [vp, u64]),
        "hcq_signal_store_quiet": (None, [vp, u64]),
        "hcq_signal_poison": (None, [vp, u64, ctypes.c_uint32]),
        "hcq_cas64": (u64, [vp, u64, u64]),
        "hcq_fault_handlers_rearmed": (i32, []),
        "hcq_run_entry_guarded": (i32, [vp, vp, vp, u64, u64, ctypes.POINTER(u64)]),
        "hcq_dev_create": (vp, [i32, ctypes.POINTER(i32)]),
        "hcq_dev_id": (ctypes.c_uint32, [vp]),
        "hcq_dev_pool_info": (None, [vp, ctypes.POINTER(i32)]),
        "hcq_dev_error": (i32, [vp, ctypes.c_char_p, i32]),
        "hcq_dev_stop": (None, [vp]),
        "hcq_dev_destroy": (i32, [vp, i64]),
        "hcq_dev_retire": (i32, [vp, i64]),
        "hcq_dev_abort": (None, [vp, ctypes.c_char_p]),
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
        "hcq_queue_destroy": (i32, [vp, i64]),
        "hcq_queue_retire": (i32, [vp, i64]),
        "hcq_num_cpus": (i32, []),
        "hcq_set_store_hook": (None, [vp, vp]),
        "hcq_set_idle_hook": (None, [vp, vp]),
        "hcq_wake_sleepers": (None, [vp, u64]),
        "hcq_now_ns": (u64, []),
        "hcq_contended_ns": (i64, []),
        "hcq_note_late_wakeup": (i64, []),
        "hcq_holds_lifted": (u64, []),
        "hcq_spread_moves": (None, [ctypes.POINTER(u64)]),
        "hcq_queue_spin_state": (None, [vp, ctypes.POINTER(i64)]),
        "hcq_wait_counts": (None, [ctypes.POINTER(u64)]),
    }
    for name, (res, args) in sigs.items():
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = res, args
    lib.hcq_set_tunables(*tunables())
    return lib


def function_address(name: str) -> int:
    """The address of cp.c's exported function `name` (for native callers: the extension, serve.c, the store hooks)."""
    return int(ctypes.cast(getattr(engine(), name), ctypes.c_void_p).value or 0)


def queue_spin_state(handle: int) -> dict[str, int]:
    """How a ring's queue thread idles (for tests and tools): `budget` how long it spins before it sleeps when it next
    idles (ns, adaptive: HCQ_CPU_QUEUE_SPIN_US up to HCQ_CPU_SPIN_MAX_US), `wakes` the doorbell sleeps that ended,
    `idle` the idle time (ns, until the doorbell rang) it learned its budget from at the last of them, `last_spin` the
    spin (ns) it allowed itself in the last spell that went to sleep (0: spinning held off while the CPUs are
    oversubscribed), `asleep` 1 while it sleeps on its doorbell. Read after a wait for a signal the ring stored, the
    values of the wakes before that store are in."""
    out = (ctypes.c_int64 * len(SPIN_STATE))()
    engine().hcq_queue_spin_state(handle, out)
    return dict(zip(SPIN_STATE, out))


def wait_counts() -> dict[str, int]:
    """Process-wide counts of the command processor's waits (for tests and tools): `host_sleeps` host waits on a signal
    (hcq_wait_ge) that went to sleep, each counted once registered as a sleeper (a store that reaches its value from
    then on wakes it); `store_wakes` stores (by a queue, the host, or a network engine applying a pushed value through
    hcq_wake_sleepers) that found a thread asleep waiting for a value they reached and woke it."""
    out = (ctypes.c_uint64 * len(WAIT_COUNTS))()
    engine().hcq_wait_counts(out)
    return dict(zip(WAIT_COUNTS, out))


def queue_settings() -> tuple[int, int]:
    """(worker threads, copy engines) of a CPU device: HCQ_CPU_WORKERS (default: the CPUs this process may use) and
    HCQ_CPU_COPY_ENGINES (default 2), range-checked."""
    return getenv("HCQ_CPU_WORKERS", int(engine().hcq_num_cpus()), lo=1, hi=4096), getenv("HCQ_CPU_COPY_ENGINES", 2, lo=1, hi=64)


SPIN_TUNABLES = (("HCQ_CPU_QUEUE_SPIN_US", 50), ("HCQ_CPU_HOST_SPIN_US", 50), ("HCQ_CPU_WORKER_SPIN_US", 20), ("HCQ_CPU_WAKE_AFTER_US", 20),
                 ("HCQ_CPU_SPIN_MAX_US", 500))  # (microseconds)


def tunables() -> tuple[int, ...]:
    """hcq_set_tunables' arguments from the environment, range-checked before they cross into C: each of SPIN_TUNABLES
    in nanoseconds, then whether queue threads may move off a busy CPU (HCQ_CPU_PLACEMENT)."""
    return (*(getenv(name, default, lo=0, hi=10_000_000) * 1000 for name, default in SPIN_TUNABLES), int(env_flag("HCQ_CPU_PLACEMENT", True)))
