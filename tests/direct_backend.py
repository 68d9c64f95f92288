"""DIRECT: a backend on the other side of the seam, for hardware that does not run hcq packets (as a CUDA device
calls its driver per command). It uses the core's stream model (hcq.stream_queue, hcq.stream_device): its queues
keep each command's operands as queue words (so the core's symbolic patching applies), and a thread per queue makes
the device calls below in order. No executor, no packet format: the core's lifetimes, validation, graphs, profiling
and the conformance kit work on it all the same.

DIRECTQ is the same device made asynchronous, as an OpenCL or CUDA queue is: kernels and copies are queued on an
in-order device thread per stream and return a `Completion` at once; the stream goes on, and the signal stores after
them are made by their completions (the stream thread is not held to a finish per signal).

Memory, signals and kernels are the toy backend's (`toy_backend.py`): only the device calls and the device differ.
"""
from __future__ import annotations


import toy_backend as toy
import queue
import threading
from typing import Callable

from hcq.backend import (COMPUTE, COPY, Capabilities, DeviceFault, HCQBuffer, HCQError, HCQProgram, PollCondition, Stream,
                         StreamComputeQueue, StreamCopyQueue, StreamDevice, StreamOps, StreamStopped)


class DirectOps(StreamOps):
    """The toy's memory is host memory: the default memory calls, bounded to live TOY allocations; kernels run in
    Python on the stream's thread."""

    def check(self, addr: int, nbytes: int) -> None:
        try:
            toy.check_range(addr, nbytes)
        except toy.ToyFault as e:
            raise DeviceFault(str(e)) from None

    def exec(self, stream: Stream, prg: HCQProgram, kernargs_addr: int, global_size: tuple[int, ...], local_size: tuple[int, ...]) -> None:
        try:
            toy.run_kernel(prg.entry, kernargs_addr, (*global_size, *local_size), lambda: stream.stopping)
        except toy._Stopped:
            raise StreamStopped from None
        except (toy.KernelError, toy.ToyFault) as e:
            raise DeviceFault(str(e)) from None


class Completion:
    """DIRECTQ's `Pending`: finished by the device thread that ran the work."""

    def __init__(self) -> None:
        self.done, self.error = threading.Event(), None
        self._lock, self._callbacks = threading.Lock(), []

    def then(self, fn: Callable[[BaseException | None], None]) -> None:
        with self._lock:
            if not self.done.is_set():
                self._callbacks.append(fn)
                return
        fn(self.error)

    def wait(self) -> None:
        self.done.wait()
        if self.error is not None: raise self.error

    def finish(self, error: BaseException | None) -> None:
        with self._lock:
            self.error = error
            self.done.set()
            callbacks, self._callbacks = self._callbacks, []
        for fn in callbacks: fn(error)


class QueuedOps(DirectOps):
    """DirectOps on an asynchronous device: kernels and copies go to an in-order device thread per stream."""
    enqueues = frozenset({"exec", "copy"})
    EXEC_DELAY_S = 0.0  # each kernel takes this much longer (a test makes the device slow)

    def __init__(self) -> None:
        self._queues: dict[Stream, queue.SimpleQueue] = {}

    def _enqueue(self, stream: Stream, work: Callable[[], None]) -> Completion:
        if stream not in self._queues:
            self._queues[stream] = q = queue.SimpleQueue()
            threading.Thread(target=self._device, args=(q,), name=f"{stream.name} device", daemon=True).start()
        done = Completion()
        self._queues[stream].put((work, done))
        return done

    @staticmethod
    def _device(q: queue.SimpleQueue) -> None:
        while True:
            work, done = q.get()
            try:
                work()
            except (DeviceFault, StreamStopped) as e:
                done.finish(e)
            else:
                done.finish(None)

    def exec(self, stream: Stream, prg: HCQProgram, kernargs_addr: int, global_size: tuple[int, ...], local_size: tuple[int, ...]) -> Completion:
        def run() -> None:
            if self.EXEC_DELAY_S: threading.Event().wait(self.EXEC_DELAY_S)
            DirectOps.exec(self, stream, prg, kernargs_addr, global_size, local_size)
        return self._enqueue(stream, run)

    def copy(self, stream: Stream, dest: int, src: int, nbytes: int) -> Completion:
        return self._enqueue(stream, lambda: DirectOps.copy(self, stream, dest, src, nbytes))


class DirectComputeQueue(StreamComputeQueue):
    """DIRECT's compute queue."""


class DirectCopyQueue(StreamCopyQueue):
    """DIRECT's copy queues."""


class DirectAllocator(toy.ToyAllocator):
    def _map_into(self, buf: HCQBuffer) -> HCQBuffer:
        if buf.owner is not None and type(buf.owner) is not type(self.dev):
            raise HCQError(f"{self.dev.device} cannot map {buf!r}: it belongs to another peer group")
        return buf


class DirectDevice(StreamDevice[toy.ToySignal]):
    """`DIRECT:n`: stream queues (one thread each) making DirectOps' calls; peer group "DIRECT"."""
    max_block_threads = 1024
    CONFORMANCE_KERNELS = toy.CONFORMANCE_KERNELS
    ops_t: type[DirectOps] = DirectOps

    def __init__(self, device: str):
        caps = Capabilities(queues={COMPUTE: 1, COPY: 2}, word_bits=64, poll_conditions=frozenset({PollCondition.EQ, PollCondition.GEQ}),
                            poll_mask=False, recover=True, queue_states=True, host_visible_memory=True, host_copies=False,
                            timestamps=True, packets=False)
        super().__init__(device, self.ops_t(), DirectAllocator(self), toy.ToyCompiler(), toy.ToyProgram, toy.ToySignal, DirectComputeQueue,
                         DirectCopyQueue, capabilities=caps, kernargs_size=1 << 20, peer_group=device.split(":")[0])


class QueuedDevice(DirectDevice):
    """`DIRECTQ:n`: DIRECT on an asynchronous device (QueuedOps); peer group "DIRECTQ"."""
    ops_t = QueuedOps


def register() -> None:
    """Make hcq.Device("DIRECT") / "DIRECTQ" (and ":n") open DIRECT / DIRECTQ devices in this process."""
    from hcq.registry import register_backend
    register_backend("DIRECT", DirectDevice)
    register_backend("DIRECTQ", QueuedDevice)
