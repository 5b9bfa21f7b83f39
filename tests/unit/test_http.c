/* test_http: the HTTP responder against real sockets on 127.0.0.1: GET and
 * HEAD of a route (status, Content-Type, Content-Length matching the body),
 * a handler's 503, query strings ignored, a request written one byte at a
 * time, and every refusal: 404 unknown path, 405 with Allow for POST (whose
 * body is never read), 400 for malformed request lines, 431 for a head over
 * the size cap, 408 for a client that stops mid-head, and connections beyond
 * the cap closing the oldest idle ones while the server keeps answering,
 * and 25 probes answered within 3 s under a flood of 1,000 idle
 * connections (issue 30; skipped when ulimit -n cannot be raised). Also refused
 * starts (bad address, port in use) and a stop with clients still
 * connected. Exit 0 = pass, 1 = fail. */
#include "http.h"

#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "check.h"
#include "clock.h"

static atomic_int healthy = 1;

static int h_metrics(void *arg, FILE *out, const char **ctype) {
  fprintf(out, "%s 42\n", (const char *)arg);
  *ctype = "text/plain; version=0.0.4; charset=utf-8";
  return 200;
}

static int h_ready(void *arg, FILE *out, const char **ctype) {
  (void)arg;
  (void)ctype;
  if (atomic_load(&healthy)) {
    fputs("ready\n", out);
    return 200;
  }
  fputs("not ready: waiting\n", out);
  return 503;
}

static int port_of(const struct http_server *h) {
  const char *a = http_address(h);
  const char *colon = strrchr(a, ':');
  return colon ? atoi(colon + 1) : -1;
}

static int connect_to(int port) {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  struct sockaddr_in sa = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port)};
  inet_pton(AF_INET, "127.0.0.1", &sa.sin_addr);
  if (connect(fd, (struct sockaddr *)&sa, sizeof(sa)) < 0) {
    close(fd);
    return -1;
  }
  return fd;
}

/* Reads until EOF or timeout_ms; returns bytes read (NUL-terminated). */
static size_t read_all(int fd, char *buf, size_t cap, int timeout_ms) {
  size_t n = 0;
  while (n + 1 < cap) {
    struct pollfd p = {.fd = fd, .events = POLLIN};
    if (poll(&p, 1, timeout_ms) <= 0) break;
    ssize_t r = recv(fd, buf + n, cap - 1 - n, 0);
    if (r <= 0) break;
    n += (size_t)r;
  }
  buf[n] = 0;
  return n;
}

/* Sends req whole and returns the response in buf. */
static size_t exchange(int port, const char *req, size_t len, char *buf, size_t cap) {
  int fd = connect_to(port);
  CHECK(fd >= 0);
  if (fd < 0) return 0;
  CHECK(send(fd, req, len, MSG_NOSIGNAL) == (ssize_t)len);
  size_t n = read_all(fd, buf, cap, 3000);
  close(fd);
  return n;
}

static int status_of(const char *resp) {
  int st = 0;
  if (sscanf(resp, "HTTP/1.0 %d", &st) != 1) return -1;
  return st;
}

static const char *body_of(const char *resp) {
  const char *p = strstr(resp, "\r\n\r\n");
  return p ? p + 4 : "";
}

static long content_length(const char *resp) {
  const char *p = strstr(resp, "Content-Length: ");
  return p ? atol(p + 16) : -1;
}

