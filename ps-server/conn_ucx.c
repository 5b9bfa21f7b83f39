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
#include "ucx_env.h"
#include "ucx_link.h"

#define UQ_MAX 4096u      /* frames one client may have queued unprocessed */
#define STOP_WAIT_MS 2000 /* after stopping: how long UCX gets to finish sends */
#define LINGER_MS 250     /* a connection closed after its last replies stays this long */

/* A UCX connection: conn.c's part first (conn_new allocates conn_size). */
struct conn_ucx {
  struct conn c;
  struct ulink_ep *uep; /* NULL once closed */
  /* frames delivered but not yet fed to the decoder (paused, or behind a
   * payload still being fetched), and what UCX still holds of c */
  struct ulink_rx *uq_head, *uq_tail;
  uint32_t uq_len;
  bool taking;      /* a payload is being fetched into the decoder's window */
  uint32_t refs;    /* sends and fetches not yet done; freed at 0 once closed */
  bool buried;      /* in the shard's grave */
  bool lingering;   /* closed, its endpoint not yet (the shard's linger list) */
  bool linger_done; /* ...and the peer has hung up */
  uint64_t linger_until;
  struct conn_ucx *dead_next; /* in the grave or the linger list */
};

/* The shard's UCX worker and its loop handles (server.tp_state). */
struct ucx_shard {
  struct server *s;
  struct ulink *ul;        /* the worker and its listener */
  uv_poll_t poll;          /* its event fd */
  uv_prepare_t prep;       /* before the loop sleeps: progress and re-arm */
  uv_timer_t stop;         /* stopping: how long the last replies get */
  bool handles;            /* poll, prep and stop open */
  uint32_t live;           /* connections not yet freed */
  struct conn_ucx *grave;  /* closed, UCX done with them: freed before the loop sleeps */
  struct conn_ucx *linger; /* closed after their last replies, endpoints still open */
};

static struct conn_ucx *ucx_of(struct conn *c) {
  return container_of(c, struct conn_ucx, c);
}

static struct ucx_shard *shard_of(struct server *s) {
  return s->tp_state;
}

static void drive(struct ucx_shard *us);
static void ucx_close(struct conn *c, bool flush);
static void pump(struct conn *c);

/* A closed connection that UCX is done with is freed before the loop
 * sleeps, once (callers up the stack may still look at it). */
static void bury_later(struct conn *c) {
  struct conn_ucx *u = ucx_of(c);
  struct ucx_shard *us = shard_of(c->srv);
  if (c->state != CONN_CLOSING || u->uep || u->refs || u->buried) return;
  u->buried = true;
  u->dead_next = us->grave;
  us->grave = u;
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
  struct conn_ucx *u = ucx_of(c);
  u->refs--;
  u->taking = false;
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
    pump(c);
}

/* One frame: preamble and header into the decoder, then its payload, then
 * its tag. The preamble goes first, so a bad one is refused as it is over
 * TCP; then the message must have the sizes it announces. Bytes after the
 * header of a frame without payload are read as the stream would read
 * them (its tag, or further frames). */
