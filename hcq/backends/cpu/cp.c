// The CPU device's command processor: rings of encoded packets consumed by native threads.
// Plain C11 with atomics; loaded through ctypes. See docs/design.md for the packet format and
// the memory-ordering rules between the host (Python) and these threads.
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <linux/futex.h>
#include <pthread.h>
#include <sched.h>
#include <setjmp.h>
#include <signal.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#if defined(__x86_64__)
#include <emmintrin.h>
#endif
#include "relax.h"
#include "hostcopy.h"
// The producer side of a submission ring (hcq_ring_*: room, copy-in, publish), shared with vk.c: hcq/ring.h.
#include "ring.h"

#define EXPORT __attribute__((visibility("default")))

// The packet format (OP_*, FLAG_*, POLL_*, GUARD_*, POISON_*, packet_words[], hdr_*()), the submit status codes
// (SUBMIT_*), the queue kinds (QUEUE_*), MAX_BLOCK_THREADS and the records filled for Python (QSTATE_*, FAULT_*,
// POOL_*, CUR_PKT_WORDS) come from this header, which hcq/backends/cpu/native.py generates from hcq/packets.py,
// hcq/packet_queue.py and its own tables at build (it replaces the line), so C and Python share one definition.
#include "hcq_shared.h"
#define MAX_PACKET_WORDS 16
#define MAX_DEVICES 4096
#define SLEEP_REPOLL_NS 1000000LL  // a sleeping wait re-polls memory nobody rings at least every 1 ms
#define FOREVER (-1LL)

// ---------------------------------------------------------------- time, futex, tunables
static inline int64_t now_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

// timeout_ns < 0: no timeout (idle threads sleep until someone rings them, using no CPU).
static void futex_wait(_Atomic uint32_t *addr, uint32_t expected, int64_t timeout_ns) {
  struct timespec rel = {.tv_sec = timeout_ns / 1000000000LL, .tv_nsec = timeout_ns % 1000000000LL};
  syscall(SYS_futex, (void *)addr, FUTEX_WAIT_PRIVATE, expected, timeout_ns < 0 ? NULL : &rel, NULL, 0);
}
static void futex_wake(_Atomic uint32_t *addr) { syscall(SYS_futex, (void *)addr, FUTEX_WAKE_PRIVATE, INT_MAX, NULL, NULL, 0); }

// The futex word of a 64-bit signal is its low half.
static inline _Atomic uint32_t *low_word(void *addr64) {
#if __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
  return (_Atomic uint32_t *)addr64;
#else
  return (_Atomic uint32_t *)((char *)addr64 + 4);
#endif
}

static int64_t spin_ns_queue = 50000, spin_ns_host = 50000, spin_ns_worker = 20000, wake_workers_after_ns = 20000;
static int64_t spin_max_ns = 500000;

static int placement_enabled = 1;  // (see keep_off_submitter)
EXPORT void hcq_set_tunables(int64_t queue_spin_ns, int64_t host_spin_ns, int64_t worker_spin_ns, int64_t wake_after_ns,
                             int64_t spin_max, int placement) {
  spin_ns_queue = queue_spin_ns; spin_ns_host = host_spin_ns; spin_ns_worker = worker_spin_ns; wake_workers_after_ns = wake_after_ns;
  spin_max_ns = spin_max; placement_enabled = placement;
}

// Spin budgets that adapt. Waking a sleeping thread costs tens of microseconds on a VM (a futex wake, often an IPI
// to an idle vCPU), much more than the work it waits for. A waiter that slept and was woken after a total idle
// time it could have spun through (below HCQ_CPU_SPIN_MAX_US) spins twice that long next time; one that idled
// longer goes back to its base (HCQ_CPU_QUEUE_SPIN_US / HCQ_CPU_HOST_SPIN_US). So a host that sleeps 200 us between
// runs finds the queue thread still spinning, and an idle device spins at most that long before it sleeps.
// Each budget has one writer that matters (host threads race on theirs: a lost update only costs a wake-up).
typedef struct { _Atomic int64_t ns; } spin_budget_t;
static spin_budget_t host_budget;

static inline int64_t spin_of(spin_budget_t *b, int64_t base) {
  int64_t ns = b ? atomic_load_explicit(&b->ns, memory_order_relaxed) : 0;
  return ns > base ? ns : base;
}

static void spin_adapt(spin_budget_t *b, int64_t base, int64_t idle_ns) {
  if (!b) return;
  int64_t want = idle_ns < spin_max_ns ? 2 * idle_ns : base, cur = atomic_load_explicit(&b->ns, memory_order_relaxed);
  if (want > spin_max_ns) want = spin_max_ns;
  if (idle_ns >= spin_max_ns || want > cur) atomic_store_explicit(&b->ns, want, memory_order_relaxed);
}

// Threads (host or command processor) sleeping on a signal's futex word, in buckets by address, with the
// smallest value any of them waits for. A writer wakes only when its bucket has sleepers and the value it
// stored reaches that target, so a counter stepping towards a sleeper's target (the timeline during a long
// pipeline) does not wake it at every step. The target is reset when the last sleeper leaves; a sleeper
// that registers in that instant may miss its wake-up, and sees the value at its next 1 ms re-poll.
#define SLEEPER_BUCKETS 64
typedef struct { _Atomic uint32_t count; _Atomic uint64_t min_target; } sleepers_t;
static sleepers_t signal_sleepers[SLEEPER_BUCKETS] = {[0 ... SLEEPER_BUCKETS - 1] = {0, UINT64_MAX}};
static inline sleepers_t *sleepers_of(const void *addr) { return &signal_sleepers[((uintptr_t)addr >> 3) % SLEEPER_BUCKETS]; }

// The bucket's target is at most `target` (again, for a sleeper already counted: a target reset by a sleeper that left
// just as this one entered is restored at its next re-poll).
static void sleepers_aim(sleepers_t *b, uint64_t target) {
  uint64_t cur = atomic_load_explicit(&b->min_target, memory_order_relaxed);
  while (target < cur && !atomic_compare_exchange_weak_explicit(&b->min_target, &cur, target, memory_order_seq_cst, memory_order_relaxed)) {}
  atomic_thread_fence(memory_order_seq_cst);  // registered before the sleeper re-checks the value
}
static void sleepers_enter(sleepers_t *b, uint64_t target) {
  atomic_fetch_add_explicit(&b->count, 1, memory_order_seq_cst);
  sleepers_aim(b, target);
}
static void sleepers_leave(sleepers_t *b) {
  if (atomic_fetch_sub_explicit(&b->count, 1, memory_order_relaxed) == 1) atomic_store_explicit(&b->min_target, UINT64_MAX, memory_order_relaxed);
}
static inline int should_wake(const void *word64, uint64_t value) {
  sleepers_t *b = sleepers_of(word64);
  return atomic_load_explicit(&b->count, memory_order_relaxed) && value >= atomic_load_explicit(&b->min_target, memory_order_relaxed);
}

// Oversubscribed CPUs: a yield that kept this thread off its CPU for more than CONTENDED_NS (time slices are
// milliseconds; a wake-up on an idle VM is tens of microseconds), or a queue thread that ran that long after its
// doorbell rang, may mean more threads want to run than there are CPUs. Spinning then only delays them, and a spinning
// thread is merely runnable when what it waits for comes, so it waits out the running thread's time slice, where a
// sleeper woken by a futex preempts at once. But on a VM the hypervisor alone keeps a vCPU away that long now and
// then, with nothing else to run. So a late yield only suggests it: the kernel's count of runnable threads
// (runnable_beyond_cpus) confirms it, and only then, for up to CONTENDED_HOLD_NS, host waits and idle queue threads do
// not spin at all; while held, the count is looked at again every CONTENDED_RECHECK_NS and the hold ends as soon as
// the CPUs are no longer oversubscribed (relaxed: a stale read costs one spin). Queue threads waiting on signals and
// pool workers keep spinning: on 2 vCPUs a signal ping-pong between two queue threads oversubscribes the machine by
// itself, and without spinning it runs at 100k instead of 10M round trips a second. Measured on 2 vCPUs, tinygrad
// timing BEAM candidates while two compile workers keep both busy: 47 waited launches took 92-132 ms with spinning,
// 32-57 ms with the hold.
#define CONTENDED_NS 500000
#define CONTENDED_HOLD_NS 100000000
#define CONTENDED_RECHECK_NS 2000000
static _Atomic int64_t contended_until, contended_checked;

// Whether threads wait for a CPU on this machine now: the kernel's instantaneous count of runnable threads (the
// "running" of /proc/loadavg's "running/total") is more than one past the CPUs online. (The caller counts itself, and
// a launch alone keeps a host thread, a queue thread and a pool worker runnable for a moment: one thread past the CPUs
// is what a device of ours does on 2 vCPUs by itself, and it passes.) 1 when it cannot be read (the late yield's
// evidence stands alone then). A few microseconds: only after a late yield, or every few ms while held.
static int runnable_beyond_cpus(void) {
  int fd = open("/proc/loadavg", O_RDONLY | O_CLOEXEC);
  if (fd < 0) return 1;
  char buf[128];
  ssize_t n = read(fd, buf, sizeof buf - 1);
  close(fd);
  if (n <= 0) return 1;
  buf[n] = 0;
  char *p = buf;  // "0.42 0.31 0.20 3/412 12345": the fourth field
  for (int i = 0; i < 3 && p; i++) if ((p = strchr(p, ' '))) p++;
  if (!p) return 1;
  static _Atomic long online;  // (sysconf reads a sysfs file each time: looked up once)
  long cpus = atomic_load_explicit(&online, memory_order_relaxed);
  if (cpus <= 0) {
    cpus = sysconf(_SC_NPROCESSORS_ONLN);
    if (cpus <= 0) cpus = 1;
    atomic_store_explicit(&online, cpus, memory_order_relaxed);
  }
  return strtol(p, NULL, 10) > cpus + 1;
}

// A late yield or wake-up at `now`: hold spinning off if the kernel confirms the CPUs are oversubscribed.
static void contended(int64_t now) {
  if (!runnable_beyond_cpus()) return;
  atomic_store_explicit(&contended_checked, now, memory_order_relaxed);
  atomic_store_explicit(&contended_until, now + CONTENDED_HOLD_NS, memory_order_relaxed);
}
// Nanoseconds left before host waits and idle queue threads spin again (0: they spin), for tests and tools.
EXPORT int64_t hcq_contended_ns(void) {
  int64_t left = atomic_load_explicit(&contended_until, memory_order_relaxed) - now_ns();
  return left > 0 ? left : 0;
}
// A late wake-up noted now, as a spinning wait notes one (for tests and tools): the hold it set, in ns (0: the kernel
// found the CPUs not oversubscribed, so none).
EXPORT int64_t hcq_note_late_wakeup(void) {
  contended(now_ns());
  return hcq_contended_ns();
}
// Holds ended by a look that found the CPUs free (before they ran out), for tests and tools (relaxed: a statistic).
static _Atomic uint64_t holds_lifted;
EXPORT uint64_t hcq_holds_lifted(void) { return atomic_load_explicit(&holds_lifted, memory_order_relaxed); }
// How long a host wait or an idle queue thread may spin when it starts now: `spin_ns`, or 0 while oversubscribed
// (looked at again every CONTENDED_RECHECK_NS, by whichever thread comes first: the hold ends once it is over).
static inline int64_t spin_limit(int64_t spin_ns) {
  int64_t until = atomic_load_explicit(&contended_until, memory_order_relaxed);
  if (!until) return spin_ns;
  int64_t now = now_ns(), checked = atomic_load_explicit(&contended_checked, memory_order_relaxed);
  if (now >= until) return spin_ns;
  if (now - checked >= CONTENDED_RECHECK_NS &&
      atomic_compare_exchange_strong_explicit(&contended_checked, &checked, now, memory_order_relaxed, memory_order_relaxed) &&
      !runnable_beyond_cpus()) {
    atomic_store_explicit(&contended_until, 0, memory_order_relaxed);
    atomic_fetch_add_explicit(&holds_lifted, 1, memory_order_relaxed);
    return spin_ns;
  }
  return 0;
}

