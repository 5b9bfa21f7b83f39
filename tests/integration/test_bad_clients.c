/* Clients that send garbage, oversized or malformed frames, unknown message
 * types, or messages out of order each get an error frame naming the problem
 * (when the stream is still in sync) and are disconnected, while a good
 * worker in another process trains on through all of it with exact values. */
#include <errno.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include "harness.h"
#include "net.h"
#include "ps.h"
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

static int raw_connect(void) {
  struct net_addr a;
  char err[128];
  REQUIRE(net_parse_addr(srv.addr, &a, 0, err, sizeof(err)) == 0, "addr");
  struct net_backoff bo = {50, 200, 2000};
  int fd = net_connect(&a, &bo, err, sizeof(err));
  REQUIRE(fd >= 0, "connect: %s", err);
  return fd;
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
static int expect_error_then_close(int fd, char *msg, size_t msglen) {
  struct timeval tv = {2, 0};
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  static uint8_t buf[1 << 16];
  size_t have = 0;
  int code = -1;
  msg[0] = 0;
  for (;;) {
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
  close(fd);
  return code;
}

static void send_all(int fd, const void *p, size_t n) {
  REQUIRE(net_write_all(fd, p, n) == 0 || errno == EPIPE || errno == ECONNRESET, "send");
}

int main(void) {
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
    int fd = raw_connect();
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
    int fd = raw_connect();
    size_t n = encode(f, sizeof(f), PS__MSG_TYPE__MSG_HELLO, 0, sizes[i]);
    send_all(fd, f, n);
    code = expect_error_then_close(fd, msg, sizeof(msg));
    REQUIRE(code == PS__ERROR_CODE__ERR_TOO_LARGE && strstr(msg, "max-frame-bytes"),
            "oversize: %d %s", code, msg);
    rejected++;
  }
  /* 3. header length 0 */
  {
    int fd = raw_connect();
    frame_preamble_encode(f, 0, 0);
    send_all(fd, f, FRAME_PREAMBLE_BYTES);
    code = expect_error_then_close(fd, msg, sizeof(msg));
    REQUIRE(code == PS__ERROR_CODE__ERR_TOO_LARGE && strstr(msg, "header length"), "hdr0: %s", msg);
    rejected++;
  }
  /* 4. a header that is not protobuf */
  {
    int fd = raw_connect();
    frame_preamble_encode(f, 20, 0);
    memset(f + FRAME_PREAMBLE_BYTES, 0xff, 20);
    send_all(fd, f, FRAME_PREAMBLE_BYTES + 20);
    code = expect_error_then_close(fd, msg, sizeof(msg));
    REQUIRE(code == PS__ERROR_CODE__ERR_BAD_FRAME && strstr(msg, "protobuf"), "bad pb: %s", msg);
    rejected++;
  }
  /* 5. data before hello */
  {
    int fd = raw_connect();
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
    int fd = raw_connect();
    size_t n = encode(f, sizeof(f), PS__MSG_TYPE__MSG_HELLO, 0, 0);
    n += encode(f + n, sizeof(f) - n, after_hello[i].type, after_hello[i].key, after_hello[i].plen);
    memset(f + n, 0, after_hello[i].plen < 512 ? after_hello[i].plen : 0);
    send_all(fd, f, n + (after_hello[i].plen < 512 ? after_hello[i].plen : 0));
    code = expect_error_then_close(fd, msg, sizeof(msg));
    REQUIRE(code == after_hello[i].code && strstr(msg, after_hello[i].needle), "case %zu: %d %s", i,
            code, msg);
    rejected++;
  }
  /* 7. a frame cut off in the middle, and a silent connection: both dropped without harm */
  {
    int fd = raw_connect();
    size_t n = encode(f, sizeof(f), PS__MSG_TYPE__MSG_HELLO, 0, 0);
    send_all(fd, f, n - 3);
    close(fd);
    close(raw_connect());
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
