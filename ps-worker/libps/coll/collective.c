/* collective: the public API of the ring collectives (see collective.h): open
 * and close, the failure state, and the request queue. Forming the group is
 * rendezvous.c, liveness and control frames are watchdog.c, the data path is
 * ring.c; collective_impl.h says what they share and who calls whom.
 *
 * Failure state. The first failure anyone notices (the data path, the
 * watchdog, a report from rank 0) is recorded once under `mu` with the rank it
 * blames; `aborted` is then set and `abort_efd` written, which wakes a data
 * path asleep in poll (ring.c checks the flag) and the watchdog, which passes
 * the news on: rank 0 to every rank, other ranks to rank 0. Nothing is ever
 * retried on a failed group.
 *
 * Requests. Operations run on the caller's thread until the first
 * asynchronous call starts the worker thread; from then on every operation,
 * blocking or not, is queued under `mu` and the worker runs them one at a
 * time in the order they were queued, so the ring sees them in issue order. */
#include "collective.h"

#include <errno.h>
#include <stdint.h>
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

#include "auth.h"
#include "collective_impl.h"
#include "config.h"
#include "dtype.h"
#include "frame.h"
#include "hier.h"
#include "log.h"
#include "net.h"
#include "ring.h"
#include "token_impl.h"
#include "wire.h"

enum {
  CTRL_HEADER_MAX = 4096, /* the largest control frame header we accept */
  DEFAULT_PEER_TIMEOUT_MS = 10000,
  PAIRWISE_ALLTOALL_MIN = 128 * 1024, /* bytes per block */
};

struct ps_coll_request {
  struct ps_coll_request *next;
  ps_coll *c;
  struct coll_op op;
  bool done;
  ps_status status;
};

/* ---- failure state ---- */

/* Records the group's first failure. code is what propagate_failure sends:
 * ERR_PEER_LOST (the blamed rank is gone, nobody tells it), ERR_PROTOCOL
 * (ranks disagree: PS_ERR_STATE on every rank, not only where it was seen)
 * or ERR_AUTH (it sent something that failed authentication: it is alive and
 * is told too). */
static void coll_failv(ps_coll *c, ps_status st, int lost, Ps__ErrorCode code, const char *fmt,
                       va_list ap) {
  pthread_mutex_lock(&c->mu);
  if (!c->failed) {
    vsnprintf(c->msg, sizeof(c->msg), fmt, ap);
    c->failed = true;
    c->fail_status = st;
    c->fail_code = code;
    c->lost = lost;
    atomic_store_explicit(&c->aborted, 1, memory_order_release);
    uint64_t one = 1;
    if (write(c->abort_efd, &one, sizeof(one)) < 0) { /* the flag alone still stops the ring */
    }
    log_error("collective group failed", "lost_rank=%d error=\"%s\"", lost, c->msg);
  }
  pthread_mutex_unlock(&c->mu);
}

void coll_fail(ps_coll *c, ps_status st, int lost, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  coll_failv(c, st, lost,
             st == PS_ERR_STATE ? PS__ERROR_CODE__ERR_PROTOCOL : PS__ERROR_CODE__ERR_PEER_LOST, fmt,
             ap);
  va_end(ap);
}

void coll_fail_auth(ps_coll *c, int culprit, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  coll_failv(c, PS_ERR_IO, culprit, PS__ERROR_CODE__ERR_AUTH, fmt, ap);
  va_end(ap);
}

static ps_status failed_status(ps_coll *c) {
  pthread_mutex_lock(&c->mu);
  ps_status st = c->failed ? c->fail_status : PS_OK;
  pthread_mutex_unlock(&c->mu);
  return st;
}

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

/* The group's status after the ring failed with r (a negative errno from
 * ring.c): the ring's reason becomes the group's unless the group had
 * already failed (-ECANCELED: another rank's reason, which stands). */