// Pause inside a spin loop: a pure pause for the first few microseconds, then yield the CPU so a thread that
// shares this CPU (on 2 cores, often the very thread we wait for) can run. Returns 1 when the loop should stop
// spinning (the yield found the CPUs oversubscribed).
#define PURE_SPIN_NS 1000
struct hcq_queue;
static _Thread_local struct hcq_queue *tls_queue;  // the queue a command-processor thread serves (NULL elsewhere)
static void spread_out(struct hcq_queue *q);
static inline int spin_pause(int64_t spun_ns) {
  if (spun_ns < PURE_SPIN_NS) { cpu_relax(); return 0; }
  int64_t before = now_ns();
  sched_yield();
  int64_t after = now_ns();
  if (after - before > CONTENDED_NS) {
    contended(after);
    return 1;
  }
  if (tls_queue) spread_out(tls_queue);  // still waiting after a yield: maybe another queue thread shares this CPU
  return 0;
}

// For tests and tools (hcq_wait_counts): host waits that went to sleep (release, once registered), and the wakes stores
// made (relaxed: a statistic).
static _Atomic uint64_t wait_counts[WAIT_WORDS];

// Wake the threads of this library sleeping on the 64-bit word at addr for a value <= value, if any; after a store of
// value and a seq_cst fence (here, or elsewhere: hcq's network engine applying a pushed signal).
EXPORT void hcq_wake_sleepers(void *addr, uint64_t value) {
  if (!should_wake(addr, value)) return;
  atomic_fetch_add_explicit(&wait_counts[WAIT_STORE_WAKES], 1, memory_order_relaxed);
  futex_wake(low_word(addr));
}

// out[WAIT_HOST_SLEEPS]: host waits (hcq_wait_ge) that went to sleep, each counted once it is registered as a sleeper: a
// store that reaches its value from then on wakes it (acquire: pairs with the waiter's release increment, so a thread
// that saw the count move and then stores sees the registration). out[WAIT_STORE_WAKES]: stores that found a thread
// asleep waiting for a value they reached and woke it (a FUTEX_WAKE), host waits and queue threads alike.
EXPORT void hcq_wait_counts(uint64_t *out) {
  for (int i = 0; i < WAIT_WORDS; i++) out[i] = atomic_load_explicit(&wait_counts[i], memory_order_acquire);
}

// Publish a 64-bit value into signal memory and wake whoever sleeps on it.
static void store_and_wake64(void *addr, uint64_t value) {
  atomic_store_explicit((_Atomic uint64_t *)addr, value, memory_order_release);  // all earlier work is visible first
  atomic_thread_fence(memory_order_seq_cst);  // pairs with the sleeper's increment + re-check (no lost wake-up)
  hcq_wake_sleepers(addr, value);
}
static void store_and_wake32(void *addr, uint32_t value) {
  atomic_store_explicit((_Atomic uint32_t *)addr, value, memory_order_release);
  atomic_thread_fence(memory_order_seq_cst);
  // Sleepers use the low half of the enclosing 8-byte word (see wait_until); a write to the high half only
  // wakes them if they are already asleep, else they see it at their next 1 ms re-poll.
  void *word64 = (void *)((uintptr_t)addr & ~(uintptr_t)7);
  if (should_wake(word64, 0) || atomic_load_explicit(&sleepers_of(word64)->count, memory_order_relaxed)) futex_wake(low_word(word64));
}

static inline uint64_t load64(const void *addr) { return atomic_load_explicit((_Atomic uint64_t *)addr, memory_order_acquire); }
static inline uint32_t load32(const void *addr) { return atomic_load_explicit((_Atomic uint32_t *)addr, memory_order_acquire); }

// ---------------------------------------------------------------- poisoned signals
// A failed device still executes the SIGNAL packets of signals (FLAG_SIGNAL), so nothing waits forever on
// work it dropped, but it tags the signal's timestamp word with POISON_TAG | device id before storing the
// value (release): whoever acquires the value sees the tag and learns the work behind it failed. A healthy
// store to the signal (device or host) clears the tag first.
// Until some device stores a poisoned signal, nothing is poisoned: healthy SIGNALs and WAITs then skip the
// timestamp word (reading it before storing the value would cost a second trip of the signal's cache line
// between cores). The failed device sets the flag before its poisoned store's release, so a waiter that
// acquired a poisoned value sees the flag too.
static _Atomic int poison_used;
static inline _Atomic uint64_t *timestamp_word(const void *signal) { return (_Atomic uint64_t *)((char *)signal + 8); }
static inline void clear_poison(const void *signal) {
  if (atomic_load_explicit(&poison_used, memory_order_relaxed)) hcq_clear_poison(timestamp_word(signal));
}
// The device id behind a poisoned value just acquired at `signal`, or -1.
static inline int64_t poisoned_by(const void *signal) {
  if (!atomic_load_explicit(&poison_used, memory_order_relaxed)) return -1;
  uint64_t ts = atomic_load_explicit(timestamp_word(signal), memory_order_relaxed);
  return hcq_is_poisoned(ts) ? (int64_t)hcq_poisoner(ts) : -1;
}

typedef int (*cond_fn)(const void *addr, uint64_t a, uint64_t b);
static int cond_ge64(const void *addr, uint64_t v, uint64_t unused) { (void)unused; return load64(addr) >= v; }
// POLL conditions, 32- and 64-bit: the packet format's rule (hcq_poll_holds, generated from hcq/packets.py) over the
// word loaded atomically, one function per condition and width for wait_until's table.
#define POLL32(cond) hcq_poll_holds((cond), load32(addr), v, mask, 0xFFFFFFFFull)
#define POLL64(cond) hcq_poll_holds((cond), load64(addr), v, mask, ~0ull)
static int cond_eq32(const void *addr, uint64_t v, uint64_t mask) { return POLL32(POLL_EQ); }
static int cond_eq64(const void *addr, uint64_t v, uint64_t mask) { return POLL64(POLL_EQ); }
static int cond_geq32(const void *addr, uint64_t v, uint64_t mask) { return POLL32(POLL_GEQ); }
static int cond_and32(const void *addr, uint64_t v, uint64_t mask) { return POLL32(POLL_AND); }
static int cond_and64(const void *addr, uint64_t v, uint64_t mask) { return POLL64(POLL_AND); }
static int cond_nor32(const void *addr, uint64_t v, uint64_t mask) { return POLL32(POLL_NOR); }
static int cond_nor64(const void *addr, uint64_t v, uint64_t mask) { return POLL64(POLL_NOR); }
#undef POLL32
#undef POLL64
_Static_assert(POLL_COUNT == 4, "a POLL condition was added to hcq/packets.py: give it its functions here");
static const cond_fn poll_conds[2][POLL_COUNT] = {[0] = {[POLL_EQ] = cond_eq32, [POLL_GEQ] = cond_geq32, [POLL_AND] = cond_and32, [POLL_NOR] = cond_nor32},
                                         [1] = {[POLL_EQ] = cond_eq64, [POLL_GEQ] = cond_ge64, [POLL_AND] = cond_and64, [POLL_NOR] = cond_nor64}};

// Spin for spin_ns (a host wait: none while the CPUs are oversubscribed), then sleep on the futex word in slices of
// at most 1 ms (memory written without a wake is still seen). Returns 0 when cond holds, 1 on timeout (timeout_ns < 0:
// never), 2 when *stop or *failed is set (a stopped queue, or a failed device whose pending work is dropped).
static int wait_until(cond_fn cond, const void *addr, uint64_t a, uint64_t b, int64_t spin_ns, int64_t timeout_ns,
                      _Atomic int *stop, _Atomic int *failed, spin_budget_t *budget, int host) {
  if (cond(addr, a, b)) return 0;
  int64_t start = now_ns(), t = start, base = spin_ns;
  spin_ns = host ? spin_limit(spin_of(budget, base)) : spin_of(budget, base);
  for (int stop_spinning = 0; t - start < spin_ns && !stop_spinning; t = now_ns())
    for (int k = 0, n = t - start < PURE_SPIN_NS ? 64 : 1; k < n && !stop_spinning; k++) {
      if (cond(addr, a, b)) return 0;
      stop_spinning = spin_pause(t - start);
    }
  void *word64 = (void *)((uintptr_t)addr & ~(uintptr_t)7);
  _Atomic uint32_t *word = low_word(word64);
  sleepers_t *sleepers = sleepers_of(word64);
  uint64_t target = cond == cond_ge64 ? a : 0;  // polls (masked compares) are woken by any write
  // Registered as a sleeper for the whole sleep, re-polls included: a store at any moment of it wakes (or finds awake)
  // this waiter, and sees it registered.
  sleepers_enter(sleepers, target);
  if (host) atomic_fetch_add_explicit(&wait_counts[WAIT_HOST_SLEEPS], 1, memory_order_release);  // (after registering)
  int rc;
  for (;;) {
    if ((stop && atomic_load_explicit(stop, memory_order_relaxed)) || (failed && atomic_load_explicit(failed, memory_order_relaxed))) { rc = 2; break; }
    int64_t slice = SLEEP_REPOLL_NS;
    if (timeout_ns >= 0) {
      int64_t left = timeout_ns - (now_ns() - start);
      if (left <= 0) { rc = cond(addr, a, b) ? 0 : 1; break; }
      if (left < slice) slice = left;
    }
    uint32_t seen = atomic_load_explicit(word, memory_order_seq_cst);
    if (cond(addr, a, b)) { rc = 0; break; }
    futex_wait(word, seen, slice);
    if (cond(addr, a, b)) { spin_adapt(budget, base, now_ns() - start); rc = 0; break; }
    sleepers_aim(sleepers, target);
  }
  sleepers_leave(sleepers);
  return rc;
}

// Host-side wait (called from Python with the GIL released): value at addr >= value, 64-bit.
EXPORT int hcq_wait_ge(const void *addr, uint64_t value, int64_t timeout_ns) {
  return wait_until(cond_ge64, addr, value, 0, spin_ns_host, timeout_ns, NULL, NULL, &host_budget, 1);
}

// Host-side signal store: a fresh value (no poison), published with release; wakes whoever sleeps on it.
static inline void stored(const void *addr, uint64_t nbytes, uint32_t flags);
EXPORT void hcq_signal_store_quiet(void *addr, uint64_t value) {  // (without the store hook)
  clear_poison(addr);
  store_and_wake64(addr, value);
}
EXPORT void hcq_signal_store(void *addr, uint64_t value) {
  hcq_signal_store_quiet(addr, value);
  stored(addr, HCQ_SIGNAL_SIZE, FLAG_SIGNAL);  // a host store reaches the signal's replicas too
}

// Host-side poisoned store: `value` tagged as stored by failed device `id` (which may name no device here: a remote
// server that fed the signal and was lost). A WAIT it releases fails its own device, naming `id` as the peer.
EXPORT void hcq_signal_poison(void *addr, uint64_t value, uint32_t id) {
  atomic_store_explicit(&poison_used, 1, memory_order_relaxed);  // before the release below
  atomic_store_explicit(timestamp_word(addr), POISON_TAG | id, memory_order_relaxed);
  store_and_wake64(addr, value);
}

// Host-side compare-and-swap of a 64-bit word (seq_cst); returns the value it found.
EXPORT uint64_t hcq_cas64(void *addr, uint64_t expected, uint64_t desired) {
  atomic_compare_exchange_strong((_Atomic uint64_t *)addr, &expected, desired);
  return expected;
}

// ---------------------------------------------------------------- fault containment
// A fault (SIGSEGV, SIGBUS, SIGFPE, SIGILL) raised while a command-processor thread runs a kernel or touches
// packet memory jumps back to that thread's guard, which marks the device failed with what faulted; the
// process goes on. Faults anywhere else go to the handler installed before ours (e.g. Python's faulthandler).
typedef struct hcq_dev hcq_dev_t;
typedef struct { uint64_t ngrp[3], lsz[3]; } hcq_launch_t;
// What a kernel's entry point keeps up to date for this thread (compiler.py's PRELUDE has the same struct): the block
// it runs (names the block if it faults) and its launch context, which helper functions of kernel code read through
// hcq_launch_ctx (kernel code keeps no thread-locals, so it loads without a dynamic linker).
typedef struct { volatile uint64_t block; const void *volatile launch_ctx; } hcq_entry_slots_t;
typedef void (*hcq_entry_t)(const void *kargs, const hcq_launch_t *launch, uint64_t block_begin, uint64_t block_end,
                            hcq_entry_slots_t *slots);

typedef struct {
  sigjmp_buf env;
  volatile int armed;         // inside a guarded region
  hcq_entry_slots_t slots;    // block being run and launch context, stored by the kernel trampoline
  uintptr_t fn;               // entry point being run (0: a packet, not a kernel)
  int sig;
  uintptr_t addr;
} fault_ctx_t;

