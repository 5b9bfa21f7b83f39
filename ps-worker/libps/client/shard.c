/* shard: libps's connection to one shard (see client_impl.h for how it fits
 * with client.c).
 *
 * Per shard: one connection, a send mutex, and one receiver thread. What
 * carries the frames is the shard's transport (sh->ops: a shard_*.c
 * transport file, found by name in shard_transports.c); this file decides
 * when to connect, what to say and what a reply means, and owns every state
 * change of the connection (connecting, handshaking, up, reconnecting,
 * dead), the same for every transport. Callers encode and write their own
 * frames under the send mutex (no hop to another thread on the way out);
 * the receiver thread decodes replies, reads pull payloads straight into
 * the caller's buffer, and completes requests.
 *
 * Every operation on one key is an `op` in its shard's pending list from the
 * moment it is written until its reply arrives. When the connection breaks,
 * the receiver thread reconnects with capped backoff while holding the send
 * mutex, repeats hello (and the layout, if declared), and rewrites every
 * pending op unchanged, so pushes keep their (rank, step, key) and shards drop
 * the copies they already applied. One client mutex guards pending lists and
 * request state; it is never held across I/O.
 *
 * With a token (opts.auth_token) each connection starts with the handshake
 * of proto/handshake.h; its session tags every frame we send (under send_mu)
 * and checks the tag of every reply (receiver thread) before the reply
 * completes anything. A pull's payload lands in the caller's buffer before
 * its tag is checked; a bad tag breaks the connection and the pull is
 * resent, so no request ever completes with unauthenticated data. */
#include <errno.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/uio.h>

#include "auth.h"
#include "clock.h"
#include "client_impl.h"
#include "frame.h"
#include "handshake.h"
#include "log.h"
#include "net.h"
#include "token_impl.h"
#include "wire.h"

/* ---- sending ------------------------------------------------------------ */

/* Writes one frame on sh (caller holds send_mu) and counts it; its preamble
 * and header stay in sh->sbuf. Returns the bytes written or -errno. */
static int64_t send_frame(struct shard *sh, const Ps__Header *h, const void *payload,
                          uint64_t plen) {
  int64_t n = sh->ops->send(sh, h, payload, plen);
  if (n > 0) {
    atomic_fetch_add_explicit(&sh->c->bytes_sent, (uint64_t)n, memory_order_relaxed);
    atomic_store_explicit(&sh->last_send_ns, clock_now_ns(), memory_order_relaxed);
  }
  return n;
}

void shard_beat(struct shard *sh, uint64_t idle_ns) {
  uint64_t last = atomic_load_explicit(&sh->last_send_ns, memory_order_relaxed);
  if (clock_now_ns() - last < idle_ns) return;
  if (pthread_mutex_trylock(&sh->send_mu) != 0) return;
  pthread_mutex_lock(&sh->c->mu);
  bool up = !sh->dead && !sh->c->closing && sh->ops->connected(sh);
  pthread_mutex_unlock(&sh->c->mu);
  if (up) {
    Ps__Header h = PS__HEADER__INIT;
    h.type = PS__MSG_TYPE__MSG_HEARTBEAT;
    h.rank = (uint32_t)sh->c->opts.rank;
    (void)send_frame(sh, &h, NULL, 0); /* a failure is the receiver thread's to find */
  }
  pthread_mutex_unlock(&sh->send_mu);
}

static int64_t send_op(struct shard *sh, struct op *o) {
  ps_client *c = sh->c;
  Ps__Header h = PS__HEADER__INIT;
  h.type = o->type;
  h.request_id = o->id;
  h.rank = (uint32_t)c->opts.rank;
  h.step = o->step;
  h.key = o->key;
  h.version = o->version;
  h.flags = o->flags;
  h.rollback_id = o->rollback_id;
  Ps__Error why = PS__ERROR__INIT;
  if (o->type == PS__MSG_TYPE__MSG_ABORT) {
    why.code = PS__ERROR_CODE__ERR_STATE_LOST;
    why.message = (char *)(o->text ? o->text : "");
    h.body_case = PS__HEADER__BODY_ERROR;
    h.error = &why;
  }
  if (o->type != PS__MSG_TYPE__MSG_LAYOUT)
    return send_frame(sh, &h, o->send_buf, o->send_buf ? o->bytes : 0);
  h.incarnation = c->incarnation;
  struct client_layout l;
  int64_t r = client_layout_init(c, &l);
  if (r == 0) {
    h.body_case = PS__HEADER__BODY_LAYOUT;
    h.layout = &l.msg;
    r = send_frame(sh, &h, NULL, 0);
  }
  client_layout_deinit(&l);
  return r;
}

