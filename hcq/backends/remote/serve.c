// hcq's remote server, the part that runs without Python: the handlers of the hot messages (SUBMIT and STORE,
// dispatched by the network engine on the thread that progressed it) and the store hook that mirrors what packets
// store into memory a client reads (its signals, its staging buffers, its device's failure word) into that client;
// and, in the client, the handler of those PUSH messages.
//
// Memory a client reads and writes through the host (the runtime memory of its device: signals, kernargs,
// staging, bound queue words) exists twice: in the client (where the host reads and writes it) and here (where
// the command processor does). A mirror is one such range: server [start, end) <-> client address.
//   client -> server: a SUBMIT carries, before the packet words, the bytes of the mirrored ranges its packets read
//     (kernargs, copy sources, bound words), copied into place before the words are published to the ring (whose
//     release store of wptr orders them); a STORE sets a signal as the host would (poison cleared, sleepers woken).
//   server -> client: cp.c calls the store hook after a SIGNAL, TIMESTAMP, WRITE or COPY stored into memory, on the
//     queue thread, in ring order. For a range in a mirror the hook sends a PUSH with the bytes; the client's handler
//     copies them, and for a signal stores the timestamp, then the value with a release store, and wakes sleepers.
//     The engine delivers the messages of a connection in the order they were sent (and the client handles them in
//     that order), so a client that sees a signal's value sees everything the ring stored before it.
// Shared mirrors (client and server on one host): the range exists once, the client's memfd mapped here too. The
// hook then sends nothing for it (but copies the failure word into the client's status page, and WAKEs a client
// that counts sleepers); a SUBMIT carries no bytes of it; a STORE only wakes. docs/design.md, "Shared runtime memory".
// Beyond the client, a range may be forwarded: pushed as well to another destination (another server's memory over a
// link connection, or, in a client, a server's memory: what a local device stores into an exported range). A
// forward is a signal replica (16 bytes some device of another peer group waits on) or a window (memory a copy engine
// writes into as if it were the destination buffer elsewhere: its bytes are pushed, then its pages dropped). The
// receiving side accepts pushes from a connection only into ranges its client accepted for it (accepts).
// (Messages, not one-sided puts: on machines where UCX can register no memory for shared-memory RMA, puts go over
// TCP loopback and a store after them needs a flush round trip; messages go over shared memory.)
// This file is compiled after net.c, in the same library (it uses only net.c's hn_* API).
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

// Generated at build: the packet format (hcq.packets: FLAG_SIGNAL, POISON_MASK, POISON_TAG, ...) with cp.c's shared
// enums, and the protocol (hcq.backends.remote.protocol: the message types HS_SUBMIT, HS_STORE, HS_PUSH, HS_WAKE (server ->
// client: a signal in shared memory changed while the client had sleepers), HS_SYNC (server -> client request,
// answered once the messages sent before it are applied), the STORE flags, HS_RING_WORDS, the client's HS_SUBMIT_* statuses).
#include "hcq_shared.h"
#include "hcq_protocol.h"

#define HS_FORWARD_WINDOW 1  // a forward's flags: the range is a window (its pages are dropped once pushed)
#define HS_PUSH_CHUNK (4u << 20)  // pushes of more bytes go as several messages (bounded copies)
#define HS_PUT_WAIT_MS 30000      // a window's put, flushed

typedef int (*hs_cp_submit_t)(void *ring, const uint64_t *words, uint64_t n, int64_t timeout_ns);
typedef void (*hs_cp_store_t)(void *addr, uint64_t value);
typedef void (*hs_cp_poison_t)(void *addr, uint64_t value, uint32_t id);
typedef uint64_t (*hs_cp_rptr_t)(void *ring);
#define HS_SUBMIT_ONE_WAY 1  // SUBMIT flag: sent without waiting for an answer (the client knows the ring has room)

// A mirror: server [start, end) <-> client address. `mapped` (a shared mirror, where client and server share a host):
// the client's memory is mapped here too, at `mapped` (== start for runtime memory, which then exists once), and
// `sleepers` is the client's count of threads asleep on such memory (in its status page, mapped here as well).
typedef struct { uint64_t start, end, client; int conn; uint64_t mapped; _Atomic uint64_t *sleepers; } hs_mirror_t;
typedef struct { void *ring; int conn; int32_t refused; } hs_ring_t;  // refused: -2 once a one-way SUBMIT failed (sticky)
// A forward: [start, end) is also pushed to `dest` over connection `conn` of engine `net` (NULL: the table's), or,
// for a window with `rkey` >= 0 (the destination registered its memory), put there and flushed;
// `owner` is the connection (of the table's engine) whose client asked for it. An accept: `conn` may push into
// [start, end), as `owner`'s client allowed; a poisoned signal value it pushes there (stored by a failed device over
// there, whose id means nothing here) is stored poisoned with `poison_id`, a name the receiving process gave that source.
typedef struct { uint64_t start, end, dest; void *net; int conn, owner; uint32_t flags; int rkey; } hs_forward_t;
typedef struct { uint64_t start, end; int conn, owner; uint32_t poison_id; } hs_accept_t;  // refused: -2 once a one-way SUBMIT failed (sticky)

typedef struct {
  void *net;
  hs_cp_submit_t submit;
  hs_cp_store_t store;
  hs_cp_rptr_t rptr;
  hs_cp_poison_t poison;  // cp.c's hcq_signal_poison (see hs_set_poison)
  // Mirrors (sorted by start, disjoint) and rings (by id; ring NULL: free slot). Changed by the server's Python
  // thread under the write lock; read by queue threads (the hook) and the progress thread (the handlers).
  pthread_rwlock_t lock;
  hs_mirror_t *mirrors;
  size_t nmirrors, mirror_cap;
  hs_ring_t *rings;
  size_t nrings;
  hs_forward_t *forwards;  // few (replicas and windows): scanned whole
  size_t nforwards;
  hs_accept_t *accepts;
  size_t naccepts;
  int *shared_conns;  // connections of clients that share memory with this process (see hs_mirror_add_shared)
  size_t nshared;
  // Device memory a connection may write with placements (hn_place: bulk copyin), sorted and disjoint; and the
  // placements under way (bytes UCX is still writing), which a range's removal waits out. landing_mu guards `landing`.
  hs_mirror_t *places;
  size_t nplaces, place_cap;
  pthread_mutex_t landing_mu;
  hs_mirror_t *landing;
  size_t nlanding, landing_cap;
  // Held from reading a stored range to sending it: two queue threads pushing the same signal (the timeline) must
  // send in the order they read it, or an older value could reach the client after a newer one.
  pthread_mutex_t push_lock;
} hs_t;

#ifndef EXPORT
#define EXPORT __attribute__((visibility("default")))
#endif