static _Thread_local fault_ctx_t *tls_fault;
// The launch context of the kernel this thread runs (NULL outside kernels), for helper functions of kernel code.
EXPORT const void *hcq_launch_ctx(void) { return tls_fault ? tls_fault->slots.launch_ctx : NULL; }
static _Thread_local uintptr_t tls_chained_addr;  // the last fault outside a guard handed to the previous handler
static struct sigaction old_actions[65];
static const int fault_signals[] = {SIGSEGV, SIGBUS, SIGFPE, SIGILL};
static pthread_mutex_t handlers_lock = PTHREAD_MUTEX_INITIALIZER;
static _Atomic int handlers_installed, handlers_rearmed;

static void fault_handler(int sig, siginfo_t *si, void *uc) {
  fault_ctx_t *c = tls_fault;
  if (c && c->armed) {
    c->armed = 0; c->sig = sig; c->addr = (uintptr_t)si->si_addr;
    siglongjmp(c->env, 1);  // SA_NODEFER: the signal stays unblocked for the next fault
  }
  // Not ours. A previous handler that returns makes the instruction fault again: the second time, the default.
  if (tls_chained_addr == (uintptr_t)si->si_addr + 1) { signal(sig, SIG_DFL); return; }
  tls_chained_addr = (uintptr_t)si->si_addr + 1;
  struct sigaction *old = &old_actions[sig];
  if ((old->sa_flags & SA_SIGINFO) && old->sa_sigaction) { old->sa_sigaction(sig, si, uc); return; }
  if (old->sa_handler == SIG_IGN) return;
  if (old->sa_handler != SIG_DFL && old->sa_handler != NULL) { old->sa_handler(sig); return; }
  signal(sig, SIG_DFL);  // the default action happens when the faulting instruction runs again
}

static inline int is_ours(const struct sigaction *a) { return (a->sa_flags & SA_SIGINFO) && a->sa_sigaction == fault_handler; }

// Install our handlers wherever they are not installed: at the first device, and again whenever someone
// replaced them since (Python's signal.signal, faulthandler, ...). The replacement becomes the handler
// that faults outside our guards are passed to.
static void install_fault_handlers(void) {
  struct sigaction sa;
  memset(&sa, 0, sizeof sa);
  sa.sa_sigaction = fault_handler;
  sa.sa_flags = SA_SIGINFO | SA_ONSTACK | SA_NODEFER;
  sigemptyset(&sa.sa_mask);
  pthread_mutex_lock(&handlers_lock);
  for (size_t i = 0; i < sizeof fault_signals / sizeof *fault_signals; i++) {
    int sig = fault_signals[i];
    struct sigaction cur, prev;
    if (sigaction(sig, NULL, &cur) == 0 && is_ours(&cur)) continue;
    if (sigaction(sig, &sa, &prev) != 0) continue;
    if (!is_ours(&prev)) old_actions[sig] = prev;
    if (atomic_load(&handlers_installed)) atomic_fetch_add(&handlers_rearmed, 1);
  }
  atomic_store(&handlers_installed, 1);
  pthread_mutex_unlock(&handlers_lock);
}

// Whether our handlers were replaced is looked at (four sigaction calls) when a queue thread wakes from idle
// (work submitted after the host did something else, such as installing a handler) and every 256th kernel or
// copy it runs; a clock read per kernel cost more than the kernel itself on some machines.
static _Thread_local uint32_t tls_runs;
static inline void check_fault_handlers(void) {
  if ((++tls_runs & 255) == 0) install_fault_handlers();
}

// How many times our handlers were found replaced and re-armed (checks now).
EXPORT int hcq_fault_handlers_rearmed(void) {
  install_fault_handlers();
  return atomic_load(&handlers_rearmed);
}

// Every command-processor thread starts here: asynchronous signals blocked (they are the Python main thread's
// business; only the synchronous fault signals reach these threads), an alternate signal stack, its fault context
// (on the thread's own stack, so it lives exactly as long as the thread), and a name that says whose it is
// ("hcq<device id>-<role>", seen in top -H and perf; set here, so a moment after the device opened).
static void thread_init(fault_ctx_t *ctx, const char *role, uint32_t dev_id) {
  char name[16];
  snprintf(name, sizeof name, "hcq%u-%s", dev_id, role);
  pthread_setname_np(pthread_self(), name);
  sigset_t set;
  sigfillset(&set);
  for (size_t i = 0; i < sizeof fault_signals / sizeof *fault_signals; i++) sigdelset(&set, fault_signals[i]);
  sigdelset(&set, SIGABRT); sigdelset(&set, SIGTRAP); sigdelset(&set, SIGSYS);
  pthread_sigmask(SIG_BLOCK, &set, NULL);
  stack_t ss = {.ss_size = 64 * 1024, .ss_flags = 0};
  ss.ss_sp = malloc(ss.ss_size);
  if (ss.ss_sp) sigaltstack(&ss, NULL);
  memset(ctx, 0, sizeof *ctx);
  tls_fault = ctx;
}

static void record_fault(hcq_dev_t *d, const fault_ctx_t *c, int op);

// Run blocks [b, e) of a kernel under this thread's fault context `c`: 0, or -1 after a fault (its signal, address,
// block and entry left in `c` for the caller to report; the caller clears c->fn).
static int run_guarded(fault_ctx_t *c, hcq_entry_t fn, const void *kargs, const hcq_launch_t *L, uint64_t b, uint64_t e) {
  c->fn = (uintptr_t)fn;
  c->slots.block = b;
  if (sigsetjmp(c->env, 0)) {
    c->slots.launch_ctx = NULL;  // (the entry point did not clear it)
    return -1;
  }
  c->armed = 1;
  fn(kargs, L, b, e, &c->slots);
  c->armed = 0;
  c->fn = 0;
  return 0;
}

// Run blocks [b, e) of a kernel; a fault inside marks the device failed (entry, block, address).
static int guarded_entry(hcq_dev_t *d, hcq_entry_t fn, const void *kargs, const hcq_launch_t *L, uint64_t b, uint64_t e) {
  fault_ctx_t *c = tls_fault;
  if (run_guarded(c, fn, kargs, L, b, e) == 0) return 0;
  record_fault(d, c, OP_EXEC);
  c->fn = 0;
  return -1;
}

// Run blocks [b, e) of a kernel on the calling thread, which is not a command-processor thread (the NV emulator runs
// its CPU twins on its channel threads), with the same containment: returns 0, or -1 with out[0..2] = the signal, the
// faulting address and the block. The thread gets a fault context and an alternate signal stack at its first run,
// freed when it exits (a thread-specific key's destructor).
static pthread_key_t guest_key;
static pthread_once_t guest_once = PTHREAD_ONCE_INIT;
typedef struct { fault_ctx_t ctx; stack_t stack; } guest_t;
static void guest_free(void *p) {
  guest_t *g = p;
  stack_t off = {.ss_flags = SS_DISABLE};
  sigaltstack(&off, NULL);  // (the thread is exiting: no signal can be running on it)
  free(g->stack.ss_sp);
  free(g);
}
static void guest_key_init(void) { pthread_key_create(&guest_key, guest_free); }

EXPORT int hcq_run_entry_guarded(hcq_entry_t fn, const void *kargs, const hcq_launch_t *L, uint64_t b, uint64_t e, uint64_t *out) {
  if (!tls_fault) {
    pthread_once(&guest_once, guest_key_init);
    guest_t *g = calloc(1, sizeof *g);
    if (!g) return -2;
    g->stack = (stack_t){.ss_size = 64 * 1024, .ss_flags = 0};
    g->stack.ss_sp = malloc(g->stack.ss_size);
    if (g->stack.ss_sp) sigaltstack(&g->stack, NULL);
    pthread_setspecific(guest_key, g);
    tls_fault = &g->ctx;
  }
  install_fault_handlers();  // (four sigaction calls: someone may have replaced ours since the last run)
  fault_ctx_t *c = tls_fault;
  if (run_guarded(c, fn, kargs, L, b, e) == 0) return 0;
  out[0] = (uint64_t)c->sig; out[1] = (uint64_t)c->addr; out[2] = c->slots.block;
  c->fn = 0;
  return -1;
}

// ---------------------------------------------------------------- worker pool (one per device)

typedef struct {
  // gen is even when a job is published and stable, odd while the dispatcher rewrites the job fields.
  _Atomic uint32_t gen;
  _Atomic uint32_t running;  // workers currently inside the job (claiming or executing blocks)
  _Atomic uint64_t next_block, done_blocks;
  _Atomic uint32_t done_word;  // futex word the dispatcher sleeps on, bumped by the last finisher
  uint64_t nblocks, chunk;
  hcq_entry_t fn;
  const void *kargs;
  hcq_launch_t launch;
  _Atomic int nthreads;  // workers wanted (the queue thread is one more); lowered if some could not start
  _Atomic int started;   // workers started so far: they start with the first grid worth splitting
  uint32_t born_gen; // gen before the job the workers were started for (they take the jobs published after it)
  int joined;        // workers joined after a stop (hcq_dev_destroy)
  _Atomic int start_error;  // errno of the first worker that could not start (0: none)
  _Atomic uint32_t woken, inlined;  // grids of several blocks the pool was woken for, and run inline (counts, for tests)
  pthread_t *threads;
  _Atomic int stop;
  hcq_dev_t *dev;
  uint32_t dev_id;      // (names the worker threads)
  _Atomic int *failed;  // the device's sticky failure flag: blocks of a failed device are skipped
} pool_t;

static void run_chunks(pool_t *p) {
  uint64_t done = 0;
  for (;;) {
    uint64_t b = atomic_fetch_add_explicit(&p->next_block, p->chunk, memory_order_relaxed);
    if (b >= p->nblocks) break;
    uint64_t e = b + p->chunk < p->nblocks ? b + p->chunk : p->nblocks;
    if (!atomic_load_explicit(p->failed, memory_order_relaxed)) guarded_entry(p->dev, p->fn, p->kargs, &p->launch, b, e);
    done += e - b;  // counted even when skipped or faulted, so the dispatcher never waits forever
  }
  if (done && atomic_fetch_add_explicit(&p->done_blocks, done, memory_order_acq_rel) + done == p->nblocks) {
    atomic_fetch_add_explicit(&p->done_word, 1, memory_order_release);
    futex_wake(&p->done_word);
  }
}

static void *worker_main(void *arg) {
  pool_t *p = arg;
  fault_ctx_t ctx;
  thread_init(&ctx, "worker", p->dev_id);
  uint32_t seen = p->born_gen;  // (not gen now: the job this worker was started for may be published already)
  while (!atomic_load_explicit(&p->stop, memory_order_relaxed)) {
    uint32_t g = atomic_load_explicit(&p->gen, memory_order_acquire);
    if (g == seen || (g & 1)) {  // nothing new (or being rewritten): spin a little, then sleep on gen
      int64_t start = now_ns();
      for (int64_t spun = 0; ((g = atomic_load_explicit(&p->gen, memory_order_acquire)) == seen || (g & 1)) && spun < spin_ns_worker;
           spun = now_ns() - start)
        if (spin_pause(spun)) break;
      if (g == seen || (g & 1)) futex_wait(&p->gen, g, (g & 1) ? SLEEP_REPOLL_NS : FOREVER);
      continue;
    }
    // Enter the job, then re-check gen: the dispatcher makes gen odd before it waits for running == 0,
    // so either it sees us (and waits) or we see its odd gen (and back off). Both sides use seq_cst.
    atomic_fetch_add_explicit(&p->running, 1, memory_order_seq_cst);
    if (atomic_load_explicit(&p->gen, memory_order_seq_cst) == g) run_chunks(p);
    atomic_fetch_sub_explicit(&p->running, 1, memory_order_release);
    seen = g;
  }
  return NULL;
}

// Start the workers not started yet (by the queue thread, before the first job worth splitting). A worker
// that cannot start lowers the pool's size: grids still run, on fewer threads.
static void pool_start(pool_t *p) {
  p->born_gen = atomic_load_explicit(&p->gen, memory_order_relaxed);  // (pthread_create orders it before the worker's read)
  while (p->started < p->nthreads) {
    int rc = pthread_create(&p->threads[p->started], NULL, worker_main, p);
    if (rc) { p->start_error = rc; p->nthreads = p->started; return; }
    p->started++;
  }
}

