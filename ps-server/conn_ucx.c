/* conn_ucx: the shard's connections over UCX (--transport ucx; the frames'
 * layout on UCX is in common/ucx_link.h).
 *
 * A UCX connection is a struct conn like a TCP one: the same decoder,
 * limits, handshake, tags, handlers, output queue and deadlines. Only the
 * bytes come differently. Each active message is replayed into the decoder
 * in stream order: preamble and header (the handlers choose the payload's
 * destination), the payload, the tag. An eager payload is copied in by the
 * decoder; a rendezvous payload is fetched by UCX straight into the
 * decoder's window (the scratch buffer a push is summed from), and the
 * frames behind it wait in the connection's queue until it is in. Every
 * active message must hold exactly one whole frame: the decoder is idle
 * after each, or the client is refused. Replies leave as one active message
 * each from the output queue (conn_flush), pinning their payload until UCX
 * is done with it.
 *
 * The worker is driven from the shard's loop: its event fd in a uv_poll_t,
 * and a uv_prepare_t that, before the loop sleeps, progresses until UCX has
 * nothing more to report, writes what that queued and re-arms the fd.
 * Pausing a client (output watermarks) stops feeding its queued frames;
 * a client that lets more than UQ_MAX frames queue up is dropped. A closed
 * connection is freed once UCX has finished every send and fetch of it (at
 * the latest when the worker is freed after the loop). */
#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "log.h"
#include "net.h"
#include "server_impl.h"

#define UQ_MAX 4096u      /* frames one client may have queued unprocessed */
#define STOP_WAIT_MS 2000 /* after stopping: how long UCX gets to finish sends */
#define LINGER_MS 250     /* a connection closed after its last replies stays this long */

static void drive(struct server *s);

/* A closed connection that UCX is done with is freed before the loop
 * sleeps, once (callers up the stack may still look at it). */
static void bury_later(struct conn *c) {
  if (c->state != CONN_CLOSING || c->uep || c->u_refs || c->u_buried) return;
  c->u_buried = true;
  c->next = c->srv->ucx_grave;
  c->srv->ucx_grave = c;
}

/* ---- receiving -------------------------------------------------------- */

struct take {
  struct conn *c;
  struct ulink_ep *ep;
  uint32_t unwrap; /* a long head: tmp holds head || payload (ucx_link.h) */
  uint8_t *tmp;    /* a payload being discarded (no destination), or the long head's data */
  uint64_t len;
  uint32_t tail_len; /* the tag, fed after the payload */
  uint8_t tail[FRAME_MAX_TAG];
};

static void feed_tail(struct conn *c, const uint8_t *tail, uint32_t n) {
  if (n && c->state != CONN_CLOSING) conn_feed(c, tail, n);
  if (c->state != CONN_CLOSING && !frame_decoder_idle(&c->dec))
    conn_fail(c, PS__ERROR_CODE__ERR_BAD_FRAME,
              "an active message ended inside its frame (its header is shorter than the frame's "
              "preamble says)");
}

static void feed_one(struct conn *c, struct ulink_rx *rx);

static void on_taken(void *arg, int status) {
  struct take *t = arg;
  struct conn *c = t->c;
  c->u_refs--;
  c->u_taking = false;
  if (c->state != CONN_CLOSING) {
    if (status < 0) {
      log_info("connection lost", "peer=%s error=\"payload fetch failed: %s\"", c->peer,
               strerror(-status));
      conn_close(c, false);
    } else if (t->unwrap) { /* now an eager frame like any other */
      struct ulink_rx *rx = ulink_rx_from_buffer(t->ep, t->tmp, t->len, t->unwrap);
      t->tmp = NULL;
      if (rx) {
        feed_one(c, rx);
      } else {
        log_warn("dropping a connection", "peer=%s reason=\"out of memory\"", c->peer);
        conn_close(c, false);
      }
    } else {
      if (t->tmp)
        conn_feed(c, t->tmp, t->len);
      else
        conn_feed_direct(c, t->len);
      feed_tail(c, t->tail, t->tail_len);
    }
  }
  free(t->tmp);
  free(t);
  if (c->state == CONN_CLOSING)
    bury_later(c);
  else
    conn_ucx_pump(c);
}