static ps_status ring_failed(ps_coll *c, int r) {
  if (r == -ECONNRESET) {
    /* A neighbour hung up. If it failed for a reason (a mismatch, its own
     * lost neighbour), that reason is on its way through rank 0: prefer it
     * to "lost rank X" for a short while. A killed rank sends nothing. */
    struct pollfd pfd = {.fd = c->abort_efd, .events = POLLIN};
    if (!atomic_load(&c->aborted)) poll(&pfd, 1, GRACE_MS);
  }
  if (r == -EBADMSG) /* the sender is alive and hears why (propagate_failure) */
    coll_fail_auth(c, ring_lost_rank(c->ring), "%s", ring_errmsg(c->ring));
  else if (r != -ECANCELED)
    coll_fail(c, status_of(r), ring_lost_rank(c->ring), "%s", ring_errmsg(c->ring));
  ps_status st = failed_status(c);
  return st != PS_OK ? st : PS_ERR_IO;
}

ps_status ps_coll_status(ps_coll *c) {
  c = coll_job(c);
  return atomic_load_explicit(&c->aborted, memory_order_acquire) ? failed_status(c) : PS_OK;
}

const char *ps_coll_errmsg(ps_coll *c, char *buf, size_t len) {
  if (c->rank < 0 && ps_coll_status(c) == PS_OK) {
    not_member_msg(c, buf, len);
    return buf;
  }
  c = coll_job(c);
  pthread_mutex_lock(&c->mu);
  snprintf(buf, len, "%s", c->msg);
  pthread_mutex_unlock(&c->mu);
  return buf;
}

int ps_coll_lost_rank(ps_coll *c) {
  c = coll_job(c);
  pthread_mutex_lock(&c->mu);
  int r = c->failed ? c->lost : -1;
  pthread_mutex_unlock(&c->mu);
  return r;
}

/* A disagreement found by the caller rather than the ring: the same path
 * (ERR_PROTOCOL to every rank, PS_ERR_STATE everywhere), blaming nobody,
 * and abort_efd wakes an operation the ring is running. */
ps_status ps_coll_abort(ps_coll *c, const char *reason) {
  if (!c || !reason) return PS_ERR_INVALID;
  c = coll_job(c); /* a group's abort is the job's */
  coll_fail(c, PS_ERR_STATE, -1, "rank %d: %s", c->rank, reason);
  return PS_OK;
}

ps_status ps_coll_backend_parse(const char *s, ps_coll_backend *out, char *err, size_t errlen) {
  static const char *const names[] = {[PS_COLL_TCP] = "tcp", [PS_COLL_NCCL] = "nccl"};
  int i = config_choice(s, names, sizeof(names) / sizeof(names[0]), err, errlen);
  if (i < 0) return PS_ERR_INVALID;
  *out = (ps_coll_backend)i;
  return PS_OK;
}

int ps_coll_rank(const ps_coll *c) {
  return c->rank;
}
int ps_coll_world_size(const ps_coll *c) {
  return c->world;
}

/* ---- open / close ---- */

