/* shard_ucx: libps's connection to one shard over UCX (--transport ucx; the
 * frame layout on UCX is in common/ucx_link.h; how it fits with shard.c is
 * in client_impl.h).
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
 * over it before the pull completes; frames behind it wait. Reconnecting
 * and resending are shard.c's, unchanged: a failed endpoint is closed and a
 * new one made to the same address. */
#include <errno.h>
#include <poll.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "clock.h"
#include "client_impl.h"
#include "log.h"
#include "wire.h"

#define HDR_BUF_BYTES (FRAME_PREAMBLE_BYTES + FRAME_MAX_HEADER)
#define RX_BUF_BYTES (64u * 1024u)
#define SYNC_TIMEOUT_MS 30000 /* one handshake reply */
#define SLEEP_MS 1000         /* the longest sleep on the event fd */

static void on_rx(struct ulink_rx *rx, void *arg) {
  struct shard *sh = arg;
  if (rx->ep != sh->uep) { /* an old connection's last frames */
    ulink_rx_free(sh->ucx, rx);
    return;
  }
  rx->next = NULL;
  if (sh->uq_tail)
    sh->uq_tail->next = rx;
  else
    sh->uq_head = rx;
  sh->uq_tail = rx;
}

static void on_error(struct ulink_ep *ep, const char *why, void *arg) {
  struct shard *sh = arg;
  if (ep != sh->uep) return;
  snprintf(sh->u_why, sizeof(sh->u_why), "%s", why);
  atomic_store(&sh->u_broken, true);
}

static struct ulink_rx *pop(struct shard *sh) {
  struct ulink_rx *rx = sh->uq_head;
  if (rx) {
    sh->uq_head = rx->next;
    if (!sh->uq_head) sh->uq_tail = NULL;
  }
  return rx;
}

int shard_ucx_init(struct shard *sh, char *err, size_t errlen) {
  struct ulink_cbs cbs = {.on_rx = on_rx, .on_error = on_error, .arg = sh};
  return ulink_new(true, &cbs, &sh->ucx, err, errlen);
}

void shard_ucx_deinit(struct shard *sh) {
  if (!sh->ucx) return;
  shard_ucx_disconnect(sh);
  ulink_free(sh->ucx);
  sh->ucx = NULL;
}

int shard_ucx_connect(struct shard *sh, char *err, size_t errlen) {
  atomic_store(&sh->u_broken, false);
  sh->u_why[0] = 0;
  struct ulink_ep *ep = NULL;
  int r = ulink_connect(sh->ucx, sh->addr.host, sh->addr.port, &ep, err, errlen);
  ps_client *c = sh->c;
  pthread_mutex_lock(&c->mu); /* published like fd */
  sh->uep = ep;
  pthread_mutex_unlock(&c->mu);
  return r;
}

void shard_ucx_disconnect(struct shard *sh) {
  struct ulink_ep *ep = sh->uep;
  ps_client *c = sh->c;
  pthread_mutex_lock(&c->mu);
  sh->uep = NULL;
  pthread_mutex_unlock(&c->mu);
  if (ep) ulink_ep_close(ep, false);
  for (struct ulink_rx *rx; (rx = pop(sh));) ulink_rx_free(sh->ucx, rx);
}

static void sent(void *arg, int status) {
  (void)arg; /* the payload is the caller's until the reply; a failure breaks the endpoint */
  (void)status;
}

int64_t shard_ucx_send(struct shard *sh, const Ps__Header *h, const void *payload, uint64_t plen) {
  if (!sh->uep) return -ENOTCONN;
  int n = wire_frame_encode(h, plen, sh->sbuf, HDR_BUF_BYTES - AUTH_TAG_BYTES);
  if (n < 0) return n;
  size_t head = (size_t)n;
  if (sh->sess) { /* the tag follows the header in the active message's header */
    struct iovec iov[2] = {{sh->sbuf, head}, {(void *)payload, (size_t)plen}};
    if (auth_seal(sh->sess, iov, plen ? 2 : 1, sh->sbuf + head) < 0) return -EIO;
    head += AUTH_TAG_BYTES;
  }
  int r = ulink_send(sh->uep, sh->sbuf, head, payload, plen, sent, NULL);
  return r < 0 ? r : (int64_t)(head + plen);
}

