/* test_net: address and list parsing, template expansion, and real sockets on
 * 127.0.0.1: a 1 MiB round trip through an echo thread (net_write_all,
 * net_writev_all with more than IOV_MAX entries, net_read_all), EOF and a
 * closed peer as negative errnos without SIGPIPE, and net_connect to a closed
 * port giving up near its deadline. Exit 0 = pass, 1 = fail. */
#include "net.h"

#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>

#include "check.h"
#include "clock.h"

enum { ROUND_TRIP = 1 << 20 };

static void test_parse_addr(void) {
  static const struct {
    const char *s;
    int allow0;
    const char *host;
    unsigned port;
  } good[] = {
      {"127.0.0.1:7070", 0, "127.0.0.1", 7070},
      {"[::1]:9000", 0, "::1", 9000},
      {"[fe80::1%eth0]:1", 0, "fe80::1%eth0", 1},
      {":7070", 0, "0.0.0.0", 7070},
      {"ps-server-0.ps-server:65535", 0, "ps-server-0.ps-server", 65535},
      {"localhost:0", 1, "localhost", 0},
      {":0", 1, "0.0.0.0", 0},
  };
  static const struct {
    const char *s;
    const char *frag; /* must appear in the message */
  } bad[] = {
      {"", "empty"},
      {"host", "\"host\""},
      {"host:", "port"},
      {"host:abc", "\"abc\""},
      {"host:70000", "70000"},
      {"host:65536", "65536"},
      {"host:0", "out of range 1..65535"},
      {"host:-1", "\"-1\""},
      {"host:+80", "\"+80\""},
      {"host:80x", "\"80x\""},
      {"::1:80", "brackets"},
      {"[::1]80", "[::1]80"},
      {"[::1", "]"},
      {"[]:80", "[]"},
      {"a b:80", "a b:80"},
  };
  for (size_t i = 0; i < sizeof(good) / sizeof(good[0]); i++) {
    struct net_addr a;
    char err[256] = "";
    int rc = net_parse_addr(good[i].s, &a, good[i].allow0, err, sizeof(err));
    if (rc != 0 || strcmp(a.host, good[i].host) != 0 || a.port != good[i].port) {
      fprintf(stderr, "parse \"%s\": rc=%d err=%s\n", good[i].s, rc, err);
      failures++;
    }
  }
  for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
    struct net_addr a = {"untouched", 1};
    char err[256] = "";
    int rc = net_parse_addr(bad[i].s, &a, 0, err, sizeof(err));
    if (rc != -EINVAL || !strstr(err, bad[i].frag) || strcmp(a.host, "untouched") != 0) {
      fprintf(stderr, "parse \"%s\": rc=%d err=%s (wanted \"%s\")\n", bad[i].s, rc, err,
              bad[i].frag);
      failures++;
    }
  }
  char host300[320];
  memset(host300, 'h', 300);
  strcpy(host300 + 300, ":80");
  struct net_addr a;
  CHECK(net_parse_addr(host300, &a, 0, NULL, 0) == -EINVAL); /* NULL err is allowed */
}

static void test_parse_list(void) {
  struct net_addr a[4];
  char err[512] = "";
  CHECK(net_parse_addr_list("a:1,b:2,[::1]:3", a, 4, err, sizeof(err)) == 3);
  CHECK(strcmp(a[0].host, "a") == 0 && a[0].port == 1);
  CHECK(strcmp(a[1].host, "b") == 0 && a[1].port == 2);
  CHECK(strcmp(a[2].host, "::1") == 0 && a[2].port == 3);
  CHECK(net_parse_addr_list(" a:1 , b:2 ", a, 2, err, sizeof(err)) == 2);
  CHECK(strcmp(a[1].host, "b") == 0 && a[1].port == 2);
  CHECK(net_parse_addr_list("h:7", a, 1, err, sizeof(err)) == 1);

  CHECK(net_parse_addr_list("a:1,,b:2", a, 4, err, sizeof(err)) == -EINVAL);
  CHECK(strstr(err, "element 1 is empty") != NULL);
  CHECK(net_parse_addr_list("a:1,", a, 4, err, sizeof(err)) == -EINVAL);
  CHECK(strstr(err, "element 1") != NULL);
  CHECK(net_parse_addr_list("a:1,b:x", a, 4, err, sizeof(err)) == -EINVAL);
  CHECK(strstr(err, "element 1") && strstr(err, "\"b:x\""));
  CHECK(net_parse_addr_list("a:1,b:0", a, 4, err, sizeof(err)) == -EINVAL);
  CHECK(strstr(err, "element 1") != NULL);
  CHECK(net_parse_addr_list("a:1,b:2,c:3", a, 2, err, sizeof(err)) == -EINVAL);
  CHECK(strstr(err, "more than 2") != NULL);
  CHECK(net_parse_addr_list("", a, 4, err, sizeof(err)) == -EINVAL);
  CHECK(strstr(err, "empty") != NULL);
  CHECK(net_parse_addr_list("a:1", a, 0, err, sizeof(err)) == -EINVAL);
}