static void feed_one(struct conn *c, struct ulink_rx *rx) {
  struct conn_ucx *u = ucx_of(c);
  struct ulink *ul = shard_of(c->srv)->ul;
  if (rx->long_head) { /* the head is in the data: fetched whole first, within the limits */
    const struct frame_limits *lim = &c->dec.lim;
    if (rx->long_head > FRAME_PREAMBLE_BYTES + lim->max_header + FRAME_MAX_TAG ||
        rx->len - rx->long_head > lim->max_payload) {
      char why[200];
      snprintf(why, sizeof(why),
               "a frame of %" PRIu32 " header and %" PRIu64
               " payload bytes is above this connection's limits",
               rx->long_head, rx->len - rx->long_head);
      ulink_rx_free(ul, rx);
      conn_fail(c, PS__ERROR_CODE__ERR_TOO_LARGE, "%s", why);
      return;
    }
    struct take *t = calloc(1, sizeof(*t));
    if (t) t->tmp = malloc(rx->len);
    if (!t || !t->tmp) {
      if (t) free(t);
      ulink_rx_free(ul, rx);
      log_warn("dropping a connection", "peer=%s reason=\"out of memory\"", c->peer);
      conn_close(c, false);
      return;
    }
    t->c = c;
    t->ep = rx->ep;
    t->unwrap = rx->long_head;
    t->len = rx->len;
    u->taking = true;
    u->refs++;
    int r = ulink_rx_take(ul, rx, t->tmp, on_taken, t);
    if (r < 0) {
      u->taking = false;
      u->refs--;
      free(t->tmp);
      free(t);
      conn_close(c, false);
    }
    return;
  }
  if (rx->head_len < FRAME_PREAMBLE_BYTES) {
    ulink_rx_free(ul, rx);
    conn_fail(c, PS__ERROR_CODE__ERR_BAD_FRAME, "an active message without a frame preamble");
    return;
  }
  conn_feed(c, rx->head, FRAME_PREAMBLE_BYTES);
  if (c->state == CONN_CLOSING) {
    ulink_rx_free(ul, rx);
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
    ulink_rx_free(ul, rx);
    conn_fail(c, PS__ERROR_CODE__ERR_BAD_FRAME, "%s", why);
    return;
  }
  conn_feed(c, rx->head + FRAME_PREAMBLE_BYTES, hlen); /* the handlers set the destination */
  if (c->state == CONN_CLOSING || !rx->len) {
    if (c->state != CONN_CLOSING) feed_tail(c, rx->head + hdr_end, tail_len);
    ulink_rx_free(ul, rx);
    return;
  }
  if (!rx->rndv) { /* eager: the decoder copies it to its destination (or drops it) */
    conn_feed(c, rx->data, rx->len);
    feed_tail(c, rx->head + hdr_end, tail_len);
    ulink_rx_free(ul, rx);
    return;
  }
  struct take *t = calloc(1, sizeof(*t));
  uint8_t *dst = NULL;
  size_t win = frame_decoder_payload_window(&c->dec, &dst);
  if (t && win != rx->len) t->tmp = malloc(rx->len); /* no destination: fetched, then dropped */
  if (!t || (win != rx->len && !t->tmp)) {
    free(t);
    ulink_rx_free(ul, rx);
    log_warn("dropping a connection", "peer=%s reason=\"out of memory\"", c->peer);
    conn_close(c, false);
    return;
  }
  t->c = c;
  t->len = rx->len;
  t->tail_len = tail_len;
  memcpy(t->tail, rx->head + hdr_end, tail_len);
  u->taking = true;
  u->refs++;
  int r = ulink_rx_take(ul, rx, t->tmp ? t->tmp : dst, on_taken, t);
  if (r < 0) {
    u->taking = false;
    u->refs--;
    free(t->tmp);
    free(t);
    log_info("connection lost", "peer=%s error=\"payload fetch failed: %s\"", c->peer,
             strerror(-r));
    conn_close(c, false);
  }
}

/* Feeds c's queued frames to the decoder while it is not paused (reading
 * resumes: conn_transport_ops.read_start). */
static void pump(struct conn *c) {
  struct conn_ucx *u = ucx_of(c);
  while (u->uq_head && !u->taking && c->state != CONN_CLOSING && !c->read_paused && !c->doomed) {
    struct ulink_rx *rx = u->uq_head;
    u->uq_head = rx->next;
    if (!u->uq_head) u->uq_tail = NULL;
    u->uq_len--;
    feed_one(c, rx);
  }
}

/* Nothing to stop: pump feeds nothing while c is paused. */
static void ucx_read_stop(struct conn *c) {
  (void)c;
}

static void on_rx(struct ulink_rx *rx, void *arg) {
  struct ucx_shard *us = arg;
  struct server *s = us->s;
  struct conn *c = ulink_ep_user(rx->ep);
  if (!c || c->state == CONN_CLOSING) {
    ulink_rx_free(us->ul, rx);
    return;
  }
  struct conn_ucx *u = ucx_of(c);
  rx->next = NULL;
  if (u->uq_tail)
    u->uq_tail->next = rx;
  else
    u->uq_head = rx;
  u->uq_tail = rx;
  if (++u->uq_len > UQ_MAX) {
    log_warn("dropping a connection", "peer=%s rank=%d reason=\"more than %u frames queued\"",
             c->peer, c->has_rank ? (int)c->rank : -1, UQ_MAX);
    s->traffic.dropped++;
    conn_close(c, false);
    return;
  }
  pump(c);
}

static void on_conn(struct ulink_ep *ep, const char *peer, void *arg) {
  struct ucx_shard *us = arg;
  struct server *s = us->s;
  struct conn *c = s->stopping || s->draining ? NULL : conn_new(s);
  if (!c) {
    ulink_ep_close(ep, false);
    return;
  }
  ucx_of(c)->uep = ep;
  ulink_ep_set_user(ep, c);
  snprintf(c->peer, sizeof(c->peer), "%s", peer);
  if (conn_admit(c) < 0) conn_refuse(c); /* closes ep; c is freed before the loop sleeps */
}

static void on_error(struct ulink_ep *ep, const char *why, void *arg) {
  (void)arg;
  struct conn *c = ulink_ep_user(ep);
  if (c && ucx_of(c)->lingering) ucx_of(c)->linger_done = true; /* the peer hung up: closed next */
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
  conn_out_done(c, m);
  ucx_of(c)->refs--;
  if (c->state == CONN_CLOSING)
    bury_later(c);
  else
    conn_read_resume(c);
}