EXPORT void *hs_create(void *net, void *submit, void *store, void *rptr) {
  hs_t *s = calloc(1, sizeof *s);
  if (!s) return NULL;
  s->net = net; s->submit = (hs_cp_submit_t)submit; s->store = (hs_cp_store_t)store; s->rptr = (hs_cp_rptr_t)rptr;
  // Readers first: a hook holds the read lock while it waits for UCX's worker lock, whose holder (a handler, on the
  // progress thread) may ask for the read lock in turn; a waiting writer must not stop it from getting it.
  pthread_rwlockattr_t attr;
  pthread_rwlockattr_init(&attr);
  pthread_rwlockattr_setkind_np(&attr, PTHREAD_RWLOCK_PREFER_READER_NP);
  pthread_rwlock_init(&s->lock, &attr);
  pthread_rwlockattr_destroy(&attr);
  pthread_mutex_init(&s->push_lock, NULL);
  pthread_mutex_init(&s->landing_mu, NULL);
  return s;
}

// The local command processor's poisoned store (hcq_signal_poison): it also makes its queues check for poison.
EXPORT void hs_set_poison(void *sp, void *poison) { ((hs_t *)sp)->poison = (hs_cp_poison_t)poison; }

EXPORT void hs_destroy(void *sp) {
  hs_t *s = sp;
  if (!s) return;
  pthread_rwlock_destroy(&s->lock);
  pthread_mutex_destroy(&s->push_lock);
  pthread_mutex_destroy(&s->landing_mu);
  free(s->places); free(s->landing);
  free(s->mirrors); free(s->rings); free(s->forwards); free(s->accepts); free(s->shared_conns); free(s);
}

// cp.c's idle hook (hcq_set_idle_hook): an idle queue thread progresses the server's engine (hn_lend).
EXPORT int hs_idle_hook(void *sp, int idle, int64_t since) { return hn_lend(((hs_t *)sp)->net, idle, since); }

// Tables of ranges sorted by start and disjoint (the mirrors here; a client executor's ranges below): the index of
// the range that contains addr, or -1; adding one (-1: it overlaps one, or out of memory); removing the one at start.
static long find_range(const hs_mirror_t *r, size_t n, uint64_t addr) {
  size_t lo = 0, hi = n;
  while (lo < hi) {
    size_t mid = (lo + hi) / 2;
    if (r[mid].end <= addr) lo = mid + 1; else hi = mid;
  }
  return lo < n && r[lo].start <= addr ? (long)lo : -1;
}
static int add_range(hs_mirror_t **r, size_t *n, size_t *cap, hs_mirror_t item) {
  size_t i = 0;
  while (i < *n && (*r)[i].end <= item.start) i++;
  if (i < *n && (*r)[i].start < item.end) return -1;  // overlaps
  if (*n == *cap) {
    size_t c = *cap ? 2 * *cap : 64;
    hs_mirror_t *m = realloc(*r, c * sizeof *m);
    if (!m) return -1;
    *r = m; *cap = c;
  }
  memmove(&(*r)[i + 1], &(*r)[i], (*n - i) * sizeof **r);
  (*r)[i] = item;
  (*n)++;
  return 0;
}
static int remove_range(hs_mirror_t *r, size_t *n, uint64_t start) {
  long i = find_range(r, *n, start);
  if (i < 0 || r[i].start != start) return -1;
  memmove(&r[i], &r[i + 1], (*n - (size_t)i - 1) * sizeof *r);
  (*n)--;
  return 0;
}

// Index of the mirror that contains addr, or -1 (under the lock).
static long find_mirror(hs_t *s, uint64_t addr) { return find_range(s->mirrors, s->nmirrors, addr); }
// The range of table r (sorted, disjoint) that holds [addr, addr + n) whole, if it is `conn`'s; else NULL.
static hs_mirror_t *range_of(hs_mirror_t *r, size_t nr, int conn, uint64_t addr, uint64_t n) {
  long i = find_range(r, nr, addr);
  if (i < 0 || r[i].conn != conn || n > r[i].end - addr) return NULL;
  return &r[i];
}
static hs_mirror_t *mirror_of(hs_t *s, int conn, uint64_t addr, uint64_t n) { return range_of(s->mirrors, s->nmirrors, conn, addr, n); }

// Add mirror m over [start, start + len): 0, or -1 when the range overlaps a mirror or memory runs out.
static int mirror_add(hs_t *s, uint64_t start, uint64_t len, hs_mirror_t m) {
  if (len == 0 || start + len < start) return -1;
  m.start = start;
  m.end = start + len;
  pthread_rwlock_wrlock(&s->lock);
  int rc = add_range(&s->mirrors, &s->nmirrors, &s->mirror_cap, m);
  pthread_rwlock_unlock(&s->lock);
  return rc;
}

EXPORT int hs_mirror_add(void *sp, uint64_t start, uint64_t len, int conn, uint64_t client) {
  return mirror_add(sp, start, len, (hs_mirror_t){.client = client, .conn = conn});
}

// A shared mirror (see hs_mirror_t): the client's memory at `client` is mapped here at `mapped`, its sleeper count
// at `sleepers`. What the command processor stores there the client sees without a message. 0, or -1.
EXPORT int hs_mirror_add_shared(void *sp, uint64_t start, uint64_t len, int conn, uint64_t client, uint64_t mapped, void *sleepers) {
  if (!mapped || !sleepers) return -1;
  return mirror_add(sp, start, len, (hs_mirror_t){.client = client, .conn = conn, .mapped = mapped, .sleepers = sleepers});
}
EXPORT int hs_mirror_remove(void *sp, uint64_t start) {
  hs_t *s = sp;
  pthread_rwlock_wrlock(&s->lock);  // waits for hooks and handlers using it
  int rc = remove_range(s->mirrors, &s->nmirrors, start);
  pthread_rwlock_unlock(&s->lock);
  return rc;
}

// ---- placements (net.c's AM_PLACE lands bytes straight in place: bulk copyin, windows)
static const hs_accept_t *accepted(hs_t *s, int conn, uint64_t addr, uint64_t n);
#define HS_LANDING_WAIT_MS 10000  // how long removing a range waits for placements into it to land

// Let `conn` place bytes into [start, start + len) (device memory of its client). 0, or -1.
EXPORT int hs_place_add(void *sp, uint64_t start, uint64_t len, int conn) {
  hs_t *s = sp;
  if (len == 0 || start + len < start) return -1;
  pthread_rwlock_wrlock(&s->lock);
  int rc = add_range(&s->places, &s->nplaces, &s->place_cap, (hs_mirror_t){.start = start, .end = start + len, .conn = conn});
  pthread_rwlock_unlock(&s->lock);
  return rc;
}

static int landing_overlaps(hs_t *s, uint64_t start, uint64_t end, int conn) {
  pthread_mutex_lock(&s->landing_mu);
  int busy = 0;
  for (size_t i = 0; i < s->nlanding && !busy; i++)
    busy = conn >= 0 ? s->landing[i].conn == conn : s->landing[i].start < end && start < s->landing[i].end;
  pthread_mutex_unlock(&s->landing_mu);
  return busy;
}

// Wait until no placement lands in [start, end) (or, conn >= 0, for conn): 0, or -1 if one still does after
// HS_LANDING_WAIT_MS (the caller must then keep the memory mapped). Without the lock: the placer takes it.
static int landing_wait(hs_t *s, uint64_t start, uint64_t end, int conn) {
  for (int ms = 0; landing_overlaps(s, start, end, conn); ms++) {
    if (ms >= HS_LANDING_WAIT_MS) return -1;
    nanosleep(&(struct timespec){0, 1000000}, NULL);
  }
  return 0;
}