static void test_template(void) {
  char out[64];
  CHECK(net_expand_template("ps-server-{i}.ps-server:7070", 3, out, sizeof(out)) == 0);
  CHECK(strcmp(out, "ps-server-3.ps-server:7070") == 0);
  CHECK(net_expand_template("{i}", 12345, out, sizeof(out)) == 0);
  CHECK(strcmp(out, "12345") == 0);
  CHECK(net_expand_template("w-{i}:12", 10, out, 8) == 0); /* exactly fits: 7 chars + NUL */
  CHECK(strcmp(out, "w-10:12") == 0);
  CHECK(net_expand_template("w-{i}:12", 10, out, 7) == -EINVAL);
  CHECK(net_expand_template("ps-server:7070", 1, out, sizeof(out)) == -EINVAL);
  CHECK(net_expand_template("{i}-{i}", 1, out, sizeof(out)) == -EINVAL);
  CHECK(net_expand_template("ps-server-{i}.ps-server:7070", 100, out, 10) == -EINVAL);
  CHECK(out[0] == '\0');
  CHECK(net_expand_template("a{i}", 1, out, 2) == -EINVAL);
}

/* A listening socket on 127.0.0.1 with a kernel-chosen port. */
static int listen_loopback(uint16_t *port) {
  struct sockaddr_in sa = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
  socklen_t len = sizeof(sa);
  int small = 4096; /* inherited by the accepted socket; see echo_main */
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0 || setsockopt(fd, SOL_SOCKET, SO_RCVBUF, &small, sizeof(small)) != 0 ||
      bind(fd, (struct sockaddr *)&sa, sizeof(sa)) != 0 || listen(fd, 4) != 0 ||
      getsockname(fd, (struct sockaddr *)&sa, &len) != 0) {
    perror("listen_loopback");
    exit(1);
  }
  *port = ntohs(sa.sin_port);
  return fd;
}

/* Echo peer: accepts one connection, reads ROUND_TRIP bytes, sends them back,
 * then closes. It moves 4 KiB at a time with pauses, so the main thread's
 * sends and reads block (and get interrupted) instead of finishing in the
 * socket buffers. Returns 0 or a negative errno. */
static void *echo_main(void *arg) {
  int lfd = *(int *)arg;
  sigset_t alarm;
  sigemptyset(&alarm);
  sigaddset(&alarm, SIGALRM);
  pthread_sigmask(SIG_BLOCK, &alarm, NULL); /* the timer below is for the main thread */
  intptr_t rc = -1;
  char *buf = malloc(ROUND_TRIP);
  int fd = accept(lfd, NULL, NULL);
  if (fd >= 0 && buf) {
    rc = 0;
    for (size_t off = 0; rc == 0 && off < ROUND_TRIP; off += 4096) {
      rc = net_read_all(fd, buf + off, 4096);
      usleep(50);
    }
    for (size_t off = 0; rc == 0 && off < ROUND_TRIP; off += 4096) {
      rc = net_write_all(fd, buf + off, 4096);
      usleep(50);
    }
  }
  if (fd >= 0) close(fd);
  free(buf);
  return (void *)rc;
}

static void on_alarm(int sig) {
  (void)sig;
}