static void test_routes(int port) {
  char buf[4096];
  const char *get = "GET /metrics HTTP/1.1\r\nHost: x\r\nUser-Agent: test\r\n\r\n";
  exchange(port, get, strlen(get), buf, sizeof(buf));
  CHECK(status_of(buf) == 200);
  CHECK(strstr(buf, "Content-Type: text/plain; version=0.0.4; charset=utf-8\r\n"));
  CHECK(strcmp(body_of(buf), "ps_up 42\n") == 0);
  CHECK(content_length(buf) == (long)strlen("ps_up 42\n"));
  CHECK(strstr(buf, "Connection: close\r\n"));

  const char *head = "HEAD /metrics HTTP/1.0\r\n\r\n";
  exchange(port, head, strlen(head), buf, sizeof(buf));
  CHECK(status_of(buf) == 200);
  CHECK(content_length(buf) == (long)strlen("ps_up 42\n"));
  CHECK(body_of(buf)[0] == 0);

  const char *query = "GET /readyz?verbose=1 HTTP/1.1\n\n"; /* bare LF is tolerated */
  exchange(port, query, strlen(query), buf, sizeof(buf));
  CHECK(status_of(buf) == 200);
  CHECK(strcmp(body_of(buf), "ready\n") == 0);

  atomic_store(&healthy, 0);
  const char *ready = "GET /readyz HTTP/1.1\r\n\r\n";
  exchange(port, ready, strlen(ready), buf, sizeof(buf));
  CHECK(status_of(buf) == 503);
  CHECK(strstr(body_of(buf), "waiting"));
  atomic_store(&healthy, 1);

  /* one byte per write */
  int fd = connect_to(port);
  for (const char *p = get; *p; p++) {
    CHECK(send(fd, p, 1, MSG_NOSIGNAL) == 1);
    usleep(200);
  }
  read_all(fd, buf, sizeof(buf), 3000);
  close(fd);
  CHECK(status_of(buf) == 200);
}

static void test_refusals(int port) {
  char buf[4096];
  static const struct {
    const char *req;
    int status;
  } cases[] = {
      {"GET /nope HTTP/1.1\r\n\r\n", 404},
      {"GET / HTTP/1.1\r\n\r\n", 404},
      {"DELETE /metrics HTTP/1.1\r\n\r\n", 405},
      {"GET /metrics\r\n\r\n", 400}, /* HTTP/0.9 */
      {"GET /metrics HTTP/2.0\r\n\r\n", 400},
      {"GET metrics HTTP/1.1\r\n\r\n", 400},   /* not origin-form */
      {"GET  /metrics HTTP/1.1\r\n\r\n", 400}, /* double space */
      {"GET /metrics HTTP/1.1 extra\r\n\r\n", 400},
      {"\r\n\r\n", 400},
      {"\x01\x02\x03\n\n", 400},
  };
  for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
    exchange(port, cases[i].req, strlen(cases[i].req), buf, sizeof(buf));
    if (status_of(buf) != cases[i].status)
      fprintf(stderr, "request %zu: got \"%.40s\", want %d\n", i, buf, cases[i].status);
    CHECK(status_of(buf) == cases[i].status);
  }
  const char *post = "POST /metrics HTTP/1.1\r\nContent-Length: 5\r\n\r\nhello";
  exchange(port, post, strlen(post), buf, sizeof(buf));
  CHECK(status_of(buf) == 405);
  CHECK(strstr(buf, "Allow: GET, HEAD\r\n"));

  /* a head over the cap: 431, and the server is still fine */
  size_t big = HTTP_MAX_REQUEST + 100;
  char *huge = malloc(big);
  memcpy(huge, "GET /metrics HTTP/1.1\r\nX-Pad: ", 30);
  memset(huge + 30, 'a', big - 30);
  int fd = connect_to(port);
  send(fd, huge, big, MSG_NOSIGNAL); /* may be cut short by the close */
  read_all(fd, buf, sizeof(buf), 3000);
  close(fd);
  free(huge);
  CHECK(status_of(buf) == 431);

  /* stops mid-head: the timeout (300 ms in this test) answers 408; the
   * event is the answer itself, waited for 100 times as long */
  fd = connect_to(port);
  send(fd, "GET /metr", 9, MSG_NOSIGNAL);
  read_all(fd, buf, sizeof(buf), 30000);
  close(fd);
  CHECK(status_of(buf) == 408, "a stalled head got \"%.40s\", want 408", buf);

  /* a client that hangs up before sending anything */
  fd = connect_to(port);
  close(fd);
}

