"""The NV device's sources for the kernels the conformance kit names by behaviour (see hcq.conformance): the C
dialect's (hcq.kernel_source), which the NV compiler builds as CUDA C for the GPU and the emulated GPU's CPU twins
build as C. A kernel that faults is left out: the kit runs it only on devices that recover, which NV does not."""
from hcq.kernel_source import CONFORMANCE_KERNELS as DIALECT_KERNELS

CONFORMANCE_KERNELS: dict[str, tuple[str, str]] = dict(DIALECT_KERNELS)
