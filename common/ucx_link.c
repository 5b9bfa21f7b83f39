/* ucx_link: ps frames over UCX active messages (see ucx_link.h). UCX 1.13
 * API only (Debian 12). */
#include "ucx_link.h"

#include <errno.h>
#include <netdb.h>
#include <pthread.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <ucp/api/ucp.h>

#include "clock.h"
#include "config.h"
#include "ucx_env.h"
#include "ucx_guard.h"

#define AM_ID 0x5053u /* "PS" */

enum ev_type { EV_RX, EV_DONE, EV_CONN, EV_ERR };

/* Something UCX reported inside progress, delivered after it. A send's or
 * take's event is allocated when it starts and queued when UCX finishes it. */
struct ev {
  struct ev *next;
  enum ev_type type;
  struct ulink *u;
  struct ulink_ep *ep; /* EV_RX (through rx), EV_CONN, EV_ERR */
  struct ulink_rx *rx; /* EV_RX */
  ulink_done_fn done;  /* EV_DONE */
  void *arg;
  int status;
  char text[64]; /* EV_CONN: peer; EV_ERR: why */
  void *owned;   /* EV_DONE of a send: a buffer freed once done */
};

struct ulink_ep {
  struct ulink *u;
  ucp_ep_h ep;
  struct ulink_ep *prev, *next; /* in u->eps while open */
  void *user;
  uint64_t tx_seq, rx_next;
  struct ulink_rx *early; /* frames ahead of rx_next, by seq */
  unsigned n_early;
  bool failed;
  bool err_pending; /* failed, not yet reported (push_errors) */
  bool admitted;    /* accepted: peer_addr is known to the guard */
  struct sockaddr_storage peer_addr;
  char why[64];
  char tls[64];
};

struct ulink {
  ucp_context_h ctx;
  ucp_worker_h w;
  ucp_listener_h lis;
  struct uguard *guard; /* while listening */
  bool locked;
  pthread_mutex_t mu;
  struct ulink_cbs cbs;
  struct ulink_ep *eps;
  struct ev *evq, *evq_tail;
  unsigned closing; /* endpoint closes UCX has not finished */
  size_t max_head;
  uint64_t rndv_bytes; /* payloads this large go by rendezvous */
  uint64_t poll_ns;    /* ulink_arm polls this long for work before arming */
  struct ulink_stats st;
};

static void lock(struct ulink *u) {
  if (u->locked) pthread_mutex_lock(&u->mu);
}
static void unlock(struct ulink *u) {
  if (u->locked) pthread_mutex_unlock(&u->mu);
}

#define status_errno(s) ucx_env_errno((int)(s))

/* Caller holds the lock. */
static void ev_push(struct ulink *u, struct ev *e) {
  e->next = NULL;
  if (u->evq_tail)
    u->evq_tail->next = e;
  else
    u->evq = e;
  u->evq_tail = e;
}

static void release_rx(struct ulink *u, struct ulink_rx *rx) {
  if (rx->owned)
    free(rx->owned);
  else if (rx->data && rx->len)
    ucp_am_data_release(u->w, rx->data);
  free(rx);
}

/* Caller holds the lock: the connection failed (once). Reported by ulink_progress once UCX has
 * nothing more to deliver: a peer that sent a last frame and closed is heard in that order even
 * when the close overtook the frame (shared memory next to the TCP manager). */
static void ep_fail(struct ulink_ep *e, const char *why) {
  if (e->failed) return;
  e->failed = true;
  e->err_pending = true;
  snprintf(e->why, sizeof(e->why), "%s", why);
}

/* Caller holds the lock. */
static void push_errors(struct ulink *u) {
  for (struct ulink_ep *e = u->eps; e; e = e->next) {
    if (!e->err_pending) continue;
    struct ev *ev = calloc(1, sizeof(*ev));
    if (!ev) return;
    e->err_pending = false;
    ev->type = EV_ERR;
    ev->ep = e;
    snprintf(ev->text, sizeof(ev->text), "%s", e->why);
    ev_push(u, ev);
  }
}

/* UCX's error handler: looked up among the open endpoints, so a report
 * about one already closed (and perhaps freed) is ignored. */
static void on_ep_error(void *arg, ucp_ep_h ep, ucs_status_t status) {
  struct ulink *u = arg;
  for (struct ulink_ep *e = u->eps; e; e = e->next)
    if (e->ep == ep) ep_fail(e, ucs_status_string(status));
}