/* One frame: preamble and header into the decoder, then its payload, then
 * its tag. The preamble goes first, so a bad one is refused as it is over
 * TCP; then the message must have the sizes it announces. Bytes after the
 * header of a frame without payload are read as the stream would read
 * them (its tag, or further frames). */
static void feed_one(struct conn *c, struct ulink_rx *rx) {
  struct server *s = c->srv;
  if (rx->long_head) { /* the head is in the data: fetched whole first, within the limits */
    const struct frame_limits *lim = &c->dec.lim;
    if (rx->long_head > FRAME_PREAMBLE_BYTES + lim->max_header + FRAME_MAX_TAG ||
        rx->len - rx->long_head > lim->max_payload) {
      char why[200];
      snprintf(why, sizeof(why),
               "a frame of %" PRIu32 " header and %" PRIu64
               " payload bytes is above this connection's limits",
               rx->long_head, rx->len - rx->long_head);
      ulink_rx_free(s->ucx, rx);
      conn_fail(c, PS__ERROR_CODE__ERR_TOO_LARGE, "%s", why);
      return;
    }
    struct take *t = calloc(1, sizeof(*t));
    if (t) t->tmp = malloc(rx->len);
    if (!t || !t->tmp) {
      if (t) free(t);
      ulink_rx_free(s->ucx, rx);
      log_warn("dropping a connection", "peer=%s reason=\"out of memory\"", c->peer);
      conn_close(c, false);
      return;
    }
    t->c = c;
    t->ep = rx->ep;
    t->unwrap = rx->long_head;
    t->len = rx->len;
    c->u_taking = true;
    c->u_refs++;
    int r = ulink_rx_take(s->ucx, rx, t->tmp, on_taken, t);
    if (r < 0) {
      c->u_taking = false;
      c->u_refs--;
      free(t->tmp);
      free(t);
      conn_close(c, false);
    }
    return;
  }
  if (rx->head_len < FRAME_PREAMBLE_BYTES) {
    ulink_rx_free(s->ucx, rx);
    conn_fail(c, PS__ERROR_CODE__ERR_BAD_FRAME, "an active message without a frame preamble");
    return;
  }
  conn_feed(c, rx->head, FRAME_PREAMBLE_BYTES);
  if (c->state == CONN_CLOSING) {
    ulink_rx_free(s->ucx, rx);
    return;
  }
  uint32_t hlen = (uint32_t)rx->head[6] | (uint32_t)rx->head[7] << 8;
  uint64_t plen = 0;
  for (int i = 7; i >= 0; i--) plen = plen << 8 | rx->head[8 + i];
  uint32_t hdr_end = FRAME_PREAMBLE_BYTES + hlen;
  uint32_t tail_len = hdr_end <= rx->head_len ? rx->head_len - hdr_end : 0;
  if (hdr_end > rx->head_len || plen != rx->len || (rx->len && tail_len > FRAME_MAX_TAG)) {
    char why[240];
    snprintf(why, sizeof(why),
             "an active message of %" PRIu32 " header and %" PRIu64
             " data bytes does not hold the frame its preamble announces (%" PRIu32
             " header, %" PRIu64 " payload bytes, then its tag)",
             rx->head_len, rx->len, hlen, plen);
    ulink_rx_free(s->ucx, rx);
    conn_fail(c, PS__ERROR_CODE__ERR_BAD_FRAME, "%s", why);
    return;
  }
  conn_feed(c, rx->head + FRAME_PREAMBLE_BYTES, hlen); /* the handlers set the destination */
  if (c->state == CONN_CLOSING || !rx->len) {
    if (c->state != CONN_CLOSING) feed_tail(c, rx->head + hdr_end, tail_len);
    ulink_rx_free(s->ucx, rx);
    return;
  }
  if (!rx->rndv) { /* eager: the decoder copies it to its destination (or drops it) */
    conn_feed(c, rx->data, rx->len);
    feed_tail(c, rx->head + hdr_end, tail_len);
    ulink_rx_free(s->ucx, rx);
    return;
  }
  struct take *t = calloc(1, sizeof(*t));
  uint8_t *dst = NULL;
  size_t win = frame_decoder_payload_window(&c->dec, &dst);
  if (t && win != rx->len) t->tmp = malloc(rx->len); /* no destination: fetched, then dropped */
  if (!t || (win != rx->len && !t->tmp)) {
    free(t);
    ulink_rx_free(s->ucx, rx);
    log_warn("dropping a connection", "peer=%s reason=\"out of memory\"", c->peer);
    conn_close(c, false);
    return;
  }
  t->c = c;
  t->len = rx->len;
  t->tail_len = tail_len;
  memcpy(t->tail, rx->head + hdr_end, tail_len);
  c->u_taking = true;
  c->u_refs++;
  int r = ulink_rx_take(s->ucx, rx, t->tmp ? t->tmp : dst, on_taken, t);
  if (r < 0) {
    c->u_taking = false;
    c->u_refs--;
    free(t->tmp);
    free(t);
    log_info("connection lost", "peer=%s error=\"payload fetch failed: %s\"", c->peer,
             strerror(-r));
    conn_close(c, false);
  }
}

