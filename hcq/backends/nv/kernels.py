"""The NV device's sources for the kernels the conformance kit names by behaviour (see hcq.conformance): hcq's C
kernel dialect, which the NV compiler builds as CUDA C for the GPU and the emulated GPU's CPU twins build as C. A
kernel that faults is left out: the emulated GPU runs kernels as CPU code, where a stray store is the host's fault."""

CONFORMANCE_KERNELS: dict[str, tuple[str, str]] = {
    "fill": ("HCQ_KERNEL void fill(uint32_t *out, uint32_t value, uint32_t n) {\n"
             "  int64_t i = hcq_global_id(0);\n"
             "  if (i < (int64_t)n) out[i] = value;\n"
             "}\n", "fill"),
    "add": ("HCQ_KERNEL void add(uint32_t *out, const uint32_t *a, const uint32_t *b, uint32_t n) {\n"
            "  int64_t i = hcq_global_id(0);\n"
            "  if (i < (int64_t)n) out[i] = a[i] + b[i];\n"
            "}\n", "add"),
    # (the flag is read with acquire loads until the host sets it: a plain load could be hoisted out of the loop)
    "spin": ("HCQ_KERNEL void spin(uint64_t *flag, uint32_t *out) {\n"
             "  if (hcq_global_id(0) != 0) return;\n"
             "  while (__atomic_load_n(flag, __ATOMIC_ACQUIRE) == 0) {}\n"
             "  out[0] = 1;\n"
             "}\n", "spin"),
}
