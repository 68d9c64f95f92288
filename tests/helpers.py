"""Small helpers shared by test modules (importable as `helpers`: pytest puts this folder on sys.path)."""
import time

import numpy as np
import pytest

from hcq import BufferSpec, HCQTimeoutError

CLOSE_TIMEOUT_MS = 10_000  # how long a test's devices get to finish its work when it ends


def close_after_test(devices) -> None:
    """Close the devices a test opened (in reverse order); work one of them still ran fails the test, saying what."""
    errors = []
    for d in reversed(list(devices)):
        try:
            d.close(timeout=CLOSE_TIMEOUT_MS)
        except HCQTimeoutError as e:
            errors.append(str(e))
    if errors: pytest.fail("the test left work running on its devices:\n" + "\n".join(errors), pytrace=False)


def alloc(dev, nbytes, fill=0):
    """A host-visible buffer of `nbytes` set to `fill` (buffers may come back from the LRU cache with old bytes)."""
    buf = dev.allocator.alloc(nbytes, BufferSpec(cpu_access=True))
    buf.cpu_view()[:] = bytes([fill]) * nbytes
    return buf


def arr(buf, dtype=np.uint32):
    """The buffer's bytes as a numpy array (a view, no copy)."""
    return np.frombuffer(buf.cpu_view().mv, dtype=dtype)


def alive(pid: int) -> bool:
    """Whether process `pid` exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f: return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:  # (gone: no such file, or the process went while it was read)
        return False


def wait_gone(pids: list[int], within: float = 10.0) -> bool:
    """Wait up to `within` seconds for every process of `pids` to be gone (or a zombie); whether they all are."""
    deadline = time.monotonic() + within
    while any(alive(p) for p in pids) and time.monotonic() < deadline: time.sleep(0.02)
    return not any(alive(p) for p in pids)


def use_kernargs_ring(dev, ring):
    """Put `ring` (a TimelineRing, or the device's own, back) in place of the device's kernargs ring and remake its fast
    launcher, which views the ring it was made with. Returns what to give back to restore the device. Programs launched
    in between keep the launcher they first took: launch only new programs afterwards."""
    from hcq import packet_queue
    old = dev.kernargs_allocator, dev.fast_launch
    if isinstance(ring, tuple):
        dev.kernargs_allocator, dev.fast_launch = ring
    else:
        dev.kernargs_allocator = ring
        dev.fast_launch = packet_queue.FastLauncher(dev)
    return old