void conn_ucx_pump(struct conn *c) {
  while (c->uq_head && !c->u_taking && c->state != CONN_CLOSING && !c->read_paused && !c->doomed) {
    struct ulink_rx *rx = c->uq_head;
    c->uq_head = rx->next;
    if (!c->uq_head) c->uq_tail = NULL;
    c->uq_len--;
    feed_one(c, rx);
  }
}

static void on_rx(struct ulink_rx *rx, void *arg) {
  struct server *s = arg;
  struct conn *c = ulink_ep_user(rx->ep);
  if (!c || c->state == CONN_CLOSING) {
    ulink_rx_free(s->ucx, rx);
    return;
  }
  rx->next = NULL;
  if (c->uq_tail)
    c->uq_tail->next = rx;
  else
    c->uq_head = rx;
  c->uq_tail = rx;
  if (++c->uq_len > UQ_MAX) {
    log_warn("dropping a connection", "peer=%s rank=%d reason=\"more than %u frames queued\"",
             c->peer, c->has_rank ? (int)c->rank : -1, UQ_MAX);
    s->traffic.dropped++;
    conn_close(c, false);
    return;
  }
  conn_ucx_pump(c);
}

static void on_conn(struct ulink_ep *ep, const char *peer, void *arg) {
  struct server *s = arg;
  struct conn *c = s->stopping || s->draining ? NULL : conn_new(s, true);
  if (!c || conn_admit(c) < 0) {
    ulink_ep_close(ep, false);
    if (c) conn_free(c);
    return;
  }
  c->uep = ep;
  ulink_ep_set_user(ep, c);
  snprintf(c->peer, sizeof(c->peer), "%s", peer);
}

static void on_error(struct ulink_ep *ep, const char *why, void *arg) {
  (void)arg;
  struct conn *c = ulink_ep_user(ep);
  if (c && c->u_lingering) c->u_linger_done = true; /* the peer hung up: closed next */
  if (!c || c->state == CONN_CLOSING) return;
  if (c->has_rank)
    log_info("worker disconnected", "peer=%s rank=%" PRIu32 " error=\"%s\" lanes=%s", c->peer,
             c->rank, why, ulink_ep_transports(ep));
  else
    log_info("connection lost", "peer=%s error=\"%s\"", c->peer, why);
  conn_close(c, false);
}

/* ---- sending ---------------------------------------------------------- */