// Take the range at `start` back (its memory is being freed); returns once nothing lands in it any more. 0; -1 if a
// placement still lands in it (keep the memory mapped); -2 if there is no such range.
EXPORT int hs_place_remove(void *sp, uint64_t start) {
  hs_t *s = sp;
  pthread_rwlock_wrlock(&s->lock);  // from here no placement into it starts (the placer checks under the read lock)
  long i = find_range(s->places, s->nplaces, start);
  uint64_t end = i >= 0 && s->places[i].start == start ? s->places[i].end : 0;
  if (end) remove_range(s->places, &s->nplaces, start);
  pthread_rwlock_unlock(&s->lock);
  return end ? landing_wait(s, start, end, -1) : -2;
}

// net.c's placer (hn_placer_fn): may `conn` write [addr, addr + len)? Its device memory (places), or what a client
// accepted for it (accepts: a window's bytes, placed by the server or client whose copy engine wrote them). While the
// bytes land the range is listed in `landing` (done = 1 takes it off).
EXPORT int hs_place_ok(void *ctx, int conn, uint64_t addr, uint64_t len, int done) {
  hs_t *s = ctx;
  int rc = -1;
  if (done) {
    pthread_mutex_lock(&s->landing_mu);
    for (size_t i = 0; i < s->nlanding; i++) {
      if (s->landing[i].start != addr || s->landing[i].end != addr + len || s->landing[i].conn != conn) continue;
      s->landing[i] = s->landing[--s->nlanding];
      break;
    }
    pthread_mutex_unlock(&s->landing_mu);
    return 0;
  }
  if (addr + len < addr) return -1;
  pthread_rwlock_rdlock(&s->lock);
  if (range_of(s->places, s->nplaces, conn, addr, len) || accepted(s, conn, addr, len)) {
    pthread_mutex_lock(&s->landing_mu);  // listed before the read lock goes: a removal that follows waits for it
    if (s->nlanding == s->landing_cap) {
      size_t c = s->landing_cap ? 2 * s->landing_cap : 16;
      hs_mirror_t *l = realloc(s->landing, c * sizeof *l);
      if (l) { s->landing = l; s->landing_cap = c; }
    }
    if (s->nlanding < s->landing_cap) {
      s->landing[s->nlanding++] = (hs_mirror_t){.start = addr, .end = addr + len, .conn = conn};
      rc = 0;
    }
    pthread_mutex_unlock(&s->landing_mu);
  }
  pthread_rwlock_unlock(&s->lock);
  return rc;
}

// A ring's id for SUBMIT messages of `conn`, or -1.
EXPORT int hs_ring_add(void *sp, void *ring, int conn) {
  hs_t *s = sp;
  pthread_rwlock_wrlock(&s->lock);
  size_t i = 0;
  while (i < s->nrings && s->rings[i].ring) i++;
  if (i == s->nrings) {
    hs_ring_t *r = realloc(s->rings, (s->nrings + 1) * sizeof *r);
    if (!r) { pthread_rwlock_unlock(&s->lock); return -1; }
    s->rings = r; s->nrings++;
  }
  s->rings[i] = (hs_ring_t){ring, conn, 0};
  pthread_rwlock_unlock(&s->lock);
  return (int)i;
}

// Take the ring with id `id` out of the table (the device is closing): once this returns no SUBMIT reaches it (one
// under way holds the read lock, and finishes first); its id may name another ring from now on.
EXPORT void hs_ring_remove(void *sp, int id) {
  hs_t *s = sp;
  pthread_rwlock_wrlock(&s->lock);
  if (id >= 0 && (size_t)id < s->nrings) s->rings[id] = (hs_ring_t){NULL, -1, 0};
  pthread_rwlock_unlock(&s->lock);
}

// Append the `size` bytes at `item` to the array *arr of *n entries, under the write lock. 0, or -1 (out of memory).
static int append_locked(hs_t *s, void **arr, size_t *n, size_t size, const void *item) {
  pthread_rwlock_wrlock(&s->lock);
  void *grown = realloc(*arr, (*n + 1) * size);
  if (grown) {
    *arr = grown;
    memcpy((char *)grown + *n * size, item, size);
    (*n)++;
  }
  pthread_rwlock_unlock(&s->lock);
  return grown ? 0 : -1;
}

// Forward [start, start + len) to `dest` over `conn` of engine `net` (NULL: the table's) for `owner`'s client (rkey:
// see hs_forward_t, else -1). 0 or -1.
EXPORT int hs_forward_add(void *sp, uint64_t start, uint64_t len, void *net, int conn, uint64_t dest, int owner, uint32_t flags, int rkey) {
  hs_t *s = sp;
  if (len == 0 || start + len < start) return -1;
  hs_forward_t f = {start, start + len, dest, net, conn, owner, flags, rkey};
  return append_locked(s, (void **)&s->forwards, &s->nforwards, sizeof f, &f);
}

// Drop the forwards of [start, ...) to `dest` (0 when there was one, -1 when not).
EXPORT int hs_forward_remove(void *sp, uint64_t start, uint64_t dest) {
  hs_t *s = sp;
  pthread_rwlock_wrlock(&s->lock);
  size_t k = 0, n = s->nforwards;
  for (size_t i = 0; i < n; i++)
    if (!(s->forwards[i].start == start && s->forwards[i].dest == dest)) s->forwards[k++] = s->forwards[i];
  s->nforwards = k;
  pthread_rwlock_unlock(&s->lock);
  return k < n ? 0 : -1;
}

// `conn`'s client shares memory with this process: a window pushed to it is followed by a SYNC (see push_forwards).
EXPORT int hs_conn_set_shared(void *sp, int conn) {
  hs_t *s = sp;
  return append_locked(s, (void **)&s->shared_conns, &s->nshared, sizeof conn, &conn);
}

static int conn_shared(const hs_t *s, int conn) {
  for (size_t i = 0; i < s->nshared; i++)
    if (s->shared_conns[i] == conn) return 1;
  return 0;
}

// Let `conn` push into [start, start + len) (for `owner`'s client; poison_id: see hs_accept_t). 0 or -1.
EXPORT int hs_accept_add(void *sp, uint64_t start, uint64_t len, int conn, int owner, uint32_t poison_id) {
  hs_t *s = sp;
  if (len == 0 || start + len < start) return -1;
  hs_accept_t a = {start, start + len, conn, owner, poison_id};
  return append_locked(s, (void **)&s->accepts, &s->naccepts, sizeof a, &a);
}

static int landing_wait(hs_t *s, uint64_t start, uint64_t end, int conn);