// Direct-mapped memory of how long one block of an entry point took last time (ns), so that grids of blocks known
// to be tiny run inline on the queue thread. Keyed by a hash of the whole address: each kernel is a library of its
// own, loaded page-aligned, so its entry's low bits are the same as every other kernel's.
#define HIST_SLOTS 4096
static _Atomic uintptr_t hist_fn[HIST_SLOTS];
static _Atomic uint64_t hist_ns[HIST_SLOTS];

static unsigned hist_slot(hcq_entry_t fn) {
  return (unsigned)(((uint64_t)(uintptr_t)fn * 0x9E3779B97F4A7C15ull) >> 52);  // (Fibonacci hashing: the top 12 bits)
}

static void wake_pool(pool_t *p, uint32_t even_gen) {
  atomic_fetch_add_explicit(&p->woken, 1, memory_order_relaxed);
  atomic_store_explicit(&p->gen, even_gen, memory_order_release);
  futex_wake(&p->gen);
}

// Run a grid: inline when it has one block or its blocks were measured tiny last time; else split with the pool,
// woken at once. (A kernel not measured yet is split too: the queue thread could only look at the clock between its
// blocks, so an unknown grid of a few long blocks would run them one after another on one thread.)
static void pool_exec(pool_t *p, hcq_entry_t fn, const void *kargs, const hcq_launch_t *L, uint64_t nblocks) {
  if (nblocks == 1 || p->nthreads == 0) {  // nothing to split: run inline, no timing or history needed
    guarded_entry(p->dev, fn, kargs, L, 0, nblocks);
    return;
  }
  unsigned slot = hist_slot(fn);
  uint64_t known_ns = atomic_load_explicit(&hist_fn[slot], memory_order_relaxed) == (uintptr_t)fn
                          ? atomic_load_explicit(&hist_ns[slot], memory_order_relaxed) : 0;
  int64_t t0 = now_ns();
  uint64_t per_block_ns = 0;  // (0: the grid's wall time over its blocks)
  if (known_ns && known_ns < (uint64_t)wake_workers_after_ns / nblocks) {  // (known_ns * nblocks could wrap)
    atomic_fetch_add_explicit(&p->inlined, 1, memory_order_relaxed);
    guarded_entry(p->dev, fn, kargs, L, 0, nblocks);
  } else {
    if (p->started < p->nthreads) pool_start(p);
    // Publish the job: gen odd, wait for stragglers of the last job to leave, write fields, gen even.
    uint32_t g = atomic_fetch_add_explicit(&p->gen, 1, memory_order_seq_cst) + 1;
    while (atomic_load_explicit(&p->running, memory_order_seq_cst)) cpu_relax();
    p->fn = fn; p->kargs = kargs; p->launch = *L; p->nblocks = nblocks;
    uint64_t parts = (uint64_t)(p->nthreads + 1) * 8;
    p->chunk = nblocks / parts ? nblocks / parts : 1;
    atomic_store_explicit(&p->next_block, 0, memory_order_relaxed);
    atomic_store_explicit(&p->done_blocks, 0, memory_order_relaxed);
    uint32_t done_seen = atomic_load_explicit(&p->done_word, memory_order_relaxed);
    wake_pool(p, g + 1);
    uint64_t mine = 0;
    int64_t mine_t0 = now_ns();
    for (;;) {  // the queue thread works too
      uint64_t b = atomic_fetch_add_explicit(&p->next_block, p->chunk, memory_order_relaxed);
      if (b >= nblocks) break;
      uint64_t e = b + p->chunk < nblocks ? b + p->chunk : nblocks;
      if (!atomic_load_explicit(p->failed, memory_order_relaxed)) guarded_entry(p->dev, fn, kargs, L, b, e);
      mine += e - b;
    }
    // A block's time is what the queue thread's own blocks took: the grid's wall time over its blocks would divide by
    // the threads that shared it, so a grid that is long alone but short split would look tiny, run inline (long),
    // look long again, and so on, every other run.
    if (mine) per_block_ns = (uint64_t)(now_ns() - mine_t0) / mine + 1;
    uint64_t total = mine ? atomic_fetch_add_explicit(&p->done_blocks, mine, memory_order_acq_rel) + mine
                          : atomic_load_explicit(&p->done_blocks, memory_order_acquire);
    // Wait for the workers' blocks; their writes are visible after the acquire on done_blocks.
    while (total < nblocks) {
      int64_t s = now_ns();
      for (int64_t spun = 0; (total = atomic_load_explicit(&p->done_blocks, memory_order_acquire)) < nblocks && spun < spin_ns_worker;
           spun = now_ns() - s)
        if (spin_pause(spun)) break;
      if (total < nblocks) {
        futex_wait(&p->done_word, done_seen, SLEEP_REPOLL_NS);
        done_seen = atomic_load_explicit(&p->done_word, memory_order_relaxed);
        total = atomic_load_explicit(&p->done_blocks, memory_order_acquire);
      }
    }
  }
  atomic_store_explicit(&hist_fn[slot], (uintptr_t)fn, memory_order_relaxed);
  atomic_store_explicit(&hist_ns[slot], per_block_ns ? per_block_ns : (uint64_t)(now_ns() - t0) / nblocks + 1, memory_order_relaxed);
}

// ---------------------------------------------------------------- copy engine
// Each copy engine has one helper thread (started with its first copy worth splitting) that copies the
// second half of large copies.
typedef struct {
  _Atomic uint32_t gen, done;
  void *dst; const void *src; size_t n;
  int rc;  // the helper's last part: 0, or -1 when it faulted
  pthread_t thread;
  int started, start_error;
  _Atomic int stop;
  hcq_dev_t *dev;
  uint32_t dev_id;  // (names the helper thread)
} copy_helper_t;

// Copies far larger than the caches go faster with streaming (non-temporal) stores: no read-for-ownership
// of the destination and no eviction of everything else. Non-overlapping ranges only.
#define STREAM_COPY_BYTES (64u << 20)
static void stream_copy(void *dst, const void *src, size_t n) {
#if defined(__x86_64__)
  char *d = dst; const char *s = src;
  size_t head = (16 - ((uintptr_t)d & 15)) & 15;
  if (head > n) head = n;
  memcpy(d, s, head); d += head; s += head; n -= head;
  for (; n >= 64; n -= 64, d += 64, s += 64) {
    __m128i a = _mm_loadu_si128((const __m128i *)s), b = _mm_loadu_si128((const __m128i *)(s + 16));
    __m128i c = _mm_loadu_si128((const __m128i *)(s + 32)), e = _mm_loadu_si128((const __m128i *)(s + 48));
    _mm_stream_si128((__m128i *)d, a); _mm_stream_si128((__m128i *)(d + 16), b);
    _mm_stream_si128((__m128i *)(d + 32), c); _mm_stream_si128((__m128i *)(d + 48), e);
  }
  _mm_sfence();  // streaming stores are weakly ordered: complete them before the copy is reported done
  memcpy(d, s, n);
#else
  memcpy(dst, src, n);
#endif
}

// A copy (or part of one) that records a fault on the device instead of crashing. Returns 0, or -1.
static int guarded_copy(hcq_dev_t *d, void *dst, const void *src, size_t n, int overlap) {
  fault_ctx_t *c = tls_fault;
  if (sigsetjmp(c->env, 0)) { record_fault(d, c, OP_COPY); return -1; }
  c->armed = 1;
  if (!overlap && n >= STREAM_COPY_BYTES) stream_copy(dst, src, n);
  else hcq_host_copy(dst, src, n);  // memmove, save where libc's would crawl (see hostcopy.h)
  c->armed = 0;
  return 0;
}

static void *copy_helper_main(void *arg) {
  copy_helper_t *h = arg;
  fault_ctx_t ctx;
  thread_init(&ctx, "copyhelp", h->dev_id);
  uint32_t seen = 0;
  for (;;) {
    uint32_t g = atomic_load_explicit(&h->gen, memory_order_acquire);
    if (g == seen) {
      int64_t start = now_ns();
      for (int64_t spun = 0; (g = atomic_load_explicit(&h->gen, memory_order_acquire)) == seen && spun < spin_ns_worker; spun = now_ns() - start)
        if (spin_pause(spun)) break;
      if (g == seen) { futex_wait(&h->gen, seen, FOREVER); continue; }
    }
    if (atomic_load_explicit(&h->stop, memory_order_acquire)) break;  // stop bumps gen: checked before any part
    h->rc = guarded_copy(h->dev, h->dst, h->src, h->n, 0);
    seen = g;
    atomic_store_explicit(&h->done, g, memory_order_release);
    futex_wake(&h->done);
  }
  return NULL;
}

#define SPLIT_COPY_BYTES (4u << 20)
// memmove semantics. Large non-overlapping copies are split with the helper; both halves finish (even when
// one faults) before this returns, so nothing touches either range afterwards. Returns 0, or -1 on a fault.
static int engine_copy(copy_helper_t *h, hcq_dev_t *dev, void *dst, const void *src, size_t n) {
  char *d = dst; const char *s = src;
  int overlap = (d < s + n) && (s < d + n);
  if (h && !h->started && !h->start_error && n >= SPLIT_COPY_BYTES) {
    h->start_error = pthread_create(&h->thread, NULL, copy_helper_main, h);
    h->started = !h->start_error;
  }
  if (!h || !h->started || n < SPLIT_COPY_BYTES || overlap) return guarded_copy(dev, dst, src, n, overlap);
  size_t half = (n / 2) & ~(size_t)63;
  h->dst = d + half; h->src = s + half; h->n = n - half;
  uint32_t g = atomic_load_explicit(&h->gen, memory_order_relaxed) + 1;
  atomic_store_explicit(&h->gen, g, memory_order_release);
  futex_wake(&h->gen);
  int rc = guarded_copy(dev, d, s, half, 0);
  for (uint32_t seen; (seen = atomic_load_explicit(&h->done, memory_order_acquire)) != g;) futex_wait(&h->done, seen, SLEEP_REPOLL_NS);
  return rc | h->rc;
}

// ---------------------------------------------------------------- queues and devices
typedef struct hcq_queue {
  _Atomic uint64_t wptr;  // words published by the host (release), read by the queue thread (acquire)
  _Atomic int submitter_cpu;  // the CPU the last submission came from (-1: none yet); see keep_off_submitter
  char pad0[52];
  _Atomic uint64_t rptr;  // words consumed by the queue thread (release), read by the host (acquire)
  char pad1[56];
  _Atomic uint32_t doorbell;  // bumped on every publish; the queue thread sleeps on it
  _Atomic uint32_t sleeping;  // set by the queue thread before it sleeps
  _Atomic int64_t rung_at;    // when a submission last woke it (relaxed: a heuristic's input, see queue_main)
  char pad2[48];
  uint64_t *ring, mask;
  void *map; size_t map_len;  // the ring's mapping, with a guard page on each side
  int kind, index;
  hcq_dev_t *dev;
  pthread_t thread;
  int started, start_error;  // copy queues start their thread with their first submission
  int joined;                 // the thread was joined after a stop (hcq_queue_destroy may free the queue)
  _Atomic int stop;
  pthread_mutex_t submit_lock;  // several host threads may submit to one ring
  copy_helper_t *helper;
  _Atomic uint64_t packets_done;
  // What the queue thread is doing, for hang reports (read racily by the host; informational only).
  _Atomic uint64_t cur_pos;     // ring word index of the packet being run, UINT64_MAX when idle
  _Atomic uint64_t cur_sub;     // index of the packet inside an indirect buffer, UINT64_MAX outside one
  _Atomic uint64_t cur_pkt[CUR_PKT_WORDS];  // its first words
  // Placement (the queue thread's own): the CPU it last noted itself awake on (-1: asleep), when it last looked at moving.
  int on_cpu;
  int64_t moved_ns, spread_ns;
  spin_budget_t budget;  // how long the queue thread spins before it sleeps (on its doorbell, WAITs and POLLs)
  // Its idle spells, for tests and tools (hcq_queue_spin_state; the queue thread's own, relaxed unless said otherwise):
  _Atomic int64_t last_spin_ns;  // the spin it allowed itself in the last spell that spun out (0: held off), before `sleeping`
  _Atomic int64_t last_idle_ns;  // the idle time it learned from at its last wake-up (see queue_main)
  _Atomic uint64_t wakes;        // doorbell sleeps that ended (release: after last_idle_ns and the budget it set)
} hcq_queue_t;