static struct ulink_ep *ep_new(struct ulink *u) {
  struct ulink_ep *e = calloc(1, sizeof(*e));
  if (!e) return NULL;
  e->u = u;
  e->next = u->eps;
  if (u->eps) u->eps->prev = e;
  u->eps = e;
  return e;
}

static void ep_unlink(struct ulink_ep *e) {
  struct ulink *u = e->u;
  if (e->prev)
    e->prev->next = e->next;
  else if (u->eps == e)
    u->eps = e->next;
  if (e->next) e->next->prev = e->prev;
  e->prev = e->next = NULL;
}

static void queue_rx(struct ulink *u, struct ulink_rx *rx) {
  struct ev *ev = calloc(1, sizeof(*ev));
  if (!ev) {
    struct ulink_ep *e = rx->ep;
    release_rx(u, rx);
    ep_fail(e, "out of memory");
    return;
  }
  ev->type = EV_RX;
  ev->ep = rx->ep;
  ev->rx = rx;
  ev_push(u, ev);
}

static ucs_status_t on_am(void *arg, const void *header, size_t header_length, void *data,
                          size_t length, const ucp_am_recv_param_t *param) {
  struct ulink *u = arg;
  struct ulink_ep *e = NULL;
  /* an empty payload is not kept: the header is copied below */
  bool keep =
      length && (param->recv_attr & (UCP_AM_RECV_ATTR_FLAG_DATA | UCP_AM_RECV_ATTR_FLAG_RNDV));
  if (param->recv_attr & UCP_AM_RECV_ATTR_FIELD_REPLY_EP)
    for (e = u->eps; e && e->ep != param->reply_ep; e = e->next) {
    }
  if (!e) return UCS_OK; /* closed, or from no connection we know: dropped */
  uint64_t seq = 0, long_head = 0;
  const uint8_t *h = header;
  for (int i = ULINK_SEQ_BYTES - 1; header_length >= ULINK_SEQ_BYTES && i >= 0; i--)
    seq = seq << 8 | h[i];
  if ((seq & ULINK_LONG_HEAD) && header_length == ULINK_SEQ_BYTES + 4)
    long_head =
        (uint32_t)h[8] | (uint32_t)h[9] << 8 | (uint32_t)h[10] << 16 | (uint32_t)h[11] << 24;
  bool long_flag = (seq & ULINK_LONG_HEAD) != 0;
  seq &= ~ULINK_LONG_HEAD;
  if (header_length < ULINK_SEQ_BYTES || header_length - ULINK_SEQ_BYTES > UINT32_MAX ||
      (long_flag && (!long_head || long_head > length))) {
    ep_fail(e, "malformed active message (sequence number or head length)");
    return UCS_OK;
  }
  size_t head_bytes = long_flag ? 0 : header_length - ULINK_SEQ_BYTES;
  struct ulink_rx *rx = malloc(sizeof(*rx) + head_bytes);
  if (!rx) {
    ep_fail(e, "out of memory");
    return UCS_OK;
  }
  rx->next = NULL;
  rx->owned = NULL;
  rx->long_head = (uint32_t)long_head;
  rx->ep = e;
  rx->seq = seq;
  rx->len = length;
  rx->rndv = (param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) != 0;
  rx->data = length ? data : NULL;
  rx->head_len = (uint32_t)head_bytes;
  memcpy(rx->head, h + ULINK_SEQ_BYTES, head_bytes);
  if (length && !keep) { /* eager data valid only in this callback: copied */
    if (!(rx->owned = malloc(length))) {
      free(rx);
      ep_fail(e, "out of memory");
      return UCS_OK;
    }
    memcpy(rx->owned, data, length);
    rx->data = rx->owned;
  }
  u->st.frames_in++;
  u->st.bytes_in += header_length + length;
  if (rx->rndv) u->st.rndv_in++;
  if (seq == e->rx_next) {
    e->rx_next++;
    queue_rx(u, rx);
    while (e->early && e->early->seq == e->rx_next) {
      struct ulink_rx *n = e->early;
      e->early = n->next;
      e->n_early--;
      e->rx_next++;
      queue_rx(u, n);
    }
  } else if (seq > e->rx_next && e->n_early < ULINK_MAX_REORDER) {
    struct ulink_rx **p = &e->early;
    while (*p && (*p)->seq < seq) p = &(*p)->next;
    if (*p && (*p)->seq == seq) {
      free(rx);
      ep_fail(e, "a frame sequence number repeated");
      return UCS_OK;
    }
    rx->next = *p;
    *p = rx;
    e->n_early++;
    u->st.reordered++;
  } else {
    free(rx);
    ep_fail(e,
            seq < e->rx_next ? "a frame sequence number repeated" : "too many frames out of order");
    return UCS_OK;
  }
  return keep ? UCS_INPROGRESS : UCS_OK;
}

