"""DIRECT: a backend on the other side of the seam, for hardware that does not run hcq packets (as a CUDA device
calls its driver per command). It uses the core's stream model (hcq.stream_queue, hcq.stream_device): its queues
keep each command's operands as queue words (so the core's symbolic patching applies), and a thread per queue makes
the device calls below in order. No executor, no packet format: the core's lifetimes, validation, graphs, profiling
and the conformance kit work on it all the same.

Memory, signals and kernels are the toy backend's (`toy_backend.py`): only the device calls and the device differ.
"""
from __future__ import annotations


import toy_backend as toy
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


class DirectComputeQueue(StreamComputeQueue):
    """DIRECT's compute queue."""


class DirectCopyQueue(StreamCopyQueue):
    """DIRECT's copy queues."""


class DirectAllocator(toy.ToyAllocator):
    def _map_into(self, buf: HCQBuffer) -> HCQBuffer:
        if buf.owner is not None and not isinstance(buf.owner, DirectDevice):
            raise HCQError(f"{self.dev.device} cannot map {buf!r}: it belongs to another peer group")
        return buf


class DirectDevice(StreamDevice[toy.ToySignal]):
    """`DIRECT:n`: stream queues (one thread each) making DirectOps' calls; peer group "DIRECT"."""
    max_block_threads = 1024
    CONFORMANCE_KERNELS = toy.CONFORMANCE_KERNELS

    def __init__(self, device: str):
        caps = Capabilities(queues={COMPUTE: 1, COPY: 2}, word_bits=64, poll_conditions=frozenset({PollCondition.EQ, PollCondition.GEQ}),
                            poll_mask=False, recover=True, queue_states=True, host_visible_memory=True, host_copies=False,
                            timestamps=True, packets=False)
        super().__init__(device, DirectOps(), DirectAllocator(self), toy.ToyCompiler(), toy.ToyProgram, toy.ToySignal, DirectComputeQueue,
                         DirectCopyQueue, capabilities=caps, kernargs_size=1 << 20, peer_group="DIRECT")


def register() -> None:
    """Make hcq.Device("DIRECT") / "DIRECT:n" open DIRECT devices in this process."""
    from hcq.registry import register_backend
    register_backend("DIRECT", DirectDevice)
