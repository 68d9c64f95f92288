"""The optional CPython extension of the launch hot path (`hcq._hotpath`, built from hcq/_hotpath.c by the
package's build step). Where it is missing, or with HCQ_HOTPATH=0, launches run through Python and native code is
called through ctypes: the same work, slower."""
from __future__ import annotations

import importlib
import threading
from array import array
from typing import Any, Callable

from hcq.helpers import env_flag

_ext: Any = None
why_not = ""  # why the extension is not in use ("" when it is)
if not env_flag("HCQ_HOTPATH", True):
    why_not = "disabled by HCQ_HOTPATH=0"
else:
    try:
        _ext = importlib.import_module("hcq._hotpath")
    except ImportError as e:  # not built: the ctypes path is the fallback
        why_not = f"not built ({e})"


def available() -> bool:
    """Whether the extension is in use."""
    return _ext is not None


def native_submitter(address: int) -> Callable[[Any, int, int, int], int] | None:
    """The native submit function at `address` (`int f(void *ring, const uint64_t *words, uint64_t n,
    int64_t timeout_ns)`) as a Python callable `f(ring, words_address, n, timeout_ns)`, or None without the
    extension."""
    return _ext.submitter(address) if _ext is not None else None


def native_waiter(address: int) -> Callable[[int, int, int], int] | None:
    """The native host wait at `address` (`int f(const void *addr, uint64_t value, int64_t timeout_ns)`, 0 once the
    64-bit word at addr is >= value) as a Python callable `f(addr, value, timeout_ns)`, or None without the extension."""
    return _ext.waiter(address) if _ext is not None else None


def host_copy_function() -> Callable[[Any, Any], None] | None:
    """`host_copy(dst, src)`: hcq/hostcopy.h's copy between two contiguous host buffers of the same length (the GIL
    released for large ones), or None without the extension."""
    return _ext.host_copy if _ext is not None else None


def timeline_ring_take_function() -> Callable[..., int] | None:
    """`take(state address, tags address, ntags, ring size, segment size, need address, size, tag, alignment, waited)`:
    hcq/timeline_ring.h's take on a TimelineRing's arrays (hcq.timeline_ring), or None without the extension."""
    return _ext.timeline_ring_take if _ext is not None else None


def device_state(dev: Any, words: Any, busy: set) -> Any:
    """What the native paths need of one device (hcq/_hotpath.c's DeviceState: the device, a view of its state words,
    hcq.device_state, and the busy set its submissions list it in), or None without the extension."""
    return _ext.DeviceState(dev, words, busy) if _ext is not None else None


def host_copier(dev_state: Any, alloc: Any, buffer_type: type, fallback: Callable[..., None], copyin: bool, has_copy_queues: bool,
                failed_flag: int) -> Callable[..., None] | None:
    """An allocator's `copyin` (or `copyout`) that does a small host copy on an idle device in one native call, with the
    Python method's checks, and passes everything else to `fallback` (see hcq/_hotpath.c's HostCopier); None without
    the extension."""
    if _ext is None: return None
    return _ext.HostCopier(dev_state, alloc, buffer_type, fallback, copyin, has_copy_queues, failed_flag)


class _PythonLaunch:
    """Without the extension, calling a program is calling its `launch`."""

    def __call__(self, *bufs: Any, **kwargs: Any) -> Any:
        return self.launch(*bufs, **kwargs)  # type: ignore[attr-defined]


# The base of hcq.HCQProgram: with the extension, `prg(...)` enters C, which launches plain calls itself and passes
# the rest to `prg.launch(...)`.
LaunchBase: type = _ext.Launchable if _ext is not None else _PythonLaunch


def set_submit_slice(ns: int) -> None:
    """How long the extension's submits wait for ring space before they come back (hcq.packet_queue.SUBMIT_SLICE_NS,
    the one definition, sets it)."""
    if _ext is not None: _ext.set_submit_slice(ns)


def set_gates(gates: tuple[tuple[dict[str, Any], str], ...]) -> None:
    """Module globals (module.__dict__, name) that turn the native fast path off unless each is None, False or 0
    (profiling, capturing, validating: those launches go through `launch`)."""
    if _ext is not None: _ext.set_gates(gates)


def launcher(dev_state: Any, py: Any, buffer_type: type, submit_address: int, ring: int, kernargs_host: int, kernargs_dev: int,
             kernargs_ring: Any) -> Any:
    """The native launcher of one device (see hcq/_hotpath.c), or None without the extension."""
    return _ext.Launcher(dev_state, py, buffer_type, submit_address, ring, kernargs_host, kernargs_dev, kernargs_ring) if _ext is not None else None


def resubmitter(dev_state: Any, ring: Any, submit_address: int, words: tuple[int, ...], symbols: tuple[tuple[int, str, int, int], ...],
                keepalive: list[Any], words_list: list[int], fence_word: Any) -> Any:
    """A queue's native re-submit (see hcq/_hotpath.c), holding `keepalive` (handed to the ring when it goes, until the
    fence passes its last submission), or None without the extension. `fence_word`: the queue's last fence word, which
    it advances with the ring's count."""
    if _ext is None: return None
    last = array("Q", [0])  # (this run's own last submission to `ring`: what the ring holds the keepalive until)
    run = _ext.Resubmit(dev_state, ring, submit_address, words, symbols, keepalive, words_list, ring.state, fence_word, last)
    ring.held_by(run, last, keepalive)
    return run


def ring_lock() -> Any:
    """The lock of a submission ring: the extension's RingLock (which the native re-submit takes without a Python
    call), else a threading.Lock."""
    return _ext.RingLock() if _ext is not None else threading.Lock()


def graph_run(dev_state: Any, queue: Any, ring: Any, *args: Any) -> Any:
    """The native run of a one-queue graph (hcq/_hotpath.c's GraphRun; see HCQGraph._native_run), holding the queue's
    keepalive (handed to the ring when it goes), or None without the extension."""
    if _ext is None: return None
    last = array("Q", [0])
    run = _ext.GraphRun(dev_state, ring, *args, queue._keepalive, ring.state, queue._fence_word, last)
    ring.held_by(run, last, queue._keepalive)
    return run