static void on_conn_request(ucp_conn_request_h req, void *arg) {
  struct ulink *u = arg;
  ucp_conn_request_attr_t attr = {.field_mask = UCP_CONN_REQUEST_ATTR_FIELD_CLIENT_ADDR};
  char peer[64] = "?";
  if (ucp_conn_request_query(req, &attr) == UCS_OK) {
    char ip[INET6_ADDRSTRLEN] = "";
    int port = 0;
    if (attr.client_address.ss_family == AF_INET) {
      struct sockaddr_in *a = (struct sockaddr_in *)&attr.client_address;
      inet_ntop(AF_INET, &a->sin_addr, ip, sizeof(ip));
      port = ntohs(a->sin_port);
    } else if (attr.client_address.ss_family == AF_INET6) {
      struct sockaddr_in6 *a = (struct sockaddr_in6 *)&attr.client_address;
      inet_ntop(AF_INET6, &a->sin6_addr, ip, sizeof(ip));
      port = ntohs(a->sin6_port);
    }
    snprintf(peer, sizeof(peer), "%s:%d", ip, port);
  }
  struct ulink_ep *e = ep_new(u);
  struct ev *ev = calloc(1, sizeof(*ev));
  if (!e || !ev) goto reject;
  if ((e->admitted = strcmp(peer, "?") != 0)) e->peer_addr = attr.client_address;
  if (e->admitted) uguard_admit(u->guard, &e->peer_addr);
  ucp_ep_params_t p = {
      .field_mask = UCP_EP_PARAM_FIELD_CONN_REQUEST | UCP_EP_PARAM_FIELD_ERR_HANDLER |
                    UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE,
      .conn_request = req,
      .err_mode = UCP_ERR_HANDLING_MODE_PEER,
      .err_handler = {.cb = on_ep_error, .arg = u},
  };
  if (ucp_ep_create(u->w, &p, &e->ep) != UCS_OK) {
    if (e->admitted) uguard_forget(u->guard, &e->peer_addr);
    ep_unlink(e);
    free(e);
    free(ev);
    return; /* the request is consumed either way */
  }
  ev->type = EV_CONN;
  ev->ep = e;
  snprintf(ev->text, sizeof(ev->text), "%s", peer);
  ev_push(u, ev);
  return;
reject:
  if (e) {
    ep_unlink(e);
    free(e);
  }
  free(ev);
  ucp_listener_reject(u->lis, req);
}

static const char *const transports[] = {"tcp", "ucx"};

int ulink_transport_parse(const char *value, char *err, size_t errlen) {
  return config_choice(value, transports, 2, err, errlen);
}

int ulink_transport_check(const char *value, char *err, size_t errlen) {
  int r = ulink_transport_parse(value, err, errlen);
  return r < 0 ? r : 0;
}

static pthread_once_t env_once = PTHREAD_ONCE_INIT;

static void set_env_defaults(void) {
  setenv("UCX_TCP_PUT_ENABLE", "n", 0);
  setenv("UCX_CM_REUSEADDR", "y", 0);
  /* 256 shared-memory FIFO slots instead of 64: a BSP step's pushes (a
   * 784 KiB tensor is a hundred 8 KiB fragments) filled 64, and senders
   * then waited for the receiver to free them: S=2 W=2 training went from
   * 50k to 75-85k samples/s here (2 MiB per transport and connection) */
  if (ucx_env_shm_possible()) setenv("UCX_MM_FIFO_SIZE", "256", 0);
}

