// The packet rings of a served NV device (hcq serve): serve.c submits a client's hcq packets here, in C, as it does
// to cp.c's and vk.c's rings; one Python thread per ring (hcq/backends/nv/hosting.py) takes them out, translates them
// into the GPU's methods and submits those through the channel. Also the host stores serve.c makes into signals of
// such a device, and their poisoned kind: the GPU's semaphore acquires poll memory, so a store needs no wake-up.
//
// Ordering: the producer side is the core's ring.h (copy in, then a release store of wptr). The consumer reads wptr
// with acquire before it reads the words, and stores rptr with release once it has read them (so the producer's
// overwrites of those words come after). `lock` and `cond` only put sleepers to sleep: every pointer is read and
// written atomically, and both sides broadcast under the lock after they move one, so no wake-up is lost.
#include <errno.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include "hcq_shared.h"
#include "ring.h"

#define EXPORT __attribute__((visibility("default")))

typedef struct {
  _Atomic uint64_t wptr, rptr;
  _Atomic int stop;
  uint64_t cap, mask;
  uint64_t *words;
  pthread_mutex_t producer;  // serialises producers (ring.h's producer lock)
  pthread_mutex_t lock;      // sleeps only
  pthread_cond_t cond;
} feed_t;

static int64_t now_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

static void deadline_of(struct timespec *ts, int64_t timeout_ns) {
  clock_gettime(CLOCK_MONOTONIC, ts);
  int64_t ns = ts->tv_nsec + timeout_ns % 1000000000LL;
  ts->tv_sec += timeout_ns / 1000000000LL + ns / 1000000000LL;
  ts->tv_nsec = ns % 1000000000LL;
}

static void broadcast(feed_t *f) {
  pthread_mutex_lock(&f->lock);
  pthread_cond_broadcast(&f->cond);
  pthread_mutex_unlock(&f->lock);
}

// A ring of `cap` words (a power of two); NULL when memory is short.
EXPORT feed_t *hcq_feed_create(uint64_t cap) {
  if (cap == 0 || (cap & (cap - 1))) return NULL;
  feed_t *f = calloc(1, sizeof *f);
  if (!f) return NULL;
  f->words = calloc(cap, sizeof(uint64_t));
  if (!f->words) { free(f); return NULL; }
  f->cap = cap;
  f->mask = cap - 1;
  pthread_mutex_init(&f->producer, NULL);
  pthread_mutex_init(&f->lock, NULL);
  pthread_condattr_t attr;
  pthread_condattr_init(&attr);
  pthread_condattr_setclock(&attr, CLOCK_MONOTONIC);
  pthread_cond_init(&f->cond, &attr);
  pthread_condattr_destroy(&attr);
  return f;
}

// Freed once no producer nor consumer uses it any more (after hcq_feed_stop and the consumer thread's join).
EXPORT void hcq_feed_destroy(feed_t *f) {
  if (!f) return;
  pthread_cond_destroy(&f->cond);
  pthread_mutex_destroy(&f->lock);
  pthread_mutex_destroy(&f->producer);
  free(f->words);
  free(f);
}

EXPORT uint64_t *hcq_feed_words(feed_t *f) { return f->words; }

// The producer (serve.c's submit): all n words as one submission, or none; a SUBMIT_* status.
EXPORT int hcq_feed_submit(feed_t *f, const uint64_t *words, uint64_t n, int64_t timeout_ns) {
  if (hcq_ring_too_big(f->cap, n)) return SUBMIT_TOO_BIG;
  pthread_mutex_lock(&f->producer);
  int64_t deadline = now_ns() + (timeout_ns > 0 ? timeout_ns : 0);
  uint64_t wp = hcq_ring_own_wptr(&f->wptr);
  int status = SUBMIT_OK;
  while (!hcq_ring_fits(f->cap, wp, hcq_ring_rptr(&f->rptr), n)) {
    if (atomic_load_explicit(&f->stop, memory_order_acquire)) { status = SUBMIT_STOPPED; break; }
    int64_t left = deadline - now_ns();
    if (left <= 0) { status = SUBMIT_FULL; break; }
    struct timespec ts;
    deadline_of(&ts, left < 1000000 ? left : 1000000);  // (re-checks each ms: the consumer broadcasts, but cheaply bounded)
    pthread_mutex_lock(&f->lock);
    if (!hcq_ring_fits(f->cap, wp, hcq_ring_rptr(&f->rptr), n) && !atomic_load_explicit(&f->stop, memory_order_acquire))
      pthread_cond_timedwait(&f->cond, &f->lock, &ts);
    pthread_mutex_unlock(&f->lock);
  }
  if (status == SUBMIT_OK && atomic_load_explicit(&f->stop, memory_order_acquire)) status = SUBMIT_STOPPED;
  if (status == SUBMIT_OK) {
    hcq_ring_copy_in(f->words, f->mask, wp, words, n);
    hcq_ring_publish(&f->wptr, wp + n);
  }
  pthread_mutex_unlock(&f->producer);
  if (status == SUBMIT_OK) broadcast(f);  // (under the lock: a consumer that saw no words is asleep or sees them)
  return status;
}

