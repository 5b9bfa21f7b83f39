/* Clients that send garbage, oversized or malformed frames, unknown message
 * types, or messages out of order each get an error frame naming the problem
 * (when the stream is still in sync) and are disconnected, while a good
 * worker in another process trains on through all of it with exact values.
 *
 * With PS_TRANSPORT=ucx (the UCX variants, meson.build) the same bytes go
 * to a shard on UCX as active messages, one per send, and the same refusals
 * must come back; two cases only UCX has follow (a message whose sizes
 * disagree with its frame's preamble, a frame cut short inside one). */
#include <errno.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <poll.h>

#include "clock.h"
#include "harness.h"
#include "net.h"
#include "ps.h"
#include "ucx_link.h"
#include "wire.h"

#define N 4096
#define STEPS 300
static struct test_server srv;
static const char *names[] = {"w"};
static const uint64_t counts[] = {N};

static ps_client *good_client(void) {
  const char *addrs[1] = {srv.addr};
  struct ps_client_opts o = {.servers = addrs, .num_servers = 1, .rank = 0, .world_size = 1};
  ps_client *c;
  char err[256];
  REQUIRE(ps_client_new(&o, &c, err, sizeof(err)) == PS_OK, "connect: %s", err);
  REQUIRE(ps_declare(c, 1, names, counts) == PS_OK, "declare");
  return c;
}

/* SGD with lr 1 and gradient 1: after s steps every value is init - s. */
static int good_worker(void *arg) {
  (void)arg;
  ps_client *c = good_client();
  static float p[N], g[N];
  for (int i = 0; i < N; i++) g[i] = 1.0f;
  for (uint64_t s = 0; s < STEPS; s++) {
    uint64_t v;
    REQUIRE(ps_pull(c, 0, s, p, &v) == PS_OK && v == s, "pull %llu", (unsigned long long)s);
    for (int i = 0; i < N; i++)
      REQUIRE(p[i] == (float)i - (float)s, "p[%d]=%g at step %llu", i, p[i], (unsigned long long)s);
    REQUIRE(ps_push(c, 0, s, g) == PS_OK, "push");
  }
  ps_client_free(c);
  return 0;
}

/* A bad client's connection: a socket, or a UCX endpoint whose replies
 * are collected as the bytes of their frames. */
struct raw {
  int fd;
  struct ulink *u;
  struct ulink_ep *ep;
  bool gone;
  uint8_t in[1 << 16];
  size_t have;
};
static bool ucx;

static void raw_rx(struct ulink_rx *rx, void *arg) {
  struct raw *r = arg;
  if (r->have + rx->head_len + rx->len <= sizeof(r->in) && !rx->rndv) {
    memcpy(r->in + r->have, rx->head, rx->head_len);
    if (rx->len) memcpy(r->in + r->have + rx->head_len, rx->data, rx->len);
    r->have += rx->head_len + rx->len;
  }
  ulink_rx_free(r->u, rx);
}

static void raw_error(struct ulink_ep *ep, const char *why, void *arg) {
  (void)ep;
  (void)why;
  ((struct raw *)arg)->gone = true;
}

static void raw_progress(struct raw *r, int ms) {
  ulink_progress(r->u);
  if (!ulink_arm(r->u)) return;
  struct pollfd p = {ulink_efd(r->u), POLLIN, 0};
  poll(&p, 1, ms);
}

static struct raw *raw_connect(void) {
  struct net_addr a;
  char err[256];
  struct raw *r = calloc(1, sizeof(*r));
  REQUIRE(r && net_parse_addr(srv.addr, &a, 0, err, sizeof(err)) == 0, "addr");
  if (ucx) {
    struct ulink_cbs cbs = {.on_rx = raw_rx, .on_error = raw_error, .arg = r};
    REQUIRE(ulink_new(false, &cbs, &r->u, err, sizeof(err)) == 0, "ucx: %s", err);
    REQUIRE(ulink_connect(r->u, a.host, a.port, &r->ep, err, sizeof(err)) == 0, "ucx: %s", err);
    return r;
  }
  struct net_backoff bo = {50, 200, 2000};
  r->fd = net_connect(&a, &bo, err, sizeof(err));
  REQUIRE(r->fd >= 0, "connect: %s", err);
  return r;
}

static void raw_close(struct raw *r) {
  if (ucx) {
    ulink_ep_close(r->ep, false);
    ulink_free(r->u);
  } else {
    close(r->fd);
  }
  free(r);
}

static void sent(void *arg, int status) {
  (void)arg;
  (void)status;
}

static size_t encode(uint8_t *buf, size_t cap, Ps__MsgType type, uint64_t key, uint64_t plen) {
  Ps__Header h = PS__HEADER__INIT;
  Ps__Hello hello = PS__HELLO__INIT;
  h.type = type;
  h.key = key;
  h.request_id = 7;
  if (type == PS__MSG_TYPE__MSG_HELLO) {
    hello.world_size = 1;
    h.body_case = PS__HEADER__BODY_HELLO;
    h.hello = &hello;
  }
  int n = wire_frame_encode(&h, plen, buf, cap);
  REQUIRE(n > 0, "encode");
  return (size_t)n;
}

