/* Authentication between libps and a real ps-server (issue 8):
 *   - the job's token: a training loop runs with exact values;
 *   - no token, another token, a shard without a token: each refused with a
 *     message that says which side lacks what;
 *   - raw clients: data before authentication, skipping AUTH, a wrong
 *     proof: ERR_AUTH and the connection closed;
 *   - a proxy between libps and the shard flips one bit of the stream after
 *     the handshake, once towards the shard and once towards the worker:
 *     the tag check catches both, libps reconnects and resends, and the
 *     values stay exact (nothing forged was applied or returned), while the
 *     shard counts the failures in /metrics.
 * With PS_TRANSPORT=ucx (the UCX variants, meson.build) the refusals and
 * the flipped bits are the same, the proxy flipping a payload byte of a
 * forwarded active message (ucx_proxy.h); the hand-made handshakes are
 * TCP's only (test_bad_clients sends data before the handshake over UCX). */
#include <errno.h>
#include <poll.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "auth.h"
#include "handshake.h"
#include "harness.h"
#include "net.h"
#include "ps.h"
#include "ucx_proxy.h"
#include "scrape.h"
#include "wire.h"

#define N (256 * 1024) /* 1 MiB of floats: a bit flip lands in a payload */
#define STEPS 40

static struct test_server srv, open_srv;
static const char *names[] = {"w"};
static const uint64_t counts[] = {N};

/* The token as a libps user loads it (ps.h). */
static ps_token *load(const char *path) {
  ps_token *t = NULL;
  char err[600];
  REQUIRE(ps_token_load(path, &t, err, sizeof(err)) == PS_OK && t, "token %s: %s", path, err);
  return t;
}

/* ps_token_load and ps_token_from_bytes refuse what auth.h refuses, naming
 * the file. */
static void token_errors(const char *dir) {
  ps_token *t = (ps_token *)&t; /* must be overwritten */
  char err[600], path[600];
  snprintf(path, sizeof(path), "%s/no-such-token", dir);
  REQUIRE(ps_token_load(path, &t, err, sizeof(err)) == PS_ERR_INVALID && !t && strstr(err, path) &&
              strstr(err, "cannot open"),
          "missing token file: %s", err);
  REQUIRE(ps_token_load(dir, &t, err, sizeof(err)) == PS_ERR_INVALID && !t &&
              strstr(err, "not a regular file"),
          "directory as token file: %s", err);
  REQUIRE(ps_token_load("", &t, err, sizeof(err)) == PS_ERR_INVALID && !t, "empty path");
  REQUIRE(ps_token_from_bytes("too-short", 9, &t) == PS_ERR_INVALID && !t, "short token");
  REQUIRE(ps_token_from_bytes("sixteen-bytes-ok", 16, &t) == PS_OK && t, "16-byte token");
  ps_token_free(t);
  ps_token_free(NULL);
}

static ps_status try_client(const char *addr, const ps_token *t, ps_client **out, char *err,
                            size_t errlen) {
  const char *addrs[1] = {addr};
  struct ps_client_opts o = {.servers = addrs,
                             .num_servers = 1,
                             .rank = 0,
                             .world_size = 1,
                             .auth_token = t,
                             .connect_timeout_ms = 5000,
                             .reconnect_timeout_ms = 10000};
  return ps_client_new(&o, out, err, errlen);
}

/* SGD with lr 1 and gradient 1 from init[i] = i: after s steps p[i] = i - s. */
static void train(ps_client *c, uint64_t first, uint64_t steps) {
  static float p[N], g[N];
  for (int i = 0; i < N; i++) g[i] = 1.0f;
  for (uint64_t s = first; s < first + steps; s++) {
    uint64_t v;
    REQUIRE(ps_pull(c, 0, s, p, &v) == PS_OK && v == s, "pull %llu", (unsigned long long)s);
    for (int i = 0; i < N; i += 997)
      REQUIRE(p[i] == (float)i - (float)s, "p[%d]=%g at step %llu", i, p[i], (unsigned long long)s);
    REQUIRE(ps_push(c, 0, s, g) == PS_OK, "push %llu", (unsigned long long)s);
  }
}

/* ---- a proxy that flips one bit ------------------------------------------ */

struct proxy {
  int listen_fd;
  char addr[64];
  struct net_addr target;
  atomic_uint_fast64_t flip_up;   /* client->shard: flip the byte this far ahead; 0 = none */
  atomic_uint_fast64_t flip_down; /* shard->client */
  atomic_int flipped;
  pthread_t thr;
};

