/* client: libps over TCP (see ps.h for the contract).
 *
 * Per shard: one blocking socket, a send mutex, and one receiver thread.
 * Callers encode and write their own frames under the send mutex (no hop to
 * another thread on the way out); the receiver thread decodes replies, reads
 * pull payloads straight into the caller's buffer, and completes requests.
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
#include "ps.h"

#include <errno.h>
#include <inttypes.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>

#include "auth.h"
#include "clock.h"
#include "frame.h"
#include "handshake.h"
#include "log.h"
#include "net.h"
#include "placement.h"
#include "wire.h"
#include "wire_send.h"

#define RX_BUF_BYTES (64u * 1024u)
#define HDR_BUF_BYTES (FRAME_PREAMBLE_BYTES + FRAME_MAX_HEADER)

struct ps_request {
  ps_client *c;
  int remaining;
  bool done;
  bool user_waits;
  ps_status status;
  uint64_t version; /* lowest version among a pull's chunks */
  ps_done_fn cb;
  void *arg;
  struct ps_shard_stats *stats_out;
  uint64_t *clocks_out; /* n_clocks entries */
  int n_clocks;
};

struct op {
  struct op *prev, *next;
  uint64_t id;
  Ps__MsgType type;
  uint64_t key, step, version;
  const void *send_buf; /* init/push payload */
  void *recv_buf;       /* pull destination */
  uint64_t bytes;
  struct ps_request *req;
};

struct shard {
  ps_client *c;
  int idx;
  struct net_addr addr;
  int fd; /* replaced only under send_mu */
  pthread_mutex_t send_mu;
  pthread_t rx;
  bool rx_started;
  bool dead;              /* reconnection failed: new ops fail at once */
  struct op *head, *tail; /* pending, in send order; under c->mu */
  struct frame_decoder dec;
  struct wire_arena arena;    /* receiver thread's */
  struct wire_arena hs_arena; /* handshakes (under send_mu) */
  uint8_t *rbuf;
  uint8_t *sbuf;             /* encoded preamble+header; under send_mu */
  struct auth_session *sess; /* this connection's; replaced only under send_mu by the rx thread */
  uint64_t mac_done;         /* payload bytes of the reply being read already fed to its tag */
};

struct ps_client {
  struct ps_client_opts opts;
  int num_shards;
  struct shard *shards;
  pthread_mutex_t mu;
  pthread_cond_t cv;
  uint64_t next_id;
  bool closing;
  bool shutting_down;
  char errmsg[512];
  _Atomic uint64_t rollback_clock; /* UINT64_MAX = none seen */
  /* layout (after declare) */
  bool declared;
  int num_tensors;
  char **names;
  uint64_t *counts;
  uint64_t chunk_bytes;
  uint64_t layout_hash;
  struct placement placement;
  /* ps_client_counters: updated without locks from any thread */
  atomic_uint_fast64_t n_pushes, n_pulls, bytes_sent, bytes_received, n_reconnects;
  atomic_int shards_up;
};

const char *ps_strerror(ps_status s) {
  switch (s) {
    case PS_OK:
      return "ok";
    case PS_ERR_INVALID:
      return "invalid argument";
    case PS_ERR_CONNECT:
      return "cannot connect to a shard";
    case PS_ERR_IO:
      return "connection to a shard lost";
    case PS_ERR_LAYOUT_MISMATCH:
      return "layout mismatch";
    case PS_ERR_REMOTE:
      return "request refused by a shard";
    case PS_ERR_NOMEM:
      return "out of memory";
    case PS_ERR_STATE:
      return "call out of order";
    case PS_ERR_CLOSED:
      return "client closed";
    case PS_ERR_ROLLBACK:
      return "a shard restarted from an older checkpoint (roll back)";
  }
  return "unknown status";
}