/* net_devices: UCX_NET_DEVICES unless the user set it (NULL: UCX's). */
static int new_link(bool locked, const char *net_devices, const struct ulink_cbs *cbs,
                    struct ulink **out, char *err, size_t errlen) {
  *out = NULL;
  int te = ucx_env_check_tls(err, errlen);
  if (te < 0) return te;
  struct ulink *u = calloc(1, sizeof(*u));
  if (!u) return -ENOMEM;
  u->locked = locked;
  u->cbs = *cbs;
  /* UCX 1.13 sends active messages of any size eagerly unless told (its
   * threshold is for tagged sends): large payloads are sent by rendezvous,
   * so the receiver fetches them straight into their destination instead
   * of UCX assembling them in a buffer of its own that is copied again.
   * PS_UCX_RNDV_BYTES overrides (benchmarks). */
  int e = envknob_u64("PS_UCX_RNDV_BYTES", &u->rndv_bytes, err, errlen);
  if (e == 0) e = envknob_u64("PS_UCX_POLL_US", &u->poll_ns, err, errlen);
  if (e < 0) {
    free(u);
    return e;
  }
  if (!u->rndv_bytes) u->rndv_bytes = UINT64_MAX;
  u->poll_ns *= 1000u;
  pthread_mutex_init(&u->mu, NULL);
  ucp_config_t *cfg = NULL;
  ucs_status_t s = ucp_config_read(NULL, NULL, &cfg);
  const char *what = "ucp_config_read";
  if (s != UCS_OK) goto fail;
  /* Defaults of ours, unless the user set them (UCX_<NAME>):
   *  - connections are made by the TCP sockaddr manager: rdmacm cannot
   *    connect over 127.0.0.1 (ucx #6523), and the --listen port is TCP;
   *    a restarted shard listens again on its port at once (REUSEADDR);
   *  - no PUT zcopy over UCX's tcp transport: in 1.13 it trips an assertion
   *    that aborts the process when a connection breaks mid-transfer
   *    (seen here; ucx #4680); rendezvous over tcp then moves by messages;
   *  - shared memory takes part in client-server endpoints, which need
   *    error handling (peer failure), only with MM_ERROR_HANDLING
   *    (ucx #8477): without it two processes of one host talk TCP. */
  /*  - a rendezvous payload is fetched by the receiver (cma's
   *    process_vm_readv between processes of one host, an RDMA read with
   *    verbs): one copy, straight into its destination.
   * The last two only where shared memory may be in use (UCX warns about
   * MM settings without it). */
  bool shm = ucx_env_shm_possible();
  static const char *const defaults[][2] = {
      {"SOCKADDR_TLS_PRIORITY", "tcp"}, {"MM_ERROR_HANDLING", "y"}, {"RNDV_SCHEME", "get_zcopy"}};
  /* a transport's or connection manager's own setting is read from the
   * environment when it opens (ucp_config_modify does not reach it, and
   * keeps such keys in a cache it never frees): set once, only where the
   * user has not */
  pthread_once(&env_once, set_env_defaults);
  for (size_t i = 0; i < (shm ? 3u : 1u); i++) {
    char env[64];
    snprintf(env, sizeof(env), "UCX_%s", defaults[i][0]);
    if (!getenv(env)) (void)ucp_config_modify(cfg, defaults[i][0], defaults[i][1]);
  }
  if (net_devices && !getenv("UCX_NET_DEVICES"))
    (void)ucp_config_modify(cfg, "NET_DEVICES", net_devices);
  ucp_params_t cp = {.field_mask = UCP_PARAM_FIELD_FEATURES | UCP_PARAM_FIELD_NAME,
                     .features = UCP_FEATURE_AM | UCP_FEATURE_WAKEUP,
                     .name = "ps"};
  what = "ucp_init";
  s = ucp_init(&cp, cfg, &u->ctx);
  ucp_config_release(cfg);
  if (s != UCS_OK) goto fail;
  ucp_worker_params_t wp = {
      .field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE,
      .thread_mode = locked ? UCS_THREAD_MODE_SERIALIZED : UCS_THREAD_MODE_SINGLE};
  what = "ucp_worker_create";
  s = ucp_worker_create(u->ctx, &wp, &u->w);
  if (s != UCS_OK) goto fail;
  ucp_worker_attr_t wa = {.field_mask = UCP_WORKER_ATTR_FIELD_MAX_AM_HEADER};
  what = "ucp_worker_query";
  s = ucp_worker_query(u->w, &wa);
  if (s != UCS_OK) goto fail;
  u->max_head = wa.max_am_header > ULINK_SEQ_BYTES ? wa.max_am_header - ULINK_SEQ_BYTES : 0;
  ucp_am_handler_param_t ap = {
      .field_mask = UCP_AM_HANDLER_PARAM_FIELD_ID | UCP_AM_HANDLER_PARAM_FIELD_FLAGS |
                    UCP_AM_HANDLER_PARAM_FIELD_CB | UCP_AM_HANDLER_PARAM_FIELD_ARG,
      .id = AM_ID,
      /* not PERSISTENT_DATA: with it UCX fetches a rendezvous payload into
       * a buffer of its own before the callback, a copy more */
      .flags = UCP_AM_FLAG_WHOLE_MSG,
      .cb = on_am,
      .arg = u,
  };
  what = "ucp_worker_set_am_recv_handler";
  s = ucp_worker_set_am_recv_handler(u->w, &ap);
  if (s != UCS_OK) goto fail;
  *out = u;
  return 0;
fail:
  if (!strcmp(what, "ucp_init"))
    ucx_env_init_error(what, ucs_status_string(s), err, errlen);
  else
    snprintf(err, errlen, "UCX: %s failed: %s", what, ucs_status_string(s));
  ulink_free(u);
  return s == UCS_ERR_NO_DEVICE ? -EINVAL : status_errno(s) ? status_errno(s) : -EIO;
}