/* Forwards one connection both ways until either side closes; flips the
 * byte flip_* bytes ahead in each direction once (then clears it). */
static void relay(struct proxy *px, int a, int b) {
  static char buf[1 << 16];
  for (;;) {
    struct pollfd p[2] = {{.fd = a, .events = POLLIN}, {.fd = b, .events = POLLIN}};
    if (poll(p, 2, 20000) <= 0) return;
    for (int d = 0; d < 2; d++) {
      if (!(p[d].revents & (POLLIN | POLLHUP | POLLERR))) continue;
      ssize_t n = recv(d ? b : a, buf, sizeof(buf), 0);
      if (n <= 0) return;
      atomic_uint_fast64_t *flip = d ? &px->flip_down : &px->flip_up;
      uint64_t ahead = atomic_load(flip);
      if (ahead && ahead <= (uint64_t)n) {
        buf[ahead - 1] ^= 0x20;
        atomic_store(flip, 0);
        atomic_fetch_add(&px->flipped, 1);
      } else if (ahead) {
        atomic_store(flip, ahead - (uint64_t)n);
      }
      if (net_write_all(d ? a : b, buf, (size_t)n) < 0) return;
    }
  }
}

static void *proxy_main(void *arg) {
  struct proxy *px = arg;
  for (;;) {
    int a = net_accept(px->listen_fd, NULL, 0);
    if (a < 0) return NULL;
    char err[128];
    struct net_backoff once = {0, 0, 0};
    int b = net_connect(&px->target, &once, err, sizeof(err));
    if (b >= 0) {
      relay(px, a, b);
      close(b);
    }
    close(a);
  }
}

/* The UCX proxy's hook: the same flips, counted in payload bytes. */
static enum ucx_proxy_verdict flip_hook(bool up, uint8_t *head, uint32_t head_len, uint8_t *payload,
                                        uint64_t len, void *arg) {
  struct proxy *px = arg;
  (void)head, (void)head_len;
  atomic_uint_fast64_t *flip = up ? &px->flip_up : &px->flip_down;
  uint64_t ahead = atomic_load(flip);
  if (ahead && ahead <= len) {
    payload[ahead - 1] ^= 0x20;
    atomic_store(flip, 0);
    atomic_fetch_add(&px->flipped, 1);
  } else if (ahead) {
    atomic_store(flip, ahead - len);
  }
  return UCX_PROXY_FORWARD;
}

static void proxy_start(struct proxy *px, const char *target) {
  const char *tr = getenv("PS_TRANSPORT");
  if (tr && strcmp(tr, "ucx") == 0) {
    ucx_proxy_start(target, flip_hook, px, px->addr, sizeof(px->addr));
    return;
  }
  char err[128];
  struct net_addr la;
  REQUIRE(net_parse_addr("127.0.0.1:0", &la, 1, err, sizeof(err)) == 0, "addr");
  px->listen_fd = net_listen(&la, 16, err, sizeof(err));
  REQUIRE(px->listen_fd >= 0, "proxy listen: %s", err);
  snprintf(px->addr, sizeof(px->addr), "127.0.0.1:%d", net_bound_port(px->listen_fd));
  REQUIRE(net_parse_addr(target, &px->target, 0, err, sizeof(err)) == 0, "target");
  REQUIRE(pthread_create(&px->thr, NULL, proxy_main, px) == 0, "proxy thread");
}

/* ---- raw handshake clients ----------------------------------------------- */

static int raw_connect(const char *addr) {
  struct net_addr a;
  char err[128];
  REQUIRE(net_parse_addr(addr, &a, 0, err, sizeof(err)) == 0, "addr");
  struct net_backoff bo = {50, 200, 2000};
  int fd = net_connect(&a, &bo, err, sizeof(err));
  REQUIRE(fd >= 0, "connect: %s", err);
  struct timeval tv = {3, 0};
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  return fd;
}

/* Reads one header-only frame (no tag). Returns its type, -1 at EOF. */
static int read_frame(int fd, struct wire_arena *a, Ps__Header **h) {
  uint8_t pre[FRAME_PREAMBLE_BYTES], hb[FRAME_MAX_HEADER];
  struct frame_limits lim = {FRAME_MAX_HEADER, 0};
  struct frame_preamble p;
  if (net_read_all(fd, pre, sizeof(pre)) < 0 || frame_preamble_decode(pre, &lim, &p) < 0 ||
      net_read_all(fd, hb, p.header_len) < 0 || wire_header_unpack(a, hb, p.header_len, h) < 0)
    return -1;
  return (int)(*h)->type;
}

