"""The CPU device's sources for the kernels the conformance kit names by behaviour (see hcq.conformance): the C
dialect's (hcq.kernel_source), and one that faults."""
from hcq.kernel_source import CONFORMANCE_KERNELS as DIALECT_KERNELS

CONFORMANCE_KERNELS: dict[str, tuple[str, str]] = {
    **DIALECT_KERNELS,
    "fault": ("HCQ_KERNEL void fault(uint32_t *out) {\n"
              "  volatile uint32_t *bad = (volatile uint32_t *)(uintptr_t)16;\n"
              "  *bad = out[0];\n"
              "}\n", "fault"),
}
