// A fork server for the C compiler, loaded into it with LD_PRELOAD (see compile_server.py).
//
// A compiler linked against shared LLVM libraries spends 30-40 ms of every run starting up: relocating the libraries
// and running their static constructors, before main() is reached. This library interposes __libc_start_main so the
// compiler stops just before main(), when all of that is done, and serves requests on a socket from there: each
// request is forked off that state and runs the compiler's own main() with the request's arguments, environment and
// working directory. A compiler started without HCQ_COMPILE_SERVER_FD runs as usual.
//
// Protocol (SOCK_SEQPACKET, one message per datagram; replies are {int32 kind, int32 value}):
//   server -> client: HELLO {HELLO, PROTOCOL} followed by the server's executable path (/proc/self/exe)
//   client -> server: a request: "cwd\0argc\0argv[0]\0...argv[argc-1]\0env[0]\0...env[n-1]\0", plus exactly one
//                     file descriptor (SCM_RIGHTS) that gets the compiler's stdout and stderr
//   server -> client: {STARTED, pid} once the compiler runs, then {EXITED, wait status} when it ends;
//                     or {REFUSED, errno-like code} for a malformed request or a failed fork (the server goes on)
// The server exits when the client closes its end, or after IDLE_EXIT_MS without a request.
// One thread: the server handles one request at a time, which is what the client's lock allows.
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

enum { MSG_HELLO = 0, MSG_STARTED = 1, MSG_EXITED = 2, MSG_REFUSED = 3 };
#define PROTOCOL 1
#define MAX_REQUEST (1 << 20)
#define MAX_ARGS 65536
#define IDLE_EXIT_MS 120000

typedef int (*main_fn)(int, char **, char **);
typedef int (*start_main_fn)(main_fn, int, char **, void (*)(void), void (*)(void), void (*)(void), void *);
static main_fn compiler_main;
extern char **environ;

typedef struct {
  char *cwd;
  int argc;
  char **argv, **envp;  // NULL-terminated, pointing into the request buffer
} request_t;

static void reply(int sock, int32_t kind, int32_t value) {
  int32_t msg[2] = {kind, value};
  (void)!send(sock, msg, sizeof msg, MSG_NOSIGNAL);  // a client that left is noticed at the next recv
}

static void hello(int sock) {
  char msg[8 + 4096];
  int32_t head[2] = {MSG_HELLO, PROTOCOL};
  memcpy(msg, head, sizeof head);
  ssize_t n = readlink("/proc/self/exe", msg + 8, sizeof msg - 8);
  (void)!send(sock, msg, 8 + (n > 0 ? (size_t)n : 0), MSG_NOSIGNAL);
}

// The strings of a request (n bytes, NUL-terminated) into r; 0, or EINVAL when it is malformed.
static int parse(char *buf, size_t n, request_t *r) {
  if (n == 0 || buf[n - 1] != '\0') return EINVAL;
  size_t count = 0;
  for (size_t i = 0; i < n; i++) count += buf[i] == '\0';
  char *p = buf, *end = buf + n;
  r->cwd = p;
  p += strlen(p) + 1;
  if (p >= end) return EINVAL;
  char *tail;
  long argc = strtol(p, &tail, 10);
  if (*tail != '\0' || argc < 1 || argc > MAX_ARGS || (size_t)argc + 2 > count) return EINVAL;
  p += strlen(p) + 1;
  size_t nenv = count - 2 - (size_t)argc;
  r->argc = (int)argc;
  r->argv = calloc((size_t)argc + 1, sizeof(char *));
  r->envp = calloc(nenv + 1, sizeof(char *));
  if (!r->argv || !r->envp) { free(r->argv); free(r->envp); return ENOMEM; }
  for (long i = 0; i < argc; i++) { r->argv[i] = p; p += strlen(p) + 1; }
  for (size_t i = 0; i < nenv; i++) { r->envp[i] = p; p += strlen(p) + 1; }
  return 0;
}