static void pending_remove(struct shard *sh, struct op *o) {
  if (o->prev)
    o->prev->next = o->next;
  else
    sh->head = o->next;
  if (o->next)
    o->next->prev = o->prev;
  else
    sh->tail = o->prev;
  o->prev = o->next = NULL;
}

/* Queues o on its shard and writes it. A write error is left to the
 * receiver thread, which sees the same broken socket and resends. */
void shard_submit(struct shard *sh, struct op *o) {
  ps_client *c = sh->c;
  pthread_mutex_lock(&sh->send_mu);
  pthread_mutex_lock(&c->mu);
  bool dead = sh->dead || c->closing;
  bool lost = sh->lost;
  if (!dead) {
    o->id = ++c->next_id;
    o->prev = sh->tail;
    if (sh->tail)
      sh->tail->next = o;
    else
      sh->head = o;
    sh->tail = o;
  }
  pthread_mutex_unlock(&c->mu);
  /* counted before sending: once written, the reply may complete and free o */
  if (!dead && o->type == PS__MSG_TYPE__MSG_PUSH)
    atomic_fetch_add_explicit(&c->n_pushes, 1, memory_order_relaxed);
  if (!dead && o->type == PS__MSG_TYPE__MSG_PULL)
    atomic_fetch_add_explicit(&c->n_pulls, 1, memory_order_relaxed);
  if (!dead) send_op(sh, o);
  pthread_mutex_unlock(&sh->send_mu);
  if (dead) {
    client_set_err(c, "shard %d (%s:%u) is unreachable", sh->idx, sh->addr.host, sh->addr.port);
    struct ps_request *r = o->req;
    free(o);
    client_req_done(c, r,
                    c->closing ? PS_ERR_CLOSED
                    : lost     ? PS_ERR_STATE_LOST
                               : PS_ERR_IO,
                    UINT64_MAX);
  }
}

/* Corks (on) or uncorks sh's connection: while corked the frames of a
 * batch leave together (the transport says how, if it can). */
void shard_cork(struct shard *sh, bool on) {
  pthread_mutex_lock(&sh->send_mu);
  sh->ops->cork(sh, on);
  pthread_mutex_unlock(&sh->send_mu);
}

/* ---- synchronous handshake ---------------------------------------------- */

/* Reads one whole frame with no payload (handshake replies). With a session
 * (sess, may be NULL) an ACK is followed by its tag, which is checked; an
 * ERROR ends the connection and its tag, if any, is not read. */
static int read_reply_sync(struct shard *sh, struct auth_session *sess, Ps__Header **out) {
  uint8_t pre[FRAME_PREAMBLE_BYTES];
  struct frame_preamble p;
  struct frame_limits lim = {FRAME_MAX_HEADER, 0};
  uint8_t *hdr = sh->rbuf;
  int r = sh->ops->read_sync(sh, pre, sizeof(pre), SHARD_SYNC_FIRST);
  if (r < 0) return r;
  r = frame_preamble_decode(pre, &lim, &p);
  if (r < 0) return -EPROTO;
  r = sh->ops->read_sync(sh, hdr, p.header_len, 0);
  if (r < 0) return r;
  if (wire_header_unpack(&sh->hs_arena, hdr, p.header_len, out) < 0) return -EPROTO;
  if (!sess || (*out)->type == PS__MSG_TYPE__MSG_ERROR) return 0;
  uint8_t tag[AUTH_TAG_BYTES];
  r = sh->ops->read_sync(sh, tag, sizeof(tag), SHARD_SYNC_LAST);
  if (r < 0) return r;
  struct iovec iov[2] = {{pre, sizeof(pre)}, {hdr, p.header_len}};
  return auth_open(sess, iov, 2, tag) == 0 ? 0 : -EBADMSG;
}

