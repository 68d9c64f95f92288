// hcq's Vulkan command processor: a thread per ring consumes hcq packets (hcq/packets.py) and records them into
// Vulkan command buffers, submitted to the device's one VkQueue; each ring signals its own timeline semaphore, one
// value per submitted batch. How each packet maps onto Vulkan, and what it costs where Vulkan has no equivalent, is
// in docs/design.md ("The Vulkan device").
//
// Threads: Python (any thread) produces words into a ring under the ring's producer lock; the ring's thread is its
// only consumer and the only one recording its command buffers. vkQueueSubmit is serialised by `qlock` per queue (Vulkan
// requires external synchronisation of a queue). Ranges, programs and the table of recent SIGNALs are under `lock`.
//
// Memory order: a producer copies words into the ring, then stores wptr with release (hcq/ring.h); the ring thread
// loads wptr with acquire before reading them, and stores rptr with release once it has copied a packet out (the
// producer's acquire load of rptr then lets it overwrite those words). Signals the GPU writes (vkCmdUpdateBuffer after a
// barrier) are read by the host with acquire loads; a failed device's stores go timestamp word first, then the
// value with release, so a reader that sees the value sees the poison tag.
#define _GNU_SOURCE
#include <vulkan/vulkan.h>
#include <errno.h>
#include <stdarg.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include "hcq_shared.h"
// The producer side of a submission ring (hcq_ring_*: room, copy-in, publish), shared with cp.c: hcq/ring.h.
#include "ring.h"

#define EXPORT __attribute__((visibility("default")))
#define NBATCH 8          // command buffers per ring (a ring records one while up to NBATCH-1 run)
#define QPB 64            // timestamp queries per batch
#define SIGS_PER_BATCH 64 // SIGNALs one batch may carry (a full batch is submitted early)
#define MAX_WAITS 16      // semaphore waits one submission may carry
#define SIGTAB 4096       // recent SIGNALs by address (a cache: a miss costs a host wait, never correctness)
#define MAX_PIPES 16      // local sizes per kernel
#define MAX_BINDINGS 32   // storage-buffer bindings per kernel
#define SETS_PER_BATCH 64 // descriptor sets one batch may carry (a full batch is submitted early)
#define WOULD_BLOCK (-2)  // a packet the submitting thread leaves to the ring's thread (see consume)

static uint64_t now_ns(void) {
  struct timespec ts; clock_gettime(CLOCK_MONOTONIC, &ts);
  return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}
static void sleep_ns(uint64_t ns) { struct timespec ts = {(time_t)(ns / 1000000000ull), (long)(ns % 1000000000ull)}; nanosleep(&ts, NULL); }

typedef struct { uint64_t va, size; VkBuffer buf; VkDeviceMemory mem; uint8_t *host; int owned, imported; } range_t;  // imported: host memory
// A kernel. `pushed`: its parameters are storage-buffer bindings and push constants (its own pipeline layout; the
// kernargs block holds the buffers' addresses, the push constant block, then the buffers' sizes: hcq/backends/vk/
// compiler.py); else the kernargs address is its one push constant (the device's layout).
typedef struct { VkShaderModule mod; char name[96]; int fixed; uint32_t local[3]; int npipes;
                 int pushed; VkPipelineLayout layout; VkDescriptorSetLayout dsl; uint32_t nbind, binding[MAX_BINDINGS], push_size, sizes_offset;
                 struct { uint32_t l[3]; VkPipeline p; } pipes[MAX_PIPES]; } prog_t;
struct ring;
typedef struct { uint64_t va, value, point; struct ring *ring; } sigent_t;
typedef struct { uint64_t va, seq; int handed; } reported_t;  // the newest ring SIGNAL of a signal recorded, and whether handed over

typedef struct vkdev {
  VkInstance inst; VkPhysicalDevice phys; VkDevice dev; VkQueue queues[2]; uint32_t family, nqueues;
  int host_is_device;  // a CPU-type device (lavapipe): its memory is host memory, so rings may copy it themselves
  VkPhysicalDeviceProperties props;
  pthread_mutex_t qlock[2], lock;
  range_t *ranges; int nranges, rcap;  // sorted by va
  prog_t **progs; uint32_t nprogs, pcap;  // entry word n names progs[n - 1]
  sigent_t sigtab[SIGTAB];
  reported_t reptab[SIGTAB]; _Atomic uint64_t store_seq;  // see signal_stored (under lock)
  pthread_mutex_t report_lock;  // a signal store's value to forward decided and handed to the hook in one step
  VkPipelineLayout layout;
  uint32_t host_type, device_type;
  int host_import; uint64_t import_align;
  PFN_vkGetMemoryHostPointerPropertiesEXT host_ptr_props;
  _Atomic int failed; char err[1024]; uint32_t id;
  int no_inline;  // HCQ_VK_INLINE=0: every submission goes through the ring's thread
  _Atomic int64_t inject_lost;  // tests: the n-th next submission reports VK_ERROR_DEVICE_LOST (0: off)
  struct ring *rings[64]; int nrings;
  int closed;  // hcq_vk_close ran: the device is destroyed with its last range (under lock)
} vkdev_t;

// A store a batch makes that the store hook is told of once the batch has finished (see hcq_vk_set_store_hook).
typedef struct { uint64_t va, n, value, seq; uint64_t *host; uint32_t flags; } store_t;  // (a signal's: see signal_stored)
typedef struct { VkCommandBuffer cb; uint64_t point, words_end, packets_end; int nq, nsig, queries_reset, nsets; VkDescriptorPool dpool;
                 struct { uint64_t *host, va, value; } sigs[SIGS_PER_BATCH]; uint64_t first[CUR_PKT_WORDS]; uint64_t first_pos;
                 store_t *stores; int nstores, stores_cap;
                 struct ring *wring[MAX_WAITS]; uint64_t wpoint[MAX_WAITS]; int nwr; } batch_t;  // (the points of other rings it waited for)

typedef struct ring {
  vkdev_t *d; int kind, index;
  uint64_t *words, cap;
  _Atomic uint64_t wptr, rptr, packets_done;
  pthread_mutex_t produce, consume, m; pthread_cond_t cv; int inline_mode; _Atomic int sleeping, stop; int started; pthread_t thr;
  VkSemaphore sem; uint64_t next_point; _Atomic uint64_t submitted;
  VkCommandPool pool; VkQueryPool qpool; batch_t b[NBATCH]; int cur, open, dirty; VkPipeline bound;
  VkSemaphore wsem[MAX_WAITS]; uint64_t wval[MAX_WAITS]; struct ring *wring[MAX_WAITS]; int nw;
  uint64_t packets_seen;                 // packets recorded (or run on the host)
  pthread_mutex_t state;                 // what ring_state reads
  uint64_t blocked[CUR_PKT_WORDS]; uint64_t blocked_pos; int is_blocked;
  int poisoned_inflight;
  uint64_t scratch_va; uint8_t *scratch;  // host-visible words a POLL of device memory copies into
  uint64_t reported;                     // the last batch point whose stores the store hook was told of
  _Atomic uint64_t handed;               // the same, once they were handed over (other rings' threads read it)
  uint64_t done_seen;                    // the last batch point the ring saw finish (its semaphore's value)
  _Atomic int pending;                   // stores recorded that the hook was not told of yet (under the consumer lock)
} ring_t;

static void destroy_device(vkdev_t *d);

static _Atomic uint32_t next_dev_id = 0x564B0001;  // "VK": poison ids apart from the CPU device's

// ---------------------------------------------------------------- the store hook
// A process that follows what its devices store from elsewhere (hcq's remote backend: signals remote devices wait on,
// windows of remote buffers; hcq.interfaces.HostStores) sets a hook: every store a ring makes into memory (SIGNAL,
// TIMESTAMP, WRITE, a COPY's destination), and host stores into signals (hcq_vk_signal_store), are then handed to
// `void hook(void *ctx, uint64_t device_address, uint64_t nbytes, uint32_t flags, uint64_t value)` once the host sees
// the bytes, on the ring's thread, in ring order; FLAG_SIGNAL marks a 16-byte signal, and `value` is then the value to
// forward (signal_reported: never what the word holds when a batch is reported, which a later batch, its bytes not
// handed over yet, may have stored already; and never older than what was forwarded). What the GPU stores is handed over when its batch
// has finished: while a hook is set a ring's thread waits for the batches it submitted before it sleeps (and polls
// for them in its host waits), and a submitting thread records nothing inline (its batches would be left unreported).
typedef void (*hcq_vk_store_hook_t)(void *ctx, uint64_t addr, uint64_t nbytes, uint32_t flags, uint64_t value);
static _Atomic(hcq_vk_store_hook_t) store_hook;
static _Atomic(void *) store_hook_ctx;
static _Atomic int hooks_running;  // threads inside stored(): removing the hook waits for them

static int hooked(void) { return atomic_load_explicit(&store_hook, memory_order_acquire) != NULL; }
static void stored(uint64_t va, uint64_t n, uint32_t flags, uint64_t value) {
  if (!hooked()) return;
  // seq_cst: the count goes up before the hook is read again, against the setter's store of NULL then load of the count
  atomic_fetch_add(&hooks_running, 1);
  hcq_vk_store_hook_t hook = atomic_load(&store_hook);
  if (hook) hook(atomic_load_explicit(&store_hook_ctx, memory_order_relaxed), va, n, flags, value);
  atomic_fetch_sub_explicit(&hooks_running, 1, memory_order_release);
}
// Setting or removing a hook first removes the one there and waits for the calls under way (seq_cst, against stored's
// count), so no call ever pairs a hook with another's context; then the new context, then the hook (release).
EXPORT void hcq_vk_set_store_hook(hcq_vk_store_hook_t fn, void *ctx) {
  atomic_store(&store_hook, NULL);
  while (atomic_load(&hooks_running)) sched_yield();
  atomic_store_explicit(&store_hook_ctx, ctx, memory_order_relaxed);
  if (fn) atomic_store_explicit(&store_hook, fn, memory_order_release);
}
// A fork() child has none of the threads that were inside the hook: nothing to wait for when it removes the hook.
static void hooks_after_fork(void) { atomic_store(&hooks_running, 0); }
__attribute__((constructor)) static void register_hooks_after_fork(void) { pthread_atfork(NULL, NULL, hooks_after_fork); }

// A host store into the signal the host maps at `addr`: a fresh value (no poison), published with release; not handed
// to the store hook (hcq serve pushes a client's store on to the signal's followers itself).
EXPORT void hcq_vk_signal_store_quiet(void *addr, uint64_t value) {
  hcq_clear_poison((_Atomic uint64_t *)addr + 1);
  atomic_store_explicit((_Atomic uint64_t *)addr, value, memory_order_release);
}

static void signal_stored(vkdev_t *d, uint64_t va, uint64_t *host, uint64_t value, uint64_t seq);

// The same store into the signal at host address `host` (device address `va`) of device `dev` (NULL: of none), handed
// to the store hook.
EXPORT void hcq_vk_signal_store(void *dev, void *host, uint64_t va, uint64_t value) {
  vkdev_t *d = dev;
  hcq_vk_signal_store_quiet(host, value);
  if (d) signal_stored(d, va, host, value, 0);
  else stored(va, 16, FLAG_SIGNAL, 0);  // (the hook reads the word)
}

// A value pushed into a signal here from elsewhere, stored poisoned in the name of `id` (a device of this backend, or a
// feeder: hcq_vk_name_feeder): the tag first, then the value with release. Not handed to the hook (it came from there).
EXPORT void hcq_vk_signal_poison(void *host, uint64_t value, uint32_t id) {
  atomic_store_explicit((_Atomic uint64_t *)host + 1, POISON_TAG | id, memory_order_relaxed);
  atomic_store_explicit((_Atomic uint64_t *)host, value, memory_order_release);
}

// Wakes this backend's threads asleep on the word at `addr` after a store from elsewhere: none sleep on a word (ring
// threads and host waits read it, in naps of at most 1 ms), so there is nothing to do.
EXPORT void hcq_vk_wake(void *addr, uint64_t value) { (void)addr; (void)value; }

// Poison ids that name no device of this backend (signals fed from elsewhere: a remote server): why a WAIT released
// by a value poisoned with one was released.
#define FEEDER_BASE 0x56460000u  // "VF": apart from the devices' ids (next_dev_id)
static pthread_mutex_t feeders_lock = PTHREAD_MUTEX_INITIALIZER;
static char **feeders; static uint32_t nfeeders;

EXPORT uint32_t hcq_vk_name_feeder(const char *why) {
  pthread_mutex_lock(&feeders_lock);
  char **grown = realloc(feeders, (nfeeders + 1) * sizeof *feeders), *copy = strdup(why);
  uint32_t id = 0;
  if (grown) feeders = grown;
  if (grown && copy && nfeeders < 0xFFFF) { feeders[nfeeders] = copy; id = FEEDER_BASE + nfeeders++; }
  else free(copy);
  pthread_mutex_unlock(&feeders_lock);
  return id;  // (0: out of memory; a value poisoned with it reads as released by an unknown device)
}

// Why feeder `id` released a WAIT, into buf; 0 when `id` is no feeder.
static int feeder_reason(uint32_t id, char *buf, size_t len) {
  int found = 0;
  pthread_mutex_lock(&feeders_lock);
  if (id >= FEEDER_BASE && id - FEEDER_BASE < nfeeders) { snprintf(buf, len, "%s", feeders[id - FEEDER_BASE]); found = 1; }
  pthread_mutex_unlock(&feeders_lock);
  return found;
}

