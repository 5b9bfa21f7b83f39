/* collective: rendezvous, liveness and the public API of the ring
 * collectives (see collective.h; the data path is ring.c).
 *
 * Failure state. The first failure anyone notices (the data path, the
 * watchdog, a report from rank 0) is recorded once under `mu` with the rank it
 * blames; `aborted` is then set and `abort_efd` written, which wakes a data
 * path asleep in poll (ring.c checks the flag) and the watchdog, which passes
 * the news on: rank 0 to every rank, other ranks to rank 0. Nothing is ever
 * retried on a failed group.
 *
 * Watchdog (one thread, asleep in poll between events): owns the control
 * sockets. Every beat_ms it writes a heartbeat on each; a peer silent for
 * peer_timeout_ms, or whose socket closes without a SHUTDOWN first, is lost.
 * Rank 0 watches ranks 1..W-1; the others watch rank 0. A SHUTDOWN frame
 * marks an orderly leave (ps_coll_close), after which silence is expected.
 *
 * Control frames use the common framing (proto/ps.proto): HEARTBEAT,
 * SHUTDOWN, and ERROR with code PEER_LOST, Header.rank = the lost rank and
 * the reason as text. */
#include "collective.h"

#include <errno.h>
#include <inttypes.h>
#include <poll.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include "frame.h"
#include "log.h"
#include "net.h"
#include "ring.h"
#include "wire.h"

enum { KIND_RING = 1, KIND_CTRL = 2 };
enum {
  HELLO_WAIT_MS = 5000, /* an accepted connection must say hello by then */
  GRACE_MS = 200,       /* failure paths: how long to wait for explanations */
  CTRL_HEADER_MAX = 4096,
  FRAME_BUF = 1024,
  DEFAULT_CONNECT_MS = 60000,
  DEFAULT_PEER_TIMEOUT_MS = 10000,
};
#define CLIENT_NAME "ps-ring"

enum req_kind { REQ_ALLREDUCE, REQ_BROADCAST, REQ_BARRIER };

struct ps_coll_request {
  struct ps_coll_request *next;
  ps_coll *c;
  enum req_kind kind;
  void *buf;
  size_t count;
  int arg; /* redop or root */
  bool done;
  ps_status status;
};

struct ctrl_peer {
  int fd, rank;
  bool left;
  uint64_t last_ns;
  struct frame_decoder dec;
};

struct ps_coll {
  int rank, world;
  char job[256];
  int peer_timeout_ms;
  int prev_fd, next_fd;
  struct ring *ring;
  struct ctrl_peer *ctrl; /* rank 0: ranks 1..W-1; others: rank 0 */
  int nctrl;

  pthread_mutex_t mu; /* failure state and the request queue */
  atomic_int aborted;
  int abort_efd, stop_efd;
  bool failed;
  ps_status fail_status;
  int lost;
  char msg[640];

  pthread_t watchdog;
  bool watchdog_started;

  pthread_t worker;
  bool worker_started, stopping;
  pthread_cond_t queued, completed;
  struct ps_coll_request *head, *tail;
};

/* ---- failure state ---- */

static void coll_fail(ps_coll *c, ps_status st, int lost, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
static void coll_fail(ps_coll *c, ps_status st, int lost, const char *fmt, ...) {
  pthread_mutex_lock(&c->mu);
  if (!c->failed) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(c->msg, sizeof(c->msg), fmt, ap);
    va_end(ap);
    c->failed = true;
    c->fail_status = st;
    c->lost = lost;
    atomic_store_explicit(&c->aborted, 1, memory_order_release);
    uint64_t one = 1;
    if (write(c->abort_efd, &one, sizeof(one)) < 0) { /* the flag alone still stops the ring */
    }
    log_error("collective group failed", "lost_rank=%d error=\"%s\"", lost, c->msg);
  }
  pthread_mutex_unlock(&c->mu);
}

static ps_status failed_status(ps_coll *c) {
  pthread_mutex_lock(&c->mu);
  ps_status st = c->failed ? c->fail_status : PS_OK;
  pthread_mutex_unlock(&c->mu);
  return st;
}

ps_status ps_coll_status(ps_coll *c) {
  return atomic_load_explicit(&c->aborted, memory_order_acquire) ? failed_status(c) : PS_OK;
}

const char *ps_coll_errmsg(ps_coll *c, char *buf, size_t len) {
  pthread_mutex_lock(&c->mu);
  snprintf(buf, len, "%s", c->msg);
  pthread_mutex_unlock(&c->mu);
  return buf;
}

int ps_coll_lost_rank(ps_coll *c) {
  pthread_mutex_lock(&c->mu);
  int r = c->failed ? c->lost : -1;
  pthread_mutex_unlock(&c->mu);
  return r;
}

int ps_coll_rank(const ps_coll *c) {
  return c->rank;
}
int ps_coll_world_size(const ps_coll *c) {
  return c->world;
}

/* ---- frames ---- */

static int send_frame(int fd, const wire_header *h) {
  uint8_t buf[FRAME_BUF];
  int n = wire_frame_encode(h, 0, buf, sizeof(buf));
  if (n < 0) return n;
  return net_write_all(fd, buf, (size_t)n);
}

