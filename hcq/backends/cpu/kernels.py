"""The CPU device's sources for the kernels the conformance kit names by behaviour (see hcq.conformance)."""

CONFORMANCE_KERNELS: dict[str, tuple[str, str]] = {
    "fill": ("HCQ_KERNEL void fill(uint32_t *out, uint32_t value, uint32_t n) {\n"
             "  int64_t i = hcq_global_id(0);\n"
             "  if (i < (int64_t)n) out[i] = value;\n"
             "}\n", "fill"),
    "add": ("HCQ_KERNEL void add(uint32_t *out, const uint32_t *a, const uint32_t *b, uint32_t n) {\n"
            "  int64_t i = hcq_global_id(0);\n"
            "  if (i < (int64_t)n) out[i] = a[i] + b[i];\n"
            "}\n", "add"),
    "spin": ("HCQ_KERNEL void spin(uint64_t *flag, uint32_t *out) {\n"
             "  if (hcq_global_id(0) != 0) return;\n"
             "  while (__atomic_load_n(flag, __ATOMIC_ACQUIRE) == 0) {}\n"
             "  out[0] = 1;\n"
             "}\n", "spin"),
    "fault": ("HCQ_KERNEL void fault(uint32_t *out) {\n"
              "  volatile uint32_t *bad = (volatile uint32_t *)(uintptr_t)16;\n"
              "  *bad = out[0];\n"
              "}\n", "fault"),
}