// Drop the accepts of [start, start + len) (and forwards out of it); returns once no placement lands in it: 0, or -1
// if one still does (keep the memory mapped).
EXPORT int hs_accept_remove_range(void *sp, uint64_t start, uint64_t len) {
  hs_t *s = sp;
  pthread_rwlock_wrlock(&s->lock);
  size_t k = 0;
  for (size_t i = 0; i < s->naccepts; i++)
    if (s->accepts[i].end <= start || s->accepts[i].start >= start + len) s->accepts[k++] = s->accepts[i];
  s->naccepts = k;
  k = 0;
  for (size_t i = 0; i < s->nforwards; i++)  // (and forwards out of it, or into a window of it)
    if (s->forwards[i].end <= start || s->forwards[i].start >= start + len) s->forwards[k++] = s->forwards[i];
  s->nforwards = k;
  pthread_rwlock_unlock(&s->lock);
  return landing_wait(s, start, start + len, -1);
}

static const hs_accept_t *accepted(hs_t *s, int conn, uint64_t addr, uint64_t n) {
  for (size_t i = 0; i < s->naccepts; i++)
    if (s->accepts[i].conn == conn && s->accepts[i].start <= addr && n <= s->accepts[i].end - addr) return &s->accepts[i];
  return NULL;
}

// Forget everything of `conn` (it closed or died); returns once no hook or handler uses it any more, and no placement
// of it lands: 0; -1 if one still does (keep its memory mapped).
EXPORT int hs_conn_remove(void *sp, int conn) {
  hs_t *s = sp;
  pthread_rwlock_wrlock(&s->lock);
  size_t k = 0;
  for (size_t i = 0; i < s->nmirrors; i++)
    if (s->mirrors[i].conn != conn) s->mirrors[k++] = s->mirrors[i];
  s->nmirrors = k;
  for (size_t i = 0; i < s->nrings; i++)
    if (s->rings[i].conn == conn) s->rings[i] = (hs_ring_t){NULL, -1, 0};
  k = 0;
  for (size_t i = 0; i < s->nforwards; i++)
    if (s->forwards[i].owner != conn && !(s->forwards[i].net == NULL && s->forwards[i].conn == conn)) s->forwards[k++] = s->forwards[i];
  s->nforwards = k;
  k = 0;
  for (size_t i = 0; i < s->naccepts; i++)
    if (s->accepts[i].owner != conn && s->accepts[i].conn != conn) s->accepts[k++] = s->accepts[i];
  s->naccepts = k;
  k = 0;
  for (size_t i = 0; i < s->nshared; i++)
    if (s->shared_conns[i] != conn) s->shared_conns[k++] = s->shared_conns[i];
  s->nshared = k;
  k = 0;
  for (size_t i = 0; i < s->nplaces; i++)
    if (s->places[i].conn != conn) s->places[k++] = s->places[i];
  s->nplaces = k;
  pthread_rwlock_unlock(&s->lock);
  if (landing_wait(s, 0, 0, conn) == 0) return 0;
  fprintf(stderr, "hcq serve: placements of connection %d still landing %d ms after it closed\n", conn, HS_LANDING_WAIT_MS);
  return -1;
}

// Push [addr, addr + n) of this process to `dest` over (net, conn), under push_lock: a 16-byte signal as its value and
// timestamp word, the value given where `given` (the store hook's HOOK_VALUE: a backend that reports stores after a
// later one may have changed the word, see vk.c's signal_reported), else read here with acquire (so what was stored
// before it is in the earlier pushes); other bytes in chunks.
typedef struct { uint32_t type, flags; uint64_t client, len; } hs_push_t;
static void push_range(void *net, int conn, uint64_t dest, uint64_t addr, uint64_t n, int signal, int given, uint64_t value) {
  uint8_t small[sizeof(hs_push_t) + 64];
  if (signal) {
    hs_push_t head = {HS_PUSH, FLAG_SIGNAL, dest, 16};
    uint64_t vt[2];
    vt[0] = given ? value : atomic_load_explicit((_Atomic uint64_t *)(uintptr_t)addr, memory_order_acquire);
    vt[1] = atomic_load_explicit((_Atomic uint64_t *)(uintptr_t)(addr + 8), memory_order_acquire);  // (the poison tag went first)
    memcpy(small, &head, sizeof head);
    memcpy(small + sizeof head, vt, sizeof vt);
    hn_send(net, conn, small, sizeof head + 16);  // (copies the message; sent in order after earlier pushes)
    return;
  }
  for (uint64_t off = 0; off < n; off += HS_PUSH_CHUNK) {
    uint64_t len = n - off < HS_PUSH_CHUNK ? n - off : HS_PUSH_CHUNK;
    uint8_t *msg = len <= 64 ? small : malloc(sizeof(hs_push_t) + len);
    if (!msg) return;  // (the receiver's wait then times out, naming the signal it waited for)
    hs_push_t head = {HS_PUSH, 0, dest + off, len};
    memcpy(msg, &head, sizeof head);
    memcpy(msg + sizeof head, (const void *)(uintptr_t)(addr + off), len);
    hn_send(net, conn, msg, sizeof head + len);
    if (msg != small) free(msg);
  }
}

// Drop the whole pages of a window's [addr, addr + n) once pushed (they read as zeros after; memory is given back).
static void drop_pages(uint64_t addr, uint64_t n) {
  uint64_t page = (uint64_t)sysconf(_SC_PAGESIZE), lo = (addr + page - 1) & ~(page - 1), hi = (addr + n) & ~(page - 1);
  if (hi > lo) madvise((void *)(uintptr_t)lo, hi - lo, MADV_DONTNEED);
}

// A window's bytes from this size on are placed (net.c's AM_PLACE: sent from the window, received straight into the
// destination); smaller ones, and signals, are pushed (a copy each way, but one message with nothing to wait for).
#define HS_PLACE_MIN (64u << 10)
static int placed_window(const hs_forward_t *f, uint64_t n, int signal) {
  return (f->flags & HS_FORWARD_WINDOW) && f->rkey < 0 && n >= HS_PLACE_MIN && !signal;
}

// The forwards that overlap [addr, addr + n): each gets the overlap (under the read lock and push_lock). Returns a
// connection to SYNC once push_lock is released, or -1: a window pushed to a client that shares memory with us (its
// bytes go as messages, but the signal the queue stores next reaches it through memory, at once: the queue must not
// go on before the client has applied them).
static int push_forwards(hs_t *s, uint64_t addr, uint64_t n, int signal, int given, uint64_t value) {
  int sync = -1;
  for (size_t i = 0; i < s->nforwards; i++) {
    hs_forward_t f = s->forwards[i];
    uint64_t lo = addr > f.start ? addr : f.start, hi = addr + n < f.end ? addr + n : f.end;
    if (lo >= hi || f.rkey >= 0 || placed_window(&f, hi - lo, signal)) continue;
    push_range(f.net ? f.net : s->net, f.conn, f.dest + (lo - f.start), lo, hi - lo, signal && lo == addr && hi - lo == 16, given, value);
    if (f.flags & HS_FORWARD_WINDOW) {
      drop_pages(lo, hi - lo);
      if (!f.net && conn_shared(s, f.conn)) sync = f.conn;
    }
  }
  return sync;
}