// ---------------------------------------------------------------- failure
static const char *vk_result_name(VkResult r) {
  switch (r) {
    case VK_SUCCESS: return "VK_SUCCESS"; case VK_TIMEOUT: return "VK_TIMEOUT";
    case VK_ERROR_OUT_OF_HOST_MEMORY: return "VK_ERROR_OUT_OF_HOST_MEMORY";
    case VK_ERROR_OUT_OF_DEVICE_MEMORY: return "VK_ERROR_OUT_OF_DEVICE_MEMORY";
    case VK_ERROR_INITIALIZATION_FAILED: return "VK_ERROR_INITIALIZATION_FAILED";
    case VK_ERROR_DEVICE_LOST: return "VK_ERROR_DEVICE_LOST"; case VK_ERROR_MEMORY_MAP_FAILED: return "VK_ERROR_MEMORY_MAP_FAILED";
    case VK_ERROR_EXTENSION_NOT_PRESENT: return "VK_ERROR_EXTENSION_NOT_PRESENT";
    case VK_ERROR_FEATURE_NOT_PRESENT: return "VK_ERROR_FEATURE_NOT_PRESENT";
    case VK_ERROR_INCOMPATIBLE_DRIVER: return "VK_ERROR_INCOMPATIBLE_DRIVER";
    case VK_ERROR_INVALID_EXTERNAL_HANDLE: return "VK_ERROR_INVALID_EXTERNAL_HANDLE";
    case VK_ERROR_INVALID_SHADER_NV: return "VK_ERROR_INVALID_SHADER_NV";
    default: return "an unknown VkResult";
  }
}

static void wake_all(vkdev_t *d);
int hcq_vk_alloc(void *dev, uint64_t size, int host_visible, uint64_t *va, void **host);
void hcq_vk_free(void *dev, uint64_t va);