static void coll_free(ps_coll *c) {
  if (!c) return;
  hier_free(c->hier);
  ring_free(c->ring);
  if (c->prev_fd >= 0) close(c->prev_fd);
  if (c->next_fd >= 0) close(c->next_fd);
  auth_session_free(c->prev_auth);
  auth_session_free(c->next_auth);
  p2p_deinit(c);
  for (int i = 0; i < c->nctrl; i++) {
    if (c->ctrl[i].fd >= 0) close(c->ctrl[i].fd);
    auth_session_free(c->ctrl[i].auth);
    frame_decoder_deinit(&c->ctrl[i].dec);
    free(c->ctrl[i].out);
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
  c->has_p2p = o->p2p || o->node_first;
  c->prev_fd = c->next_fd = -1;
  c->lost = -1;
  c->peer_timeout_ms = o->peer_timeout_ms > 0 ? o->peer_timeout_ms : DEFAULT_PEER_TIMEOUT_MS;
  c->spin_ns = (uint64_t)(o->spin_us == 0  ? RING_DEFAULT_SPIN_US
                          : o->spin_us < 0 ? 0
                                           : o->spin_us) *
               1000u;
  c->token = token_auth(o->auth_token);
  snprintf(c->job, sizeof(c->job), "%s", o->job_id ? o->job_id : "");
  snprintf(c->node, sizeof(c->node), "%s", o->node ? o->node : ""); /* grid.c */
  pthread_mutex_init(&c->mu, NULL);
  pthread_cond_init(&c->queued, NULL);
  pthread_cond_init(&c->completed, NULL);
  c->abort_efd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  c->stop_efd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  ps_status st = PS_ERR_NOMEM;
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
    if ((o->p2p || o->node_first) && p2p_init(c) < 0) goto fail;
    st = rendezvous_run(c, o, err, errlen);
    if (st != PS_OK) goto fail;
    p2p_setup(c);
    for (int i = 0; i < c->nctrl; i++)
      if (c->ctrl[i].auth) frame_decoder_set_tag_len(&c->ctrl[i].dec, AUTH_TAG_BYTES);
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
                         .send_auth = c->next_auth,
                         .recv_auth = c->prev_auth,
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
  if (c->world > 1 && watchdog_start(c) < 0) {
    snprintf(err, errlen, "cannot start the watchdog thread");
    st = PS_ERR_NOMEM;
    goto fail;
  }
  if (c->world > 1 && o->node_first) {
    r = hier_new(c, o->node, &c->hier);
    if (r < 0) {
      /* the group fails as an operation would: every rank hears why, and a
       * rank still here when another rank's later call failed the group
       * (it finished the exchange first) names that call's reason */
      char why[sizeof(c->msg)];
      if (r == -ENOMEM && !ring_errmsg(c->ring)[0]) {
        st = PS_ERR_NOMEM;
        snprintf(why, sizeof(why), "%s", strerror(ENOMEM));
      } else {
        st = ring_failed(c, r);
        ps_coll_errmsg(c, why, sizeof(why));
      }
      snprintf(err, errlen, "cannot exchange the node names: %s", why);
      goto fail;
    }
  }
  *out = c;
  return PS_OK;
fail:
  watchdog_stop(c); /* passes a failure on first */
  coll_free(c);
  return st;
}

static void *worker_main(void *arg);

void ps_coll_close(ps_coll *c) {
  if (!c) return;
  if (c->job_group) { /* a group: the last one closed frees a closed job group */
    ps_coll *job = c->job_group;
    group_free(c);
    pthread_mutex_lock(&job->mu);
    bool last = --job->open_groups == 0 && job->closed;
    pthread_mutex_unlock(&job->mu);
    if (last) coll_free(job);
    return;
  }
  if (c->worker_started) {
    pthread_mutex_lock(&c->mu);
    c->stopping = true;
    pthread_cond_broadcast(&c->queued);
    pthread_mutex_unlock(&c->mu);
    pthread_join(c->worker, NULL);
  }
  watchdog_stop(c);
  if (c->next_fd >= 0) shutdown(c->next_fd, SHUT_WR);
  pthread_mutex_lock(&c->mu);
  int open = c->open_groups;
  c->closed = true;
  pthread_mutex_unlock(&c->mu);
  if (open > 0) {
    log_warn("the job group closed before its groups",
             "job_rank=%d open_groups=%d hint=\"close every group (ps_coll_split, ps_grid_free) "
             "first; their operations now fail with PS_ERR_STATE\"",
             c->rank, open);
    return; /* the last group's close frees it */
  }
  coll_free(c);
}

/* ---- operations ---- */

static ps_status run_op(ps_coll *c, const struct coll_op *o) {
  ps_status st = failed_status(c);
  if (st != PS_OK) return st;
  if (o->group) return group_run(o->group, o);
  int r;
  float token = 0;
  enum ring_redop op = (enum ring_redop)o->redop; /* the same numbers (collective.h) */
  enum dtype dt = (enum dtype)o->dtype;           /* likewise */
  switch (o->kind) {
    case REQ_ALLREDUCE:
      if (c->hier && o->count) {
        r = ring_agree(c->ring, RING_NODE_ALLREDUCE, o->count, dt, op);
        if (r == 0) return hier_allreduce(c, c->hier, o->buf, o->count, dt, op);
        break;
      }
      r = ring_allreduce(c->ring, o->buf, o->count, dt, op);
      break;
    case REQ_BROADCAST:
      r = ring_broadcast(c->ring, o->buf, o->count, o->root);
      break;
    case REQ_ALLGATHER:
      r = ring_allgather(c->ring, o->src, o->buf, o->count);
      break;
    case REQ_REDUCE_SCATTER:
      r = ring_reduce_scatter(c->ring, o->src, o->buf, o->count, dt, op);
      break;
    case REQ_REDUCE:
      r = ring_reduce(c->ring, o->buf, o->count, dt, op, o->root);
      break;
    case REQ_ALLTOALL:
      /* pairwise: W-1 blocks per link, not W(W-1)/2; its W-1 steps cost more
       * than the ring's pipeline below 128 KiB blocks (BENCHMARKS.md) */
      if (c->p2p && o->count && (c->world == 2 || o->count >= PAIRWISE_ALLTOALL_MIN)) {
        r = ring_agree(c->ring, RING_PAIRWISE_ALLTOALL, o->count, DTYPE_FLOAT32, RING_SUM);
        if (r == 0) return p2p_alltoall(c, o->src, o->buf, o->count);
        break;
      }
      r = ring_alltoall(c->ring, o->src, o->buf, o->count);
      break;
    case REQ_SENDRECV:
      return p2p_run(c, o->src, o->count, o->root, o->buf, o->rcount, o->from);
    default:
      r = ring_allreduce(c->ring, &token, 1, DTYPE_FLOAT32, RING_SUM);
      break;
  }
  if (r == 0) return PS_OK;
  if (r == -EINVAL && !ring_errmsg(c->ring)[0]) return PS_ERR_INVALID; /* nothing was sent */
  return ring_failed(c, r);
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
    ps_status st = run_op(c, &q->op);
    pthread_mutex_lock(&c->mu);
    q->status = st;
    q->done = true;
    pthread_cond_broadcast(&c->completed);
  }
  pthread_mutex_unlock(&c->mu);
  return NULL;
}