/* Reads exactly len bytes before deadline_ns; -ETIMEDOUT, -ECONNRESET at EOF. */
static int read_deadline(int fd, void *buf, size_t len, uint64_t deadline_ns) {
  char *p = buf;
  while (len > 0) {
    uint64_t now = net_now_ns();
    if (now >= deadline_ns) return -ETIMEDOUT;
    struct pollfd pfd = {.fd = fd, .events = POLLIN};
    uint64_t left_ms = (deadline_ns - now + 999999u) / 1000000u;
    int pr = poll(&pfd, 1, left_ms > INT32_MAX ? -1 : (int)left_ms);
    if (pr < 0 && errno != EINTR) return -errno;
    if (pr <= 0) continue;
    ssize_t n = recv(fd, p, len, MSG_DONTWAIT);
    if (n == 0) return -ECONNRESET;
    if (n < 0) {
      if (errno == EINTR || errno == EAGAIN || errno == EWOULDBLOCK) continue;
      return -errno;
    }
    p += n;
    len -= (size_t)n;
  }
  return 0;
}

/* Reads one header-only frame. Returns 0, -EBADMSG (not our protocol; why
 * says more), -ETIMEDOUT or a socket error. */
static int recv_frame(int fd, struct wire_arena *a, uint8_t *hbuf, uint64_t deadline_ns,
                      wire_header **out, char *why, size_t whylen) {
  uint8_t pre[FRAME_PREAMBLE_BYTES];
  int r = read_deadline(fd, pre, sizeof(pre), deadline_ns);
  if (r < 0) return r;
  struct frame_limits lim = {.max_header = CTRL_HEADER_MAX, .max_payload = 0};
  struct frame_preamble p;
  r = frame_preamble_decode(pre, &lim, &p);
  if (r < 0) {
    snprintf(why, whylen, "%s", frame_strerror(r));
    return -EBADMSG;
  }
  r = read_deadline(fd, hbuf, p.header_len, deadline_ns);
  if (r < 0) return r;
  if (wire_header_unpack(a, hbuf, p.header_len, out) < 0) {
    snprintf(why, whylen, "undecodable header");
    return -EBADMSG;
  }
  return 0;
}

static int send_hello(int fd, const ps_coll *c, int to, int kind) {
  wire_header h = PS__HEADER__INIT;
  Ps__Hello hello = PS__HELLO__INIT;
  hello.rank = (uint32_t)c->rank;
  hello.world_size = (uint32_t)c->world;
  hello.job_id = (char *)c->job;
  hello.client = CLIENT_NAME;
  h.type = PS__MSG_TYPE__MSG_HELLO;
  h.rank = (uint32_t)c->rank;
  h.key = (uint64_t)to;
  h.flags = (uint32_t)kind;
  h.body_case = PS__HEADER__BODY_HELLO;
  h.hello = &hello;
  return send_frame(fd, &h);
}

static int send_error(int fd, Ps__ErrorCode code, int rank, const char *msg) {
  wire_header h = PS__HEADER__INIT;
  Ps__Error e = PS__ERROR__INIT;
  e.code = code;
  e.message = (char *)msg;
  h.type = PS__MSG_TYPE__MSG_ERROR;
  h.rank = rank < 0 ? UINT32_MAX : (uint32_t)rank; /* UINT32_MAX: nobody in particular */
  h.body_case = PS__HEADER__BODY_ERROR;
  h.error = &e;
  return send_frame(fd, &h);
}

static int send_simple(int fd, Ps__MsgType type, int rank) {
  wire_header h = PS__HEADER__INIT;
  h.type = type;
  h.rank = (uint32_t)rank;
  return send_frame(fd, &h);
}

/* ---- rendezvous ---- */

struct rendezvous {
  ps_coll *c;
  const struct ps_coll_opts *o;
  int listen_fd;
  uint64_t deadline_ns; /* UINT64_MAX = none */
  struct wire_arena arena;
  uint8_t hbuf[CTRL_HEADER_MAX];
  int ctrl0_fd; /* rank > 0: control connection to rank 0 */
  bool next_acked, ctrl0_acked;
  char refused[400]; /* the last stranger we turned away, for the timeout message */
};

