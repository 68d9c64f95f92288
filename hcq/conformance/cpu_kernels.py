"""The conformance kernels of the CPU device, in its kernel language (C with `HCQ_KERNEL` entry points and the
`hcq_global_id` built-in). The CPU device class publishes them as `CONFORMANCE_KERNELS`; see hcq.conformance
for what each behaviour must do."""
from __future__ import annotations

_SOURCE = r"""
HCQ_KERNEL void conformance_fill(uint32_t *out, uint32_t value, uint32_t n) {
  int64_t i = hcq_global_id(0);
  if (i < (int64_t)n) out[i] = value;
}

HCQ_KERNEL void conformance_add(uint32_t *out, const uint32_t *a, const uint32_t *b, uint32_t n) {
  int64_t i = hcq_global_id(0);
  if (i < (int64_t)n) out[i] = a[i] + b[i];
}

HCQ_KERNEL void conformance_spin(uint64_t *flag, uint32_t *out) {
  if (hcq_global_id(0) != 0) return;
  while (__atomic_load_n(flag, __ATOMIC_ACQUIRE) == 0) {}
  out[0] = 1;
}

HCQ_KERNEL void conformance_fault(uint32_t *out) {
  *(volatile uint32_t *)(uintptr_t)16 = 1;  /* a store into the unmapped first page */
  out[0] = 1;
}
"""

CPU_KERNELS: dict[str, tuple[str, str]] = {
    "fill": (_SOURCE, "conformance_fill"),
    "add": (_SOURCE, "conformance_add"),
    "spin": (_SOURCE, "conformance_spin"),
    "fault": (_SOURCE, "conformance_fault"),
}