static ps_status submit(ps_coll *c, const struct coll_op *o, ps_coll_request **out) {
  ps_coll_request *q = calloc(1, sizeof(*q));
  if (!q) return PS_ERR_NOMEM;
  *q = (ps_coll_request){.c = c, .op = *o};
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

/* Runs o now (no worker thread yet), or through the queue behind what is
 * queued; with req, queues it and returns at once. */
static ps_status issue(ps_coll *c, const struct coll_op *o, ps_coll_request **req) {
  struct coll_op on_group;
  if (c->job_group) { /* a group's operations run on the job group's thread */
    on_group = *o;
    on_group.group = c;
    o = &on_group;
    c = c->job_group;
    pthread_mutex_lock(&c->mu);
    bool closed = c->closed;
    pthread_mutex_unlock(&c->mu);
    if (closed) return PS_ERR_STATE; /* its thread and connections are gone */
  }
  if (req) return submit(c, o, req);
  if (!c->worker_started) return run_op(c, o);
  ps_coll_request *q;
  ps_status st = submit(c, o, &q);
  return st == PS_OK ? ps_coll_wait(q) : st;
}

static bool redop_ok(enum ps_redop op) {
  return op == PS_REDOP_SUM || op == PS_REDOP_AVG || op == PS_REDOP_MAX || op == PS_REDOP_MIN;
}

/* Arguments every rank can check alone (PS_ERR_INVALID), and a group this
 * rank is not in (PS_ERR_STATE); what needs W (sizes) is each call's. */
static ps_status args_status(ps_coll *c, bool has_req, ps_coll_request **req) {
  if (!c || (has_req && !req)) return PS_ERR_INVALID;
  return c->rank < 0 ? PS_ERR_STATE : PS_OK;
}

/* A reduction's type and op, checked on the caller's side. */
static bool reduction_ok(ps_dtype dt, enum ps_redop op) {
  return redop_ok(op) && dtype_size((int)dt) != 0;
}

static ps_status allreduce(ps_coll *c, void *buf, size_t count, ps_dtype dt, enum ps_redop op,
                           ps_coll_request **req, bool has_req) {
  ps_status st = args_status(c, has_req, req);
  if (st != PS_OK) return st;
  if (!reduction_ok(dt, op) || (count && !buf) || count > SIZE_MAX / 2 / dtype_size((int)dt))
    return PS_ERR_INVALID;
  struct coll_op o = {
      .kind = REQ_ALLREDUCE, .buf = buf, .count = count, .dtype = (int)dt, .redop = (int)op};
  return issue(c, &o, req);
}

ps_status ps_coll_allreduce(ps_coll *c, float *buf, size_t count, enum ps_redop op) {
  return allreduce(c, buf, count, PS_DTYPE_FLOAT32, op, NULL, false);
}

ps_status ps_coll_allreduce_async(ps_coll *c, float *buf, size_t count, enum ps_redop op,
                                  ps_coll_request **req) {
  return allreduce(c, buf, count, PS_DTYPE_FLOAT32, op, req, true);
}

ps_status ps_coll_allreduce_typed(ps_coll *c, void *buf, size_t count, ps_dtype dtype,
                                  enum ps_redop op) {
  return allreduce(c, buf, count, dtype, op, NULL, false);
}

ps_status ps_coll_allreduce_typed_async(ps_coll *c, void *buf, size_t count, ps_dtype dtype,
                                        enum ps_redop op, ps_coll_request **req) {
  return allreduce(c, buf, count, dtype, op, req, true);
}

static ps_status broadcast(ps_coll *c, void *buf, size_t bytes, int root, ps_coll_request **req,
                           bool has_req) {
  ps_status st = args_status(c, has_req, req);
  if (st != PS_OK) return st;
  if (root < 0 || root >= c->world || (bytes && !buf)) return PS_ERR_INVALID;
  struct coll_op o = {.kind = REQ_BROADCAST, .buf = buf, .count = bytes, .root = root};
  return issue(c, &o, req);
}

ps_status ps_coll_broadcast(ps_coll *c, void *buf, size_t bytes, int root) {
  return broadcast(c, buf, bytes, root, NULL, false);
}

ps_status ps_coll_broadcast_async(ps_coll *c, void *buf, size_t bytes, int root,
                                  ps_coll_request **req) {
  return broadcast(c, buf, bytes, root, req, true);
}

ps_status ps_coll_barrier(ps_coll *c) {
  ps_status st = args_status(c, false, NULL);
  if (st != PS_OK) return st;
  struct coll_op o = {.kind = REQ_BARRIER};
  return issue(c, &o, NULL);
}

static ps_status allgather(ps_coll *c, const void *send, void *recv, size_t bytes,
                           ps_coll_request **req, bool has_req) {
  ps_status st = args_status(c, has_req, req);
  if (st != PS_OK) return st;
  if ((bytes && (!send || !recv)) || bytes > SIZE_MAX / 2 / (size_t)c->world) return PS_ERR_INVALID;
  struct coll_op o = {.kind = REQ_ALLGATHER, .buf = recv, .src = send, .count = bytes};
  return issue(c, &o, req);
}

ps_status ps_coll_allgather(ps_coll *c, const void *send, void *recv, size_t bytes) {
  return allgather(c, send, recv, bytes, NULL, false);
}

ps_status ps_coll_allgather_async(ps_coll *c, const void *send, void *recv, size_t bytes,
                                  ps_coll_request **req) {
  return allgather(c, send, recv, bytes, req, true);
}

static ps_status reduce_scatter(ps_coll *c, const void *send, void *recv, size_t count, ps_dtype dt,
                                enum ps_redop op, ps_coll_request **req, bool has_req) {
  ps_status st = args_status(c, has_req, req);
  if (st != PS_OK) return st;
  if (!reduction_ok(dt, op) || (count && (!send || !recv)) ||
      count > SIZE_MAX / 2 / dtype_size((int)dt) / (size_t)c->world)
    return PS_ERR_INVALID;
  const char *s = send, *d = recv;
  size_t mine = count * dtype_size((int)dt), all = (size_t)c->world * mine;
  bool in_place = d == s + (size_t)c->rank * mine;
  if (count && !in_place && d < s + all && s < d + mine) return PS_ERR_INVALID;
  struct coll_op o = {.kind = REQ_REDUCE_SCATTER,
                      .buf = recv,
                      .src = send,
                      .count = count,
                      .dtype = (int)dt,
                      .redop = (int)op};
  return issue(c, &o, req);
}

ps_status ps_coll_reduce_scatter(ps_coll *c, const float *send, float *recv, size_t count,
                                 enum ps_redop op) {
  return reduce_scatter(c, send, recv, count, PS_DTYPE_FLOAT32, op, NULL, false);
}

ps_status ps_coll_reduce_scatter_async(ps_coll *c, const float *send, float *recv, size_t count,
                                       enum ps_redop op, ps_coll_request **req) {
  return reduce_scatter(c, send, recv, count, PS_DTYPE_FLOAT32, op, req, true);
}

ps_status ps_coll_reduce_scatter_typed(ps_coll *c, const void *send, void *recv, size_t count,
                                       ps_dtype dtype, enum ps_redop op) {
  return reduce_scatter(c, send, recv, count, dtype, op, NULL, false);
}

ps_status ps_coll_reduce_scatter_typed_async(ps_coll *c, const void *send, void *recv, size_t count,
                                             ps_dtype dtype, enum ps_redop op,
                                             ps_coll_request **req) {
  return reduce_scatter(c, send, recv, count, dtype, op, req, true);
}

static ps_status reduce(ps_coll *c, void *buf, size_t count, ps_dtype dt, enum ps_redop op,
                        int root, ps_coll_request **req, bool has_req) {
  ps_status st = args_status(c, has_req, req);
  if (st != PS_OK) return st;
  if (!reduction_ok(dt, op) || root < 0 || root >= c->world || (count && !buf) ||
      count > SIZE_MAX / 2 / dtype_size((int)dt))
    return PS_ERR_INVALID;
  struct coll_op o = {.kind = REQ_REDUCE,
                      .buf = buf,
                      .count = count,
                      .dtype = (int)dt,
                      .redop = (int)op,
                      .root = root};
  return issue(c, &o, req);
}

ps_status ps_coll_reduce(ps_coll *c, float *buf, size_t count, enum ps_redop op, int root) {
  return reduce(c, buf, count, PS_DTYPE_FLOAT32, op, root, NULL, false);
}

ps_status ps_coll_reduce_async(ps_coll *c, float *buf, size_t count, enum ps_redop op, int root,
                               ps_coll_request **req) {
  return reduce(c, buf, count, PS_DTYPE_FLOAT32, op, root, req, true);
}

ps_status ps_coll_reduce_typed(ps_coll *c, void *buf, size_t count, ps_dtype dtype,
                               enum ps_redop op, int root) {
  return reduce(c, buf, count, dtype, op, root, NULL, false);
}

ps_status ps_coll_reduce_typed_async(ps_coll *c, void *buf, size_t count, ps_dtype dtype,
                                     enum ps_redop op, int root, ps_coll_request **req) {
  return reduce(c, buf, count, dtype, op, root, req, true);
}

const char *ps_dtype_name(ps_dtype dtype) {
  return dtype_size((int)dtype) ? dtype_name((int)dtype) : NULL;
}

size_t ps_dtype_size(ps_dtype dtype) {
  return dtype_size((int)dtype);
}

static ps_status alltoall(ps_coll *c, const void *send, void *recv, size_t bytes,
                          ps_coll_request **req, bool has_req) {
  ps_status st = args_status(c, has_req, req);
  if (st != PS_OK) return st;
  if ((bytes && (!send || !recv)) || bytes > SIZE_MAX / 2 / (size_t)c->world / (size_t)c->world)
    return PS_ERR_INVALID;
  const char *s = send, *d = recv;
  size_t all = (size_t)c->world * bytes;
  if (bytes && d < s + all && s < d + all) return PS_ERR_INVALID; /* no in-place all-to-all */
  struct coll_op o = {.kind = REQ_ALLTOALL, .buf = recv, .src = send, .count = bytes};
  return issue(c, &o, req);
}

ps_status ps_coll_alltoall(ps_coll *c, const void *send, void *recv, size_t bytes) {
  return alltoall(c, send, recv, bytes, NULL, false);
}

ps_status ps_coll_alltoall_async(ps_coll *c, const void *send, void *recv, size_t bytes,
                                 ps_coll_request **req) {
  return alltoall(c, send, recv, bytes, req, true);
}

/* dst or src -1: that half is not done; neither may be this rank or out of
 * range, and the group must have its point-to-point connections. */
static ps_status sendrecv(ps_coll *c, const void *send, size_t send_bytes, int dst, void *recv,
                          size_t recv_bytes, int src, ps_coll_request **req, bool has_req) {
  ps_status st = args_status(c, has_req, req);
  if (st != PS_OK) return st;
  if (dst >= c->world || src >= c->world || dst < -1 || src < -1 || dst == c->rank ||
      src == c->rank || (dst >= 0 && send_bytes && !send) || (src >= 0 && recv_bytes && !recv))
    return PS_ERR_INVALID;
  if (!coll_job(c)->p2p) return PS_ERR_STATE;
  struct coll_op o = {.kind = REQ_SENDRECV,
                      .src = send,
                      .count = dst >= 0 ? send_bytes : 0,
                      .root = dst,
                      .buf = recv,
                      .rcount = src >= 0 ? recv_bytes : 0,
                      .from = src};
  return issue(c, &o, req);
}

ps_status ps_coll_send(ps_coll *c, const void *buf, size_t bytes, int peer) {
  return sendrecv(c, buf, bytes, peer < 0 ? INT32_MAX : peer, NULL, 0, -1, NULL, false);
}

ps_status ps_coll_recv(ps_coll *c, void *buf, size_t bytes, int peer) {
  return sendrecv(c, NULL, 0, -1, buf, bytes, peer < 0 ? INT32_MAX : peer, NULL, false);
}

ps_status ps_coll_sendrecv(ps_coll *c, const void *send, size_t send_bytes, int dst, void *recv,
                           size_t recv_bytes, int src) {
  return sendrecv(c, send, send_bytes, dst, recv, recv_bytes, src, NULL, false);
}

ps_status ps_coll_send_async(ps_coll *c, const void *buf, size_t bytes, int peer,
                             ps_coll_request **req) {
  return sendrecv(c, buf, bytes, peer < 0 ? INT32_MAX : peer, NULL, 0, -1, req, true);
}

ps_status ps_coll_recv_async(ps_coll *c, void *buf, size_t bytes, int peer, ps_coll_request **req) {
  return sendrecv(c, NULL, 0, -1, buf, bytes, peer < 0 ? INT32_MAX : peer, req, true);
}

ps_status ps_coll_sendrecv_async(ps_coll *c, const void *send, size_t send_bytes, int dst,
                                 void *recv, size_t recv_bytes, int src, ps_coll_request **req) {
  return sendrecv(c, send, send_bytes, dst, recv, recv_bytes, src, req, true);
}
