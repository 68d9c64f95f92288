// uct_put: the attacker of docs/design.md's "What remains": a raw UCT tcp PUT into another process, with nothing
// but UCX's UCT API (no UCP, no hcq). UCX's tcp transport executes a PUT frame (an address and the bytes to write
// there) from any peer that completed UCT's tcp handshake on the iface's listening port, whatever the receiving
// worker's settings (UCX_TCP_PUT_ENABLE only stops it *sending* puts; the receive path, uct_tcp_ep_handle_put_req in
// src/uct/tcp/tcp_ep.c, memcpy's to the address the frame names).
//
//   uct_put [-t SECONDS] [-d DEVICE] HOST PORT ADDRESS HEXBYTES
//
// opens UCT's tcp transport on the network device that has HOST (or the one the kernel routes HOST through; "lo"
// for 127.0.0.0/8; -d names one), connects an endpoint (CONNECT_TO_IFACE) to the tcp iface listening on HOST:PORT, PUTs
// the bytes HEXBYTES to ADDRESS (an integer, 0x... for hex) in the process that owns that port, and flushes: the flush
// completes only once the target's PUT_ACK came back, i.e. the target wrote the bytes. The peer's addresses are built
// as an attacker who knows only HOST and PORT would: the device address is this process's own tcp device address
// (kept as UCX packs it for loopback when HOST is 127.0.0.1, otherwise rewritten to HOST), the iface address is our
// own with its port replaced by PORT.
//
// Prints exactly one line on stdout and exits:
//   0  "put done: N bytes to ADDRESS at HOST:PORT via DEVICE"
//   3  "connect failed: ..."  (no tcp handshake completed within the time: refused, dropped, or not a UCT tcp port)
//   4  "put failed: ..."      (connected, but the put or its acknowledgement did not complete in time)
//   5  "setup failed: ..."    (no tcp transport or no device for HOST here: nothing was tried)
//   2  usage
// Never hangs: progress is bounded by -t SECONDS (default 5), and a timer 2 s later ends the process whatever UCX is
// doing. UCX's own messages (if any) go to stderr.
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <dirent.h>
#include <errno.h>
#include <ifaddrs.h>
#include <net/if.h>
#include <netinet/in.h>
#include <signal.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <time.h>
#include <unistd.h>

#include <ucs/async/async_fwd.h>
#include <uct/api/uct.h>

enum { RC_DONE = 0, RC_USAGE = 2, RC_CONNECT = 3, RC_PUT = 4, RC_SETUP = 5 };

// UCX's tcp address layouts (src/uct/tcp/tcp.h, UCX 1.22; not part of the public headers): a device address is
// {u8 flags, u8 sa_family} followed by an in_addr (or, with the LOOPBACK flag, a uct_iface_local_addr_ns_t, and the
// peer is then 127.0.0.1); an iface address is the iface's listening port in network byte order.
#define TCP_DEVICE_ADDR_FLAG_LOOPBACK 1u
typedef struct __attribute__((packed)) { uint8_t flags, sa_family; } tcp_device_addr_t;
typedef struct __attribute__((packed)) { uint16_t port; } tcp_iface_addr_t;

static volatile sig_atomic_t exit_code = RC_PUT;  // what the alarm exits with (set before the outcome is printed)
static int outcome_printed;
static int result_fd = 1;  // our stdout; UCX logs to stdout, so its fd 1 is made our stderr (see main)

static void outcome(int rc, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void outcome(int rc, const char *fmt, ...) {
  if (outcome_printed) return;
  outcome_printed = 1;
  exit_code = rc;
  char line[1024];
  va_list ap;
  va_start(ap, fmt);
  int n = vsnprintf(line, sizeof line - 1, fmt, ap);
  va_end(ap);
  if (n < 0) n = 0;
  if (n > (int)sizeof line - 2) n = sizeof line - 2;
  line[n++] = '\n';
  if (write(result_fd, line, n) < 0) {}
}

static volatile sig_atomic_t connected;  // the handshake completed (put_zcopy took the put)

static void on_alarm(int sig) {
  (void)sig;
  if (!outcome_printed) {
    static const char c[] = "connect failed: timed out inside UCX (no handshake)\n", p[] = "put failed: timed out inside UCX\n";
    if (write(result_fd, connected ? p : c, connected ? sizeof p - 1 : sizeof c - 1) < 0) {}
    _exit(connected ? RC_PUT : RC_CONNECT);
  }
  _exit(exit_code);
}

static double now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return ts.tv_sec + ts.tv_nsec * 1e-9;
}