/* Sends msg and expects an ACK; an ERROR reply is returned as its text. */
static int exchange_sync(struct shard *sh, Ps__Header *h, char *err, size_t errlen, ps_status *st) {
  int64_t sent = send_frame(sh, h, NULL, 0);
  Ps__Header *rep = NULL;
  int r = sent < 0 ? (int)sent : read_reply_sync(sh, sh->sess, &rep);
  if (r == -EBADMSG) {
    snprintf(err, errlen, "shard %d (%s:%u): reply failed authentication", sh->idx, sh->addr.host,
             sh->addr.port);
    *st = PS_ERR_IO;
    return r;
  }
  if (r < 0) {
    snprintf(err, errlen, "shard %d (%s:%u): %s during handshake", sh->idx, sh->addr.host,
             sh->addr.port, strerror(-r));
    *st = PS_ERR_IO;
    return r;
  }
  if (rep->type == PS__MSG_TYPE__MSG_ERROR && rep->body_case == PS__HEADER__BODY_ERROR) {
    snprintf(err, errlen, "shard %d (%s:%u) refused %s: %s", sh->idx, sh->addr.host, sh->addr.port,
             wire_type_name(h->type), rep->error->message);
    *st = rep->error->code == PS__ERROR_CODE__ERR_LAYOUT_MISMATCH ? PS_ERR_LAYOUT_MISMATCH
          : rep->error->code == PS__ERROR_CODE__ERR_STATE_LOST    ? PS_ERR_STATE_LOST
                                                                  : PS_ERR_REMOTE;
    return -EPROTO;
  }
  if (rep->type != PS__MSG_TYPE__MSG_ACK) {
    snprintf(err, errlen, "shard %d: unexpected %s during handshake", sh->idx,
             wire_type_name(rep->type));
    *st = PS_ERR_IO;
    return -EPROTO;
  }
  return 0;
}

/* Hello and authentication (proto/handshake.h). Caller holds send_mu. */
static int hello_auth(struct shard *sh, char *err, size_t errlen, ps_status *st) {
  ps_client *c = sh->c;
  struct hs hs;
  hs_init(&hs, AUTH_INITIATOR, token_auth(c->opts.auth_token));
  Ps__Header h = PS__HEADER__INIT;
  Ps__Hello hello = PS__HELLO__INIT;
  hello.rank = (uint32_t)c->opts.rank;
  hello.world_size = (uint32_t)c->opts.world_size;
  hello.job_id = (char *)(c->opts.job_id ? c->opts.job_id : "");
  hello.client = "libps 0.1.0";
  hello.heartbeat_ms = (uint32_t)c->beat_ms;
  h.type = PS__MSG_TYPE__MSG_HELLO;
  h.rank = hello.rank;
  h.body_case = PS__HEADER__BODY_HELLO;
  h.hello = &hello;
  char why[400] = "";
  Ps__Header *rep = NULL;
  *st = PS_ERR_IO;
  int r = hs_initiator_hello(&hs, &hello);
  int64_t sent = r < 0 ? r : send_frame(sh, &h, NULL, 0);
  if (sent > 0) { /* no payload and no session yet: sbuf holds the whole hello as sent */
    hs_initiator_sent(&hs, sh->sbuf + FRAME_PREAMBLE_BYTES, (size_t)sent - FRAME_PREAMBLE_BYTES);
    r = read_reply_sync(sh, NULL, &rep);
  } else {
    r = (int)sent;
  }
  if (r < 0) {
    snprintf(err, errlen, "shard %d (%s:%u): %s during handshake", sh->idx, sh->addr.host,
             sh->addr.port, strerror(-r));
    goto out;
  }
  Ps__Auth auth;
  r = hs_initiator_on_reply(&hs, rep, &auth, why, sizeof(why));
  if (r == 1) {
    Ps__Header ah = PS__HEADER__INIT;
    ah.type = PS__MSG_TYPE__MSG_AUTH;
    ah.rank = hello.rank;
    ah.body_case = PS__HEADER__BODY_AUTH;
    ah.auth = &auth;
    sent = send_frame(sh, &ah, NULL, 0);
    r = sent < 0 ? (int)sent : read_reply_sync(sh, hs.session, &rep);
    if (r < 0) {
      snprintf(err, errlen, "shard %d (%s:%u): %s during authentication", sh->idx, sh->addr.host,
               sh->addr.port, r == -EBADMSG ? "a reply that failed authentication" : strerror(-r));
      goto out;
    }
    r = hs_initiator_on_ack(&hs, rep, why, sizeof(why));
  }
  if (r < 0) {
    snprintf(err, errlen, "shard %d (%s:%u) refused hello: %s", sh->idx, sh->addr.host,
             sh->addr.port, why);
    *st = r == -EACCES ? PS_ERR_REMOTE : PS_ERR_IO; /* a refusal is permanent */
    goto out;
  }
  auth_session_free(sh->sess);
  sh->sess = hs_take_session(&hs); /* NULL when neither side authenticates */
  r = 0;
out:
  hs_deinit(&hs);
  return r;
}