/* Checks an incoming hello; on refusal writes the reason into why. */
static int check_hello(struct rendezvous *z, const wire_header *h, int *from, int *kind, char *why,
                       size_t n) {
  ps_coll *c = z->c;
  if (h->type != PS__MSG_TYPE__MSG_HELLO || h->body_case != PS__HEADER__BODY_HELLO) {
    snprintf(why, n, "expected a hello, got %s", wire_type_name(h->type));
    return -1;
  }
  const Ps__Hello *hl = h->hello;
  if (!hl->client || strcmp(hl->client, CLIENT_NAME) != 0) {
    snprintf(why, n,
             "this is the ring port of worker rank %d, not a parameter server (client \"%.64s\")",
             c->rank, hl->client ? hl->client : "");
    return -1;
  }
  if (strcmp(hl->job_id ? hl->job_id : "", c->job) != 0) {
    snprintf(why, n, "job id \"%.100s\" differs from rank %d's \"%.100s\"", hl->job_id, c->rank,
             c->job);
    return -1;
  }
  if ((int)hl->world_size != c->world) {
    snprintf(why, n, "world size %u differs from rank %d's %d", hl->world_size, c->rank, c->world);
    return -1;
  }
  if (h->key != (uint64_t)c->rank) {
    snprintf(why, n, "rank %u addressed rank %" PRIu64 " but reached rank %d (peer list order?)",
             hl->rank, h->key, c->rank);
    return -1;
  }
  *from = (int)hl->rank;
  *kind = (int)h->flags;
  int prev = (c->rank + c->world - 1) % c->world;
  if (*kind == KIND_RING) {
    if (*from != prev) {
      snprintf(why, n, "rank %d connected as the ring predecessor of rank %d, expected rank %d",
               *from, c->rank, prev);
      return -1;
    }
    if (c->prev_fd >= 0) {
      snprintf(why, n, "rank %d is already connected (a second process with the same rank?)",
               *from);
      return -1;
    }
    return 0;
  }
  if (*kind == KIND_CTRL && c->rank == 0) {
    if (*from < 1 || *from >= c->world) {
      snprintf(why, n, "rank %d is outside [1, %d)", *from, c->world);
      return -1;
    }
    if (c->ctrl[*from - 1].fd >= 0) {
      snprintf(why, n,
               "rank %d already has a control connection (a second process with the "
               "same rank?)",
               *from);
      return -1;
    }
    return 0;
  }
  snprintf(why, n, "unexpected connection kind %d for rank %d", *kind, c->rank);
  return -1;
}

static int remaining_ms(const struct rendezvous *z) {
  if (z->deadline_ns == UINT64_MAX) return -1;
  uint64_t now = net_now_ns();
  return now >= z->deadline_ns ? 0 : (int)((z->deadline_ns - now + 999999u) / 1000000u);
}

static ps_status connect_peer(struct rendezvous *z, int to, int kind, int *fd_out, char *err,
                              size_t errlen) {
  struct net_addr a;
  char why[400];
  if (net_parse_addr(z->o->peers[to], &a, 0, why, sizeof(why)) < 0) {
    snprintf(err, errlen, "peer address of rank %d: %s", to, why);
    return PS_ERR_INVALID;
  }
  struct net_backoff bo = {.initial_ms = 50, .max_ms = 1000, .deadline_ms = remaining_ms(z)};
  if (bo.deadline_ms == 0) bo.deadline_ms = 1; /* one try */
  int fd = net_connect(&a, &bo, why, sizeof(why));
  if (fd < 0) {
    snprintf(err, errlen, "cannot reach rank %d at %s: %s", to, z->o->peers[to], why);
    return PS_ERR_CONNECT;
  }
  if (send_hello(fd, z->c, to, kind) < 0) {
    snprintf(err, errlen, "rank %d at %s closed the connection before the hello", to,
             z->o->peers[to]);
    close(fd);
    return PS_ERR_CONNECT;
  }
  *fd_out = fd;
  return PS_OK;
}

static ps_status await_ack(struct rendezvous *z, int fd, int to, char *err, size_t errlen) {
  wire_header *h;
  char why[200] = "";
  int r = recv_frame(fd, &z->arena, z->hbuf, z->deadline_ns, &h, why, sizeof(why));
  if (r == -ETIMEDOUT) {
    snprintf(err, errlen, "rank %d at %s accepted but did not answer the hello in time", to,
             z->o->peers[to]);
    return PS_ERR_CONNECT;
  }
  if (r == -EBADMSG) {
    snprintf(err, errlen, "%s (rank %d's address) does not speak the ps protocol: %s",
             z->o->peers[to], to, why);
    return PS_ERR_REMOTE;
  }
  if (r < 0) {
    snprintf(err, errlen, "rank %d at %s closed the connection during the hello: %s", to,
             z->o->peers[to], strerror(-r));
    return PS_ERR_CONNECT;
  }
  if (h->type == PS__MSG_TYPE__MSG_ACK) return PS_OK;
  if (h->type == PS__MSG_TYPE__MSG_ERROR && h->body_case == PS__HEADER__BODY_ERROR) {
    snprintf(err, errlen, "the peer at %s (rank %d's address) refused this rank: %s",
             z->o->peers[to], to, h->error->message ? h->error->message : "?");
    return PS_ERR_REMOTE;
  }
  snprintf(err, errlen, "rank %d at %s answered the hello with %s", to, z->o->peers[to],
           wire_type_name(h->type));
  return PS_ERR_REMOTE;
}

static void describe_missing(const ps_coll *c, char *out, size_t n) {
  size_t len = 0;
  out[0] = 0;
  if (c->prev_fd < 0)
    len +=
        (size_t)snprintf(out + len, n - len, "rank %d (ring)", (c->rank + c->world - 1) % c->world);
  for (int i = 0; i < c->nctrl && c->rank == 0 && len < n; i++)
    if (c->ctrl[i].fd < 0)
      len += (size_t)snprintf(out + len, n - len, "%srank %d (control)", len ? ", " : "",
                              c->ctrl[i].rank);
}

