// hcq's network engine: connections, messages, remote memory access and atomics between processes, over UCX's
// UCP API. Plain C11 with atomics; built on first use and loaded through ctypes (hcq/backends/remote/net.py).
//
// One engine = one UCP context + one worker (UCS_THREAD_MODE_MULTI: every UCP call is serialised by the worker's
// own lock, so any thread may call any hn_* function) + one progress thread. The progress thread spins on
// ucp_worker_progress for a short budget after activity, then sleeps in epoll on the worker's event fd (the
// ucp_worker_arm protocol) and on an eventfd used to wake or stop it: an idle engine uses no CPU (UCX's keepalive
// timer wakes it a few times a second). A thread that waits for something (a reply, a completion) first spins
// for 50-250 us (adaptive) calling ucp_worker_progress itself, then sleeps on a futex that whichever thread
// progresses the worker rings; while it spins, the progress thread leaves the worker to it.
//
// Wire format: four UCP active messages, each with a 16-byte header (hn_hdr_t):
//   AM_MSG    a message: a request (req_id != 0, answered by one AM_REPLY) or a one-way message (req_id 0).
//             Its first 4 bytes (little-endian u32) are its type: a type with a C handler (hn_set_handler) is
//             answered by the thread that progressed the worker, anything else waits in the queue hn_next drains;
//             either way in the order the messages arrived.
//   AM_REPLY  the answer to request req_id; status != 0: the answering side failed (no payload).
//   AM_HELLO  the handshake hn_connect does (payload HELLO_MAGIC), answered by an AM_REPLY: when hn_connect
//             returns, the endpoint is wired up and the peer runs this engine.
//   AM_PING   a liveness probe (no payload), answered by the receiving engine itself with AM_PONG.
//   AM_PONG   the answer. Every arrival on a connection counts as a sign of life; a connection idle for a quarter of
//             the dead time gets a PING from the progress thread, and one with nothing from its peer for the dead
//             time (hn_set_liveness; HCQ_REMOTE_DEAD_S, 2 s) is failed: a peer behind a link that went down, or a
//             stopped process, is noticed in bounded time even where TCP and UCX's keepalive stay silent.
//   AM_PLACE  hn_place: header {address, 0}, payload the bytes to write there (bulk host copies). Always sent as a
//             rendezvous, and received straight into the address if the engine's placer (hn_set_placer) says that
//             range of the receiving process is the sending connection's to write (else the connection is failed);
//             it holds its place in the dispatch order until its data is in, so a message sent after it sees it.
//   AM_STORE  hn_store64: header {address, value}, no payload; the receiver stores the value with a 64-bit atomic
//             store (release) if the address is in memory it registered (see hn_store64 for why not a UCP atomic),
//             then wakes threads of its process sleeping on a futex on the value's low 32-bit word.
// Every send carries UCP_AM_SEND_FLAG_REPLY, so the receiver learns the endpoint (and so the connection) it came on.
// Messages above UCX's rendezvous threshold arrive with UCP_AM_RECV_ATTR_FLAG_RNDV and are received into a malloc'd
// buffer with ucp_am_recv_data_nbx before they are handled; a rendezvous-sized AM_REPLY goes straight into the
// requester's reply buffer when it fits (a bulk read lands where the caller wants it, without a copy).
//
// Buffers: no hn_* call touches the caller's memory after it returns. Small sends and puts go out immediately from
// the caller's memory (UCP_OP_ATTR_FLAG_FORCE_IMM_CMPL) or are copied; large ones are sent from the caller's
// memory and waited for. A wait that must end before the transfer has (a timeout) closes the connection first
// (forcibly: UCX then completes the transfer with an error and never touches the buffer again).
//
// Handlers (C functions hn_set_handler registers) run on the thread that progressed the worker, right after
// ucp_worker_progress returns (not inside UCX's callbacks, so they hold no UCX lock: see run_arrivals), one at a
// time. They may call the non-blocking functions (hn_put_nb, hn_store64, hn_fence, hn_send, hn_reply, hn_alive, ...),
// which then copy whatever cannot go out at once; the blocking ones (hn_request, hn_put, hn_get, hn_flush,
// hn_connect) refuse to run there.
//
// Locks: UCX's worker lock (held by every thread inside a UCP call, and by UCX's callbacks) comes before the
// engine's mutexes; no engine mutex is held across a UCP call.
//
// Who may do what (see docs/design.md, "Threat model"): an engine made without HN_RMA has no one-sided operations
// at all (no UCP RMA/AMO features, UCX's tcp PUT capability off), so stock UCX peers can issue none into it. A
// listening engine with pre-authentication limits (hn_set_preauth) treats every accepted connection as a stranger
// until hn_authenticate: its messages must be small and few (a larger one, a rendezvous one, or one too many closes
// the connection without receiving it), none goes to a C handler or sets memory (AM_STORE), there may be only so
// many strangers at a time, and hn_preauth_expire closes those that did not authenticate in time.
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <limits.h>
#include <linux/futex.h>
#include <netdb.h>
#include <netinet/in.h>
#include <poll.h>
#include <pthread.h>
#include <sched.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include <ucp/api/ucp.h>

#define EXPORT __attribute__((visibility("default")))

#include "relax.h"  // cpu_relax() (hcq/relax.h, put in place when built)

// Return codes of the hn_* calls.
#define HN_OK 0
#define HN_ETIMEDOUT (-1)  // the timeout passed
#define HN_EDEAD (-2)      // the connection is dead (peer died or closed, or it was closed here); hn_next: engine closed
#define HN_EFAIL (-3)      // anything else (hn_last_error says what); hn_next: a "connection closed" event
#define HN_RMA 1           // hn_create flag: one-sided operations (see hn_create)

enum { AM_MSG = 0x4831, AM_REPLY = 0x4832, AM_HELLO = 0x4833, AM_STORE = 0x4834, AM_PING = 0x4835, AM_PONG = 0x4836, AM_PLACE = 0x4837 };  // UCP AM ids
#define HELLO_MAGIC "hcq-net/2"

#define SMALL_BYTES (64u << 10)              // sends and puts up to this size are copied when they cannot go out at once
#define HANDLER_REPLY_CAP (1u << 20)         // room a C handler gets for its reply
#define SHARED_POLL_NS 5000LL               // a waiter on shared memory polls it alone this long between progress calls
#define SPIN_MIN_NS 50000LL                  // a waiting thread progresses the worker itself at least this long before
#define SPIN_MAX_NS 250000LL                 // it sleeps, at most this long (adaptive, see spin_budget)
#define SPIN_LEARN_NS (4 * SPIN_MAX_NS)      // waits up to this long teach the spin budget (see spin_learn)
#define PROGRESS_SPIN_NS 100000LL            // the progress thread spins at least this long after the last activity,
#define PROGRESS_SPIN_MAX_NS 1000000LL       // and at most this long (adaptive, see progress_main)
#define BUSY_POLL_MS 1                       // its epoll timeout while someone waits or requests are in flight
#define SLEEP_SLICE_NS 100000000LL           // a sleeping waiter re-checks at least this often
#define LOCAL_WAIT_MS 10000                  // bound of a wait that has no timeout argument (a large put_nb or reply)
#define ABORT_WAIT_MS 1000                   // after forcibly closing a connection, how long to wait for its requests
#define DESTROY_FLUSH_MS 300                 // hn_destroy: flushing live connections
#define DESTROY_CLOSE_MS 1000                // hn_destroy: endpoints closing
#define DESTROY_CALLS_MS 2000                // hn_destroy: threads still inside hn_* calls
#define KEEPALIVE_INTERVAL "200ms"           // UCX_KEEPALIVE_INTERVAL unless the user set it (UCX's default is 20 s)
#define TCP_TX_SEG_SIZE "64K"                // UCX_TCP_TX_SEG_SIZE unless the user set it (UCX's default: 8K; see hn_create)
#define TCP_RX_SEG_SIZE "256K"               // UCX_TCP_RX_SEG_SIZE unless the user set it (UCX's default: 64K)
#define KEEPALIVE_NUM_EPS "inf"              // UCX_KEEPALIVE_NUM_EPS unless the user set it: every endpoint each round

#define SLOT_CHUNK 1024
#define SLOT_CHUNKS 4096                     // at most 4M connections (ids are never reused) and 4M live rkeys
#define MAX_HANDLERS 64

typedef int64_t (*hn_handler_fn)(void *ctx, int conn, const void *msg, uint64_t len, void *reply, uint64_t cap);
// May connection `conn` write [addr, addr + len) of this process (an AM_PLACE)? 0: yes, and the range stays valid until
// the same call with done = 1 (the data is in, or the transfer failed); anything else: no. Called inside UCX callbacks.
typedef int (*hn_placer_fn)(void *ctx, int conn, uint64_t addr, uint64_t len, int done);

// ---------------------------------------------------------------- errors, time, futex
static _Thread_local char tl_err[512];
static _Thread_local int tl_in_cb;  // > 0 while this thread runs one of our UCX callbacks (inside ucp_worker_progress)

