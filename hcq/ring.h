// The producer side of a submission ring, defined once for the C command processors that own one (cp.c, the CPU
// device's; vk.c, the Vulkan device's). Put in place of `#include "ring.h"` when those sources are built
// (hcq/backends/cpu/native.py and hcq/backends/vk/native.py, inline_include), so a change here changes what the build
// cache keys on.
//
// A ring is `cap` 64-bit words, cap a power of two (mask = cap - 1). `wptr` and `rptr` count words ever written and
// ever consumed (they never wrap back: word k lives at ring[k & mask]), so wptr - rptr words are in use. Producers are
// serialised by the backend's producer lock; the ring's consumer is one thread at a time. A submission of n words is
// published whole or not at all:
//   if (hcq_ring_too_big(cap, n)) refuse (SUBMIT_TOO_BIG: it can never fit);
//   wp = hcq_ring_own_wptr(&wptr);
//   until hcq_ring_fits(cap, wp, hcq_ring_rptr(&rptr), n): wait (the backend's way; the consumer must reach
//     rptr >= hcq_ring_rptr_needed(cap, wp, n)), or give up (SUBMIT_FULL / SUBMIT_STOPPED);
//   hcq_ring_copy_in(ring, mask, wp, words, n);
//   hcq_ring_publish(&wptr, wp + n);
//   then wake the consumer (the backend's way; where it reads a consumer's `sleeping` flag after the publish, it puts
//   a seq_cst fence between the two, see hcq_ring_publish).
// What stays with each backend: how a producer waits for room and how it wakes the consumer.
#include <stdatomic.h>
#include <stdint.h>

// n words can never fit a ring of cap words: refused outright, not waited for.
static inline int hcq_ring_too_big(uint64_t cap, uint64_t n) { return n > cap; }

// The producer's own write pointer (under the producer lock). Relaxed: only producers store wptr, and the lock they
// hold orders the last producer's store before this load (mutex release/acquire), so this reads the latest value.
static inline uint64_t hcq_ring_own_wptr(_Atomic uint64_t *wptr) { return atomic_load_explicit(wptr, memory_order_relaxed); }

// The consumer's read pointer, as the producer reads it before reusing ring words. Acquire: pairs with the consumer's
// release store of rptr, made once it has copied those words out, so the producer's overwrites of them cannot be seen
// by the consumer's earlier reads (the words it reuses are no longer being read).
static inline uint64_t hcq_ring_rptr(_Atomic uint64_t *rptr) { return atomic_load_explicit(rptr, memory_order_acquire); }

// Words free in a ring of cap words with wptr - rptr in use (rptr as hcq_ring_rptr read it; wptr - rptr <= cap).
static inline uint64_t hcq_ring_free(uint64_t cap, uint64_t wptr, uint64_t rptr) { return cap - (wptr - rptr); }

// Whether n more words fit now. (Pure arithmetic: the orders are those of the loads that gave wptr and rptr.)
static inline int hcq_ring_fits(uint64_t cap, uint64_t wptr, uint64_t rptr, uint64_t n) { return hcq_ring_free(cap, wptr, rptr) >= n; }

// The read pointer the consumer must reach for n words to fit after wptr (for a producer that waits on rptr's value
// itself, cp.c's wait_until): rptr >= this <=> hcq_ring_fits. Meaningful where n words do not fit now (then
// wptr + n > cap, so it does not underflow) and n <= cap.
static inline uint64_t hcq_ring_rptr_needed(uint64_t cap, uint64_t wptr, uint64_t n) { return wptr + n - cap; }

// Copy n words into the ring at word wptr onwards (wrapping at mask + 1). Plain stores: the consumer reads these words
// only after its acquire load of wptr sees hcq_ring_publish's store, which is ordered after them (release).
static inline void hcq_ring_copy_in(uint64_t *ring, uint64_t mask, uint64_t wptr, const uint64_t *words, uint64_t n) {
  for (uint64_t k = 0; k < n; k++) ring[(wptr + k) & mask] = words[k];
}

// Publish the words copied in: wptr = new_wptr. Release: every ring word stored before it is visible to a consumer
// whose acquire load of wptr reads new_wptr (or later). A producer that then reads a flag the consumer sets before it
// sleeps (a store-buffering handshake: producer stores wptr then loads `sleeping`, consumer stores `sleeping` then
// loads wptr) needs more than release: it follows this with atomic_thread_fence(memory_order_seq_cst) before that
// load, so at least one side sees the other's store and no wake-up is lost (cp.c's ring_doorbell, vk.c's submit).
static inline void hcq_ring_publish(_Atomic uint64_t *wptr, uint64_t new_wptr) {
  atomic_store_explicit(wptr, new_wptr, memory_order_release);
}
