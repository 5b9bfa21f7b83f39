/* ucx_proxy: see ucx_proxy.h. One thread progresses one link that both
 * listens for the worker and connects to the shard; frames are forwarded
 * strictly in arrival order, each once its payload is in (a rendezvous
 * payload is fetched first). A head that came in the data (ucx_link.h's
 * long heads) is unwrapped first, so the hook always sees the frame. */
#include "ucx_proxy.h"

#include <poll.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "harness.h"
#include "net.h"
#include "ucx_link.h"

struct fwd {
  struct fwd *next;
  bool up;
  uint8_t *buf; /* the payload, or a long head's data (head || payload) */
  uint64_t len;
  uint32_t long_head;
  atomic_bool in;
  uint32_t head_len;
  uint8_t *head;
};

static struct ulink *ux;
static struct ulink_ep *down, *up; /* the worker's connection, ours to the shard */
static struct fwd *fq_head, *fq_tail;
static struct net_addr target;
static ucx_proxy_hook hook;
static void *hook_arg;
static atomic_int accepted;

static void fwd_free(struct fwd *f) {
  free(f->buf);
  free(f->head);
  free(f);
}

static void fwd_sent(void *arg, int status) {
  (void)status;
  fwd_free(arg);
}

static void fwd_in(void *arg, int status) {
  (void)status;
  atomic_store(&((struct fwd *)arg)->in, true);
}

static void cut(void) {
  if (down) ulink_ep_close(down, false);
  if (up) ulink_ep_close(up, false);
  down = up = NULL;
}

/* Frames whose payload is in go on, in order. */
static void pump(void) {
  while (fq_head && atomic_load(&fq_head->in)) {
    struct fwd *f = fq_head;
    fq_head = f->next;
    if (!fq_head) fq_tail = NULL;
    if (f->long_head) { /* head || payload: split */
      REQUIRE(f->long_head <= f->len && (f->head = malloc(f->long_head)), "proxy: long head");
      memcpy(f->head, f->buf, f->long_head);
      f->head_len = f->long_head;
      memmove(f->buf, f->buf + f->long_head, f->len - f->long_head);
      f->len -= f->long_head;
    }
    struct ulink_ep *to = f->up ? up : down;
    if (to && hook(f->up, f->head, f->head_len, f->buf, f->len, hook_arg) == UCX_PROXY_CUT) {
      cut();
      to = NULL;
    }
    if (!to ||
        ulink_send(to, f->head, f->head_len, f->len ? f->buf : NULL, f->len, fwd_sent, f) < 0)
      fwd_free(f);
  }
}

static void on_rx(struct ulink_rx *rx, void *arg) {
  (void)arg;
  if (rx->ep != down && rx->ep != up) {
    ulink_rx_free(ux, rx);
    return;
  }
  struct fwd *f = calloc(1, sizeof(*f));
  REQUIRE(f && (!rx->head_len || (f->head = malloc(rx->head_len))) &&
              (!rx->len || (f->buf = malloc(rx->len))),
          "proxy: no memory");
  f->up = rx->ep == down;
  f->len = rx->len;
  f->long_head = rx->long_head;
  f->head_len = rx->head_len;
  if (rx->head_len) memcpy(f->head, rx->head, rx->head_len);
  if (fq_tail)
    fq_tail->next = f;
  else
    fq_head = f;
  fq_tail = f;
  if (!rx->len) {
    ulink_rx_free(ux, rx);
    atomic_store(&f->in, true);
  } else {
    REQUIRE(ulink_rx_take(ux, rx, f->buf, fwd_in, f) == 0, "proxy: take");
  }
  pump();
}

static void on_conn(struct ulink_ep *ep, const char *peer, void *arg) {
  (void)peer;
  (void)arg;
  cut(); /* one worker connection at a time */
  atomic_fetch_add(&accepted, 1);
  char err[200];
  down = ep;
  REQUIRE(ulink_connect(ux, target.host, target.port, &up, err, sizeof(err)) == 0, "proxy: %s",
          err);
}

static void on_error(struct ulink_ep *ep, const char *why, void *arg) {
  (void)why;
  (void)arg;
  if (ep == down || ep == up) cut();
}

static void *proxy_main(void *arg) {
  (void)arg;
  for (;;) {
    ulink_progress(ux);
    pump();
    if (!ulink_arm(ux)) continue;
    struct pollfd p = {ulink_efd(ux), POLLIN, 0};
    poll(&p, 1, 50);
  }
  return NULL;
}

void ucx_proxy_start(const char *to, ucx_proxy_hook h, void *arg, char *addr, size_t addrlen) {
  struct ulink_cbs cbs = {.on_rx = on_rx, .on_conn = on_conn, .on_error = on_error};
  char err[256];
  uint16_t port = 0;
  hook = h;
  hook_arg = arg;
  REQUIRE(net_parse_addr(to, &target, 0, err, sizeof(err)) == 0, "proxy target: %s", err);
  REQUIRE(ulink_new(false, &cbs, &ux, err, sizeof(err)) == 0, "proxy: %s", err);
  REQUIRE(ulink_listen(ux, "127.0.0.1", 0, &port, err, sizeof(err)) == 0, "proxy: %s", err);
  snprintf(addr, addrlen, "127.0.0.1:%u", (unsigned)port);
  pthread_t th;
  REQUIRE(pthread_create(&th, NULL, proxy_main, NULL) == 0, "proxy thread");
}

int ucx_proxy_accepted(void) {
  return atomic_load(&accepted);
}