// A store into a shared mirror: nothing to send but, for its failure word (mapped elsewhere), a copy; and for a signal
// while the client has sleepers, a WAKE (under the read lock; no push_lock: a WAKE carries no value).
static void shared_store(hs_t *s, const hs_mirror_t *m, uint64_t addr, uint64_t n, int signal) {
  uint64_t to = m->mapped + (addr - m->start);
  if (to != addr) {
    // (before this hook returns, so the poisoned signals this thread stores after a failure come after it)
    if (n == 4 && to % 4 == 0) atomic_store_explicit((_Atomic uint32_t *)(uintptr_t)to, *(const uint32_t *)(uintptr_t)addr, memory_order_release);
    else { memcpy((void *)(uintptr_t)to, (const void *)(uintptr_t)addr, n); atomic_thread_fence(memory_order_release); }
  }
  if (!signal) return;
  atomic_thread_fence(memory_order_seq_cst);  // the value before the count: pairs with the sleeper's increment (hn_set_sleep_word)
  if (!atomic_load_explicit(m->sleepers, memory_order_relaxed)) return;
  struct { uint32_t type, pad; uint64_t client; } wake = {HS_WAKE, 0, m->client + (addr - m->start)};
  hn_send(s->net, m->conn, &wake, sizeof wake);
}

// SYNC `conn` (see push_forwards), under the read lock only: the wait may run handlers on this thread.
static void sync_client(hs_t *s, int conn) {
  uint32_t msg[2] = {HS_SYNC, 0};
  uint64_t reply;
  hn_request(s->net, conn, msg, sizeof msg, &reply, sizeof reply, HS_PUT_WAIT_MS);  // (a dead client: nobody to order for)
}

// The windows that overlap [addr, addr + n) by HS_PLACE_MIN or more: each overlap is placed before this returns (under
// the read lock only, as put_forwards), so the signal a later packet stores, pushed after, is handled after the bytes
// are in. A placement that fails falls back to a push (its connection is likely dead: nobody waits then). Returns a
// connection to SYNC, as push_forwards.
static int place_forwards(hs_t *s, uint64_t addr, uint64_t n) {
  int sync = -1;
  for (size_t i = 0; i < s->nforwards; i++) {
    hs_forward_t f = s->forwards[i];
    uint64_t lo = addr > f.start ? addr : f.start, hi = addr + n < f.end ? addr + n : f.end;
    if (lo >= hi || !placed_window(&f, hi - lo, 0)) continue;
    void *net = f.net ? f.net : s->net;
    if (hn_place(net, f.conn, f.dest + (lo - f.start), (const void *)(uintptr_t)lo, hi - lo, HS_PUT_WAIT_MS) != 0) {
      pthread_mutex_lock(&s->push_lock);
      push_range(net, f.conn, f.dest + (lo - f.start), lo, hi - lo, 0, 0, 0);
      pthread_mutex_unlock(&s->push_lock);
    }
    drop_pages(lo, hi - lo);
    if (!f.net && conn_shared(s, f.conn)) sync = f.conn;
  }
  return sync;
}

// The windows with registered destinations that overlap [addr, addr + n): each overlap is put and flushed before this
// returns (under the read lock only: the wait may run handlers on this thread, and one takes push_lock), so the
// signal a later packet stores, pushed after, reaches the destination after the bytes. A put that fails falls back
// to a push.
static void put_forwards(hs_t *s, uint64_t addr, uint64_t n) {
  for (size_t i = 0; i < s->nforwards; i++) {
    hs_forward_t f = s->forwards[i];
    uint64_t lo = addr > f.start ? addr : f.start, hi = addr + n < f.end ? addr + n : f.end;
    if (lo >= hi || f.rkey < 0) continue;
    void *net = f.net ? f.net : s->net;
    if (hn_put(net, f.conn, (const void *)(uintptr_t)lo, f.dest + (lo - f.start), f.rkey, hi - lo, HS_PUT_WAIT_MS) != 0) {
      pthread_mutex_lock(&s->push_lock);
      push_range(net, f.conn, f.dest + (lo - f.start), lo, hi - lo, 0, 0, 0);
      pthread_mutex_unlock(&s->push_lock);
    }
    drop_pages(lo, hi - lo);
  }
}

// A backend's store hook (hcq.interfaces.HostStores.set_hook): runs on the thread that stored [addr, addr + n) (a
// signal: with HOOK_VALUE, `value` is the value to forward; else its word is read under push_lock).
EXPORT void hs_store_hook(void *ctx, uint64_t addr, uint64_t n, uint32_t flags, uint64_t value) {
  hs_t *s = ctx;
  if (pthread_rwlock_rdlock(&s->lock) != 0) return;
  int signal = (flags & FLAG_SIGNAL) && n == 16, given = signal && (flags & HOOK_VALUE), sync = -1;
  if (!signal && s->nforwards) {
    put_forwards(s, addr, n);
    sync = place_forwards(s, addr, n);
  }
  long i = find_mirror(s, addr);
  const hs_mirror_t *m = i >= 0 && n <= s->mirrors[i].end - addr ? &s->mirrors[i] : NULL;
  if (m && m->mapped) {
    shared_store(s, m, addr, n, signal);
    m = NULL;
  }
  if (m || s->nforwards) {
    pthread_mutex_lock(&s->push_lock);  // (the engine never calls back into the hook: no lock order to keep)
    if (m) push_range(s->net, m->conn, m->client + (addr - m->start), addr, n, signal, given, value);
    int pushed_sync = push_forwards(s, addr, n, signal, given, value);
    if (pushed_sync >= 0) sync = pushed_sync;
    pthread_mutex_unlock(&s->push_lock);
  }
  if (sync >= 0) sync_client(s, sync);
  pthread_rwlock_unlock(&s->lock);
}

// The store hook for a range's current bytes, at once (a new replica's first value, a host store into a forwarded
// signal: its word is read under push_lock).
EXPORT void hs_push_now(void *ctx, uint64_t addr, uint64_t n, uint32_t flags) { hs_store_hook(ctx, addr, n, flags & ~(uint32_t)HOOK_VALUE, 0); }

// Wake this process's sleepers on the signal at addr, which another process stored into (shared memory).
static void wake_sleepers_on(uint64_t addr) {
  hn_wake_local64((void *)(uintptr_t)addr, atomic_load_explicit((_Atomic uint64_t *)(uintptr_t)addr, memory_order_acquire));
}

static int64_t reply_status(void *reply, uint64_t cap, int32_t status) {
  if (cap < sizeof status) return 0;
  memcpy(reply, &status, sizeof status);
  return sizeof status;
}