// In the forked child: become the compiler run the request asks for. Never returns.
static void become_compiler(int sock, int out, request_t *r) {
  close(sock);
  int in = open("/dev/null", O_RDONLY);
  if (in < 0 || dup2(in, 0) < 0 || dup2(out, 1) < 0 || dup2(out, 2) < 0 || chdir(r->cwd) != 0) _exit(127);
  if (in > 2) close(in);
  if (out > 2) close(out);
  environ = r->envp;
  exit(compiler_main(r->argc, r->argv, r->envp));  // exit(): the compiler's atexit handlers and stdio flush as usual
}

// The file descriptor a request carried (-1 if none); any others are closed.
static int received_fd(struct msghdr *m) {
  int fd = -1;
  for (struct cmsghdr *c = CMSG_FIRSTHDR(m); c; c = CMSG_NXTHDR(m, c)) {
    if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS) continue;
    size_t nfds = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
    for (size_t i = 0; i < nfds; i++) {
      int got;
      memcpy(&got, CMSG_DATA(c) + i * sizeof(int), sizeof got);
      if (fd < 0) fd = got; else close(got);
    }
  }
  return fd;
}

static void handle(int sock, char *buf, size_t n, int out) {
  request_t r;
  int err = out < 0 ? EBADF : parse(buf, n, &r);
  if (err) { reply(sock, MSG_REFUSED, err); return; }
  pid_t pid = fork();
  if (pid == 0) become_compiler(sock, out, &r);
  free(r.argv);
  free(r.envp);
  if (pid < 0) { reply(sock, MSG_REFUSED, errno); return; }
  reply(sock, MSG_STARTED, pid);
  int status = 0;
  while (waitpid(pid, &status, 0) < 0 && errno == EINTR) {}
  reply(sock, MSG_EXITED, status);
}

static int serve(int sock) {
  static char buf[MAX_REQUEST + 1];
  hello(sock);
  for (;;) {
    struct pollfd p = {.fd = sock, .events = POLLIN};
    int ready = poll(&p, 1, IDLE_EXIT_MS);
    if (ready == 0) _exit(0);  // idle: the client starts a new server when it needs one
    if (ready < 0) { if (errno == EINTR) continue; _exit(1); }
    union { char bytes[CMSG_SPACE(4 * sizeof(int))]; struct cmsghdr align; } control;
    struct iovec iov = {.iov_base = buf, .iov_len = MAX_REQUEST};
    struct msghdr m = {.msg_iov = &iov, .msg_iovlen = 1, .msg_control = control.bytes, .msg_controllen = sizeof control.bytes};
    ssize_t n = recvmsg(sock, &m, MSG_CMSG_CLOEXEC);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) _exit(0);  // the client closed its end (or left)
    int out = received_fd(&m);
    if (m.msg_flags & (MSG_TRUNC | MSG_CTRUNC)) reply(sock, MSG_REFUSED, E2BIG);
    else handle(sock, buf, (size_t)n, out);
    if (out >= 0) close(out);
  }
}

static int server_main(int argc, char **argv, char **envp) {
  const char *fd = getenv("HCQ_COMPILE_SERVER_FD");
  if (!fd) return compiler_main(argc, argv, envp);  // not started by hcq: the compiler as usual
  char *tail;
  long sock = strtol(fd, &tail, 10);
  if (*tail != '\0' || sock < 0 || sock > 65535) return compiler_main(argc, argv, envp);
  return serve((int)sock);
}

__attribute__((visibility("default")))
int __libc_start_main(main_fn main, int argc, char **argv, void (*init)(void), void (*fini)(void), void (*rtld_fini)(void),
                      void *stack_end) {
  start_main_fn real = (start_main_fn)dlsym(RTLD_NEXT, "__libc_start_main");
  if (!real) _exit(127);
  compiler_main = main;
  return real(server_main, argc, argv, init, fini, rtld_fini, stack_end);
}