/* A 500 us interval timer whose handler has no SA_RESTART: blocked sends and
 * reads keep being interrupted, so the helpers must handle EINTR and resume
 * after partial counts (mid-iovec for writev) without corrupting the stream. */
static void interrupt_timer(int on) {
  struct sigaction sa = {.sa_handler = on_alarm};
  struct itimerval it = {{0, on ? 500 : 0}, {0, on ? 500 : 0}};
  sigemptyset(&sa.sa_mask);
  if (on) sigaction(SIGALRM, &sa, NULL);
  setitimer(ITIMER_REAL, &it, NULL);
}

static void test_loopback(void) {
  uint16_t port;
  int lfd = listen_loopback(&port);
  pthread_t th;
  CHECK(pthread_create(&th, NULL, echo_main, &lfd) == 0);

  struct net_addr addr = {"127.0.0.1", port};
  struct net_backoff bo = {20, 100, 2000};
  char err[256] = "";
  int fd = net_connect(&addr, &bo, err, sizeof(err));
  if (fd < 0) fprintf(stderr, "net_connect: %d %s\n", fd, err);
  CHECK(fd >= 0);
  if (fd < 0) exit(1);

  int v = 0;
  socklen_t vl = sizeof(v);
  CHECK(getsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &v, &vl) == 0 && v != 0);
  CHECK(getsockopt(fd, SOL_SOCKET, SO_KEEPALIVE, &v, &vl) == 0 && v != 0);
  CHECK(fcntl(fd, F_GETFD) & FD_CLOEXEC);
  CHECK((fcntl(fd, F_GETFL) & O_NONBLOCK) == 0);
  /* Only the test shrinks a buffer: a small send buffer makes writes block. */
  int small = 4096;
  CHECK(setsockopt(fd, SOL_SOCKET, SO_SNDBUF, &small, sizeof(small)) == 0);

  unsigned char *out = malloc(ROUND_TRIP), *in = malloc(ROUND_TRIP);
  for (size_t i = 0; i < ROUND_TRIP; i++) out[i] = (unsigned char)(i * 131 + (i >> 12));
  memset(in, 0, ROUND_TRIP);

  /* First half in one call, second half as 2048 iovecs (more than IOV_MAX,
   * so the writev path has to split) of irregular sizes, so the partial
   * counts the kernel returns (page multiples) land inside an entry. */
  interrupt_timer(1);
  CHECK(net_write_all(fd, out, ROUND_TRIP / 2) == 0);
  enum { NIOV = 2048 };
  struct iovec *iov = calloc(NIOV, sizeof(*iov));
  size_t off = ROUND_TRIP / 2;
  for (int i = 0; i < NIOV; i++) {
    iov[i].iov_base = out + off;
    iov[i].iov_len = i < NIOV - 1 ? 1 + (size_t)i * 7919 % 500 : ROUND_TRIP - off;
    off += iov[i].iov_len;
  }
  CHECK(off == ROUND_TRIP);
  CHECK(net_writev_all(fd, iov, NIOV) == 0);
  CHECK(net_read_all(fd, in, ROUND_TRIP) == 0);
  interrupt_timer(0);
  CHECK(memcmp(in, out, ROUND_TRIP) == 0);

  void *th_rc;
  pthread_join(th, &th_rc);
  CHECK((intptr_t)th_rc == 0);

  /* The peer closed: reading is -ECONNRESET, and writing ends in -EPIPE or
   * -ECONNRESET instead of SIGPIPE killing the test. */
  char c;
  CHECK(net_read_all(fd, &c, 1) == -ECONNRESET);
  int wrc = 0;
  for (int i = 0; i < 100 && wrc == 0; i++) {
    wrc = net_write_all(fd, out, 4096);
    if (wrc == 0) usleep(1000);
  }
  CHECK(wrc == -EPIPE || wrc == -ECONNRESET);

  close(fd);
  close(lfd);
  free(iov);
  free(in);
  free(out);
}