// One round of progress; a short sleep when it did nothing (the machine may be shared: no spinning at full speed).
static void progress(uct_worker_h worker) {
  if (!uct_worker_progress(worker)) nanosleep(&(struct timespec){.tv_nsec = 100000}, NULL);
}

static ucs_status_t ep_error = UCS_OK;  // set by the iface's error handler (connection refused, reset, ...)
static ucs_status_t on_ep_error(void *arg, uct_ep_h ep, ucs_status_t status) {
  (void)arg; (void)ep;
  if (ep_error == UCS_OK) ep_error = status;
  return UCS_OK;  // handled: the endpoint is not used for anything more
}

// The TCP state of our own socket to host:port (/proc/self/fd's sockets looked up in /proc/net/tcp): 2 SYN_SENT (no
// answer: dropped), 1 ESTABLISHED (connected: the peer did not speak UCT's handshake), another state, or -1 (none).
static int tcp_state_to(struct in_addr host, long port) {
  char inodes[4096] = " ";
  DIR *d = opendir("/proc/self/fd");
  if (!d) return -1;
  for (struct dirent *e; (e = readdir(d));) {
    char path[300], target[64];
    snprintf(path, sizeof path, "/proc/self/fd/%s", e->d_name);
    ssize_t n = readlink(path, target, sizeof target - 1);
    if (n <= 0) continue;
    target[n] = 0;
    unsigned long inode;
    size_t k = strlen(inodes);
    if (sscanf(target, "socket:[%lu]", &inode) == 1 && k < sizeof inodes - 24) snprintf(inodes + k, sizeof inodes - k, "%lu ", inode);
  }
  closedir(d);
  FILE *f = fopen("/proc/net/tcp", "r");
  if (!f) return -1;
  char line[512];
  int state = -1;
  while (fgets(line, sizeof line, f)) {
    unsigned raddr, rport, st;
    unsigned long inode;
    char key[32];
    if (sscanf(line, " %*d: %*x:%*x %x:%x %x %*x:%*x %*x:%*x %*x %*u %*u %lu", &raddr, &rport, &st, &inode) != 4) continue;
    snprintf(key, sizeof key, " %lu ", inode);
    if (raddr == host.s_addr && rport == (unsigned)port && strstr(inodes, key) && (state == -1 || st == 1)) state = (int)st;
  }
  fclose(f);
  return state;
}

typedef struct { uct_completion_t super; int done; ucs_status_t status; } comp_t;
static void on_comp(uct_completion_t *self) {
  comp_t *c = (comp_t *)self;
  c->done = 1;
  c->status = self->status;
}

static int parse_hex(const char *s, unsigned char **out, size_t *len) {
  size_t n = strlen(s);
  if (n == 0 || n % 2) return -1;
  unsigned char *b = malloc(n / 2);
  if (!b) return -1;
  for (size_t i = 0; i < n / 2; i++) {
    unsigned v;
    if (sscanf(s + 2 * i, "%2x", &v) != 1 || !strchr("0123456789abcdefABCDEF", s[2 * i]) || !strchr("0123456789abcdefABCDEF", s[2 * i + 1])) {
      free(b);
      return -1;
    }
    b[i] = (unsigned char)v;
  }
  *out = b;
  *len = n / 2;
  return 0;
}

// The network device for `host`: the one that has it, else the one that has the source address the kernel's routes
// pick for it (a UDP socket connected to it: nothing is sent), else the one whose IPv4 subnet holds it, else "lo" for
// 127.0.0.0/8. 0 when found.
static int device_for(struct in_addr host, char *dev, size_t n) {
  struct in_addr src = {0};
  int fd = socket(AF_INET, SOCK_DGRAM | SOCK_CLOEXEC, 0);
  if (fd >= 0) {
    struct sockaddr_in to = {.sin_family = AF_INET, .sin_port = htons(9), .sin_addr = host}, me;
    socklen_t ml = sizeof me;
    if (connect(fd, (struct sockaddr *)&to, sizeof to) == 0 && getsockname(fd, (struct sockaddr *)&me, &ml) == 0) src = me.sin_addr;
    close(fd);
  }
  struct ifaddrs *ifs = NULL;
  if (getifaddrs(&ifs) != 0) return -1;
  const char *exact = NULL, *routed = NULL, *subnet = NULL;
  for (struct ifaddrs *i = ifs; i; i = i->ifa_next) {
    if (!i->ifa_addr || i->ifa_addr->sa_family != AF_INET || !(i->ifa_flags & IFF_UP)) continue;
    struct in_addr a = ((struct sockaddr_in *)i->ifa_addr)->sin_addr;
    struct in_addr m = i->ifa_netmask ? ((struct sockaddr_in *)i->ifa_netmask)->sin_addr : (struct in_addr){0};
    if (a.s_addr == host.s_addr && !exact) exact = i->ifa_name;
    if (src.s_addr && a.s_addr == src.s_addr && !routed) routed = i->ifa_name;
    if (m.s_addr && (a.s_addr & m.s_addr) == (host.s_addr & m.s_addr) && !subnet) subnet = i->ifa_name;
  }
  const char *pick = exact ? exact : routed ? routed : subnet ? subnet : ((ntohl(host.s_addr) >> 24) == 127 ? "lo" : NULL);
  if (pick) snprintf(dev, n, "%s", pick);
  freeifaddrs(ifs);
  return pick ? 0 : -1;
}