static ps_status accept_peers(struct rendezvous *z, char *err, size_t errlen) {
  ps_coll *c = z->c;
  for (;;) {
    bool complete = c->prev_fd >= 0;
    for (int i = 0; c->rank == 0 && i < c->nctrl; i++) complete = complete && c->ctrl[i].fd >= 0;
    if (complete) return PS_OK;
    int wait = remaining_ms(z);
    if (wait == 0) {
      char missing[300];
      describe_missing(c, missing, sizeof(missing));
      snprintf(err, errlen, "rendezvous timed out: %s never connected to rank %d%s%s", missing,
               c->rank, z->refused[0] ? "; refused: " : "", z->refused);
      return z->refused[0] ? PS_ERR_REMOTE : PS_ERR_CONNECT;
    }
    /* Our own hellos may be answered meanwhile: a refusal ends the wait at
     * once instead of at the deadline. */
    struct pollfd pfd[3] = {{.fd = z->listen_fd, .events = POLLIN},
                            {.fd = z->next_acked ? -1 : c->next_fd, .events = POLLIN},
                            {.fd = z->ctrl0_acked ? -1 : z->ctrl0_fd, .events = POLLIN}};
    int pr = poll(pfd, 3, wait);
    if (pr < 0 && errno != EINTR) {
      snprintf(err, errlen, "poll on the listening socket: %s", strerror(errno));
      return PS_ERR_CONNECT;
    }
    if (pr <= 0) continue;
    if (pfd[1].revents) {
      ps_status st = await_ack(z, c->next_fd, (c->rank + 1) % c->world, err, errlen);
      if (st != PS_OK) return st;
      z->next_acked = true;
    }
    if (pfd[2].revents) {
      ps_status st = await_ack(z, z->ctrl0_fd, 0, err, errlen);
      if (st != PS_OK) return st;
      z->ctrl0_acked = true;
    }
    if (!(pfd[0].revents & POLLIN)) continue;
    char peer[80];
    int fd = net_accept(z->listen_fd, peer, sizeof(peer));
    if (fd < 0) continue;
    wire_header *h;
    char why[300] = "";
    uint64_t hello_deadline = net_now_ns() + (uint64_t)HELLO_WAIT_MS * 1000000u;
    if (hello_deadline > z->deadline_ns) hello_deadline = z->deadline_ns;
    int r = recv_frame(fd, &z->arena, z->hbuf, hello_deadline, &h, why, sizeof(why));
    int from = -1, kind = 0;
    if (r == 0 && check_hello(z, h, &from, &kind, why, sizeof(why)) == 0) {
      wire_header ack = PS__HEADER__INIT;
      ack.type = PS__MSG_TYPE__MSG_ACK;
      ack.rank = (uint32_t)c->rank;
      if (send_frame(fd, &ack) < 0) {
        close(fd);
        continue;
      }
      if (kind == KIND_RING)
        c->prev_fd = fd;
      else
        c->ctrl[from - 1].fd = fd;
      continue;
    }
    if (r == 0) {
      send_error(fd, PS__ERROR_CODE__ERR_BAD_RANK, c->rank, why);
    } else if (r != -EBADMSG) {
      snprintf(why, sizeof(why), "no hello (%s)", r == -ETIMEDOUT ? "timed out" : strerror(-r));
    }
    snprintf(z->refused, sizeof(z->refused), "%s: %s", peer, why);
    log_warn("refused a ring connection", "peer=%s reason=\"%s\"", peer, why);
    close(fd);
  }
}

/* The rendezvous failed here: tell whoever is still waiting in our backlog
 * why (their own mismatch if their hello has one, else our error) rather
 * than leaving them a bare reset. Stops after GRACE_MS without a caller. */
static void refuse_pending(struct rendezvous *z, const char *why_we_fail) {
  ps_coll *c = z->c;
  for (;;) {
    struct pollfd pfd = {.fd = z->listen_fd, .events = POLLIN};
    if (poll(&pfd, 1, GRACE_MS) <= 0) return;
    int fd = net_accept(z->listen_fd, NULL, 0);
    if (fd < 0) return;
    wire_header *h;
    char why[300] = "", msg[600];
    uint64_t deadline = net_now_ns() + (uint64_t)GRACE_MS * 1000000u;
    int from, kind;
    if (recv_frame(fd, &z->arena, z->hbuf, deadline, &h, why, sizeof(why)) == 0) {
      if (check_hello(z, h, &from, &kind, why, sizeof(why)) == 0)
        snprintf(msg, sizeof(msg), "rank %d cannot join: %s", c->rank, why_we_fail);
      else
        snprintf(msg, sizeof(msg), "%s", why);
      send_error(fd, PS__ERROR_CODE__ERR_PROTOCOL, c->rank, msg);
    }
    close(fd);
  }
}

static ps_status rendezvous_steps(struct rendezvous *z, char *err, size_t errlen);

static ps_status rendezvous(struct rendezvous *z, char *err, size_t errlen) {
  ps_status st = rendezvous_steps(z, err, errlen);
  if (st != PS_OK) refuse_pending(z, err);
  return st;
}

