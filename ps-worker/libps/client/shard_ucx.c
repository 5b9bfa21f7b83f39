/* shard_ucx: libps's connection to one shard over UCX (--transport ucx; the
 * frame layout on UCX is in common/ucx_link.h), one struct
 * shard_transport_ops (client_impl.h) for shard.c. Its fields are struct
 * shard_ucx, at sh->tp. In a build without UCX, ucx_link_none.c makes init
 * fail with "built without UCX".
 *
 * The threads stay as they are over TCP: callers send their own frames
 * under the shard's send mutex (ulink_send, which takes the link's own
 * mutex and never blocks), and the receiver thread progresses the shard's
 * UCX worker, sleeping on its event fd, and completes requests. A sender
 * whose frame UCX could not finish at once wakes the receiver thread
 * (ulink_send signals the worker), which progresses it.
 *
 * Replies go through the same decoder and the same code as over TCP
 * (shard_rx_feed): each active message is replayed as preamble and header,
 * payload, tag. A pull reply's rendezvous payload is fetched by UCX straight
 * into the caller's tensor (the decoder's window), and its tag is checked
 * over it before the pull completes; frames behind it wait. A handshake
 * reply is one active message, read from its start by read_sync, whose
 * bounds must match the frame's. Reconnecting and resending are shard.c's,
 * unchanged: a failed endpoint is closed and a new one made to the same
 * address. */
#include <errno.h>
#include <poll.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "clock.h"
#include "client_impl.h"
#include "log.h"
#include "ucx_link.h"
#include "wire.h"

#define SYNC_TIMEOUT_MS 30000 /* one handshake reply */
#define SLEEP_MS 1000         /* the longest sleep on the event fd */

/* The shard's worker; the connection is uep. Frames UCX delivered wait in
 * uq for the thread that progresses (the receiver thread, or the caller
 * during a handshake). */
struct shard_ucx {
  struct ulink *ucx;
  struct ulink_ep *uep; /* replaced only under send_mu, published under c->mu */
  struct ulink_rx *uq_head, *uq_tail;
  struct ulink_rx *sync_rx; /* the handshake reply read_sync is reading, at sync_off */
  uint32_t sync_off;
  atomic_bool u_broken; /* the connection failed (UCX said so) */
  atomic_bool u_stop;   /* ps_client_free: the receiver thread returns */
  char u_why[64];
};

static struct shard_ucx *ucx_of(const struct shard *sh) {
  return sh->tp;
}

static void on_rx(struct ulink_rx *rx, void *arg) {
  struct shard_ucx *u = ucx_of(arg);
  if (rx->ep != u->uep) { /* an old connection's last frames */
    ulink_rx_free(u->ucx, rx);
    return;
  }
  rx->next = NULL;
  if (u->uq_tail)
    u->uq_tail->next = rx;
  else
    u->uq_head = rx;
  u->uq_tail = rx;
}

static void on_error(struct ulink_ep *ep, const char *why, void *arg) {
  struct shard_ucx *u = ucx_of(arg);
  if (ep != u->uep) return;
  snprintf(u->u_why, sizeof(u->u_why), "%s", why);
  atomic_store(&u->u_broken, true);
}

static struct ulink_rx *pop(struct shard_ucx *u) {
  struct ulink_rx *rx = u->uq_head;
  if (rx) {
    u->uq_head = rx->next;
    if (!u->uq_head) u->uq_tail = NULL;
  }
  return rx;
}

static void sync_drop(struct shard_ucx *u) {
  if (u->sync_rx) ulink_rx_free(u->ucx, u->sync_rx);
  u->sync_rx = NULL;
}

static int ucx_init(struct shard *sh, char *err, size_t errlen) {
  struct shard_ucx *u = calloc(1, sizeof(*u));
  if (!u) return -ENOMEM;
  sh->tp = u;
  struct ulink_cbs cbs = {.on_rx = on_rx, .on_error = on_error, .arg = sh};
  int r = ulink_new(true, &cbs, &u->ucx, err, errlen);
  if (r < 0) {
    free(u);
    sh->tp = NULL;
  }
  return r;
}

static void ucx_disconnect(struct shard *sh) {
  struct shard_ucx *u = ucx_of(sh);
  struct ulink_ep *ep = u->uep;
  ps_client *c = sh->c;
  pthread_mutex_lock(&c->mu);
  u->uep = NULL;
  pthread_mutex_unlock(&c->mu);
  if (ep) ulink_ep_close(ep, false);
  sync_drop(u);
  for (struct ulink_rx *rx; (rx = pop(u));) ulink_rx_free(u->ucx, rx);
}

static void ucx_deinit(struct shard *sh) {
  struct shard_ucx *u = ucx_of(sh);
  ucx_disconnect(sh);
  ulink_free(u->ucx);
  free(u);
  sh->tp = NULL;
}