/* c's queued replies, one active message each. */
static void ucx_write(struct conn *c, struct out_msg *head) {
  struct conn_ucx *u = ucx_of(c);
  for (struct out_msg *m = head, *next; m; m = next) {
    next = m->next;
    uint64_t plen = m->vb ? m->vb->count * sizeof(float) : 0;
    unsigned hl = m->hdr_len;
    if (c->sess) { /* the tag travels in the active message's header, after the header */
      memcpy(m->hdr + hl, m->tag, AUTH_TAG_BYTES);
      hl += AUTH_TAG_BYTES;
    }
    int r = u->uep ? 0 : -EPIPE;
    if (r == 0) {
      u->refs++;
      r = ulink_send(u->uep, m->hdr, hl, m->vb ? m->vb->data : NULL, plen, on_sent, m);
      if (r < 0) u->refs--;
    }
    if (r < 0) {
      conn_out_done(c, m);
      conn_doom(c, "cannot send a reply", r);
    }
  }
}

/* ---- lifetime --------------------------------------------------------- */

/* Closes c's endpoint (after its replies, with flush); c is freed once
 * UCX is done with it. */
static void ucx_close(struct conn *c, bool flush) {
  struct server *s = c->srv;
  struct ucx_shard *us = shard_of(s);
  struct conn_ucx *u = ucx_of(c);
  while (u->uq_head) {
    struct ulink_rx *rx = u->uq_head;
    u->uq_head = rx->next;
    ulink_rx_free(us->ul, rx);
  }
  u->uq_tail = NULL;
  u->uq_len = 0;
  if (u->uep && flush && !u->lingering && !u->linger_done) {
    /* The last replies (an error frame naming the problem) are out, but
     * a peer that hears of the close first drops what it has not read yet
     * (UCX discards a failed endpoint's messages, and on shared memory the
     * close comes by the TCP manager, ahead of them): the endpoint stays
     * open, reading nothing, until the peer hangs up or LINGER_MS. */
    u->lingering = true;
    u->linger_until = uv_now(&s->loop) + LINGER_MS;
    u->dead_next = us->linger;
    us->linger = u;
    return;
  }
  if (u->uep) {
    ulink_ep_set_user(u->uep, NULL);
    ulink_ep_close(u->uep, flush);
    u->uep = NULL;
  }
  bury_later(c);
}

/* Closes the lingering connections whose time is up. */
static void end_lingering(struct ucx_shard *us) {
  uint64_t now = uv_now(&us->s->loop);
  for (struct conn_ucx **p = &us->linger; *p;) {
    struct conn_ucx *u = *p;
    if (!u->linger_done && now < u->linger_until) {
      p = &u->dead_next;
      continue;
    }
    *p = u->dead_next;
    u->lingering = false;
    u->linger_done = true;
    ucx_close(&u->c, true);
  }
}

static void close_handles(struct ucx_shard *us) {
  if (!us->handles) return;
  us->handles = false;
  uv_close((uv_handle_t *)&us->poll, NULL);
  uv_close((uv_handle_t *)&us->prep, NULL);
  uv_close((uv_handle_t *)&us->stop, NULL);
}

static void on_stop_wait(uv_timer_t *t);

/* Stopping: the handles close once every connection is freed, or
 * STOP_WAIT_MS after the last one closed with sends still in flight. */
static void check_done(struct ucx_shard *us) {
  if (!us->s->stopping || !us->handles) return;
  if (!us->live)
    close_handles(us);
  else if (!us->s->num_conns && !uv_is_active((uv_handle_t *)&us->stop))
    uv_timer_start(&us->stop, on_stop_wait, STOP_WAIT_MS, 0);
}

static void free_grave(struct ucx_shard *us) {
  while (us->grave) {
    struct conn_ucx *u = us->grave;
    us->grave = u->dead_next;
    conn_free(&u->c);
  }
}

static void bury(struct ucx_shard *us) {
  free_grave(us);
  check_done(us);
}

/* Progress until UCX reports nothing more, write what that queued, and arm
 * the event fd; then free the connections UCX is done with. */
static void drive(struct ucx_shard *us) {
  struct server *s = us->s;
  s->traffic.rejected_frames += ulink_take_refused(us->ul); /* by the listener's guard */
  for (int spins = 0;; spins++) {
    unsigned n = ulink_progress(us->ul);
    if (s->flush_list) conn_flush_all(&s->flush);
    if (!n && ulink_arm(us->ul)) break;
    if (spins > 4096) break; /* the prepare handle comes round again */
  }
  if (us->linger) end_lingering(us);
  bury(us);
}

static void on_poll(uv_poll_t *h, int status, int events) {
  (void)status;
  (void)events;
  drive(container_of(h, struct ucx_shard, poll));
}

static void on_prepare(uv_prepare_t *h) {
  drive(container_of(h, struct ucx_shard, prep));
}