/* Progresses, then sleeps on the event fd at most ms when there is nothing
 * to do. */
static void wait_events(struct shard *sh, int ms) {
  if (ulink_progress(sh->ucx) || sh->uq_head) return;
  if (!ulink_arm(sh->ucx)) return;
  struct pollfd p = {.fd = ulink_efd(sh->ucx), .events = POLLIN};
  if (p.fd >= 0) (void)poll(&p, 1, ms);
}

static int broken(struct shard *sh) {
  if (atomic_load(&sh->u_stop)) return -ECONNRESET;
  if (!atomic_load(&sh->u_broken)) return 0;
  log_info("UCX connection failed", "shard=%d error=\"%s\"", sh->idx, sh->u_why);
  return -ECONNRESET;
}

int shard_ucx_read_sync(struct shard *sh, uint32_t *head_len) {
  uint64_t deadline = clock_now_ns() + (uint64_t)SYNC_TIMEOUT_MS * 1000000u;
  struct ulink_rx *rx;
  while (!(rx = pop(sh))) {
    int e = broken(sh);
    if (e < 0) return e;
    if (clock_now_ns() > deadline) return -ETIMEDOUT;
    wait_events(sh, 50);
  }
  int r = 0;
  if (rx->len || rx->head_len > RX_BUF_BYTES)
    r = -EPROTO; /* handshake replies carry no payload */
  else
    memcpy(sh->rbuf, rx->head, rx->head_len);
  *head_len = rx->head_len;
  ulink_rx_free(sh->ucx, rx);
  return r;
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
  struct take t = {false, 0};
  int e = ulink_rx_take(sh->ucx, rx, dst, taken, &t);
  while (e == 0 && !atomic_load(&t.done)) {
    e = broken(sh);
    if (e == 0) wait_events(sh, 50);
  }
  /* a broken connection still finishes (cancels) the fetch, in ulink_free
   * at the latest; t must outlive it */
  while (e < 0 && !atomic_load(&t.done)) wait_events(sh, 10);
  return e == 0 ? atomic_load(&t.status) : e;
}

/* One reply: header, payload (fetched into its destination), tag. */
static int rx_one(struct shard *sh, struct ulink_rx *rx) {
  if (rx->long_head) { /* the head is in the data (ucx_link.h): fetch it all, then as eager */
    uint64_t len = rx->len;
    uint32_t head = rx->long_head;
    uint8_t *buf = len <= HDR_BUF_BYTES + AUTH_TAG_BYTES + (1ull << 32) ? malloc(len) : NULL;
    if (!buf) {
      ulink_rx_free(sh->ucx, rx);
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
    ulink_rx_free(sh->ucx, rx);
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
    ulink_rx_free(sh->ucx, rx);
  } else {
    uint8_t *dst = NULL, *tmp = NULL;
    uint64_t len = rx->len;
    if (frame_decoder_payload_window(&sh->dec, &dst) != len) {
      dst = tmp = malloc(len); /* no destination: fetched, then dropped by the decoder */
      if (!tmp) {
        ulink_rx_free(sh->ucx, rx);
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

int shard_ucx_rx_run(struct shard *sh) {
  frame_decoder_reset(&sh->dec);
  frame_decoder_set_tag_len(&sh->dec, sh->sess ? AUTH_TAG_BYTES : 0);
  for (;;) {
    struct ulink_rx *rx = pop(sh);
    if (rx) {
      int e = rx_one(sh, rx);
      if (e < 0) return e;
      continue;
    }
    int e = broken(sh);
    if (e < 0) return e;
    wait_events(sh, SLEEP_MS);
  }
}

void shard_ucx_shutdown(struct shard *sh) {
  atomic_store(&sh->u_stop, true);
  if (sh->ucx) ulink_signal(sh->ucx);
}