static ps_status rendezvous_steps(struct rendezvous *z, char *err, size_t errlen) {
  ps_coll *c = z->c;
  int next = (c->rank + 1) % c->world;
  ps_status st = connect_peer(z, next, KIND_RING, &c->next_fd, err, errlen);
  if (st != PS_OK) return st;
  if (c->rank != 0) {
    st = connect_peer(z, 0, KIND_CTRL, &z->ctrl0_fd, err, errlen);
    if (st != PS_OK) return st;
  }
  st = accept_peers(z, err, errlen);
  if (st != PS_OK) return st;
  if (!z->next_acked && (st = await_ack(z, c->next_fd, next, err, errlen)) != PS_OK) return st;
  if (c->rank != 0) {
    if (!z->ctrl0_acked && (st = await_ack(z, z->ctrl0_fd, 0, err, errlen)) != PS_OK) return st;
    c->ctrl[0].fd = z->ctrl0_fd;
    z->ctrl0_fd = -1;
  }
  return PS_OK;
}

/* ---- watchdog ---- */

static void ctrl_send_all(ps_coll *c, Ps__MsgType type) {
  for (int i = 0; i < c->nctrl; i++)
    if (c->ctrl[i].fd >= 0 && !c->ctrl[i].left) send_simple(c->ctrl[i].fd, type, c->rank);
}

/* Passes a failure on: rank 0 to every rank, the others to rank 0. */
static void propagate_failure(ps_coll *c) {
  pthread_mutex_lock(&c->mu);
  int lost = c->lost;
  char msg[sizeof(c->msg)];
  snprintf(msg, sizeof(msg), "%s", c->msg);
  pthread_mutex_unlock(&c->mu);
  for (int i = 0; i < c->nctrl; i++)
    if (c->ctrl[i].fd >= 0 && !c->ctrl[i].left && c->ctrl[i].rank != lost)
      send_error(c->ctrl[i].fd, PS__ERROR_CODE__ERR_PEER_LOST, lost, msg);
}

/* A frame from control peer p. */
static void on_ctrl_frame(ps_coll *c, struct ctrl_peer *p, const wire_header *h) {
  if (h->type == PS__MSG_TYPE__MSG_SHUTDOWN) {
    p->left = true;
  } else if (h->type == PS__MSG_TYPE__MSG_ERROR && h->body_case == PS__HEADER__BODY_ERROR) {
    const char *m = h->error->message ? h->error->message : "";
    int lost = h->rank == UINT32_MAX ? -1 : (int)h->rank;
    if (c->rank == 0)
      coll_fail(c, PS_ERR_IO, lost, "rank %d reports: %s", p->rank, m);
    else
      coll_fail(c, PS_ERR_IO, lost, "%s (reported by rank 0)", m);
  }
  /* HEARTBEAT and anything newer: proof of life only */
}

/* Reads what p has; returns false once p is gone. */
static bool ctrl_read(ps_coll *c, struct ctrl_peer *p, struct wire_arena *a) {
  uint8_t buf[4096];
  for (;;) {
    ssize_t n = recv(p->fd, buf, sizeof(buf), MSG_DONTWAIT);
    if (n == 0 || (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR)) {
      if (!p->left)
        coll_fail(c, PS_ERR_IO, p->rank,
                  "lost rank %d: its control connection %s (process exited or was killed?)",
                  p->rank, n == 0 ? "closed" : strerror(errno));
      return false;
    }
    if (n < 0) return true;
    p->last_ns = net_now_ns();
    size_t off = 0;
    while (off < (size_t)n) {
      size_t used = 0;
      int ev = frame_decoder_feed(&p->dec, buf + off, (size_t)n - off, &used);
      off += used;
      if (ev < 0) {
        coll_fail(c, PS_ERR_IO, p->rank, "rank %d sent a bad control frame: %s", p->rank,
                  frame_strerror(ev));
        return false;
      }
      if (ev == FRAME_HEADER) {
        wire_header *h = NULL;
        int ok = wire_header_unpack(a, frame_decoder_header(&p->dec),
                                    frame_decoder_header_len(&p->dec), &h);
        ev = frame_decoder_set_payload(&p->dec, NULL);
        if (ok == 0) on_ctrl_frame(c, p, h);
      }
      if (ev == FRAME_DONE) frame_decoder_reset(&p->dec);
    }
  }
}