static int fail(int code, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static int fail(int code, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(tl_err, sizeof tl_err, fmt, ap);
  va_end(ap);
  return code;
}

static void copy_err(char *err, int errlen) {
  if (err && errlen > 0) snprintf(err, (size_t)errlen, "%s", tl_err);
}

static inline int64_t now_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

static int64_t deadline_after_ms(int64_t ms) { return ms < 0 ? INT64_MAX : now_ns() + ms * 1000000LL; }

// 1: woken (a FUTEX_WAKE, or *addr was no longer `expected`: a store came as it went to sleep); 0: the timeout ran out,
// or a signal interrupted it.
static int futex_wait(_Atomic uint32_t *addr, uint32_t expected, int64_t timeout_ns) {
  struct timespec rel = {.tv_sec = timeout_ns / 1000000000LL, .tv_nsec = timeout_ns % 1000000000LL};
  return syscall(SYS_futex, (void *)addr, FUTEX_WAIT_PRIVATE, expected, &rel, NULL, 0) == 0 || errno == EAGAIN;
}
static void futex_wake(_Atomic uint32_t *addr) { syscall(SYS_futex, (void *)addr, FUTEX_WAKE_PRIVATE, INT_MAX, NULL, NULL, 0); }

// A completion word: PENDING until whoever completes it exchanges in DONE. A waiter that wants to sleep first
// moves PENDING -> SLEEPING, so the completer knows it has to wake it (and otherwise makes no system call).
enum { W_PENDING = 0, W_DONE = 1, W_SLEEPING = 2 };

static void word_complete(_Atomic uint32_t *w) {
  // acq_rel: release publishes what the completer wrote before (status, reply bytes) to the waiter's acquire load;
  // acquire orders the read of the old value (did the waiter sleep?) after it.
  if (atomic_exchange_explicit(w, W_DONE, memory_order_acq_rel) == W_SLEEPING) futex_wake(w);
}

static inline int word_done(_Atomic uint32_t *w) {
  return atomic_load_explicit(w, memory_order_acquire) == W_DONE;  // acquire: pairs with word_complete's release
}

// ---------------------------------------------------------------- id tables
// Chunked tables of pointers with lock-free lookups: writers (under the table owner's mutex) fill a slot with a
// release store, and publish a new id by a release store of n; readers load n and the slot with acquire. Chunks,
// once allocated, stay until the engine is destroyed, so a reader never sees memory go away under it.
typedef struct { _Atomic(void *) p[SLOT_CHUNK]; } slot_chunk_t;
typedef struct {
  _Atomic(slot_chunk_t *) chunk[SLOT_CHUNKS];
  _Atomic int n;  // ids below n have been handed out
} slots_t;

static void *slot_get(slots_t *t, int id) {
  if (id < 0 || id >= atomic_load_explicit(&t->n, memory_order_acquire)) return NULL;
  slot_chunk_t *c = atomic_load_explicit(&t->chunk[id / SLOT_CHUNK], memory_order_acquire);
  return c ? atomic_load_explicit(&c->p[id % SLOT_CHUNK], memory_order_acquire) : NULL;
}

static _Atomic(void *) *slot_ref(slots_t *t, int id) {  // under the owner's mutex; the chunk exists
  return &atomic_load_explicit(&t->chunk[id / SLOT_CHUNK], memory_order_relaxed)->p[id % SLOT_CHUNK];
}

// A new id holding p (caller holds the owner's mutex), or -1 when the table is full or memory ran out.
static int slot_add(slots_t *t, void *p) {
  int id = atomic_load_explicit(&t->n, memory_order_relaxed);  // only writers (serialised by the mutex) change n
  if (id >= SLOT_CHUNK * SLOT_CHUNKS) return -1;
  if (!atomic_load_explicit(&t->chunk[id / SLOT_CHUNK], memory_order_relaxed)) {
    slot_chunk_t *c = calloc(1, sizeof *c);
    if (!c) return -1;
    atomic_store_explicit(&t->chunk[id / SLOT_CHUNK], c, memory_order_release);  // zeroed chunk before it is seen
  }
  atomic_store_explicit(slot_ref(t, id), p, memory_order_release);  // the object's contents before its pointer
  atomic_store_explicit(&t->n, id + 1, memory_order_release);        // the slot before the id that reaches it
  return id;
}

static void slots_free(slots_t *t) {
  for (int i = 0; i < SLOT_CHUNKS; i++) free(atomic_load_explicit(&t->chunk[i], memory_order_relaxed));
}

// ---------------------------------------------------------------- the engine's records
enum { CONN_NEW, CONN_UP, CONN_DEAD, CONN_GONE };
// The progress thread: running; in epoll_wait on the worker, without / with a timeout; leaving the worker to a spinner.
enum { PT_AWAKE, PT_IDLE, PT_BUSY, PT_DEFERRED };  // GONE: dead and its endpoint closed

typedef struct engine engine_t;

typedef struct conn {
  engine_t *e;
  int id;
  ucp_ep_h ep;              // written before state becomes UP (release); used only by threads holding a reference
  _Atomic int state;        // CONN_*
  _Atomic int users;        // threads between conn_ref and conn_unref (issuing operations on ep)
  _Atomic int ep_closed;    // the endpoint close was started (by exactly one thread)
  pthread_mutex_t mu;       // guards err and announced
  int announced;            // the user knows this connection (it gets a "closed" event when it dies)
  _Atomic int authed;       // 1: trusted (outgoing, or hn_authenticate); 0: a stranger (accepted, pre-authentication)
  _Atomic int preauth_msgs; // messages a stranger sent
  int64_t accepted_ns;      // when it was accepted (a stranger's deadline counts from it)
  _Atomic int64_t last_rx_ns;  // when something last arrived from the peer (relaxed: a liveness heuristic)
  int64_t last_ping_ns;     // when the progress thread last probed it (its own)
  _Atomic int64_t last_pong_ns;  // when we last answered its probe (a stranger's pings are answered at most every 100 ms)
  struct conn *stranger_next;  // on the engine's list of strangers (under conn_mu)
  char peer[96];
  char err[256];
  struct conn *reap_next;   // on the engine's reap list (under conn_mu)
  // hn_store64's ordering (see there): puts issued, and the stores waiting for a flush to cover them (FIFO).
  _Atomic uint64_t put_seq; // puts issued on ep (incremented after each is issued: release; read with acquire)
  pthread_mutex_t st_mu;    // guards the fields below; never held across a UCP call (callbacks take it)
  struct pstore *st_head, *st_tail;
  uint64_t flushed_seq;     // puts (by put_seq) known complete in the peer's memory
  uint64_t flush_issued_seq;// the highest put_seq a flush was issued for
  int draining, redrain;    // one thread at a time sends ready stores, in order
} conn_t;

typedef struct pstore { struct pstore *next; uint64_t addr, value, after_seq; } pstore_t;

// A UCX request we may wait for, or whose memory (a copy of the caller's data) lives until it completes.
typedef struct op {
  _Atomic uint32_t done;    // completion word (W_*)
  _Atomic int refs;         // the waiter and the callback
  ucs_status_t status;      // written before done is completed
  engine_t *e;
  int counted;              // counted in e->inflight
  uint64_t hdr[2];          // an AM header (hn_hdr_t), kept until the send completes
  uint64_t amo[2];          // an atomic's operand and reply
  unsigned char data[];     // a copy of the caller's data, when the op owns one
} op_t;

typedef struct pending {    // a request waiting for its reply (on the requesting thread's stack)
  struct pending *next, *prev;
  uint64_t req_id;
  int conn;
  void *reply;
  uint64_t cap;
  int64_t len;              // the full reply length
  int status;               // HN_OK, HN_EDEAD, HN_EFAIL
  int32_t remote_status;    // the replier's status (AM_REPLY header)
  _Atomic uint32_t state;   // completion word (W_*)
  _Atomic int receiving;    // RECV_*: a rendezvous reply is (or was) received straight into `reply`
} pending_t;
enum { RECV_NONE, RECV_BUSY, RECV_DONE };  // pending_t.receiving: RECV_BUSY while UCX may still write `reply`

enum { MSG_DATA, MSG_CLOSED, MSG_DROPPED, MSG_PLACED, MSG_PLACE };  // PLACED: an AM_PLACE's data is in; PLACE: copy it to `dest`
typedef struct msg {
  struct msg *next;
  int kind, conn;
  uint64_t req_id, len, dest;
  unsigned char *data;      // malloc'd, owned
  _Atomic int ready;        // 0 while a rendezvous message's data is still arriving (it holds its place in the queue)
} msg_t;

typedef struct handler { uint32_t type; hn_handler_fn fn; void *ctx; struct handler *retired; } handler_t;
typedef struct rkey { ucp_rkey_h rk; int conn; uint64_t base, len; struct rkey *next; } rkey_t;
typedef struct map { struct map *next; uint64_t addr, len; ucp_mem_h memh; } map_t;
typedef struct { uint64_t req_id; int32_t status; uint32_t flags; } hn_hdr_t;
_Static_assert(sizeof(hn_hdr_t) == 16, "hn_hdr_t is 16 bytes on the wire");

enum { CNT_MSGS_IN, CNT_HANDLED, CNT_QUEUED, CNT_REPLIES_IN, CNT_LATE_REPLIES, CNT_SENT_IMMEDIATE, CNT_SENT_COPIED,
       CNT_SENT_ZCOPY, CNT_RNDV_IN, CNT_ACCEPTED, CNT_CONNS_DIED, CNT_PT_SLEEPS, CNT_PT_WAKEUPS, CNT_PT_DEFERS, CNT_WAKE_WRITES,
       CNT_WAITS_SPUN, CNT_WAITS_SLEPT, CNT_NEXT_SPUN, CNT_NEXT_SLEPT, CNT_STORES_IN, CNT_BAD_STORES, CNT_STORE_FLUSHES,
       CNT_ARM_BUSY, CNT_PREAUTH_CLOSED, CNT_PLACES_IN, CNT_BAD_PLACES, CNT_REPLIES_IN_PLACE,
       CNT_REPLIES_ABANDONED, CNT_WAITS_WOKEN, CNT_WAITS_RECHECKED, CNT_N };
static const char *const counter_names[CNT_N] = {
    "msgs_in", "handled_in_c", "queued", "replies_in", "late_replies", "sent_immediate", "sent_copied",
    "sent_zcopy", "rndv_in", "accepted", "conns_died", "pt_sleeps", "pt_wakeups", "pt_defers", "wake_writes",
    "waits_spun", "waits_slept", "next_spun", "next_slept", "stores_in", "bad_stores", "store_flushes", "arm_busy",
    "preauth_closed", "places_in", "bad_places", "replies_in_place",
    "replies_abandoned", "waits_woken", "waits_rechecked"};

struct engine {
  ucp_context_h ctx;
  ucp_worker_h worker;
  ucp_listener_h listener;
  _Atomic int listening;     // the listener is there (a server: from hn_create, or later from hn_listen)
  int port;
  int worker_fd, wake_fd, epoll_fd;
  pthread_t thread;
  int thread_started;
  _Atomic int stop;          // the progress thread leaves (release store; acquire load)
  _Atomic int closing;       // hn_destroy began (seq_cst: pairs with enter()'s seq_cst increment of calls)
  _Atomic int calls;         // threads inside hn_* calls
  _Atomic int pt_sleeping;   // PT_*: the progress thread sleeps (or is about to), and how (seq_cst, see wake_progress)
  _Atomic int waiters;       // threads sleeping on something only progress brings (seq_cst, see wake_progress)
  _Atomic int spinners;      // threads spinning on ucp_worker_progress themselves (a hint; seq_cst where a spinner
                             // stops, so that a progress thread deferring to it is sure to be woken: see wake_progress)
  _Atomic int64_t inflight;  // requests issued without a waiter and not completed (seq_cst, see wake_progress)
  _Atomic int lender;        // a thread lent to progress the worker while it idles (hn_lend) holds this (acq/rel)
  _Atomic int64_t lender_since;  // when the lender's idle spell began (relaxed)
  _Atomic int lend_steal;    // a thread whose idle spell began later asks for the loan (relaxed)
  _Atomic int issuing;       // threads between conn_ref and conn_unref: a lender leaves the worker's lock to them (relaxed)
  _Atomic int64_t wait_ewma, next_ewma;  // how long waits (wait_word, hn_next) took, smoothed (relaxed: heuristics)
  _Atomic(_Atomic uint64_t *) sleep_word;  // hn_set_sleep_word: also counts hn_wait_ge64's sleepers (seq_cst)
  _Atomic uint64_t next_req; // request ids (relaxed: only uniqueness matters)
  _Atomic int closing_eps;   // endpoint closes not completed
  _Atomic uint64_t counters[CNT_N];  // statistics (relaxed)

  pthread_mutex_t conn_mu;   // conns (adding), the reap list, the strangers
  slots_t conns;
  conn_t *reap;
  conn_t *strangers;         // accepted connections not authenticated yet (only with pre-authentication limits)
  int nstrangers;
  _Atomic int preauth;       // hn_set_preauth was called: accepted connections start as strangers
  int rma;                   // made with HN_RMA: one-sided operations
  _Atomic int64_t dead_ns;   // a connection silent this long is failed (0: never; hn_set_liveness)
  int64_t live_next_ns;      // when the progress thread looks at liveness next: the earliest probe or failure due (its own)
  int64_t live_dead_ns;      // ...computed for this dead time (its own: a change of dead_ns looks at once)
  uint64_t preauth_bytes;    // the largest message a stranger may send
  int preauth_msgs, preauth_conns;  // how many messages a stranger may send; how many strangers at a time
  int64_t preauth_ns;        // how long a stranger has to authenticate
  _Atomic int reap_flag;     // the reap list is not empty (release store after linking; acquire load)

  pthread_mutex_t pend_mu;   // the pending requests
  pending_t *pend;

  pthread_mutex_t q_mu;      // the message queue
  pthread_cond_t q_cond;
  msg_t *q_head, *q_tail;
  _Atomic int q_count;       // messages queued (a lock-free peek for spinning readers; release/acquire)

  pthread_mutex_t h_mu;      // handler registration
  _Atomic(handler_t *) handlers[MAX_HANDLERS];
  _Atomic int nhandlers;     // slots in use (release after the slot is filled; acquire)
  handler_t *retired;        // replaced entries, freed at destroy (a progressing thread may still be using one)
  unsigned char *scratch;    // reply room for handlers (one dispatcher at a time: run_arrivals)
  _Atomic(hn_placer_fn) placer;  // who may write where with AM_PLACE (NULL: nobody); set before peers connect
  void *placer_ctx;
  pthread_mutex_t hq_mu;     // messages that arrived, not yet dispatched (FIFO)
  msg_t *hq_head, *hq_tail;
  _Atomic int hq_count;      // their number (seq_cst: see run_arrivals)
  _Atomic int hq_running;    // a thread is dispatching (acquire/release: hands the dispatcher's state over)

  pthread_mutex_t map_mu;
  map_t *maps;

  pthread_mutex_t rkey_mu;   // rkeys (adding, releasing), the free ids
  slots_t rkeys;
  int *rkey_free;
  int rkey_nfree, rkey_free_cap;
};

static unsigned progress(engine_t *e);  // ucp_worker_progress + dispatch of what arrived (run_arrivals)

static inline void count(engine_t *e, int which, uint64_t n) {
  atomic_fetch_add_explicit(&e->counters[which], n, memory_order_relaxed);
}

// ---------------------------------------------------------------- entering and leaving the engine
// hn_destroy waits for the calls inside the engine to leave before it frees anything. Dekker-style: a caller
// increments calls, then reads closing; hn_destroy sets closing, then reads calls (all seq_cst), so either the
// caller sees closing (and backs out) or hn_destroy sees the caller (and waits for it).
static int enter(engine_t *e) {
  if (!e) return 0;
  atomic_fetch_add_explicit(&e->calls, 1, memory_order_seq_cst);
  if (atomic_load_explicit(&e->closing, memory_order_seq_cst)) {
    atomic_fetch_sub_explicit(&e->calls, 1, memory_order_release);
    return 0;
  }
  return 1;
}
static void leave(engine_t *e) { atomic_fetch_sub_explicit(&e->calls, 1, memory_order_release); }  // release: our accesses before hn_destroy frees

// Waking the progress thread, for one of three reasons:
//   WAKE_WAITER  a thread sleeps until progress brings what it waits for: the worker must be watched, and polled
//                every BUSY_POLL_MS (a safety net for work that raises no event);
//   WAKE_WORK    work only the progress thread looks after: requests in flight that nobody waits for, dead
//                connections to reap; a progress thread that defers to a spinner is left alone while one spins (the
//                spinner progresses the work, and wakes it when it stops). One asleep for BUSY_POLL_MS (PT_BUSY) is
//                woken too when nobody spins: a send UCX queued (its FIFO full) leaves only when the worker is
//                progressed, and waiting out the poll made whole runs settle at 0.5-1 ms round trips (seen on 2 vCPUs:
//                the client's waits slept, its SUBMITs queued, each left at the progress thread's next look);
//   WAKE_SPIN    a spinner stopped: a progress thread that left the worker to it must watch it again.
// Only the sleep states that need it are woken (each wakeup costs both threads a system call, and on a VM often
// an interrupt to an idle vCPU). The handshake is Dekker's: a waker first publishes its reason (waiters,
// inflight, reap_flag incremented or spinners decremented, seq_cst) then reads pt_sleeping (seq_cst); the
// progress thread first publishes its state, then reads the reasons (seq_cst) before it sleeps. Either it sees
// the reason, or the waker sees it asleep and writes the eventfd.
enum { WAKE_WAITER, WAKE_WORK, WAKE_SPIN };
static void wake_progress(engine_t *e, int why) {
  int how = atomic_load_explicit(&e->pt_sleeping, memory_order_seq_cst);
  int wake = why == WAKE_WAITER ? how == PT_IDLE || how == PT_DEFERRED
           : why == WAKE_WORK   ? how == PT_IDLE || ((how == PT_DEFERRED || how == PT_BUSY) && !atomic_load_explicit(&e->spinners, memory_order_seq_cst))
                                : how == PT_DEFERRED;
  if (wake) {
    uint64_t one = 1;
    if (write(e->wake_fd, &one, sizeof one) < 0) { /* the counter is saturated: it is awake anyway */ }
    count(e, CNT_WAKE_WRITES, 1);
  }
}

// ---------------------------------------------------------------- ops (UCX requests)
static op_t *op_new(engine_t *e, size_t data_bytes, int refs) {
  op_t *op = malloc(sizeof *op + data_bytes);
  if (!op) return NULL;
  atomic_init(&op->done, W_PENDING);
  atomic_init(&op->refs, refs);
  op->status = UCS_OK;
  op->e = e;
  op->counted = 0;
  return op;
}

static void op_unref(op_t *op) {
  // acq_rel: the last owner sees everything the other one did to the op before freeing it.
  if (atomic_fetch_sub_explicit(&op->refs, 1, memory_order_acq_rel) == 1) free(op);
}

static void op_finish(op_t *op, ucs_status_t status) {
  op->status = status;
  if (op->counted) atomic_fetch_sub_explicit(&op->e->inflight, 1, memory_order_seq_cst);
  word_complete(&op->done);  // release: status before done
  op_unref(op);
}

// The completion callback of every send-like request (send, put, get, atomic, flush, close) we issue.
static void op_cb(void *request, ucs_status_t status, void *user_data) {
  ucp_request_free(request);  // allowed before completion handling: the request is complete
  op_finish(user_data, status);
}

// What an nbx call returned, for an op with a waiter (refs 2): NULL (done at once) and errors complete the op here
// (the callback will not run); a request completes it from the callback. Returns the immediate status.
static ucs_status_t op_issued(op_t *op, ucs_status_ptr_t s) {
  if (UCS_PTR_IS_PTR(s)) return UCS_INPROGRESS;
  op_finish(op, UCS_PTR_STATUS(s));  // drops the callback's reference
  return UCS_PTR_STATUS(s);
}

// How long a waiter spins before it sleeps: twice the typical wait, within [SPIN_MIN_NS, SPIN_MAX_NS]. Waking a
// sleeper costs tens to hundreds of microseconds on a VM (a futex or epoll wakeup, often an interrupt to an idle
// vCPU), at both ends of a ping-pong: with a fixed 50 us spin, a round trip that once takes longer than that makes
// the next one sleep too, and the pair settles at ~150-250 us instead of ~10-30 us. Waits that end within
// SPIN_LEARN_NS teach how long to spin, slept through or not; longer ones (a slow server, an idle queue) pull the
// budget back down. The cap is low because spinning takes a CPU from the peer (on one host: the server computing
// the answer). The learning reaches past the cap: waits that sleep take the wakeup's time on top, so a pair settled
// just above the cap (seen: 250 us round trips in a whole run) still raises the budget to it, spins, and recovers.
static int64_t spin_budget(_Atomic int64_t *ewma) {
  int64_t b = 2 * atomic_load_explicit(ewma, memory_order_relaxed);
  return b < SPIN_MIN_NS ? SPIN_MIN_NS : b > SPIN_MAX_NS ? SPIN_MAX_NS : b;
}
static void spin_learn(_Atomic int64_t *ewma, int64_t took) {
  int64_t v = atomic_load_explicit(ewma, memory_order_relaxed);  // a racy update loses a sample at worst
  int64_t target = took <= SPIN_LEARN_NS ? took : SPIN_MIN_NS / 4;
  atomic_store_explicit(ewma, v + (target - v) / 8, memory_order_relaxed);
}

// A spinner got what it waited for and stops progressing the worker. A progress thread that left the worker to it
// (PT_DEFERRED) looks again within BUSY_POLL_MS anyway; wake it now if something needs progress meanwhile: requests
// in flight (e.g. the flush before a store64), or, in a listening engine (a server), C handlers: its peers wait for
// their answers. A client's handlers only bring values in (hcq's PUSHes), which a thread that waits for one
// progresses itself, or sleeps as a waiter (which wakes the progress thread): waking it at the end of every wait
// would put a third thread on the CPUs, right when the waiter goes back to work (on 2 vCPUs, with a server on the
// host, that costs the next round trip most).
static void spin_ended(engine_t *e) {
  if (atomic_load_explicit(&e->inflight, memory_order_seq_cst) > 0 ||
      (atomic_load_explicit(&e->listening, memory_order_relaxed) && atomic_load_explicit(&e->nhandlers, memory_order_relaxed) > 0))
    wake_progress(e, WAKE_SPIN);
}

// A spinner that has spun a while lets other threads of its CPU run now and then: with few CPUs (two, on small
// VMs) the thread it waits for (the peer's progress thread, if the peer is on this host) may need this one.
#define SPIN_YIELD_NS 20000LL
static inline void spin_yield(int64_t *next_yield, int64_t now) {
  if (now >= *next_yield) { sched_yield(); *next_yield = now + SPIN_YIELD_NS; }
}

// Waits until *w is W_DONE or the deadline passes: first spinning on ucp_worker_progress (spin_budget), then
// sleeping on the futex (the progress thread polls the worker while anyone sleeps here). 1: done, 0: timed out.
static int wait_word(engine_t *e, _Atomic uint32_t *w, int64_t deadline) {
  if (word_done(w)) return 1;
  int64_t start = now_ns();
  int64_t spin_end = start + spin_budget(&e->wait_ewma);
  if (spin_end > deadline) spin_end = deadline;
  atomic_fetch_add_explicit(&e->spinners, 1, memory_order_relaxed);
  int done = 0;
  for (int64_t next_yield = start + SPIN_MIN_NS / 2;;) {
    progress(e);
    if ((done = word_done(w))) break;
    int64_t t = now_ns();
    if (t >= spin_end) break;
    spin_yield(&next_yield, t);
  }
  atomic_fetch_sub_explicit(&e->spinners, 1, memory_order_seq_cst);
  if (done) {
    count(e, CNT_WAITS_SPUN, 1);
    spin_learn(&e->wait_ewma, now_ns() - start);
    spin_ended(e);
    return 1;
  }
  count(e, CNT_WAITS_SLEPT, 1);
  atomic_fetch_add_explicit(&e->waiters, 1, memory_order_seq_cst);  // seq_cst: see wake_progress
  wake_progress(e, WAKE_WAITER);
  for (;;) {
    uint32_t v = atomic_load_explicit(w, memory_order_acquire);
    if (v == W_DONE) { done = 1; break; }
    // relaxed on failure: we re-read the word at the top of the loop
    if (v == W_PENDING && !atomic_compare_exchange_strong_explicit(w, &v, W_SLEEPING, memory_order_acq_rel, memory_order_relaxed)) continue;
    int64_t t = now_ns();
    if (t >= deadline) break;
    futex_wait(w, W_SLEEPING, deadline - t < SLEEP_SLICE_NS ? deadline - t : SLEEP_SLICE_NS);
  }
  atomic_fetch_sub_explicit(&e->waiters, 1, memory_order_seq_cst);
  spin_learn(&e->wait_ewma, now_ns() - start);
  return done;
}

// A thread of the process that would spin idle anyway (hcq serve's queue threads, waiting for work) lends itself:
// while it does, it progresses the worker in the progress thread's place (which defers to it as to any spinner),
// so a message that brings it work (a SUBMIT) is handled by the very thread that runs the work: no thread is woken
// and no second one spins beside it for the CPUs. One thread at a time (lender); the others just spin.
// idle 1: progress once if this thread holds the loan or can take it (since: when its idle spell began): 1 when
// something arrived (spin on at once), 0 when nothing did (pause as an idle spinner does: that leaves UCX's worker
// lock free a while for a thread that sends, such as another queue's store hook), -1 when another thread holds the
// loan or the engine is closing.
// idle 0 (the thread goes to sleep) or 2 (to work): give the loan back. The progress thread watches the worker again:
// woken at once for 0; for 2 it looks within BUSY_POLL_MS (the thread is likely back before that, and waking it
// each time would put a third thread on the CPUs, beside the one at work and a client spinning on this host).
// Not inside a handler: the handlers it runs would run within the handler that called it.
static _Thread_local engine_t *tl_lent;
static void lend_end(engine_t *e, int wake) {
  tl_lent = NULL;
  atomic_fetch_sub_explicit(&e->spinners, 1, memory_order_seq_cst);  // seq_cst: see wake_progress
  atomic_store_explicit(&e->lender, 0, memory_order_release);
  if (wake) wake_progress(e, WAKE_SPIN);
  leave(e);
}

EXPORT int hn_lend(void *ep, int idle, int64_t since) {
  engine_t *e = ep;
  if (idle != 1) {
    if (tl_lent == e) lend_end(e, idle == 0);
    return 0;
  }
  if (tl_lent != e) {
    int free_ = 0;
    if (tl_lent || tl_in_cb) return -1;
    int64_t held_since = atomic_load_explicit(&e->lender_since, memory_order_relaxed);
    if (atomic_load_explicit(&e->lend_steal, memory_order_relaxed) && since <= held_since) return -1;  // (left to the taker)
    if (atomic_load_explicit(&e->lender, memory_order_relaxed) ||
        !atomic_compare_exchange_strong_explicit(&e->lender, &free_, 1, memory_order_acquire, memory_order_relaxed)) {
      // A thread that was at work more recently than the lender takes the loan over: it is the likelier to be handed
      // the next work (its client's next launch), which it then runs without being woken. (An older one does not, so
      // two idle threads do not pass it back and forth.)
      if (since > held_since) atomic_store_explicit(&e->lend_steal, 1, memory_order_relaxed);
      return -1;
    }
    if (!enter(e)) {  // (held until the loan ends: hn_destroy waits for it)
      atomic_store_explicit(&e->lender, 0, memory_order_release);
      return -1;
    }
    tl_lent = e;
    atomic_fetch_add_explicit(&e->spinners, 1, memory_order_relaxed);
    atomic_store_explicit(&e->lender_since, since, memory_order_relaxed);
    atomic_store_explicit(&e->lend_steal, 0, memory_order_relaxed);
  }
  if (atomic_load_explicit(&e->closing, memory_order_relaxed)) return -1;  // (given back at idle 0)
  if (atomic_load_explicit(&e->lend_steal, memory_order_relaxed)) {  // handed over (the taker progresses at its next turn)
    lend_end(e, 0);
    return -1;
  }
  // Another thread is about to issue an operation (a store hook's PUSH, a reply): it needs the worker's lock, which a
  // lender calling ucp_worker_progress back to back would hardly ever leave free.
  if (atomic_load_explicit(&e->issuing, memory_order_relaxed) > 0) return 0;
  return progress(e) > 0;
}

// hn_wait_ge64's sleepers (all engines of the process), and the wake of other sleepers (hn_set_waker).
typedef void (*hn_waker_fn)(void *addr, uint64_t value);
static _Atomic int local_sleepers;
static _Atomic(hn_waker_fn) other_sleepers;

// ---------------------------------------------------------------- connections
static conn_t *conn_at(engine_t *e, int id) { return slot_get(&e->conns, id); }

static const char *conn_why(conn_t *c, char *buf, size_t n) {
  pthread_mutex_lock(&c->mu);
  snprintf(buf, n, "%s", c->err[0] ? c->err : "closed");
  pthread_mutex_unlock(&c->mu);
  return buf;
}

// A reference on a live connection, for issuing operations on its endpoint; NULL (error set: HN_EFAIL for a bad
// id, HN_EDEAD for a dead connection, in *code) otherwise. The endpoint is not closed while references exist.
static conn_t *conn_ref(engine_t *e, int id, const char *what, int *code) {
  conn_t *c = conn_at(e, id);
  if (!c) { *code = fail(HN_EFAIL, "%s: no connection %d", what, id); return NULL; }
  // seq_cst increment then seq_cst load of state; the reaper sets state DEAD (seq_cst) before it reads users
  // (seq_cst): either we see DEAD, or it sees our reference and leaves the endpoint alone.
  atomic_fetch_add_explicit(&c->users, 1, memory_order_seq_cst);
  if (atomic_load_explicit(&c->state, memory_order_seq_cst) != CONN_UP) {
    atomic_fetch_sub_explicit(&c->users, 1, memory_order_release);
    char why[256];
    *code = fail(HN_EDEAD, "%s on the connection to %s: the connection is dead (%s)", what, c->peer, conn_why(c, why, sizeof why));
    return NULL;
  }
  atomic_fetch_add_explicit(&e->issuing, 1, memory_order_relaxed);
  return c;
}
// release: our use of the endpoint happens before the reaper (acquire load of users) closes it.
static void conn_unref(conn_t *c) {
  atomic_fetch_sub_explicit(&c->e->issuing, 1, memory_order_relaxed);
  atomic_fetch_sub_explicit(&c->users, 1, memory_order_release);
}

static void queue_push(engine_t *e, msg_t *m) {
  m->next = NULL;
  pthread_mutex_lock(&e->q_mu);
  if (e->q_tail) e->q_tail->next = m; else e->q_head = m;
  e->q_tail = m;
  atomic_fetch_add_explicit(&e->q_count, 1, memory_order_release);  // release: the message before the count spinners read
  pthread_cond_signal(&e->q_cond);
  pthread_mutex_unlock(&e->q_mu);
}

static void pending_finish(pending_t *p, int status) {
  p->status = status;
  word_complete(&p->state);  // release: status (and reply bytes) before the waiter sees DONE; p may be gone after this
}

// The connection died (peer failure, local close, failed connect): record why (the first reason wins), fail the
// requests waiting on it, queue a "closed" event if the user knows it, and hand the endpoint to the reaper.
static void conn_fail(conn_t *c, const char *why) {
  engine_t *e = c->e;
  pthread_mutex_lock(&c->mu);
  if (!c->err[0]) snprintf(c->err, sizeof c->err, "%s", why);
  int announced = c->announced;
  // seq_cst: see conn_ref. Under mu, so hn_connect's announce (which checks state under mu) cannot miss it.
  int old = atomic_exchange_explicit(&c->state, CONN_DEAD, memory_order_seq_cst);
  if (old == CONN_GONE) atomic_store_explicit(&c->state, CONN_GONE, memory_order_seq_cst);
  pthread_mutex_unlock(&c->mu);
  if (old == CONN_DEAD || old == CONN_GONE) return;
  count(e, CNT_CONNS_DIED, 1);
  pthread_mutex_lock(&e->pend_mu);
  for (pending_t *p = e->pend, *next; p; p = next) {
    next = p->next;
    if (p->conn != c->id) continue;
    if (p->prev) p->prev->next = p->next; else e->pend = p->next;
    if (p->next) p->next->prev = p->prev;
    p->next = p->prev = NULL;
    pending_finish(p, HN_EDEAD);
  }
  pthread_mutex_unlock(&e->pend_mu);
  if (announced) {
    msg_t *m = calloc(1, sizeof *m);
    if (m) { m->kind = MSG_CLOSED; m->conn = c->id; queue_push(e, m); }
  }
  pthread_mutex_lock(&e->conn_mu);
  c->reap_next = e->reap;
  e->reap = c;
  pthread_mutex_unlock(&e->conn_mu);
  atomic_store_explicit(&e->reap_flag, 1, memory_order_seq_cst);  // release: the list before the flag; seq_cst: see wake_progress
  wake_progress(e, WAKE_WORK);
}

static void rkeys_drop_conn(engine_t *e, int conn);

static void close_cb(void *request, ucs_status_t status, void *user_data) {
  (void)status;
  ucp_request_free(request);
  atomic_fetch_sub_explicit(&((engine_t *)user_data)->closing_eps, 1, memory_order_release);
}

// Close a dead connection's endpoint (forcibly: no handshake with a peer that may be gone). Only once no thread holds
// a reference: returns 0 without doing anything while one does (wait_users 0), or waits for them (wait_users 1;
// they only hold one while issuing an operation). Must not run inside a UCX callback.
static int conn_close_ep(conn_t *c, int wait_users) {
  engine_t *e = c->e;
  // acquire: the users' accesses to the endpoint (released by conn_unref) happen before we close it.
  while (atomic_load_explicit(&c->users, memory_order_seq_cst) != 0) {
    if (!wait_users) return 0;
    sched_yield();
  }
  atomic_thread_fence(memory_order_acquire);
  if (atomic_exchange_explicit(&c->ep_closed, 1, memory_order_acq_rel)) return 1;  // someone else closes it
  rkeys_drop_conn(e, c->id);
  if (c->ep) {
    ucp_request_param_t prm = {.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS | UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA,
                               .flags = UCP_EP_CLOSE_FLAG_FORCE, .cb.send = close_cb, .user_data = e};
    atomic_fetch_add_explicit(&e->closing_eps, 1, memory_order_relaxed);
    ucs_status_ptr_t s = ucp_ep_close_nbx(c->ep, &prm);
    if (!UCS_PTR_IS_PTR(s)) atomic_fetch_sub_explicit(&e->closing_eps, 1, memory_order_relaxed);
  }
  atomic_store_explicit(&c->state, CONN_GONE, memory_order_seq_cst);
  return 1;
}

// Fail the connection and close its endpoint now (waits for references to drop): after this UCX no longer touches
// memory of requests issued on it.
static void conn_abort(conn_t *c, const char *why) {
  conn_fail(c, why);
  conn_close_ep(c, 1);
}

// The progress thread closes the endpoints of connections that died.
static void reap(engine_t *e) {
  atomic_store_explicit(&e->reap_flag, 0, memory_order_relaxed);
  atomic_thread_fence(memory_order_seq_cst);  // clear the flag before taking the list: a later conn_fail sets it again
  pthread_mutex_lock(&e->conn_mu);
  conn_t *list = e->reap;
  e->reap = NULL;
  pthread_mutex_unlock(&e->conn_mu);
  conn_t *keep = NULL;
  while (list) {
    conn_t *c = list;
    list = c->reap_next;
    if (!conn_close_ep(c, 0)) { c->reap_next = keep; keep = c; }
  }
  if (keep) {
    pthread_mutex_lock(&e->conn_mu);
    conn_t *last = keep;
    while (last->reap_next) last = last->reap_next;
    last->reap_next = e->reap;
    e->reap = keep;
    pthread_mutex_unlock(&e->conn_mu);
    atomic_store_explicit(&e->reap_flag, 1, memory_order_release);
  }
}

static void ep_error_cb(void *arg, ucp_ep_h ep, ucs_status_t status) {
  (void)ep;
  conn_fail(arg, ucs_status_string(status));
}

static conn_t *conn_new(engine_t *e, const char *peer, int announced) {
  conn_t *c = calloc(1, sizeof *c);
  if (!c) return NULL;
  c->e = e;
  pthread_mutex_init(&c->mu, NULL);
  pthread_mutex_init(&c->st_mu, NULL);
  c->announced = announced;
  atomic_init(&c->authed, 1);
  atomic_init(&c->last_rx_ns, now_ns());
  atomic_init(&c->state, CONN_NEW);
  snprintf(c->peer, sizeof c->peer, "%s", peer);
  pthread_mutex_lock(&e->conn_mu);
  c->id = slot_add(&e->conns, c);
  pthread_mutex_unlock(&e->conn_mu);
  if (c->id < 0) { pthread_mutex_destroy(&c->mu); pthread_mutex_destroy(&c->st_mu); free(c); return NULL; }
  return c;
}

// The connection an endpoint belongs to (its user data), inside callbacks: -1 if unknown.
static int conn_of_ep(ucp_ep_h ep) {
  if (!ep) return -1;
  ucp_ep_attr_t attr = {.field_mask = UCP_EP_ATTR_FIELD_USER_DATA};
  if (ucp_ep_query(ep, &attr) != UCS_OK || !attr.user_data) return -1;
  return ((conn_t *)attr.user_data)->id;
}

static void format_sockaddr(const struct sockaddr_storage *ss, char *buf, size_t n) {
  char host[INET6_ADDRSTRLEN] = "?";
  int port = 0;
  if (ss->ss_family == AF_INET) {
    const struct sockaddr_in *a = (const struct sockaddr_in *)ss;
    inet_ntop(AF_INET, &a->sin_addr, host, sizeof host);
    port = ntohs(a->sin_port);
    snprintf(buf, n, "%s:%d", host, port);
  } else if (ss->ss_family == AF_INET6) {
    const struct sockaddr_in6 *a = (const struct sockaddr_in6 *)ss;
    inet_ntop(AF_INET6, &a->sin6_addr, host, sizeof host);
    port = ntohs(a->sin6_port);
    snprintf(buf, n, "[%s]:%d", host, port);
  } else {
    snprintf(buf, n, "?");
  }
}

static int resolve(const char *ip, int port, int passive, struct sockaddr_storage *out, socklen_t *len) {
  struct addrinfo hints = {.ai_family = AF_UNSPEC, .ai_socktype = SOCK_STREAM, .ai_flags = AI_NUMERICSERV | (passive ? AI_PASSIVE : 0)};
  struct addrinfo *res = NULL;
  char service[16];
  snprintf(service, sizeof service, "%d", port);
  int rc = getaddrinfo(ip, service, &hints, &res);
  if (rc != 0 || !res) return fail(HN_EFAIL, "cannot resolve %s: %s", ip, gai_strerror(rc));
  memcpy(out, res->ai_addr, res->ai_addrlen);
  *len = res->ai_addrlen;
  freeaddrinfo(res);
  return 0;
}

// ---------------------------------------------------------------- pending requests
static void pend_add(engine_t *e, pending_t *p) {
  pthread_mutex_lock(&e->pend_mu);
  p->prev = NULL;
  p->next = e->pend;
  if (e->pend) e->pend->prev = p;
  e->pend = p;
  pthread_mutex_unlock(&e->pend_mu);
}

// Take p off the list if it is still there (1): then nobody else will complete it. 0: a completer took it.
static int pend_remove(engine_t *e, pending_t *p) {
  int found = 0;
  pthread_mutex_lock(&e->pend_mu);
  for (pending_t *q = e->pend; q; q = q->next) {
    if (q != p) continue;
    if (p->prev) p->prev->next = p->next; else e->pend = p->next;
    if (p->next) p->next->prev = p->prev;
    found = 1;
    break;
  }
  pthread_mutex_unlock(&e->pend_mu);
  return found;
}

static pending_t *pend_take(engine_t *e, uint64_t req_id, int conn) {
  pthread_mutex_lock(&e->pend_mu);
  pending_t *p = e->pend;
  while (p && (p->req_id != req_id || p->conn != conn)) p = p->next;  // (a reply counts only on its request's connection)
  if (p) {
    if (p->prev) p->prev->next = p->next; else e->pend = p->next;
    if (p->next) p->next->prev = p->prev;
  }
  pthread_mutex_unlock(&e->pend_mu);
  return p;
}

static void deliver_reply(engine_t *e, int conn, uint64_t req_id, int32_t status, const void *data, uint64_t len) {
  count(e, CNT_REPLIES_IN, 1);
  pending_t *p = pend_take(e, req_id, conn);
  if (!p) { count(e, CNT_LATE_REPLIES, 1); return; }  // its requester gave up (timed out)
  // The requester waits until we complete p (it found p off the list), so its reply buffer stays valid meanwhile.
  if (status == 0) {
    if (len && p->cap && data != p->reply) memcpy(p->reply, data, len < p->cap ? len : p->cap);  // (received in place: there already)
    p->len = (int64_t)len;
  }
  p->remote_status = status;
  pending_finish(p, status == 0 ? HN_OK : HN_EFAIL);
}

// ---------------------------------------------------------------- sending
static int status_code(ucs_status_t st) {
  return st == UCS_ERR_TIMED_OUT ? HN_ETIMEDOUT
       : (st == UCS_ERR_CONNECTION_RESET || st == UCS_ERR_ENDPOINT_TIMEOUT || st == UCS_ERR_UNREACHABLE ||
          st == UCS_ERR_CANCELED || st == UCS_ERR_NOT_CONNECTED || st == UCS_ERR_REJECTED) ? HN_EDEAD : HN_EFAIL;
}

// Send active message `id` on ep so that the caller's data may change as soon as this returns: at once from the
// caller's memory when UCX can, else from a copy freed when the send completes. 0, or a negative code.
static int send_copy(engine_t *e, ucp_ep_h ep, unsigned id, const void *hdr, const void *data, uint64_t len) {
  ucp_request_param_t prm = {.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS | UCP_OP_ATTR_FLAG_FORCE_IMM_CMPL, .flags = UCP_AM_SEND_FLAG_REPLY};
  ucs_status_ptr_t s = ucp_am_send_nbx(ep, id, hdr, sizeof(hn_hdr_t), data, len, &prm);
  if (s == NULL) { count(e, CNT_SENT_IMMEDIATE, 1); return 0; }
  if (UCS_PTR_IS_PTR(s)) {  // should not happen with FORCE_IMM_CMPL; the data is in use: wait for it here
    while (!tl_in_cb && ucp_request_check_status(s) == UCS_INPROGRESS) progress(e);
    ucp_request_free(s);
    return 0;
  }
  if (UCS_PTR_STATUS(s) != UCS_ERR_NO_RESOURCE) return fail(status_code(UCS_PTR_STATUS(s)), "%s", ucs_status_string(UCS_PTR_STATUS(s)));
  op_t *op = op_new(e, len, 1);
  if (!op) return fail(HN_EFAIL, "out of memory copying a %llu-byte message", (unsigned long long)len);
  memcpy(op->hdr, hdr, sizeof(hn_hdr_t));
  if (len) memcpy(op->data, data, len);
  // The callback may run (on another thread) as soon as the request exists: count it in flight before issuing.
  op->counted = 1;
  atomic_fetch_add_explicit(&e->inflight, 1, memory_order_seq_cst);  // seq_cst: see wake_progress
  prm = (ucp_request_param_t){.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS | UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA,
                              .flags = UCP_AM_SEND_FLAG_REPLY, .cb.send = op_cb, .user_data = op};
  s = ucp_am_send_nbx(ep, id, op->hdr, sizeof(hn_hdr_t), op->data, len, &prm);
  count(e, CNT_SENT_COPIED, 1);
  if (UCS_PTR_IS_PTR(s)) { wake_progress(e, WAKE_WORK); return 0; }
  atomic_fetch_sub_explicit(&e->inflight, 1, memory_order_seq_cst);
  free(op);
  if (UCS_PTR_STATUS(s) != UCS_OK) return fail(status_code(UCS_PTR_STATUS(s)), "%s", ucs_status_string(UCS_PTR_STATUS(s)));
  return 0;
}

// Send from the caller's memory; the returned op (refs 2: ours and the callback's) completes when the data is no
// longer needed. NULL with the error set (and *code) when the send failed at once.
static op_t *send_zcopy(engine_t *e, ucp_ep_h ep, unsigned id, const hn_hdr_t *hdr, const void *data, uint64_t len, uint32_t flags, int *code) {
  op_t *op = op_new(e, 0, 2);
  if (!op) { *code = fail(HN_EFAIL, "out of memory"); return NULL; }
  memcpy(op->hdr, hdr, sizeof *hdr);
  ucp_request_param_t prm = {.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS | UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA,
                             .flags = UCP_AM_SEND_FLAG_REPLY | flags, .cb.send = op_cb, .user_data = op};
  ucs_status_t st = op_issued(op, ucp_am_send_nbx(ep, id, op->hdr, sizeof *hdr, data, len, &prm));
  count(e, CNT_SENT_ZCOPY, 1);
  if (st != UCS_OK && st != UCS_INPROGRESS) {
    *code = fail(status_code(st), "%s", ucs_status_string(st));
    op_unref(op);
    return NULL;
  }
  return op;  // the caller waits for it (wait_word wakes the progress thread if it has to sleep)
}

// Wait for an op that uses the caller's memory; past the deadline the connection is closed (so UCX lets go of the
// memory) and HN_ETIMEDOUT returned. Drops our reference. 0 or a negative code (error set).
static int wait_op_or_abort(engine_t *e, conn_t *c, op_t *op, int64_t deadline, const char *what) {
  int rc = 0;
  if (!wait_word(e, &op->done, deadline)) {
    char why[300];
    snprintf(why, sizeof why, "%s did not complete in time; the connection was closed", what);
    conn_abort(c, why);
    wait_word(e, &op->done, deadline_after_ms(ABORT_WAIT_MS));
    rc = fail(HN_ETIMEDOUT, "%s on the connection to %s timed out (the connection was closed so that the buffer is free)", what, c->peer);
  } else if (op->status != UCS_OK) {
    char why[256];
    rc = fail(status_code(op->status), "%s on the connection to %s failed: %s", what, c->peer,
              atomic_load_explicit(&c->state, memory_order_acquire) == CONN_UP ? ucs_status_string(op->status) : conn_why(c, why, sizeof why));
  }
  op_unref(op);
  return rc;
}

// ---------------------------------------------------------------- receiving
static handler_t *handler_find(engine_t *e, uint32_t type) {
  int n = atomic_load_explicit(&e->nhandlers, memory_order_acquire);  // acquire: slots filled before n was raised
  for (int i = 0; i < n; i++) {
    handler_t *h = atomic_load_explicit(&e->handlers[i], memory_order_acquire);  // acquire: the entry's fields
    if (h && h->type == type) return h->fn ? h : NULL;
  }
  return NULL;
}

// A message arrived on connection `conn` (in a callback). It joins the arrival queue; the thread that progressed
// the worker dispatches it (run_arrivals) once ucp_worker_progress has returned. `owned`: data is a malloc'd buffer
// we may keep (else it is copied).
// Messages are dispatched in the order their first callback came (the order the peer sent them on the connection):
// a rendezvous message is queued when its callback comes, not ready, and holds back those behind it until its data
// has arrived (so a large PUSH is applied before the small one sent after it).
static void hq_push(engine_t *e, msg_t *m) {
  pthread_mutex_lock(&e->hq_mu);  // lock order: the worker's lock (held here), then hq_mu
  if (e->hq_tail) e->hq_tail->next = m; else e->hq_head = m;
  e->hq_tail = m;
  atomic_fetch_add_explicit(&e->hq_count, 1, memory_order_seq_cst);  // seq_cst: see run_arrivals
  pthread_mutex_unlock(&e->hq_mu);
}

static void deliver_msg(engine_t *e, ucp_ep_h reply_ep, int conn, uint64_t req_id, void *data, uint64_t len, int owned) {
  count(e, CNT_MSGS_IN, 1);
  msg_t *m = calloc(1, sizeof *m);
  unsigned char *copy = owned ? data : malloc(len ? len : 1);
  if (!m || !copy) {
    free(m);
    free(copy);
    if (req_id) {
      hn_hdr_t hdr = {.req_id = req_id, .status = -12};  // -ENOMEM
      send_copy(e, reply_ep, AM_REPLY, &hdr, NULL, 0);
    }
    return;
  }
  if (!owned && len) memcpy(copy, data, len);
  *m = (msg_t){.kind = MSG_DATA, .conn = conn, .req_id = req_id, .len = len, .data = copy, .ready = 1};
  hq_push(e, m);
}

// Something arrived on connection `id` (inside a UCX callback): it is alive.
static void touch(engine_t *e, int id) {
  conn_t *c = id >= 0 ? conn_at(e, id) : NULL;
  if (c) atomic_store_explicit(&c->last_rx_ns, now_ns(), memory_order_relaxed);
}

static int conn_trusted(engine_t *e, int id) {
  conn_t *c = conn_at(e, id);
  return c && atomic_load_explicit(&c->authed, memory_order_acquire);
}

// Dispatch one arrived message: to its C handler (and send the handler's reply), or into hn_next's queue.
static void dispatch(engine_t *e, msg_t *m) {
  if (m->kind == MSG_DROPPED) { free(m->data); free(m); return; }
  if (m->kind == MSG_PLACED) {  // its bytes are in (or its connection died): the range is no longer written
    hn_placer_fn placer = atomic_load_explicit(&e->placer, memory_order_acquire);
    if (placer) placer(e->placer_ctx, m->conn, m->dest, m->len, 1);
    free(m);
    return;
  }
  handler_t *h = NULL;
  if (m->len >= 4) {
    const unsigned char *b = m->data;
    h = handler_find(e, (uint32_t)b[0] | (uint32_t)b[1] << 8 | (uint32_t)b[2] << 16 | (uint32_t)b[3] << 24);
  }
  if (h && !conn_trusted(e, m->conn)) { free(m->data); free(m); return; }  // (a stranger's message goes to hn_next only)
  if (!h) {
    count(e, CNT_QUEUED, 1);
    queue_push(e, m);
    return;
  }
  // One dispatcher at a time (run_arrivals), so one reply buffer serves. The handler counts as "inside a callback":
  // the functions that would block refuse to, the others copy what cannot go out at once.
  tl_in_cb++;
  int64_t r = e->scratch ? h->fn(h->ctx, m->conn, m->data, m->len, e->scratch, HANDLER_REPLY_CAP) : -12;
  tl_in_cb--;
  count(e, CNT_HANDLED, 1);
  if (m->req_id) {
    hn_hdr_t hdr = {.req_id = m->req_id, .status = 0};
    uint64_t n = 0;
    if (r < 0 || (uint64_t)r > HANDLER_REPLY_CAP) hdr.status = r < 0 ? (int32_t)(r < INT32_MIN ? INT32_MIN : r) : INT32_MIN;
    else n = (uint64_t)r;
    int code;
    conn_t *c = conn_ref(e, m->conn, "reply", &code);
    if (c) {
      tl_in_cb++;  // never wait here: copy the reply if it cannot go out at once
      send_copy(e, c->ep, AM_REPLY, &hdr, e->scratch, n);
      tl_in_cb--;
      conn_unref(c);
    }
  }
  free(m->data);
  free(m);
}

// Dispatch the messages that arrived, in arrival order, one thread at a time. C handlers run here, after
// ucp_worker_progress has returned, not inside UCX's callbacks: a handler then holds no UCX lock, so a handler that
// takes a lock which another thread holds while calling hn_* (hcq's server: its store hook, on a queue thread)
// cannot deadlock against it (inside the callback it would hold the worker's lock that thread spins on). Messages
// for hn_next pass through here too, so they reach it after the handled messages that came before them.
static unsigned run_arrivals(engine_t *e) {
  if (tl_in_cb) return 0;  // not from inside a callback or a handler
  unsigned n = 0;
  // acquire: pairs with the release below, so the previous dispatcher's work (and e->scratch) is visible.
  int blocked = 0;  // the head is a rendezvous message still arriving
  while (!blocked && !atomic_exchange_explicit(&e->hq_running, 1, memory_order_acquire)) {
    for (;;) {
      pthread_mutex_lock(&e->hq_mu);
      msg_t *m = e->hq_head;
      if (m && !atomic_load_explicit(&m->ready, memory_order_acquire)) { blocked = 1; m = NULL; }  // acquire: its data
      if (m) {
        e->hq_head = m->next;
        if (!e->hq_head) e->hq_tail = NULL;
        atomic_fetch_sub_explicit(&e->hq_count, 1, memory_order_relaxed);
      }
      pthread_mutex_unlock(&e->hq_mu);
      if (!m) break;
      m->next = NULL;
      dispatch(e, m);
      n++;
    }
    atomic_store_explicit(&e->hq_running, 0, memory_order_seq_cst);
    // A message queued after our last look by a thread that found us running would otherwise wait for the next
    // progress call: look again (seq_cst store above, seq_cst load here; deliver_msg increments with seq_cst).
    // (A blocked head is looked at again by the progress call after its data arrives.)
    if (atomic_load_explicit(&e->hq_count, memory_order_seq_cst) == 0) break;
  }
  return n;
}

// ucp_worker_progress, then the dispatch of what it brought. Every thread progresses the worker through this.
static unsigned progress(engine_t *e) {
  unsigned n = ucp_worker_progress(e->worker);
  if (atomic_load_explicit(&e->hq_count, memory_order_seq_cst)) n += run_arrivals(e);
  return n;
}

typedef struct rndv {
  engine_t *e;
  unsigned id;        // AM_MSG or AM_REPLY
  ucp_ep_h reply_ep;  // valid while the endpoint is open; used only inside callbacks
  int conn;
  hn_hdr_t hdr;
  uint64_t len;
  void *buf;
  msg_t *m;           // AM_MSG: its place in the dispatch queue (owns buf); AM_PLACE: its place (buf is the destination)
  pending_t *p;       // AM_REPLY received straight into p's reply buffer (buf); valid while p->receiving is RECV_BUSY
} rndv_t;

static void rndv_cb(void *request, ucs_status_t status, size_t length, void *user_data) {
  rndv_t *r = user_data;
  ucp_request_free(request);
  if (status == UCS_OK) touch(r->e, r->conn);  // (its last byte arrived just now: a sign of life too)
  tl_in_cb++;
  if (r->id != AM_REPLY) {  // its place in the queue is taken: fill it (or drop it: the connection died mid-transfer)
    if (!(status == UCS_OK && length == r->len) && r->id == AM_MSG) r->m->kind = MSG_DROPPED;
    atomic_store_explicit(&r->m->ready, 1, memory_order_release);  // release: the data before the flag
  } else if (r->p) {  // in the requester's buffer: let the requester go first (p is not touched after), then complete it
    atomic_store_explicit(&r->p->receiving, RECV_DONE, memory_order_release);  // release: UCX's writes of the data before
    if (status == UCS_OK && length == r->len) deliver_reply(r->e, r->conn, r->hdr.req_id, r->hdr.status, r->buf, r->len);
  } else if (status == UCS_OK && length == r->len) {
    deliver_reply(r->e, r->conn, r->hdr.req_id, r->hdr.status, r->buf, r->len);
    free(r->buf);
  } else {
    free(r->buf);  // the connection died mid-transfer: its requests fail through conn_fail
  }
  tl_in_cb--;
  free(r);
}

// The request a rendezvous reply answers, if its reply buffer takes the whole reply: marked RECV_BUSY (under pend_mu,
// so a requester that gives up later sees it), to be received straight into that buffer. NULL otherwise.
static pending_t *reply_in_place(engine_t *e, int conn, const hn_hdr_t *hdr, size_t len) {
  if (!len || hdr->status != 0) return NULL;
  pthread_mutex_lock(&e->pend_mu);
  pending_t *p = e->pend;
  while (p && (p->req_id != hdr->req_id || p->conn != conn)) p = p->next;
  if (p && !(p->reply && p->cap >= len)) p = NULL;
  if (p) atomic_store_explicit(&p->receiving, RECV_BUSY, memory_order_relaxed);  // (published by the unlock)
  pthread_mutex_unlock(&e->pend_mu);
  return p;
}

// Start receiving a rendezvous message into a malloc'd buffer (a reply: into its requester's buffer where it fits);
// handled in rndv_cb.
static ucs_status_t recv_rndv(engine_t *e, unsigned id, ucp_ep_h reply_ep, int conn, const hn_hdr_t *hdr, void *desc, size_t len) {
  count(e, CNT_RNDV_IN, 1);
  rndv_t *r = malloc(sizeof *r);
  pending_t *p = r && id == AM_REPLY ? reply_in_place(e, conn, hdr, len) : NULL;
  void *buf = p ? p->reply : malloc(len ? len : 1);
  if (!r || !buf) { free(r); free(buf); return UCS_ERR_NO_MEMORY; }  // the sender's request fails with this
  if (p) count(e, CNT_REPLIES_IN_PLACE, 1);
  *r = (rndv_t){.e = e, .id = id, .reply_ep = reply_ep, .conn = conn, .hdr = *hdr, .len = len, .buf = buf, .p = p};
  if (id != AM_REPLY) {  // holds its place in the dispatch order from now (see hq_push)
    if (!(r->m = calloc(1, sizeof *r->m))) { free(r); free(buf); return UCS_ERR_NO_MEMORY; }
    count(e, CNT_MSGS_IN, 1);
    *r->m = (msg_t){.kind = MSG_DATA, .conn = conn, .req_id = hdr->req_id, .len = len, .data = buf, .ready = 0};
  }
  ucp_request_param_t prm = {.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FLAG_NO_IMM_CMPL,
                             .cb.recv_am = rndv_cb, .user_data = r};
  ucs_status_ptr_t s = ucp_am_recv_data_nbx(e->worker, desc, buf, len, &prm);
  if (UCS_PTR_IS_ERR(s)) {
    if (p) atomic_store_explicit(&p->receiving, RECV_DONE, memory_order_release);
    else free(buf);
    free(r->m); free(r);
    return UCS_PTR_STATUS(s);
  }
  if (r->m) hq_push(e, r->m);  // (the callback, which may already have run, only sets ready: the queue frees it)
  return UCS_INPROGRESS;  // the descriptor is ours until the receive completes
}

// A message from a stranger (an accepted connection not authenticated yet): within the limits, or the connection is
// closed and the message dropped unread (a rendezvous one is never fetched). Inside a UCX callback.
static int stranger_within_limits(engine_t *e, conn_t *c, size_t len, int rndv) {
  if (atomic_load_explicit(&c->authed, memory_order_acquire)) return 1;
  if (atomic_load_explicit(&c->state, memory_order_acquire) >= CONN_DEAD) return 0;  // (closed already: what is still coming goes)
  int n = atomic_fetch_add_explicit(&c->preauth_msgs, 1, memory_order_relaxed) + 1;
  if (!rndv && len <= e->preauth_bytes && n <= e->preauth_msgs) return 1;
  char why[160];
  snprintf(why, sizeof why, "closed before authenticating: %s", rndv || len > e->preauth_bytes ? "a message too large" : "too many messages");
  count(e, CNT_PREAUTH_CLOSED, 1);
  conn_fail(c, why);
  return 0;
}

// The connection one of our AMs (MSG, REPLY, PLACE: a 16-byte header, copied to *hdr) arrived on, which counts as a
// sign of life; -1 for anything else (not ours: dropped).
static int am_arrival(engine_t *e, const void *header, size_t hlen, const ucp_am_recv_param_t *param, hn_hdr_t *hdr) {
  if (hlen != sizeof *hdr || !(param->recv_attr & UCP_AM_RECV_ATTR_FIELD_REPLY_EP)) return -1;
  memcpy(hdr, header, sizeof *hdr);
  int conn = conn_of_ep(param->reply_ep);
  if (conn >= 0) touch(e, conn);
  return conn;
}

static ucs_status_t am_msg_cb(void *arg, const void *header, size_t hlen, void *data, size_t len, const ucp_am_recv_param_t *param) {
  engine_t *e = arg;
  hn_hdr_t hdr;
  int conn = am_arrival(e, header, hlen, param, &hdr);
  if (conn < 0) return UCS_OK;
  if (!stranger_within_limits(e, conn_at(e, conn), len, !!(param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV))) return UCS_OK;
  if (param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) return recv_rndv(e, AM_MSG, param->reply_ep, conn, &hdr, data, len);
  tl_in_cb++;
  deliver_msg(e, param->reply_ep, conn, hdr.req_id, data, len, 0);
  tl_in_cb--;
  return UCS_OK;
}

static ucs_status_t am_reply_cb(void *arg, const void *header, size_t hlen, void *data, size_t len, const ucp_am_recv_param_t *param) {
  engine_t *e = arg;
  hn_hdr_t hdr;
  int conn = am_arrival(e, header, hlen, param, &hdr);
  if (conn < 0) return UCS_OK;
  if (param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) return recv_rndv(e, AM_REPLY, NULL, conn, &hdr, data, len);
  tl_in_cb++;
  deliver_reply(e, conn, hdr.req_id, hdr.status, data, len);
  tl_in_cb--;
  return UCS_OK;
}

// AM_PLACE: bytes for [dest, dest + len) of this process, from a peer the placer lets write there. They land as they
// arrive (the sender orders the placement after whatever uses the range: hcq's copyin synchronizes first); the message
// holds its place in the dispatch order until they are in, so what the peer sends after it is handled after.
static ucs_status_t am_place_cb(void *arg, const void *header, size_t hlen, void *data, size_t len, const ucp_am_recv_param_t *param) {
  engine_t *e = arg;
  hn_hdr_t hdr;
  int conn = am_arrival(e, header, hlen, param, &hdr);
  conn_t *c = conn >= 0 ? conn_at(e, conn) : NULL;
  if (!c) return UCS_OK;
  uint64_t dest;
  memcpy(&dest, &hdr, sizeof dest);  // (its first word: the address)
  hn_placer_fn placer = atomic_load_explicit(&e->placer, memory_order_acquire);
  const char *refused = !conn_trusted(e, conn) ? "closed: it placed bytes before authenticating"
                        : !placer || placer(e->placer_ctx, conn, dest, len, 0) != 0 ? "closed: it placed bytes outside the memory it may write"
                        : NULL;
  if (refused) {  // (a rendezvous one is never fetched)
    count(e, CNT_BAD_PLACES, 1);
    conn_fail(c, refused);
    return UCS_OK;
  }
  count(e, CNT_PLACES_IN, 1);
  msg_t *m = calloc(1, sizeof *m);
  rndv_t *r = (param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) ? malloc(sizeof *r) : NULL;
  if (!m || (!r && (param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV))) {
    free(m); free(r);
    placer(e->placer_ctx, conn, dest, len, 1);
    conn_fail(c, "closed: out of memory for a placement");
    return UCS_OK;
  }
  *m = (msg_t){.kind = MSG_PLACED, .conn = conn, .len = len, .dest = dest, .ready = 1};
  if (!r) {  // all here already
    if (len) memcpy((void *)(uintptr_t)dest, data, len);
    hq_push(e, m);
    return UCS_OK;
  }
  atomic_store_explicit(&m->ready, 0, memory_order_relaxed);
  *r = (rndv_t){.e = e, .id = AM_PLACE, .conn = conn, .len = len, .buf = (void *)(uintptr_t)dest, .m = m};
  ucp_request_param_t prm = {.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FLAG_NO_IMM_CMPL,
                             .cb.recv_am = rndv_cb, .user_data = r};
  ucs_status_ptr_t s = ucp_am_recv_data_nbx(e->worker, data, r->buf, len, &prm);
  if (UCS_PTR_IS_ERR(s)) {
    free(m); free(r);
    placer(e->placer_ctx, conn, dest, len, 1);
    conn_fail(c, "closed: receiving a placement failed");
    return UCS_PTR_STATUS(s);
  }
  hq_push(e, m);  // (the callback, which may already have run, only sets ready: the queue frees it)
  return UCS_INPROGRESS;
}

static ucs_status_t am_hello_cb(void *arg, const void *header, size_t hlen, void *data, size_t len, const ucp_am_recv_param_t *param) {
  engine_t *e = arg;
  if (hlen != sizeof(hn_hdr_t) || !(param->recv_attr & UCP_AM_RECV_ATTR_FIELD_REPLY_EP) || (param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV)) return UCS_OK;
  hn_hdr_t hdr;
  memcpy(&hdr, header, sizeof hdr);
  touch(e, conn_of_ep(param->reply_ep));
  int ok = len == sizeof HELLO_MAGIC && memcmp(data, HELLO_MAGIC, len) == 0;
  hn_hdr_t rep = {.req_id = hdr.req_id, .status = ok ? 0 : -71};  // -EPROTO
  tl_in_cb++;
  send_copy(e, param->reply_ep, AM_REPLY, &rep, NULL, 0);
  tl_in_cb--;
  return UCS_OK;
}

// A peer's liveness probe: answered at once by this engine (a stranger's at most every 100 ms).
static ucs_status_t am_ping_cb(void *arg, const void *header, size_t hlen, void *data, size_t len, const ucp_am_recv_param_t *param) {
  engine_t *e = arg;
  (void)header; (void)hlen; (void)data; (void)len;
  if (!(param->recv_attr & UCP_AM_RECV_ATTR_FIELD_REPLY_EP) || (param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV)) return UCS_OK;
  int conn = conn_of_ep(param->reply_ep);
  conn_t *c = conn >= 0 ? conn_at(e, conn) : NULL;
  if (!c) return UCS_OK;
  int64_t t = now_ns();
  atomic_store_explicit(&c->last_rx_ns, t, memory_order_relaxed);
  if (!atomic_load_explicit(&c->authed, memory_order_acquire) && t - atomic_load_explicit(&c->last_pong_ns, memory_order_relaxed) < 100000000LL)
    return UCS_OK;
  atomic_store_explicit(&c->last_pong_ns, t, memory_order_relaxed);
  hn_hdr_t rep = {0};
  tl_in_cb++;
  send_copy(e, param->reply_ep, AM_PONG, &rep, NULL, 0);
  tl_in_cb--;
  return UCS_OK;
}

static ucs_status_t am_pong_cb(void *arg, const void *header, size_t hlen, void *data, size_t len, const ucp_am_recv_param_t *param) {
  (void)header; (void)hlen; (void)data; (void)len;
  if (param->recv_attr & UCP_AM_RECV_ATTR_FIELD_REPLY_EP) touch(arg, conn_of_ep(param->reply_ep));
  return UCS_OK;
}

// The progress thread, when a probe or a failure is due (live_next_ns): probe connections that were quiet for a quarter
// of the dead time, fail those from which nothing came for all of it, counted from the last arrival (so a link that
// goes down is failed at most the dead time after the last byte it carried), and note when the next is due: the
// thread's sleep ends then. Not inside a UCX callback (it sends).
static void check_liveness(engine_t *e, int64_t now) {
  int64_t dead = atomic_load_explicit(&e->dead_ns, memory_order_relaxed);
  if (!dead || (dead == e->live_dead_ns && now < e->live_next_ns)) return;
  int64_t probe = dead / 4, next = now + probe;  // (a connection made meanwhile is looked at within a probe interval)
  e->live_dead_ns = dead;
  int n = atomic_load_explicit(&e->conns.n, memory_order_acquire);
  for (int i = 0; i < n; i++) {
    conn_t *c = conn_at(e, i);
    if (!c || atomic_load_explicit(&c->state, memory_order_acquire) != CONN_UP) continue;
    int64_t last = atomic_load_explicit(&c->last_rx_ns, memory_order_relaxed), quiet = now - last;
    if (quiet >= dead) {
      char why[160], since[16] = "?";
      time_t then = time(NULL) - (time_t)(quiet / 1000000000LL);
      struct tm tm;
      if (localtime_r(&then, &tm)) strftime(since, sizeof since, "%H:%M:%S", &tm);
      snprintf(why, sizeof why, "nothing came from the peer for %.2f s, since %s (a link down, or a stopped process)", quiet / 1e9, since);
      conn_fail(c, why);
      continue;
    }
    if (quiet >= probe && now - c->last_ping_ns >= probe) {
      c->last_ping_ns = now;
      int code;
      conn_t *r = conn_ref(e, c->id, "ping", &code);
      if (r) {
        hn_hdr_t hdr = {0};
        tl_in_cb++;  // (never wait here: copy it if it cannot go out at once)
        send_copy(e, r->ep, AM_PING, &hdr, NULL, 0);
        tl_in_cb--;
        conn_unref(r);
      }
    }
    int64_t ping_due = (last > c->last_ping_ns ? last : c->last_ping_ns) + probe;
    if (last + dead < next) next = last + dead;
    if (ping_due < next) next = ping_due;
  }
  e->live_next_ns = next;
}

// hn_store64 of a peer: store the value if the address is in memory we registered (8-byte aligned).
static ucs_status_t am_store_cb(void *arg, const void *header, size_t hlen, void *data, size_t len, const ucp_am_recv_param_t *param) {
  engine_t *e = arg;
  (void)data; (void)len;
  uint64_t st[2];
  if (hlen != sizeof st) return UCS_OK;
  memcpy(st, header, sizeof st);
  int conn = (param->recv_attr & UCP_AM_RECV_ATTR_FIELD_REPLY_EP) ? conn_of_ep(param->reply_ep) : -1;
  touch(e, conn);
  if (conn < 0 || !conn_trusted(e, conn)) { count(e, CNT_BAD_STORES, 1); return UCS_OK; }  // (a stranger sets no memory)
  int ok = 0;
  pthread_mutex_lock(&e->map_mu);
  for (map_t *m = e->maps; m && !ok; m = m->next) ok = m->len >= 8 && st[0] >= m->addr && st[0] - m->addr <= m->len - 8;
  pthread_mutex_unlock(&e->map_mu);
  if (!ok || st[0] % 8) { count(e, CNT_BAD_STORES, 1); return UCS_OK; }
  // release: the puts that came before (ordered by hn_store64's flush; written into memory by this or another
  // thread progressing the worker, whose lock orders them before us) are visible to a reader that loads the value
  // with acquire (or plainly, on x86).
  atomic_store_explicit((_Atomic uint64_t *)(uintptr_t)st[0], st[1], memory_order_release);
  // A thread of this process may sleep on the value (a futex on its low 32-bit word, as hcq's signal waits do):
  // wake it now rather than at its next re-poll. (A futex wake with no sleeper is one cheap system call.)
#if __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
  futex_wake((_Atomic uint32_t *)(uintptr_t)st[0]);
#else
  futex_wake((_Atomic uint32_t *)(uintptr_t)(st[0] + 4));
#endif
  count(e, CNT_STORES_IN, 1);
  return UCS_OK;
}

static int strangers_room(engine_t *e) {
  pthread_mutex_lock(&e->conn_mu);
  int room = e->nstrangers < e->preauth_conns;
  pthread_mutex_unlock(&e->conn_mu);
  return room;
}

// The listener accepted a connection (inside progress).
static void conn_request_cb(ucp_conn_request_h req, void *arg) {
  engine_t *e = arg;
  ucp_conn_request_attr_t attr = {.field_mask = UCP_CONN_REQUEST_ATTR_FIELD_CLIENT_ADDR};
  char peer[96] = "?";
  if (ucp_conn_request_query(req, &attr) == UCS_OK) format_sockaddr(&attr.client_address, peer, sizeof peer);
  if (atomic_load_explicit(&e->closing, memory_order_acquire)) { ucp_listener_reject(e->listener, req); return; }
  int stranger = atomic_load_explicit(&e->preauth, memory_order_acquire);
  conn_t *c = NULL;
  if (!stranger || strangers_room(e)) c = conn_new(e, peer, 1);
  if (!c) { ucp_listener_reject(e->listener, req); if (stranger) count(e, CNT_PREAUTH_CLOSED, 1); return; }
  if (stranger) {
    atomic_store_explicit(&c->authed, 0, memory_order_release);
    c->accepted_ns = now_ns();
    pthread_mutex_lock(&e->conn_mu);
    c->stranger_next = e->strangers;
    e->strangers = c;
    e->nstrangers++;
    pthread_mutex_unlock(&e->conn_mu);
  }
  ucp_ep_params_t p = {.field_mask = UCP_EP_PARAM_FIELD_CONN_REQUEST | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE |
                                     UCP_EP_PARAM_FIELD_ERR_HANDLER | UCP_EP_PARAM_FIELD_USER_DATA,
                       .conn_request = req, .err_mode = UCP_ERR_HANDLING_MODE_PEER,
                       .err_handler = {.cb = ep_error_cb, .arg = c}, .user_data = c};
  ucs_status_t st = ucp_ep_create(e->worker, &p, &c->ep);
  if (st != UCS_OK) {
    c->ep = NULL;
    char why[160];
    snprintf(why, sizeof why, "accepting the connection failed: %s", ucs_status_string(st));
    conn_fail(c, why);
    return;
  }
  int expected = CONN_NEW;  // release: ep before the state that lets other threads use it
  atomic_compare_exchange_strong_explicit(&c->state, &expected, CONN_UP, memory_order_seq_cst, memory_order_relaxed);
  count(e, CNT_ACCEPTED, 1);
}

// ---------------------------------------------------------------- the progress thread
// Does anything need the worker polled while the progress thread sleeps? (seq_cst loads: see wake_progress)
static int pt_reasons(engine_t *e) {
  return atomic_load_explicit(&e->waiters, memory_order_seq_cst) > 0 || atomic_load_explicit(&e->inflight, memory_order_seq_cst) > 0 ||
         atomic_load_explicit(&e->reap_flag, memory_order_seq_cst);
}

// Work the engine saw arrive (a sum of counters): ucp_worker_progress's return value misses some of it (it counted
// no event for a message that came through shared memory and was handled by a C handler, say).
static uint64_t arrivals(engine_t *e) {
  return atomic_load_explicit(&e->counters[CNT_MSGS_IN], memory_order_relaxed) +
         atomic_load_explicit(&e->counters[CNT_REPLIES_IN], memory_order_relaxed) +
         atomic_load_explicit(&e->counters[CNT_STORES_IN], memory_order_relaxed);
}

static void *progress_main(void *arg) {
  engine_t *e = arg;
  int64_t last = now_ns();
  uint64_t seen = arrivals(e);
  int64_t next_yield = 0;
  unsigned busy_streak = 0;  // ucp_worker_arm said BUSY this many times in a row with nothing progressed
  // Spin budget: woken by an event after an idle gap it could have spun through (below PROGRESS_SPIN_MAX_NS), the
  // thread spins twice that gap next time; a longer gap sets it back. Waking a sleeping thread costs tens of
  // microseconds on a VM: a client that sends a request every 150 us would otherwise find it asleep every time.
  int64_t spin_ns = PROGRESS_SPIN_NS, idle_since = 0;
  for (;;) {
    if (atomic_load_explicit(&e->stop, memory_order_acquire)) break;  // acquire: pairs with hn_destroy's release
    unsigned n = progress(e);
    uint64_t now_seen = arrivals(e);
    if (now_seen != seen) { seen = now_seen; n++; }
    if (atomic_load_explicit(&e->reap_flag, memory_order_acquire)) reap(e);  // acquire: the list before the flag
    int64_t t = now_ns();
    check_liveness(e, t);
    if (n) { last = t; busy_streak = 0; continue; }
    int spinning = atomic_load_explicit(&e->spinners, memory_order_relaxed) > 0;
    if (t - last < spin_ns && !spinning) {
      // Yield now and then: the thread whose message woke us may be waiting for this CPU (the scheduler tends to
      // run a woken thread on its waker's CPU, preempting it), and it would wait out our whole spin.
      if (t >= next_yield) { sched_yield(); next_yield = t + SPIN_YIELD_NS; }
      cpu_relax();
      continue;
    }
    if (spinning) {
      // Another thread spins on the worker (a waiter): leave the worker to it. Two threads polling one worker only
      // fight over its lock, and over the CPUs (there may be two); and a progress thread woken by every event the
      // spinner handles anyway costs a wakeup each time. Look again every BUSY_POLL_MS, or at once when a spinner
      // gives up and sleeps (it rings wake_fd).
      atomic_store_explicit(&e->pt_sleeping, PT_DEFERRED, memory_order_seq_cst);  // seq_cst: see wake_progress
      if (atomic_load_explicit(&e->spinners, memory_order_seq_cst) > 0 && !atomic_load_explicit(&e->stop, memory_order_acquire)) {
        struct pollfd pfd = {.fd = e->wake_fd, .events = POLLIN};
        count(e, CNT_PT_DEFERS, 1);
        if (poll(&pfd, 1, BUSY_POLL_MS) > 0) {
          uint64_t v;
          if (read(e->wake_fd, &v, sizeof v) < 0) { /* drained already */ }
        }
      }
      atomic_store_explicit(&e->pt_sleeping, PT_AWAKE, memory_order_seq_cst);
      continue;
    }
    ucs_status_t st = ucp_worker_arm(e->worker);
    if (st == UCS_ERR_BUSY) {  // events arrived meanwhile: progress them
      count(e, CNT_ARM_BUSY, 1);
      // ...but not forever: an event progress does not consume (seen with UCX's adaptive progress, which polls only
      // active interfaces) would keep arm busy and this thread at 100% CPU. After a streak, nap BUSY_POLL_MS.
      if (++busy_streak < 1000) continue;
      struct pollfd pfd = {.fd = e->wake_fd, .events = POLLIN};
      if (poll(&pfd, 1, BUSY_POLL_MS) > 0) {
        uint64_t v;
        if (read(e->wake_fd, &v, sizeof v) < 0) { /* drained already */ }
      }
      continue;
    }
    busy_streak = 0;
    // seq_cst stores, then seq_cst loads: see wake_progress. BUSY first, so a reason that appears while we decide
    // is either seen by the second look or finds us IDLE (and wakes us).
    atomic_store_explicit(&e->pt_sleeping, PT_BUSY, memory_order_seq_cst);
    int busy = pt_reasons(e) || st != UCS_OK;
    if (!busy) {
      atomic_store_explicit(&e->pt_sleeping, PT_IDLE, memory_order_seq_cst);
      if ((busy = pt_reasons(e))) atomic_store_explicit(&e->pt_sleeping, PT_BUSY, memory_order_seq_cst);
    }
    int k = 0;
    if (!atomic_load_explicit(&e->stop, memory_order_acquire)) {
      struct epoll_event ev[4];
      count(e, CNT_PT_SLEEPS, 1);
      idle_since = last;
      int64_t dead = atomic_load_explicit(&e->dead_ns, memory_order_relaxed);
      int64_t due = e->live_next_ns - now_ns();  // (the next probe or failure: see check_liveness)
      int live_ms = dead && atomic_load_explicit(&e->conns.n, memory_order_relaxed) ? (due > 0 ? (int)((due + 999999) / 1000000) : 0) : -1;
      k = epoll_wait(e->epoll_fd, ev, 4, busy ? BUSY_POLL_MS : live_ms);
      for (int i = 0; i < k; i++) {
        if (ev[i].data.fd == e->wake_fd) {
          uint64_t v;
          if (read(e->wake_fd, &v, sizeof v) < 0) { /* drained already */ }
        }
      }
    }
    atomic_store_explicit(&e->pt_sleeping, PT_AWAKE, memory_order_seq_cst);
    if (k > 0) {  // woken by an event: spin a while (longer if the gap was short)
      last = now_ns();
      int64_t gap = last - idle_since;
      spin_ns = gap < PROGRESS_SPIN_MAX_NS ? (2 * gap > spin_ns ? (2 * gap < PROGRESS_SPIN_MAX_NS ? 2 * gap : PROGRESS_SPIN_MAX_NS) : spin_ns)
                                          : PROGRESS_SPIN_NS;
      count(e, CNT_PT_WAKEUPS, 1);
    }
  }
  return NULL;
}

// ---------------------------------------------------------------- engine life
static void set_default_config(ucp_config_t *cfg, const char *env, const char *name, const char *value) {
  if (getenv(env)) return;  // the user's setting wins
  ucp_config_modify(cfg, name, value);
}

static void engine_free(engine_t *e) {
  if (e->epoll_fd >= 0) close(e->epoll_fd);
  if (e->wake_fd >= 0) close(e->wake_fd);
  int n = atomic_load_explicit(&e->conns.n, memory_order_acquire);
  for (int i = 0; i < n; i++) {
    conn_t *c = conn_at(e, i);
    if (!c) continue;
    for (pstore_t *p = c->st_head, *next; p; p = next) { next = p->next; free(p); }
    pthread_mutex_destroy(&c->mu);
    pthread_mutex_destroy(&c->st_mu);
    free(c);
  }
  slots_free(&e->conns);
  slots_free(&e->rkeys);
  free(e->rkey_free);
  for (msg_t *m = e->q_head, *next; m; m = next) { next = m->next; free(m->data); free(m); }
  for (msg_t *m = e->hq_head, *next; m; m = next) { next = m->next; free(m->data); free(m); }
  for (int i = 0; i < MAX_HANDLERS; i++) free(atomic_load_explicit(&e->handlers[i], memory_order_relaxed));
  for (handler_t *h = e->retired, *next; h; h = next) { next = h->retired; free(h); }
  free(e->scratch);
  pthread_mutex_destroy(&e->conn_mu);
  pthread_mutex_destroy(&e->pend_mu);
  pthread_mutex_destroy(&e->q_mu);
  pthread_cond_destroy(&e->q_cond);
  pthread_mutex_destroy(&e->h_mu);
  pthread_mutex_destroy(&e->hq_mu);
  pthread_mutex_destroy(&e->map_mu);
  pthread_mutex_destroy(&e->rkey_mu);
  free(e);
}

// Listen on ip:port (port 0: any free one); the port is then hn_port's. Connections are accepted from now on.
static int engine_listen(engine_t *e, const char *ip, int port) {
  if (e->listener) return fail(HN_EFAIL, "the network engine listens already");
  struct sockaddr_storage ss;
  socklen_t sl;
  if (resolve(ip, port, 1, &ss, &sl) < 0) return HN_EFAIL;
  ucp_listener_params_t lp = {.field_mask = UCP_LISTENER_PARAM_FIELD_SOCK_ADDR | UCP_LISTENER_PARAM_FIELD_CONN_HANDLER,
                              .sockaddr = {.addr = (const struct sockaddr *)&ss, .addrlen = sl},
                              .conn_handler = {.cb = conn_request_cb, .arg = e}};
  ucs_status_t st = ucp_listener_create(e->worker, &lp, &e->listener);  // (conn_request_cb reads e->listener under the worker's lock)
  if (st != UCS_OK) {
    e->listener = NULL;
    return fail(HN_EFAIL, "listening on %s:%d failed: %s", ip, port, ucs_status_string(st));
  }
  ucp_listener_attr_t la = {.field_mask = UCP_LISTENER_ATTR_FIELD_SOCKADDR};
  if (ucp_listener_query(e->listener, &la) != UCS_OK) return fail(HN_EFAIL, "ucp_listener_query failed");
  e->port = la.sockaddr.ss_family == AF_INET6 ? ntohs(((struct sockaddr_in6 *)&la.sockaddr)->sin6_port)
                                               : ntohs(((struct sockaddr_in *)&la.sockaddr)->sin_port);
  atomic_store_explicit(&e->listening, 1, memory_order_release);
  return HN_OK;
}

// flags: HN_RMA gives the engine one-sided operations (puts, gets, atomics: UCP's RMA and AMO features, and UCX's tcp
// PUT); without it peers can issue none into this process (see the top of this file).
EXPORT void *hn_create(const char *listen_ip, int port, int flags, char *err, int errlen) {
  engine_t *e = calloc(1, sizeof *e);
  if (!e) { fail(HN_EFAIL, "out of memory"); copy_err(err, errlen); return NULL; }
  e->rma = !!(flags & HN_RMA);
  e->worker_fd = e->wake_fd = e->epoll_fd = -1;
  atomic_init(&e->next_req, 1);
  pthread_mutex_init(&e->conn_mu, NULL);
  pthread_mutex_init(&e->pend_mu, NULL);
  pthread_mutex_init(&e->q_mu, NULL);
  pthread_condattr_t ca;
  pthread_condattr_init(&ca);
  pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
  pthread_cond_init(&e->q_cond, &ca);
  pthread_condattr_destroy(&ca);
  pthread_mutex_init(&e->h_mu, NULL);
  pthread_mutex_init(&e->hq_mu, NULL);
  pthread_mutex_init(&e->map_mu, NULL);
  pthread_mutex_init(&e->rkey_mu, NULL);

  ucp_config_t *cfg = NULL;
  ucs_status_t st = ucp_config_read(NULL, NULL, &cfg);
  if (st != UCS_OK) { fail(HN_EFAIL, "reading the UCX configuration failed: %s", ucs_status_string(st)); goto err; }
  // UCX checks whether peers are alive only every 20 s by default; a dead peer must be noticed in well under 2 s.
  set_default_config(cfg, "UCX_KEEPALIVE_INTERVAL", "KEEPALIVE_INTERVAL", KEEPALIVE_INTERVAL);
  set_default_config(cfg, "UCX_KEEPALIVE_NUM_EPS", "KEEPALIVE_NUM_EPS", KEEPALIVE_NUM_EPS);
  // UCX's shared-memory transports (sysv, posix) do not offer peer-failure handling unless asked to, so endpoints
  // with UCP_ERR_HANDLING_MODE_PEER (all of ours) would fall back to tcp between processes of one host. Their
  // peers are checked by the keepalive (is the process there?), and the connection manager's socket notices a
  // peer's death at once anyway.
  if (!getenv("UCX_SYSV_ERROR_HANDLING") && !getenv("UCX_POSIX_ERROR_HANDLING"))
    set_default_config(cfg, "UCX_MM_ERROR_HANDLING", "MM_ERROR_HANDLING", "y");
  // UCX's adaptive progress deactivates idle interfaces when the worker is armed and reactivates them on events;
  // each switch re-installs the interfaces' AM handlers, and for tcp that queries the interface (sysfs, ioctls,
  // /proc/net/route: ~100 us of system calls). Our progress thread arms the worker whenever it goes to sleep, so
  // that cost would land on nearly every message that wakes it (measured: a C handler's round trip 120 us -> 4 us).
  set_default_config(cfg, "UCX_ADAPTIVE_PROGRESS", "ADAPTIVE_PROGRESS", "n");
  // A message that fits a shared-memory FIFO element goes out at once from the caller's memory (am_short); a larger
  // one is copied into a request that completes later, and the progress thread is woken for it. A launch's SUBMIT
  // (its packet words and kernargs: a few hundred bytes) does not fit UCX's default 128-byte element.
  set_default_config(cfg, "UCX_MM_FIFO_ELEM_SIZE", "MM_FIFO_ELEM_SIZE", "1024");
  // Without HN_RMA: UCX's tcp transport would still advertise PUT, and any peer's UCP would then write into this
  // process at an address of its choosing (the target checks no registration); with the capability off and no RMA
  // feature (which would otherwise emulate puts over active messages, unchecked too), a UCP peer has no way to.
  if (!(flags & HN_RMA)) set_default_config(cfg, "UCX_TCP_PUT_ENABLE", "TCP_PUT_ENABLE", "n");
  // Without PUT, a large message over tcp goes as fragments of the send segment (a rendezvous over active messages):
  // with UCX's 8 KiB default that is a send() per 8 KiB, and bulk copies reached about half a plain TCP stream between
  // two hosts. 64 KiB segments (received into 256 KiB buffers) reach the stream's speed; small messages keep their latency.
  set_default_config(cfg, "UCX_TCP_TX_SEG_SIZE", "TCP_TX_SEG_SIZE", TCP_TX_SEG_SIZE);
  set_default_config(cfg, "UCX_TCP_RX_SEG_SIZE", "TCP_RX_SEG_SIZE", TCP_RX_SEG_SIZE);
  ucp_params_t params = {.field_mask = UCP_PARAM_FIELD_FEATURES | UCP_PARAM_FIELD_NAME,
                         .features = ((flags & HN_RMA) ? UCP_FEATURE_RMA | UCP_FEATURE_AMO64 : 0) | UCP_FEATURE_AM | UCP_FEATURE_WAKEUP,
                         .name = "hcq-net"};
  st = ucp_init(&params, cfg, &e->ctx);
  ucp_config_release(cfg);
  if (st != UCS_OK) { e->ctx = NULL; fail(HN_EFAIL, "ucp_init failed: %s", ucs_status_string(st)); goto err; }

  ucp_worker_params_t wp = {.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE, .thread_mode = UCS_THREAD_MODE_MULTI};
  st = ucp_worker_create(e->ctx, &wp, &e->worker);
  if (st != UCS_OK) { e->worker = NULL; fail(HN_EFAIL, "ucp_worker_create failed: %s", ucs_status_string(st)); goto err; }
  ucp_worker_attr_t wa = {.field_mask = UCP_WORKER_ATTR_FIELD_THREAD_MODE};
  if (ucp_worker_query(e->worker, &wa) != UCS_OK || wa.thread_mode != UCS_THREAD_MODE_MULTI) {
    fail(HN_EFAIL, "this UCX library does not support multi-threaded workers (build it with --enable-mt)");
    goto err;
  }
  struct { unsigned id; ucp_am_recv_callback_t cb; } ams[] = {{AM_MSG, am_msg_cb}, {AM_REPLY, am_reply_cb}, {AM_HELLO, am_hello_cb},
                                                              {AM_STORE, am_store_cb}, {AM_PING, am_ping_cb}, {AM_PONG, am_pong_cb},
                                                              {AM_PLACE, am_place_cb}};
  for (size_t i = 0; i < sizeof ams / sizeof ams[0]; i++) {
    ucp_am_handler_param_t hp = {.field_mask = UCP_AM_HANDLER_PARAM_FIELD_ID | UCP_AM_HANDLER_PARAM_FIELD_FLAGS |
                                               UCP_AM_HANDLER_PARAM_FIELD_CB | UCP_AM_HANDLER_PARAM_FIELD_ARG,
                                 .id = ams[i].id, .flags = UCP_AM_FLAG_WHOLE_MSG, .cb = ams[i].cb, .arg = e};
    st = ucp_worker_set_am_recv_handler(e->worker, &hp);
    if (st != UCS_OK) { fail(HN_EFAIL, "ucp_worker_set_am_recv_handler failed: %s", ucs_status_string(st)); goto err; }
  }
  st = ucp_worker_get_efd(e->worker, &e->worker_fd);
  if (st != UCS_OK) { e->worker_fd = -1; fail(HN_EFAIL, "ucp_worker_get_efd failed: %s", ucs_status_string(st)); goto err; }
  e->wake_fd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  e->epoll_fd = epoll_create1(EPOLL_CLOEXEC);
  if (e->wake_fd < 0 || e->epoll_fd < 0) { fail(HN_EFAIL, "eventfd/epoll_create1 failed: %s", strerror(errno)); goto err; }
  struct epoll_event ev = {.events = EPOLLIN, .data.fd = e->worker_fd};
  struct epoll_event ev2 = {.events = EPOLLIN, .data.fd = e->wake_fd};
  if (epoll_ctl(e->epoll_fd, EPOLL_CTL_ADD, e->worker_fd, &ev) || epoll_ctl(e->epoll_fd, EPOLL_CTL_ADD, e->wake_fd, &ev2)) {
    fail(HN_EFAIL, "epoll_ctl failed: %s", strerror(errno));
    goto err;
  }

  if (listen_ip && engine_listen(e, listen_ip, port) < 0) goto err;
  if (pthread_create(&e->thread, NULL, progress_main, e) != 0) { fail(HN_EFAIL, "cannot start the progress thread"); goto err; }
  e->thread_started = 1;
  return e;
err:
  copy_err(err, errlen);
  if (e->listener) ucp_listener_destroy(e->listener);
  if (e->worker) ucp_worker_destroy(e->worker);
  if (e->ctx) ucp_cleanup(e->ctx);
  engine_free(e);
  return NULL;
}

EXPORT int hn_port(void *ep) { return ep ? ((engine_t *)ep)->port : -1; }

// A client engine starts listening (a server's worker kept unreachable until it has a client): returns the port.
EXPORT int hn_listen(void *ep, const char *ip, int port, char *err, int errlen) {
  engine_t *e = ep;
  if (!enter(e)) { fail(HN_EDEAD, "listen: the network engine is closed"); copy_err(err, errlen); return HN_EDEAD; }
  int rc = engine_listen(e, ip, port);
  if (rc < 0) copy_err(err, errlen);
  else rc = e->port;
  leave(e);
  return rc;
}

// A connection from which nothing (a message, a reply, an answer to a probe) came for `dead_ms` is failed; 0 turns
// it off. Probes go out after a quarter of that.
EXPORT void hn_set_liveness(void *ep, int dead_ms) {
  engine_t *e = ep;
  atomic_store_explicit(&e->dead_ns, dead_ms > 0 ? (int64_t)dead_ms * 1000000LL : 0, memory_order_relaxed);
  wake_progress(e, WAKE_WORK);
}

// From now on, accepted connections are strangers until hn_authenticate: at most `conns` at a time, each sending at
// most `msgs` messages of at most `bytes` bytes (no rendezvous), and closed by hn_preauth_expire after `ms`.
EXPORT void hn_set_preauth(void *ep, uint64_t bytes, int msgs, int conns, int ms) {
  engine_t *e = ep;
  pthread_mutex_lock(&e->conn_mu);
  e->preauth_bytes = bytes; e->preauth_msgs = msgs; e->preauth_conns = conns; e->preauth_ns = (int64_t)ms * 1000000LL;
  pthread_mutex_unlock(&e->conn_mu);
  atomic_store_explicit(&e->preauth, 1, memory_order_release);  // release: the limits before accepted connections use them
}

// Take conn off the strangers (under conn_mu); 1 if it was one.
static int strangers_remove(engine_t *e, conn_t *c) {
  for (conn_t **p = &e->strangers; *p; p = &(*p)->stranger_next)
    if (*p == c) { *p = c->stranger_next; c->stranger_next = NULL; e->nstrangers--; return 1; }
  return 0;
}

// The connection proved who it is (its hello): it may now send anything, and its messages reach the C handlers.
EXPORT int hn_authenticate(void *ep, int conn) {
  engine_t *e = ep;
  conn_t *c = conn_at(e, conn);
  if (!c) return fail(HN_EFAIL, "authenticate: no connection %d", conn);
  pthread_mutex_lock(&e->conn_mu);
  strangers_remove(e, c);
  pthread_mutex_unlock(&e->conn_mu);
  atomic_store_explicit(&c->authed, 1, memory_order_release);
  return HN_OK;
}

// Close the strangers whose time is up, and forget dead ones; returns how many were closed. Not from a handler.
EXPORT int hn_preauth_expire(void *ep) {
  engine_t *e = ep;
  if (tl_in_cb || !enter(e)) return 0;
  int64_t now = now_ns();
  int closed = 0;
  for (;;) {
    conn_t *late = NULL;
    pthread_mutex_lock(&e->conn_mu);
    for (conn_t *c = e->strangers, *next; c; c = next) {
      next = c->stranger_next;
      int dead = atomic_load_explicit(&c->state, memory_order_acquire) >= CONN_DEAD;
      if (!dead && now - c->accepted_ns <= e->preauth_ns) continue;
      strangers_remove(e, c);
      if (!dead) { late = c; break; }
    }
    pthread_mutex_unlock(&e->conn_mu);
    if (!late) break;
    count(e, CNT_PREAUTH_CLOSED, 1);
    conn_abort(late, "closed: it did not authenticate in time");  // (outside conn_mu: conn_fail takes it)
    closed++;
  }
  leave(e);
  return closed;
}

static void progress_until(engine_t *e, int64_t deadline, int (*done)(engine_t *)) {
  while (!done(e) && now_ns() < deadline) {
    if (!progress(e)) sched_yield();
  }
}
static int closes_done(engine_t *e) {
  return atomic_load_explicit(&e->closing_eps, memory_order_acquire) == 0 && atomic_load_explicit(&e->inflight, memory_order_acquire) == 0;
}
static int calls_done(engine_t *e) { return atomic_load_explicit(&e->calls, memory_order_acquire) == 0; }

EXPORT void hn_destroy(void *ep) {
  engine_t *e = ep;
  if (!e) return;
  atomic_store_explicit(&e->closing, 1, memory_order_seq_cst);  // seq_cst: see enter()
  pthread_mutex_lock(&e->q_mu);
  pthread_cond_broadcast(&e->q_cond);  // hn_next sleepers leave
  pthread_mutex_unlock(&e->q_mu);
  if (e->thread_started) {
    atomic_store_explicit(&e->stop, 1, memory_order_release);
    uint64_t one = 1;
    if (write(e->wake_fd, &one, sizeof one) < 0) { /* it is awake */ }
    pthread_join(e->thread, NULL);
  }
  if (e->listener) { ucp_listener_destroy(e->listener); e->listener = NULL; }
  int n = atomic_load_explicit(&e->conns.n, memory_order_acquire);
  // Flush what live connections still carry (bounded: a dead peer must not hold us).
  op_t **flushes = calloc((size_t)n + 1, sizeof *flushes);
  int64_t deadline = deadline_after_ms(DESTROY_FLUSH_MS);
  for (int i = 0; flushes && i < n; i++) {
    int code;
    conn_t *c = conn_ref(e, i, "flush", &code);
    if (!c) continue;
    op_t *op = op_new(e, 0, 2);
    if (op) {
      ucp_request_param_t prm = {.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA, .cb.send = op_cb, .user_data = op};
      op_issued(op, ucp_ep_flush_nbx(c->ep, &prm));
      flushes[i] = op;
    }
    conn_unref(c);
  }
  for (int i = 0; flushes && i < n; i++) {
    if (!flushes[i]) continue;
    while (!word_done(&flushes[i]->done) && now_ns() < deadline) progress(e);
    op_unref(flushes[i]);
  }
  free(flushes);
  for (int i = 0; i < n; i++) {
    conn_t *c = conn_at(e, i);
    if (!c) continue;
    conn_fail(c, "the local network engine was closed");
    conn_close_ep(c, 1);
  }
  progress_until(e, deadline_after_ms(DESTROY_CLOSE_MS), closes_done);
  progress_until(e, deadline_after_ms(DESTROY_CALLS_MS), calls_done);
  if (!calls_done(e)) return;  // a thread is still inside a call: leave everything allocated rather than pull it away
  if (e->listener) { ucp_listener_destroy(e->listener); e->listener = NULL; }  // (one hn_listen made meanwhile)
  pthread_mutex_lock(&e->rkey_mu);
  int nr = atomic_load_explicit(&e->rkeys.n, memory_order_relaxed);
  for (int i = 0; i < nr; i++) {
    rkey_t *k = atomic_exchange_explicit(slot_ref(&e->rkeys, i), NULL, memory_order_acq_rel);
    if (k) { ucp_rkey_destroy(k->rk); free(k); }
  }
  pthread_mutex_unlock(&e->rkey_mu);
  for (map_t *m = e->maps, *next; m; m = next) { next = m->next; ucp_mem_unmap(e->ctx, m->memh); free(m); }
  e->maps = NULL;
  ucp_worker_destroy(e->worker);
  ucp_cleanup(e->ctx);
  engine_free(e);
}

// ---------------------------------------------------------------- connections (API)
static int64_t request_wait(engine_t *e, conn_t *c, pending_t *p, op_t *op, int64_t deadline, const char *what);

// The start of a call that waits on connection `conn` (request, place, put, get, flush): inside the engine, not inside
// a message handler (`hint`: what to use there instead, or ""), the connection referenced. NULL otherwise, the
// engine left and the error set (its code in *code).
static conn_t *enter_to_wait(engine_t *e, int conn, const char *what, const char *hint, int *code) {
  if (!enter(e)) { *code = fail(HN_EFAIL, "%s: the network engine is closed", what); return NULL; }
  if (tl_in_cb) { leave(e); *code = fail(HN_EFAIL, "%s cannot wait inside a message handler%s", what, hint); return NULL; }
  conn_t *c = conn_ref(e, conn, what, code);
  if (!c) leave(e);
  return c;
}

EXPORT int hn_connect(void *ep, const char *ip, int port, int timeout_ms, char *err, int errlen) {
  engine_t *e = ep;
  if (!enter(e)) { fail(HN_EFAIL, "connect: the network engine is closed"); copy_err(err, errlen); return HN_EFAIL; }
  int rc = HN_EFAIL;
  if (tl_in_cb) { rc = fail(HN_EFAIL, "connect cannot wait inside a message handler"); goto out; }
  char peer[96];
  snprintf(peer, sizeof peer, strchr(ip, ':') ? "[%s]:%d" : "%s:%d", ip, port);
  struct sockaddr_storage ss;
  socklen_t sl;
  if (resolve(ip, port, 0, &ss, &sl) < 0) {
    char why[512];
    snprintf(why, sizeof why, "%s", tl_err);
    rc = fail(HN_EFAIL, "connect to %s: %s", peer, why);
    goto out;
  }
  conn_t *c = conn_new(e, peer, 0);
  if (!c) { rc = fail(HN_EFAIL, "connect to %s: out of memory or connections", peer); goto out; }
  ucp_ep_params_t p = {.field_mask = UCP_EP_PARAM_FIELD_FLAGS | UCP_EP_PARAM_FIELD_SOCK_ADDR | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE |
                                     UCP_EP_PARAM_FIELD_ERR_HANDLER | UCP_EP_PARAM_FIELD_USER_DATA,
                       .flags = UCP_EP_PARAMS_FLAGS_CLIENT_SERVER,
                       .sockaddr = {.addr = (const struct sockaddr *)&ss, .addrlen = sl},
                       .err_mode = UCP_ERR_HANDLING_MODE_PEER, .err_handler = {.cb = ep_error_cb, .arg = c}, .user_data = c};
  ucs_status_t st = ucp_ep_create(e->worker, &p, &c->ep);
  if (st != UCS_OK) {
    c->ep = NULL;
    char why[200];
    snprintf(why, sizeof why, "connect failed: %s", ucs_status_string(st));
    conn_fail(c, why);
    rc = fail(HN_EFAIL, "connect to %s failed: %s", peer, ucs_status_string(st));
    goto out;
  }
  int expected = CONN_NEW;  // seq_cst (release): ep before the state
  atomic_compare_exchange_strong_explicit(&c->state, &expected, CONN_UP, memory_order_seq_cst, memory_order_relaxed);
  // The handshake: a request the peer's engine answers itself. When its reply is here, the endpoint is wired up.
  int64_t deadline = deadline_after_ms(timeout_ms);
  pending_t pd = {.req_id = atomic_fetch_add_explicit(&e->next_req, 1, memory_order_relaxed), .conn = c->id, .reply = NULL, .cap = 0, .len = -1};
  atomic_init(&pd.state, W_PENDING);
  pend_add(e, &pd);
  int code = 0;
  conn_t *r = conn_ref(e, c->id, "connect", &code);
  if (r) {
    hn_hdr_t hdr = {.req_id = pd.req_id};
    code = send_copy(e, c->ep, AM_HELLO, &hdr, HELLO_MAGIC, sizeof HELLO_MAGIC);
    conn_unref(r);
  }
  int64_t got = code < 0 ? code : request_wait(e, c, &pd, NULL, deadline, "connect");
  if (code < 0 && !pend_remove(e, &pd)) wait_word(e, &pd.state, INT64_MAX);
  if (got >= 0) {
    pthread_mutex_lock(&c->mu);
    if (atomic_load_explicit(&c->state, memory_order_seq_cst) == CONN_UP) { c->announced = 1; rc = c->id; }
    pthread_mutex_unlock(&c->mu);
    if (rc < 0) { char why[256]; rc = fail(HN_EDEAD, "connect to %s failed: %s", peer, conn_why(c, why, sizeof why)); }
  } else {
    char why[256];
    if (got == HN_ETIMEDOUT) {
      snprintf(why, sizeof why, "no answer within %d ms", timeout_ms);
      conn_abort(c, why);
      rc = fail(HN_ETIMEDOUT, "connect to %s timed out: no answer within %d ms (is an hcq network engine listening there?)", peer, timeout_ms);
    } else if (got == HN_EFAIL && pd.remote_status) {
      conn_abort(c, "the peer refused the handshake");
      rc = fail(HN_EFAIL, "connect to %s: the peer is not an hcq network engine of this version (%s)", peer, HELLO_MAGIC);
    } else {
      conn_why(c, why, sizeof why);
      conn_abort(c, why);
      // UCX says "Endpoint is not connected" or "Destination is unreachable" for a refused connection.
      rc = fail(HN_EDEAD, "connect to %s failed: nobody accepted the connection, or it broke (%s)", peer, why);
    }
  }
out:
  if (rc < 0) copy_err(err, errlen);
  leave(e);
  return rc;
}

EXPORT int hn_alive(void *ep, int conn) {
  engine_t *e = ep;
  if (!enter(e)) return 0;
  conn_t *c = conn_at(e, conn);
  int r = c && atomic_load_explicit(&c->state, memory_order_acquire) == CONN_UP;
  leave(e);
  return r;
}

EXPORT int hn_conn_error(void *ep, int conn, char *buf, int len) {
  engine_t *e = ep;
  if (!enter(e)) return -1;
  conn_t *c = conn_at(e, conn);
  if (c && buf && len > 0) {
    pthread_mutex_lock(&c->mu);
    snprintf(buf, (size_t)len, "%s", c->err);
    pthread_mutex_unlock(&c->mu);
  }
  leave(e);
  return c ? 0 : -1;
}

EXPORT int hn_conn_peer(void *ep, int conn, char *buf, int len) {
  engine_t *e = ep;
  if (!enter(e)) return -1;
  conn_t *c = conn_at(e, conn);
  if (c && buf && len > 0) snprintf(buf, (size_t)len, "%s", c->peer);  // written before the id was published
  leave(e);
  return c ? 0 : -1;
}

// The transports (e.g. "tcp/lo;cma/memory") the connection's endpoint uses.
EXPORT int hn_conn_transports(void *ep, int conn, char *buf, int len) {
  engine_t *e = ep;
  if (!enter(e)) return -1;
  int code;
  conn_t *c = conn_ref(e, conn, "transports", &code);
  if (!c) { leave(e); return code; }
  ucp_transport_entry_t ents[32];
  ucp_ep_attr_t attr = {.field_mask = UCP_EP_ATTR_FIELD_TRANSPORTS,
                        .transports = {.entries = ents, .num_entries = 32, .entry_size = sizeof(ucp_transport_entry_t)}};
  ucs_status_t st = ucp_ep_query(c->ep, &attr);
  conn_unref(c);
  int rc = 0;
  if (st != UCS_OK) rc = fail(HN_EFAIL, "ucp_ep_query: %s", ucs_status_string(st));
  else if (buf && len > 0) {
    size_t off = 0;
    buf[0] = 0;
    for (unsigned i = 0; i < attr.transports.num_entries && off < (size_t)len; i++)
      off += (size_t)snprintf(buf + off, (size_t)len - off, "%s%s/%s", i ? ";" : "", ents[i].transport_name, ents[i].device_name);
  }
  leave(e);
  return rc;
}

EXPORT int hn_conn_count(void *ep) {
  engine_t *e = ep;
  if (!enter(e)) return 0;
  int n = atomic_load_explicit(&e->conns.n, memory_order_acquire), alive = 0;
  for (int i = 0; i < n; i++) {
    conn_t *c = conn_at(e, i);
    if (c && atomic_load_explicit(&c->state, memory_order_acquire) == CONN_UP) alive++;
  }
  leave(e);
  return alive;
}

// Close a connection from this side (its peer sees it closed). Flushes first, for at most timeout_ms.
EXPORT int hn_close(void *ep, int conn, int timeout_ms) {
  engine_t *e = ep;
  if (!enter(e)) return HN_EFAIL;
  conn_t *c = conn_at(e, conn);
  if (!c) { leave(e); return fail(HN_EFAIL, "close: no connection %d", conn); }
  int code;
  conn_t *r = tl_in_cb ? NULL : conn_ref(e, conn, "close", &code);
  if (r) {
    op_t *op = op_new(e, 0, 2);
    if (op) {
      ucp_request_param_t prm = {.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA, .cb.send = op_cb, .user_data = op};
      op_issued(op, ucp_ep_flush_nbx(r->ep, &prm));
    }
    conn_unref(r);
    if (op) { wait_word(e, &op->done, deadline_after_ms(timeout_ms)); op_unref(op); }
  }
  conn_fail(c, "closed by this side");
  if (!tl_in_cb) conn_close_ep(c, 1);  // else the progress thread's reaper closes it
  leave(e);
  return 0;
}

// ---------------------------------------------------------------- messages (API)
// Waits for p's reply (and for op, the zero-copy send of the request, if any). Returns the reply length or a code.
static int64_t request_wait(engine_t *e, conn_t *c, pending_t *p, op_t *op, int64_t deadline, const char *what) {
  int64_t rc;
  int done = wait_word(e, &p->state, deadline);
  if (!done && pend_remove(e, p)) {
    rc = fail(HN_ETIMEDOUT, "%s on the connection to %s: no reply in time", what, c->peer);
  } else {
    if (!done) wait_word(e, &p->state, INT64_MAX);  // a completer took p off the list: it is copying the reply now
    if (p->status == HN_OK) rc = p->len;
    else if (p->status == HN_EDEAD) {
      char why[256];
      rc = fail(HN_EDEAD, "%s on the connection to %s: the connection died (%s)", what, c->peer, conn_why(c, why, sizeof why));
    } else rc = fail(HN_EFAIL, "%s on the connection to %s: the peer failed to answer (status %d)", what, c->peer, p->remote_status);
  }
  if (op) {
    int orc = wait_op_or_abort(e, c, op, deadline, "sending the request");
    if (orc < 0 && rc >= 0) rc = orc;
  }
  if (atomic_load_explicit(&p->receiving, memory_order_acquire) == RECV_BUSY) {
    // It gave up (no reply in time, or the connection died) while its reply is still arriving into the caller's buffer:
    // close the connection, so that UCX ends the transfer and lets go of the buffer before this returns.
    count(e, CNT_REPLIES_ABANDONED, 1);
    conn_abort(c, "closed: a reply was still arriving after its requester gave up");
    for (int64_t until = deadline_after_ms(ABORT_WAIT_MS); atomic_load_explicit(&p->receiving, memory_order_acquire) == RECV_BUSY;) {
      if (now_ns() > until) {
        fprintf(stderr, "hcq net: a reply from %s was still arriving %d ms after its connection was closed\n", c->peer, ABORT_WAIT_MS);
        break;
      }
      progress(e);
      sched_yield();
    }
    if (rc >= 0) rc = fail(HN_EDEAD, "%s on the connection to %s: the connection was closed while the reply arrived", what, c->peer);
  }
  return rc;
}

EXPORT int64_t hn_request(void *ep, int conn, const void *msg, uint64_t len, void *reply, uint64_t cap, int timeout_ms) {
  engine_t *e = ep;
  int64_t deadline = deadline_after_ms(timeout_ms);
  int code;
  conn_t *c = enter_to_wait(e, conn, "request", "", &code);
  if (!c) return code;
  pending_t p = {.req_id = atomic_fetch_add_explicit(&e->next_req, 1, memory_order_relaxed), .conn = conn, .reply = reply, .cap = cap, .len = -1};
  atomic_init(&p.state, W_PENDING);
  pend_add(e, &p);
  // Added before the state is read again (conn_ref read it before): a conn_fail that came in between finds p.
  hn_hdr_t hdr = {.req_id = p.req_id};
  op_t *op = NULL;
  code = 0;
  if (len <= SMALL_BYTES) code = send_copy(e, c->ep, AM_MSG, &hdr, msg, len);
  else if (!(op = send_zcopy(e, c->ep, AM_MSG, &hdr, msg, len, 0, &code))) { /* code set */ }
  conn_unref(c);
  int64_t rc;
  if (code < 0) {
    char msgbuf[512];
    snprintf(msgbuf, sizeof msgbuf, "%s", tl_err);
    if (!pend_remove(e, &p)) wait_word(e, &p.state, INT64_MAX);
    rc = fail(code, "request on the connection to %s: sending failed: %s", c->peer, msgbuf);
  } else {
    rc = request_wait(e, c, &p, op, deadline, "request");
  }
  leave(e);
  return rc;
}

// Write `len` bytes of `src` at `dest` in the peer's process (AM_PLACE; the peer's placer must allow it, or the
// connection is failed). Returns once `src` may be reused: the bytes are on their way, ahead of anything sent on the
// connection after them; past `timeout_ms` the connection is closed first. 0 or a negative code.
EXPORT int hn_place(void *ep, int conn, uint64_t dest, const void *src, uint64_t len, int timeout_ms) {
  engine_t *e = ep;
  int code;
  conn_t *c = enter_to_wait(e, conn, "place", "", &code);
  if (!c) return code;
  uint64_t h[2] = {dest, 0};
  hn_hdr_t hdr;
  memcpy(&hdr, h, sizeof hdr);
  // A rendezvous even when small: the receiver then fetches the bytes straight into place.
  op_t *op = send_zcopy(e, c->ep, AM_PLACE, &hdr, src, len, UCP_AM_SEND_FLAG_RNDV, &code);
  conn_unref(c);
  if (op) code = wait_op_or_abort(e, c, op, deadline_after_ms(timeout_ms), "placing bytes");
  leave(e);
  return code;
}

// Who may write where in this process with AM_PLACE (hn_placer_fn; NULL: nobody). Set it before peers connect.
EXPORT void hn_set_placer(void *ep, void *fn, void *ctx) {
  engine_t *e = ep;
  e->placer_ctx = ctx;
  atomic_store_explicit(&e->placer, (hn_placer_fn)fn, memory_order_release);  // release: the context before the function
}

EXPORT int hn_send(void *ep, int conn, const void *msg, uint64_t len) {
  engine_t *e = ep;
  if (!enter(e)) return fail(HN_EFAIL, "send: the network engine is closed");
  int code;
  conn_t *c = conn_ref(e, conn, "send", &code);
  if (!c) { leave(e); return code; }
  hn_hdr_t hdr = {.req_id = 0};
  code = send_copy(e, c->ep, AM_MSG, &hdr, msg, len);
  conn_unref(c);
  leave(e);
  return code;
}

EXPORT int hn_reply(void *ep, int conn, uint64_t req_id, const void *msg, uint64_t len) {
  engine_t *e = ep;
  if (!enter(e)) return fail(HN_EFAIL, "reply: the network engine is closed");
  int code;
  conn_t *c = conn_ref(e, conn, "reply", &code);
  if (!c) { leave(e); return code; }
  hn_hdr_t hdr = {.req_id = req_id};
  op_t *op = NULL;
  if (len <= SMALL_BYTES || tl_in_cb) code = send_copy(e, c->ep, AM_REPLY, &hdr, msg, len);
  else op = send_zcopy(e, c->ep, AM_REPLY, &hdr, msg, len, 0, &code);  // large: no copy, wait for it below
  conn_unref(c);
  if (op) code = wait_op_or_abort(e, c, op, deadline_after_ms(LOCAL_WAIT_MS), "sending the reply");
  leave(e);
  return code;
}

EXPORT int64_t hn_next(void *ep, int timeout_ms, int *conn, uint64_t *req_id, void *buf, uint64_t cap) {
  engine_t *e = ep;
  if (!enter(e)) return HN_EDEAD;
  int64_t deadline = deadline_after_ms(timeout_ms);
  int64_t start = now_ns();
  int learn = atomic_load_explicit(&e->q_count, memory_order_acquire) == 0;  // how long it takes for one to come
  if (!tl_in_cb && learn) {  // spin a while first, progressing ourselves: the next request of a ping-pong comes sooner
    int64_t spin_end = start + spin_budget(&e->next_ewma);
    if (spin_end > deadline) spin_end = deadline;
    atomic_fetch_add_explicit(&e->spinners, 1, memory_order_relaxed);
    for (int64_t next_yield = start + SPIN_MIN_NS / 2; atomic_load_explicit(&e->q_count, memory_order_acquire) == 0;) {
      progress(e);
      int64_t t = now_ns();
      if (t >= spin_end) break;
      spin_yield(&next_yield, t);
    }
    atomic_fetch_sub_explicit(&e->spinners, 1, memory_order_seq_cst);
    // We may sleep now: a progress thread that left the worker to us must watch it again.
    if (atomic_load_explicit(&e->q_count, memory_order_acquire) == 0) { count(e, CNT_NEXT_SLEPT, 1); wake_progress(e, WAKE_SPIN); }
    else { count(e, CNT_NEXT_SPUN, 1); spin_ended(e); }
  }
  int64_t rc;
  pthread_mutex_lock(&e->q_mu);
  for (;;) {
    if (e->q_head) break;
    if (atomic_load_explicit(&e->closing, memory_order_acquire)) { rc = HN_EDEAD; goto out; }
    int64_t t = now_ns();
    if (t >= deadline) { rc = HN_ETIMEDOUT; if (learn) spin_learn(&e->next_ewma, t - start); goto out; }
    if (deadline == INT64_MAX) pthread_cond_wait(&e->q_cond, &e->q_mu);
    else {
      struct timespec ts = {.tv_sec = deadline / 1000000000LL, .tv_nsec = deadline % 1000000000LL};
      pthread_cond_timedwait(&e->q_cond, &e->q_mu, &ts);
    }
  }
  if (learn) { spin_learn(&e->next_ewma, now_ns() - start); learn = 0; }
  msg_t *m = e->q_head;
  if (conn) *conn = m->conn;
  if (req_id) *req_id = m->req_id;
  if (m->kind == MSG_DATA && m->len > cap) { rc = (int64_t)m->len; goto out; }  // not taken: retry with room for it
  e->q_head = m->next;
  if (!e->q_head) e->q_tail = NULL;
  atomic_fetch_sub_explicit(&e->q_count, 1, memory_order_relaxed);
  pthread_mutex_unlock(&e->q_mu);
  if (m->kind == MSG_CLOSED) rc = HN_EFAIL;
  else { if (m->len) memcpy(buf, m->data, m->len); rc = (int64_t)m->len; }
  free(m->data);
  free(m);
  leave(e);
  return rc;
out:
  pthread_mutex_unlock(&e->q_mu);
  leave(e);
  return rc;
}

EXPORT void hn_set_handler(void *ep, uint32_t type, hn_handler_fn fn, void *ctx) {
  engine_t *e = ep;
  if (!enter(e)) return;
  pthread_mutex_lock(&e->h_mu);
  if (!e->scratch) e->scratch = malloc(HANDLER_REPLY_CAP);
  handler_t *h = malloc(sizeof *h);
  if (h && e->scratch) {
    *h = (handler_t){.type = type, .fn = fn, .ctx = ctx};
    int n = atomic_load_explicit(&e->nhandlers, memory_order_relaxed), i = 0;
    while (i < n && atomic_load_explicit(&e->handlers[i], memory_order_relaxed)->type != type) i++;
    if (i < n) {  // replace; the old entry may be in use by a progressing thread: keep it until destroy
      handler_t *old = atomic_exchange_explicit(&e->handlers[i], h, memory_order_acq_rel);  // release: h's fields first
      old->retired = e->retired;
      e->retired = old;
    } else if (n < MAX_HANDLERS) {
      atomic_store_explicit(&e->handlers[n], h, memory_order_release);   // the entry's fields before the pointer
      atomic_store_explicit(&e->nhandlers, n + 1, memory_order_release);  // the slot before the count
    } else {
      free(h);
      fail(HN_EFAIL, "too many message types with handlers (%d)", MAX_HANDLERS);
    }
  } else {
    free(h);
  }
  pthread_mutex_unlock(&e->h_mu);
  leave(e);
}

// ---------------------------------------------------------------- memory
// Registering memory and unpacking keys are refused by an engine without one-sided operations (puts, gets and stores
// then have no key to use).
static int no_rma(const char *what) {
  return fail(HN_EFAIL, "%s: this network engine has no one-sided operations (made without HN_RMA: NetEngine(rma=True) has them)", what);
}
// What hn_mem_map hands out: this header, then UCX's packed rkey. The checksum lets hn_rkey refuse bytes that are
// not a key (UCX would crash unpacking them); base and len let every access be bounds-checked before it is issued.
#define RKEY_MAGIC 0x4b52484eu  // "NHRK"
typedef struct { uint32_t magic, ucx_len; uint64_t base, len, check; } rkey_head_t;

static uint64_t fnv1a(uint64_t h, const void *p, size_t n) {
  const unsigned char *b = p;
  for (size_t i = 0; i < n; i++) { h ^= b[i]; h *= 0x100000001b3ULL; }
  return h;
}
static uint64_t rkey_check(const rkey_head_t *h, const void *ucx) {
  uint64_t x = fnv1a(0xcbf29ce484222325ULL, &h->ucx_len, sizeof h->ucx_len);
  x = fnv1a(x, &h->base, sizeof h->base);
  x = fnv1a(x, &h->len, sizeof h->len);
  return fnv1a(x, ucx, h->ucx_len);
}

// The mapped range that overlaps [addr, addr + len), or NULL (under map_mu).
static map_t *map_overlap(engine_t *e, uint64_t addr, uint64_t len) {
  for (map_t *m = e->maps; m; m = m->next)
    if (addr < m->addr + m->len && m->addr < addr + len) return m;
  return NULL;
}

// Lock order: the worker's lock (held by every callback, e.g. am_store_cb, which takes map_mu) comes before the
// engine's mutexes, so no engine mutex is held across a UCP call (ucp_mem_map takes UCX's locks).
EXPORT int hn_mem_map(void *ep, uint64_t addr, uint64_t len, void *out, int cap) {
  engine_t *e = ep;
  if (!e->rma) return no_rma("mem_map");
  if (!enter(e)) return fail(HN_EFAIL, "mem_map: the network engine is closed");
  if (len == 0 || addr + len < addr) { leave(e); return fail(HN_EFAIL, "mem_map: bad range [0x%llx, +%llu)", (unsigned long long)addr, (unsigned long long)len); }
  pthread_mutex_lock(&e->map_mu);
  map_t *o = map_overlap(e, addr, len);
  uint64_t oaddr = o ? o->addr : 0, olen = o ? o->len : 0;
  pthread_mutex_unlock(&e->map_mu);
  if (o) {
    leave(e);
    return fail(HN_EFAIL, "mem_map: [0x%llx, +%llu) overlaps the mapped range [0x%llx, +%llu)", (unsigned long long)addr,
                (unsigned long long)len, (unsigned long long)oaddr, (unsigned long long)olen);
  }
  map_t *m = calloc(1, sizeof *m);
  ucp_mem_map_params_t mp = {.field_mask = UCP_MEM_MAP_PARAM_FIELD_ADDRESS | UCP_MEM_MAP_PARAM_FIELD_LENGTH,
                             .address = (void *)(uintptr_t)addr, .length = len};
  ucs_status_t st = m ? ucp_mem_map(e->ctx, &mp, &m->memh) : UCS_ERR_NO_MEMORY;
  void *packed = NULL;
  size_t plen = 0;
  if (st == UCS_OK) {
    // ucp_rkey_pack, not ucp_memh_pack: UCX 1.22 aborts the process ("packing rkey using ucp_memh_pack() is
    // unsupported") when asked for a plain remote key that way.
    st = ucp_rkey_pack(e->ctx, m->memh, &packed, &plen);
    if (st != UCS_OK) ucp_mem_unmap(e->ctx, m->memh);
  }
  int rc;
  if (st != UCS_OK) {
    free(m);
    rc = fail(HN_EFAIL, "mem_map of [0x%llx, +%llu) failed: %s", (unsigned long long)addr, (unsigned long long)len, ucs_status_string(st));
  } else if (sizeof(rkey_head_t) + plen > (size_t)cap) {
    rc = fail(HN_EFAIL, "mem_map: the key needs %zu bytes, the buffer has %d", sizeof(rkey_head_t) + plen, cap);
  } else {
    rkey_head_t h = {.magic = RKEY_MAGIC, .ucx_len = (uint32_t)plen, .base = addr, .len = len};
    h.check = rkey_check(&h, packed);
    memcpy(out, &h, sizeof h);
    memcpy((char *)out + sizeof h, packed, plen);
    m->addr = addr;
    m->len = len;
    pthread_mutex_lock(&e->map_mu);
    if ((o = map_overlap(e, addr, len))) {  // another thread mapped an overlapping range meanwhile
      rc = fail(HN_EFAIL, "mem_map: [0x%llx, +%llu) overlaps a range mapped meanwhile", (unsigned long long)addr, (unsigned long long)len);
    } else {
      m->next = e->maps;
      e->maps = m;
      rc = (int)(sizeof h + plen);
    }
    pthread_mutex_unlock(&e->map_mu);
  }
  if (packed) ucp_rkey_buffer_release(packed);
  if (rc < 0 && st == UCS_OK) { ucp_mem_unmap(e->ctx, m->memh); free(m); }
  leave(e);
  return rc;
}

EXPORT int hn_mem_unmap(void *ep, uint64_t addr) {
  engine_t *e = ep;
  if (!enter(e)) return fail(HN_EFAIL, "mem_unmap: the network engine is closed");
  pthread_mutex_lock(&e->map_mu);
  map_t **pp = &e->maps;
  while (*pp && (*pp)->addr != addr) pp = &(*pp)->next;
  map_t *m = *pp;
  if (m) *pp = m->next;
  pthread_mutex_unlock(&e->map_mu);
  int rc = 0;
  if (m) { ucp_mem_unmap(e->ctx, m->memh); free(m); }
  else rc = fail(HN_EFAIL, "mem_unmap: nothing is mapped at 0x%llx", (unsigned long long)addr);
  leave(e);
  return rc;
}

EXPORT int hn_rkey(void *ep, int conn, const void *packed, int len) {
  engine_t *e = ep;
  if (!e->rma) return no_rma("rkey");
  if (!enter(e)) return fail(HN_EFAIL, "rkey: the network engine is closed");
  rkey_head_t h;
  if (!packed || len < (int)sizeof h) { leave(e); return fail(HN_EFAIL, "rkey: %d bytes are not a remote key (too short)", len); }
  memcpy(&h, packed, sizeof h);
  if (h.magic != RKEY_MAGIC || h.ucx_len != (uint64_t)len - sizeof h || h.base + h.len < h.base ||
      rkey_check(&h, (const char *)packed + sizeof h) != h.check) {
    leave(e);
    return fail(HN_EFAIL, "rkey: these %d bytes are not a remote key made by hn_mem_map (bad header or checksum)", len);
  }
  int code;
  conn_t *c = conn_ref(e, conn, "rkey", &code);
  if (!c) { leave(e); return code; }
  rkey_t *k = malloc(sizeof *k);
  ucs_status_t st = k ? ucp_ep_rkey_unpack(c->ep, (const char *)packed + sizeof h, &k->rk) : UCS_ERR_NO_MEMORY;
  int rc;
  if (st != UCS_OK) {
    free(k);
    rc = fail(HN_EFAIL, "rkey: unpacking the remote key for %s failed: %s", c->peer, ucs_status_string(st));
  } else {
    k->conn = conn;
    k->base = h.base;
    k->len = h.len;
    pthread_mutex_lock(&e->rkey_mu);
    if (e->rkey_nfree) {
      rc = e->rkey_free[--e->rkey_nfree];
      atomic_store_explicit(slot_ref(&e->rkeys, rc), k, memory_order_release);  // the record before its pointer
    } else {
      rc = slot_add(&e->rkeys, k);
    }
    pthread_mutex_unlock(&e->rkey_mu);
    if (rc < 0) { ucp_rkey_destroy(k->rk); free(k); rc = fail(HN_EFAIL, "rkey: too many remote keys"); }
  }
  conn_unref(c);
  leave(e);
  return rc;
}

static void rkey_free_id(engine_t *e, int id) {  // under rkey_mu
  if (e->rkey_nfree == e->rkey_free_cap) {
    int cap = e->rkey_free_cap ? 2 * e->rkey_free_cap : 64;
    int *f = realloc(e->rkey_free, (size_t)cap * sizeof *f);
    if (!f) return;  // the id is lost, nothing else
    e->rkey_free = f;
    e->rkey_free_cap = cap;
  }
  e->rkey_free[e->rkey_nfree++] = id;
}

EXPORT void hn_rkey_release(void *ep, int rkey) {
  engine_t *e = ep;
  if (!enter(e)) return;
  pthread_mutex_lock(&e->rkey_mu);
  rkey_t *k = NULL;
  if (rkey >= 0 && rkey < atomic_load_explicit(&e->rkeys.n, memory_order_relaxed)) {
    k = atomic_exchange_explicit(slot_ref(&e->rkeys, rkey), NULL, memory_order_acq_rel);
    if (k) rkey_free_id(e, rkey);
  }
  pthread_mutex_unlock(&e->rkey_mu);
  if (k) { ucp_rkey_destroy(k->rk); free(k); }
  leave(e);
}

// The rkeys of a connection whose endpoint is closing (no thread uses the connection any more). Destroyed after
// rkey_mu is released (no engine mutex across UCP calls: see hn_mem_map).
static void rkeys_drop_conn(engine_t *e, int conn) {
  rkey_t *drop = NULL;
  pthread_mutex_lock(&e->rkey_mu);
  int n = atomic_load_explicit(&e->rkeys.n, memory_order_relaxed);
  for (int i = 0; i < n; i++) {
    rkey_t *k = atomic_load_explicit(slot_ref(&e->rkeys, i), memory_order_acquire);
    if (!k || k->conn != conn) continue;
    atomic_store_explicit(slot_ref(&e->rkeys, i), NULL, memory_order_relaxed);
    rkey_free_id(e, i);
    k->next = drop;
    drop = k;
  }
  pthread_mutex_unlock(&e->rkey_mu);
  while (drop) {
    rkey_t *k = drop;
    drop = k->next;
    ucp_rkey_destroy(k->rk);
    free(k);
  }
}

// The UCX key of rkey id for an access of [remote, remote + len) on conn (the caller holds a reference on conn).
static ucp_rkey_h rkey_for(engine_t *e, int rkey, conn_t *c, uint64_t remote, uint64_t len, const char *what, int *code) {
  rkey_t *k = slot_get(&e->rkeys, rkey);
  if (!k) { *code = fail(HN_EFAIL, "%s: no remote key %d", what, rkey); return NULL; }
  if (k->conn != c->id) { *code = fail(HN_EFAIL, "%s: remote key %d belongs to connection %d, not %d", what, rkey, k->conn, c->id); return NULL; }
  if (remote < k->base || len > k->len || remote - k->base > k->len - len) {
    *code = fail(HN_EFAIL, "%s of %llu bytes at 0x%llx on %s: outside the range the key covers [0x%llx, +%llu)", what,
                 (unsigned long long)len, (unsigned long long)remote, c->peer, (unsigned long long)k->base, (unsigned long long)k->len);
    return NULL;
  }
  return k->rk;
}

// ---------------------------------------------------------------- RMA and atomics
// Start a flush of everything issued on c's endpoint (the caller holds a reference on c). NULL: error set in *code.
static op_t *flush_issue(engine_t *e, conn_t *c, int *code) {
  op_t *op = op_new(e, 0, 2);
  if (!op) { *code = fail(HN_EFAIL, "out of memory"); return NULL; }
  ucp_request_param_t prm = {.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA, .cb.send = op_cb, .user_data = op};
  op_issued(op, ucp_ep_flush_nbx(c->ep, &prm));
  return op;  // the caller waits for it
}

// Wait for a flush (no reference on c needed: a flush holds no caller memory). Drops our reference on op.
static int flush_wait(engine_t *e, conn_t *c, op_t *op, int64_t deadline) {
  int rc = 0;
  if (!wait_word(e, &op->done, deadline)) rc = fail(HN_ETIMEDOUT, "flush on the connection to %s timed out", c->peer);
  else if (op->status != UCS_OK) {
    char why[256];
    rc = fail(status_code(op->status), "flush on the connection to %s failed: %s", c->peer,
              atomic_load_explicit(&c->state, memory_order_acquire) == CONN_UP ? ucs_status_string(op->status) : conn_why(c, why, sizeof why));
  }
  op_unref(op);  // a flush that timed out completes later; its callback frees the op
  return rc;
}

// A put from the caller's memory that returns once the memory may be reused (and, with remote_deadline, once the
// peer has the data).
static int put_wait(engine_t *e, conn_t *c, ucp_rkey_h rk, const void *local, uint64_t remote, uint64_t len, int64_t deadline, int flush) {
  op_t *op = op_new(e, 0, 2);
  if (!op) { conn_unref(c); return fail(HN_EFAIL, "out of memory"); }
  ucp_request_param_t prm = {.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA, .cb.send = op_cb, .user_data = op};
  ucs_status_t st = op_issued(op, ucp_put_nbx(c->ep, local, len, remote, rk, &prm));
  atomic_fetch_add_explicit(&c->put_seq, 1, memory_order_release);  // after the put is issued: see hn_store64
  int code = 0;
  op_t *fl = flush && (st == UCS_OK || st == UCS_INPROGRESS) ? flush_issue(e, c, &code) : NULL;  // under our reference
  conn_unref(c);
  int rc = wait_op_or_abort(e, c, op, deadline, "put");
  if (fl) { int frc = flush_wait(e, c, fl, deadline); if (rc == 0) rc = frc; }
  return rc < 0 ? rc : code;
}

EXPORT int hn_put(void *ep, int conn, const void *local, uint64_t remote, int rkey, uint64_t len, int wait_remote_ms) {
  engine_t *e = ep;
  int code;
  conn_t *c = enter_to_wait(e, conn, "put", " (use put_nb)", &code);
  if (!c) return code;
  ucp_rkey_h rk = rkey_for(e, rkey, c, remote, len, "put", &code);
  if (!rk) { conn_unref(c); leave(e); return code; }
  int rc = put_wait(e, c, rk, local, remote, len, deadline_after_ms(wait_remote_ms > 0 ? wait_remote_ms : LOCAL_WAIT_MS), wait_remote_ms > 0);
  leave(e);
  return rc;
}

EXPORT int hn_put_nb(void *ep, int conn, const void *local, uint64_t remote, int rkey, uint64_t len) {
  engine_t *e = ep;
  if (!enter(e)) return fail(HN_EFAIL, "put_nb: the network engine is closed");
  int code;
  conn_t *c = conn_ref(e, conn, "put_nb", &code);
  if (!c) { leave(e); return code; }
  ucp_rkey_h rk = rkey_for(e, rkey, c, remote, len, "put_nb", &code);
  if (!rk) { conn_unref(c); leave(e); return code; }
  int rc = 0;
  if (len > SMALL_BYTES && !tl_in_cb) {  // large: from the caller's memory, returning once it may be reused
    rc = put_wait(e, c, rk, local, remote, len, deadline_after_ms(LOCAL_WAIT_MS), 0);
    leave(e);
    return rc;
  }
  ucp_request_param_t prm = {.op_attr_mask = UCP_OP_ATTR_FLAG_FORCE_IMM_CMPL};
  ucs_status_ptr_t s = ucp_put_nbx(c->ep, local, len, remote, rk, &prm);
  atomic_fetch_add_explicit(&c->put_seq, 1, memory_order_release);  // after the put is issued: see hn_store64
  if (s == NULL) count(e, CNT_SENT_IMMEDIATE, 1);
  else if (UCS_PTR_IS_PTR(s)) {  // not expected with FORCE_IMM_CMPL: the memory is in use, so wait here
    while (!tl_in_cb && ucp_request_check_status(s) == UCS_INPROGRESS) progress(e);
    ucp_request_free(s);
  } else if (UCS_PTR_STATUS(s) != UCS_ERR_NO_RESOURCE) {
    rc = fail(status_code(UCS_PTR_STATUS(s)), "put_nb on the connection to %s failed: %s", c->peer, ucs_status_string(UCS_PTR_STATUS(s)));
  } else {
    op_t *op = op_new(e, len, 1);
    if (!op) rc = fail(HN_EFAIL, "put_nb: out of memory copying %llu bytes", (unsigned long long)len);
    else {
      memcpy(op->data, local, len);
      op->counted = 1;
      atomic_fetch_add_explicit(&e->inflight, 1, memory_order_seq_cst);  // before the callback can run; see wake_progress
      prm = (ucp_request_param_t){.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA, .cb.send = op_cb, .user_data = op};
      s = ucp_put_nbx(c->ep, op->data, len, remote, rk, &prm);
      atomic_fetch_add_explicit(&c->put_seq, 1, memory_order_release);  // see hn_store64
      count(e, CNT_SENT_COPIED, 1);
      if (UCS_PTR_IS_PTR(s)) wake_progress(e, WAKE_WORK);
      else {
        atomic_fetch_sub_explicit(&e->inflight, 1, memory_order_seq_cst);
        free(op);
        if (UCS_PTR_STATUS(s) != UCS_OK)
          rc = fail(status_code(UCS_PTR_STATUS(s)), "put_nb on the connection to %s failed: %s", c->peer, ucs_status_string(UCS_PTR_STATUS(s)));
      }
    }
  }
  conn_unref(c);
  leave(e);
  return rc;
}

EXPORT int hn_fence(void *ep) {
  engine_t *e = ep;
  if (!enter(e)) return fail(HN_EFAIL, "fence: the network engine is closed");
  ucs_status_t st = ucp_worker_fence(e->worker);
  leave(e);
  return st == UCS_OK ? 0 : fail(HN_EFAIL, "ucp_worker_fence failed: %s", ucs_status_string(st));
}

// hn_store64. UCP's atomics cannot serve here: on memory registered from ordinary allocations no transport of a
// typical host offers them (tcp has none; sysv/posix only on their own segments; cma registers nothing where
// ptrace is restricted), and UCP 1.22 has no software fallback for fetching atomics: a UCP_ATOMIC_OP_SWAP there
// fails the endpoint ("cannot find remote protocol ... amo_fetch"). So the engine does it itself: an AM_STORE that
// the peer's engine applies with one 64-bit atomic store (release). A put of 8 bytes would not do: over tcp it is
// received straight into place and may land in pieces, so a reader could see half a value.
// Ordering: a store is sent only once every put issued on the connection before it is complete in the peer's
// memory (an ep flush covers them; puts go on other lanes than AMs, e.g. tcp zero-copy, so a fence alone would
// not order them against our AM). Stores leave in the order they were issued. So a peer that sees the value sees
// every put issued before the store (with or without a fence). Later puts are not held back: they may land
// before an earlier store does.
static void store_drain(engine_t *e, conn_t *c);

typedef struct { engine_t *e; conn_t *c; uint64_t seq; } store_flush_t;

static void store_flushed(engine_t *e, conn_t *c, uint64_t seq, ucs_status_t st) {
  pthread_mutex_lock(&c->st_mu);
  if (st == UCS_OK && seq > c->flushed_seq) c->flushed_seq = seq;
  pthread_mutex_unlock(&c->st_mu);
  if (st == UCS_OK) store_drain(e, c);  // a failed flush: the connection died; its stores die with it
}

static void store_flush_cb(void *request, ucs_status_t status, void *user_data) {
  store_flush_t *f = user_data;
  ucp_request_free(request);
  tl_in_cb++;
  store_flushed(f->e, f->c, f->seq, status);
  tl_in_cb--;
  atomic_fetch_sub_explicit(&f->e->inflight, 1, memory_order_seq_cst);
  free(f);
}

// Send the stores whose puts are complete, oldest first; one thread at a time (another one that finds us at it
// leaves the sending to us). Runs in the thread of hn_store64 (holding a reference on c) or in the flush's
// callback (under the worker lock, so the endpoint cannot be closed meanwhile). Never holds st_mu across a UCP
// call: a thread progressing the worker (holding its lock) may be waiting for st_mu in store_flush_cb.
static void store_drain(engine_t *e, conn_t *c) {
  pthread_mutex_lock(&c->st_mu);
  if (c->draining) { c->redrain = 1; pthread_mutex_unlock(&c->st_mu); return; }
  c->draining = 1;
  for (;;) {
    pstore_t *p = c->st_head;
    if (!p || p->after_seq > c->flushed_seq) {
      if (!c->redrain) break;
      c->redrain = 0;
      continue;
    }
    c->st_head = p->next;
    if (!c->st_head) c->st_tail = NULL;
    pthread_mutex_unlock(&c->st_mu);
    uint64_t st[2] = {p->addr, p->value};
    if (atomic_load_explicit(&c->state, memory_order_acquire) == CONN_UP) send_copy(e, c->ep, AM_STORE, st, NULL, 0);
    free(p);
    pthread_mutex_lock(&c->st_mu);
  }
  c->draining = 0;
  pthread_mutex_unlock(&c->st_mu);
}

// Wait (up to timeout_ms; < 0: forever; 0: only as long as a waiter spins) until the 64-bit word at addr, in this process, is >= value: a value the peer
// sends in a message whose handler stores it (release) and wakes futex sleepers on its low 32-bit word. The waiter
// progresses the worker itself while it spins (the message is handled right here), then sleeps on that word while
// the progress thread handles arrivals. 0: reached; -1: timed out.
EXPORT int hn_wait_ge64(void *ep, const void *addr, uint64_t value, int timeout_ms) {
  engine_t *e = ep;
  _Atomic uint64_t *word = (_Atomic uint64_t *)addr;
  if (atomic_load_explicit(word, memory_order_acquire) >= value) return 0;
  if (!enter(e)) return fail(HN_EFAIL, "wait: the network engine is closed");
  int64_t start = now_ns(), spin_end = start + spin_budget(&e->wait_ewma);
  int64_t deadline = timeout_ms == 0 ? spin_end : deadline_after_ms(timeout_ms);  // 0: only the spin phase
  if (spin_end > deadline) spin_end = deadline;
  int done = 0;
  // Memory another process stores into (hn_set_sleep_word) needs no progress to change: between progress calls (a
  // microsecond or so each, tcp's epoll included) the word is polled alone for a while, so a store is seen at once.
  _Atomic uint64_t *shared_count = atomic_load_explicit(&e->sleep_word, memory_order_acquire);
  int64_t poll_ns = shared_count ? SHARED_POLL_NS : 0;
  if (!tl_in_cb) {
    atomic_fetch_add_explicit(&e->spinners, 1, memory_order_relaxed);
    for (int64_t next_yield = start + SPIN_MIN_NS / 2;;) {
      progress(e);
      if ((done = atomic_load_explicit(word, memory_order_acquire) >= value)) break;
      int64_t t = now_ns();
      for (int64_t until = t + poll_ns; t < until && !done; t = now_ns()) {
        cpu_relax();
        done = atomic_load_explicit(word, memory_order_acquire) >= value;
      }
      if (done) break;
      if (t >= spin_end) break;
      spin_yield(&next_yield, t);
    }
    atomic_fetch_sub_explicit(&e->spinners, 1, memory_order_seq_cst);
    if (done) spin_learn(&e->wait_ewma, now_ns() - start);
    count(e, done ? CNT_WAITS_SPUN : CNT_WAITS_SLEPT, 1);
    spin_ended(e);
  }
  if (!done) {
    _Atomic uint32_t *low = (_Atomic uint32_t *)addr;
#if __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
    low += 1;
#endif
    atomic_fetch_add_explicit(&e->waiters, 1, memory_order_seq_cst);  // seq_cst: see wake_progress
    atomic_fetch_add_explicit(&local_sleepers, 1, memory_order_seq_cst);  // seq_cst: see hn_store_local64
    if (shared_count) atomic_fetch_add_explicit(shared_count, 1, memory_order_seq_cst);  // seq_cst: see hn_set_sleep_word
    wake_progress(e, WAKE_WAITER);
    // How the sleep ended, for the counters: a sleep the value's store woke (or a store seen on the way to sleep), or
    // a periodic re-check after a slice ran out with no wake (a store that did not wake its sleepers shows here).
    int rechecked = 0;
    for (;;) {
      uint32_t seen = atomic_load_explicit(low, memory_order_seq_cst);
      if ((done = atomic_load_explicit(word, memory_order_acquire) >= value)) break;
      int64_t t = now_ns();
      if (t >= deadline) break;
      rechecked = !futex_wait(low, seen, deadline - t < SLEEP_SLICE_NS ? deadline - t : SLEEP_SLICE_NS);  // the storer wakes us
    }
    if (done) count(e, rechecked ? CNT_WAITS_RECHECKED : CNT_WAITS_WOKEN, 1);
    atomic_fetch_sub_explicit(&local_sleepers, 1, memory_order_relaxed);
    if (shared_count) atomic_fetch_sub_explicit(shared_count, 1, memory_order_relaxed);
    atomic_fetch_sub_explicit(&e->waiters, 1, memory_order_seq_cst);
    if (done) spin_learn(&e->wait_ewma, now_ns() - start);  // (a wait that slept teaches too: see spin_learn)
  }
  leave(e);
  return done ? 0 : HN_ETIMEDOUT;
}

// A counter in memory another process reads (the client's status page, which its server maps): hn_wait_ge64 adds
// its sleepers to it as well, so that a server storing straight into memory this process waits on sends a WAKE only
// while somebody sleeps. The waiter increments it (seq_cst) before its last look at the value; the storer stores the
// value, then (seq_cst fence) reads the counter: one of them sees the other. NULL: none.
EXPORT void hn_set_sleep_word(void *ep, void *addr) {
  atomic_store_explicit(&((engine_t *)ep)->sleep_word, (_Atomic uint64_t *)addr, memory_order_release);
}

// Wake the threads sleeping on the 64-bit word at addr of this process (in hn_wait_ge64, or cp.c's waiter) after a
// store into it (value: what it now holds).
EXPORT void hn_wake_local64(void *addr, uint64_t value) {
  _Atomic uint32_t *low = (_Atomic uint32_t *)addr;
#if __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
  low += 1;
#endif
  atomic_thread_fence(memory_order_seq_cst);  // pairs with the sleepers' seq_cst count before they read the value
  hn_waker_fn waker = atomic_load_explicit(&other_sleepers, memory_order_acquire);
  if (!waker || atomic_load_explicit(&local_sleepers, memory_order_seq_cst)) futex_wake(low);
  if (waker) waker(addr, value);
}

// Store value (release) into the 64-bit word at addr of this process and wake the threads sleeping on it: what a
// message handler does with a value its peer sent.
EXPORT void hn_store_local64(void *addr, uint64_t value) {
  atomic_store_explicit((_Atomic uint64_t *)addr, value, memory_order_release);
  hn_wake_local64(addr, value);
}

// Sleepers other than hn_wait_ge64's on words hn_store_local64 stores (hcq's command processor: a queue waiting on a
// signal replica, a host wait): fn(addr, value) wakes those, if any (after the caller's seq_cst fence). Once set,
// a store no longer makes a futex system call when nobody sleeps (about a microsecond a PUSH on a VM); unset, every
// store wakes the word's futex, whoever may sleep on it.
EXPORT void hn_set_waker(void *fn) { atomic_store_explicit(&other_sleepers, (hn_waker_fn)fn, memory_order_release); }
// The waker of a process with no such sleepers (a client of remote devices only, until a local device's backend is
// followed: see hcq.interfaces.HostStores): stores then wake only hn_wait_ge64's sleepers, and only when there are some.
EXPORT void hn_no_other_sleepers(void *addr, uint64_t value) { (void)addr; (void)value; }

EXPORT int hn_store64(void *ep, int conn, uint64_t remote, int rkey, uint64_t value) {
  engine_t *e = ep;
  if (!enter(e)) return fail(HN_EFAIL, "store64: the network engine is closed");
  int code;
  conn_t *c = conn_ref(e, conn, "store64", &code);
  if (!c) { leave(e); return code; }
  ucp_rkey_h rk = rkey_for(e, rkey, c, remote, 8, "store64", &code);
  if (!rk || remote % 8) {
    conn_unref(c);
    leave(e);
    return rk ? fail(HN_EFAIL, "store64: address 0x%llx is not 8-byte aligned", (unsigned long long)remote) : code;
  }
  pstore_t *p = malloc(sizeof *p);
  store_flush_t *f = malloc(sizeof *f);
  if (!p || !f) {
    free(p); free(f);
    conn_unref(c);
    leave(e);
    return fail(HN_EFAIL, "store64: out of memory");
  }
  // acquire: pairs with the release increments; every put this thread (or one it synchronised with) issued counts.
  uint64_t seq = atomic_load_explicit(&c->put_seq, memory_order_acquire);
  *p = (pstore_t){.addr = remote, .value = value, .after_seq = seq};
  int need_flush = 0;
  pthread_mutex_lock(&c->st_mu);
  if (c->st_tail) c->st_tail->next = p; else c->st_head = p;
  c->st_tail = p;
  if (seq > c->flushed_seq && seq > c->flush_issued_seq) { need_flush = 1; c->flush_issued_seq = seq; }
  pthread_mutex_unlock(&c->st_mu);
  int rc = 0;
  if (need_flush) {
    *f = (store_flush_t){.e = e, .c = c, .seq = seq};
    atomic_fetch_add_explicit(&e->inflight, 1, memory_order_seq_cst);  // before the callback can run; see wake_progress
    ucp_request_param_t prm = {.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA, .cb.send = store_flush_cb, .user_data = f};
    ucs_status_ptr_t s = ucp_ep_flush_nbx(c->ep, &prm);
    count(e, CNT_STORE_FLUSHES, 1);
    if (UCS_PTR_IS_PTR(s)) { wake_progress(e, WAKE_WORK); f = NULL; }
    else {
      atomic_fetch_sub_explicit(&e->inflight, 1, memory_order_seq_cst);
      store_flushed(e, c, seq, UCS_PTR_STATUS(s));
      if (UCS_PTR_STATUS(s) != UCS_OK)
        rc = fail(status_code(UCS_PTR_STATUS(s)), "store64 on the connection to %s failed: %s", c->peer, ucs_status_string(UCS_PTR_STATUS(s)));
    }
  } else {
    store_drain(e, c);
  }
  free(f);
  conn_unref(c);
  leave(e);
  return rc;
}

EXPORT int hn_flush(void *ep, int conn, int timeout_ms) {
  engine_t *e = ep;
  int code;
  conn_t *c = enter_to_wait(e, conn, "flush", "", &code);
  if (!c) return code;
  op_t *op = flush_issue(e, c, &code);
  conn_unref(c);
  int rc = op ? flush_wait(e, c, op, deadline_after_ms(timeout_ms)) : code;
  leave(e);
  return rc;
}

EXPORT int hn_get(void *ep, int conn, void *local, uint64_t remote, int rkey, uint64_t len, int timeout_ms) {
  engine_t *e = ep;
  int code;
  conn_t *c = enter_to_wait(e, conn, "get", "", &code);
  if (!c) return code;
  ucp_rkey_h rk = rkey_for(e, rkey, c, remote, len, "get", &code);
  if (!rk) { conn_unref(c); leave(e); return code; }
  op_t *op = op_new(e, 0, 2);
  if (!op) { conn_unref(c); leave(e); return fail(HN_EFAIL, "out of memory"); }
  ucp_request_param_t prm = {.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA, .cb.send = op_cb, .user_data = op};
  op_issued(op, ucp_get_nbx(c->ep, local, len, remote, rk, &prm));
  conn_unref(c);
  int rc = wait_op_or_abort(e, c, op, deadline_after_ms(timeout_ms), "get");
  leave(e);
  return rc;
}

// ---------------------------------------------------------------- misc
EXPORT const char *hn_last_error(void) { return tl_err; }

EXPORT uint64_t hn_counter(void *ep, int which) {
  engine_t *e = ep;
  return e && which >= 0 && which < CNT_N ? atomic_load_explicit(&e->counters[which], memory_order_relaxed) : 0;
}

EXPORT const char *hn_counter_name(int which) { return which >= 0 && which < CNT_N ? counter_names[which] : NULL; }

EXPORT int64_t hn_inflight(void *ep) { return ep ? atomic_load_explicit(&((engine_t *)ep)->inflight, memory_order_relaxed) : 0; }