/* Hello (and authentication), then the layout if one was declared, then
 * ps_leave's kind if it was called: the shard forgot it at the hello, and
 * must know it before any request is resent. Caller holds send_mu. */
static int handshake(struct shard *sh, char *err, size_t errlen, ps_status *st) {
  ps_client *c = sh->c;
  auth_session_free(sh->sess); /* a new connection: the old keys are void */
  sh->sess = NULL;
  int r = hello_auth(sh, err, errlen, st);
  if (r < 0 || !c->declared) return r;
  Ps__Header lh = PS__HEADER__INIT;
  struct client_layout l;
  r = client_layout_init(c, &l);
  *st = PS_ERR_NOMEM;
  if (r == 0) {
    lh.type = PS__MSG_TYPE__MSG_LAYOUT;
    lh.rank = (uint32_t)c->opts.rank;
    lh.incarnation = c->incarnation;
    if (atomic_load(&c->started)) {
      uint64_t next = atomic_load(&c->clock);
      lh.flags = WIRE_LAYOUT_STARTED;
      lh.step = next ? next - 1 : 0; /* the step it is at: the last it pushed */
    }
    lh.body_case = PS__HEADER__BODY_LAYOUT;
    lh.layout = &l.msg;
    r = exchange_sync(sh, &lh, err, errlen, st);
  }
  client_layout_deinit(&l);
  int leave = atomic_load(&c->leave);
  if (r < 0 || !leave) return r;
  Ps__Header vh = PS__HEADER__INIT;
  vh.type = PS__MSG_TYPE__MSG_LEAVE;
  vh.rank = (uint32_t)c->opts.rank;
  vh.flags = (uint32_t)leave;
  return exchange_sync(sh, &vh, err, errlen, st);
}

/* Whether a handshake's refusal is final: the shard answered, and asking
 * again gets the same answer. */
static bool handshake_final(ps_status st) {
  return st == PS_ERR_LAYOUT_MISMATCH || st == PS_ERR_REMOTE || st == PS_ERR_STATE_LOST;
}

/* Connects and handshakes with capped exponential backoff until timeout_ms
 * (-1 = forever) or the client closes. Caller holds send_mu. */
static int shard_connect(struct shard *sh, int timeout_ms, char *err, size_t errlen,
                         ps_status *st) {
  ps_client *c = sh->c;
  uint64_t start = clock_now_ns();
  int wait = 50;
  for (;;) {
    if (atomic_load(&c->lost_said)) { /* the shards are stopping: nothing to reconnect to */
      snprintf(err, errlen, "shard %d: not reconnecting, the job's state is lost", sh->idx);
      *st = PS_ERR_STATE_LOST;
      return -ESTALE;
    }
    *st = PS_ERR_CONNECT;
    if (sh->ops->connect(sh, err, errlen) == 0) {
      int r = handshake(sh, err, errlen, st);
      if (r == 0) return 0;
      sh->ops->disconnect(sh);
      if (handshake_final(*st)) return r;
    }
    pthread_mutex_lock(&c->mu);
    bool stop = c->closing;
    pthread_mutex_unlock(&c->mu);
    uint64_t elapsed_ms = (clock_now_ns() - start) / 1000000u;
    if (stop || (timeout_ms >= 0 && elapsed_ms >= (uint64_t)timeout_ms)) return -ETIMEDOUT;
    clock_sleep_ms(wait);
    wait = wait * 2 > 2000 ? 2000 : wait * 2;
  }
}

/* ---- receiver thread ------------------------------------------------------ */

static struct op *find_op(struct shard *sh, uint64_t id) {
  for (struct op *o = sh->head; o; o = o->next)
    if (o->id == id) return o;
  return NULL;
}