static void *watchdog_main(void *arg) {
  ps_coll *c = arg;
  struct wire_arena arena;
  if (wire_arena_init(&arena, 64 * 1024) < 0) return NULL;
  const uint64_t timeout_ns = (uint64_t)c->peer_timeout_ms * 1000000u;
  uint64_t beat_ns = timeout_ns / 4;
  if (beat_ns > 1000000000u) beat_ns = 1000000000u;
  if (beat_ns < 10000000u) beat_ns = 10000000u;
  struct pollfd *pfd = calloc((size_t)c->nctrl + 2, sizeof(*pfd));
  int *who = calloc((size_t)c->nctrl + 2, sizeof(int));
  uint64_t next_beat = 0;
  bool propagated = false;
  for (int i = 0; i < c->nctrl; i++) c->ctrl[i].last_ns = net_now_ns();
  while (pfd && who) {
    uint64_t now = net_now_ns();
    if (now >= next_beat) {
      ctrl_send_all(c, PS__MSG_TYPE__MSG_HEARTBEAT);
      next_beat = now + beat_ns;
    }
    for (int i = 0; i < c->nctrl; i++) {
      struct ctrl_peer *p = &c->ctrl[i];
      if (p->fd >= 0 && !p->left && now - p->last_ns > timeout_ns)
        coll_fail(c, PS_ERR_IO, p->rank,
                  "lost rank %d: silent for %d ms (stopped, hung or "
                  "unreachable)",
                  p->rank, c->peer_timeout_ms);
    }
    if (atomic_load(&c->aborted) && !propagated) {
      propagate_failure(c);
      propagated = true;
    }
    int n = 0;
    pfd[n] = (struct pollfd){.fd = c->stop_efd, .events = POLLIN};
    who[n++] = -1;
    if (!propagated) {
      pfd[n] = (struct pollfd){.fd = c->abort_efd, .events = POLLIN};
      who[n++] = -2;
    }
    for (int i = 0; i < c->nctrl; i++) {
      if (c->ctrl[i].fd < 0 || c->ctrl[i].left) continue;
      pfd[n] = (struct pollfd){.fd = c->ctrl[i].fd, .events = POLLIN};
      who[n++] = i;
    }
    int wait = (int)((next_beat - now + 999999u) / 1000000u);
    if (poll(pfd, (nfds_t)n, wait) < 0 && errno != EINTR) break;
    if (pfd[0].revents & POLLIN) { /* ps_coll_close: a failure still goes out first */
      if (atomic_load(&c->aborted) && !propagated) propagate_failure(c);
      break;
    }
    for (int k = 1; k < n; k++) {
      if (who[k] < 0 || !pfd[k].revents) continue;
      struct ctrl_peer *p = &c->ctrl[who[k]];
      if (!ctrl_read(c, p, &arena)) {
        close(p->fd);
        p->fd = -1;
      }
    }
  }
  free(pfd);
  free(who);
  wire_arena_deinit(&arena);
  return NULL;
}

/* ---- open / close ---- */

static ps_status open_listener(const struct ps_coll_opts *o, int *fd_out, char *err,
                               size_t errlen) {
  if (o->listen_fd > 0) {
    *fd_out = o->listen_fd;
    return PS_OK;
  }
  struct net_addr a;
  char why[400];
  if (o->listen_addr && o->listen_addr[0]) {
    if (net_parse_addr(o->listen_addr, &a, 0, why, sizeof(why)) < 0) {
      snprintf(err, errlen, "listen address: %s", why);
      return PS_ERR_INVALID;
    }
  } else {
    if (net_parse_addr(o->peers[o->rank], &a, 0, why, sizeof(why)) < 0) {
      snprintf(err, errlen, "peer address of rank %d (this rank): %s", o->rank, why);
      return PS_ERR_INVALID;
    }
    snprintf(a.host, sizeof(a.host), "0.0.0.0");
  }
  int fd = net_listen(&a, SOMAXCONN, why, sizeof(why));
  if (fd < 0) {
    snprintf(err, errlen, "cannot listen for ring peers: %s", why);
    return fd == -EADDRINUSE ? PS_ERR_CONNECT : PS_ERR_INVALID;
  }
  *fd_out = fd;
  return PS_OK;
}

static void coll_free(ps_coll *c) {
  if (!c) return;
  ring_free(c->ring);
  if (c->prev_fd >= 0) close(c->prev_fd);
  if (c->next_fd >= 0) close(c->next_fd);
  for (int i = 0; i < c->nctrl; i++) {
    if (c->ctrl[i].fd >= 0) close(c->ctrl[i].fd);
    frame_decoder_deinit(&c->ctrl[i].dec);
  }
  free(c->ctrl);
  if (c->abort_efd >= 0) close(c->abort_efd);
  if (c->stop_efd >= 0) close(c->stop_efd);
  pthread_mutex_destroy(&c->mu);
  pthread_cond_destroy(&c->queued);
  pthread_cond_destroy(&c->completed);
  free(c);
}