int ulink_new(bool locked, const struct ulink_cbs *cbs, struct ulink **out, char *err,
              size_t errlen) {
  return new_link(locked, NULL, cbs, out, err, errlen);
}

/* A loopback address: the UCX devices it can use are lo's (and memory). */
static bool loopback_host(const char *host) {
  return host && (!strcmp(host, "localhost") || !strncmp(host, "127.", 4) || !strcmp(host, "::1"));
}

int ulink_new_server(const char *host, const struct ulink_cbs *cbs, struct ulink **out, char *err,
                     size_t errlen) {
  return new_link(false, loopback_host(host) ? "lo" : NULL, cbs, out, err, errlen);
}

static void on_close_done(void *request, ucs_status_t status, void *user_data) {
  struct ulink_ep *e = user_data;
  (void)status;
  e->u->closing--;
  ucp_request_free(request);
  free(e);
}

/* Caller holds the lock. Drops e's undelivered frames and error. */
static void ep_purge(struct ulink_ep *e) {
  struct ulink *u = e->u;
  struct ev **p = &u->evq, *last = NULL;
  while (*p) {
    struct ev *ev = *p;
    if ((ev->type == EV_RX || ev->type == EV_ERR || ev->type == EV_CONN) && ev->ep == e) {
      *p = ev->next;
      if (ev->rx) release_rx(u, ev->rx);
      free(ev);
      continue;
    }
    last = ev;
    p = &ev->next;
  }
  u->evq_tail = last;
  while (e->early) {
    struct ulink_rx *n = e->early;
    e->early = n->next;
    release_rx(u, n);
  }
  e->n_early = 0;
}

static void ep_close_locked(struct ulink_ep *e, bool flush) {
  struct ulink *u = e->u;
  if (e->admitted) uguard_forget(u->guard, &e->peer_addr);
  ep_unlink(e);
  ep_purge(e);
  if (!e->ep) {
    free(e);
    return;
  }
  ucp_request_param_t p = {.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA,
                           .cb.send = on_close_done,
                           .user_data = e};
  if (!flush || e->failed) {
    p.op_attr_mask |= UCP_OP_ATTR_FIELD_FLAGS;
    p.flags = UCP_EP_CLOSE_FLAG_FORCE;
  }
  ucs_status_ptr_t r = ucp_ep_close_nbx(e->ep, &p);
  if (r == NULL || UCS_PTR_IS_ERR(r)) {
    free(e);
    return;
  }
  u->closing++;
}

void ulink_ep_close(struct ulink_ep *e, bool flush) {
  if (!e) return;
  struct ulink *u = e->u;
  lock(u);
  ep_close_locked(e, flush);
  unlock(u);
}

static unsigned deliver(struct ulink *u) {
  unsigned n = 0;
  for (;;) {
    lock(u);
    struct ev *ev = u->evq;
    if (ev) {
      u->evq = ev->next;
      if (!u->evq) u->evq_tail = NULL;
    }
    unlock(u);
    if (!ev) return n;
    n++;
    switch (ev->type) {
      case EV_RX:
        if (u->cbs.on_rx)
          u->cbs.on_rx(ev->rx, u->cbs.arg);
        else
          ulink_rx_free(u, ev->rx);
        break;
      case EV_DONE:
        free(ev->owned);
        ev->done(ev->arg, ev->status);
        break;
      case EV_CONN:
        if (u->cbs.on_conn)
          u->cbs.on_conn(ev->ep, ev->text, u->cbs.arg);
        else
          ulink_ep_close(ev->ep, false);
        break;
      case EV_ERR:
        if (u->cbs.on_error) u->cbs.on_error(ev->ep, ev->text, u->cbs.arg);
        break;
    }
    free(ev);
  }
}