static int ucx_connect(struct shard *sh, char *err, size_t errlen) {
  struct shard_ucx *u = ucx_of(sh);
  atomic_store(&u->u_broken, false);
  u->u_why[0] = 0;
  struct ulink_ep *ep = NULL;
  int r = ulink_connect(u->ucx, sh->addr.host, sh->addr.port, &ep, err, errlen);
  ps_client *c = sh->c;
  pthread_mutex_lock(&c->mu); /* published for ps_client_free's shutdown */
  u->uep = ep;
  pthread_mutex_unlock(&c->mu);
  if (r < 0) ucx_disconnect(sh); /* nothing left open */
  return r;
}

static bool ucx_connected(const struct shard *sh) {
  return ucx_of(sh)->uep != NULL;
}

static void sent(void *arg, int status) {
  (void)arg; /* the payload is the caller's until the reply; a failure breaks the endpoint */
  (void)status;
}

static int64_t ucx_send(struct shard *sh, const Ps__Header *h, const void *payload, uint64_t plen) {
  struct shard_ucx *u = ucx_of(sh);
  if (!u->uep) return -ENOTCONN;
  int n = wire_frame_encode(h, plen, sh->sbuf, SHARD_HDR_BUF_BYTES - AUTH_TAG_BYTES);
  if (n < 0) return n;
  size_t head = (size_t)n;
  if (sh->sess) { /* the tag follows the header in the active message's header */
    struct iovec iov[2] = {{sh->sbuf, head}, {(void *)payload, (size_t)plen}};
    if (auth_seal(sh->sess, iov, plen ? 2 : 1, sh->sbuf + head) < 0) return -EIO;
    head += AUTH_TAG_BYTES;
  }
  int r = ulink_send(u->uep, sh->sbuf, head, payload, plen, sent, NULL);
  return r < 0 ? r : (int64_t)(head + plen);
}

/* Progresses, then sleeps on the event fd at most ms when there is nothing
 * to do. */
static void wait_events(struct shard_ucx *u, int ms) {
  if (ulink_progress(u->ucx) || u->uq_head) return;
  if (!ulink_arm(u->ucx)) return;
  struct pollfd p = {.fd = ulink_efd(u->ucx), .events = POLLIN};
  if (p.fd >= 0) (void)poll(&p, 1, ms);
}

static int broken(struct shard *sh) {
  struct shard_ucx *u = ucx_of(sh);
  if (atomic_load(&u->u_stop)) return -ECONNRESET;
  if (!atomic_load(&u->u_broken)) return 0;
  log_info("UCX connection failed", "shard=%d error=\"%s\"", sh->idx, u->u_why);
  return -ECONNRESET;
}

/* A handshake reply is one whole message: FIRST takes the next one, each
 * read takes the next bytes of it, and it must hold them (and, at LAST,
 * nothing more). */
static int ucx_read_sync(struct shard *sh, void *buf, size_t len, unsigned flags) {
  struct shard_ucx *u = ucx_of(sh);
  if (flags & SHARD_SYNC_FIRST) {
    sync_drop(u);
    uint64_t deadline = clock_now_ns() + (uint64_t)SYNC_TIMEOUT_MS * 1000000u;
    struct ulink_rx *rx;
    while (!(rx = pop(u))) {
      int e = broken(sh);
      if (e < 0) return e;
      if (clock_now_ns() > deadline) return -ETIMEDOUT;
      wait_events(u, 50);
    }
    u->sync_rx = rx;
    u->sync_off = 0;
    if (rx->len || rx->head_len > SHARD_RX_BUF_BYTES) { /* handshake replies carry no payload */
      sync_drop(u);
      return -EPROTO;
    }
  }
  struct ulink_rx *rx = u->sync_rx;
  if (!rx || len > rx->head_len - u->sync_off) return -EPROTO;
  memcpy(buf, rx->head + u->sync_off, len);
  u->sync_off += (uint32_t)len;
  if (!(flags & SHARD_SYNC_LAST)) return 0;
  bool whole = u->sync_off == rx->head_len;
  sync_drop(u);
  return whole ? 0 : -EPROTO;
}

struct take {
  atomic_bool done;
  atomic_int status;
};

static void taken(void *arg, int status) {
  struct take *t = arg;
  atomic_store(&t->status, status);
  atomic_store(&t->done, true);
}

/* Fetches rx's rendezvous payload into dst (rx is freed) and waits for it;
 * what arrives meanwhile waits in uq, in order. 0 or a negative errno. */