ps_status ps_coll_open(const struct ps_coll_opts *o, ps_coll **out, char *err, size_t errlen) {
  *out = NULL;
  if (!o || o->world_size < 1 || o->rank < 0 || o->rank >= o->world_size ||
      (o->world_size > 1 && !o->peers)) {
    snprintf(err, errlen, "bad collective options: rank %d, world size %d%s", o ? o->rank : -1,
             o ? o->world_size : 0, o && o->world_size > 1 && !o->peers ? ", no peer list" : "");
    return PS_ERR_INVALID;
  }
  for (int i = 0; o->world_size > 1 && i < o->world_size; i++) {
    struct net_addr a;
    char why[400];
    if (!o->peers[i] || net_parse_addr(o->peers[i], &a, 0, why, sizeof(why)) < 0) {
      snprintf(err, errlen, "peer address of rank %d: %s", i, o->peers[i] ? why : "missing");
      return PS_ERR_INVALID;
    }
  }
  ps_coll *c = calloc(1, sizeof(*c));
  if (!c) return PS_ERR_NOMEM;
  c->rank = o->rank;
  c->world = o->world_size;
  c->prev_fd = c->next_fd = -1;
  c->lost = -1;
  c->peer_timeout_ms = o->peer_timeout_ms > 0 ? o->peer_timeout_ms : DEFAULT_PEER_TIMEOUT_MS;
  snprintf(c->job, sizeof(c->job), "%s", o->job_id ? o->job_id : "");
  pthread_mutex_init(&c->mu, NULL);
  pthread_cond_init(&c->queued, NULL);
  pthread_cond_init(&c->completed, NULL);
  c->abort_efd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  c->stop_efd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  ps_status st = PS_ERR_NOMEM;
  struct rendezvous z = {.c = c, .o = o, .listen_fd = -1, .ctrl0_fd = -1};
  bool arena = false;
  if (c->abort_efd < 0 || c->stop_efd < 0) {
    snprintf(err, errlen, "eventfd: %s", strerror(errno));
    goto fail;
  }
  if (c->world > 1) {
    c->nctrl = c->rank == 0 ? c->world - 1 : 1;
    c->ctrl = calloc((size_t)c->nctrl, sizeof(*c->ctrl));
    if (!c->ctrl) goto fail;
    struct frame_limits lim = {.max_header = CTRL_HEADER_MAX, .max_payload = 0};
    for (int i = 0; i < c->nctrl; i++) {
      c->ctrl[i].fd = -1;
      c->ctrl[i].rank = c->rank == 0 ? i + 1 : 0;
      if (frame_decoder_init(&c->ctrl[i].dec, &lim) < 0) goto fail;
    }
    if (wire_arena_init(&z.arena, 64 * 1024) < 0) goto fail;
    arena = true;
    int cto = o->connect_timeout_ms == 0 ? DEFAULT_CONNECT_MS : o->connect_timeout_ms;
    z.deadline_ns = cto < 0 ? UINT64_MAX : net_now_ns() + (uint64_t)cto * 1000000u;
    st = open_listener(o, &z.listen_fd, err, errlen);
    if (st != PS_OK) goto fail;
    st = rendezvous(&z, err, errlen);
    if (st != PS_OK) goto fail;
    int fds[2] = {c->prev_fd, c->next_fd};
    for (int i = 0; i < 2; i++) net_set_user_timeout(fds[i], c->peer_timeout_ms);
    for (int i = 0; i < c->nctrl; i++) {
      net_set_user_timeout(c->ctrl[i].fd, c->peer_timeout_ms);
      net_set_nonblocking(c->ctrl[i].fd, 1);
    }
  }
  if (c->world == 1 && o->listen_fd > 0) close(o->listen_fd); /* taken over, not needed */
  struct ring_opts ro = {.rank = c->rank,
                         .world_size = c->world,
                         .prev_fd = c->prev_fd,
                         .next_fd = c->next_fd,
                         .abort_fd = c->abort_efd,
                         .abort_flag = &c->aborted,
                         .slice_bytes = o->slice_bytes,
                         .small_bytes = o->small_bytes,
                         .round_bytes = o->round_bytes,
                         .spin_us = o->spin_us == 0  ? -1
                                    : o->spin_us < 0 ? 0
                                                     : o->spin_us};
  int r = ring_new(&ro, &c->ring);
  if (r < 0) {
    snprintf(err, errlen, "cannot set up the ring: %s", strerror(-r));
    st = r == -ENOMEM ? PS_ERR_NOMEM : PS_ERR_INVALID;
    goto fail;
  }
  if (c->world > 1) {
    if (pthread_create(&c->watchdog, NULL, watchdog_main, c) != 0) {
      snprintf(err, errlen, "cannot start the watchdog thread");
      st = PS_ERR_NOMEM;
      goto fail;
    }
    c->watchdog_started = true;
  }
  if (z.listen_fd >= 0) close(z.listen_fd);
  if (arena) wire_arena_deinit(&z.arena);
  *out = c;
  return PS_OK;
fail:
  if (z.ctrl0_fd >= 0) close(z.ctrl0_fd);
  if (z.listen_fd >= 0) close(z.listen_fd);
  if (arena) wire_arena_deinit(&z.arena);
  coll_free(c);
  return st;
}

static void *worker_main(void *arg);

void ps_coll_close(ps_coll *c) {
  if (!c) return;
  if (c->worker_started) {
    pthread_mutex_lock(&c->mu);
    c->stopping = true;
    pthread_cond_broadcast(&c->queued);
    pthread_mutex_unlock(&c->mu);
    pthread_join(c->worker, NULL);
  }
  if (c->watchdog_started) {
    uint64_t one = 1;
    if (write(c->stop_efd, &one, sizeof(one)) < 0) { /* cannot fail on a fresh eventfd */
    }
    pthread_join(c->watchdog, NULL);
    ctrl_send_all(c, PS__MSG_TYPE__MSG_SHUTDOWN);
  }
  if (c->next_fd >= 0) shutdown(c->next_fd, SHUT_WR);
  coll_free(c);
}

/* ---- operations ---- */

static ps_status status_of(int r) {
  switch (r) {
    case -EPROTO:
      return PS_ERR_STATE;
    case -ENOMEM:
      return PS_ERR_NOMEM;
    case -EINVAL:
      return PS_ERR_INVALID;
    default:
      return PS_ERR_IO;
  }
}