EXPORT uint64_t hcq_feed_rptr(feed_t *f) { return atomic_load_explicit(&f->rptr, memory_order_acquire); }

EXPORT uint64_t hcq_feed_wptr(feed_t *f) { return atomic_load_explicit(&f->wptr, memory_order_acquire); }

// The consumer: the write pointer once it is past `seen`, or `seen` after `timeout_ns` or once stopped. Acquire:
// the words up to the value returned are in the ring (hcq_ring_publish's release).
EXPORT uint64_t hcq_feed_wait(feed_t *f, uint64_t seen, int64_t timeout_ns) {
  uint64_t wp = atomic_load_explicit(&f->wptr, memory_order_acquire);
  if (wp != seen || timeout_ns <= 0) return wp;
  struct timespec ts;
  deadline_of(&ts, timeout_ns);
  pthread_mutex_lock(&f->lock);
  while ((wp = atomic_load_explicit(&f->wptr, memory_order_acquire)) == seen && !atomic_load_explicit(&f->stop, memory_order_acquire))
    if (pthread_cond_timedwait(&f->cond, &f->lock, &ts) == ETIMEDOUT) break;
  pthread_mutex_unlock(&f->lock);
  return atomic_load_explicit(&f->wptr, memory_order_acquire);
}

// The consumer is done reading the words before `rptr`. Release: its reads of them come before a producer's
// overwrites (which follow that producer's acquire load of rptr).
EXPORT void hcq_feed_consumed(feed_t *f, uint64_t rptr) {
  atomic_store_explicit(&f->rptr, rptr, memory_order_release);
  broadcast(f);
}

// No more submissions; a producer waiting for room and the consumer waiting for words return.
EXPORT void hcq_feed_stop(feed_t *f) {
  atomic_store_explicit(&f->stop, 1, memory_order_release);
  broadcast(f);
}

EXPORT int hcq_feed_stopped(feed_t *f) { return atomic_load_explicit(&f->stop, memory_order_acquire); }

// A host store into a 16-byte signal: its poison tag cleared, then the value (release: the timestamp word and what
// the storer wrote before are visible to whoever sees the value). The GPU polls, so nothing is woken.
EXPORT void hcq_feed_signal_store(void *signal, uint64_t value) {
  hcq_clear_poison((_Atomic uint64_t *)((char *)signal + HCQ_SIGNAL_TIMESTAMP_OFFSET));
  atomic_store_explicit((_Atomic uint64_t *)signal, value, memory_order_release);
}

// The same store made by a failed device, or in the name of poison id `id`: the timestamp word tagged first.
EXPORT void hcq_feed_signal_poison(void *signal, uint64_t value, uint32_t id) {
  atomic_store_explicit((_Atomic uint64_t *)((char *)signal + HCQ_SIGNAL_TIMESTAMP_OFFSET), POISON_TAG | id, memory_order_relaxed);
  atomic_store_explicit((_Atomic uint64_t *)signal, value, memory_order_release);
}

// HostStores.waker: nothing sleeps on a word here (GPU acquires poll; the translator threads sleep on their rings).
EXPORT void hcq_feed_wake(void *addr, uint64_t value) { (void)addr; (void)value; }