static int take_wait(struct shard *sh, struct ulink_rx *rx, void *dst) {
  struct shard_ucx *u = ucx_of(sh);
  struct take t = {false, 0};
  int e = ulink_rx_take(u->ucx, rx, dst, taken, &t);
  while (e == 0 && !atomic_load(&t.done)) {
    e = broken(sh);
    if (e == 0) wait_events(u, 50);
  }
  /* a broken connection still finishes (cancels) the fetch, in ulink_free
   * at the latest; t must outlive it */
  while (e < 0 && !atomic_load(&t.done)) wait_events(u, 10);
  return e == 0 ? atomic_load(&t.status) : e;
}

/* One reply: header, payload (fetched into its destination), tag. */
static int rx_one(struct shard *sh, struct ulink_rx *rx) {
  struct shard_ucx *u = ucx_of(sh);
  if (rx->long_head) { /* the head is in the data (ucx_link.h): fetch it all, then as eager */
    uint64_t len = rx->len;
    uint32_t head = rx->long_head;
    uint8_t *buf = len <= SHARD_HDR_BUF_BYTES + AUTH_TAG_BYTES + (1ull << 32) ? malloc(len) : NULL;
    if (!buf) {
      ulink_rx_free(u->ucx, rx);
      return -ENOMEM;
    }
    struct ulink_ep *ep = rx->ep;
    int e = take_wait(sh, rx, buf);
    if (e < 0) {
      free(buf);
      return e;
    }
    if (!(rx = ulink_rx_from_buffer(ep, buf, len, head))) return -ENOMEM;
  }
  if (rx->head_len < FRAME_PREAMBLE_BYTES) {
    ulink_rx_free(u->ucx, rx);
    return -EPROTO;
  }
  uint32_t hlen = (uint32_t)rx->head[6] | (uint32_t)rx->head[7] << 8;
  uint64_t plen = 0;
  for (int i = 7; i >= 0; i--) plen = plen << 8 | rx->head[8 + i];
  uint32_t hdr_end = FRAME_PREAMBLE_BYTES + hlen, tail = rx->head_len - hdr_end;
  atomic_fetch_add_explicit(&sh->c->bytes_received, rx->head_len + rx->len, memory_order_relaxed);
  int e = hdr_end > rx->head_len || plen != rx->len || tail > FRAME_MAX_TAG
              ? -EPROTO
              : shard_rx_feed(sh, rx->head, hdr_end);
  uint8_t tag[FRAME_MAX_TAG];
  if (e == 0) memcpy(tag, rx->head + hdr_end, tail);
  if (e == 0 && rx->len && !rx->rndv) e = shard_rx_feed(sh, rx->data, rx->len);
  if (e < 0 || !rx->len || !rx->rndv) {
    ulink_rx_free(u->ucx, rx);
  } else {
    uint8_t *dst = NULL, *tmp = NULL;
    uint64_t len = rx->len;
    if (frame_decoder_payload_window(&sh->dec, &dst) != len) {
      dst = tmp = malloc(len); /* no destination: fetched, then dropped by the decoder */
      if (!tmp) {
        ulink_rx_free(u->ucx, rx);
        return -ENOMEM;
      }
    }
    e = take_wait(sh, rx, dst);
    if (e == 0) e = tmp ? shard_rx_feed(sh, tmp, len) : shard_rx_advance(sh, len);
    free(tmp);
  }
  if (e == 0 && tail) e = shard_rx_feed(sh, tag, tail);
  if (e == 0 && !frame_decoder_idle(&sh->dec)) e = -EPROTO; /* a frame ended inside the message */
  return e;
}

static int ucx_rx_run(struct shard *sh) {
  struct shard_ucx *u = ucx_of(sh);
  for (;;) {
    struct ulink_rx *rx = pop(u);
    if (rx) {
      int e = rx_one(sh, rx);
      if (e < 0) return e;
      continue;
    }
    int e = broken(sh);
    if (e < 0) return e;
    wait_events(u, SLEEP_MS);
  }
}

static void ucx_shutdown(struct shard *sh) {
  struct shard_ucx *u = ucx_of(sh);
  atomic_store(&u->u_stop, true);
  ulink_signal(u->ucx);
}

/* UCX sends each frame as one message: nothing to hold back. */
static void ucx_cork(struct shard *sh, bool on) {
  (void)sh;
  (void)on;
}

const struct shard_transport_ops shard_ucx_ops = {
    .name = "ucx",
    .check_build = ulink_transport_check,
    .init = ucx_init,
    .deinit = ucx_deinit,
    .connect = ucx_connect,
    .disconnect = ucx_disconnect,
    .connected = ucx_connected,
    .send = ucx_send,
    .read_sync = ucx_read_sync,
    .rx_run = ucx_rx_run,
    .shutdown = ucx_shutdown,
    .cork = ucx_cork,
};