static ps_status run_op(ps_coll *c, enum req_kind kind, void *buf, size_t count, int arg) {
  ps_status st = failed_status(c);
  if (st != PS_OK) return st;
  int r;
  float token = 0;
  switch (kind) {
    case REQ_ALLREDUCE:
      r = ring_allreduce(c->ring, buf, count, arg == PS_REDOP_AVG ? RING_AVG : RING_SUM);
      break;
    case REQ_BROADCAST:
      r = ring_broadcast(c->ring, buf, count, arg);
      break;
    default:
      r = ring_allreduce(c->ring, &token, 1, RING_SUM);
      break;
  }
  if (r == 0) return PS_OK;
  if (r == -EINVAL && !ring_errmsg(c->ring)[0]) return PS_ERR_INVALID; /* nothing was sent */
  if (r == -ECONNRESET) {
    /* A neighbour hung up. If it failed for a reason (a mismatch, its own
     * lost neighbour), that reason is on its way through rank 0: prefer it
     * to "lost rank X" for a short while. A killed rank sends nothing. */
    struct pollfd pfd = {.fd = c->abort_efd, .events = POLLIN};
    if (!atomic_load(&c->aborted)) poll(&pfd, 1, GRACE_MS);
  }
  if (r != -ECANCELED)
    coll_fail(c, status_of(r), ring_lost_rank(c->ring), "%s", ring_errmsg(c->ring));
  st = failed_status(c);
  return st != PS_OK ? st : PS_ERR_IO;
}

static void *worker_main(void *arg) {
  ps_coll *c = arg;
  pthread_mutex_lock(&c->mu);
  for (;;) {
    while (!c->head && !c->stopping) pthread_cond_wait(&c->queued, &c->mu);
    struct ps_coll_request *q = c->head;
    if (!q) break; /* stopping and drained */
    c->head = q->next;
    if (!c->head) c->tail = NULL;
    pthread_mutex_unlock(&c->mu);
    ps_status st = run_op(c, q->kind, q->buf, q->count, q->arg);
    pthread_mutex_lock(&c->mu);
    q->status = st;
    q->done = true;
    pthread_cond_broadcast(&c->completed);
  }
  pthread_mutex_unlock(&c->mu);
  return NULL;
}

static ps_status submit(ps_coll *c, enum req_kind kind, void *buf, size_t count, int arg,
                        ps_coll_request **out) {
  ps_coll_request *q = calloc(1, sizeof(*q));
  if (!q) return PS_ERR_NOMEM;
  *q = (ps_coll_request){.c = c, .kind = kind, .buf = buf, .count = count, .arg = arg};
  pthread_mutex_lock(&c->mu);
  if (!c->worker_started) {
    if (pthread_create(&c->worker, NULL, worker_main, c) != 0) {
      pthread_mutex_unlock(&c->mu);
      free(q);
      return PS_ERR_NOMEM;
    }
    c->worker_started = true;
  }
  if (c->tail)
    c->tail->next = q;
  else
    c->head = q;
  c->tail = q;
  pthread_cond_signal(&c->queued);
  pthread_mutex_unlock(&c->mu);
  *out = q;
  return PS_OK;
}

ps_status ps_coll_wait(ps_coll_request *q) {
  if (!q) return PS_ERR_INVALID;
  ps_coll *c = q->c;
  pthread_mutex_lock(&c->mu);
  while (!q->done) pthread_cond_wait(&c->completed, &c->mu);
  ps_status st = q->status;
  pthread_mutex_unlock(&c->mu);
  free(q);
  return st;
}

static ps_status blocking(ps_coll *c, enum req_kind kind, void *buf, size_t count, int arg) {
  if (!c->worker_started) return run_op(c, kind, buf, count, arg);
  ps_coll_request *q;
  ps_status st = submit(c, kind, buf, count, arg, &q);
  return st == PS_OK ? ps_coll_wait(q) : st;
}

ps_status ps_coll_allreduce(ps_coll *c, float *buf, size_t count, enum ps_redop op) {
  if (!c || (op != PS_REDOP_SUM && op != PS_REDOP_AVG) || (count && !buf)) return PS_ERR_INVALID;
  return blocking(c, REQ_ALLREDUCE, buf, count, (int)op);
}

ps_status ps_coll_broadcast(ps_coll *c, void *buf, size_t bytes, int root) {
  if (!c || root < 0 || root >= c->world || (bytes && !buf)) return PS_ERR_INVALID;
  return blocking(c, REQ_BROADCAST, buf, bytes, root);
}

ps_status ps_coll_barrier(ps_coll *c) {
  if (!c) return PS_ERR_INVALID;
  return blocking(c, REQ_BARRIER, NULL, 0, 0);
}

ps_status ps_coll_allreduce_async(ps_coll *c, float *buf, size_t count, enum ps_redop op,
                                  ps_coll_request **req) {
  if (!c || !req || (op != PS_REDOP_SUM && op != PS_REDOP_AVG) || (count && !buf))
    return PS_ERR_INVALID;
  return submit(c, REQ_ALLREDUCE, buf, count, (int)op, req);
}