void ulink_free(struct ulink *u) {
  if (!u) return;
  if (u->w) {
    lock(u);
    /* flushed, so the peers hear of it now rather than by a timeout */
    while (u->eps) ep_close_locked(u->eps, true);
    if (u->lis) ucp_listener_destroy(u->lis);
    u->lis = NULL;
    unlock(u);
    uguard_stop(u->guard);
    u->guard = NULL;
    /* the force-closes and cancelled operations finish inside progress */
    uint64_t until = clock_now_ns() + 1000000000u; /* a peer that hangs gets a second */
    while (u->closing && clock_now_ns() < until) {
      lock(u);
      ucp_worker_progress(u->w);
      unlock(u);
    }
    /* what they reported: sends and takes done (their owners free them) */
    u->cbs.on_rx = NULL;
    u->cbs.on_conn = NULL;
    u->cbs.on_error = NULL;
    deliver(u);
    ucp_worker_destroy(u->w);
  }
  if (u->ctx) ucp_cleanup(u->ctx);
  pthread_mutex_destroy(&u->mu);
  free(u);
}

int ulink_efd(struct ulink *u) {
  int fd = -1;
  lock(u);
  if (ucp_worker_get_efd(u->w, &fd) != UCS_OK) fd = -1;
  unlock(u);
  return fd;
}

unsigned ulink_progress(struct ulink *u) {
  /* the lock is taken per call, so senders get in between */
  for (unsigned n = 1; n;) {
    lock(u);
    n = ucp_worker_progress(u->w);
    if (!n) push_errors(u);
    unlock(u);
  }
  return deliver(u);
}

/* Waking a sleeping thread costs 70-80 us on these VMs, longer than a 4 KiB
 * request takes over shared memory, and a rendezvous pays it at each of its
 * steps: polling for a while first, yielding the CPU to any thread that
 * wants it between polls, made 1 MiB push and pull over shared memory 4x
 * faster, and S=2 W=2 training faster too (BENCHMARKS.md, issue 17). */
static bool poll_for_work(struct ulink *u) {
  uint64_t until = clock_now_ns() + u->poll_ns;
  while (clock_now_ns() < until) {
    lock(u);
    bool work = ucp_worker_progress(u->w) || u->evq;
    unlock(u);
    if (work) return true;
    sched_yield();
  }
  return false;
}

bool ulink_arm(struct ulink *u) {
  if (u->poll_ns && poll_for_work(u)) return false;
  lock(u);
  bool ok = !u->evq && ucp_worker_arm(u->w) == UCS_OK;
  unlock(u);
  return ok;
}

void ulink_signal(struct ulink *u) {
  ucp_worker_signal(u->w);
}

static int resolve(const char *host, uint16_t port, struct sockaddr_storage *ss, socklen_t *len,
                   char *err, size_t errlen) {
  struct addrinfo hints = {.ai_family = AF_UNSPEC, .ai_socktype = SOCK_STREAM}, *ai = NULL;
  char ps[8];
  snprintf(ps, sizeof(ps), "%u", (unsigned)port);
  int r = getaddrinfo(host && host[0] ? host : "0.0.0.0", ps, &hints, &ai);
  if (r != 0 || !ai) {
    snprintf(err, errlen, "cannot resolve %s: %s", host, gai_strerror(r));
    return -EHOSTUNREACH;
  }
  memcpy(ss, ai->ai_addr, ai->ai_addrlen);
  *len = ai->ai_addrlen;
  freeaddrinfo(ai);
  return 0;
}

int ulink_listen(struct ulink *u, const char *host, uint16_t port, uint16_t *bound, char *err,
                 size_t errlen) {
  struct sockaddr_storage ss;
  socklen_t len;
  int r = resolve(host, port, &ss, &len, err, errlen);
  if (r < 0) return r;
  ucp_listener_params_t p = {
      .field_mask = UCP_LISTENER_PARAM_FIELD_SOCK_ADDR | UCP_LISTENER_PARAM_FIELD_CONN_HANDLER,
      .sockaddr = {.addr = (struct sockaddr *)&ss, .addrlen = len},
      .conn_handler = {.cb = on_conn_request, .arg = u},
  };
  lock(u);
  ucs_status_t s = ucp_listener_create(u->w, &p, &u->lis);
  ucp_listener_attr_t a = {.field_mask = UCP_LISTENER_ATTR_FIELD_SOCKADDR};
  if (s == UCS_OK) s = ucp_listener_query(u->lis, &a);
  unlock(u);
  if (s != UCS_OK) {
    snprintf(err, errlen, "UCX cannot listen on %s:%u: %s", host, (unsigned)port,
             ucs_status_string(s));
    return s == UCS_ERR_BUSY ? -EADDRINUSE : status_errno(s);
  }
  r = uguard_start(&a.sockaddr, &u->guard);
  if (r < 0) {
    snprintf(err, errlen, "cannot start the UCX listener's guard: %s", strerror(-r));
    ulink_unlisten(u);
    return r;
  }
  if (bound)
    *bound =
        ntohs(a.sockaddr.ss_family == AF_INET6 ? ((struct sockaddr_in6 *)&a.sockaddr)->sin6_port
                                               : ((struct sockaddr_in *)&a.sockaddr)->sin_port);
  return 0;
}