// ---------------------------------------------------------------- placement
// On a machine with few CPUs the scheduler tends to wake a queue thread on the CPU of the host thread that rang
// it (wake-affine). The two then share one CPU while each spins for the other: a launch + wait round trip goes
// from about 2 us to 10 us, and pipelined launches slow down too. Each submission notes the submitter's CPU; a
// queue thread about to spin on that CPU moves off it: it narrows its affinity to the other CPUs it may use (which
// migrates it at once) and gives the whole set back right away, so the scheduler stays free to place it later
// (pinning queue threads away for good would crowd them onto the other CPUs while the host sleeps: two queues
// ping-ponging signals on one CPU, a copy engine and its helper sharing one). It looks at most once per
// MOVE_INTERVAL_NS, and leaves a thread whose affinity somebody else changed within that set (pinned to one CPU,
// it stays there). HCQ_CPU_PLACEMENT=0 turns this off.
#define MOVE_INTERVAL_NS 10000000LL
#define SPREAD_INTERVAL_NS 1000000LL  // (see spread_out)

// Awake queue threads, in all and per CPU (as each last saw itself; a heuristic, updated without locks). A queue
// thread moves only while it is the one awake queue thread of the process, and only to a CPU no other awake
// queue thread uses: queues that ping-pong signals (on one device or across devices) keep the CPUs the scheduler
// gave them while the host sleeps, instead of being crowded onto the CPUs the host is not on.
static _Atomic int awake_on[CPU_SETSIZE], awake_total;

static void placement_note(hcq_queue_t *q, int cpu) {  // cpu < 0: the thread is going to sleep
  if (cpu >= CPU_SETSIZE) cpu = -1;
  if (cpu == q->on_cpu) return;
  if (q->on_cpu >= 0) { atomic_fetch_sub_explicit(&awake_on[q->on_cpu], 1, memory_order_relaxed); atomic_fetch_sub_explicit(&awake_total, 1, memory_order_relaxed); }
  if (cpu >= 0) { atomic_fetch_add_explicit(&awake_on[cpu], 1, memory_order_relaxed); atomic_fetch_add_explicit(&awake_total, 1, memory_order_relaxed); }
  q->on_cpu = cpu;
}

static void placement_init(hcq_queue_t *q) {
  q->moved_ns = now_ns() - MOVE_INTERVAL_NS;
  q->spread_ns = now_ns() - SPREAD_INTERVAL_NS;
  tls_queue = q;
  q->on_cpu = -1;
  placement_note(q, sched_getcpu());
}

// Move the calling queue thread to another CPU of its affinity that no awake queue thread uses (and that is not
// `avoid`): narrow the affinity, which migrates it at once, then give the whole set back. False when there is none.
static int move_to_quiet_cpu(hcq_queue_t *q, int avoid) {
  cpu_set_t current, set;
  if (pthread_getaffinity_np(pthread_self(), sizeof current, &current) != 0) return 0;  // (somebody else's setting: stay within it)
  CPU_ZERO(&set);
  for (int c = 0; c < CPU_SETSIZE; c++)
    if (c != avoid && c != q->on_cpu && CPU_ISSET(c, &current) && atomic_load_explicit(&awake_on[c], memory_order_relaxed) == 0) CPU_SET(c, &set);
  if (CPU_COUNT(&set) == 0 || pthread_setaffinity_np(pthread_self(), sizeof set, &set) != 0) return 0;
  pthread_setaffinity_np(pthread_self(), sizeof current, &current);
  placement_note(q, sched_getcpu());
  return 1;
}

static void keep_off_submitter(hcq_queue_t *q) {
  int cpu = sched_getcpu();
  placement_note(q, cpu);
  if (!placement_enabled) return;
  int host = atomic_load_explicit(&q->submitter_cpu, memory_order_relaxed);
  if (host < 0 || host >= CPU_SETSIZE || cpu != host || atomic_load_explicit(&awake_total, memory_order_relaxed) > 1) return;
  int64_t now = now_ns();
  if (now - q->moved_ns < MOVE_INTERVAL_NS) return;  // one look per interval: the host may move about, do not chase it
  q->moved_ns = now;
  move_to_quiet_cpu(q, host);
}

// Moves spread_out made, and how many of them left a CPU that another queue thread had left less than PAIRED_NS
// before (the two moving together), for tests and tools.
#define PAIRED_NS 200000
static _Atomic uint64_t spread_moves, spread_moves_paired;
static _Atomic int64_t spread_left_at[CPU_SETSIZE];
EXPORT void hcq_spread_moves(uint64_t *out) {
  out[0] = atomic_load_explicit(&spread_moves, memory_order_relaxed);
  out[1] = atomic_load_explicit(&spread_moves_paired, memory_order_relaxed);
}
static void count_move(int from, int64_t at) {
  atomic_fetch_add_explicit(&spread_moves, 1, memory_order_relaxed);
  if (at - atomic_exchange_explicit(&spread_left_at[from], at, memory_order_relaxed) < PAIRED_NS)
    atomic_fetch_add_explicit(&spread_moves_paired, 1, memory_order_relaxed);
}

// Two queue threads that wait for each other (a signal ping-pong) can end up on one CPU while another CPU idles:
// each then runs only when the other yields, about 2.5 us a round trip instead of 0.1, and the scheduler may leave
// them so for many milliseconds (a task that keeps yielding looks cache-hot to its load balancer). A queue thread
// still waiting after a yield looks, at most once per SPREAD_INTERVAL_NS, whether another awake queue thread is on
// its CPU, and if so moves to a CPU with none. Two such threads started together look in step, and a move takes
// tens of microseconds; each would see the other still there, and both would move, to the same CPU, every interval
// (seen on 2 vCPUs: 8 us round trips for up to 15 ms, in about one ping-pong in ten). So a thread first takes itself
// out of its CPU's count, only while another stays counted there (a compare-and-swap: of two looking at once, one
// leaves), and the other then finds itself alone and stays.
static void spread_out(hcq_queue_t *q) {
  if (!placement_enabled) return;
  int64_t now = now_ns();
  if (now - q->spread_ns < SPREAD_INTERVAL_NS) return;
  q->spread_ns = now;
  int cpu = sched_getcpu();
  placement_note(q, cpu);
  if (cpu < 0 || cpu >= CPU_SETSIZE) return;
  // (relaxed: what matters is that the count's decrements are atomic, not their order against other memory)
  int here = atomic_load_explicit(&awake_on[cpu], memory_order_relaxed);
  while (here > 1 && !atomic_compare_exchange_weak_explicit(&awake_on[cpu], &here, here - 1, memory_order_relaxed, memory_order_relaxed)) {}
  if (here <= 1) return;
  atomic_fetch_sub_explicit(&awake_total, 1, memory_order_relaxed);  // (the rest of placement_note(q, -1))
  q->on_cpu = -1;
  if (move_to_quiet_cpu(q, cpu)) count_move(cpu, now);
  else placement_note(q, sched_getcpu());
}

// The pause of a queue thread lent to a network engine (see hcq_set_idle_hook) when nothing arrived. While it is
// the one awake queue thread, a short one without yielding: it and the thread it serves (a client on this host,
// spinning too) then keep a CPU each; a thread that yields at every turn can settle on one CPU with that client, and
// each runs only when the other yields. With other queue threads awake (one waiting on a signal, say) it pauses as
// any spinner does, yielding, so that they get a CPU (on 2 vCPUs there may be none free).
static inline int lent_pause(int64_t spun_ns) {
  if (atomic_load_explicit(&awake_total, memory_order_relaxed) > 1) return spin_pause(spun_ns);
  for (int k = 0; k < 16; k++) cpu_relax();
  return 0;
}

// The idle hook: a process that serves its devices to others (hcq's remote server) lends its idle queue threads to
// its network engine. A queue thread whose ring is empty calls hook(ctx, 1, when its idle spell began) in its spin:
// the hook may progress the engine there, and so hand a SUBMIT that arrives straight to a thread that is awake
// instead of waking one; it returns 1 when something arrived (spin on at once), 0 when nothing did (lent_pause), -1
// when it did not progress the engine (another thread does: the usual pause). When the thread stops spinning:
// hook(ctx, 2, ...) when work came, hook(ctx, 0, ...) when it goes to sleep or stops.
// Clearing the hook waits until no thread is inside an idle spin that loaded it (idle_users, seq_cst both ways: a
// thread counts itself before it loads the hook, the clearer stores NULL before it reads the count; a thread that
// found no hook at a first, relaxed look does not count itself, and does not use one in that spell).
typedef int (*hcq_idle_hook_t)(void *ctx, int idle, int64_t idle_since);
static _Atomic(hcq_idle_hook_t) idle_hook;
static _Atomic(void *) idle_hook_ctx;
static _Atomic int idle_users;

EXPORT void hcq_set_idle_hook(hcq_idle_hook_t fn, void *ctx) {
  atomic_store_explicit(&idle_hook, NULL, memory_order_seq_cst);
  while (atomic_load_explicit(&idle_users, memory_order_seq_cst)) sched_yield();  // an idle spin ends within its budget
  atomic_store_explicit(&idle_hook_ctx, ctx, memory_order_relaxed);
  atomic_store_explicit(&idle_hook, fn, memory_order_release);  // the context is visible to whoever acquires the hook
}

#define ERR_LEN 512
struct hcq_dev {
  pool_t pool;
  _Atomic int failed;
  uint32_t id;
  char error[ERR_LEN];
  pthread_mutex_t error_lock;
  // signal, address, entry (0 for packets), block, opcode, peer (id + 1 of the failed device whose poisoned
  // signal this one waited on, 0: none); all 0 when the failure was not a fault.
  uint64_t fault[FAULT_WORDS];
};

static hcq_dev_t *devices[MAX_DEVICES];  // by id, for naming the failed peer behind a poisoned signal
static pthread_mutex_t devices_lock = PTHREAD_MUTEX_INITIALIZER;

// fork(): the locks a command-processor thread may hold are taken around it, so the child gets them free; the
// child has none of the parent's threads, so it forgets the parent's devices and sleepers.
static void fork_prepare(void) { pthread_mutex_lock(&devices_lock); pthread_mutex_lock(&handlers_lock); }
static void fork_parent(void) { pthread_mutex_unlock(&handlers_lock); pthread_mutex_unlock(&devices_lock); }
static void fork_child(void) {
  pthread_mutex_init(&handlers_lock, NULL);
  pthread_mutex_init(&devices_lock, NULL);
  memset(devices, 0, sizeof devices);
  for (int i = 0; i < SLEEPER_BUCKETS; i++) {
    atomic_store(&signal_sleepers[i].count, 0);
    atomic_store(&signal_sleepers[i].min_target, UINT64_MAX);
  }
  for (int c = 0; c < CPU_SETSIZE; c++) atomic_store(&awake_on[c], 0);  // the parent's queue threads are not here
  atomic_store(&awake_total, 0);
  atomic_store(&idle_users, 0);  // (nor their idle spins)
}
static pthread_once_t atfork_once = PTHREAD_ONCE_INIT;
static void register_atfork(void) { pthread_atfork(fork_prepare, fork_parent, fork_child); }

// The store hook: a process that serves its devices to others (hcq's remote server) mirrors what packets store into
// memory its clients read (signals, staging buffers) into the clients' memory. After a SIGNAL, TIMESTAMP, WRITE or
// COPY has stored (and released) its bytes, the queue thread calls the hook with the range; the hook runs on that
// thread, so whatever a later packet of the ring stores is handed to it after. FLAG_SIGNAL marks a 16-byte signal,
// whose value the hook reads itself (under its lock: another queue thread's newer store may be there already, and its
// own hook runs after it stored everything before it, so the newest value is never ahead of the bytes stored before
// it, while a store's own value, handed over after another thread's newer one, would take a follower back); `value`
// is 0 (no HOOK_VALUE).
// A device's failure word goes through it too when the device fails or recovers, and so do host stores into a
// signal (hcq_signal_store; a client uses the hook for the signals of its local devices that remote devices wait on).
typedef void (*hcq_store_hook_t)(void *ctx, uint64_t addr, uint64_t nbytes, uint32_t flags, uint64_t value);
static _Atomic(hcq_store_hook_t) store_hook;
static _Atomic(void *) store_hook_ctx;

