// hcq_host_copy(): memmove for host copies (the allocator's host-side copies, the CPU command processor's copy
// engine). Included by hcq/_hotpath.c and put in place of `#include "hostcopy.h"` in the sources built at run time
// (hcq/hostcopy.py, hcq/backends/cpu/native.py).
//
// Why not plain memcpy: where libc copies with `rep movsb` (glibc on CPUs with ERMS/FSRM, for copies between a few
// KB and its non-temporal threshold), a destination a few bytes past the source modulo 4 KB (4K aliasing) makes the
// copy crawl: 256 KB took 94-168 us against 8-15 us on an AMD EPYC (Zen 3) with glibc 2.36, for a destination 1 to
// 31 bytes ahead (taken here as 1 to 63, for CPUs with wider moves). That is the common case of a copy out of
// page-aligned device memory into a numpy array, whose data starts 16 bytes into its pages. Vector loads and stores
// do not suffer from it, so such copies take a loop of them; every other copy is memmove.
#include <stdint.h>
#include <string.h>
#if defined(__SSE2__)
#include <emmintrin.h>
#endif

#define HCQ_ALIAS_MIN_BYTES 1024u  // below this libc copies with vector moves anyway
#define HCQ_ALIAS_BAND 64u         // a destination fewer bytes than this past the source (mod 4 KB): aliased

static inline int hcq_copy_aliases(const void *dst, const void *src, size_t n) {
  size_t ahead = ((uintptr_t)dst - (uintptr_t)src) & 4095u;
  return n >= HCQ_ALIAS_MIN_BYTES && ahead != 0 && ahead < HCQ_ALIAS_BAND;
}

static inline void hcq_host_copy(void *dst, const void *src, size_t n) {
  char *d = (char *)dst; const char *s = (const char *)src;
  if ((d < s + n && s < d + n) || !hcq_copy_aliases(d, s, n)) { memmove(d, s, n); return; }
#if defined(__SSE2__)
  for (; n >= 64; n -= 64, d += 64, s += 64) {  // all four loads before the stores, as libc's own vector loops do
    __m128i a = _mm_loadu_si128((const __m128i *)s), b = _mm_loadu_si128((const __m128i *)(s + 16));
    __m128i c = _mm_loadu_si128((const __m128i *)(s + 32)), e = _mm_loadu_si128((const __m128i *)(s + 48));
    _mm_storeu_si128((__m128i *)d, a); _mm_storeu_si128((__m128i *)(d + 16), b);
    _mm_storeu_si128((__m128i *)(d + 32), c); _mm_storeu_si128((__m128i *)(d + 48), e);
    __asm__ __volatile__("" ::: "memory");  // keeps compilers from turning the loop back into a memcpy call
  }
#endif
  memcpy(d, s, n);
}