/* The connection cap, on a server of its own whose head timeout (60 s) no
 * connection reaches during the test, so nothing but the cap closes one:
 * no earlier test's connections to wait out, no timing to guess. The
 * event is EOF on the EXTRA oldest (pushed out by the newest), waited for
 * with a generous bound; the newer ones stay open. */
static void test_conn_cap(void) {
  enum { EXTRA = 6, TOTAL = HTTP_MAX_CONNS + EXTRA };
  struct http_route routes[] = {{"/metrics", h_metrics, "ps_up"}};
  struct http_opts o = {
      .listen = "127.0.0.1:0", .routes = routes, .num_routes = 1, .request_timeout_ms = 60000};
  struct http_server *h = NULL;
  char err[256];
  CHECK(http_start(&o, &h, err, sizeof(err)) == 0, "%s", err);
  if (!h) return;
  int port = port_of(h);
  int fds[TOTAL];
  bool eof[TOTAL] = {false};
  for (int i = 0; i < TOTAL; i++) fds[i] = connect_to(port);
  int closed = 0;
  double deadline = clock_now_s() + 30;
  while (closed < EXTRA && clock_now_s() < deadline) {
    struct pollfd p[TOTAL];
    for (int i = 0; i < TOTAL; i++)
      p[i] = (struct pollfd){.fd = eof[i] ? -1 : fds[i], .events = POLLIN};
    if (poll(p, TOTAL, 100) <= 0) continue;
    for (int i = 0; i < TOTAL; i++) {
      char c;
      if ((p[i].revents & (POLLIN | POLLHUP)) && recv(fds[i], &c, 1, MSG_DONTWAIT) == 0) {
        eof[i] = true;
        closed++;
      }
    }
  }
  int oldest = 0;
  for (int i = 0; i < EXTRA; i++) oldest += eof[i];
  CHECK(closed == EXTRA && oldest == EXTRA, "%d connections closed (%d of the %d oldest), want %d",
        closed, oldest, EXTRA, EXTRA);
  for (int i = 0; i < TOTAL; i++) close(fds[i]);
  char buf[1024];
  const char *get = "GET /metrics HTTP/1.1\r\n\r\n";
  exchange(port, get, strlen(get), buf, sizeof(buf));
  CHECK(status_of(buf) == 200);
  http_stop(h);
}

/* Issue 30: 1,000 idle connections (a port scanner, a slowloris client,
 * anyone who can open sockets) must not make the kubelet's probes miss
 * their 3 s timeout. A server with the default 5 s head timeout, so the
 * flood does not expire during the test; more idle connections arrive just
 * before each probe, so the probe competes with a flood still coming. */
static bool flood_skipped;