EXPORT void hcq_set_store_hook(hcq_store_hook_t fn, void *ctx) {
  atomic_store_explicit(&store_hook_ctx, ctx, memory_order_relaxed);
  atomic_store_explicit(&store_hook, fn, memory_order_release);  // the context is visible to whoever acquires the hook
}

static inline void stored(const void *addr, uint64_t nbytes, uint32_t flags) {
  hcq_store_hook_t hook = atomic_load_explicit(&store_hook, memory_order_acquire);
  if (hook) hook(atomic_load_explicit(&store_hook_ctx, memory_order_relaxed), (uint64_t)(uintptr_t)addr, nbytes, flags, 0);
}

static void set_failure(hcq_dev_t *d, const uint64_t *fault, const char *fmt, ...) {
  pthread_mutex_lock(&d->error_lock);
  if (!atomic_load(&d->failed)) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(d->error, ERR_LEN, fmt, ap);
    va_end(ap);
    if (fault) memcpy(d->fault, fault, sizeof d->fault);
  }
  atomic_store(&d->failed, 1);
  pthread_mutex_unlock(&d->error_lock);
  stored(&d->failed, sizeof d->failed, 0);
}

static void record_fault(hcq_dev_t *d, const fault_ctx_t *c, int op) {
  uint64_t f[FAULT_WORDS] = {[FAULT_SIGNAL] = (uint64_t)c->sig, [FAULT_ADDR] = (uint64_t)c->addr, [FAULT_ENTRY] = (uint64_t)c->fn,
                            [FAULT_BLOCK] = c->slots.block, [FAULT_OP] = (uint64_t)op};
  set_failure(d, f, "%s at address 0x%llx", strsignal(c->sig), (unsigned long long)c->addr);
}

#define dev_fail(d, ...) set_failure((d), NULL, __VA_ARGS__)

// A WAIT of device d was satisfied by a signal that device `peer` stored after it failed: d fails too,
// carrying the peer's error.
static void fail_from_peer(hcq_dev_t *d, uint32_t peer, const void *signal, uint64_t value) {
  char peer_error[ERR_LEN] = "";
  pthread_mutex_lock(&devices_lock);
  hcq_dev_t *p = peer < MAX_DEVICES ? devices[peer] : NULL;
  if (p) {
    pthread_mutex_lock(&p->error_lock);
    snprintf(peer_error, ERR_LEN, "%s", p->error[0] ? p->error : "(its failure was cleared since)");
    pthread_mutex_unlock(&p->error_lock);
  }
  pthread_mutex_unlock(&devices_lock);
  uint64_t f[FAULT_WORDS] = {[FAULT_ADDR] = (uint64_t)(uintptr_t)signal, [FAULT_BLOCK] = value, [FAULT_OP] = OP_WAIT,
                            [FAULT_PEER] = (uint64_t)peer + 1};
  set_failure(d, f, "%s", peer_error);
}

// Words each packet needs (header included): packet_words[] by opcode; a guarded COPY has one more (the guard word).
static inline uint64_t pkt_len(uint64_t hdr) { return hdr_words(hdr); }
static inline uint32_t pkt_op(uint64_t hdr) { return (uint32_t)hdr_op(hdr); }
static inline uint32_t pkt_flags(uint64_t hdr) { return (uint32_t)hdr_flags(hdr); }

static int exec_packet(hcq_queue_t *q, const uint64_t *p, int nested);

// Every page of the indirect buffer [w, w + n words) is read once under a guard (w may be a bad address in raw
// words), so its packets can then be read in place without one (a guard per packet cost more than a kernel).
// The memory stays mapped while the run lasts: released memory waits for the work submitted before it.
static int probe_indirect(hcq_queue_t *q, const uint64_t *w, uint64_t n) {
  if (((uintptr_t)w & 7) || n > (1ULL << 40)) {
    dev_fail(q->dev, "indirect buffer at 0x%llx of %llu words is misaligned or too large", (unsigned long long)(uintptr_t)w, (unsigned long long)n);
    return 0;
  }
  fault_ctx_t *c = tls_fault;
  if (sigsetjmp(c->env, 0)) { record_fault(q->dev, c, OP_INDIRECT); return 0; }
  c->armed = 1;
  uint64_t sink = 0;
  for (uint64_t i = 0; i < n; i += 512) sink += *(const volatile uint64_t *)(w + i);  // one word per 4 KiB
  if (n) sink += *(const volatile uint64_t *)(w + n - 1);
  c->armed = 0;
  (void)sink;
  return 1;
}

// A bound queue's words, run in place (no nesting).
static int run_indirect(hcq_queue_t *q, const uint64_t *w, uint64_t n) {
  if (!probe_indirect(q, w, n)) return 0;
  int rc = 0;
  for (uint64_t i = 0, len; i < n && rc == 0; i += len) {
    len = pkt_len(w[i]);
    if (len == 0 || len > MAX_PACKET_WORDS || len > n - i) {
      dev_fail(q->dev, "malformed packet header 0x%llx at word %llu of an indirect buffer", (unsigned long long)w[i], (unsigned long long)i);
      break;
    }
    atomic_store_explicit(&q->cur_sub, i, memory_order_relaxed);
    rc = exec_packet(q, w + i, 1);
  }
  atomic_store_explicit(&q->cur_sub, UINT64_MAX, memory_order_relaxed);
  return rc;
}

// Grid and block must be non-empty, the grid at most 2^63 blocks, the block at most 2^20 threads: anything
// else would run nothing (or overflow) while the queue reported success.
static int launch_ok(const hcq_launch_t *L, uint64_t *nblocks) {
  uint64_t g = 1, t = 1;
  for (int d = 0; d < 3; d++) {
    if (!L->ngrp[d] || !L->lsz[d]) return 0;
    if (__builtin_mul_overflow(g, L->ngrp[d], &g) || __builtin_mul_overflow(t, L->lsz[d], &t)) return 0;
  }
  *nblocks = g;
  return g <= (uint64_t)INT64_MAX && t <= MAX_BLOCK_THREADS;
}

static int exec_kernel(hcq_queue_t *q, const uint64_t *p) {
  hcq_launch_t L = {{p[3], p[4], p[5]}, {p[6], p[7], p[8]}};
  uint64_t nblocks;
  if (q->kind != QUEUE_COMPUTE) {  // (the device's one worker pool takes grids from its one compute queue thread only)
    dev_fail(q->dev, "EXEC on copy queue %d: kernels run on the compute queue", q->index);
    return 0;
  }
  if (!launch_ok(&L, &nblocks)) {
    dev_fail(q->dev, "EXEC of a grid of (%llu, %llu, %llu) blocks of (%llu, %llu, %llu) threads: every dimension must be >= 1, the grid "
             "at most 2^63 blocks and a block at most 2^20 threads", (unsigned long long)p[3], (unsigned long long)p[4],
             (unsigned long long)p[5], (unsigned long long)p[6], (unsigned long long)p[7], (unsigned long long)p[8]);
    return 0;
  }
  check_fault_handlers();
  pool_exec(&q->dev->pool, (hcq_entry_t)p[1], (const void *)p[2], &L, nblocks);
  atomic_thread_fence(memory_order_release);  // kernel stores precede the following signal's store
  return 0;
}

// Claim (1) or find cancelled (0) the guard word of a cancellable copy; -1 when it is unreadable.
static int guard_claim(hcq_queue_t *q, void *guard) {
  fault_ctx_t *c = tls_fault;
  if (sigsetjmp(c->env, 0)) { record_fault(q->dev, c, OP_COPY); return -1; }
  c->armed = 1;
  uint64_t expected = GUARD_PENDING;
  int claimed = atomic_compare_exchange_strong((_Atomic uint64_t *)guard, &expected, GUARD_RUNNING);
  c->armed = 0;
  return claimed;
}

static void guard_done(hcq_queue_t *q, void *guard) {
  fault_ctx_t *c = tls_fault;
  if (sigsetjmp(c->env, 0)) { record_fault(q->dev, c, OP_COPY); return; }
  c->armed = 1;
  store_and_wake64(guard, GUARD_DONE);  // release: the copy's stores precede it
  c->armed = 0;
}

// COPY dest src bytes [guard]: a guarded copy runs only if it claims its guard word before the host cancels
// it, and stores GUARD_DONE when both halves are done (faulted or not), after which it touches neither range.
static int exec_copy(hcq_queue_t *q, const uint64_t *p, uint32_t flags) {
  void *guard = (flags & FLAG_GUARD) ? (void *)p[4] : NULL;
  if (guard && guard_claim(q, guard) != 1) return 0;
  check_fault_handlers();
  engine_copy(q->helper, q->dev, (void *)p[1], (const void *)p[2], (size_t)p[3]);
  if (guard) guard_done(q, guard);
  stored((void *)p[1], p[3], 0);
  return 0;
}

// WAIT, SIGNAL, TIMESTAMP, WRITE, POLL: packets that only touch memory, run under a fault guard.
static int exec_mem_packet(hcq_queue_t *q, const uint64_t *p, uint32_t op, uint32_t flags) {
  fault_ctx_t *c = tls_fault;
  if (sigsetjmp(c->env, 0)) {  // the packet touched memory it may not (a bad signal, write or poll address)
    record_fault(q->dev, c, (int)op);
    return 0;
  }
  c->armed = 1;
  int rc = 0;
  void *addr = (void *)p[1];
  switch (op) {
  case OP_WAIT: {
    int w = wait_until(cond_ge64, addr, p[2], 0, spin_ns_queue, FOREVER, &q->stop, &q->dev->failed, &q->budget, 0);
    if (w == 2) rc = atomic_load_explicit(&q->stop, memory_order_relaxed) ? -1 : 0;
    else if (flags & FLAG_SIGNAL) {
      int64_t peer = poisoned_by(addr);  // after the value's acquire
      if (peer >= 0) { c->armed = 0; fail_from_peer(q->dev, (uint32_t)peer, addr, p[2]); return 0; }
    }
    break;
  }
  case OP_SIGNAL:
    if (flags & FLAG_SIGNAL) clear_poison(addr);
    store_and_wake64(addr, p[2]);
    c->armed = 0;  // (the hook runs outside the fault guard: the store above proved the address good)
    stored(addr, (flags & FLAG_SIGNAL) ? HCQ_SIGNAL_SIZE : 8, flags & FLAG_SIGNAL);
    break;
  case OP_TIMESTAMP:
    store_and_wake64(addr, (uint64_t)now_ns());
    c->armed = 0;
    stored(addr, 8, 0);
    break;
  case OP_WRITE:
    if (flags & FLAG_B64) store_and_wake64(addr, p[2]); else store_and_wake32(addr, (uint32_t)p[2]);
    c->armed = 0;
    stored(addr, (flags & FLAG_B64) ? 8 : 4, 0);
    break;
  case OP_POLL: {
    uint64_t cond = hdr_cond(p[0]);
    if (cond >= POLL_COUNT) { c->armed = 0; dev_fail(q->dev, "POLL with unknown condition %llu", (unsigned long long)cond); return 0; }
    int w = wait_until(poll_conds[(flags & FLAG_B64) ? 1 : 0][cond], addr, p[2], p[3], spin_ns_queue, FOREVER, &q->stop, &q->dev->failed,
                       &q->budget, 0);
    if (w == 2 && atomic_load_explicit(&q->stop, memory_order_relaxed)) rc = -1;
    break;
  }
  }
  c->armed = 0;
  return rc;
}

// What a failed device still does with a packet: SIGNALs of signals are stored, poisoned, so waiters are
// released and learn of the failure; bound queues are walked for theirs; everything else is dropped.
static int drain_packet(hcq_queue_t *q, const uint64_t *p, uint32_t op, uint32_t flags, int nested) {
  if (op == OP_INDIRECT && !nested) return run_indirect(q, (const uint64_t *)p[1], p[2]);
  if (op != OP_SIGNAL || !(flags & FLAG_SIGNAL)) return 0;
  fault_ctx_t *c = tls_fault;
  if (sigsetjmp(c->env, 0)) return 0;  // a bad signal address: nothing more to record on a failed device
  c->armed = 1;
  // The failure word first, from this thread: set_failure publishes it (the store hook) after its flag, which this
  // thread may have read before that; a mirror of the device's memory (hcq serve) must never show the poisoned value
  // before the failure it stands for (the client would take the device for recovered).
  stored(&q->dev->failed, sizeof q->dev->failed, 0);
  atomic_store_explicit(&poison_used, 1, memory_order_relaxed);  // before the release below
  atomic_store_explicit(timestamp_word((void *)p[1]), POISON_TAG | q->dev->id, memory_order_relaxed);
  store_and_wake64((void *)p[1], p[2]);  // release: the tag is visible to whoever acquires the value
  c->armed = 0;
  stored((void *)p[1], HCQ_SIGNAL_SIZE, FLAG_SIGNAL);
  return 0;
}

