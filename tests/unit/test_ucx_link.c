/* ucx_link: two links in one process, connected over 127.0.0.1 through the
 * sockaddr manager, as the shard and libps use them.
 *
 *  - order and content: frames with heads of 16 bytes to 20 KiB (past
 *    ulink_max_head, so they travel in the data) and payloads of 0 bytes to
 *    1 MiB (eager and rendezvous, taken straight into a buffer of the
 *    receiver's choosing) arrive whole and in the order sent, and echoes
 *    come back the same way;
 *  - a closed connection is reported to the peer (on_error), and a send on
 *    a failed endpoint fails instead of hanging;
 *  - the counters count what went through.
 * Skips (77) in a build without UCX. Run once with the default transports
 * and, from meson.build, with UCX_TLS=tcp and UCX_TLS=sm,tcp. */
#include <errno.h>
#include <poll.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "clock.h"
#include "ucx_link.h"
#include "check.h"

#define FRAMES 200
#define MAX_PAYLOAD (1u << 20)

struct side {
  struct ulink *u;
  struct ulink_ep *ep; /* the server learns its own from on_conn */
  uint64_t got;        /* frames received, checked */
  bool error;
  uint8_t *buf; /* where payloads are taken */
  bool taking;
  struct ulink_rx *pending; /* frames waiting while a take is in flight */
  struct ulink_rx *pending_tail;
  bool echo; /* the server sends every frame back */
};
static struct side srv, cli;

static uint32_t head_len_of(uint64_t i) {
  return i == 7 || i == 150 ? 20000 : 16 + (uint32_t)(i * 37 % 300);
}
static uint64_t payload_of(uint64_t i) {
  static const uint64_t sizes[] = {0, 4, 100, 5000, 70000, MAX_PAYLOAD};
  return sizes[i * 7 % 6];
}
static uint8_t byte_of(uint64_t i, uint64_t off) {
  return (uint8_t)(i * 131 + off * 7 + 1);
}

static void fill(uint8_t *p, uint64_t n, uint64_t i) {
  for (uint64_t k = 0; k < n; k++) p[k] = byte_of(i, k);
}

/* p[0..n) holds the pattern of frame i from offset off on. */
static bool same(const uint8_t *p, uint64_t n, uint64_t i, uint64_t off) {
  for (uint64_t k = 0; k < n; k++)
    if (p[k] != byte_of(i, off + k)) return false;
  return true;
}

static void sent(void *arg, int status) {
  free(arg);
  CHECK(status == 0 || status == -ECANCELED || status == -ECONNRESET, "send: %d", status);
}

/* Sends frame i: its head starts with i, and the payload's pattern follows. */
static void send_frame(struct side *s, uint64_t i) {
  uint32_t hl = head_len_of(i);
  uint64_t pl = payload_of(i);
  uint8_t *b = malloc(hl + pl);
  fill(b, hl, i);
  memcpy(b, &i, sizeof(i));
  fill(b + hl, pl, i + 1000);
  CHECK(ulink_send(s->ep, b, hl, pl ? b + hl : NULL, pl, sent, b) == 0, "send %llu",
        (unsigned long long)i);
}

static void check_frame(struct side *s, struct ulink_rx *rx, const uint8_t *payload) {
  uint64_t i;
  memcpy(&i, rx->head, sizeof(i));
  CHECK(i == s->got, "frame %llu arrived as number %llu", (unsigned long long)i,
        (unsigned long long)s->got);
  CHECK(rx->head_len == head_len_of(i) && same(rx->head + 8, rx->head_len - 8, i, 8),
        "frame %llu: head of %u bytes", (unsigned long long)i, rx->head_len);
  CHECK(rx->len == payload_of(i) && (!rx->len || same(payload, rx->len, i + 1000, 0)),
        "frame %llu: payload of %llu bytes", (unsigned long long)i, (unsigned long long)rx->len);
  s->got++;
  if (s->echo) send_frame(s, i);
}

static void on_rx(struct ulink_rx *rx, void *arg);

struct tk {
  struct side *s;
  struct ulink_rx *rx; /* a copy of the head, the payload in s->buf */
  bool unwrap;
};

static void process(struct side *s, struct ulink_rx *rx);

static void taken(void *arg, int status) {
  struct tk *t = arg;
  struct side *s = t->s;
  CHECK(status == 0, "take: %d", status);
  s->taking = false;
  if (t->unwrap) {
    struct ulink_rx *rx = ulink_rx_from_buffer(t->rx->ep, s->buf, t->rx->len, t->rx->long_head);
    s->buf = malloc(MAX_PAYLOAD + 32768);
    CHECK(rx != NULL, "unwrap");
    if (rx) process(s, rx);
  } else {
    check_frame(s, t->rx, s->buf);
  }
  free(t->rx);
  free(t);
  while (!s->taking && s->pending) {
    struct ulink_rx *rx = s->pending;
    s->pending = rx->next;
    if (!s->pending) s->pending_tail = NULL;
    process(s, rx);
  }
}

static void process(struct side *s, struct ulink_rx *rx) {
  if (!rx->rndv && !rx->long_head) {
    check_frame(s, rx, rx->data);
    ulink_rx_free(s->u, rx);
    return;
  }
  struct tk *t = calloc(1, sizeof(*t));
  t->s = s;
  t->unwrap = rx->long_head != 0;
  t->rx = malloc(sizeof(*rx) + rx->head_len);
  memcpy(t->rx, rx, sizeof(*rx) + rx->head_len);
  s->taking = true;
  CHECK(ulink_rx_take(s->u, rx, s->buf, taken, t) == 0, "take");
}