static void test_connect_refused(void) {
  /* A port that was just free: bind, read the port, close. */
  uint16_t port;
  int lfd = listen_loopback(&port);
  close(lfd);
  struct net_addr addr = {"127.0.0.1", port};
  char err[256] = "";

  /* deadline 300 ms: it tried again with backoff until the deadline, as its
   * message says ("gave up after N attempts in M ms", N > 1, M >= 300);
   * the call itself returned within 10 times the deadline */
  struct net_backoff bo = {50, 2000, 300};
  uint64_t t0 = clock_now_ns();
  int rc = net_connect(&addr, &bo, err, sizeof(err));
  double s = (double)(clock_now_ns() - t0) / 1e9;
  CHECK(rc == -ECONNREFUSED);
  const char *gave_up = strstr(err, "gave up after ");
  int attempts = 0;
  long long in_ms = 0;
  CHECK(strstr(err, "127.0.0.1") && gave_up &&
            sscanf(gave_up, "gave up after %d attempts in %lld ms", &attempts, &in_ms) == 2 &&
            attempts > 1 && in_ms >= 300,
        "deadline 300 ms: %s", err);
  CHECK(s <= 3.0, "deadline 300 ms took %.3f s", s);

  /* deadline 0: exactly one try (no "attempts" in the message), no sleeping */
  bo.deadline_ms = 0;
  t0 = clock_now_ns();
  rc = net_connect(&addr, &bo, err, sizeof(err));
  s = (double)(clock_now_ns() - t0) / 1e9;
  CHECK(rc == -ECONNREFUSED);
  CHECK(s < 2.0, "deadline 0 took %.3f s", s);
  CHECK(strstr(err, "attempts") == NULL);
}

static void test_pipe_fallback(void) {
  /* On a non-socket fd the helpers fall back to write/read. */
  int p[2];
  CHECK(pipe(p) == 0);
  char msg[] = "hello, pipe", got[sizeof(msg)] = "";
  struct iovec iov[2] = {{msg, 5}, {msg + 5, sizeof(msg) - 5}};
  CHECK(net_writev_all(p[1], iov, 2) == 0);
  CHECK(net_read_all(p[0], got, sizeof(got)) == 0);
  CHECK(memcmp(got, msg, sizeof(msg)) == 0);
  close(p[1]);
  CHECK(net_read_all(p[0], got, 1) == -ECONNRESET);
  close(p[0]);
}

static void test_listen_accept(void) {
  /* net_listen on port 0, the port read back, a connection accepted with
   * the peer's address, and a second listener on the same port refused. */
  struct net_addr a = {.host = "127.0.0.1", .port = 0};
  char err[256] = "";
  int lfd = net_listen(&a, 4, err, sizeof(err));
  CHECK(lfd >= 0);
  int port = net_bound_port(lfd);
  CHECK(port > 0);
  struct net_addr same = {.host = "127.0.0.1", .port = (uint16_t)port};
  CHECK(net_listen(&same, 4, err, sizeof(err)) == -EADDRINUSE);
  CHECK(strstr(err, "127.0.0.1") != NULL);
  struct net_backoff once = {0, 0, 0};
  int cfd = net_connect(&same, &once, err, sizeof(err));
  CHECK(cfd >= 0);
  char peer[80] = "";
  int afd = net_accept(lfd, peer, sizeof(peer));
  CHECK(afd >= 0);
  CHECK(strncmp(peer, "127.0.0.1:", 10) == 0);
  CHECK(net_set_nonblocking(afd, 1) == 0);
  char b;
  CHECK(read(afd, &b, 1) < 0 && errno == EAGAIN);
  CHECK(net_set_nonblocking(afd, 0) == 0);
  CHECK(net_set_user_timeout(afd, 1000) == 0);
  CHECK(net_write_all(cfd, "x", 1) == 0);
  CHECK(net_read_all(afd, &b, 1) == 0 && b == 'x');
  close(cfd);
  close(afd);
  close(lfd);
}

int main(void) {
  test_parse_addr();
  test_listen_accept();
  test_parse_list();
  test_template();
  test_loopback();
  test_connect_refused();
  test_pipe_fallback();
  uint64_t a = clock_now_ns(), b = clock_now_ns();
  CHECK(a > 0 && b >= a);
  if (failures) {
    fprintf(stderr, "test_net: %d failure(s)\n", failures);
    return 1;
  }
  printf("test_net: ok\n");
  return 0;
}