/* Fails every pending op of sh with st (connection given up, or closing). */
static void fail_pending(struct shard *sh, ps_status st) {
  ps_client *c = sh->c;
  for (;;) {
    pthread_mutex_lock(&c->mu);
    struct op *o = sh->head;
    if (o) pending_remove(sh, o);
    pthread_mutex_unlock(&c->mu);
    if (!o) return;
    struct ps_request *r = o->req;
    free(o);
    client_req_done(c, r, st, UINT64_MAX);
  }
}

/* A reply's header arrived: match it to its op and choose the payload's
 * destination. Returns the op (still pending) or NULL for a reply to nothing
 * we know (its payload is discarded). */
static struct op *on_reply_header(struct shard *sh, Ps__Header *h, uint64_t plen) {
  ps_client *c = sh->c;
  pthread_mutex_lock(&c->mu);
  struct op *o = find_op(sh, h->request_id);
  pthread_mutex_unlock(&c->mu);
  void *dst = NULL;
  if (o && h->type == PS__MSG_TYPE__MSG_PULL_REPLY) {
    if (o->type == PS__MSG_TYPE__MSG_PULL && h->key == o->key && plen == o->bytes)
      dst = o->recv_buf;
    else
      o = NULL; /* malformed reply: drop it, the op stays pending */
  }
  frame_decoder_set_payload(&sh->dec, dst);
  return o;
}

static void on_reply_done(struct shard *sh, Ps__Header *h, struct op *o) {
  ps_client *c = sh->c;
  if (!o) {
    if (h->type == PS__MSG_TYPE__MSG_ERROR && h->body_case == PS__HEADER__BODY_ERROR)
      client_set_err(c, "shard %d: %s", sh->idx, h->error->message);
    return;
  }
  ps_status st = PS_OK;
  uint64_t version = UINT64_MAX;
  switch (h->type) {
    case PS__MSG_TYPE__MSG_PULL_REPLY:
      version = h->version;
      atomic_store(&c->pulled[o->chunk], version + 1);
      atomic_store(&c->started, true);
      break;
    case PS__MSG_TYPE__MSG_ACK:
      if (o->type == PS__MSG_TYPE__MSG_INIT) atomic_store(&c->started, true);
      break;
    case PS__MSG_TYPE__MSG_STATS:
      if (h->body_case == PS__HEADER__BODY_STATS) client_req_stats(o->req, h->stats);
      break;
    case PS__MSG_TYPE__MSG_ERROR:
      st = PS_ERR_REMOTE;
      if (h->body_case == PS__HEADER__BODY_ERROR) {
        if (h->error->code == PS__ERROR_CODE__ERR_LAYOUT_MISMATCH) st = PS_ERR_LAYOUT_MISMATCH;
        /* the job's code ran the ranks unevenly: permanent */
        if (h->error->code == PS__ERROR_CODE__ERR_UNEVEN_STEPS) st = PS_ERR_STATE;
        /* a push before the key's INIT: out of order (ps_wait_initialised) */
        if (h->error->code == PS__ERROR_CODE__ERR_NOT_INITIALISED) st = PS_ERR_STATE;
        /* a shard stopped the job for a lost worker: a restart retries it */
        if (h->error->code == PS__ERROR_CODE__ERR_WORKER_LOST) st = PS_ERR_IO;
        if (h->error->code == PS__ERROR_CODE__ERR_STATE_LOST) st = PS_ERR_STATE_LOST;
        if (h->error->code == PS__ERROR_CODE__ERR_ROLLBACK) {
          st = PS_ERR_ROLLBACK;
          atomic_store(&c->rollback_id, h->rollback_id);
          atomic_store(&c->rollback_clock, h->version);
        }
        client_set_err(c, "shard %d (%s:%u) refused %s: %s", sh->idx, sh->addr.host, sh->addr.port,
                       wire_type_name(o->type), h->error->message);
        if (st == PS_ERR_STATE_LOST) atomic_store(&c->lost_said, true);
      }
      break;
    default:
      return; /* not a reply type: ignore */
  }
  pthread_mutex_lock(&c->mu);
  pending_remove(sh, o);
  pthread_mutex_unlock(&c->mu);
  struct ps_request *r = o->req;
  free(o);
  client_req_done(c, r, st, version);
}

/* With a session, a reply's tag is computed as its bytes arrive (hot in
 * cache, while the shard still sends): begin at its header, progress after
 * each recv, and the whole reply must match before it counts. */