// The first failure wins; ring threads then drain (see drain_packet).
static void fail(vkdev_t *d, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void fail(vkdev_t *d, const char *fmt, ...) {
  pthread_mutex_lock(&d->lock);
  if (!atomic_load_explicit(&d->failed, memory_order_relaxed)) {
    va_list ap; va_start(ap, fmt); vsnprintf(d->err, sizeof d->err, fmt, ap); va_end(ap);
    atomic_store_explicit(&d->failed, 1, memory_order_release);  // the message is published before the flag
  }
  pthread_mutex_unlock(&d->lock);
  stored((uint64_t)(uintptr_t)&d->failed, sizeof d->failed, 0, 0);  // (a host that serves the device mirrors its failure word)
  wake_all(d);
}
static int failed(vkdev_t *d) { return atomic_load_explicit(&d->failed, memory_order_acquire); }

// A failed device's store of a signal: poison tag first, then the value with release (hcq.packets); the store hook
// is told of it.
static void poison_store(vkdev_t *d, uint64_t *host, uint64_t va, uint64_t value) {
  // The failure word first, from this thread (as cp.c's drain does): a mirror of the device's memory (hcq serve) must
  // never show the poisoned value before the failure it stands for.
  stored((uint64_t)(uintptr_t)&d->failed, sizeof d->failed, 0, 0);
  hcq_vk_signal_poison(host, value, d->id);
  signal_stored(d, va, host, value, 0);
}

// ---------------------------------------------------------------- ranges (device address -> buffer, host view)
static int range_index(vkdev_t *d, uint64_t va) {  // last range starting at or below va, or -1
  int lo = 0, hi = d->nranges - 1, at = -1;
  while (lo <= hi) { int mid = (lo + hi) / 2; if (d->ranges[mid].va <= va) { at = mid; lo = mid + 1; } else hi = mid - 1; }
  return at;
}
// The range holding [va, va + n), copied out under the lock (ranges never move while work may use them: the core
// frees memory only once no submitted work can reach it).
static int find_range(vkdev_t *d, uint64_t va, uint64_t n, range_t *out) {
  pthread_mutex_lock(&d->lock);
  int i = range_index(d, va), ok = i >= 0 && va - d->ranges[i].va <= d->ranges[i].size && n <= d->ranges[i].size - (va - d->ranges[i].va);
  if (ok) *out = d->ranges[i];
  pthread_mutex_unlock(&d->lock);
  return ok;
}
static int add_range(vkdev_t *d, range_t r) {
  pthread_mutex_lock(&d->lock);
  if (d->nranges == d->rcap) {
    int cap = d->rcap ? 2 * d->rcap : 64;
    range_t *n = realloc(d->ranges, (size_t)cap * sizeof *n);
    if (!n) { pthread_mutex_unlock(&d->lock); return -1; }
    d->ranges = n; d->rcap = cap;
  }
  int at = range_index(d, r.va) + 1;
  memmove(&d->ranges[at + 1], &d->ranges[at], (size_t)(d->nranges - at) * sizeof *d->ranges);
  d->ranges[at] = r; d->nranges++;
  pthread_mutex_unlock(&d->lock);
  return 0;
}

// ---------------------------------------------------------------- recent SIGNALs
// A signal's slot in the device's tables of signals (sigtab, reptab): the high bits of a multiplicative hash of its
// 16-byte index (the low ones would make signals a multiple of 64 KiB apart share a slot).
static uint32_t sig_index(uint64_t va) { return (uint32_t)(((va >> 4) * 0x9E3779B97F4A7C15ull) >> 40) % SIGTAB; }
static sigent_t *sig_slot(vkdev_t *d, uint64_t va) { return &d->sigtab[sig_index(va)]; }
static void sig_put(vkdev_t *d, uint64_t va, uint64_t value, ring_t *r, uint64_t point) {
  pthread_mutex_lock(&d->lock);
  *sig_slot(d, va) = (sigent_t){va, value, point, r};
  pthread_mutex_unlock(&d->lock);
}
static int sig_get(vkdev_t *d, uint64_t va, sigent_t *out) {
  pthread_mutex_lock(&d->lock);
  *out = *sig_slot(d, va);
  pthread_mutex_unlock(&d->lock);
  return out->ring != NULL && out->va == va;
}

static reported_t *rep_slot(vkdev_t *d, uint64_t va) { return &d->reptab[sig_index(va)]; }
static uint64_t next_store_seq(vkdev_t *d) { return atomic_fetch_add_explicit(&d->store_seq, 1, memory_order_relaxed) + 1; }

// A ring SIGNAL of the signal at `va` recorded, the `seq`-th store recorded on the device: the newest of it, not handed
// over yet (see signal_stored).
static void signal_recorded(vkdev_t *d, uint64_t va, uint64_t seq) {
  pthread_mutex_lock(&d->lock);
  *rep_slot(d, va) = (reported_t){va, seq, 0};
  pthread_mutex_unlock(&d->lock);
}

// A signal store handed to the hook with the value to forward (HOOK_VALUE): a store a ring recorded as the `seq`-th of
// the device, or (seq 0) one the host made just now. The word itself, unless a ring SIGNAL of the signal recorded later
// than this store was not handed over yet: the GPU may have run that one already, and its batch's other bytes are not
// handed over; then the value this store wrote (the later one forwards the word once handed over). Rings hand their
// batches over on their own threads, so an older store may come after a newer one was handed over: it then forwards the
// word, which is not older, rather than take a follower back. Decided under the lock that records SIGNALs (one recorded
// after the decision cannot have run) and handed over under report_lock (one signal store at a time per device). A
// signal whose table slot another took forwards the word, as before there was a table.
static void signal_stored(vkdev_t *d, uint64_t va, uint64_t *host, uint64_t value, uint64_t seq) {
  if (!hooked()) return;  // (no follower)
  pthread_mutex_lock(&d->report_lock);
  pthread_mutex_lock(&d->lock);
  reported_t *e = rep_slot(d, va);
  int mine = seq && e->va == va && e->seq == seq;
  uint64_t forward = e->va == va && !mine && !e->handed ? value : atomic_load_explicit((_Atomic uint64_t *)host, memory_order_acquire);
  if (mine) e->handed = 1;
  pthread_mutex_unlock(&d->lock);
  stored(va, 16, FLAG_SIGNAL | HOOK_VALUE, forward);
  pthread_mutex_unlock(&d->report_lock);
}
static uint64_t sem_value(ring_t *r) {
  uint64_t v = 0;
  if (vkGetSemaphoreCounterValue(r->d->dev, r->sem, &v) == VK_ERROR_DEVICE_LOST) fail(r->d, "the device was lost (VK_ERROR_DEVICE_LOST)");
  return v;
}
// Wait for `sem` to reach `value` for at most `ns`: 0 reached, 1 not yet, -1 device lost.
static int sem_wait(vkdev_t *d, VkSemaphore sem, uint64_t value, uint64_t ns) {
  VkSemaphoreWaitInfo wi = {.sType = VK_STRUCTURE_TYPE_SEMAPHORE_WAIT_INFO, .semaphoreCount = 1, .pSemaphores = &sem, .pValues = &value};
  VkResult rc = vkWaitSemaphores(d->dev, &wi, ns);
  if (rc == VK_SUCCESS) return 0;
  if (rc == VK_TIMEOUT) return 1;
  fail(d, "waiting for the device failed: %s", vk_result_name(rc));
  return -1;
}

// ---------------------------------------------------------------- batches
static void wake_ring(ring_t *r) { pthread_mutex_lock(&r->m); pthread_cond_broadcast(&r->cv); pthread_mutex_unlock(&r->m); }
static void wake_all(vkdev_t *d) { for (int i = 0; i < d->nrings; i++) wake_ring(d->rings[i]); }

static int stopping(ring_t *r) { return atomic_load_explicit(&r->stop, memory_order_acquire); }

static void set_blocked(ring_t *r, const uint64_t *pkt, uint64_t n, uint64_t pos) {
  pthread_mutex_lock(&r->state);
  r->is_blocked = pkt != NULL;
  if (pkt) { memset(r->blocked, 0, sizeof r->blocked); memcpy(r->blocked, pkt, (n < CUR_PKT_WORDS ? n : CUR_PKT_WORDS) * 8); r->blocked_pos = pos; }
  pthread_mutex_unlock(&r->state);
}

static void report_finished(struct ring *r);

// Open a batch in the next command buffer, once the work it last held has finished.
static int open_batch(ring_t *r, const uint64_t *pkt, uint64_t n, uint64_t pos) {
  if (r->open) return 0;
  batch_t *b = &r->b[r->cur];
  if (r->inline_mode && b->point && sem_value(r) < b->point) return WOULD_BLOCK;
  while (b->point && !failed(r->d)) {
    int rc = sem_wait(r->d, r->sem, b->point, 50000000);
    if (rc <= 0 || stopping(r)) { if (rc != 0) return -1; break; }
  }
  if (failed(r->d) || stopping(r)) return -1;
  if (b->nstores) report_finished(r);  // (its stores, and those of the batches before it, before its list is reused)
  vkResetCommandBuffer(b->cb, 0);
  if (b->nsets) { vkResetDescriptorPool(r->d->dev, b->dpool, 0); b->nsets = 0; }  // (its sets' last use has finished)
  VkCommandBufferBeginInfo bi = {.sType = VK_STRUCTURE_TYPE_COMMAND_BUFFER_BEGIN_INFO, .flags = VK_COMMAND_BUFFER_USAGE_ONE_TIME_SUBMIT_BIT};
  VkResult rc = vkBeginCommandBuffer(b->cb, &bi);
  if (rc != VK_SUCCESS) { fail(r->d, "vkBeginCommandBuffer failed: %s", vk_result_name(rc)); return -1; }
  pthread_mutex_lock(&r->state);
  b->point = ++r->next_point;
  b->nq = b->nsig = b->queries_reset = 0;
  memset(b->first, 0, sizeof b->first);
  memcpy(b->first, pkt, (n < CUR_PKT_WORDS ? n : CUR_PKT_WORDS) * 8);
  b->first_pos = pos;
  pthread_mutex_unlock(&r->state);
  r->open = 1; r->dirty = 0; r->bound = VK_NULL_HANDLE;
  return 0;
}

static void poison_batch(ring_t *r, batch_t *b) {
  for (int i = 0; i < b->nsig; i++) poison_store(r->d, b->sigs[i].host, b->sigs[i].va, b->sigs[i].value);
  b->nsig = 0;
  atomic_fetch_sub_explicit(&r->pending, b->nstores, memory_order_relaxed);  // (its other stores never happened)
  b->nstores = 0;
}

// Until ring `w` handed over the stores of its batches up to `point` (their rings' threads do, in their waits and before
// they sleep): what ring `r` stores after it must not reach a follower before them. Not waited for longer than a second
// (nor once a device fails or a ring stops).
static void await_point(ring_t *r, ring_t *w, uint64_t point) {
  for (int n = 0; n < 20000 && atomic_load_explicit(&w->handed, memory_order_acquire) < point; n++) {
    if (failed(r->d) || stopping(r) || stopping(w)) return;
    sleep_ns(50000);
  }
}
// Before a batch's stores are handed over: those of the batches of other rings it waited for on the GPU.
static void await_handed(ring_t *r, batch_t *b) { for (int i = 0; i < b->nwr; i++) await_point(r, b->wring[i], b->wpoint[i]); }

// The stores of the ring's batches finished up to point `done` that the hook was not told of yet, handed to it oldest
// first (the batches of a ring finish in the order of their points: one timeline semaphore) and forgotten.
static void report_finished_to(ring_t *r, uint64_t done) {
  uint64_t last = atomic_load_explicit(&r->submitted, memory_order_relaxed);
  if (done > last) done = last;
  if (done > r->done_seen) r->done_seen = done;
  if (!atomic_load_explicit(&r->pending, memory_order_relaxed)) {
    if (last > r->reported) r->reported = last;
    atomic_store_explicit(&r->handed, r->reported, memory_order_release);
    return;
  }
  while (r->reported < done) {
    uint64_t p = ++r->reported;
    for (int i = 0; i < NBATCH; i++) {
      batch_t *b = &r->b[i];
      if (b->point != p || !b->nstores) continue;
      await_handed(r, b);
      for (int k = 0; k < b->nstores; k++) {
        store_t *st = &b->stores[k];
        if (st->flags & FLAG_SIGNAL) signal_stored(r->d, st->va, st->host, st->value, st->seq);
        else stored(st->va, st->n, st->flags, 0);
      }
      atomic_fetch_sub_explicit(&r->pending, b->nstores, memory_order_relaxed);
      b->nstores = 0;
    }
    atomic_store_explicit(&r->handed, p, memory_order_release);  // (release: after its stores were handed over)
  }
}
static void report_finished(ring_t *r) {
  if (atomic_load_explicit(&r->pending, memory_order_relaxed)) report_finished_to(r, sem_value(r));  // (acquire: the bytes are visible)
  else report_finished_to(r, 0);
}

// A store the open batch makes: the hook is told of it once the batch has finished (nothing is kept without a hook).
static int note_store(ring_t *r, uint64_t va, uint64_t n, uint32_t flags, uint64_t value, uint64_t *host) {
  if (!hooked()) return 0;
  batch_t *b = &r->b[r->cur];
  if (b->nstores == b->stores_cap) {
    int cap = b->stores_cap ? 2 * b->stores_cap : 16;
    store_t *grown = realloc(b->stores, (size_t)cap * sizeof *grown);
    if (!grown) { fail(r->d, "out of host memory for the list of stores a batch makes"); return -1; }
    b->stores = grown; b->stores_cap = cap;
  }
  uint64_t seq = (flags & FLAG_SIGNAL) ? next_store_seq(r->d) : 0;
  if (seq) signal_recorded(r->d, va, seq);
  b->stores[b->nstores++] = (store_t){va, n, value, seq, host, flags};
  atomic_fetch_add_explicit(&r->pending, 1, memory_order_relaxed);
  return 0;
}

// Before the ring's thread sleeps: wait for the batches whose stores the hook was not told of yet, and tell it (in
// slices, so words that come meanwhile are recorded first; a failed device's batches were poisoned instead).
static void settle(ring_t *r) {
  for (;;) {
    report_finished(r);
    if (!atomic_load_explicit(&r->pending, memory_order_relaxed) || failed(r->d) || stopping(r)) return;
    if (atomic_load_explicit(&r->wptr, memory_order_acquire) != atomic_load_explicit(&r->rptr, memory_order_relaxed)) return;
    if (sem_wait(r->d, r->sem, r->reported + 1, 1000000) < 0) return;
  }
}

static void barrier(ring_t *r);

// Submit the open batch (with the semaphore waits gathered for it), signalling the ring's semaphore to its point.
static int flush(ring_t *r) {
  if (!r->open) return 0;
  batch_t *b = &r->b[r->cur];
  barrier(r);  // (what the batch's last commands wrote is visible to the host once the semaphore says it finished)
  r->open = 0; r->cur = (r->cur + 1) % NBATCH;
  VkResult rc = vkEndCommandBuffer(b->cb);
  if (rc == VK_SUCCESS) {
    VkPipelineStageFlags stages[MAX_WAITS];
    for (int i = 0; i < r->nw; i++) stages[i] = VK_PIPELINE_STAGE_ALL_COMMANDS_BIT;
    VkTimelineSemaphoreSubmitInfo ti = {.sType = VK_STRUCTURE_TYPE_TIMELINE_SEMAPHORE_SUBMIT_INFO, .waitSemaphoreValueCount = (uint32_t)r->nw,
                                        .pWaitSemaphoreValues = r->wval, .signalSemaphoreValueCount = 1, .pSignalSemaphoreValues = &b->point};
    VkSubmitInfo si = {.sType = VK_STRUCTURE_TYPE_SUBMIT_INFO, .pNext = &ti, .waitSemaphoreCount = (uint32_t)r->nw, .pWaitSemaphores = r->wsem,
                       .pWaitDstStageMask = stages, .commandBufferCount = 1, .pCommandBuffers = &b->cb, .signalSemaphoreCount = 1,
                       .pSignalSemaphores = &r->sem};
    int64_t inject = atomic_load_explicit(&r->d->inject_lost, memory_order_relaxed);
    if (inject > 0 && atomic_fetch_sub_explicit(&r->d->inject_lost, 1, memory_order_relaxed) == 1) rc = VK_ERROR_DEVICE_LOST;
    else {
      int q = r->kind == 1 && r->d->nqueues > 1;  // the copy ring gets the second queue where there is one
      pthread_mutex_lock(&r->d->qlock[q]);
      rc = vkQueueSubmit(r->d->queues[q], 1, &si, VK_NULL_HANDLE);
      pthread_mutex_unlock(&r->d->qlock[q]);
    }
  }
  b->nwr = r->nw;
  for (int i = 0; i < r->nw; i++) { b->wring[i] = r->wring[i]; b->wpoint[i] = r->wval[i]; }
  r->nw = 0;
  if (rc != VK_SUCCESS) {  // (its SIGNALs are stored poisoned by poison_inflight, in order with the batches before it)
    fail(r->d, "vkQueueSubmit failed: %s%s", vk_result_name(rc), rc == VK_ERROR_DEVICE_LOST ? " (the device was lost)" : "");
    return -1;
  }
  pthread_mutex_lock(&r->state);
  b->words_end = atomic_load_explicit(&r->rptr, memory_order_relaxed);
  b->packets_end = r->packets_seen;
  pthread_mutex_unlock(&r->state);
  atomic_store_explicit(&r->submitted, b->point, memory_order_release);
  return 0;
}

// Wait until everything this ring submitted has finished (0), or the device failed / the ring stops (-1).
static int finish(ring_t *r) {
  if (flush(r)) return -1;
  uint64_t last = atomic_load_explicit(&r->submitted, memory_order_relaxed);
  for (;;) {
    if (failed(r->d) || stopping(r)) return -1;
    int rc = sem_wait(r->d, r->sem, last, 50000000);
    if (rc == 0) { report_finished(r); return 0; }
    if (rc < 0) return -1;
  }
}

// Whether everything this ring handed to the device has finished and nothing is being recorded: a store or copy the
// host can make itself is then in order without a submission (and is not queued behind other rings' work on a
// shared queue).
static int ring_idle(ring_t *r) {
  uint64_t last = atomic_load_explicit(&r->submitted, memory_order_relaxed);
  return !r->open && r->nw == 0 && (last == 0 || sem_value(r) >= last);
}

static void barrier(ring_t *r) {  // earlier commands of the batch finished and their writes visible to later ones
  if (!r->dirty) return;
  VkMemoryBarrier mb = {.sType = VK_STRUCTURE_TYPE_MEMORY_BARRIER, .srcAccessMask = VK_ACCESS_MEMORY_WRITE_BIT,
                        .dstAccessMask = VK_ACCESS_MEMORY_READ_BIT | VK_ACCESS_MEMORY_WRITE_BIT | VK_ACCESS_HOST_READ_BIT};
  vkCmdPipelineBarrier(r->b[r->cur].cb, VK_PIPELINE_STAGE_ALL_COMMANDS_BIT, VK_PIPELINE_STAGE_ALL_COMMANDS_BIT | VK_PIPELINE_STAGE_HOST_BIT,
                       0, 1, &mb, 0, NULL, 0, NULL);
  r->dirty = 0;
}

// ---------------------------------------------------------------- packets
typedef struct { ring_t *r; const uint64_t *pkt; uint64_t n, pos; } ctx_t;

static int fault(ctx_t *c, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static int fault(ctx_t *c, const char *fmt, ...) {
  char msg[512]; va_list ap; va_start(ap, fmt); vsnprintf(msg, sizeof msg, fmt, ap); va_end(ap);
  fail(c->r->d, "%s", msg);
  return -1;
}
static int need_range(ctx_t *c, uint64_t va, uint64_t n, int want_buffer, int want_host, const char *what, range_t *out) {
  if (!find_range(c->r->d, va, n, out)) return fault(c, "%s: 0x%llx (+%llu bytes) is not memory of this device", what, (unsigned long long)va, (unsigned long long)n);
  if (want_buffer && out->buf == VK_NULL_HANDLE) return fault(c, "%s: 0x%llx is memory the device's queues cannot reach", what, (unsigned long long)va);
  if (want_host && out->host == NULL) return fault(c, "%s: 0x%llx is device memory the host cannot read (not host-visible)", what, (unsigned long long)va);
  return 0;
}
static int begin(ctx_t *c) { return open_batch(c->r, c->pkt, c->n, c->pos); }

// The packet a hang report names for the batch: its first EXEC or COPY (what can take long), else its first packet.
static void note_work(ctx_t *c) {
  batch_t *b = &c->r->b[c->r->cur];
  uint64_t op = hdr_op(b->first[0]);
  if (op == OP_EXEC || op == OP_COPY) return;
  pthread_mutex_lock(&c->r->state);
  memset(b->first, 0, sizeof b->first);
  memcpy(b->first, c->pkt, (c->n < CUR_PKT_WORDS ? c->n : CUR_PKT_WORDS) * 8);
  b->first_pos = c->pos;
  pthread_mutex_unlock(&c->r->state);
}

static int record_timestamp_to(ctx_t *c, const range_t *rg, uint64_t off) {
  int rc_ = 0;
  ring_t *r = c->r; batch_t *b = &r->b[r->cur];
  if (b->nq == QPB) { if ((rc_ = flush(r)) || (rc_ = begin(c))) return rc_; b = &r->b[r->cur]; }
  uint32_t q = (uint32_t)(r->cur * QPB + b->nq++);
  if (!b->queries_reset) { vkCmdResetQueryPool(b->cb, r->qpool, (uint32_t)(r->cur * QPB), QPB); b->queries_reset = 1; }
  barrier(r);
  vkCmdWriteTimestamp(b->cb, VK_PIPELINE_STAGE_BOTTOM_OF_PIPE_BIT, r->qpool, q);
  vkCmdCopyQueryPoolResults(b->cb, r->qpool, q, 1, rg->buf, off, 8, VK_QUERY_RESULT_64_BIT | VK_QUERY_RESULT_WAIT_BIT);
  r->dirty = 1;
  return 0;
}

// Whether the host may skip a WAIT whose value it already sees; a poisoned one fails this device (hcq.packets).
static int wait_released(ctx_t *c, const uint64_t *host, uint64_t value, uint64_t flags) {
  if (atomic_load_explicit((_Atomic uint64_t *)host, memory_order_acquire) < value) return 0;
  if (flags & FLAG_SIGNAL) {
    uint64_t ts = atomic_load_explicit((_Atomic uint64_t *)(host + 1), memory_order_relaxed);
    char why[256];
    if (hcq_is_poisoned(ts) && hcq_poisoner(ts) != c->r->d->id && feeder_reason(hcq_poisoner(ts), why, sizeof why))
      fault(c, "a WAIT for signal 0x%llx >= %llu was released because %s, so the work it waited for did not run", (unsigned long long)c->pkt[1],
            (unsigned long long)value, why);
    else if (hcq_is_poisoned(ts) && hcq_poisoner(ts) != c->r->d->id)
      fault(c, "a WAIT for signal 0x%llx >= %llu was released by device #%llu after it failed, so the work it waited for did not run",
            (unsigned long long)c->pkt[1], (unsigned long long)value, (unsigned long long)hcq_poisoner(ts));
  }
  return 1;
}

// WAIT: done when the host already sees the value; after an earlier SIGNAL of this ring, by order; after a SIGNAL
// another ring of this device already submitted, by a semaphore wait of the next batch; else on the host (a
// submission must never wait on a semaphore value not yet submitted: one queue would deadlock).
static int do_wait(ctx_t *c, uint64_t va, uint64_t value, uint64_t flags) {
  ring_t *r = c->r; vkdev_t *d = r->d; range_t rg;
  if (need_range(c, va, 16, 0, 1, "WAIT", &rg)) return -1;
  uint64_t *host = (uint64_t *)(rg.host + (va - rg.va));
  uint64_t spun = 0, nap = 2000;
  for (int blocked = 0;; ) {
    if (wait_released(c, host, value, flags)) {  // (a SIGNAL another ring's GPU batch made, seen in memory: what this ring
      sigent_t e;                                  // stores next reaches a follower after that batch's stores)
      if (hooked() && sig_get(d, va, &e) && e.ring != r && e.value >= value && e.point <= sem_value(e.ring)) await_point(r, e.ring, e.point);
      break;
    }
    sigent_t e;
    if (sig_get(d, va, &e) && e.value >= value) {
      if (e.ring == r && e.point > sem_value(r)) break;  // an earlier SIGNAL of this ring, not run yet: order does it
      // (a semaphore wait needs a free slot: waits gathered with nothing recorded after them stay until a batch opens)
      if (e.ring != r && r->nw < MAX_WAITS && e.point <= atomic_load_explicit(&e.ring->submitted, memory_order_acquire) && e.point > sem_value(e.ring)) {
        if (flush(r)) return -1;  // the wait holds for what follows, not for what is recorded already
        r->wring[r->nw] = e.ring; r->wsem[r->nw] = e.ring->sem; r->wval[r->nw++] = e.point;
        break;
      }
    }
    if (r->inline_mode) return WOULD_BLOCK;
    if (!blocked) { if (flush(r)) return -1; set_blocked(r, c->pkt, c->n, c->pos); blocked = 1; }
    if (failed(d) || stopping(r)) { set_blocked(r, NULL, 0, 0); return -1; }
    report_finished(r);  // (what it waits for may come from a device that follows what this ring stored)
    if (spun < 20000) { spun += 1000; continue; }  // (each round reads memory; a short spin first)
    sleep_ns(nap); if (nap < 1000000) nap *= 2;
  }
  set_blocked(r, NULL, 0, 0);
  return 0;
}

static int do_signal(ctx_t *c, uint64_t va, uint64_t value, uint64_t flags) {
  int rc_ = 0;
  ring_t *r = c->r; range_t rg;
  uint64_t reported = (flags & FLAG_SIGNAL) ? 16 : 8;
  if (need_range(c, va, 16, 1, 1, "SIGNAL", &rg)) return -1;
  if (ring_idle(r)) {  // stored by the host: acquire of the semaphore (ring_idle) before, release of the value
    report_finished(r);  // (what the ring stored before, first)
    uint64_t *host = (uint64_t *)(rg.host + (va - rg.va));
    hcq_vk_signal_store_quiet(host, value);
    if (flags & FLAG_SIGNAL) signal_stored(r->d, va, host, value, 0);
    else stored(va, reported, 0, 0);
    return 0;
  }
  if ((rc_ = begin(c))) return rc_;
  batch_t *b = &r->b[r->cur];
  if (b->nsig == SIGS_PER_BATCH) { if ((rc_ = flush(r)) || (rc_ = begin(c))) return rc_; b = &r->b[r->cur]; }
  uint64_t off = va - rg.va;
  barrier(r);
  vkCmdUpdateBuffer(b->cb, rg.buf, off, 8, &value);
  r->dirty = 1;
  b->sigs[b->nsig].host = (uint64_t *)(rg.host + off); b->sigs[b->nsig].va = va; b->sigs[b->nsig++].value = value;
  sig_put(r->d, va, value, r, b->point);
  return note_store(r, va, reported, (uint32_t)(flags & FLAG_SIGNAL), value, (uint64_t *)(rg.host + off));
}

static VkPipeline pipeline_for(ctx_t *c, prog_t *p, const uint32_t l[3]) {
  vkdev_t *d = c->r->d;
  for (int i = 0; i < p->npipes; i++) if (!memcmp(p->pipes[i].l, l, sizeof p->pipes[i].l)) return p->pipes[i].p;
  if (p->fixed && memcmp(p->local, l, sizeof p->local)) {
    fault(c, "kernel '%s' declares its local size (%u, %u, %u) and was launched with (%u, %u, %u)", p->name, p->local[0], p->local[1],
          p->local[2], l[0], l[1], l[2]);
    return VK_NULL_HANDLE;
  }
  if (p->npipes == MAX_PIPES) { fault(c, "kernel '%s' was launched with more than %d local sizes", p->name, MAX_PIPES); return VK_NULL_HANDLE; }
  VkSpecializationMapEntry me[3] = {{0, 0, 4}, {1, 4, 4}, {2, 8, 4}};
  VkSpecializationInfo spec = {3, me, 12, l};
  VkComputePipelineCreateInfo ci = {.sType = VK_STRUCTURE_TYPE_COMPUTE_PIPELINE_CREATE_INFO, .layout = p->layout,
    .stage = {.sType = VK_STRUCTURE_TYPE_PIPELINE_SHADER_STAGE_CREATE_INFO, .stage = VK_SHADER_STAGE_COMPUTE_BIT, .module = p->mod,
              .pName = "main", .pSpecializationInfo = p->fixed ? NULL : &spec}};
  VkPipeline pipe;
  VkResult rc = vkCreateComputePipelines(d->dev, VK_NULL_HANDLE, 1, &ci, NULL, &pipe);
  if (rc != VK_SUCCESS) { fault(c, "cannot create the pipeline of kernel '%s': %s", p->name, vk_result_name(rc)); return VK_NULL_HANDLE; }
  memcpy(p->pipes[p->npipes].l, l, sizeof p->pipes[p->npipes].l); p->pipes[p->npipes++].p = pipe;
  return pipe;
}

// A descriptor set of the open batch for kernel `p` (a full batch is submitted and another opened), filled from the
// kernargs block at `args` (host memory): each binding's buffer at its address for its size. 0, WOULD_BLOCK or -1.
static int bind_buffers(ctx_t *c, prog_t *p, const uint64_t *args, VkDescriptorSet *out) {
  ring_t *r = c->r; vkdev_t *d = r->d; int rc_ = 0;
  batch_t *b = &r->b[r->cur];
  if (b->nsets == SETS_PER_BATCH) { if ((rc_ = flush(r)) || (rc_ = begin(c))) return rc_; b = &r->b[r->cur]; }
  if (!b->dpool) {
    VkDescriptorPoolSize ps = {VK_DESCRIPTOR_TYPE_STORAGE_BUFFER, SETS_PER_BATCH * MAX_BINDINGS};
    VkDescriptorPoolCreateInfo pci = {.sType = VK_STRUCTURE_TYPE_DESCRIPTOR_POOL_CREATE_INFO, .maxSets = SETS_PER_BATCH, .poolSizeCount = 1, .pPoolSizes = &ps};
    VkResult rc = vkCreateDescriptorPool(d->dev, &pci, NULL, &b->dpool);
    if (rc != VK_SUCCESS) return fault(c, "EXEC of kernel '%s': cannot create a descriptor pool: %s", p->name, vk_result_name(rc));
  }
  VkDescriptorBufferInfo bufs[MAX_BINDINGS]; VkWriteDescriptorSet wr[MAX_BINDINGS];
  const uint64_t *sizes = args + p->sizes_offset / 8;
  uint64_t align = d->props.limits.minStorageBufferOffsetAlignment, most = d->props.limits.maxStorageBufferRange;
  for (uint32_t i = 0; i < p->nbind; i++) {
    range_t rg;
    char what[160]; snprintf(what, sizeof what, "EXEC of kernel '%s': the buffer of binding %u", p->name, p->binding[i]);
    if (!sizes[i]) return fault(c, "%s is empty", what);
    if (sizes[i] > most) return fault(c, "%s is %llu bytes, more than the device's maxStorageBufferRange (%llu)", what, (unsigned long long)sizes[i], (unsigned long long)most);
    if (need_range(c, args[i], sizes[i], 1, 0, what, &rg)) return -1;
    if (align > 1 && (args[i] - rg.va) % align)
      return fault(c, "%s starts at 0x%llx, not a multiple of the device's minStorageBufferOffsetAlignment (%llu)", what, (unsigned long long)args[i], (unsigned long long)align);
    bufs[i] = (VkDescriptorBufferInfo){rg.buf, args[i] - rg.va, sizes[i]};
    wr[i] = (VkWriteDescriptorSet){.sType = VK_STRUCTURE_TYPE_WRITE_DESCRIPTOR_SET, .dstBinding = p->binding[i], .descriptorCount = 1,
                                   .descriptorType = VK_DESCRIPTOR_TYPE_STORAGE_BUFFER, .pBufferInfo = &bufs[i]};
  }
  VkDescriptorSetAllocateInfo ai = {.sType = VK_STRUCTURE_TYPE_DESCRIPTOR_SET_ALLOCATE_INFO, .descriptorPool = b->dpool, .descriptorSetCount = 1, .pSetLayouts = &p->dsl};
  VkResult rc = vkAllocateDescriptorSets(d->dev, &ai, out);
  if (rc != VK_SUCCESS) return fault(c, "EXEC of kernel '%s': cannot allocate a descriptor set: %s", p->name, vk_result_name(rc));
  b->nsets++;
  for (uint32_t i = 0; i < p->nbind; i++) wr[i].dstSet = *out;
  vkUpdateDescriptorSets(d->dev, p->nbind, wr, 0, NULL);
  return 0;
}

static int do_exec(ctx_t *c) {
  int rc_ = 0;
  ring_t *r = c->r; vkdev_t *d = r->d;
  uint64_t entry = c->pkt[1], kernargs = c->pkt[2];
  const uint64_t *dims = &c->pkt[EXEC_DIMS_AT];
  pthread_mutex_lock(&d->lock);
  prog_t *p = entry >= 1 && entry <= d->nprogs ? d->progs[entry - 1] : NULL;
  pthread_mutex_unlock(&d->lock);
  if (!p) return fault(c, "EXEC of kernel entry %llu: no such kernel was loaded", (unsigned long long)entry);
  for (int i = 0; i < 3; i++)
    if (dims[i] > d->props.limits.maxComputeWorkGroupCount[i] || dims[3 + i] == 0 || dims[3 + i] > d->props.limits.maxComputeWorkGroupSize[i])
      return fault(c, "EXEC of kernel '%s': launch (%llu, %llu, %llu) x (%llu, %llu, %llu) exceeds the device's limits", p->name,
                   (unsigned long long)dims[0], (unsigned long long)dims[1], (unsigned long long)dims[2], (unsigned long long)dims[3],
                   (unsigned long long)dims[4], (unsigned long long)dims[5]);
  uint32_t l[3] = {(uint32_t)dims[3], (uint32_t)dims[4], (uint32_t)dims[5]};
  VkPipeline pipe = pipeline_for(c, p, l);
  if (!pipe) return -1;
  if ((rc_ = begin(c))) return rc_;
  if (!dims[0] || !dims[1] || !dims[2]) return 0;
  const uint64_t *args = NULL; VkDescriptorSet set = VK_NULL_HANDLE;
  if (p->pushed) {  // read when recorded: the host wrote the block before it submitted the packet
    range_t rg;
    if (need_range(c, kernargs, p->sizes_offset + 8ull * p->nbind, 0, 1, "EXEC kernargs", &rg)) return -1;
    if (kernargs & 7) return fault(c, "EXEC of kernel '%s': kernargs at 0x%llx are not 8-byte aligned", p->name, (unsigned long long)kernargs);
    args = (const uint64_t *)(rg.host + (kernargs - rg.va));
    if (p->nbind && (rc_ = bind_buffers(c, p, args, &set))) return rc_;
  }
  VkCommandBuffer cb = r->b[r->cur].cb;
  barrier(r);
  if (r->bound != pipe) { vkCmdBindPipeline(cb, VK_PIPELINE_BIND_POINT_COMPUTE, pipe); r->bound = pipe; }
  if (!p->pushed) vkCmdPushConstants(cb, d->layout, VK_SHADER_STAGE_COMPUTE_BIT, 0, 8, &kernargs);
  if (set) vkCmdBindDescriptorSets(cb, VK_PIPELINE_BIND_POINT_COMPUTE, p->layout, 0, 1, &set, 0, NULL);
  if (p->push_size) vkCmdPushConstants(cb, p->layout, VK_SHADER_STAGE_COMPUTE_BIT, 0, p->push_size, (const uint8_t *)args + 8 * p->nbind);
  vkCmdDispatch(cb, (uint32_t)dims[0], (uint32_t)dims[1], (uint32_t)dims[2]);
  r->dirty = 1;
  note_work(c);
  return 0;
}

static int do_copy(ctx_t *c, uint64_t flags) {
  int rc_ = 0;
  ring_t *r = c->r; range_t dst, src;
  uint64_t dva = c->pkt[1], sva = c->pkt[2], n = c->pkt[3];
  if (need_range(c, dva, n, 1, 0, "COPY destination", &dst) || need_range(c, sva, n, 1, 0, "COPY source", &src)) return -1;
  uint64_t *guard = NULL;
  if (flags & FLAG_GUARD) {  // cancellable: the guard moves on the host, between finished batches
    range_t g;
    if (r->inline_mode) return WOULD_BLOCK;
    if (need_range(c, c->pkt[4], 8, 0, 1, "COPY guard", &g) || finish(r)) return -1;
    guard = (uint64_t *)(g.host + (c->pkt[4] - g.va));
    uint64_t expect = GUARD_PENDING;
    if (!atomic_compare_exchange_strong((_Atomic uint64_t *)guard, &expect, GUARD_RUNNING)) return 0;  // cancelled
  }
  if (n && r->d->host_is_device && dst.host && src.host && ring_idle(r)) {
    report_finished(r);
    memmove(dst.host + (dva - dst.va), src.host + (sva - src.va), n);
    stored(dva, n, 0, 0);
  } else if (n) {
    if ((rc_ = begin(c))) return rc_;
    barrier(r);
    VkBufferCopy region = {sva - src.va, dva - dst.va, n};
    vkCmdCopyBuffer(r->b[r->cur].cb, src.buf, dst.buf, 1, &region);
    r->dirty = 1;
    note_work(c);
    if (note_store(r, dva, n, 0, 0, NULL)) return -1;
  }
  if (guard) {
    int rc = finish(r);
    atomic_store_explicit((_Atomic uint64_t *)guard, GUARD_DONE, memory_order_release);
    return rc;
  }
  return 0;
}

static int do_write(ctx_t *c, uint64_t flags) {
  int rc_ = 0;
  ring_t *r = c->r; range_t rg;
  uint64_t va = c->pkt[1], value = c->pkt[2], n = (flags & FLAG_B64) ? 8 : 4;
  if (need_range(c, va, n, 1, 0, "WRITE", &rg)) return -1;
  if (va & 3) return fault(c, "WRITE to 0x%llx: Vulkan writes only 4-byte aligned words", (unsigned long long)va);
  if (rg.host && ring_idle(r)) {
    void *host = rg.host + (va - rg.va);
    report_finished(r);
    if (n == 8) atomic_store_explicit((_Atomic uint64_t *)host, value, memory_order_release);
    else atomic_store_explicit((_Atomic uint32_t *)host, (uint32_t)value, memory_order_release);
    stored(va, n, 0, 0);
    return 0;
  }
  if ((rc_ = begin(c))) return rc_;
  barrier(r);
  uint32_t v32 = (uint32_t)value;
  vkCmdUpdateBuffer(r->b[r->cur].cb, rg.buf, va - rg.va, n, n == 8 ? (const void *)&value : (const void *)&v32);
  r->dirty = 1;
  return note_store(r, va, n, 0, 0, NULL);
}

// POLL: after everything before it finished, on the host (Vulkan has no wait on a memory word).
static int do_poll(ctx_t *c, uint64_t flags, uint64_t cond) {
  ring_t *r = c->r; range_t rg;
  uint64_t va = c->pkt[1], value = c->pkt[2], mask = c->pkt[3], b64 = flags & FLAG_B64;
  if (cond >= POLL_COUNT) return fault(c, "POLL with unknown condition %llu", (unsigned long long)cond);
  if (r->inline_mode) return WOULD_BLOCK;
  if (need_range(c, va, b64 ? 8 : 4, 0, 0, "POLL", &rg) || finish(r)) return -1;
  range_t scratch;
  if (!rg.host && (need_range(c, va, b64 ? 8 : 4, 1, 0, "POLL", &rg) || need_range(c, r->scratch_va, 8, 1, 1, "POLL scratch", &scratch))) return -1;
  void *host = rg.host ? rg.host + (va - rg.va) : r->scratch;
  set_blocked(r, c->pkt, c->n, c->pos);
  uint64_t nap = 2000;
  for (int i = 0;; i++) {
    if (!rg.host) {  // device memory the host cannot read: each look is a copy of the word into the ring's scratch
      if (begin(c)) { set_blocked(r, NULL, 0, 0); return -1; }
      VkBufferCopy region = {va - rg.va, 0, b64 ? 8 : 4};
      vkCmdCopyBuffer(r->b[r->cur].cb, rg.buf, scratch.buf, 1, &region);
      r->dirty = 1;
      if (finish(r)) { set_blocked(r, NULL, 0, 0); return -1; }
    }
    uint64_t v = b64 ? atomic_load_explicit((_Atomic uint64_t *)host, memory_order_acquire) : atomic_load_explicit((_Atomic uint32_t *)host, memory_order_acquire);
    if (hcq_poll_holds(cond, v, value, mask, b64 ? ~0ull : 0xFFFFFFFFull)) break;
    if (failed(r->d) || stopping(r)) { set_blocked(r, NULL, 0, 0); return -1; }
    report_finished(r);
    if (i > 20) { sleep_ns(nap); if (nap < 1000000) nap *= 2; }
  }
  set_blocked(r, NULL, 0, 0);
  return 0;
}

static int run_packet(ring_t *r, const uint64_t *pkt, uint64_t n, uint64_t pos, int depth);
static int run_op(ctx_t *c, uint64_t op, uint64_t flags, int depth);

static int do_indirect(ctx_t *c, int depth) {
  range_t rg; uint64_t va = c->pkt[1], nw = c->pkt[2];
  if (depth) return fault(c, "INDIRECT inside an INDIRECT run");
  if (c->r->inline_mode) return WOULD_BLOCK;  // (its packets may wait)
  if (need_range(c, va, nw * 8, 0, 1, "INDIRECT", &rg)) return -1;
  const uint64_t *w = (const uint64_t *)(rg.host + (va - rg.va));
  for (uint64_t i = 0; i < nw;) {
    uint64_t n = hdr_words(w[i]);
    if (n == 0 || i + n > nw) return fault(c, "a bad packet (header 0x%llx) at word %llu of an INDIRECT run", (unsigned long long)w[i], (unsigned long long)i);
    if (run_packet(c->r, &w[i], n, c->pos, depth + 1)) return -1;
    i += n;
  }
  return 0;
}

static int run_packet(ring_t *r, const uint64_t *pkt, uint64_t n, uint64_t pos, int depth) {
  ctx_t c = {r, pkt, n, pos};
  uint64_t op = hdr_op(pkt[0]), flags = hdr_flags(pkt[0]);
  if (op == 0 || op >= OP_COUNT || n < packet_words[op] + ((op == OP_COPY && (flags & FLAG_GUARD)) ? 1 : 0))
    return fault(&c, "a bad packet (header 0x%llx)", (unsigned long long)pkt[0]);
  int rc = run_op(&c, op, flags, depth);
  if (rc != WOULD_BLOCK) r->packets_seen++;
  return rc;
}

static int run_op(ctx_t *c, uint64_t op, uint64_t flags, int depth) {
  ring_t *r = c->r; const uint64_t *pkt = c->pkt;
  int rc_ = 0;
  switch (op) {
    case OP_WAIT: return do_wait(c, pkt[1], pkt[2], flags);
    case OP_SIGNAL: return do_signal(c, pkt[1], pkt[2], flags);
    case OP_TIMESTAMP: {
      range_t rg;
      if ((rc_ = need_range(c, pkt[1], 8, 1, 0, "TIMESTAMP", &rg)) || (rc_ = begin(c))) return rc_;
      if (pkt[1] & 7) return fault(c, "TIMESTAMP to 0x%llx: not 8-byte aligned", (unsigned long long)pkt[1]);
      if ((rc_ = record_timestamp_to(c, &rg, pkt[1] - rg.va))) return rc_;
      return note_store(r, pkt[1], 8, 0, 0, NULL);
    }
    case OP_BARRIER: if ((rc_ = begin(c))) return rc_; r->dirty = 1; barrier(r); return 0;
    case OP_EXEC: return do_exec(c);
    case OP_COPY: return do_copy(c, flags);
    case OP_WRITE: return do_write(c, flags);
    case OP_POLL: return do_poll(c, flags, hdr_cond(pkt[0]));
    case OP_INDIRECT: return do_indirect(c, depth);
  }
  return 0;
}

// A failed device drains: SIGNALs of signals are stored on the host, poisoned; everything else is dropped.
static void drain_packet(ring_t *r, const uint64_t *pkt, uint64_t n, int depth) {
  uint64_t op = hdr_op(pkt[0]);
  range_t rg;
  if (op == OP_SIGNAL && (hdr_flags(pkt[0]) & FLAG_SIGNAL) && n >= 3 && find_range(r->d, pkt[1], 16, &rg) && rg.host)
    poison_store(r->d, (uint64_t *)(rg.host + (pkt[1] - rg.va)), pkt[1], pkt[2]);
  else if (op == OP_INDIRECT && !depth && n >= 3 && find_range(r->d, pkt[1], pkt[2] * 8, &rg) && rg.host) {
    const uint64_t *w = (const uint64_t *)(rg.host + (pkt[1] - rg.va));
    for (uint64_t i = 0, k; i < pkt[2] && (k = hdr_words(w[i])) && i + k <= pkt[2]; i += k) drain_packet(r, &w[i], k, 1);
  }
}

// Batches that did not finish before the failure never store their signals: store them poisoned, oldest first (after
// the stores of those that did finish, handed to the hook), so no signal's value goes back.
static void poison_inflight(ring_t *r) {
  if (r->poisoned_inflight) return;
  r->poisoned_inflight = 1;
  uint64_t done = 0;
  vkGetSemaphoreCounterValue(r->d->dev, r->sem, &done);  // (read once: a batch is either reported or poisoned)
  if (done < r->done_seen) done = r->done_seen;  // (a lost device may answer nothing)
  report_finished_to(r, done);
  for (uint64_t floor = done;;) {  // the batches past `done`, by point
    batch_t *next = NULL;
    for (int i = 0; i < NBATCH; i++) if (r->b[i].point > floor && (!next || r->b[i].point < next->point)) next = &r->b[i];
    if (!next) break;
    poison_batch(r, next);
    floor = next->point;
  }
  r->open = 0;
}

// ---------------------------------------------------------------- the ring thread
static int nothing_to_do(ring_t *r) {  // (pending: stores an inline consumer left for the hook, see hcq_vk_submit)
  return atomic_load(&r->wptr) == atomic_load(&r->rptr) && !stopping(r) && !(failed(r->d) && !r->poisoned_inflight) &&
         !(atomic_load(&r->pending) && !failed(r->d));
}
static void wait_for_words(ring_t *r) {
  uint64_t t0 = now_ns();
  while (nothing_to_do(r)) {
    if (now_ns() - t0 < 20000) continue;  // a short spin: launches come in bursts
    pthread_mutex_lock(&r->m);
    atomic_store(&r->sleeping, 1);  // seq_cst, against the producer's wptr publish, seq_cst fence, then sleeping load
    while (nothing_to_do(r)) pthread_cond_wait(&r->cv, &r->m);
    atomic_store(&r->sleeping, 0);
    pthread_mutex_unlock(&r->m);
  }
}

// Run the words in the ring, under the consumer lock: by the ring's thread, or inline by a submitting thread while
// the ring's thread sleeps (no wake-up on the way to the GPU). Inline, a packet that would wait on the host (a WAIT
// nothing submitted can release yet, a POLL, a guarded COPY, an INDIRECT run, a command buffer still running) is left
// with the rest for the thread. Returns whether words are left.
static int consume(ring_t *r, int inline_mode) {
  uint64_t pkt[32];
  uint64_t rp = atomic_load_explicit(&r->rptr, memory_order_relaxed), w = atomic_load_explicit(&r->wptr, memory_order_acquire);
  r->inline_mode = inline_mode;
  if (failed(r->d)) poison_inflight(r);
  while (rp < w && !stopping(r)) {
    uint64_t n = hdr_words(r->words[rp & (r->cap - 1)]);
    if (n == 0 || n > 32 || rp + n > w) n = 1;  // (a bad header: run_packet refuses it)
    for (uint64_t i = 0; i < n; i++) pkt[i] = r->words[(rp + i) & (r->cap - 1)];
    if (failed(r->d)) { poison_inflight(r); drain_packet(r, pkt, n, 0); r->packets_seen++; }
    else if (run_packet(r, pkt, n, rp, 0) == WOULD_BLOCK) break;
    rp += n;
    atomic_store_explicit(&r->rptr, rp, memory_order_release);  // its words were copied out: the producer may reuse them
  }
  r->inline_mode = 0;
  if (!failed(r->d)) flush(r);
  if (!failed(r->d) && rp == w && ring_idle(r)) atomic_store_explicit(&r->packets_done, r->packets_seen, memory_order_release);  // (run on the host)
  if (failed(r->d)) { poison_inflight(r); atomic_store_explicit(&r->packets_done, r->packets_seen, memory_order_release); }
  return rp < w;
}

static void *ring_main(void *arg) {
  ring_t *r = arg;
  for (;;) {
    wait_for_words(r);
    if (stopping(r)) break;
    pthread_mutex_lock(&r->consume);
    consume(r, 0);
    settle(r);
    pthread_mutex_unlock(&r->consume);
  }
  return NULL;
}

// ---------------------------------------------------------------- exported: rings
EXPORT int hcq_vk_submit(void *ring, const uint64_t *words, uint64_t n, int64_t timeout_ns) {
  ring_t *r = ring;
  if (hcq_ring_too_big(r->cap, n)) return SUBMIT_TOO_BIG;
  if (stopping(r)) return SUBMIT_STOPPED;
  pthread_mutex_lock(&r->produce);
  if (stopping(r)) { pthread_mutex_unlock(&r->produce); return SUBMIT_STOPPED; }  // (a closed ring's words are gone)
  uint64_t w = hcq_ring_own_wptr(&r->wptr), t0 = 0;
  while (!hcq_ring_fits(r->cap, w, hcq_ring_rptr(&r->rptr), n)) {
    if (!t0) t0 = now_ns();
    if (stopping(r)) { pthread_mutex_unlock(&r->produce); return SUBMIT_STOPPED; }
    if ((int64_t)(now_ns() - t0) >= timeout_ns) { pthread_mutex_unlock(&r->produce); return SUBMIT_FULL; }
    sleep_ns(20000);
  }
  hcq_ring_copy_in(r->words, r->cap - 1, w, words, n);
  hcq_ring_publish(&r->wptr, w + n);  // (release)
  // The publish, then the seq_cst load of `sleeping`, against wait_for_words' seq_cst store of `sleeping`, then its
  // seq_cst load of wptr: this fence keeps the two in order, so one side sees the other's store (no lost wake-up).
  atomic_thread_fence(memory_order_seq_cst);
  int asleep = atomic_load(&r->sleeping);
  pthread_mutex_unlock(&r->produce);
  if (!asleep) return SUBMIT_OK;  // the ring's thread is awake: it takes the words
  // (not while a store hook is set: the batches it submits would finish with nobody to tell the hook)
  if (!r->d->no_inline && !hooked() && pthread_mutex_trylock(&r->consume) == 0) {
    int left = consume(r, 1);
    int pending = atomic_load(&r->pending);  // (a hook set meanwhile: the ring's thread tells it)
    pthread_mutex_unlock(&r->consume);
    if (!left && !pending) return SUBMIT_OK;
  }
  wake_ring(r);
  return SUBMIT_OK;
}

EXPORT uint64_t hcq_vk_rptr(void *ring) { return atomic_load_explicit(&((ring_t *)ring)->rptr, memory_order_acquire); }
EXPORT uint64_t hcq_vk_wptr(void *ring) { return atomic_load_explicit(&((ring_t *)ring)->wptr, memory_order_acquire); }

// What ring_state reports: rptr, wptr, packets done, position, then CUR_PKT_WORDS words of the packet running (the
// one the thread is blocked on, else the first of the oldest batch still running); position ~0 when idle.
EXPORT void hcq_vk_ring_state(void *ring, uint64_t *out) {
  ring_t *r = ring;
  uint64_t done = 0;
  vkGetSemaphoreCounterValue(r->d->dev, r->sem, &done);
  pthread_mutex_lock(&r->state);
  out[0] = atomic_load(&r->rptr); out[1] = atomic_load(&r->wptr); out[3] = ~0ull;
  uint64_t packets = atomic_load(&r->packets_done);  // (packets the host ran; batches that finished add theirs below)
  const batch_t *oldest = NULL;
  for (int i = 0; i < NBATCH; i++) {
    const batch_t *b = &r->b[i];
    if (!b->point || b->point > atomic_load(&r->submitted)) continue;
    if (b->point <= done) { if (b->packets_end > packets) packets = b->packets_end; }
    else if (!oldest || b->point < oldest->point) oldest = b;
  }
  out[2] = packets;
  const uint64_t *cur = r->is_blocked ? r->blocked : oldest ? oldest->first : NULL;
  if (cur) { out[3] = r->is_blocked ? r->blocked_pos : oldest->first_pos; memcpy(&out[4], cur, CUR_PKT_WORDS * 8); }
  pthread_mutex_unlock(&r->state);
}

static void destroy_ring(ring_t *r) {
  vkdev_t *d = r->d;
  for (int i = 0; i < NBATCH; i++) {
    if (r->b[i].dpool) vkDestroyDescriptorPool(d->dev, r->b[i].dpool, NULL);
    free(r->b[i].stores);
  }
  if (r->qpool) vkDestroyQueryPool(d->dev, r->qpool, NULL);
  if (r->pool) vkDestroyCommandPool(d->dev, r->pool, NULL);
  if (r->sem) vkDestroySemaphore(d->dev, r->sem, NULL);
  if (r->scratch_va) hcq_vk_free(d, r->scratch_va);
  free(r->words); free(r);
}

EXPORT int hcq_vk_ring_create(void *dev, int kind, int index, uint64_t words, void **out) {
  vkdev_t *d = dev;
  if (d->nrings == 64 || (words & (words - 1))) return EINVAL;
  ring_t *r = calloc(1, sizeof *r);
  if (!r || !(r->words = calloc(words, 8))) { free(r); return ENOMEM; }
  r->d = d; r->kind = kind; r->index = index; r->cap = words;
  pthread_mutex_init(&r->produce, NULL); pthread_mutex_init(&r->consume, NULL); pthread_mutex_init(&r->m, NULL); pthread_mutex_init(&r->state, NULL); pthread_cond_init(&r->cv, NULL);
  VkSemaphoreTypeCreateInfo st = {.sType = VK_STRUCTURE_TYPE_SEMAPHORE_TYPE_CREATE_INFO, .semaphoreType = VK_SEMAPHORE_TYPE_TIMELINE};
  VkSemaphoreCreateInfo sci = {.sType = VK_STRUCTURE_TYPE_SEMAPHORE_CREATE_INFO, .pNext = &st};
  VkCommandPoolCreateInfo pci = {.sType = VK_STRUCTURE_TYPE_COMMAND_POOL_CREATE_INFO, .flags = VK_COMMAND_POOL_CREATE_RESET_COMMAND_BUFFER_BIT,
                                 .queueFamilyIndex = d->family};
  VkQueryPoolCreateInfo qci = {.sType = VK_STRUCTURE_TYPE_QUERY_POOL_CREATE_INFO, .queryType = VK_QUERY_TYPE_TIMESTAMP, .queryCount = NBATCH * QPB};
  VkCommandBuffer cbs[NBATCH];
  VkCommandBufferAllocateInfo ai = {.sType = VK_STRUCTURE_TYPE_COMMAND_BUFFER_ALLOCATE_INFO, .level = VK_COMMAND_BUFFER_LEVEL_PRIMARY,
                                    .commandBufferCount = NBATCH};
  if (vkCreateSemaphore(d->dev, &sci, NULL, &r->sem) || vkCreateCommandPool(d->dev, &pci, NULL, &r->pool) ||
      vkCreateQueryPool(d->dev, &qci, NULL, &r->qpool) || (ai.commandPool = r->pool, vkAllocateCommandBuffers(d->dev, &ai, cbs))) {
    destroy_ring(r); return ENOMEM;
  }
  for (int i = 0; i < NBATCH; i++) r->b[i].cb = cbs[i];
  if (hcq_vk_alloc(d, 64, 1, &r->scratch_va, (void **)&r->scratch)) { destroy_ring(r); return ENOMEM; }
  int rc = pthread_create(&r->thr, NULL, ring_main, r);
  if (rc) { destroy_ring(r); return rc; }
  r->started = 1;
  pthread_mutex_lock(&d->lock); d->rings[d->nrings++] = r; pthread_mutex_unlock(&d->lock);
  *out = r;
  return 0;
}

// ---------------------------------------------------------------- exported: host waits and failure
// Wait until the signal at device address `va` reaches `value`, for at most timeout_ns: 0 reached, 1 not yet, 2 the
// device failed. Where a SIGNAL of it is in a submitted batch, the wait sleeps on that ring's semaphore (the way a
// plain Vulkan program waits); otherwise it reads the word, spinning briefly, then in growing naps.
EXPORT int hcq_vk_wait(void *dev, uint64_t va, uint64_t value, int64_t timeout_ns) {
  vkdev_t *d = dev; range_t rg;
  if (!find_range(d, va, 16, &rg) || !rg.host) return 2;
  _Atomic uint64_t *host = (_Atomic uint64_t *)(rg.host + (va - rg.va));
  uint64_t t0 = now_ns(), nap = 10000;
  for (;;) {
    if (atomic_load_explicit(host, memory_order_acquire) >= value) return 0;
    if (failed(d)) return 2;
    uint64_t el = now_ns() - t0;
    if ((int64_t)el >= timeout_ns) return 1;
    sigent_t e;
    if (sig_get(d, va, &e) && e.value >= value && e.point <= atomic_load_explicit(&e.ring->submitted, memory_order_acquire)) {
      uint64_t left = (uint64_t)timeout_ns - el;
      if (sem_wait(d, e.ring->sem, e.point, left < 20000000 ? left : 20000000) < 0) return 2;
      if (atomic_load_explicit(host, memory_order_acquire) >= value) return 0;
      if (sem_value(e.ring) >= e.point) sleep_ns(nap);  // (a stale entry: its batch ran, the value was since rewritten)
      continue;
    }
    // Nothing submitted stores the value yet (the ring thread is about to record it, or another device stores it):
    // yield for a while, then nap, the naps growing slowly up to 1 ms.
    if (el < 200000) sched_yield();
    else { sleep_ns(nap); if (nap < 1000000) nap += nap / 4; }
  }
}

EXPORT int hcq_vk_error(void *dev, char *buf, int len) {
  vkdev_t *d = dev;
  if (!failed(d)) return 0;
  pthread_mutex_lock(&d->lock); snprintf(buf, (size_t)len, "%s", d->err); pthread_mutex_unlock(&d->lock);
  return 1;
}
EXPORT uint32_t hcq_vk_id(void *dev) { return ((vkdev_t *)dev)->id; }
// The 4-byte word that is nonzero once the device failed (hcq serve mirrors it into the client).
EXPORT void *hcq_vk_failed_flag(void *dev) { return (void *)&((vkdev_t *)dev)->failed; }

// The device address of this device's own memory that the host maps at [host, host + n), or 0 (none: not its memory;
// host memory it imported is another's).
EXPORT uint64_t hcq_vk_address_of_host(void *dev, uint64_t host, uint64_t n) {
  vkdev_t *d = dev; uint64_t va = 0;
  pthread_mutex_lock(&d->lock);
  for (int i = 0; i < d->nranges && !va; i++) {
    const range_t *r = &d->ranges[i];
    uint64_t h = (uint64_t)(uintptr_t)r->host;
    if (h && !r->imported && host >= h && n <= r->size && host - h <= r->size - n) va = r->va + (host - h);
  }
  pthread_mutex_unlock(&d->lock);
  return va;
}
EXPORT void hcq_vk_inject_device_lost(void *dev, int64_t nth) { atomic_store(&((vkdev_t *)dev)->inject_lost, nth); }

// ---------------------------------------------------------------- exported: memory
static int find_type(vkdev_t *d, uint32_t bits, VkMemoryPropertyFlags want, VkMemoryPropertyFlags avoid) {
  VkPhysicalDeviceMemoryProperties mp; vkGetPhysicalDeviceMemoryProperties(d->phys, &mp);
  for (uint32_t i = 0; i < mp.memoryTypeCount; i++)
    if ((bits & (1u << i)) && (mp.memoryTypes[i].propertyFlags & want) == want && !(mp.memoryTypes[i].propertyFlags & avoid)) return (int)i;
  return -1;
}

static VkResult make_buffer(vkdev_t *d, uint64_t size, int external, VkBuffer *out) {
  VkExternalMemoryBufferCreateInfo ext = {.sType = VK_STRUCTURE_TYPE_EXTERNAL_MEMORY_BUFFER_CREATE_INFO,
                                          .handleTypes = VK_EXTERNAL_MEMORY_HANDLE_TYPE_HOST_ALLOCATION_BIT_EXT};
  VkBufferCreateInfo bi = {.sType = VK_STRUCTURE_TYPE_BUFFER_CREATE_INFO, .pNext = external ? &ext : NULL, .size = size,
                           .usage = VK_BUFFER_USAGE_STORAGE_BUFFER_BIT | VK_BUFFER_USAGE_TRANSFER_SRC_BIT | VK_BUFFER_USAGE_TRANSFER_DST_BIT |
                                    VK_BUFFER_USAGE_SHADER_DEVICE_ADDRESS_BIT,
                           .sharingMode = VK_SHARING_MODE_EXCLUSIVE};
  return vkCreateBuffer(d->dev, &bi, NULL, out);
}

// Bind `mem` to a new buffer over it and index the range; its device address goes to *va.
static VkResult bind_range(vkdev_t *d, VkDeviceMemory mem, uint64_t size, int external, uint8_t *host, int owned, uint64_t *va) {
  VkBuffer buf;
  VkResult rc = make_buffer(d, size, external, &buf);
  if (rc == VK_SUCCESS && (rc = vkBindBufferMemory(d->dev, buf, mem, 0)) != VK_SUCCESS) vkDestroyBuffer(d->dev, buf, NULL);
  if (rc != VK_SUCCESS) return rc;
  VkBufferDeviceAddressInfo ai = {.sType = VK_STRUCTURE_TYPE_BUFFER_DEVICE_ADDRESS_INFO, .buffer = buf};
  *va = vkGetBufferDeviceAddress(d->dev, &ai);
  if (add_range(d, (range_t){*va, size, buf, mem, host, owned, external})) { vkDestroyBuffer(d->dev, buf, NULL); return VK_ERROR_OUT_OF_HOST_MEMORY; }
  return VK_SUCCESS;
}

// `size` bytes of device memory (host-visible, mapped, when host_visible): 0, else a VkResult (negative).
EXPORT int hcq_vk_alloc(void *dev, uint64_t size, int host_visible, uint64_t *va, void **host) {
  vkdev_t *d = dev;
  VkMemoryAllocateFlagsInfo fi = {.sType = VK_STRUCTURE_TYPE_MEMORY_ALLOCATE_FLAGS_INFO, .flags = VK_MEMORY_ALLOCATE_DEVICE_ADDRESS_BIT};
  VkMemoryAllocateInfo ai = {.sType = VK_STRUCTURE_TYPE_MEMORY_ALLOCATE_INFO, .pNext = &fi, .allocationSize = size,
                             .memoryTypeIndex = host_visible ? d->host_type : d->device_type};
  VkDeviceMemory mem;
  VkResult rc = vkAllocateMemory(d->dev, &ai, NULL, &mem);
  if (rc != VK_SUCCESS) return rc;
  void *p = NULL;
  if (host_visible && (rc = vkMapMemory(d->dev, mem, 0, VK_WHOLE_SIZE, 0, &p)) != VK_SUCCESS) { vkFreeMemory(d->dev, mem, NULL); return rc; }
  if ((rc = bind_range(d, mem, size, 0, p, 1, va)) != VK_SUCCESS) { vkFreeMemory(d->dev, mem, NULL); return rc; }
  *host = p;
  return 0;
}

// Host memory [host, host + size) (aligned to the import alignment) as device memory: 0, else a VkResult.
EXPORT int hcq_vk_import_host(void *dev, void *host, uint64_t size, uint64_t *va) {
  vkdev_t *d = dev;
  if (!d->host_import) return VK_ERROR_EXTENSION_NOT_PRESENT;
  VkMemoryHostPointerPropertiesEXT hp = {.sType = VK_STRUCTURE_TYPE_MEMORY_HOST_POINTER_PROPERTIES_EXT};
  VkResult rc = d->host_ptr_props(d->dev, VK_EXTERNAL_MEMORY_HANDLE_TYPE_HOST_ALLOCATION_BIT_EXT, host, &hp);
  if (rc != VK_SUCCESS) return rc;
  int type = find_type(d, hp.memoryTypeBits, VK_MEMORY_PROPERTY_HOST_VISIBLE_BIT, 0);
  if (type < 0) return VK_ERROR_INVALID_EXTERNAL_HANDLE;
  VkImportMemoryHostPointerInfoEXT ii = {.sType = VK_STRUCTURE_TYPE_IMPORT_MEMORY_HOST_POINTER_INFO_EXT,
                                          .handleType = VK_EXTERNAL_MEMORY_HANDLE_TYPE_HOST_ALLOCATION_BIT_EXT, .pHostPointer = host};
  VkMemoryAllocateFlagsInfo fi = {.sType = VK_STRUCTURE_TYPE_MEMORY_ALLOCATE_FLAGS_INFO, .pNext = &ii, .flags = VK_MEMORY_ALLOCATE_DEVICE_ADDRESS_BIT};
  VkMemoryAllocateInfo ai = {.sType = VK_STRUCTURE_TYPE_MEMORY_ALLOCATE_INFO, .pNext = &fi, .allocationSize = size, .memoryTypeIndex = (uint32_t)type};
  VkDeviceMemory mem;
  if ((rc = vkAllocateMemory(d->dev, &ai, NULL, &mem)) != VK_SUCCESS) return rc;
  if ((rc = bind_range(d, mem, size, 1, host, 1, va)) != VK_SUCCESS) { vkFreeMemory(d->dev, mem, NULL); return rc; }
  return 0;
}

EXPORT void hcq_vk_free(void *dev, uint64_t va) {
  vkdev_t *d = dev;
  pthread_mutex_lock(&d->lock);
  int i = range_index(d, va);
  range_t r = {0};
  if (i >= 0 && d->ranges[i].va == va) { r = d->ranges[i]; memmove(&d->ranges[i], &d->ranges[i + 1], (size_t)(d->nranges - i - 1) * sizeof r); d->nranges--; }
  int last = d->closed && d->nranges == 0;
  pthread_mutex_unlock(&d->lock);
  if (r.buf) vkDestroyBuffer(d->dev, r.buf, NULL);
  if (r.mem && r.owned) vkFreeMemory(d->dev, r.mem, NULL);
  if (last) destroy_device(d);
}

// ---------------------------------------------------------------- exported: programs
static void free_program(vkdev_t *d, prog_t *p) {
  if (p->layout && p->layout != d->layout) vkDestroyPipelineLayout(d->dev, p->layout, NULL);
  if (p->dsl) vkDestroyDescriptorSetLayout(d->dev, p->dsl, NULL);
  if (p->mod) vkDestroyShaderModule(d->dev, p->mod, NULL);
  free(p);
}

// The pipeline layout of a kernel whose parameters are `nbind` storage-buffer bindings (numbers in `binding`) and a
// push constant block of `push_size` bytes: 0, else -1 with the reason in err.
// A closed device whose last range was freed: its programs, layout, VkDevice and instance go (lavapipe's threads with them).
static void destroy_device(vkdev_t *d) {
  for (uint32_t i = 0; i < d->nprogs; i++) {
    prog_t *p = d->progs[i];
    for (int k = 0; k < p->npipes; k++) vkDestroyPipeline(d->dev, p->pipes[k].p, NULL);
    free_program(d, p);
  }
  free(d->progs);
  free(d->ranges);
  if (d->layout) vkDestroyPipelineLayout(d->dev, d->layout, NULL);
  vkDestroyDevice(d->dev, NULL);
  vkDestroyInstance(d->inst, NULL);
  pthread_mutex_destroy(&d->qlock[0]); pthread_mutex_destroy(&d->qlock[1]); pthread_mutex_destroy(&d->lock); pthread_mutex_destroy(&d->report_lock);
  free(d);
}

static int pushed_layout(vkdev_t *d, prog_t *p, uint32_t nbind, const uint32_t *binding, uint32_t push_size, char *err, int len) {
  const VkPhysicalDeviceLimits *lim = &d->props.limits;
  if (nbind > MAX_BINDINGS || nbind > lim->maxPerStageDescriptorStorageBuffers || nbind > lim->maxDescriptorSetStorageBuffers) {
    snprintf(err, (size_t)len, "it has %u storage-buffer bindings; hcq binds at most %u here (the device: %u per stage)", nbind, MAX_BINDINGS,
             lim->maxPerStageDescriptorStorageBuffers);
    return -1;
  }
  if (push_size > lim->maxPushConstantsSize || push_size % 4) {
    snprintf(err, (size_t)len, "its push constant block is %u bytes; the device takes at most %u", push_size, lim->maxPushConstantsSize);
    return -1;
  }
  VkDescriptorSetLayoutBinding lb[MAX_BINDINGS];
  for (uint32_t i = 0; i < nbind; i++) lb[i] = (VkDescriptorSetLayoutBinding){binding[i], VK_DESCRIPTOR_TYPE_STORAGE_BUFFER, 1, VK_SHADER_STAGE_COMPUTE_BIT, NULL};
  VkDescriptorSetLayoutCreateInfo dci = {.sType = VK_STRUCTURE_TYPE_DESCRIPTOR_SET_LAYOUT_CREATE_INFO, .bindingCount = nbind, .pBindings = lb};
  VkResult rc = nbind ? vkCreateDescriptorSetLayout(d->dev, &dci, NULL, &p->dsl) : VK_SUCCESS;
  VkPushConstantRange pc = {VK_SHADER_STAGE_COMPUTE_BIT, 0, push_size};
  VkPipelineLayoutCreateInfo lci = {.sType = VK_STRUCTURE_TYPE_PIPELINE_LAYOUT_CREATE_INFO, .setLayoutCount = nbind ? 1 : 0, .pSetLayouts = &p->dsl,
                                    .pushConstantRangeCount = push_size ? 1 : 0, .pPushConstantRanges = &pc};
  if (rc == VK_SUCCESS) rc = vkCreatePipelineLayout(d->dev, &lci, NULL, &p->layout);
  if (rc != VK_SUCCESS) { snprintf(err, (size_t)len, "cannot create its pipeline layout: %s", vk_result_name(rc)); return -1; }
  p->pushed = 1; p->nbind = nbind; p->push_size = push_size;
  memcpy(p->binding, binding, nbind * sizeof *binding);
  p->sizes_offset = 8 * nbind + (push_size + 7) / 8 * 8;
  return 0;
}

// Load SPIR-V as kernel `name`: its entry word (>= 1), or 0 with the reason in err. `local` != NULL: the kernel
// fixes its local size (else the launch's local size specialises constants 0, 1, 2). `pushed`: its parameters are
// `nbind` storage-buffer bindings (numbers in `binding`, in the order of its buffer parameters) and a push constant
// block of `push_size` bytes (else an argument struct whose address is the one push constant).
EXPORT uint64_t hcq_vk_program(void *dev, const uint32_t *code, uint64_t nbytes, const char *name, const uint32_t *local, int pushed,
                               uint32_t nbind, const uint32_t *binding, uint32_t push_size, char *err, int len) {
  vkdev_t *d = dev;
  prog_t *p = calloc(1, sizeof *p);
  if (!p) { snprintf(err, (size_t)len, "out of memory"); return 0; }
  p->layout = d->layout;
  if (pushed && pushed_layout(d, p, nbind, binding, push_size, err, len)) { free_program(d, p); return 0; }
  VkShaderModuleCreateInfo ci = {.sType = VK_STRUCTURE_TYPE_SHADER_MODULE_CREATE_INFO, .codeSize = nbytes, .pCode = code};
  VkResult rc = vkCreateShaderModule(d->dev, &ci, NULL, &p->mod);
  if (rc != VK_SUCCESS) { snprintf(err, (size_t)len, "vkCreateShaderModule failed: %s", vk_result_name(rc)); free_program(d, p); return 0; }
  snprintf(p->name, sizeof p->name, "%s", name);
  if (local) { p->fixed = 1; memcpy(p->local, local, sizeof p->local); }
  pthread_mutex_lock(&d->lock);
  if (d->nprogs == d->pcap) {
    uint32_t cap = d->pcap ? 2 * d->pcap : 64;
    prog_t **n = realloc(d->progs, cap * sizeof *n);
    if (!n) { pthread_mutex_unlock(&d->lock); free_program(d, p); snprintf(err, (size_t)len, "out of memory"); return 0; }
    d->progs = n; d->pcap = cap;
  }
  d->progs[d->nprogs++] = p;
  uint64_t entry = d->nprogs;
  pthread_mutex_unlock(&d->lock);
  return entry;
}

// ---------------------------------------------------------------- exported: the device
static const char *const wanted_exts[] = {VK_EXT_EXTERNAL_MEMORY_HOST_EXTENSION_NAME};

// Open physical device `index` (force_device_memory: user memory is never host-visible, as on a discrete GPU).
// Returns the device, or NULL with the reason in err.
EXPORT void *hcq_vk_open(int index, int force_device_memory, char *err, int len) {
  vkdev_t *d = calloc(1, sizeof *d);
  if (!d) { snprintf(err, (size_t)len, "out of memory"); return NULL; }
  pthread_mutex_init(&d->qlock[0], NULL); pthread_mutex_init(&d->qlock[1], NULL); pthread_mutex_init(&d->lock, NULL); pthread_mutex_init(&d->report_lock, NULL);
  VkApplicationInfo app = {.sType = VK_STRUCTURE_TYPE_APPLICATION_INFO, .pApplicationName = "hcq", .apiVersion = VK_API_VERSION_1_2};
  VkInstanceCreateInfo ici = {.sType = VK_STRUCTURE_TYPE_INSTANCE_CREATE_INFO, .pApplicationInfo = &app};
  VkResult rc = vkCreateInstance(&ici, NULL, &d->inst);
  if (rc != VK_SUCCESS) { snprintf(err, (size_t)len, "vkCreateInstance failed: %s (no Vulkan driver?)", vk_result_name(rc)); free(d); return NULL; }
  uint32_t n = 0; vkEnumeratePhysicalDevices(d->inst, &n, NULL);
  VkPhysicalDevice phys[16]; if (n > 16) n = 16;
  vkEnumeratePhysicalDevices(d->inst, &n, phys);
  if (index < 0 || (uint32_t)index >= n) { snprintf(err, (size_t)len, "no Vulkan device %d (the driver reports %u)", index, n); goto fail_inst; }
  d->phys = phys[index];
  vkGetPhysicalDeviceProperties(d->phys, &d->props);
  if (d->props.apiVersion < VK_API_VERSION_1_2) { snprintf(err, (size_t)len, "%s supports Vulkan %u.%u; hcq needs 1.2", d->props.deviceName,
                                                           VK_API_VERSION_MAJOR(d->props.apiVersion), VK_API_VERSION_MINOR(d->props.apiVersion)); goto fail_inst; }
  VkPhysicalDeviceVulkan12Features f12 = {.sType = VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_VULKAN_1_2_FEATURES};
  VkPhysicalDeviceVulkan11Features f11 = {.sType = VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_VULKAN_1_1_FEATURES, .pNext = &f12};
  VkPhysicalDeviceFeatures2 f2 = {.sType = VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_FEATURES_2, .pNext = &f11};
  vkGetPhysicalDeviceFeatures2(d->phys, &f2);
  if (!f12.timelineSemaphore || !f12.bufferDeviceAddress || !f2.features.shaderInt64) {
    snprintf(err, (size_t)len, "%s lacks what hcq needs: timelineSemaphore %d, bufferDeviceAddress %d, shaderInt64 %d", d->props.deviceName,
             f12.timelineSemaphore, f12.bufferDeviceAddress, f2.features.shaderInt64);
    goto fail_inst;
  }
  // Features kernels may use, enabled where the device has them; the rest off.
  VkPhysicalDeviceVulkan12Features e12 = {.sType = VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_VULKAN_1_2_FEATURES, .timelineSemaphore = 1,
    .bufferDeviceAddress = 1, .shaderInt8 = f12.shaderInt8, .shaderFloat16 = f12.shaderFloat16, .storageBuffer8BitAccess = f12.storageBuffer8BitAccess,
    .vulkanMemoryModel = f12.vulkanMemoryModel, .vulkanMemoryModelDeviceScope = f12.vulkanMemoryModelDeviceScope};
  VkPhysicalDeviceVulkan11Features e11 = {.sType = VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_VULKAN_1_1_FEATURES, .pNext = &e12,
    .storageBuffer16BitAccess = f11.storageBuffer16BitAccess};
  VkPhysicalDeviceFeatures2 e2 = {.sType = VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_FEATURES_2, .pNext = &e11,
    .features = {.shaderInt64 = 1, .shaderFloat64 = f2.features.shaderFloat64, .shaderInt16 = f2.features.shaderInt16}};
  // One queue of the first family with compute (timestamps where the family has them).
  uint32_t nf = 0; vkGetPhysicalDeviceQueueFamilyProperties(d->phys, &nf, NULL);
  VkQueueFamilyProperties fams[32]; if (nf > 32) nf = 32;
  vkGetPhysicalDeviceQueueFamilyProperties(d->phys, &nf, fams);
  d->family = UINT32_MAX;
  for (uint32_t i = 0; i < nf; i++) if ((fams[i].queueFlags & VK_QUEUE_COMPUTE_BIT) && fams[i].timestampValidBits) { d->family = i; break; }
  if (d->family == UINT32_MAX) { snprintf(err, (size_t)len, "%s has no compute queue with timestamps", d->props.deviceName); goto fail_inst; }
  uint32_t ne = 0; vkEnumerateDeviceExtensionProperties(d->phys, NULL, &ne, NULL);
  VkExtensionProperties *exts = calloc(ne ? ne : 1, sizeof *exts);
  if (exts) vkEnumerateDeviceExtensionProperties(d->phys, NULL, &ne, exts);
  for (uint32_t i = 0; exts && i < ne; i++) if (!strcmp(exts[i].extensionName, wanted_exts[0])) d->host_import = 1;
  free(exts);
  float prio[2] = {1.0f, 1.0f};
  d->nqueues = fams[d->family].queueCount > 1 ? 2 : 1;
  VkDeviceQueueCreateInfo qci = {.sType = VK_STRUCTURE_TYPE_DEVICE_QUEUE_CREATE_INFO, .queueFamilyIndex = d->family, .queueCount = d->nqueues, .pQueuePriorities = prio};
  VkDeviceCreateInfo dci = {.sType = VK_STRUCTURE_TYPE_DEVICE_CREATE_INFO, .pNext = &e2, .queueCreateInfoCount = 1, .pQueueCreateInfos = &qci,
                            .enabledExtensionCount = d->host_import ? 1 : 0, .ppEnabledExtensionNames = wanted_exts};
  if ((rc = vkCreateDevice(d->phys, &dci, NULL, &d->dev)) != VK_SUCCESS) { snprintf(err, (size_t)len, "vkCreateDevice failed: %s", vk_result_name(rc)); goto fail_inst; }
  for (uint32_t i = 0; i < d->nqueues; i++) vkGetDeviceQueue(d->dev, d->family, i, &d->queues[i]);
  d->host_is_device = d->props.deviceType == VK_PHYSICAL_DEVICE_TYPE_CPU;
  if (d->host_import) {
    d->host_ptr_props = (PFN_vkGetMemoryHostPointerPropertiesEXT)vkGetDeviceProcAddr(d->dev, "vkGetMemoryHostPointerPropertiesEXT");
    VkPhysicalDeviceExternalMemoryHostPropertiesEXT hp = {.sType = VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_EXTERNAL_MEMORY_HOST_PROPERTIES_EXT};
    VkPhysicalDeviceProperties2 p2 = {.sType = VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_PROPERTIES_2, .pNext = &hp};
    vkGetPhysicalDeviceProperties2(d->phys, &p2);
    d->import_align = hp.minImportedHostPointerAlignment;
    if (!d->host_ptr_props) d->host_import = 0;
  }
  // Memory types: runtime state wants host-visible coherent memory (host-cached where there is some); user memory
  // device-local, non-host-visible where the device has such (or when forced).
  VkBuffer probe;
  if ((rc = make_buffer(d, 4096, 0, &probe)) != VK_SUCCESS) { snprintf(err, (size_t)len, "vkCreateBuffer failed: %s", vk_result_name(rc)); goto fail_dev; }
  VkMemoryRequirements req; vkGetBufferMemoryRequirements(d->dev, probe, &req);
  vkDestroyBuffer(d->dev, probe, NULL);
  const VkMemoryPropertyFlags hv = VK_MEMORY_PROPERTY_HOST_VISIBLE_BIT | VK_MEMORY_PROPERTY_HOST_COHERENT_BIT;
  int ht = find_type(d, req.memoryTypeBits, hv | VK_MEMORY_PROPERTY_HOST_CACHED_BIT, 0);
  if (ht < 0) ht = find_type(d, req.memoryTypeBits, hv, 0);
  int dt = find_type(d, req.memoryTypeBits, VK_MEMORY_PROPERTY_DEVICE_LOCAL_BIT, VK_MEMORY_PROPERTY_HOST_VISIBLE_BIT);
  if (dt < 0 && !force_device_memory) dt = find_type(d, req.memoryTypeBits, VK_MEMORY_PROPERTY_DEVICE_LOCAL_BIT, 0);
  if (dt < 0) dt = find_type(d, req.memoryTypeBits, 0, 0);
  if (ht < 0 || dt < 0) { snprintf(err, (size_t)len, "%s has no host-visible coherent memory type for buffers", d->props.deviceName); goto fail_dev; }
  d->host_type = (uint32_t)ht; d->device_type = (uint32_t)dt;
  VkPushConstantRange pc = {VK_SHADER_STAGE_COMPUTE_BIT, 0, 8};
  VkPipelineLayoutCreateInfo lci = {.sType = VK_STRUCTURE_TYPE_PIPELINE_LAYOUT_CREATE_INFO, .pushConstantRangeCount = 1, .pPushConstantRanges = &pc};
  if ((rc = vkCreatePipelineLayout(d->dev, &lci, NULL, &d->layout)) != VK_SUCCESS) { snprintf(err, (size_t)len, "vkCreatePipelineLayout failed: %s", vk_result_name(rc)); goto fail_dev; }
  d->id = atomic_fetch_add(&next_dev_id, 1);
  const char *inl = getenv("HCQ_VK_INLINE");
  d->no_inline = inl && !strcmp(inl, "0");
  return d;
fail_dev:
  vkDestroyDevice(d->dev, NULL);
fail_inst:
  vkDestroyInstance(d->inst, NULL);
  free(d);
  return NULL;
}

// What Python reads of the device: [host-visible memory is what user buffers get (0/1), host import (0/1), import
// alignment, timestamp period as float bits, timestamp valid bits, max group count x3, max group size x3, max
// invocations, vendor id, device id, API version, hardware queues used, CPU-type device, minStorageBufferOffsetAlignment,
// maxStorageBufferRange].
EXPORT void hcq_vk_info(void *dev, uint64_t *out, char *name, int len) {
  vkdev_t *d = dev;
  VkPhysicalDeviceMemoryProperties mp; vkGetPhysicalDeviceMemoryProperties(d->phys, &mp);
  out[0] = (mp.memoryTypes[d->device_type].propertyFlags & VK_MEMORY_PROPERTY_HOST_VISIBLE_BIT) != 0;
  out[1] = (uint64_t)d->host_import; out[2] = d->import_align;
  float period = d->props.limits.timestampPeriod; uint32_t bits; memcpy(&bits, &period, 4); out[3] = bits;
  uint32_t nf = 0; vkGetPhysicalDeviceQueueFamilyProperties(d->phys, &nf, NULL);
  VkQueueFamilyProperties fams[32]; if (nf > 32) nf = 32;
  vkGetPhysicalDeviceQueueFamilyProperties(d->phys, &nf, fams);
  out[4] = fams[d->family].timestampValidBits;
  for (int i = 0; i < 3; i++) { out[5 + i] = d->props.limits.maxComputeWorkGroupCount[i]; out[8 + i] = d->props.limits.maxComputeWorkGroupSize[i]; }
  out[11] = d->props.limits.maxComputeWorkGroupInvocations;
  out[12] = d->props.vendorID; out[13] = d->props.deviceID; out[14] = d->props.apiVersion;
  out[15] = d->nqueues; out[16] = (uint64_t)d->host_is_device;
  out[17] = d->props.limits.minStorageBufferOffsetAlignment; out[18] = d->props.limits.maxStorageBufferRange;
  snprintf(name, (size_t)len, "%s", d->props.deviceName);
}

// Stop the rings' threads (queued work is abandoned). Objects stay: the process is ending, or the device failed.
EXPORT void hcq_vk_stop(void *dev) {
  vkdev_t *d = dev;
  for (int i = 0; i < d->nrings; i++) { atomic_store(&d->rings[i]->stop, 1); wake_ring(d->rings[i]); }
  for (int i = 0; i < d->nrings; i++) if (d->rings[i]->started) { pthread_join(d->rings[i]->thr, NULL); d->rings[i]->started = 0; }
}

// Wait until everything the device's rings submitted has finished: 0, or 1 after timeout_ns (a kernel still runs), -1
// when the device is lost.
EXPORT int hcq_vk_wait_idle(void *dev, int64_t timeout_ns) {
  vkdev_t *d = dev;
  uint64_t t0 = now_ns();
  for (int i = 0; i < d->nrings; i++) {
    ring_t *r = d->rings[i];
    uint64_t last = atomic_load_explicit(&r->submitted, memory_order_acquire), spent = now_ns() - t0;
    if (!last || !r->sem) continue;
    int rc = sem_wait(d, r->sem, last, (int64_t)spent < timeout_ns ? (uint64_t)timeout_ns - spent : 0);
    if (rc) return rc;
  }
  return 0;
}

// dev.close(): stop the rings, wait for the device, and give back what the rings hold; each ring itself stays, stopped,
// as a tombstone (a host thread that read its handle before may still call hcq_vk_submit, which answers
// SUBMIT_STOPPED). The device goes once its last range (memory Python still holds) is freed: now, or in hcq_vk_free.
EXPORT void hcq_vk_close(void *dev) {
  vkdev_t *d = dev;
  hcq_vk_stop(d);
  vkDeviceWaitIdle(d->dev);
  for (int i = 0; i < d->nrings; i++) {
    ring_t *r = d->rings[i];
    pthread_mutex_lock(&r->produce); pthread_mutex_lock(&r->consume);  // (no host thread is inside either)
    if (r->sem && !failed(d)) report_finished(r);  // (what the batches that ran stored, to the hook: the device is idle)
    for (int b = 0; b < NBATCH; b++) {
      if (r->b[b].dpool) vkDestroyDescriptorPool(d->dev, r->b[b].dpool, NULL), r->b[b].dpool = VK_NULL_HANDLE;
      free(r->b[b].stores);
      r->b[b].stores = NULL, r->b[b].nstores = r->b[b].stores_cap = 0;
    }
    atomic_store_explicit(&r->pending, 0, memory_order_relaxed);
    if (r->qpool) vkDestroyQueryPool(d->dev, r->qpool, NULL);
    if (r->pool) vkDestroyCommandPool(d->dev, r->pool, NULL);
    if (r->sem) vkDestroySemaphore(d->dev, r->sem, NULL);
    if (r->scratch_va) hcq_vk_free(d, r->scratch_va);
    r->qpool = VK_NULL_HANDLE, r->pool = VK_NULL_HANDLE, r->sem = VK_NULL_HANDLE, r->scratch_va = 0, r->scratch = NULL;
    free(r->words);
    r->words = NULL;
    pthread_mutex_unlock(&r->consume); pthread_mutex_unlock(&r->produce);
  }
  d->nrings = 0;
  pthread_mutex_lock(&d->lock);
  d->closed = 1;
  int last = d->nranges == 0;
  pthread_mutex_unlock(&d->lock);
  if (last) destroy_device(d);
}

// How many Vulkan devices the driver reports (-1 with the reason in err when there is no usable driver).
EXPORT int hcq_vk_count(char *err, int len) {
  VkApplicationInfo app = {.sType = VK_STRUCTURE_TYPE_APPLICATION_INFO, .pApplicationName = "hcq", .apiVersion = VK_API_VERSION_1_2};
  VkInstanceCreateInfo ici = {.sType = VK_STRUCTURE_TYPE_INSTANCE_CREATE_INFO, .pApplicationInfo = &app};
  VkInstance inst;
  VkResult rc = vkCreateInstance(&ici, NULL, &inst);
  if (rc != VK_SUCCESS) { snprintf(err, (size_t)len, "vkCreateInstance failed: %s (no Vulkan driver installed?)", vk_result_name(rc)); return -1; }
  uint32_t n = 0;
  vkEnumeratePhysicalDevices(inst, &n, NULL);
  vkDestroyInstance(inst, NULL);
  if (!n) snprintf(err, (size_t)len, "the Vulkan loader found no device (install a driver: mesa-vulkan-drivers gives lavapipe)");
  return (int)n;
}

// The name of device `index` (for HCQ_VK_DEVICE=<part of a name>): 0, or -1.
EXPORT int hcq_vk_name(int index, char *name, int len) {
  VkApplicationInfo app = {.sType = VK_STRUCTURE_TYPE_APPLICATION_INFO, .pApplicationName = "hcq", .apiVersion = VK_API_VERSION_1_2};
  VkInstanceCreateInfo ici = {.sType = VK_STRUCTURE_TYPE_INSTANCE_CREATE_INFO, .pApplicationInfo = &app};
  VkInstance inst;
  if (vkCreateInstance(&ici, NULL, &inst) != VK_SUCCESS) return -1;
  uint32_t n = 0; VkPhysicalDevice phys[16];
  vkEnumeratePhysicalDevices(inst, &n, NULL); if (n > 16) n = 16;
  vkEnumeratePhysicalDevices(inst, &n, phys);
  int rc = -1;
  if (index >= 0 && (uint32_t)index < n) {
    VkPhysicalDeviceProperties p; vkGetPhysicalDeviceProperties(phys[index], &p);
    snprintf(name, (size_t)len, "%s", p.deviceName); rc = 0;
  }
  vkDestroyInstance(inst, NULL);
  return rc;
}