static void set_err(ps_client *c, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void set_err(ps_client *c, const char *fmt, ...) {
  char buf[sizeof(c->errmsg)];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(buf, sizeof(buf), fmt, ap);
  va_end(ap);
  pthread_mutex_lock(&c->mu);
  memcpy(c->errmsg, buf, sizeof(buf));
  pthread_mutex_unlock(&c->mu);
}

const char *ps_errmsg(ps_client *c, char *buf, size_t len) {
  if (!c || !len) return "";
  pthread_mutex_lock(&c->mu);
  snprintf(buf, len, "%s", c->errmsg);
  pthread_mutex_unlock(&c->mu);
  return buf;
}

/* ---- requests ----------------------------------------------------------- */

static struct ps_request *req_new(ps_client *c, int ops, ps_done_fn cb, void *arg,
                                  bool user_waits) {
  struct ps_request *r = calloc(1, sizeof(*r));
  if (!r) return NULL;
  r->c = c;
  r->remaining = ops;
  r->cb = cb;
  r->arg = arg;
  r->user_waits = user_waits;
  r->version = UINT64_MAX;
  return r;
}

/* One op of r finished; the last one completes r. Takes c->mu. */
static void req_op_done(ps_client *c, struct ps_request *r, ps_status st, uint64_t version) {
  pthread_mutex_lock(&c->mu);
  if (st != PS_OK && r->status == PS_OK) r->status = st;
  if (version < r->version) r->version = version;
  bool last = --r->remaining == 0;
  if (last) r->done = true;
  ps_done_fn cb = r->cb;
  void *arg = r->arg;
  ps_status status = r->status;
  bool autofree = last && !r->user_waits;
  if (last) pthread_cond_broadcast(&c->cv);
  pthread_mutex_unlock(&c->mu);
  if (last && cb) cb(status, arg);
  if (autofree) free(r);
}

ps_status ps_wait(ps_request *r, uint64_t *version) {
  if (!r) return PS_ERR_INVALID;
  ps_client *c = r->c;
  pthread_mutex_lock(&c->mu);
  while (!r->done) pthread_cond_wait(&c->cv, &c->mu);
  pthread_mutex_unlock(&c->mu);
  ps_status st = r->status;
  if (version) *version = r->version;
  free(r);
  return st;
}

/* ---- encoding and sending ---------------------------------------------- */

static void fill_layout(ps_client *c, Ps__Layout *l, Ps__Tensor *tensors, Ps__Tensor **ptrs,
                        uint64_t *shapes) {
  for (int i = 0; i < c->num_tensors; i++) {
    ps__tensor__init(&tensors[i]);
    tensors[i].name = c->names[i];
    tensors[i].dtype = 0;
    shapes[i] = c->counts[i];
    tensors[i].n_shape = 1;
    tensors[i].shape = &shapes[i];
    ptrs[i] = &tensors[i];
  }
  l->n_tensors = (size_t)c->num_tensors;
  l->tensors = ptrs;
  l->chunk_bytes = c->chunk_bytes;
  l->num_shards = (uint32_t)c->num_shards;
  l->hash = c->layout_hash;
}

/* Writes one frame on sh (caller holds send_mu) and counts it; its preamble
 * and header stay in sh->sbuf. Returns the bytes written or -errno. */
static int64_t send_frame(struct shard *sh, const Ps__Header *h, const void *payload,
                          uint64_t plen) {
  int64_t n = wire_send_frame(sh->fd, h, payload, plen, sh->sess, sh->sbuf, HDR_BUF_BYTES);
  if (n > 0) atomic_fetch_add_explicit(&sh->c->bytes_sent, (uint64_t)n, memory_order_relaxed);
  return n;
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
  if (o->type != PS__MSG_TYPE__MSG_LAYOUT)
    return send_frame(sh, &h, o->send_buf, o->send_buf ? o->bytes : 0);
  Ps__Layout l = PS__LAYOUT__INIT;
  Ps__Tensor *tensors = calloc((size_t)c->num_tensors, sizeof(*tensors));
  Ps__Tensor **ptrs = calloc((size_t)c->num_tensors, sizeof(*ptrs));
  uint64_t *shapes = calloc((size_t)c->num_tensors, sizeof(*shapes));
  int64_t r = -ENOMEM;
  if (tensors && ptrs && shapes) {
    fill_layout(c, &l, tensors, ptrs, shapes);
    h.body_case = PS__HEADER__BODY_LAYOUT;
    h.layout = &l;
    r = send_frame(sh, &h, NULL, 0);
  }
  free(tensors);
  free(ptrs);
  free(shapes);
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
static void shard_submit(struct shard *sh, struct op *o) {
  ps_client *c = sh->c;
  pthread_mutex_lock(&sh->send_mu);
  pthread_mutex_lock(&c->mu);
  bool dead = sh->dead || c->closing;
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
    set_err(c, "shard %d (%s:%u) is unreachable", sh->idx, sh->addr.host, sh->addr.port);
    struct ps_request *r = o->req;
    free(o);
    req_op_done(c, r, c->closing ? PS_ERR_CLOSED : PS_ERR_IO, UINT64_MAX);
  }
}

/* ---- synchronous handshake ---------------------------------------------- */

/* Reads one whole frame with no payload (handshake replies). With a session
 * (sess, may be NULL) an ACK is followed by its tag, which is checked; an
 * ERROR ends the connection and its tag, if any, is not read. */
static int read_reply_sync(struct shard *sh, struct auth_session *sess, Ps__Header **out) {
  uint8_t pre[FRAME_PREAMBLE_BYTES];
  struct frame_preamble p;
  struct frame_limits lim = {FRAME_MAX_HEADER, 0};
  int r = net_read_all(sh->fd, pre, sizeof(pre));
  if (r < 0) return r;
  r = frame_preamble_decode(pre, &lim, &p);
  if (r < 0) return -EPROTO;
  r = net_read_all(sh->fd, sh->rbuf, p.header_len);
  if (r < 0) return r;
  if (wire_header_unpack(&sh->hs_arena, sh->rbuf, p.header_len, out) < 0) return -EPROTO;
  if (!sess || (*out)->type == PS__MSG_TYPE__MSG_ERROR) return 0;
  uint8_t tag[AUTH_TAG_BYTES];
  r = net_read_all(sh->fd, tag, sizeof(tag));
  if (r < 0) return r;
  struct iovec iov[2] = {{pre, sizeof(pre)}, {sh->rbuf, p.header_len}};
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
  hs_init(&hs, AUTH_INITIATOR, c->opts.auth_token);
  Ps__Header h = PS__HEADER__INIT;
  Ps__Hello hello = PS__HELLO__INIT;
  hello.rank = (uint32_t)c->opts.rank;
  hello.world_size = (uint32_t)c->opts.world_size;
  hello.job_id = (char *)(c->opts.job_id ? c->opts.job_id : "");
  hello.client = "libps 0.1.0";
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

/* Hello (and authentication), then the layout if one was declared. Caller
 * holds send_mu. */
static int handshake(struct shard *sh, char *err, size_t errlen, ps_status *st) {
  ps_client *c = sh->c;
  auth_session_free(sh->sess); /* a new connection: the old keys are void */
  sh->sess = NULL;
  int r = hello_auth(sh, err, errlen, st);
  if (r < 0 || !c->declared) return r;
  Ps__Header lh = PS__HEADER__INIT;
  Ps__Layout l = PS__LAYOUT__INIT;
  Ps__Tensor *tensors = calloc((size_t)c->num_tensors, sizeof(*tensors));
  Ps__Tensor **ptrs = calloc((size_t)c->num_tensors, sizeof(*ptrs));
  uint64_t *shapes = calloc((size_t)c->num_tensors, sizeof(*shapes));
  r = -ENOMEM;
  *st = PS_ERR_NOMEM;
  if (tensors && ptrs && shapes) {
    fill_layout(c, &l, tensors, ptrs, shapes);
    lh.type = PS__MSG_TYPE__MSG_LAYOUT;
    lh.rank = (uint32_t)c->opts.rank;
    lh.body_case = PS__HEADER__BODY_LAYOUT;
    lh.layout = &l;
    r = exchange_sync(sh, &lh, err, errlen, st);
  }
  free(tensors);
  free(ptrs);
  free(shapes);
  return r;
}

/* Connects and handshakes with capped exponential backoff until timeout_ms
 * (-1 = forever) or the client closes. Caller holds send_mu. */
static int shard_connect(struct shard *sh, int timeout_ms, char *err, size_t errlen,
                         ps_status *st) {
  ps_client *c = sh->c;
  uint64_t start = clock_now_ns();
  int wait = 50;
  for (;;) {
    struct net_backoff once = {0, 0, 0};
    int fd = net_connect(&sh->addr, &once, err, errlen);
    *st = PS_ERR_CONNECT;
    if (fd >= 0) {
      /* a shard that vanished without FIN/RST (node lost, partition) is
       * noticed in bounded time, not when the kernel gives up after ~15 min */
      net_set_keepalive(fd, 30, 10, 3);
      net_set_user_timeout(fd, 60000);
      pthread_mutex_lock(&c->mu); /* published for ps_client_free's shutdown */
      sh->fd = fd;
      pthread_mutex_unlock(&c->mu);
      int r = handshake(sh, err, errlen, st);
      if (r == 0) return 0;
      close(fd);
      sh->fd = -1;
      if (*st == PS_ERR_LAYOUT_MISMATCH || *st == PS_ERR_REMOTE) return r; /* permanent */
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
    req_op_done(c, r, st, UINT64_MAX);
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
      set_err(c, "shard %d: %s", sh->idx, h->error->message);
    return;
  }
  ps_status st = PS_OK;
  uint64_t version = UINT64_MAX;
  switch (h->type) {
    case PS__MSG_TYPE__MSG_PULL_REPLY:
      version = h->version;
      break;
    case PS__MSG_TYPE__MSG_ACK:
      break;
    case PS__MSG_TYPE__MSG_STATS:
      if (o->req->stats_out && h->body_case == PS__HEADER__BODY_STATS) {
        const Ps__Stats *s = h->stats;
        struct ps_shard_stats *out = o->req->stats_out;
        out->pushes = s->pushes;
        out->pulls = s->pulls;
        out->updates = s->updates;
        out->duplicates = s->duplicates;
        out->rejected_frames = s->rejected_frames;
        out->bytes_in = s->bytes_in;
        out->bytes_out = s->bytes_out;
        out->param_bytes = s->param_bytes;
        out->min_version = s->min_version;
        out->max_version = s->max_version;
        out->connected_workers = s->connected_workers;
        out->num_keys = s->num_keys;
        out->live_workers = s->live_workers;
      }
      if (o->req->clocks_out && h->body_case == PS__HEADER__BODY_STATS) {
        const Ps__Stats *s = h->stats;
        for (int i = 0; i < o->req->n_clocks; i++)
          o->req->clocks_out[i] = (size_t)i < s->n_worker_clocks ? s->worker_clocks[i] : UINT64_MAX;
      }
      break;
    case PS__MSG_TYPE__MSG_ERROR:
      st = PS_ERR_REMOTE;
      if (h->body_case == PS__HEADER__BODY_ERROR) {
        if (h->error->code == PS__ERROR_CODE__ERR_LAYOUT_MISMATCH) st = PS_ERR_LAYOUT_MISMATCH;
        if (h->error->code == PS__ERROR_CODE__ERR_ROLLBACK) {
          st = PS_ERR_ROLLBACK;
          atomic_store(&c->rollback_clock, h->version);
        }
        set_err(c, "shard %d (%s:%u) refused %s: %s", sh->idx, sh->addr.host, sh->addr.port,
                wire_type_name(o->type), h->error->message);
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
  req_op_done(c, r, st, version);
}

/* Reads and dispatches replies until the socket fails. Returns 0 if the
 * client is closing, else a negative errno. */
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

static int rx_run(struct shard *sh) {
  Ps__Header *h = NULL;
  struct op *o = NULL;
  frame_decoder_reset(&sh->dec);
  frame_decoder_set_tag_len(&sh->dec, sh->sess ? AUTH_TAG_BYTES : 0);
  for (;;) {
    uint8_t *win;
    size_t want = frame_decoder_payload_window(&sh->dec, &win);
    if (want >= 16384) {
      ssize_t n = recv(sh->fd, win, want, 0);
      if (n <= 0) return n == 0 ? -ECONNRESET : -errno;
      atomic_fetch_add_explicit(&sh->c->bytes_received, (uint64_t)n, memory_order_relaxed);
      int r = frame_decoder_advance(&sh->dec, (size_t)n);
      rx_mac_progress(sh);
      if (r == FRAME_DONE) {
        int e = reply_authentic(sh);
        if (e < 0) return e;
        on_reply_done(sh, h, o);
        frame_decoder_reset(&sh->dec);
      }
      continue;
    }
    ssize_t n = recv(sh->fd, sh->rbuf, RX_BUF_BYTES, 0);
    if (n <= 0) {
      if (n < 0 && errno == EINTR) continue;
      return n == 0 ? -ECONNRESET : -errno;
    }
    atomic_fetch_add_explicit(&sh->c->bytes_received, (uint64_t)n, memory_order_relaxed);
    size_t off = 0;
    while (off < (size_t)n) {
      size_t used = 0;
      int r = frame_decoder_feed(&sh->dec, sh->rbuf + off, (size_t)n - off, &used);
      off += used;
      if (r < 0) return -EPROTO;
      if (r == FRAME_HEADER) {
        if (wire_header_unpack(&sh->arena, frame_decoder_header(&sh->dec),
                               frame_decoder_header_len(&sh->dec), &h) < 0)
          return -EPROTO;
        o = on_reply_header(sh, h, frame_decoder_payload_len(&sh->dec));
        rx_mac_begin(sh);
        r = sh->dec.state == FD_DONE ? FRAME_DONE : FRAME_NEED_MORE;
      }
      if (r == FRAME_DONE) {
        int e = reply_authentic(sh);
        if (e < 0) return e;
        on_reply_done(sh, h, o);
        frame_decoder_reset(&sh->dec);
      }
    }
    rx_mac_progress(sh);
  }
}

static void *rx_main(void *arg) {
  struct shard *sh = arg;
  ps_client *c = sh->c;
  for (;;) {
    int r = rx_run(sh);
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
    close(sh->fd);
    sh->fd = -1;
    int timeout = c->opts.reconnect_timeout_ms;
    r = shard_connect(sh, timeout == 0 ? 60000 : timeout, err, sizeof(err), &st);
    if (r == 0) {
      /* ps_client_free may have run while we reconnected: it shuts down only
       * the fds it sees, so look at closing after publishing the new fd. */
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
    pthread_mutex_lock(&c->mu);
    sh->dead = true;
    pthread_mutex_unlock(&c->mu);
    pthread_mutex_unlock(&sh->send_mu);
    set_err(c, "%s", err);
    log_error("giving up on shard", "shard=%d error=\"%s\"", sh->idx, err);
    fail_pending(sh, c->closing ? PS_ERR_CLOSED : PS_ERR_IO);
    return NULL;
  }
  fail_pending(sh, PS_ERR_CLOSED);
  return NULL;
}

/* ---- public API ----------------------------------------------------------- */

static void shard_deinit(struct shard *sh) {
  if (sh->fd >= 0) close(sh->fd);
  auth_session_free(sh->sess);
  frame_decoder_deinit(&sh->dec);
  wire_arena_deinit(&sh->arena);
  wire_arena_deinit(&sh->hs_arena);
  free(sh->rbuf);
  free(sh->sbuf);
  pthread_mutex_destroy(&sh->send_mu);
}

static void layout_clear(ps_client *c) {
  if (c->names)
    for (int i = 0; i < c->num_tensors; i++) free(c->names[i]);
  free(c->names);
  free(c->counts);
  placement_free(&c->placement);
  c->names = NULL;
  c->counts = NULL;
  c->num_tensors = 0;
}

ps_status ps_client_new(const struct ps_client_opts *opts, ps_client **out, char *errbuf,
                        size_t errlen) {
  char tmp[512];
  if (!errbuf || !errlen) {
    errbuf = tmp;
    errlen = sizeof(tmp);
  }
  errbuf[0] = 0;
  *out = NULL;
  if (!opts || opts->num_servers < 1 || !opts->servers || opts->world_size < 1 || opts->rank < 0 ||
      opts->rank >= opts->world_size) {
    snprintf(errbuf, errlen, "need >= 1 server, world_size >= 1 and 0 <= rank < world_size");
    return PS_ERR_INVALID;
  }
  ps_client *c = calloc(1, sizeof(*c));
  if (!c) return PS_ERR_NOMEM;
  atomic_init(&c->rollback_clock, UINT64_MAX);
  c->opts = *opts;
  c->num_shards = opts->num_servers;
  c->chunk_bytes = opts->chunk_bytes ? opts->chunk_bytes : PLACEMENT_DEFAULT_CHUNK_BYTES;
  pthread_mutex_init(&c->mu, NULL);
  pthread_cond_init(&c->cv, NULL);
  ps_status st = PS_ERR_NOMEM;
  c->shards = calloc((size_t)c->num_shards, sizeof(*c->shards));
  if (!c->shards) goto fail;
  struct frame_limits lim = {FRAME_MAX_HEADER, UINT32_MAX};
  for (int i = 0; i < c->num_shards; i++) {
    struct shard *sh = &c->shards[i];
    sh->c = c;
    sh->idx = i;
    sh->fd = -1;
    pthread_mutex_init(&sh->send_mu, NULL);
    if (frame_decoder_init(&sh->dec, &lim) < 0 ||
        wire_arena_init(&sh->arena, WIRE_DEFAULT_BUDGET) < 0 ||
        wire_arena_init(&sh->hs_arena, WIRE_DEFAULT_BUDGET) < 0 ||
        !(sh->rbuf = malloc(RX_BUF_BYTES)) || !(sh->sbuf = malloc(HDR_BUF_BYTES)))
      goto fail;
    if (net_parse_addr(opts->servers[i], &sh->addr, 0, errbuf, errlen) < 0) {
      st = PS_ERR_INVALID;
      goto fail;
    }
  }
  int timeout = opts->connect_timeout_ms == 0 ? 30000 : opts->connect_timeout_ms;
  for (int i = 0; i < c->num_shards; i++) {
    struct shard *sh = &c->shards[i];
    pthread_mutex_lock(&sh->send_mu);
    int r = shard_connect(sh, timeout, errbuf, errlen, &st);
    pthread_mutex_unlock(&sh->send_mu);
    if (r < 0) goto fail;
  }
  atomic_store(&c->shards_up, c->num_shards);
  for (int i = 0; i < c->num_shards; i++) {
    if (pthread_create(&c->shards[i].rx, NULL, rx_main, &c->shards[i]) != 0) goto fail;
    c->shards[i].rx_started = true;
  }
  *out = c;
  return PS_OK;
fail:
  if (!errbuf[0]) snprintf(errbuf, errlen, "%s", ps_strerror(st));
  ps_client_free(c);
  return st;
}

void ps_client_free(ps_client *c) {
  if (!c) return;
  pthread_mutex_lock(&c->mu);
  c->closing = true;
  for (int i = 0; c->shards && i < c->num_shards; i++) {
    int fd = c->shards[i].fd;
    if (fd >= 0) shutdown(fd, SHUT_RDWR);
  }
  pthread_mutex_unlock(&c->mu);
  for (int i = 0; c->shards && i < c->num_shards; i++) {
    if (c->shards[i].rx_started) pthread_join(c->shards[i].rx, NULL);
    fail_pending(&c->shards[i], PS_ERR_CLOSED);
    shard_deinit(&c->shards[i]);
  }
  free(c->shards);
  layout_clear(c);
  pthread_cond_destroy(&c->cv);
  pthread_mutex_destroy(&c->mu);
  free(c);
}

/* Runs one op per shard (or only on shard `only` >= 0) and waits. A STATS
 * reply fills stats_out and/or clocks_out[0..n_clocks) when given. */
static ps_status run_on_shards_v(ps_client *c, Ps__MsgType type, int only,
                                 struct ps_shard_stats *stats_out, uint64_t *clocks_out,
                                 int n_clocks, uint64_t version);

static ps_status run_on_shards(ps_client *c, Ps__MsgType type, int only,
                               struct ps_shard_stats *stats_out, uint64_t *clocks_out,
                               int n_clocks) {
  return run_on_shards_v(c, type, only, stats_out, clocks_out, n_clocks, 0);
}

/* run_on_shards with Header.version set (MSG_ROLLBACK's clock). */
static ps_status run_on_shards_v(ps_client *c, Ps__MsgType type, int only,
                                 struct ps_shard_stats *stats_out, uint64_t *clocks_out,
                                 int n_clocks, uint64_t version) {
  int n = only >= 0 ? 1 : c->num_shards;
  struct ps_request *r = req_new(c, n, NULL, NULL, true);
  if (!r) return PS_ERR_NOMEM;
  r->stats_out = stats_out;
  r->clocks_out = clocks_out;
  r->n_clocks = n_clocks;
  struct op **ops = calloc((size_t)n, sizeof(*ops));
  for (int i = 0; ops && i < n; i++) {
    ops[i] = calloc(1, sizeof(struct op));
    if (!ops[i]) break;
  }
  bool ok = ops != NULL;
  for (int i = 0; ok && i < n; i++) ok = ops[i] != NULL;
  if (!ok) {
    for (int i = 0; ops && i < n; i++) free(ops[i]);
    free(ops);
    free(r);
    return PS_ERR_NOMEM;
  }
  for (int i = 0; i < n; i++) {
    ops[i]->type = type;
    ops[i]->version = version;
    ops[i]->req = r;
    shard_submit(&c->shards[only >= 0 ? only : i], ops[i]);
  }
  free(ops);
  return ps_wait(r, NULL);
}

ps_status ps_declare(ps_client *c, int num_tensors, const char *const *names,
                     const uint64_t *counts) {
  if (!c || num_tensors < 1 || !names || !counts) return PS_ERR_INVALID;
  for (int i = 0; i < num_tensors; i++) {
    if (!names[i] || !counts[i]) {
      set_err(c, "tensor %d has no name or no elements", i);
      return PS_ERR_INVALID;
    }
  }
  if (c->declared) {
    set_err(c, "the layout was already declared");
    return PS_ERR_STATE;
  }
  layout_clear(c);
  c->names = calloc((size_t)num_tensors, sizeof(char *));
  c->counts = calloc((size_t)num_tensors, sizeof(uint64_t));
  if (!c->names || !c->counts) goto nomem;
  c->num_tensors = num_tensors;
  for (int i = 0; i < num_tensors; i++) {
    if (!(c->names[i] = strdup(names[i]))) goto nomem;
    c->counts[i] = counts[i];
  }
  if (placement_build(c->counts, (uint32_t)num_tensors, c->chunk_bytes, (uint32_t)c->num_shards,
                      &c->placement) < 0)
    goto nomem;
  c->layout_hash =
      placement_layout_hash((const char *const *)c->names, c->counts, (uint32_t)num_tensors,
                            c->chunk_bytes, (uint32_t)c->num_shards);
  ps_status st = run_on_shards(c, PS__MSG_TYPE__MSG_LAYOUT, -1, NULL, NULL, 0);
  if (st != PS_OK) {
    layout_clear(c);
    return st;
  }
  c->declared = true; /* from now on a reconnect re-declares it */
  return PS_OK;
nomem:
  layout_clear(c);
  return PS_ERR_NOMEM;
}

ps_status ps_shard_bytes(ps_client *c, uint64_t *bytes_per_shard) {
  if (!c || !bytes_per_shard) return PS_ERR_INVALID;
  if (!c->declared) return PS_ERR_STATE;
  memcpy(bytes_per_shard, c->placement.shard_bytes, (size_t)c->num_shards * sizeof(uint64_t));
  return PS_OK;
}

/* Fans a tensor operation out to its chunks. */
static ps_status tensor_op(ps_client *c, Ps__MsgType type, int tensor, uint64_t step,
                           uint64_t version, const float *src, float *dst, ps_done_fn cb, void *arg,
                           ps_request **req) {
  if (!c || (!cb && !req) || (!src && !dst)) return PS_ERR_INVALID;
  if (!c->declared) {
    set_err(c, "%s before ps_declare", wire_type_name(type));
    return PS_ERR_STATE;
  }
  if (tensor < 0 || tensor >= c->num_tensors) {
    set_err(c, "tensor index %d outside [0, %d)", tensor, c->num_tensors);
    return PS_ERR_INVALID;
  }
  size_t first = c->placement.first_chunk[tensor], end = c->placement.first_chunk[tensor + 1];
  int n = (int)(end - first);
  struct ps_request *r = req_new(c, n, cb, arg, req != NULL);
  /* ops are freed one by one as they complete, so each is its own allocation */
  struct op **v = calloc((size_t)n, sizeof(*v));
  bool ok = r && v;
  for (int i = 0; ok && i < n; i++) ok = (v[i] = calloc(1, sizeof(struct op))) != NULL;
  if (!ok) {
    for (int i = 0; v && i < n; i++) free(v[i]);
    free(v);
    free(r);
    return PS_ERR_NOMEM;
  }
  for (int i = 0; i < n; i++) {
    const struct placement_chunk *ch = &c->placement.chunks[first + (size_t)i];
    struct op *o = v[i];
    o->type = type;
    o->key = ch->key;
    o->step = step;
    o->version = version;
    o->bytes = ch->count * sizeof(float);
    o->send_buf = src ? src + ch->offset : NULL;
    o->recv_buf = dst ? dst + ch->offset : NULL;
    o->req = r;
  }
  if (req) *req = r;
  /* after the last submit r may already be freed (callback form) */
  for (int i = 0; i < n; i++)
    shard_submit(&c->shards[c->placement.chunks[first + (size_t)i].shard], v[i]);
  free(v);
  return PS_OK;
}

ps_status ps_init_async(ps_client *c, int tensor, const float *values, ps_done_fn cb, void *arg,
                        ps_request **req) {
  return tensor_op(c, PS__MSG_TYPE__MSG_INIT, tensor, 0, 0, values, NULL, cb, arg, req);
}

ps_status ps_push_async(ps_client *c, int tensor, uint64_t step, const float *grad, ps_done_fn cb,
                        void *arg, ps_request **req) {
  return tensor_op(c, PS__MSG_TYPE__MSG_PUSH, tensor, step, 0, grad, NULL, cb, arg, req);
}

ps_status ps_pull_async(ps_client *c, int tensor, uint64_t min_version, float *out, ps_done_fn cb,
                        void *arg, ps_request **req) {
  return tensor_op(c, PS__MSG_TYPE__MSG_PULL, tensor, 0, min_version, NULL, out, cb, arg, req);
}

ps_status ps_init(ps_client *c, int tensor, const float *values) {
  ps_request *r;
  ps_status st = ps_init_async(c, tensor, values, NULL, NULL, &r);
  return st != PS_OK ? st : ps_wait(r, NULL);
}

ps_status ps_push(ps_client *c, int tensor, uint64_t step, const float *grad) {
  ps_request *r;
  ps_status st = ps_push_async(c, tensor, step, grad, NULL, NULL, &r);
  return st != PS_OK ? st : ps_wait(r, NULL);
}

ps_status ps_pull(ps_client *c, int tensor, uint64_t min_version, float *out, uint64_t *version) {
  ps_request *r;
  ps_status st = ps_pull_async(c, tensor, min_version, out, NULL, NULL, &r);
  return st != PS_OK ? st : ps_wait(r, version);
}

ps_status ps_barrier(ps_client *c) {
  if (!c) return PS_ERR_INVALID;
  if (!c->declared) return PS_ERR_STATE;
  return run_on_shards(c, PS__MSG_TYPE__MSG_BARRIER, 0, NULL, NULL, 0);
}

ps_status ps_stats(ps_client *c, int shard, struct ps_shard_stats *out) {
  if (!c || !out || shard < 0 || shard >= c->num_shards) return PS_ERR_INVALID;
  memset(out, 0, sizeof(*out));
  return run_on_shards(c, PS__MSG_TYPE__MSG_STATS, shard, out, NULL, 0);
}

ps_status ps_worker_clocks(ps_client *c, int shard, uint64_t *clocks, int n) {
  if (!c || !clocks || n < 0 || n > c->opts.world_size || shard < 0 || shard >= c->num_shards)
    return PS_ERR_INVALID;
  return run_on_shards(c, PS__MSG_TYPE__MSG_STATS, shard, NULL, clocks, n);
}

uint64_t ps_rollback_clock(ps_client *c) {
  return c ? atomic_load(&c->rollback_clock) : UINT64_MAX;
}

ps_status ps_rollback(ps_client *c, uint64_t clock) {
  if (!c) return PS_ERR_INVALID;
  if (!c->declared) return PS_ERR_STATE;
  ps_status st = run_on_shards_v(c, PS__MSG_TYPE__MSG_ROLLBACK, -1, NULL, NULL, 0, clock);
  if (st == PS_OK) atomic_store(&c->rollback_clock, UINT64_MAX);
  return st;
}

ps_status ps_resume_step(ps_client *c, uint64_t *step) {
  if (!c || !step) return PS_ERR_INVALID;
  if (!c->declared) {
    set_err(c, "ps_resume_step before ps_declare");
    return PS_ERR_STATE;
  }
  int me = c->opts.rank;
  uint64_t lowest = UINT64_MAX;
  uint64_t *clocks = calloc((size_t)me + 1, sizeof(uint64_t));
  if (!clocks) return PS_ERR_NOMEM;
  for (int i = 0; i < c->num_shards; i++) {
    ps_status st = ps_worker_clocks(c, i, clocks, me + 1);
    if (st != PS_OK) {
      free(clocks);
      return st;
    }
    if (clocks[me] < lowest) lowest = clocks[me];
  }
  free(clocks);
  *step = lowest == UINT64_MAX ? 0 : lowest; /* no shard holds a key: nothing pushed */
  return PS_OK;
}

void ps_client_counters(ps_client *c, struct ps_client_counters *out) {
  memset(out, 0, sizeof(*out));
  if (!c) return;
  out->pushes = atomic_load_explicit(&c->n_pushes, memory_order_relaxed);
  out->pulls = atomic_load_explicit(&c->n_pulls, memory_order_relaxed);
  out->bytes_sent = atomic_load_explicit(&c->bytes_sent, memory_order_relaxed);
  out->bytes_received = atomic_load_explicit(&c->bytes_received, memory_order_relaxed);
  out->reconnects = atomic_load_explicit(&c->n_reconnects, memory_order_relaxed);
  int up = atomic_load(&c->shards_up);
  out->connected_shards = up < 0 ? 0 : up;
  out->num_shards = c->num_shards;
}

ps_status ps_shutdown_servers(ps_client *c) {
  if (!c) return PS_ERR_INVALID;
  if (c->opts.rank != 0) {
    set_err(c, "only rank 0 may shut the shards down");
    return PS_ERR_STATE;
  }
  pthread_mutex_lock(&c->mu);
  c->shutting_down = true; /* the shards will close: do not reconnect */
  pthread_mutex_unlock(&c->mu);
  return run_on_shards(c, PS__MSG_TYPE__MSG_SHUTDOWN, -1, NULL, NULL, 0);
}