/* The shard's answer must be ERR_AUTH with `want` in its text, then EOF. */
static void expect_auth_error(int fd, struct wire_arena *a, const char *want, const char *what) {
  Ps__Header *h = NULL;
  int t = read_frame(fd, a, &h);
  REQUIRE(t == PS__MSG_TYPE__MSG_ERROR && h->body_case == PS__HEADER__BODY_ERROR &&
              h->error->code == PS__ERROR_CODE__ERR_AUTH && strstr(h->error->message, want),
          "%s: type %d message %s", what, t,
          t == PS__MSG_TYPE__MSG_ERROR && h->error ? h->error->message : "-");
  char c;
  REQUIRE(recv(fd, &c, 1, 0) <= 0, "%s: the shard kept the connection open", what);
  close(fd);
}

static void send_header(int fd, Ps__Header *h, uint8_t *out, size_t *outlen) {
  uint8_t buf[2048];
  int n = wire_frame_encode(h, 0, buf, sizeof(buf));
  REQUIRE(n > 0 && net_write_all(fd, buf, (size_t)n) == 0, "send");
  if (out) {
    memcpy(out, buf + FRAME_PREAMBLE_BYTES, (size_t)n - FRAME_PREAMBLE_BYTES);
    *outlen = (size_t)n - FRAME_PREAMBLE_BYTES;
  }
}

static void raw_clients(const struct auth_token *t) {
  struct wire_arena a;
  wire_arena_init(&a, WIRE_DEFAULT_BUDGET);
  /* 1. data before any hello */
  int fd = raw_connect(srv.addr);
  Ps__Header push = PS__HEADER__INIT;
  push.type = PS__MSG_TYPE__MSG_PULL;
  push.key = 1;
  send_header(fd, &push, NULL, NULL);
  expect_auth_error(fd, &a, "before authentication", "pull before hello");

  /* 2. hello without a nonce */
  fd = raw_connect(srv.addr);
  Ps__Header h = PS__HEADER__INIT;
  Ps__Hello hello = PS__HELLO__INIT;
  hello.world_size = 1;
  h.type = PS__MSG_TYPE__MSG_HELLO;
  h.body_case = PS__HEADER__BODY_HELLO;
  h.hello = &hello;
  send_header(fd, &h, NULL, NULL);
  expect_auth_error(fd, &a, "authentication required", "hello without nonce");

  /* 3. hello with a nonce, then a pull instead of the proof */
  struct hs hs;
  hs_init(&hs, AUTH_INITIATOR, t);
  uint8_t sent[2048];
  size_t sent_len;
  fd = raw_connect(srv.addr);
  hs_initiator_hello(&hs, &hello);
  send_header(fd, &h, sent, &sent_len);
  Ps__Header *rep = NULL;
  REQUIRE(read_frame(fd, &a, &rep) == PS__MSG_TYPE__MSG_AUTH, "challenge expected");
  send_header(fd, &push, NULL, NULL);
  expect_auth_error(fd, &a, "before authentication completed", "pull instead of the proof");
  hs_deinit(&hs);

  /* 4. a wrong proof */
  hs_init(&hs, AUTH_INITIATOR, t);
  fd = raw_connect(srv.addr);
  hs_initiator_hello(&hs, &hello);
  send_header(fd, &h, sent, &sent_len);
  REQUIRE(read_frame(fd, &a, &rep) == PS__MSG_TYPE__MSG_AUTH, "challenge expected");
  uint8_t bogus[AUTH_PROOF_BYTES];
  auth_random(bogus, sizeof(bogus));
  Ps__Header ah = PS__HEADER__INIT;
  Ps__Auth au = PS__AUTH__INIT;
  au.proof.data = bogus;
  au.proof.len = sizeof(bogus);
  ah.type = PS__MSG_TYPE__MSG_AUTH;
  ah.body_case = PS__HEADER__BODY_AUTH;
  ah.auth = &au;
  send_header(fd, &ah, NULL, NULL);
  expect_auth_error(fd, &a, "wrong token", "wrong proof");
  hs_deinit(&hs);

  /* 5. a big frame before authentication is refused before it is read */
  fd = raw_connect(srv.addr);
  uint8_t big[64];
  int n = wire_frame_encode(&h, 4096, big, sizeof(big));
  REQUIRE(n > 0 && net_write_all(fd, big, (size_t)n) == 0, "send big");
  Ps__Header *e = NULL;
  int ty = read_frame(fd, &a, &e);
  REQUIRE(ty == PS__MSG_TYPE__MSG_ERROR && strstr(e->error->message, "before the handshake"),
          "payload before auth: %d %s", ty,
          ty == PS__MSG_TYPE__MSG_ERROR ? e->error->message : "-");
  close(fd);
  wire_arena_deinit(&a);
}