static void test_idle_flood(void) {
  enum { FLOOD = 1000, PER_PROBE = 10, PROBES = 25, NEED_FDS = FLOOD + PROBES * PER_PROBE + 200 };
  struct rlimit rl;
  if (getrlimit(RLIMIT_NOFILE, &rl) == 0 && rl.rlim_cur < NEED_FDS) {
    if (rl.rlim_max != RLIM_INFINITY && rl.rlim_max < NEED_FDS) {
      printf("test_http: skipping the idle flood: hard limit of %llu descriptors\n",
             (unsigned long long)rl.rlim_max);
      flood_skipped = true;
      return;
    }
    rl.rlim_cur = NEED_FDS;
    if (setrlimit(RLIMIT_NOFILE, &rl) != 0) {
      printf("test_http: skipping the idle flood: cannot raise ulimit -n\n");
      flood_skipped = true;
      return;
    }
  }
  struct http_route routes[] = {{"/healthz", h_ready, NULL}, {"/readyz", h_ready, NULL}};
  struct http_opts o = {.listen = "127.0.0.1:0", .routes = routes, .num_routes = 2};
  struct http_server *h = NULL;
  char err[256];
  CHECK(http_start(&o, &h, err, sizeof(err)) == 0, "%s", err);
  if (!h) return;
  int port = port_of(h);
  static int idle[FLOOD + PROBES * PER_PROBE];
  int n_idle = 0;
  for (int i = 0; i < FLOOD; i++) {
    idle[n_idle] = connect_to(port);
    if (idle[n_idle] >= 0) n_idle++;
  }
  CHECK(n_idle == FLOOD, "opened %d idle connections of %d", n_idle, FLOOD);
  int ok = 0;
  double worst = 0;
  for (int p = 0; p < PROBES; p++) {
    for (int i = 0; i < PER_PROBE; i++) {
      idle[n_idle] = connect_to(port);
      if (idle[n_idle] >= 0) n_idle++;
    }
    const char *req = p % 2 ? "GET /readyz HTTP/1.1\r\n\r\n" : "GET /healthz HTTP/1.1\r\n\r\n";
    char buf[1024];
    double t0 = clock_now_s();
    int fd = connect_to(port);
    size_t n = 0;
    /* the event is the answer: a server that refused or closed the probe
     * once the flood filled its table would answer nothing */
    if (fd >= 0 && send(fd, req, strlen(req), MSG_NOSIGNAL) == (ssize_t)strlen(req))
      n = read_all(fd, buf, sizeof(buf), 30000);
    double dt = clock_now_s() - t0;
    if (fd >= 0) close(fd);
    buf[n] = 0;
    if (n > 0 && status_of(buf) == 200) ok++;
    if (dt > worst) worst = dt;
  }
  printf("test_http: idle flood of %d connections: %d/%d probes answered, slowest %.3f s\n", n_idle,
         ok, PROBES, worst);
  CHECK(ok == PROBES, "%d of %d probes answered", ok, PROBES);
  for (int i = 0; i < n_idle; i++) close(idle[i]);
  http_stop(h);
}

static void test_bad_starts(int port) {
  struct http_route r = {"/metrics", h_metrics, "x"};
  struct http_opts o = {.listen = "127.0.0.1:notaport", .routes = &r, .num_routes = 1};
  struct http_server *h = (void *)1;
  char err[256] = "";
  CHECK(http_start(&o, &h, err, sizeof(err)) < 0);
  CHECK(h == NULL && err[0]);
  char addr[64];
  snprintf(addr, sizeof(addr), "127.0.0.1:%d", port);
  o.listen = addr;
  err[0] = 0;
  CHECK(http_start(&o, &h, err, sizeof(err)) == -EADDRINUSE);
  CHECK(strstr(err, "cannot listen"));
  o.listen = "";
  CHECK(http_start(&o, &h, err, sizeof(err)) < 0);
}

int main(void) {
  signal(SIGPIPE, SIG_IGN);
  struct http_route routes[] = {{"/metrics", h_metrics, "ps_up"}, {"/readyz", h_ready, NULL}};
  struct http_opts o = {
      .listen = "127.0.0.1:0", .routes = routes, .num_routes = 2, .request_timeout_ms = 300};
  struct http_server *h = NULL;
  char err[256];
  int r = http_start(&o, &h, err, sizeof(err));
  if (r < 0) {
    fprintf(stderr, "http_start: %s\n", err);
    return 1;
  }
  int port = port_of(h);
  CHECK(port > 0);
  test_routes(port);
  test_refusals(port);
  test_conn_cap();
  test_bad_starts(port);
  test_idle_flood();
  /* stop while a client is connected and idle */
  int fd = connect_to(port);
  http_stop(h);
  char c;
  CHECK(recv(fd, &c, 1, 0) <= 0);
  close(fd);
  http_stop(NULL);
  if (failures) fprintf(stderr, "%d check(s) failed\n", failures);
  return failures ? 1 : flood_skipped ? 77 : 0;
}