int main(int argc, char **argv) {
  double timeout = 5;
  const char *dev_arg = NULL;
  int opt;
  while ((opt = getopt(argc, argv, "t:d:")) != -1) {
    if (opt == 't') timeout = atof(optarg);
    else if (opt == 'd') dev_arg = optarg;
    else goto usage;
  }
  if (argc - optind != 4 || timeout <= 0) {
  usage:
    fprintf(stderr, "usage: %s [-t SECONDS] [-d DEVICE] HOST PORT ADDRESS HEXBYTES\n", argv[0]);
    return RC_USAGE;
  }
  const char *host = argv[optind], *port_s = argv[optind + 1], *addr_s = argv[optind + 2], *hex = argv[optind + 3];
  struct in_addr host_in;
  char *port_end, *end;
  long port = strtol(port_s, &port_end, 10);
  errno = 0;
  unsigned long long remote = strtoull(addr_s, &end, 0);
  unsigned char *data;
  size_t len;
  if (inet_pton(AF_INET, host, &host_in) != 1 || *port_end || port <= 0 || port > 65535 || errno || *end || parse_hex(hex, &data, &len) != 0)
    goto usage;

  // UCX writes its log (connect errors and the like) to stdout: that goes to our stderr, leaving stdout to the one
  // line that says the outcome.
  fflush(stdout);
  if ((result_fd = dup(1)) < 0 || dup2(2, 1) < 0) result_fd = 1;
  signal(SIGALRM, on_alarm);
  struct itimerval backstop = {.it_value = {.tv_sec = (time_t)timeout + 2, .tv_usec = (suseconds_t)((timeout - (time_t)timeout) * 1e6)}};
  setitimer(ITIMER_REAL, &backstop, NULL);  // whatever UCX does, the process ends 2 s after the time it was given
  signal(SIGPIPE, SIG_IGN);

  char dev[IF_NAMESIZE + 1] = "";
  if (dev_arg) snprintf(dev, sizeof dev, "%s", dev_arg);
  else if (device_for(host_in, dev, sizeof dev) != 0) {
    outcome(RC_SETUP, "setup failed: no network device here has or reaches %s (name one with -d)", host);
    return RC_SETUP;
  }

  // The tcp component, its memory domain, and the tcp transport on `dev`.
  uct_component_h *comps;
  unsigned ncomps;
  ucs_status_t st = uct_query_components(&comps, &ncomps);
  if (st != UCS_OK) { outcome(RC_SETUP, "setup failed: uct_query_components: %s", ucs_status_string(st)); return RC_SETUP; }
  uct_component_h tcp = NULL;
  char md_name[UCT_MD_NAME_MAX] = "";
  for (unsigned i = 0; i < ncomps && !tcp; i++) {
    uct_component_attr_t ca = {.field_mask = UCT_COMPONENT_ATTR_FIELD_NAME | UCT_COMPONENT_ATTR_FIELD_MD_RESOURCE_COUNT};
    if (uct_component_query(comps[i], &ca) != UCS_OK || strcmp(ca.name, "tcp") != 0 || ca.md_resource_count < 1) continue;
    uct_md_resource_desc_t *mds = calloc(ca.md_resource_count, sizeof *mds);
    ca.field_mask = UCT_COMPONENT_ATTR_FIELD_MD_RESOURCES;
    ca.md_resources = mds;
    if (mds && uct_component_query(comps[i], &ca) == UCS_OK) {
      tcp = comps[i];
      snprintf(md_name, sizeof md_name, "%s", mds[0].md_name);
    }
    free(mds);
  }
  if (!tcp) { outcome(RC_SETUP, "setup failed: this UCX has no tcp component"); return RC_SETUP; }

  uct_md_config_t *md_cfg;
  uct_md_h md;
  if ((st = uct_md_config_read(tcp, NULL, NULL, &md_cfg)) != UCS_OK) { outcome(RC_SETUP, "setup failed: uct_md_config_read: %s", ucs_status_string(st)); return RC_SETUP; }
  st = uct_md_open(tcp, md_name, md_cfg, &md);
  uct_config_release(md_cfg);
  if (st != UCS_OK) { outcome(RC_SETUP, "setup failed: uct_md_open(%s): %s", md_name, ucs_status_string(st)); return RC_SETUP; }

  uct_tl_resource_desc_t *tls;
  unsigned ntls;
  if ((st = uct_md_query_tl_resources(md, &tls, &ntls)) != UCS_OK) { outcome(RC_SETUP, "setup failed: uct_md_query_tl_resources: %s", ucs_status_string(st)); return RC_SETUP; }
  int have = 0;
  char seen[512] = "";
  for (unsigned i = 0; i < ntls; i++) {
    if (strcmp(tls[i].tl_name, "tcp") != 0) continue;
    if (!strcmp(tls[i].dev_name, dev)) have = 1;
    size_t k = strlen(seen);
    snprintf(seen + k, sizeof seen - k, "%s%s", k ? " " : "", tls[i].dev_name);
  }
  uct_release_tl_resource_list(tls);
  if (!have) { outcome(RC_SETUP, "setup failed: UCX's tcp transport has no device %s for %s (it has: %s)", dev, host, seen); return RC_SETUP; }

  ucs_async_context_t *async;
  uct_worker_h worker;
  if ((st = ucs_async_context_create(UCS_ASYNC_MODE_THREAD_SPINLOCK, &async)) != UCS_OK) { outcome(RC_SETUP, "setup failed: ucs_async_context_create: %s", ucs_status_string(st)); return RC_SETUP; }
  if ((st = uct_worker_create(async, UCS_THREAD_MODE_SINGLE, &worker)) != UCS_OK) { outcome(RC_SETUP, "setup failed: uct_worker_create: %s", ucs_status_string(st)); return RC_SETUP; }

  uct_iface_config_t *if_cfg;
  if ((st = uct_md_iface_config_read(md, "tcp", NULL, NULL, &if_cfg)) != UCS_OK) { outcome(RC_SETUP, "setup failed: uct_md_iface_config_read: %s", ucs_status_string(st)); return RC_SETUP; }
  // Whatever the environment says (hcq's engines run with UCX_TCP_PUT_ENABLE=n), this side sends puts.
  if ((st = uct_config_modify(if_cfg, "TCP_PUT_ENABLE", "y")) != UCS_OK) { outcome(RC_SETUP, "setup failed: setting TCP_PUT_ENABLE: %s", ucs_status_string(st)); return RC_SETUP; }
  // A non-blocking connect(): UCX's default blocks in uct_ep_create until the kernel gives up on a dropped SYN (about
  // two minutes); this way the handshake runs in progress, within our time.
  if ((st = uct_config_modify(if_cfg, "TCP_CONN_NB", "y")) != UCS_OK) { outcome(RC_SETUP, "setup failed: setting TCP_CONN_NB: %s", ucs_status_string(st)); return RC_SETUP; }
  uct_iface_params_t ip = {
      .field_mask = UCT_IFACE_PARAM_FIELD_OPEN_MODE | UCT_IFACE_PARAM_FIELD_DEVICE | UCT_IFACE_PARAM_FIELD_STATS_ROOT |
                    UCT_IFACE_PARAM_FIELD_RX_HEADROOM | UCT_IFACE_PARAM_FIELD_CPU_MASK | UCT_IFACE_PARAM_FIELD_ERR_HANDLER |
                    UCT_IFACE_PARAM_FIELD_ERR_HANDLER_ARG | UCT_IFACE_PARAM_FIELD_ERR_HANDLER_FLAGS | UCT_IFACE_PARAM_FIELD_FEATURES,
      .open_mode = UCT_IFACE_OPEN_MODE_DEVICE,
      .mode.device = {.tl_name = "tcp", .dev_name = dev},
      .stats_root = NULL,
      .rx_headroom = 0,
      .err_handler = on_ep_error,
      .err_handler_arg = NULL,
      .err_handler_flags = 0,
      .features = UCT_IFACE_FEATURE_AM | UCT_IFACE_FEATURE_PUT,
  };
  UCS_CPU_ZERO(&ip.cpu_mask);
  uct_iface_h iface;
  st = uct_iface_open(md, worker, &ip, if_cfg, &iface);
  uct_config_release(if_cfg);
  if (st != UCS_OK) { outcome(RC_SETUP, "setup failed: uct_iface_open(tcp/%s): %s", dev, ucs_status_string(st)); return RC_SETUP; }
  uct_iface_progress_enable(iface, UCT_PROGRESS_SEND | UCT_PROGRESS_RECV);

  uct_iface_attr_t attr;
  if ((st = uct_iface_query(iface, &attr)) != UCS_OK) { outcome(RC_SETUP, "setup failed: uct_iface_query: %s", ucs_status_string(st)); return RC_SETUP; }
  if (!(attr.cap.flags & UCT_IFACE_FLAG_CONNECT_TO_IFACE) || !(attr.cap.flags & UCT_IFACE_FLAG_PUT_ZCOPY)) {
    outcome(RC_SETUP, "setup failed: tcp/%s offers no %s", dev, (attr.cap.flags & UCT_IFACE_FLAG_PUT_ZCOPY) ? "CONNECT_TO_IFACE" : "put_zcopy");
    return RC_SETUP;
  }
  if (len > attr.cap.put.max_zcopy) { outcome(RC_SETUP, "setup failed: %zu bytes exceed tcp's put_zcopy maximum %zu", len, attr.cap.put.max_zcopy); return RC_SETUP; }
  if (attr.device_addr_len < sizeof(tcp_device_addr_t) + sizeof(struct in_addr) || attr.iface_addr_len != sizeof(tcp_iface_addr_t)) {
    outcome(RC_SETUP, "setup failed: unexpected tcp address sizes (device %zu, iface %zu): not UCX 1.22's layout",
            attr.device_addr_len, attr.iface_addr_len);
    return RC_SETUP;
  }

  // The peer's addresses, from our own.
  unsigned char *dev_addr = calloc(1, attr.device_addr_len), *if_addr = calloc(1, attr.iface_addr_len);
  if (!dev_addr || !if_addr) { outcome(RC_SETUP, "setup failed: out of memory"); return RC_SETUP; }
  if ((st = uct_iface_get_device_address(iface, (uct_device_addr_t *)dev_addr)) != UCS_OK ||
      (st = uct_iface_get_address(iface, (uct_iface_addr_t *)if_addr)) != UCS_OK) {
    outcome(RC_SETUP, "setup failed: reading our own tcp addresses: %s", ucs_status_string(st));
    return RC_SETUP;
  }
  tcp_device_addr_t *da = (tcp_device_addr_t *)dev_addr;
  if (da->sa_family != AF_INET && da->sa_family != AF_INET6) { outcome(RC_SETUP, "setup failed: unexpected tcp device address family %u", da->sa_family); return RC_SETUP; }
  int keep_loopback = (da->flags & TCP_DEVICE_ADDR_FLAG_LOOPBACK) && host_in.s_addr == htonl(INADDR_LOOPBACK) && da->sa_family == AF_INET;
  if (!keep_loopback) {  // a plain IPv4 device address naming HOST
    da->flags = 0;
    da->sa_family = AF_INET;
    memcpy(dev_addr + sizeof *da, &host_in, sizeof host_in);
  }
  ((tcp_iface_addr_t *)if_addr)->port = htons((uint16_t)port);

  uct_ep_params_t ep_params = {.field_mask = UCT_EP_PARAM_FIELD_IFACE | UCT_EP_PARAM_FIELD_DEV_ADDR | UCT_EP_PARAM_FIELD_IFACE_ADDR,
                               .iface = iface,
                               .dev_addr = (const uct_device_addr_t *)dev_addr,
                               .iface_addr = (const uct_iface_addr_t *)if_addr};
  uct_ep_h ep;
  errno = 0;
  if ((st = uct_ep_create(&ep_params, &ep)) != UCS_OK) {
    // (UCX's status says little: "Destination is unreachable" for a refused or forbidden connect(); connect()'s
    // errno, logged by UCX on stderr, is still there where it is one of connect()'s)
    int e = errno;
    int said = e == ECONNREFUSED || e == EPERM || e == EACCES || e == ENETUNREACH || e == EHOSTUNREACH || e == ETIMEDOUT || e == EADDRNOTAVAIL;
    outcome(RC_CONNECT, "connect failed: uct_ep_create to %s:%ld: %s%s%s%s", host, port, ucs_status_string(st),
            said ? " (connect: " : "", said ? strerror(e) : "", said ? ")" : "");
    _exit(RC_CONNECT);
  }

  // put_zcopy answers NO_RESOURCE until the endpoint is CONNECTED, which takes UCT's tcp handshake (our CONN_REQ
  // answered by the target's CONN_ACK): its acceptance is the end of the connect phase.
  double deadline = now_s() + timeout;
  uct_iov_t iov = {.buffer = data, .length = len, .memh = UCT_MEM_HANDLE_NULL, .stride = 0, .count = 1};
  comp_t put_comp = {.super = {.func = on_comp, .count = 1, .status = UCS_OK}};
  for (;;) {
    st = uct_ep_put_zcopy(ep, &iov, 1, (uint64_t)remote, 0 /* rkey: tcp checks none */, &put_comp.super);
    if (st != UCS_ERR_NO_RESOURCE) break;
    progress(worker);
    if (ep_error != UCS_OK) {
      outcome(RC_CONNECT, "connect failed: %s:%ld: the connection failed (UCX: %s; its log on stderr says why)", host, port, ucs_status_string(ep_error));
      _exit(RC_CONNECT);
    }
    if (now_s() > deadline) {
      int tcp_state = tcp_state_to(host_in, port);
      if (tcp_state == 2)
        outcome(RC_CONNECT, "connect failed: %s:%ld: no answer to the TCP SYN within %g s (dropped)", host, port, timeout);
      else if (tcp_state == 1)
        outcome(RC_CONNECT, "connect failed: %s:%ld: TCP connected, but no UCT tcp handshake within %g s (not a UCT tcp iface port)", host, port, timeout);
      else
        outcome(RC_CONNECT, "connect failed: %s:%ld: no UCT tcp handshake within %g s (TCP state %d)", host, port, timeout, tcp_state);
      _exit(RC_CONNECT);
    }
  }
  connected = 1;
  if (UCS_STATUS_IS_ERR(st)) {
    outcome(RC_PUT, "put failed: uct_ep_put_zcopy: %s", ucs_status_string(st));
    _exit(RC_PUT);
  }
  if (st == UCS_OK) put_comp.done = 1;  // completed in place: no callback comes
  // The flush completes once the target acknowledged the put (its PUT_ACK carries the put's sequence number).
  comp_t flush_comp = {.super = {.func = on_comp, .count = 1, .status = UCS_OK}};
  for (;;) {
    st = uct_ep_flush(ep, 0, &flush_comp.super);
    if (st != UCS_ERR_NO_RESOURCE) break;
    progress(worker);
    if (ep_error != UCS_OK || now_s() > deadline) break;
  }
  if (st == UCS_OK) flush_comp.done = 1;
  else if (st != UCS_INPROGRESS && st != UCS_ERR_NO_RESOURCE) {
    outcome(RC_PUT, "put failed: uct_ep_flush: %s", ucs_status_string(st));
    _exit(RC_PUT);
  }
  while (!(put_comp.done && flush_comp.done) && ep_error == UCS_OK && now_s() <= deadline) progress(worker);
  if (ep_error != UCS_OK) { outcome(RC_PUT, "put failed: connection lost: %s", ucs_status_string(ep_error)); _exit(RC_PUT); }
  if (!(put_comp.done && flush_comp.done)) { outcome(RC_PUT, "put failed: connected, but no acknowledgement within %g s", timeout); _exit(RC_PUT); }
  if (put_comp.status != UCS_OK || flush_comp.status != UCS_OK) {
    outcome(RC_PUT, "put failed: %s", ucs_status_string(put_comp.status != UCS_OK ? put_comp.status : flush_comp.status));
    _exit(RC_PUT);
  }
  outcome(RC_DONE, "put done: %zu bytes to 0x%llx at %s:%ld via %s", len, remote, host, port, dev);

  uct_ep_destroy(ep);
  uct_iface_close(iface);
  uct_worker_destroy(worker);
  ucs_async_context_destroy(async);
  uct_md_close(md);
  uct_release_component_list(comps);
  free(dev_addr);
  free(if_addr);
  free(data);
  return RC_DONE;
}