/* Reads frames until EOF (2 s at most); returns the error code of the last
 * ERROR frame, or -1 if none came. Fails if the shard keeps the socket open. */
static int expect_error_then_close(struct raw *r, char *msg, size_t msglen) {
  static uint8_t buf[1 << 16];
  size_t have = 0;
  int code = -1;
  msg[0] = 0;
  if (ucx) {
    uint64_t until = clock_now_ns() + 2000000000u;
    while (!r->gone && clock_now_ns() < until) raw_progress(r, 50);
    REQUIRE(r->gone, "shard kept a bad UCX client open");
    memcpy(buf, r->in, r->have);
    have = r->have;
  }
  int fd = r->fd;
  struct timeval tv = {2, 0};
  if (!ucx) setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  for (; !ucx;) {
    ssize_t n = recv(fd, buf + have, sizeof(buf) - have, 0);
    if (n == 0) break;
    REQUIRE(n > 0 || errno == ECONNRESET, "shard kept a bad client open (recv: %s)",
            strerror(errno));
    if (n < 0) break;
    have += (size_t)n;
  }
  struct frame_limits lim = {FRAME_MAX_HEADER, 1u << 30};
  size_t off = 0;
  struct wire_arena arena;
  wire_arena_init(&arena, WIRE_DEFAULT_BUDGET);
  while (have - off >= FRAME_PREAMBLE_BYTES) {
    struct frame_preamble p;
    if (frame_preamble_decode(buf + off, &lim, &p) < 0) break;
    if (have - off < FRAME_PREAMBLE_BYTES + p.header_len + p.payload_len) break;
    Ps__Header *h;
    if (wire_header_unpack(&arena, buf + off + FRAME_PREAMBLE_BYTES, p.header_len, &h) == 0 &&
        h->type == PS__MSG_TYPE__MSG_ERROR && h->body_case == PS__HEADER__BODY_ERROR) {
      code = h->error->code;
      snprintf(msg, msglen, "%s", h->error->message);
    }
    off += FRAME_PREAMBLE_BYTES + p.header_len + p.payload_len;
  }
  wire_arena_deinit(&arena);
  raw_close(r);
  return code;
}

/* Over UCX: one active message, the bytes as its header and data (if any)
 * as its payload. */
static void send_am(struct raw *r, const void *p, size_t n, const void *data, size_t dlen) {
  REQUIRE(ulink_send(r->ep, p, n, data, dlen, sent, NULL) == 0, "ucx send");
}

static void send_all(struct raw *r, const void *p, size_t n) {
  if (ucx) {
    send_am(r, p, n, NULL, 0);
    return;
  }
  REQUIRE(net_write_all(r->fd, p, n) == 0 || errno == EPIPE || errno == ECONNRESET, "send");
}