void ulink_unlisten(struct ulink *u) {
  lock(u);
  if (u->lis) ucp_listener_destroy(u->lis);
  u->lis = NULL;
  unlock(u);
  uguard_stop(u->guard);
  u->guard = NULL;
}

uint64_t ulink_take_refused(struct ulink *u) {
  return uguard_take_refused(u->guard);
}

int ulink_connect(struct ulink *u, const char *host, uint16_t port, struct ulink_ep **out,
                  char *err, size_t errlen) {
  struct sockaddr_storage ss;
  socklen_t len;
  *out = NULL;
  int r = resolve(host, port, &ss, &len, err, errlen);
  if (r < 0) return r;
  lock(u);
  struct ulink_ep *e = ep_new(u);
  if (!e) {
    unlock(u);
    return -ENOMEM;
  }
  ucp_ep_params_t p = {
      .field_mask = UCP_EP_PARAM_FIELD_FLAGS | UCP_EP_PARAM_FIELD_SOCK_ADDR |
                    UCP_EP_PARAM_FIELD_ERR_HANDLER | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE,
      .flags = UCP_EP_PARAMS_FLAGS_CLIENT_SERVER,
      .sockaddr = {.addr = (struct sockaddr *)&ss, .addrlen = len},
      .err_mode = UCP_ERR_HANDLING_MODE_PEER,
      .err_handler = {.cb = on_ep_error, .arg = u},
  };
  ucs_status_t s = ucp_ep_create(u->w, &p, &e->ep);
  if (s != UCS_OK) {
    ep_unlink(e);
    free(e);
    unlock(u);
    snprintf(err, errlen, "UCX cannot connect to %s:%u: %s", host, (unsigned)port,
             ucs_status_string(s));
    return status_errno(s);
  }
  unlock(u);
  *out = e;
  return 0;
}

void ulink_ep_set_user(struct ulink_ep *e, void *user) {
  e->user = user;
}
void *ulink_ep_user(const struct ulink_ep *e) {
  return e->user;
}

/* The transports in ucp_ep_print_info's lane lines ("lane[0]:  1:posix/memory.0 ..."). */
const char *ulink_ep_transports(struct ulink_ep *e) {
  if (!e->ep) return e->tls;
  e->tls[0] = 0;
  char *buf = NULL;
  size_t n = 0;
  FILE *f = open_memstream(&buf, &n);
  if (!f) return e->tls;
  lock(e->u);
  ucp_ep_print_info(e->ep, f);
  unlock(e->u);
  fclose(f);
  size_t used = 0;
  for (char *line = buf ? strtok(buf, "\n") : NULL; line; line = strtok(NULL, "\n")) {
    char *l = strstr(line, "lane[");
    if (!l || !(l = strchr(l, ':'))) continue;
    l++;
    while (*l == ' ') l++;
    char *c = strchr(l, ':'), *slash = c ? strchr(c, '/') : NULL;
    if (!c || !slash || slash - c - 1 <= 0 || slash - c - 1 > 15) continue;
    char name[16];
    memcpy(name, c + 1, (size_t)(slash - c - 1));
    name[slash - c - 1] = 0;
    if (strstr(e->tls, name)) continue; /* each once */
    int w = snprintf(e->tls + used, sizeof(e->tls) - used, "%s%s", used ? "," : "", name);
    if (w < 0 || (size_t)w >= sizeof(e->tls) - used) break;
    used += (size_t)w;
  }
  free(buf);
  return e->tls;
}

static void on_op_done(void *request, ucs_status_t status, void *user_data) {
  struct ev *ev = user_data;
  struct ulink *u = ev->u;
  ev->status = status_errno(status);
  ucp_request_free(request);
  ev_push(u, ev);
}

static void on_recv_done(void *request, ucs_status_t status, size_t length, void *user_data) {
  (void)length;
  on_op_done(request, status, user_data);
}