static void on_sent(void *arg, int status) {
  struct out_msg *m = arg;
  struct conn *c = m->c;
  (void)status; /* a failed send also fails the endpoint: on_error closes c */
  c->out_bytes -= m->held;
  vbuf_unref(m->vb);
  free(m);
  c->u_refs--;
  if (c->state == CONN_CLOSING)
    bury_later(c);
  else
    conn_read_resume(c);
}

void conn_ucx_flush(struct conn *c, struct out_msg *head) {
  for (struct out_msg *m = head, *next; m; m = next) {
    next = m->next;
    uint64_t plen = m->vb ? m->vb->count * sizeof(float) : 0;
    unsigned hl = m->hdr_len;
    if (c->sess) { /* the tag travels in the active message's header, after the header */
      memcpy(m->hdr + hl, m->tag, AUTH_TAG_BYTES);
      hl += AUTH_TAG_BYTES;
    }
    int r = c->uep ? 0 : -EPIPE;
    if (r == 0) {
      c->u_refs++;
      r = ulink_send(c->uep, m->hdr, hl, m->vb ? m->vb->data : NULL, plen, on_sent, m);
      if (r < 0) c->u_refs--;
    }
    if (r < 0) {
      c->out_bytes -= m->held;
      vbuf_unref(m->vb);
      free(m);
      if (c->state != CONN_CLOSING && !c->doomed) {
        log_warn("dropping a connection", "peer=%s reason=\"cannot send a reply: %s\"", c->peer,
                 strerror(-r));
        c->doomed = true;
        c->doom_why = "cannot send a reply";
      }
    }
  }
}

/* ---- lifetime --------------------------------------------------------- */

void conn_ucx_close(struct conn *c, bool flush) {
  struct server *s = c->srv;
  while (c->uq_head) {
    struct ulink_rx *rx = c->uq_head;
    c->uq_head = rx->next;
    ulink_rx_free(s->ucx, rx);
  }
  c->uq_tail = NULL;
  c->uq_len = 0;
  if (c->uep && flush && !c->u_lingering && !c->u_linger_done) {
    /* The last replies (an error frame naming the problem) are out, but
     * a peer that hears of the close first drops what it has not read yet
     * (UCX discards a failed endpoint's messages, and on shared memory the
     * close comes by the TCP manager, ahead of them): the endpoint stays
     * open, reading nothing, until the peer hangs up or LINGER_MS. */
    c->u_lingering = true;
    c->u_linger_until = uv_now(&s->loop) + LINGER_MS;
    c->next = s->ucx_linger;
    s->ucx_linger = c;
    return;
  }
  if (c->uep) {
    ulink_ep_set_user(c->uep, NULL);
    ulink_ep_close(c->uep, flush);
    c->uep = NULL;
  }
  bury_later(c);
}

/* Closes the lingering connections whose time is up. */
static void end_lingering(struct server *s) {
  uint64_t now = uv_now(&s->loop);
  for (struct conn **p = &s->ucx_linger; *p;) {
    struct conn *c = *p;
    if (!c->u_linger_done && now < c->u_linger_until) {
      p = &c->next;
      continue;
    }
    *p = c->next;
    c->u_lingering = false;
    c->u_linger_done = true;
    conn_ucx_close(c, true);
  }
}

static void close_handles(struct server *s) {
  if (!s->ucx_handles) return;
  s->ucx_handles = false;
  uv_close((uv_handle_t *)&s->ucx_poll, NULL);
  uv_close((uv_handle_t *)&s->ucx_prep, NULL);
  uv_close((uv_handle_t *)&s->ucx_stop, NULL);
}

static void on_stop_wait(uv_timer_t *t);

/* Stopping: the handles close once every connection is freed, or
 * STOP_WAIT_MS after the last one closed with sends still in flight. */
static void check_done(struct server *s) {
  if (!s->stopping || !s->ucx_handles) return;
  if (!s->ucx_live)
    close_handles(s);
  else if (!s->num_conns && !uv_is_active((uv_handle_t *)&s->ucx_stop))
    uv_timer_start(&s->ucx_stop, on_stop_wait, STOP_WAIT_MS, 0);
}