int main(void) {
  const char *tr = getenv("PS_TRANSPORT");
  ucx = tr && strcmp(tr, "ucx") == 0;
  const char *extra[] = {"--max-frame-bytes", "1MiB", NULL};
  harness_start_server(&srv, 0, 1, 1, 1.0, extra);
  ps_client *setup = good_client();
  static float init[N];
  for (int i = 0; i < N; i++) init[i] = (float)i;
  REQUIRE(ps_init(setup, 0, init) == PS_OK, "init");
  ps_client_free(setup);
  pid_t good = harness_fork(good_worker, NULL);

  uint8_t f[4096], g[4096];
  char msg[512];
  int rejected = 0, code;
  srand(1234);
  for (int round = 0; round < 20; round++) {
    /* 1. random garbage */
    struct raw *fd = raw_connect();
    for (size_t i = 0; i < sizeof(g); i++) g[i] = (uint8_t)rand();
    send_all(fd, g, sizeof(g));
    code = expect_error_then_close(fd, msg, sizeof(msg));
    REQUIRE(code == PS__ERROR_CODE__ERR_BAD_FRAME && strstr(msg, "magic"), "garbage: %d %s", code,
            msg);
    rejected++;
  }
  /* 2. payload over --max-frame-bytes, and 2^64-1 */
  uint64_t sizes[] = {(1u << 20) + 1, UINT64_MAX, 0xffffffffull};
  for (int i = 0; i < 3; i++) {
    struct raw *fd = raw_connect();
    size_t n = encode(f, sizeof(f), PS__MSG_TYPE__MSG_HELLO, 0, sizes[i]);
    send_all(fd, f, n);
    code = expect_error_then_close(fd, msg, sizeof(msg));
    REQUIRE(code == PS__ERROR_CODE__ERR_TOO_LARGE && strstr(msg, "max-frame-bytes"),
            "oversize: %d %s", code, msg);
    rejected++;
  }
  /* 3. header length 0 */
  {
    struct raw *fd = raw_connect();
    frame_preamble_encode(f, 0, 0);
    send_all(fd, f, FRAME_PREAMBLE_BYTES);
    code = expect_error_then_close(fd, msg, sizeof(msg));
    REQUIRE(code == PS__ERROR_CODE__ERR_TOO_LARGE && strstr(msg, "header length"), "hdr0: %s", msg);
    rejected++;
  }
  /* 4. a header that is not protobuf */
  {
    struct raw *fd = raw_connect();
    frame_preamble_encode(f, 20, 0);
    memset(f + FRAME_PREAMBLE_BYTES, 0xff, 20);
    send_all(fd, f, FRAME_PREAMBLE_BYTES + 20);
    code = expect_error_then_close(fd, msg, sizeof(msg));
    REQUIRE(code == PS__ERROR_CODE__ERR_BAD_FRAME && strstr(msg, "protobuf"), "bad pb: %s", msg);
    rejected++;
  }
  /* 5. data before hello */
  {
    struct raw *fd = raw_connect();
    size_t n = encode(f, sizeof(f), PS__MSG_TYPE__MSG_PULL, 0, 0);
    send_all(fd, f, n);
    code = expect_error_then_close(fd, msg, sizeof(msg));
    REQUIRE(code == PS__ERROR_CODE__ERR_PROTOCOL && strstr(msg, "before hello"), "no hello: %s",
            msg);
    rejected++;
  }
  /* 6. unknown type, wrong payload size, unknown key, each after a hello */
  struct {
    Ps__MsgType type;
    uint64_t key, plen;
    int code;
    const char *needle;
  } after_hello[] = {
      {(Ps__MsgType)99, 0, 0, PS__ERROR_CODE__ERR_UNKNOWN_TYPE, "type 99"},
      {PS__MSG_TYPE__MSG_PULL_REPLY, 0, 0, PS__ERROR_CODE__ERR_UNKNOWN_TYPE, "pull_reply"},
      {PS__MSG_TYPE__MSG_PUSH, 0, 100, PS__ERROR_CODE__ERR_BAD_SIZE, "expected 16384"},
      {PS__MSG_TYPE__MSG_PUSH, 12345, 4, PS__ERROR_CODE__ERR_BAD_KEY, "not held"},
      {PS__MSG_TYPE__MSG_HELLO, 0, 0, PS__ERROR_CODE__ERR_PROTOCOL, "hello twice"},
  };
  for (size_t i = 0; i < sizeof(after_hello) / sizeof(after_hello[0]); i++) {
    struct raw *fd = raw_connect();
    size_t n = encode(f, sizeof(f), PS__MSG_TYPE__MSG_HELLO, 0, 0);
    n += encode(f + n, sizeof(f) - n, after_hello[i].type, after_hello[i].key, after_hello[i].plen);
    memset(f + n, 0, after_hello[i].plen < 512 ? after_hello[i].plen : 0);
    send_all(fd, f, n + (after_hello[i].plen < 512 ? after_hello[i].plen : 0));
    code = expect_error_then_close(fd, msg, sizeof(msg));
    REQUIRE(code == after_hello[i].code && strstr(msg, after_hello[i].needle), "case %zu: %d %s", i,
            code, msg);
    rejected++;
  }
  /* 7. a frame cut off in the middle, and a silent connection: both dropped without harm
   * (over UCX a cut frame is a whole message that is too short: refused) */
  {
    struct raw *fd = raw_connect();
    size_t n = encode(f, sizeof(f), PS__MSG_TYPE__MSG_HELLO, 0, 0);
    send_all(fd, f, n - 3);
    if (ucx) {
      code = expect_error_then_close(fd, msg, sizeof(msg));
      REQUIRE(code == PS__ERROR_CODE__ERR_BAD_FRAME && strstr(msg, "does not hold"), "cut: %d %s",
              code, msg);
      rejected++;
    } else {
      raw_close(fd);
    }
    raw_close(raw_connect());
  }
  /* 8. UCX: a message whose data is not the payload its preamble announces */
  if (ucx) {
    struct raw *fd = raw_connect();
    size_t n = encode(f, sizeof(f), PS__MSG_TYPE__MSG_HELLO, 0, 0);
    send_am(fd, f, n, g, 100);
    code = expect_error_then_close(fd, msg, sizeof(msg));
    REQUIRE(code == PS__ERROR_CODE__ERR_BAD_FRAME && strstr(msg, "100 data bytes"), "sizes: %d %s",
            code, msg);
    rejected++;
  }

  int st = harness_wait(good, 60000);
  REQUIRE(st >= 0 && WIFEXITED(st) && WEXITSTATUS(st) == 0, "the good worker failed (%d)", st);
  ps_client *c = good_client();
  struct ps_shard_stats s;
  REQUIRE(ps_stats(c, 0, &s) == PS_OK, "stats");
  REQUIRE(s.rejected_frames == (uint64_t)rejected, "rejected %llu, sent %d bad",
          (unsigned long long)s.rejected_frames, rejected);
  REQUIRE(s.max_version == STEPS, "version %llu", (unsigned long long)s.max_version);
  ps_client_free(c);
  st = harness_stop(srv.pid, SIGTERM, 5000);
  REQUIRE(st >= 0 && WIFEXITED(st) && WEXITSTATUS(st) == 0, "shard exit %d", st);
  printf("%d bad clients rejected with error frames; the good worker trained %d exact steps\n",
         rejected, STEPS);
  return 0;
}