static void rx_mac_begin(struct shard *sh) {
  if (!sh->sess) return;
  auth_rx_begin(sh->sess);
  auth_rx_update(sh->sess, frame_decoder_preamble(&sh->dec), FRAME_PREAMBLE_BYTES);
  auth_rx_update(sh->sess, frame_decoder_header(&sh->dec), frame_decoder_header_len(&sh->dec));
  sh->mac_done = 0;
}

static void rx_mac_progress(struct shard *sh) {
  if (!sh->sess || !sh->dec.payload) return;
  enum frame_state st = sh->dec.state;
  uint64_t have = st == FD_PAYLOAD                ? sh->dec.got
                  : st == FD_TAG || st == FD_DONE ? frame_decoder_payload_len(&sh->dec)
                                                  : 0;
  if (have > sh->mac_done) {
    auth_rx_update(sh->sess, sh->dec.payload + sh->mac_done, have - sh->mac_done);
    sh->mac_done = have;
  }
}

static int reply_authentic(struct shard *sh) {
  if (!sh->sess) return 0;
  if (frame_decoder_payload_len(&sh->dec) && !sh->dec.payload)
    return -EPROTO; /* discarded: cannot be checked */
  rx_mac_progress(sh);
  if (auth_rx_finish(sh->sess, frame_decoder_tag(&sh->dec)) == 0) return 0;
  log_error("reply failed authentication, reconnecting", "shard=%d addr=%s:%u", sh->idx,
            sh->addr.host, sh->addr.port);
  return -EBADMSG;
}

/* A whole reply is in: check it and complete its op. */
static int rx_done(struct shard *sh) {
  int e = reply_authentic(sh);
  if (e < 0) return e;
  on_reply_done(sh, sh->rx_h, sh->rx_o);
  frame_decoder_reset(&sh->dec);
  return 0;
}

int shard_rx_advance(struct shard *sh, size_t n) {
  int r = frame_decoder_advance(&sh->dec, n);
  rx_mac_progress(sh);
  return r == FRAME_DONE ? rx_done(sh) : 0;
}

int shard_rx_feed(struct shard *sh, const uint8_t *p, size_t n) {
  size_t off = 0;
  while (off < n) {
    size_t used = 0;
    int r = frame_decoder_feed(&sh->dec, p + off, n - off, &used);
    off += used;
    if (r < 0) return -EPROTO;
    if (r == FRAME_HEADER) {
      if (wire_header_unpack(&sh->arena, frame_decoder_header(&sh->dec),
                             frame_decoder_header_len(&sh->dec), &sh->rx_h) < 0)
        return -EPROTO;
      sh->rx_o = on_reply_header(sh, sh->rx_h, frame_decoder_payload_len(&sh->dec));
      rx_mac_begin(sh);
      r = sh->dec.state == FD_DONE ? FRAME_DONE : FRAME_NEED_MORE;
    }
    if (r == FRAME_DONE) {
      int e = rx_done(sh);
      if (e < 0) return e;
    }
  }
  rx_mac_progress(sh);
  return 0;
}