// SUBMIT: u32 type, u32 ring id, u32 pushes, u32 flags; per push: u64 server address, u64 length, the bytes (padded
// to 8); then u64 words, the words. Answers (a request) i32 status, i32 0, u64 the ring's read pointer in words:
// a SubmitStatus, or -1 for a malformed message (nothing done), or -2 after an earlier one-way SUBMIT to the ring failed (HS_SUBMIT_ONE_WAY: the client sent it without waiting, knowing from the read pointer that the ring had room;
// should it fail anyway, its work is lost and the ring refuses what follows, so the client learns of it).
static int32_t submit(hs_t *s, int conn, const uint8_t *p, const uint8_t *end, uint32_t *ring_id, uint32_t *flags) {
  uint32_t head[4];
  if ((uint64_t)(end - p) < sizeof head) return -1;
  memcpy(head, p, sizeof head);
  p += sizeof head;
  *ring_id = head[1];
  *flags = head[3];
  if (head[1] >= s->nrings || !s->rings[head[1]].ring || s->rings[head[1]].conn != conn) return -1;
  if (s->rings[head[1]].refused) return s->rings[head[1]].refused;
  const uint8_t *q = p;
  for (uint32_t i = 0; i < head[2]; i++) {  // check every push before writing any
    uint64_t hdr[2];
    if ((uint64_t)(end - q) < sizeof hdr) return -1;
    memcpy(hdr, q, sizeof hdr);
    q += sizeof hdr;
    uint64_t padded = (hdr[1] + 7) & ~(uint64_t)7;
    if (padded < hdr[1] || (uint64_t)(end - q) < padded || !mirror_of(s, conn, hdr[0], hdr[1])) return -1;
    q += padded;
  }
  uint64_t nwords;
  if ((uint64_t)(end - q) < sizeof nwords) return -1;
  memcpy(&nwords, q, sizeof nwords);
  q += sizeof nwords;
  if (nwords > (uint64_t)(end - q) / 8) return -1;
  for (uint32_t i = 0; i < head[2]; i++) {
    uint64_t hdr[2];
    memcpy(hdr, p, sizeof hdr);
    p += sizeof hdr;
    memcpy((void *)(uintptr_t)hdr[0], p, hdr[1]);  // published to the queue thread by the ring's release of wptr
    p += (hdr[1] + 7) & ~(uint64_t)7;
  }
  void *ring = s->rings[head[1]].ring;
  if ((uintptr_t)q % 8 == 0) return s->submit(ring, (const uint64_t *)(const void *)q, nwords, 0);
  // the engine's receive buffer need not be 8-aligned (it is not over TCP): the words go through an aligned copy
  uint64_t *words = malloc(nwords ? nwords * 8 : 8);
  if (!words) return -1;
  memcpy(words, q, nwords * 8);
  int32_t status = s->submit(ring, words, nwords, 0);
  free(words);
  return status;
}

EXPORT int64_t hs_on_submit(void *ctx, int conn, const void *msg, uint64_t len, void *reply, uint64_t cap) {
  hs_t *s = ctx;
  uint32_t ring_id = UINT32_MAX, flags = 0;
  struct { int32_t status, pad; uint64_t rptr; } answer = {0, 0, 0};
  pthread_rwlock_rdlock(&s->lock);
  answer.status = submit(s, conn, msg, (const uint8_t *)msg + len, &ring_id, &flags);
  int known = ring_id < s->nrings && s->rings[ring_id].ring && s->rings[ring_id].conn == conn;
  if (known && (flags & HS_SUBMIT_ONE_WAY) && answer.status != 0) s->rings[ring_id].refused = -2;  // lost work: the ring refuses the rest
  if (known) answer.rptr = s->rptr(s->rings[ring_id].ring);
  pthread_rwlock_unlock(&s->lock);
  if (cap < sizeof answer) return 0;
  memcpy(reply, &answer, sizeof answer);
  return sizeof answer;
}

// STORE: u32 type, u32 flags, u64 signal address, u64 value: a host store into a signal of the client's mirrors
// (HS_STORE_RESET_TIMESTAMP: also zero its timestamp, as a fresh signal has). Replies an i32: 0, or -1; sent one-way
// (HS_STORE_ONE_WAY, as clients do) it is applied before the SUBMITs sent after it, and a refusal is only logged.
EXPORT int64_t hs_on_store(void *ctx, int conn, const void *msg, uint64_t len, void *reply, uint64_t cap) {
  hs_t *s = ctx;
  struct { uint32_t type, flags; uint64_t addr, value; } m;
  if (len != sizeof m) return reply_status(reply, cap, -1);
  memcpy(&m, msg, sizeof m);
  int32_t status = -1;
  pthread_rwlock_rdlock(&s->lock);
  const hs_mirror_t *mirror = m.addr % 8 == 0 ? mirror_of(s, conn, m.addr, 16) : NULL;
  if (mirror) {
    if (mirror->mapped) {  // the client stored into the memory itself (poison and timestamp cleared): wake only
      wake_sleepers_on(m.addr);
    } else {
      if (m.flags & HS_STORE_RESET_TIMESTAMP) atomic_store_explicit((_Atomic uint64_t *)(uintptr_t)(m.addr + 8), 0, memory_order_relaxed);
      s->store((void *)(uintptr_t)m.addr, m.value);  // release (the timestamp first), wakes sleepers; no store hook
    }
    if (s->nforwards) {  // the signal's replicas elsewhere follow; the client is not sent back what it stored (a push
      pthread_mutex_lock(&s->push_lock);  // arriving after its next store would take its own copy back in time)
      push_forwards(s, m.addr, 16, 1, 0, 0);
      pthread_mutex_unlock(&s->push_lock);
    }
    status = 0;
  }
  pthread_rwlock_unlock(&s->lock);
  if (status != 0 && (m.flags & HS_STORE_ONE_WAY))  // (a client bug: nobody waits for the answer)
    fprintf(stderr, "hcq serve: refused a one-way store of %llu into 0x%llx (not a signal of that connection)\n",
            (unsigned long long)m.value, (unsigned long long)m.addr);
  return reply_status(reply, cap, status);
}

// PUSH (one-way, server -> client, or into ranges a table accepts from a connection: a server's link to another
// server, a client's forwards; ctx = the receiving table, whose mirrors in a client are keyed by client address): u32 type, u32 flags, u64 client address, u64 length, the bytes. Bytes for a range of the connection's
// mirrors are copied in; a signal (FLAG_SIGNAL, value then timestamp) gets its timestamp first, then its value
// with a release store that wakes the threads sleeping on it.
EXPORT int64_t hs_on_push(void *ctx, int conn, const void *msg, uint64_t len, void *reply, uint64_t cap) {
  (void)reply; (void)cap;
  hs_t *s = ctx;
  hs_push_t h;
  if (len < sizeof h) return 0;
  memcpy(&h, msg, sizeof h);
  const uint8_t *data = (const uint8_t *)msg + sizeof h;
  if (h.len != len - sizeof h) return 0;
  pthread_rwlock_rdlock(&s->lock);
  const hs_accept_t *acc = NULL;
  if (mirror_of(s, conn, h.client, h.len) || (acc = accepted(s, conn, h.client, h.len))) {
    if ((h.flags & FLAG_SIGNAL) && h.len == 16 && h.client % 8 == 0) {
      uint64_t vt[2];
      memcpy(vt, data, sizeof vt);
      if (acc && s->poison && hcq_is_poisoned(vt[1])) {  // a failed device's store, named here
        s->poison((void *)(uintptr_t)h.client, vt[0], acc->poison_id);
      } else {
        atomic_store_explicit((_Atomic uint64_t *)(uintptr_t)(h.client + 8), vt[1], memory_order_relaxed);
        hn_store_local64((void *)(uintptr_t)h.client, vt[0]);  // release: the timestamp and earlier pushes first
      }
    } else {
      memcpy((void *)(uintptr_t)h.client, data, h.len);
    }
  }
  pthread_rwlock_unlock(&s->lock);
  return 0;
}