int main(void) {
  char tok1[600], tok2[600];
  harness_token_file("token", tok1, sizeof(tok1));
  harness_token_file("other-token", tok2, sizeof(tok2));
  ps_token *t1 = load(tok1), *t2 = load(tok2);
  struct auth_token *raw = NULL; /* the same token, for the hand-made handshakes */
  REQUIRE(auth_token_option("test_auth", tok1, &raw) == 0 && raw, "token %s", tok1);
  token_errors(harness_dir());
  const char *extra[] = {"--auth-token-file", tok1, "--http", "127.0.0.1:0", NULL};
  harness_start_server(&srv, 0, 1, 1, 1.0, extra);
  const char *open_extra[] = {"--http", "", NULL};
  harness_start_server(&open_srv, 0, 1, 1, 1.0, open_extra);

  /* refusals, each naming the side that lacks the token */
  ps_client *c = NULL;
  char err[512];
  ps_status st = try_client(srv.addr, NULL, &c, err, sizeof(err));
  REQUIRE(st == PS_ERR_REMOTE && strstr(err, "authentication required"), "no token: %d %s", st,
          err);
  st = try_client(srv.addr, t2, &c, err, sizeof(err));
  REQUIRE(st == PS_ERR_REMOTE && strstr(err, "differs"), "other token: %d %s", st, err);
  st = try_client(open_srv.addr, t1, &c, err, sizeof(err));
  REQUIRE(st == PS_ERR_REMOTE && strstr(err, "does not authenticate"), "open shard: %d %s", st,
          err);
  REQUIRE(harness_grep(open_srv.log, "AUTHENTICATION IS OFF") == 1, "open shard warns");
  const char *tr = getenv("PS_TRANSPORT");
  bool ucx = tr && strcmp(tr, "ucx") == 0;
  if (!ucx) raw_clients(raw);

  /* the job's token through a proxy that flips one bit each way */
  struct proxy px = {0};
  proxy_start(&px, srv.addr);
  atomic_store(&px.flip_up, 3 * 1024 * 1024 + 12345); /* inside a later push or init payload */
  st = try_client(px.addr, t1, &c, err, sizeof(err));
  REQUIRE(st == PS_OK, "job token: %s", err);
  REQUIRE(ps_declare(c, 1, names, counts) == PS_OK, "declare");
  static float init[N];
  for (int i = 0; i < N; i++) init[i] = (float)i;
  REQUIRE(ps_init(c, 0, init) == PS_OK, "init");
  train(c, 0, STEPS / 2);
  REQUIRE(atomic_load(&px.flipped) == 1, "the proxy flipped a bit towards the shard");
  atomic_store(&px.flip_down, 2 * 1024 * 1024 + 777); /* inside a later pull reply */
  train(c, STEPS / 2, STEPS / 2);
  REQUIRE(atomic_load(&px.flipped) == 2, "the proxy flipped a bit towards the worker");
  struct ps_client_counters cc;
  ps_client_counters(c, &cc);
  REQUIRE(cc.reconnects >= 2, "libps reconnected after each failed tag (%llu)",
          (unsigned long long)cc.reconnects);
  ps_client_free(c);

  /* the shard counted its tag failures (one frame, plus the proofs above) */
  char http[64], body[65536];
  REQUIRE(scrape_http_addr(srv.log, http, sizeof(http), 5000) == 0, "http address");
  REQUIRE(scrape_get(http, "/metrics", body, sizeof(body)) == 200, "scrape");
  double auth_errors = scrape_value(body, "ps_server_errors_total{kind=\"auth\"}");
  REQUIRE(auth_errors >= (ucx ? 2 : 6), "auth errors counted: %g", auth_errors);
  REQUIRE(harness_grep(srv.log, "push frame failed authentication") >= 1 ||
              harness_grep(srv.log, "init frame failed authentication") >= 1,
          "the shard names the frame that failed");
  REQUIRE(harness_grep(srv.log, "AUTHENTICATION IS OFF") == 0, "no warning with a token");
  ps_token_free(t1);
  ps_token_free(t2);
  auth_token_free(raw);
  printf("auth: refusals, raw clients and two flipped bits all caught; values exact\n");
  return 0;
}