static void *rx_main(void *arg) {
  struct shard *sh = arg;
  ps_client *c = sh->c;
  for (;;) {
    frame_decoder_reset(&sh->dec);
    frame_decoder_set_tag_len(&sh->dec, sh->sess ? AUTH_TAG_BYTES : 0);
    int r = sh->ops->rx_run(sh);
    atomic_fetch_sub(&c->shards_up, 1);
    pthread_mutex_lock(&c->mu);
    bool stop = c->closing || c->shutting_down;
    pthread_mutex_unlock(&c->mu);
    if (stop) {
      pthread_mutex_lock(&c->mu);
      sh->dead = true;
      pthread_mutex_unlock(&c->mu);
      break;
    }
    log_warn("lost shard, reconnecting", "shard=%d addr=%s:%u error=\"%s\"", sh->idx, sh->addr.host,
             sh->addr.port, strerror(-r));
    char err[512];
    ps_status st;
    pthread_mutex_lock(&sh->send_mu);
    sh->ops->disconnect(sh);
    int timeout = c->opts.reconnect_timeout_ms;
    r = shard_connect(sh, timeout == 0 ? 60000 : timeout, err, sizeof(err), &st);
    if (r == 0) {
      /* ps_client_free may have run while we reconnected: it shuts down only
       * the connection it sees, so look at closing after publishing the new
       * one. */
      pthread_mutex_lock(&c->mu);
      bool closing = c->closing;
      pthread_mutex_unlock(&c->mu);
      if (closing) {
        pthread_mutex_unlock(&sh->send_mu);
        break;
      }
      /* resend everything in flight, unchanged, in order */
      pthread_mutex_lock(&c->mu);
      size_t n = 0;
      for (struct op *o = sh->head; o; o = o->next) n++;
      pthread_mutex_unlock(&c->mu);
      atomic_fetch_add(&c->shards_up, 1);
      atomic_fetch_add_explicit(&c->n_reconnects, 1, memory_order_relaxed);
      log_info("shard reconnected, resending", "shard=%d pending=%zu", sh->idx, n);
      for (struct op *o = sh->head; o; o = o->next) send_op(sh, o);
      pthread_mutex_unlock(&sh->send_mu);
      continue;
    }
    /* Why, before the shard is marked dead: a request submitted once it
     * is would otherwise say only "unreachable", and with the job lost
     * that message would be the one relayed and kept (relay_lost). */
    client_set_err(c, "%s", err);
    if (st == PS_ERR_STATE_LOST) atomic_store(&c->lost_said, true);
    pthread_mutex_lock(&c->mu);
    sh->dead = true;
    sh->lost = st == PS_ERR_STATE_LOST; /* what its later requests fail with too */
    pthread_mutex_unlock(&c->mu);
    pthread_mutex_unlock(&sh->send_mu);
    log_error("giving up on shard", "shard=%d error=\"%s\"", sh->idx, err);
    fail_pending(sh, c->closing ? PS_ERR_CLOSED : st == PS_ERR_STATE_LOST ? st : PS_ERR_IO);
    return NULL;
  }
  fail_pending(sh, PS_ERR_CLOSED);
  return NULL;
}

/* ---- lifetime ------------------------------------------------------------ */

int shard_init(struct shard *sh, ps_client *c, int idx, const char *addr, char *err,
               size_t errlen) {
  struct frame_limits lim = {FRAME_MAX_HEADER, UINT32_MAX};
  sh->c = c;
  sh->idx = idx;
  pthread_mutex_init(&sh->send_mu, NULL);
  if (frame_decoder_init(&sh->dec, &lim) < 0 ||
      wire_arena_init(&sh->arena, WIRE_DEFAULT_BUDGET) < 0 ||
      wire_arena_init(&sh->hs_arena, WIRE_DEFAULT_BUDGET) < 0 ||
      !(sh->rbuf = malloc(SHARD_RX_BUF_BYTES)) || !(sh->sbuf = malloc(SHARD_HDR_BUF_BYTES)))
    return -ENOMEM;
  if (net_parse_addr(addr, &sh->addr, 0, err, errlen) < 0) return -EINVAL;
  /* the one place that looks at the transport's name (checked by
   * ps_client_new) */
  sh->ops = shard_transport_find(c->opts.transport, err, errlen);
  if (!sh->ops) return -EINVAL;
  return sh->ops->init(sh, err, errlen);
}

void shard_deinit(struct shard *sh) {
  if (sh->tp) sh->ops->deinit(sh);
  auth_session_free(sh->sess);
  frame_decoder_deinit(&sh->dec);
  wire_arena_deinit(&sh->arena);
  wire_arena_deinit(&sh->hs_arena);
  free(sh->rbuf);
  free(sh->sbuf);
  pthread_mutex_destroy(&sh->send_mu);
}

int shard_open(struct shard *sh, int timeout_ms, char *err, size_t errlen, ps_status *st) {
  pthread_mutex_lock(&sh->send_mu);
  int r = shard_connect(sh, timeout_ms, err, errlen, st);
  pthread_mutex_unlock(&sh->send_mu);
  return r;
}

int shard_start(struct shard *sh) {
  int r = pthread_create(&sh->rx, NULL, rx_main, sh);
  if (r != 0) return -r;
  sh->rx_started = true;
  return 0;
}

void shard_shutdown(struct shard *sh) {
  if (sh->tp) sh->ops->shutdown(sh);
}

void shard_stop(struct shard *sh) {
  if (sh->rx_started) pthread_join(sh->rx, NULL);
  fail_pending(sh, PS_ERR_CLOSED);
}