static void bury(struct server *s) {
  while (s->ucx_grave) {
    struct conn *c = s->ucx_grave;
    s->ucx_grave = c->next;
    conn_free(c);
  }
  check_done(s);
}

/* Progress until UCX reports nothing more, write what that queued, and arm
 * the event fd; then free the connections UCX is done with. */
static void drive(struct server *s) {
  s->traffic.rejected_frames += ulink_take_refused(s->ucx); /* by the listener's guard */
  for (int spins = 0;; spins++) {
    unsigned n = ulink_progress(s->ucx);
    if (s->flush_list) conn_flush_all(&s->flush);
    if (!n && ulink_arm(s->ucx)) break;
    if (spins > 4096) break; /* the prepare handle comes round again */
  }
  if (s->ucx_linger) end_lingering(s);
  bury(s);
}

static void on_poll(uv_poll_t *h, int status, int events) {
  (void)status;
  (void)events;
  drive(container_of(h, struct server, ucx_poll));
}

static void on_prepare(uv_prepare_t *h) {
  drive(container_of(h, struct server, ucx_prep));
}

/* After stopping, UCX had STOP_WAIT_MS to finish the last replies. */
static void on_stop_wait(uv_timer_t *t) {
  struct server *s = container_of(t, struct server, ucx_stop);
  log_warn("closing UCX connections that still had replies in flight", "connections=%" PRIu32,
           s->ucx_live);
  close_handles(s);
}

int conn_ucx_start(struct server *s, char *bound, size_t boundlen) {
  char err[300] = "";
  struct net_addr a;
  if (net_parse_addr(s->opts.listen, &a, 7070, err, sizeof(err)) < 0) {
    log_error("bad --listen", "value=\"%s\" error=\"%s\"", s->opts.listen, err);
    return -EINVAL;
  }
  struct ulink_cbs cbs = {.on_rx = on_rx, .on_conn = on_conn, .on_error = on_error, .arg = s};
  int r = ulink_new_server(a.host, &cbs, &s->ucx, err, sizeof(err));
  uint16_t port = 0;
  if (r == 0) r = ulink_listen(s->ucx, a.host, a.port, &port, err, sizeof(err));
  int fd = r == 0 ? ulink_efd(s->ucx) : -1;
  if (r == 0 && fd < 0) {
    snprintf(err, sizeof(err), "UCX gave no event fd");
    r = -EIO;
  }
  if (r < 0) {
    log_error("cannot listen", "addr=%s transport=ucx error=\"%s\"", s->opts.listen, err);
    ulink_free(s->ucx);
    s->ucx = NULL;
    return r;
  }
  uv_poll_init(&s->loop, &s->ucx_poll, fd);
  uv_poll_start(&s->ucx_poll, UV_READABLE, on_poll);
  uv_prepare_init(&s->loop, &s->ucx_prep);
  uv_prepare_start(&s->ucx_prep, on_prepare);
  uv_timer_init(&s->loop, &s->ucx_stop);
  s->ucx_handles = true;
  snprintf(bound, boundlen, "%s:%u", a.host, (unsigned)port);
  return 0;
}

void conn_ucx_stop_accepting(struct server *s) {
  if (!s->ucx) return;
  ulink_unlisten(s->ucx);
  check_done(s);
}

void conn_ucx_free(struct server *s) {
  if (!s->ucx) return;
  while (s->ucx_linger) { /* the loop ended before their time was up */
    struct conn *c = s->ucx_linger;
    s->ucx_linger = c->next;
    c->u_lingering = false;
    c->u_linger_done = true;
    conn_ucx_close(c, false);
  }
  ulink_free(s->ucx); /* cancels what is left: the sends' callbacks free the rest */
  s->ucx = NULL;
  while (s->ucx_grave) {
    struct conn *c = s->ucx_grave;
    s->ucx_grave = c->next;
    conn_free(c);
  }
}