// Execute one packet (already copied out of the ring or indirect buffer). Returns 0, or -1 when the queue
// is told to stop during a wait.
static int exec_packet(hcq_queue_t *q, const uint64_t *p, int nested) {
  uint32_t op = pkt_op(p[0]), flags = pkt_flags(p[0]);
  for (int i = 0; i < CUR_PKT_WORDS; i++) atomic_store_explicit(&q->cur_pkt[i], i < (int)pkt_len(p[0]) ? p[i] : 0, memory_order_relaxed);
  if (op >= OP_COUNT || !packet_words[op]) {
    dev_fail(q->dev, "unknown packet opcode %llu (header 0x%llx)", (unsigned long long)op, (unsigned long long)p[0]);
    return 0;
  }
  uint64_t need = packet_words[op] + (op == OP_COPY && (flags & FLAG_GUARD) ? 1 : 0);
  if (pkt_len(p[0]) < need) {
    dev_fail(q->dev, "malformed packet: opcode %llu needs %llu words, its header says %llu", (unsigned long long)op,
             (unsigned long long)need, (unsigned long long)pkt_len(p[0]));
    return 0;
  }
  if (atomic_load_explicit(&q->dev->failed, memory_order_relaxed)) return drain_packet(q, p, op, flags, nested);
  switch (op) {
  case OP_EXEC: return exec_kernel(q, p);
  case OP_COPY: return exec_copy(q, p, flags);
  case OP_BARRIER: atomic_thread_fence(memory_order_seq_cst); return 0;
  case OP_INDIRECT:
    if (nested) { dev_fail(q->dev, "indirect packet inside an indirect buffer at 0x%llx (%llu words)", (unsigned long long)p[1], (unsigned long long)p[2]); return 0; }
    return run_indirect(q, (const uint64_t *)p[1], p[2]);
  default: return exec_mem_packet(q, p, op, flags);
  }
}

static void *queue_main(void *arg) {
  hcq_queue_t *q = arg;
  fault_ctx_t ctx;
  char role[12];
  if (q->kind == QUEUE_COMPUTE) snprintf(role, sizeof role, "compute");
  else snprintf(role, sizeof role, "copy%d", q->index);
  thread_init(&ctx, role, q->dev->id);
  uint64_t pkt[MAX_PACKET_WORDS];
  uint64_t rp = atomic_load_explicit(&q->rptr, memory_order_relaxed);
  placement_init(q);
  while (!atomic_load_explicit(&q->stop, memory_order_relaxed)) {
    uint64_t wp = atomic_load_explicit(&q->wptr, memory_order_acquire);  // packets written before wptr are visible
    if (wp == rp) {  // empty: spin, then sleep on the doorbell until the host rings it
      keep_off_submitter(q);
      int64_t start = now_ns(), spin = spin_limit(spin_of(&q->budget, spin_ns_queue));
      hcq_idle_hook_t idle = NULL;  // (counted in idle_users only where a hook is set: local-only processes skip it)
      void *idle_ctx = NULL;
      if (atomic_load_explicit(&idle_hook, memory_order_relaxed)) {
        atomic_fetch_add_explicit(&idle_users, 1, memory_order_seq_cst);
        idle = atomic_load_explicit(&idle_hook, memory_order_seq_cst);
        idle_ctx = atomic_load_explicit(&idle_hook_ctx, memory_order_relaxed);
        if (!idle) atomic_fetch_sub_explicit(&idle_users, 1, memory_order_release);
      }
      for (int64_t spun = 0; atomic_load_explicit(&q->wptr, memory_order_acquire) == wp && spun < spin &&
                             !atomic_load_explicit(&q->stop, memory_order_relaxed); spun = now_ns() - start) {
        int lent = idle ? idle(idle_ctx, 1, start) : -1;
        if (lent < 0 ? spin_pause(spun) : lent == 0 && lent_pause(spun)) break;
      }
      if (idle) {
        idle(idle_ctx, atomic_load_explicit(&q->wptr, memory_order_acquire) != wp ? 2 : 0, start);  // 2: to work
        atomic_fetch_sub_explicit(&idle_users, 1, memory_order_release);
      }
      if (atomic_load_explicit(&q->wptr, memory_order_acquire) != wp) continue;
      uint32_t db = atomic_load_explicit(&q->doorbell, memory_order_acquire);
      atomic_store_explicit(&q->last_spin_ns, spin, memory_order_relaxed);  // (published by the seq_cst store below)
      atomic_store_explicit(&q->sleeping, 1, memory_order_seq_cst);
      atomic_thread_fence(memory_order_seq_cst);  // pairs with the host's fence between publish and reading `sleeping`
      if (atomic_load_explicit(&q->wptr, memory_order_seq_cst) == wp && !atomic_load_explicit(&q->stop, memory_order_relaxed)) {
        placement_note(q, -1);
        futex_wait(&q->doorbell, db, FOREVER);
        placement_note(q, sched_getcpu());
        install_fault_handlers();  // re-armed if replaced while this queue slept
        // Idle until the work came, not until this thread ran: on a busy machine a woken thread can wait
        // milliseconds for a CPU, and counting that would make it sleep sooner next time, and so wait again
        // (seen on 2 vCPUs: a server's queue thread settled into 0.5-1 ms round trips for a whole run).
        int64_t woke = now_ns(), rung = atomic_load_explicit(&q->rung_at, memory_order_relaxed);
        int64_t idle = (rung > start && rung < woke ? rung : woke) - start;
        spin_adapt(&q->budget, spin_ns_queue, idle);
        atomic_store_explicit(&q->last_idle_ns, idle, memory_order_relaxed);
        atomic_fetch_add_explicit(&q->wakes, 1, memory_order_release);  // the idle and the budget it set come with it
        if (rung > start && woke - rung > CONTENDED_NS) contended(woke);  // rung, then waited that long for a CPU
      }
      atomic_store_explicit(&q->sleeping, 0, memory_order_relaxed);
      continue;
    }
    uint64_t hdr = q->ring[rp & q->mask], len = pkt_len(hdr);
    if (len == 0 || len > MAX_PACKET_WORDS || len > wp - rp) {
      // Submissions are published whole, so this is garbage: drop everything published so far (reading on
      // word by word could take data for packets).
      dev_fail(q->dev, "malformed packet header 0x%llx at ring word %llu", (unsigned long long)hdr, (unsigned long long)rp);
      rp = wp;
    } else {
      for (uint64_t i = 0; i < len; i++) pkt[i] = q->ring[(rp + i) & q->mask];
      atomic_store_explicit(&q->cur_pos, rp, memory_order_relaxed);
      if (exec_packet(q, pkt, 0) < 0 && atomic_load_explicit(&q->stop, memory_order_relaxed)) break;
      atomic_store_explicit(&q->cur_pos, UINT64_MAX, memory_order_relaxed);
      rp += len;
    }
    atomic_store_explicit(&q->rptr, rp, memory_order_release);  // the host may now reuse these ring words
    atomic_fetch_add_explicit(&q->packets_done, 1, memory_order_relaxed);
  }
  placement_note(q, -1);
  return NULL;
}

// ---------------------------------------------------------------- exported API
// A device (its worker pool starts with the first grid worth splitting). NULL with *err set on failure.
EXPORT hcq_dev_t *hcq_dev_create(int nworkers, int *err) {
  hcq_dev_t *d = calloc(1, sizeof(hcq_dev_t));
  int nthreads = nworkers > 1 ? nworkers - 1 : 0;  // the queue thread is the first worker
  pthread_t *threads = calloc((size_t)nthreads + 1, sizeof(pthread_t));
  if (!d || !threads) { free(d); free(threads); *err = ENOMEM; return NULL; }
  pthread_once(&atfork_once, register_atfork);
  pthread_mutex_lock(&devices_lock);
  uint32_t id = 0;
  while (id < MAX_DEVICES && devices[id]) id++;
  if (id == MAX_DEVICES) { pthread_mutex_unlock(&devices_lock); free(d); free(threads); *err = EMFILE; return NULL; }
  devices[id] = d;
  pthread_mutex_unlock(&devices_lock);
  d->id = id;
  pthread_mutex_init(&d->error_lock, NULL);
  install_fault_handlers();
  d->pool.dev = d;
  d->pool.dev_id = id;
  d->pool.failed = &d->failed;
  d->pool.nthreads = nthreads;
  d->pool.threads = threads;
  *err = 0;
  return d;
}

EXPORT uint32_t hcq_dev_id(hcq_dev_t *d) { return d->id; }

// Workers wanted, started, the errno of one that could not start (0: none), and how many grids of several blocks the
// pool was woken for and ran inline (counts that wrap).
EXPORT void hcq_dev_pool_info(hcq_dev_t *d, int *out) {
  // (relaxed loads: the queue thread may be starting the pool meanwhile, and these are counts for a look)
  out[POOL_WANTED] = atomic_load_explicit(&d->pool.nthreads, memory_order_relaxed);
  out[POOL_STARTED] = atomic_load_explicit(&d->pool.started, memory_order_relaxed);
  out[POOL_START_ERROR] = atomic_load_explicit(&d->pool.start_error, memory_order_relaxed);
  out[POOL_WOKEN] = (int)atomic_load_explicit(&d->pool.woken, memory_order_relaxed);
  out[POOL_INLINE] = (int)atomic_load_explicit(&d->pool.inlined, memory_order_relaxed);
}

EXPORT int hcq_dev_error(hcq_dev_t *d, char *out, int len) {
  if (!atomic_load(&d->failed)) return 0;
  pthread_mutex_lock(&d->error_lock);
  snprintf(out, (size_t)len, "%s", d->error);
  pthread_mutex_unlock(&d->error_lock);
  return 1;
}

// Address of the sticky failure flag, so the host can poll it with a plain load.
EXPORT const _Atomic int *hcq_dev_failed_flag(hcq_dev_t *d) { return &d->failed; }

static int queue_start(hcq_queue_t *q) {
  if (q->started) return 0;
  if (!q->start_error) q->start_error = pthread_create(&q->thread, NULL, queue_main, q);
  q->started = !q->start_error;
  return q->start_error;
}