/* After stopping, UCX had STOP_WAIT_MS to finish the last replies. */
static void on_stop_wait(uv_timer_t *t) {
  struct ucx_shard *us = container_of(t, struct ucx_shard, stop);
  log_warn("closing UCX connections that still had replies in flight", "connections=%" PRIu32,
           us->live);
  close_handles(us);
}

/* The worker, its listener on opts.listen (bound gets "host:port") and its
 * loop handles. Returns 0 or a negative errno, logged. */
static int ucx_listen(struct server *s, char *bound, size_t boundlen) {
  char err[300] = "";
  struct net_addr a;
  if (net_parse_addr(s->opts.listen, &a, 7070, err, sizeof(err)) < 0) {
    log_error("bad --listen", "value=\"%s\" error=\"%s\"", s->opts.listen, err);
    return -EINVAL;
  }
  struct ucx_shard *us = calloc(1, sizeof(*us));
  if (!us) return -ENOMEM;
  us->s = s;
  struct ulink_cbs cbs = {.on_rx = on_rx, .on_conn = on_conn, .on_error = on_error, .arg = us};
  int r = ulink_new_server(a.host, &cbs, &us->ul, err, sizeof(err));
  uint16_t port = 0;
  if (r == 0) r = ulink_listen(us->ul, a.host, a.port, &port, err, sizeof(err));
  int fd = r == 0 ? ulink_efd(us->ul) : -1;
  if (r == 0 && fd < 0) {
    snprintf(err, sizeof(err), "UCX gave no event fd");
    r = -EIO;
  }
  if (r < 0) {
    log_error("cannot listen", "addr=%s transport=ucx error=\"%s\"", s->opts.listen, err);
    ulink_free(us->ul);
    free(us);
    return r;
  }
  s->tp_state = us;
  uv_poll_init(&s->loop, &us->poll, fd);
  uv_poll_start(&us->poll, UV_READABLE, on_poll);
  uv_prepare_init(&s->loop, &us->prep);
  uv_prepare_start(&us->prep, on_prepare);
  uv_timer_init(&s->loop, &us->stop);
  us->handles = true;
  snprintf(bound, boundlen, "%s:%u", a.host, (unsigned)port);
  return 0;
}

/* Stops accepting; the handles close once the last connection is gone. */
static void ucx_stop_accepting(struct server *s) {
  struct ucx_shard *us = shard_of(s);
  if (!us) return;
  ulink_unlisten(us->ul);
  check_done(us);
}

/* After the loop: the lingering connections, the worker (which cancels
 * what is left: the sends' callbacks free the rest) and the dead. */
static void ucx_release(struct server *s) {
  struct ucx_shard *us = shard_of(s);
  if (!us) return;
  while (us->linger) { /* the loop ended before their time was up */
    struct conn_ucx *u = us->linger;
    us->linger = u->dead_next;
    u->lingering = false;
    u->linger_done = true;
    ucx_close(&u->c, false);
  }
  ulink_free(us->ul);
  us->ul = NULL;
  free_grave(us);
}

/* Once the loop is closed: the handles' memory. */
static void ucx_free(struct server *s) {
  free(s->tp_state);
  s->tp_state = NULL;
}

/* Payloads UCX fetched by rendezvous, for the metrics. */
static void ucx_count(struct server *s) {
  struct ucx_shard *us = shard_of(s);
  if (!us || !us->ul) return;
  struct ulink_stats st;
  ulink_stats(us->ul, &st);
  s->traffic.rndv_in = st.rndv_in;
}

static int ucx_init(struct conn *c) {
  shard_of(c->srv)->live++;
  return 0;
}

static void ucx_deinit(struct conn *c) {
  struct ucx_shard *us = shard_of(c->srv);
  if (us) us->live--;
}

static bool ucx_gone(const struct conn *c) {
  return !container_of(c, const struct conn_ucx, c)->uep;
}

static void ucx_describe(const struct conn *c, char *buf, size_t len) {
  const struct conn_ucx *u = container_of(c, const struct conn_ucx, c);
  snprintf(buf, len, "ucx ucx_lanes=%s", u->uep ? ulink_ep_transports(u->uep) : "");
}

const struct conn_transport_ops conn_ucx_ops = {
    .name = "ucx",
    .conn_size = sizeof(struct conn_ucx),
    .check_build = ulink_transport_check,
    .check_env = ucx_env_check,
    .listen = ucx_listen,
    .stop_accepting = ucx_stop_accepting,
    .count = ucx_count,
    .release = ucx_release,
    .free = ucx_free,
    .init = ucx_init,
    .deinit = ucx_deinit,
    .read_stop = ucx_read_stop,
    .read_start = pump,
    .gone = ucx_gone,
    .write = ucx_write,
    .close = ucx_close,
    .describe = ucx_describe,
};