static void on_rx(struct ulink_rx *rx, void *arg) {
  struct side *s = arg;
  if (s->taking) { /* in order behind the payload being fetched */
    rx->next = NULL;
    if (s->pending_tail)
      s->pending_tail->next = rx;
    else
      s->pending = rx;
    s->pending_tail = rx;
    return;
  }
  process(s, rx);
}

static void on_conn(struct ulink_ep *ep, const char *peer, void *arg) {
  struct side *s = arg;
  CHECK(strncmp(peer, "127.0.0.1:", 10) == 0, "peer %s", peer);
  s->ep = ep;
}

static void on_error(struct ulink_ep *ep, const char *why, void *arg) {
  struct side *s = arg;
  (void)why;
  if (ep == s->ep) s->error = true;
}

static void spin(int ms, bool (*done)(void)) {
  uint64_t until = clock_now_ns() + (uint64_t)ms * 1000000u;
  while (!done() && clock_now_ns() < until) {
    ulink_progress(srv.u);
    ulink_progress(cli.u);
  }
}

static bool connected(void) {
  return srv.ep != NULL;
}
static bool all_in(void) {
  return srv.got == FRAMES && cli.got == FRAMES;
}
static bool srv_error(void) {
  return srv.error;
}

int main(void) {
  char err[256];
  struct ulink_cbs cs = {on_rx, on_conn, on_error, &srv}, cc = {on_rx, NULL, on_error, &cli};
  int r = ulink_new(false, &cs, &srv.u, err, sizeof(err));
  if (r == -ENOTSUP) {
    printf("SKIP: %s\n", err);
    return 77;
  }
  CHECK(r == 0, "%s", err);
  /* the tuning variables are checked: a bad value is refused by name */
  const char *bad[][2] = {{"PS_UCX_POLL_US", "2000000"}, {"PS_UCX_POLL_US", "50us"},
                          {"PS_UCX_RNDV_BYTES", "-1"}, {"PS_UCX_RNDV_BYTES", "1e6"}};
  for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
    struct ulink *x = NULL;
    setenv(bad[i][0], bad[i][1], 1);
    err[0] = 0;
    int e = ulink_new(false, &cc, &x, err, sizeof(err));
    CHECK(e == -EINVAL && !x && strstr(err, bad[i][0]), "%s=%s gave %d (%s)", bad[i][0], bad[i][1],
          e, err);
    unsetenv(bad[i][0]);
  }
  CHECK(ulink_new(false, &cc, &cli.u, err, sizeof(err)) == 0, "%s", err);
  if (failures) return 1;
  srv.buf = malloc(MAX_PAYLOAD + 32768);
  cli.buf = malloc(MAX_PAYLOAD + 32768);
  srv.echo = true;
  uint16_t port = 0;
  CHECK(ulink_listen(srv.u, "127.0.0.1", 0, &port, err, sizeof(err)) == 0 && port, "%s", err);
  CHECK(ulink_connect(cli.u, "127.0.0.1", port, &cli.ep, err, sizeof(err)) == 0, "%s", err);
  CHECK(ulink_max_head(cli.u) < 20000, "a 20000-byte head fits the AM header (%zu)",
        ulink_max_head(cli.u));
  for (uint64_t i = 0; i < FRAMES; i++) send_frame(&cli, i);
  spin(5000, connected);
  CHECK(srv.ep, "no connection within 5 s");
  spin(30000, all_in);
  CHECK(srv.got == FRAMES && cli.got == FRAMES, "frames in order: server %llu, client %llu of %d",
        (unsigned long long)srv.got, (unsigned long long)cli.got, FRAMES);
  struct ulink_stats a, b;
  ulink_stats(cli.u, &a);
  ulink_stats(srv.u, &b);
  CHECK(a.frames_out == FRAMES && b.frames_in == FRAMES && b.frames_out == FRAMES &&
            a.frames_in == FRAMES,
        "counters: %llu %llu %llu %llu", (unsigned long long)a.frames_out,
        (unsigned long long)b.frames_in, (unsigned long long)b.frames_out,
        (unsigned long long)a.frames_in);
  CHECK(b.rndv_in > 0, "no payload came by rendezvous");
  printf("%d frames each way in order (%llu by rendezvous), lanes %s\n", FRAMES,
         (unsigned long long)b.rndv_in, ulink_ep_transports(cli.ep));

  /* the client goes: the server hears of it; sending there then fails */
  ulink_ep_close(cli.ep, true);
  cli.ep = NULL;
  spin(10000, srv_error);
  CHECK(srv.error, "the server did not learn of the closed connection within 10 s");
  uint8_t h[16] = {0};
  int sr = ulink_send(srv.ep, h, sizeof(h), NULL, 0, sent, NULL);
  CHECK(sr == -ECONNRESET, "a send on the failed endpoint gave %d, not -ECONNRESET", sr);
  ulink_ep_close(srv.ep, false);
  ulink_free(cli.u);
  ulink_free(srv.u);
  free(srv.buf);
  free(cli.buf);
  return failures ? 1 : 0;
}