// WAKE (one-way, server -> client: u32 type, u32 0, u64 client address): a signal of a shared mirror changed while
// the client counted sleepers; wake them.
EXPORT int64_t hs_on_wake(void *ctx, int conn, const void *msg, uint64_t len, void *reply, uint64_t cap) {
  (void)reply; (void)cap;
  hs_t *s = ctx;
  struct { uint32_t type, pad; uint64_t client; } m;
  if (len != sizeof m) return 0;
  memcpy(&m, msg, sizeof m);
  pthread_rwlock_rdlock(&s->lock);
  if (m.client % 8 == 0 && mirror_of(s, conn, m.client, 16))
    wake_sleepers_on(m.client);
  pthread_rwlock_unlock(&s->lock);
  return 0;
}

// SYNC (a request, server -> client): answered empty. Messages of a connection are handled in order, so the answer
// means those sent before it are applied.
EXPORT int64_t hs_on_sync(void *ctx, int conn, const void *msg, uint64_t len, void *reply, uint64_t cap) {
  (void)ctx; (void)conn; (void)msg; (void)len; (void)reply; (void)cap;
  return 0;
}

// ---------------------------------------------------------------- the client's executor (hs_exec_*)
// A remote device's rings, client side (hcq/backends/remote/device.py, RemoteExecutor): hs_exec_submit is the
// executor's native submit (`int submit(ring, words, n, timeout_ns)`), so launches and queue re-submits go from the
// core's hot path (hcq/_hotpath.c) to the network without Python. A submission is one SUBMIT message: the
// mirrored bytes its packets read, found by walking them (EXEC: the kernargs block, sized by the program its entry
// names; COPY: the source; INDIRECT: the bound words, and the EXECs and COPYs inside them), copied from the client's
// copies, then the words. While the ring certainly has room (the words sent to it, less its read pointer when last
// heard of, plus these fit), the SUBMIT goes one-way; otherwise it is a request, answered with the status and the read
// pointer. Statuses past SUBMIT_NO_THREAD are the client's own (HS_SUBMIT_*); like any status but SUBMIT_OK they
// mean nothing was queued, and the core's checked path asks the executor what went wrong (RemoteExecutor.submit_error).
#define HS_SUBMIT_TIMEOUT_MS 30000

typedef struct { uint64_t entry, size; } hs_kargs_t;           // the kernargs bytes of a program, by its entry word
typedef struct hs_exec hs_exec_t;
typedef struct { hs_exec_t *x; uint32_t id; uint64_t sent, rptr; } hs_cring_t;  // sent, rptr: in words (under x->mu)

struct hs_exec {
  void *net;
  int conn;
  const _Atomic int32_t *failed;  // the device's failure word (the client's copy; the server pushes it)
  _Atomic int closed;       // set before the engine closes, and in a fork() child (where UCX is unusable): refuse all
  pthread_mutex_t mu;       // everything below; a submit holds it from its walk to its send
  hs_mirror_t *ranges;      // the mirrored ranges: server [start, end), the client's copy (sorted, disjoint)
  size_t nranges, range_cap;
  hs_kargs_t *kargs;        // sorted by entry
  size_t nkargs, kargs_cap;
  hs_cring_t **rings;
  size_t nrings;
  uint8_t *msg;             // the SUBMIT being built
  size_t msg_len, msg_cap;
  uint32_t npushes;
};

EXPORT void *hs_exec_create(void *net, int conn, void *failed) {
  hs_exec_t *x = calloc(1, sizeof *x);
  if (!x) return NULL;
  x->net = net;
  x->conn = conn;
  x->failed = failed;
  pthread_mutex_init(&x->mu, NULL);
  return x;
}

// No submission after this returns (wait: for one under way to finish; 0 in a fork() child, whose lock a thread of
// the parent may have held).
EXPORT void hs_exec_close(void *xp, int wait) {
  hs_exec_t *x = xp;
  atomic_store_explicit(&x->closed, 1, memory_order_seq_cst);
  if (wait) { pthread_mutex_lock(&x->mu); pthread_mutex_unlock(&x->mu); }
}

// How the device stands, in one call (checked after every synchronize): 0 well, 1 failed (its failure word is set),
// 2 its connection is dead, 3 closed here (at exit, or in a fork() child).
EXPORT int hs_exec_state(void *xp) {
  hs_exec_t *x = xp;
  if (atomic_load_explicit(&x->closed, memory_order_seq_cst)) return 3;
  if (!hn_alive(x->net, x->conn)) return 2;
  return atomic_load_explicit(x->failed, memory_order_acquire) != 0;
}

EXPORT void hs_exec_free(void *xp) {
  hs_exec_t *x = xp;
  if (!x) return;
  for (size_t i = 0; i < x->nrings; i++) free(x->rings[i]);
  pthread_mutex_destroy(&x->mu);
  free(x->ranges); free(x->kargs); free(x->rings); free(x->msg); free(x);
}

// A ring of the server (its id there); the handle hs_exec_submit takes. Freed with the executor.
EXPORT void *hs_exec_ring(void *xp, uint32_t id) {
  hs_exec_t *x = xp;
  hs_cring_t *r = calloc(1, sizeof *r);
  if (!r) return NULL;
  r->x = x; r->id = id;
  pthread_mutex_lock(&x->mu);
  hs_cring_t **grown = realloc(x->rings, (x->nrings + 1) * sizeof *grown);
  if (grown) { x->rings = grown; x->rings[x->nrings++] = r; }
  pthread_mutex_unlock(&x->mu);
  if (!grown) { free(r); return NULL; }
  return r;
}

// The index of the first program (sorted by entry) whose entry is >= entry (under x->mu).
static size_t kargs_index(const hs_exec_t *x, uint64_t entry) {
  size_t lo = 0, hi = x->nkargs;
  while (lo < hi) {
    size_t mid = (lo + hi) / 2;
    if (x->kargs[mid].entry < entry) lo = mid + 1; else hi = mid;
  }
  return lo;
}

// Mirrored range server [start, start + size) <-> client address (a runtime buffer of this device); shared: the server
// maps the client's memory (nothing to carry). 0, or -1.
EXPORT int hs_exec_range_add(void *xp, uint64_t start, uint64_t size, uint64_t client, int shared) {
  hs_exec_t *x = xp;
  if (size == 0 || start + size < start) return -1;
  pthread_mutex_lock(&x->mu);
  int rc = add_range(&x->ranges, &x->nranges, &x->range_cap, (hs_mirror_t){start, start + size, client, x->conn, shared ? start : 0, NULL});
  pthread_mutex_unlock(&x->mu);
  return rc;
}

EXPORT void hs_exec_range_remove(void *xp, uint64_t start) {
  hs_exec_t *x = xp;
  pthread_mutex_lock(&x->mu);
  remove_range(x->ranges, &x->nranges, start);
  pthread_mutex_unlock(&x->mu);
}

