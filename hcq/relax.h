// cpu_relax(): the pause inside a spin-wait loop (x86 PAUSE, arm64 YIELD), for cp.c and the remote backend's net.c.
// Put in place of `#include "relax.h"` when the sources are built (packets.RELAX_HEADER, inline_include).
#if defined(__x86_64__) || defined(__i386__)
#define cpu_relax() __builtin_ia32_pause()
#elif defined(__aarch64__)
#define cpu_relax() __asm__ __volatile__("yield" ::: "memory")
#else
#define cpu_relax() ((void)0)
#endif