// A ring of ring_words (a power of two) words in a private mapping with a guard page on each side. The
// compute queue starts its thread now (eager), copy queues with their first submission. 0, or an errno.
EXPORT int hcq_queue_create(hcq_dev_t *d, int kind, int index, uint64_t ring_words, int eager, hcq_queue_t **out) {
  hcq_queue_t *q = NULL;
  *out = NULL;
  if (!ring_words || (ring_words & (ring_words - 1))) return EINVAL;
  if (posix_memalign((void **)&q, 64, sizeof(hcq_queue_t))) return ENOMEM;
  memset(q, 0, sizeof(*q));
  size_t page = (size_t)sysconf(_SC_PAGESIZE);
  q->map_len = ring_words * 8 + 2 * page;
  q->map = mmap(NULL, q->map_len, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (q->map == MAP_FAILED) { free(q); return ENOMEM; }
  if (mprotect((char *)q->map + page, ring_words * 8, PROT_READ | PROT_WRITE)) { int e = errno; munmap(q->map, q->map_len); free(q); return e; }
  q->ring = (uint64_t *)((char *)q->map + page);
  q->mask = ring_words - 1; q->kind = kind; q->index = index; q->dev = d;
  pthread_mutex_init(&q->submit_lock, NULL);
  atomic_store(&q->cur_pos, UINT64_MAX);
  atomic_store(&q->cur_sub, UINT64_MAX);
  atomic_store(&q->submitter_cpu, -1);
  if (kind == QUEUE_COPY) {
    q->helper = calloc(1, sizeof(copy_helper_t));
    if (!q->helper) { munmap(q->map, q->map_len); free(q); return ENOMEM; }
    q->helper->dev = d;
    q->helper->dev_id = d->id;
  }
  if (eager && queue_start(q)) {
    int e = q->start_error;
    munmap(q->map, q->map_len); free(q->helper); free(q);
    return e;
  }
  *out = q;
  return 0;
}

EXPORT int hcq_queue_start_error(hcq_queue_t *q) { return q->start_error; }

static void ring_doorbell(hcq_queue_t *q, uint64_t wp) {
  hcq_ring_publish(&q->wptr, wp);  // packets first, then the write pointer (release)
  atomic_fetch_add_explicit(&q->doorbell, 1, memory_order_release);
  atomic_thread_fence(memory_order_seq_cst);  // publish before reading `sleeping` (see queue_main; ring.h's hcq_ring_publish)
  if (atomic_load_explicit(&q->sleeping, memory_order_relaxed)) {
    atomic_store_explicit(&q->rung_at, now_ns(), memory_order_relaxed);
    futex_wake(&q->doorbell);
  }
}

// Publish n words as one submission: whole or not at all. Waits (up to timeout_ns) for room for all of
// them. Returns SUBMIT_OK; SUBMIT_FULL (nothing published: the queue is stalled), SUBMIT_STOPPED,
// SUBMIT_TOO_BIG (n exceeds the ring: it can never fit), or SUBMIT_NO_THREAD (see hcq_queue_start_error).
EXPORT int hcq_queue_submit(hcq_queue_t *q, const uint64_t *w, uint64_t n, int64_t timeout_ns) {
  uint64_t cap = q->mask + 1;
  if (hcq_ring_too_big(cap, n)) return SUBMIT_TOO_BIG;
  pthread_mutex_lock(&q->submit_lock);
  int rc = SUBMIT_OK;
  if (atomic_load_explicit(&q->stop, memory_order_relaxed)) rc = SUBMIT_STOPPED;
  else if (queue_start(q)) rc = SUBMIT_NO_THREAD;
  uint64_t wp = hcq_ring_own_wptr(&q->wptr);
  if (rc == SUBMIT_OK && !hcq_ring_fits(cap, wp, hcq_ring_rptr(&q->rptr), n))  // (cond_ge64 loads rptr with acquire too)
    rc = wait_until(cond_ge64, &q->rptr, hcq_ring_rptr_needed(cap, wp, n), 0, spin_ns_host, timeout_ns, &q->stop, NULL, NULL, 1);
  if (rc == SUBMIT_OK) {
    hcq_ring_copy_in(q->ring, q->mask, wp, w, n);
    int cpu = tls_queue ? -1 : sched_getcpu();  // (a vDSO call; stored only when it changed: the line is the host's anyway, next to wptr)
    // (-1: a queue thread submitted, lent to a network engine: it does not then wait on this CPU as a host would)
    if (cpu != atomic_load_explicit(&q->submitter_cpu, memory_order_relaxed)) atomic_store_explicit(&q->submitter_cpu, cpu, memory_order_relaxed);
    ring_doorbell(q, wp + n);
  }
  pthread_mutex_unlock(&q->submit_lock);
  return rc;
}

// Fault details (signal, address, entry, block, opcode, peer + 1); returns 0 when the failure was not a fault
// or a poisoned wait.
EXPORT int hcq_dev_fault(hcq_dev_t *d, uint64_t *out) {
  pthread_mutex_lock(&d->error_lock);
  memcpy(out, d->fault, sizeof d->fault);
  pthread_mutex_unlock(&d->error_lock);
  return out[FAULT_SIGNAL] != 0 || out[FAULT_PEER] != 0;
}

// Clear the sticky failure once the host has seen every ring drain (failed devices skip their packets).
EXPORT void hcq_dev_recover(hcq_dev_t *d) {
  pthread_mutex_lock(&d->error_lock);
  memset(d->fault, 0, sizeof d->fault);
  d->error[0] = 0;
  atomic_store(&d->failed, 0);
  pthread_mutex_unlock(&d->error_lock);
  stored(&d->failed, sizeof d->failed, 0);
}

// For hang reports: rptr, wptr, packets done, ring position of the current packet (UINT64_MAX: idle),
// index inside an indirect buffer (UINT64_MAX: none), then the current packet's first 4 words.
EXPORT void hcq_queue_state(hcq_queue_t *q, uint64_t *out) {
  out[QSTATE_RPTR] = atomic_load(&q->rptr); out[QSTATE_WPTR] = atomic_load(&q->wptr); out[QSTATE_PACKETS_DONE] = atomic_load(&q->packets_done);
  out[QSTATE_POSITION] = atomic_load(&q->cur_pos); out[QSTATE_INDIRECT_INDEX] = atomic_load(&q->cur_sub);
  for (int i = 0; i < CUR_PKT_WORDS; i++) out[QSTATE_PKT0 + i] = atomic_load(&q->cur_pkt[i]);
}

// Addresses of the ring's write and read pointers, so the host can read them without a call (relaxed loads:
// used only to see whether a submission would have room).
EXPORT void hcq_queue_pointers(hcq_queue_t *q, uint64_t *out) { out[0] = (uint64_t)(uintptr_t)&q->wptr; out[1] = (uint64_t)(uintptr_t)&q->rptr; }

// The queue thread's idle spells, for tests and tools: out[SPIN_BUDGET] how long it spins when it next idles (ns; its
// adaptive budget), out[SPIN_WAKES] doorbell sleeps that ended, out[SPIN_IDLE] the idle time (ns) it learned from at the
// last of them, out[SPIN_LAST_SPIN] the spin (ns) it allowed itself in the last spell that spun out and went to sleep
// (0: spinning was held off, see spin_limit), out[SPIN_ASLEEP] whether it is asleep on its doorbell now (or about to be). The wake
// count is read with acquire (the idle and budget written before its release increment come with it), and `sleeping`
// with seq_cst (last_spin_ns, stored before it, comes with it); the rest relaxed.
EXPORT void hcq_queue_spin_state(hcq_queue_t *q, int64_t *out) {
  out[SPIN_ASLEEP] = atomic_load_explicit(&q->sleeping, memory_order_seq_cst);
  out[SPIN_WAKES] = (int64_t)atomic_load_explicit(&q->wakes, memory_order_acquire);
  out[SPIN_BUDGET] = spin_of(&q->budget, spin_ns_queue);
  out[SPIN_IDLE] = atomic_load_explicit(&q->last_idle_ns, memory_order_relaxed);
  out[SPIN_LAST_SPIN] = atomic_load_explicit(&q->last_spin_ns, memory_order_relaxed);
}

EXPORT uint64_t hcq_queue_rptr(hcq_queue_t *q) { return atomic_load_explicit(&q->rptr, memory_order_acquire); }
EXPORT uint64_t hcq_queue_wptr(hcq_queue_t *q) { return atomic_load_explicit(&q->wptr, memory_order_acquire); }
EXPORT int hcq_queue_started(hcq_queue_t *q) { return q->started; }

static int timed_join(pthread_t t, int64_t timeout_ns);

// Stop the queue thread (it finishes the packet it is on; waits are abandoned). Returns 0 when joined (or
// never started).
EXPORT int hcq_queue_stop(hcq_queue_t *q, int64_t timeout_ns) {
  atomic_store(&q->stop, 1);  // first: a submission waiting for ring space gives up and releases the lock
  pthread_mutex_lock(&q->submit_lock);  // no submission starts the thread while it stops
  atomic_fetch_add(&q->doorbell, 1);
  futex_wake(&q->doorbell);
  int started = q->started;
  pthread_mutex_unlock(&q->submit_lock);
  int rc = 0;
  if (started && !q->joined) {
    rc = timed_join(q->thread, timeout_ns);
    q->joined = rc == 0;
  }
  if (q->helper && q->helper->started) {
    atomic_store_explicit(&q->helper->stop, 1, memory_order_release);
    atomic_fetch_add(&q->helper->gen, 1);  // a changed gen: a helper about to sleep sees it and stops
    futex_wake(&q->helper->gen);
  }
  return rc;
}

// Stop the worker pool (after the queues). The device id is released; the memory stays (threads may linger).
EXPORT void hcq_dev_stop(hcq_dev_t *d) {
  atomic_store(&d->pool.stop, 1);
  atomic_fetch_add(&d->pool.gen, 2);  // a changed (still even) gen wakes sleepers; the stale job has no blocks left
  futex_wake(&d->pool.gen);
  pthread_mutex_lock(&devices_lock);
  if (devices[d->id] == d) devices[d->id] = NULL;
  pthread_mutex_unlock(&devices_lock);
}

static int timed_join(pthread_t t, int64_t timeout_ns) {
  struct timespec ts;
  clock_gettime(CLOCK_REALTIME, &ts);
  ts.tv_sec += timeout_ns / 1000000000LL; ts.tv_nsec += timeout_ns % 1000000000LL;
  if (ts.tv_nsec >= 1000000000L) { ts.tv_sec++; ts.tv_nsec -= 1000000000L; }
  return pthread_timedjoin_np(t, NULL, &ts);
}

// Join a stopped queue's copy helper (hcq_queue_stop, after the queue thread was joined): 0 when joined (or none ran).
static int join_helper(hcq_queue_t *q, int64_t timeout_ns) {
  if (!atomic_load(&q->stop) || (q->started && !q->joined)) return EBUSY;
  if (q->helper && q->helper->started) {
    int rc = timed_join(q->helper->thread, timeout_ns);
    if (rc) return rc;
    q->helper->started = 0;
  }
  return 0;
}

// Free a stopped queue (hcq_queue_stop returned 0): its helper is joined first. 0 when freed; else (a thread still
// runs) the queue is left as it is, an errno returned, and it may be tried again.
EXPORT int hcq_queue_destroy(hcq_queue_t *q, int64_t timeout_ns) {
  int rc = join_helper(q, timeout_ns);
  if (rc) return rc;
  munmap(q->map, q->map_len);
  pthread_mutex_destroy(&q->submit_lock);
  free(q->helper);
  free(q);
  return 0;
}

// Release a stopped queue's ring and helper (dev.close()) but keep the queue itself, stopped, as a tombstone: a host
// thread that read its handle before the close may still call hcq_queue_submit, which answers SUBMIT_STOPPED under
// the submit lock before it touches the ring. 0 when released; else an errno, the queue left as it is.
EXPORT int hcq_queue_retire(hcq_queue_t *q, int64_t timeout_ns) {
  int rc = join_helper(q, timeout_ns);
  if (rc) return rc;
  pthread_mutex_lock(&q->submit_lock);  // (a submission that took the lock before the stop has left it)
  if (q->map) munmap(q->map, q->map_len);
  q->map = NULL, q->ring = NULL;
  free(q->helper);
  q->helper = NULL;
  pthread_mutex_unlock(&q->submit_lock);
  return 0;
}

// Join a stopped device's workers (hcq_dev_stop, after its queues): 0 when joined, else an errno (a worker still runs
// a kernel; it may be tried again).
static int join_workers(hcq_dev_t *d, int64_t timeout_ns) {
  if (!atomic_load(&d->pool.stop)) return EBUSY;
  while (d->pool.joined < d->pool.started) {
    int rc = timed_join(d->pool.threads[d->pool.joined], timeout_ns);
    if (rc) return rc;
    d->pool.joined++;
  }
  return 0;
}

// Free a stopped device (hcq_dev_stop, after its queues) once its workers are joined: 0 when freed, else an errno
// (a worker still runs a kernel; the device stays, and it may be tried again).
EXPORT int hcq_dev_destroy(hcq_dev_t *d, int64_t timeout_ns) {
  int rc = join_workers(d, timeout_ns);
  if (rc) return rc;
  pthread_mutex_destroy(&d->error_lock);
  free(d->pool.threads);
  free(d);
  return 0;
}

// Join a stopped device's workers (dev.close()), keeping the device record as a tombstone: the host may still read
// its failure flag and error. 0 when joined, else an errno.
EXPORT int hcq_dev_retire(hcq_dev_t *d, int64_t timeout_ns) { return join_workers(d, timeout_ns); }

// Fail the device from the host (dev.close() with work that did not finish in time): waits are released and queued
// packets drained with their signals poisoned, blocks not started are skipped, as after a fault.
EXPORT void hcq_dev_abort(hcq_dev_t *d, const char *why) { dev_fail(d, "%s", why); }

EXPORT int hcq_num_cpus(void) {
  cpu_set_t set;
  if (sched_getaffinity(0, sizeof(set), &set) == 0) return CPU_COUNT(&set);
  long n = sysconf(_SC_NPROCESSORS_ONLN);
  return n > 0 ? (int)n : 1;
}

EXPORT uint64_t hcq_now_ns(void) { return (uint64_t)now_ns(); }