int ulink_send(struct ulink_ep *e, const void *head, size_t head_len, const void *payload,
               uint64_t len, ulink_done_fn done, void *arg) {
  struct ulink *u = e->u;
  bool in_data = head_len > u->max_head;
  size_t am_head = ULINK_SEQ_BYTES + (in_data ? 4 : head_len);
  struct ev *ev = calloc(1, sizeof(*ev) + am_head);
  if (!ev) return -ENOMEM;
  if (in_data) { /* head || payload as the data, in a buffer freed once done */
    if (head_len > UINT32_MAX || !(ev->owned = malloc(head_len + len))) {
      free(ev);
      return -ENOMEM;
    }
    memcpy(ev->owned, head, head_len);
    if (len) memcpy((uint8_t *)ev->owned + head_len, payload, len);
    payload = ev->owned;
    len += head_len;
  }
  /* the AM header (seq || head) lives in the event until the send is done */
  uint8_t *h = (uint8_t *)(ev + 1);
  ev->type = EV_DONE;
  ev->done = done;
  ev->arg = arg;
  ev->u = u;
  lock(u);
  if (e->failed) {
    unlock(u);
    free(ev);
    return -ECONNRESET;
  }
  uint64_t seq = e->tx_seq | (in_data ? ULINK_LONG_HEAD : 0);
  for (int i = 0; i < ULINK_SEQ_BYTES; i++) h[i] = (uint8_t)(seq >> (8 * i));
  if (in_data)
    for (int i = 0; i < 4; i++) h[ULINK_SEQ_BYTES + i] = (uint8_t)(head_len >> (8 * i));
  else
    memcpy(h + ULINK_SEQ_BYTES, head, head_len);
  ucp_request_param_t p = {
      .op_attr_mask =
          UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FIELD_FLAGS,
      .flags = UCP_AM_SEND_FLAG_REPLY | (len >= u->rndv_bytes ? UCP_AM_SEND_FLAG_RNDV : 0),
      .cb.send = on_op_done,
      .user_data = ev};
  ucs_status_ptr_t r = ucp_am_send_nbx(e->ep, AM_ID, h, am_head, payload, len, &p);
  if (UCS_PTR_IS_ERR(r)) {
    unlock(u);
    free(ev->owned);
    free(ev);
    return status_errno(UCS_PTR_STATUS(r));
  }
  e->tx_seq++;
  u->st.frames_out++;
  u->st.bytes_out += am_head + len;
  unlock(u);
  if (r == NULL) { /* done at once */
    free(ev->owned);
    free(ev);
    done(arg, 0);
  } else if (u->locked) {
    ulink_signal(u); /* the progressing thread may be asleep on the event fd */
  }
  return 0;
}

int ulink_rx_take(struct ulink *u, struct ulink_rx *rx, void *dst, ulink_done_fn done, void *arg) {
  if (!rx->rndv) {
    if (rx->len && dst != rx->data) memcpy(dst, rx->data, rx->len);
    lock(u);
    release_rx(u, rx);
    unlock(u);
    done(arg, 0);
    return 0;
  }
  struct ev *ev = calloc(1, sizeof(*ev));
  if (!ev) {
    ulink_rx_free(u, rx);
    return -ENOMEM;
  }
  ev->type = EV_DONE;
  ev->done = done;
  ev->arg = arg;
  ev->u = u;
  ucp_request_param_t p = {.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA,
                           .cb.recv_am = on_recv_done,
                           .user_data = ev};
  lock(u);
  ucs_status_ptr_t r = ucp_am_recv_data_nbx(u->w, rx->data, dst, rx->len, &p);
  unlock(u);
  free(rx); /* UCX owns the descriptor now */
  if (UCS_PTR_IS_ERR(r)) {
    free(ev);
    return status_errno(UCS_PTR_STATUS(r));
  }
  if (r == NULL) {
    free(ev);
    done(arg, 0);
  }
  return 0;
}

struct ulink_rx *ulink_rx_from_buffer(struct ulink_ep *ep, uint8_t *buf, uint64_t len,
                                      uint32_t head_len) {
  struct ulink_rx *rx = head_len <= len ? calloc(1, sizeof(*rx) + head_len) : NULL;
  if (!rx) {
    free(buf);
    return NULL;
  }
  rx->ep = ep;
  rx->len = len - head_len;
  rx->owned = buf;
  rx->data = rx->len ? buf + head_len : NULL;
  rx->head_len = head_len;
  memcpy(rx->head, buf, head_len);
  return rx;
}

void ulink_rx_free(struct ulink *u, struct ulink_rx *rx) {
  if (!rx) return;
  lock(u);
  release_rx(u, rx);
  unlock(u);
}

size_t ulink_max_head(const struct ulink *u) {
  return u->max_head;
}

void ulink_stats(struct ulink *u, struct ulink_stats *out) {
  lock(u);
  *out = u->st;
  unlock(u);
}