// The kernargs bytes an EXEC of `entry` reads (a program loaded again at that entry replaces it). 0, or -1.
EXPORT int hs_exec_kargs(void *xp, uint64_t entry, uint64_t size) {
  hs_exec_t *x = xp;
  int rc = 0;
  pthread_mutex_lock(&x->mu);
  size_t i = kargs_index(x, entry);
  if (i < x->nkargs && x->kargs[i].entry == entry) {
    x->kargs[i].size = size;
  } else {
    if (x->nkargs == x->kargs_cap) {
      size_t c = x->kargs_cap ? 2 * x->kargs_cap : 16;
      hs_kargs_t *k = realloc(x->kargs, c * sizeof *k);
      if (k) { x->kargs = k; x->kargs_cap = c; }
    }
    if (x->nkargs < x->kargs_cap) {
      memmove(&x->kargs[i + 1], &x->kargs[i], (x->nkargs - i) * sizeof *x->kargs);
      x->kargs[i] = (hs_kargs_t){entry, size};
      x->nkargs++;
    } else {
      rc = -1;
    }
  }
  pthread_mutex_unlock(&x->mu);
  return rc;
}

static int msg_room(hs_exec_t *x, size_t more) {
  if (x->msg_len + more <= x->msg_cap) return 0;
  size_t c = x->msg_cap ? x->msg_cap : 4096;
  while (c < x->msg_len + more) c *= 2;
  uint8_t *m = realloc(x->msg, c);
  if (!m) return -1;
  x->msg = m; x->msg_cap = c;
  return 0;
}

// Append a push of server range [addr, addr + n) if it lies in a mirrored range: its server address, length and the
// client's bytes, padded to 8 (nothing for a shared range: the server reads the client's memory). The client's bytes
// (for an INDIRECT's walk; valid until the message grows), or NULL when not mirrored.
static const uint8_t *exec_push(hs_exec_t *x, uint64_t addr, uint64_t n, int *err) {
  if (n == 0) return NULL;
  long i = find_range(x->ranges, x->nranges, addr);
  if (i < 0) return NULL;
  const hs_mirror_t *r = &x->ranges[i];
  if (addr + n < addr || addr + n > r->end) return NULL;
  if (r->mapped) return (const uint8_t *)(uintptr_t)(r->client + (addr - r->start));
  uint64_t padded = (n + 7) & ~(uint64_t)7, head[2] = {addr, n};
  if (padded < n || msg_room(x, sizeof head + padded)) { *err = 1; return NULL; }
  memcpy(x->msg + x->msg_len, head, sizeof head);
  uint8_t *data = x->msg + x->msg_len + sizeof head;
  memcpy(data, (const void *)(uintptr_t)(r->client + (addr - r->start)), n);
  memset(data + n, 0, padded - n);
  x->msg_len += sizeof head + padded;
  x->npushes++;
  return data;
}

static uint64_t exec_kargs_size(hs_exec_t *x, uint64_t entry) {
  size_t i = kargs_index(x, entry);
  return i < x->nkargs && x->kargs[i].entry == entry ? x->kargs[i].size : 0;
}

// The pushes of the packets in words[0, n) (nested: inside an INDIRECT, whose own INDIRECTs the server refuses).
// A malformed header ends the walk: the server's command processor fails the device on it.
static int exec_walk(hs_exec_t *x, const uint64_t *w, uint64_t n, int nested) {
  int err = 0;
  for (uint64_t i = 0; i < n && !err;) {
    uint64_t op = hdr_op(w[i]), len = hdr_words(w[i]);
    if (len == 0) break;
    if (op == OP_EXEC && i + 2 < n) exec_push(x, w[i + 2], exec_kargs_size(x, w[i + 1]), &err);
    else if (op == OP_COPY && i + 3 < n) exec_push(x, w[i + 2], w[i + 3], &err);
    else if (op == OP_INDIRECT && i + 2 < n && !nested && w[i + 2] <= ((uint64_t)1 << 40)) {
      const uint8_t *bytes = exec_push(x, w[i + 1], w[i + 2] * 8, &err);
      if (bytes) {
        // (copied out: walking them appends to the message, which may move)
        uint64_t words = w[i + 2];
        uint64_t *bound = malloc(words * 8);
        if (!bound) return -1;
        memcpy(bound, bytes, words * 8);
        int rc = exec_walk(x, bound, words, 1);
        free(bound);
        if (rc) return rc;
      }
    }
    i += len;
  }
  return err ? -1 : 0;
}

// The executor's native submit: `n` packet words for ring `rp` (an hs_exec_ring handle), queued whole or not at all.
// timeout_ns is unused: a server ring with no room answers SUBMIT_FULL at once, and the core retries.
EXPORT int hs_exec_submit(void *rp, const uint64_t *words, uint64_t n, int64_t timeout_ns) {
  (void)timeout_ns;
  hs_cring_t *r = rp;
  hs_exec_t *x = r->x;
  // (closed is looked at before the lock too: in a fork() child, a thread of the parent may have held it)
  if (atomic_load_explicit(&x->closed, memory_order_seq_cst)) return HS_SUBMIT_CLOSED;
  if (n > HS_RING_WORDS) return SUBMIT_TOO_BIG;
  pthread_mutex_lock(&x->mu);
  int status = HS_SUBMIT_ERROR;
  if (atomic_load_explicit(&x->closed, memory_order_relaxed)) { status = HS_SUBMIT_CLOSED; goto out; }
  int one_way = r->sent + n - r->rptr <= HS_RING_WORDS;
  uint32_t head[4] = {HS_SUBMIT, r->id, 0, one_way ? HS_SUBMIT_ONE_WAY : 0};
  x->msg_len = 0;
  x->npushes = 0;
  if (msg_room(x, sizeof head)) goto out;
  x->msg_len = sizeof head;
  if (exec_walk(x, words, n, 0)) goto out;
  if (msg_room(x, 8 + n * 8)) goto out;
  memcpy(x->msg + x->msg_len, &n, 8);
  memcpy(x->msg + x->msg_len + 8, words, n * 8);
  x->msg_len += 8 + n * 8;
  head[2] = x->npushes;
  memcpy(x->msg, head, sizeof head);
  if (one_way) {
    int rc = hn_send(x->net, x->conn, x->msg, x->msg_len);
    status = rc == HN_OK ? SUBMIT_OK : rc == HN_EDEAD ? HS_SUBMIT_DEAD : HS_SUBMIT_ERROR;
  } else {
    struct { int32_t status, pad; uint64_t rptr; } answer;
    int64_t got = hn_request(x->net, x->conn, x->msg, x->msg_len, &answer, sizeof answer, HS_SUBMIT_TIMEOUT_MS);
    if (got < 0) status = got == HN_EDEAD ? HS_SUBMIT_DEAD : got == HN_ETIMEDOUT ? HS_SUBMIT_TIMEOUT : HS_SUBMIT_ERROR;
    else if (got != (int64_t)sizeof answer) status = HS_SUBMIT_ERROR;
    else {
      r->rptr = answer.rptr;
      status = answer.status == -2 ? HS_SUBMIT_LOST : answer.status < 0 ? HS_SUBMIT_REFUSED : answer.status;
    }
  }
  if (status == SUBMIT_OK) r->sent += n;
out:
  pthread_mutex_unlock(&x->mu);
  return status;
}
