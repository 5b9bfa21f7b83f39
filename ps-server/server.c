/* server: the shard's loop, handlers and lifecycle (see server.h; the
 * connections themselves are conn.c, server_impl.h says who owns what).
 * Messages dispatch through a table of handlers indexed by type. */
#include "server.h"

#include <errno.h>
#include <inttypes.h>
#include <signal.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>
#include <uv.h>

#include "auth.h"
#include "ckpt.h"
#include "ckpt_writer.h"
#include "frame.h"
#include "handshake.h"
#include "listener.h"
#include "log.h"
#include "shard_http.h"
#include "store.h"
#include "tensor_math.h"
#include "wire.h"
#include "server_impl.h"

#define DRAIN_TIMEOUT_MS 10000

typedef void (*handler_fn)(struct conn *c, const wire_header *h, const void *payload);

/* ---- sending ---------------------------------------------------------- */

/* ---- closing ---------------------------------------------------------- */

/* ERR_ROLLBACK: the request is behind-the-shard's-state; version = the
 * clock the job must roll back to. */
static void send_rollback(struct conn *c, uint64_t request_id, uint64_t clock, const char *msg) {
  wire_header h = PS__HEADER__INIT;
  Ps__Error err = PS__ERROR__INIT;
  h.type = PS__MSG_TYPE__MSG_ERROR;
  h.request_id = request_id;
  h.version = clock;
  err.code = PS__ERROR_CODE__ERR_ROLLBACK;
  err.message = (char *)msg;
  h.body_case = PS__HEADER__BODY_ERROR;
  h.error = &err;
  conn_send(c, &h, NULL);
}

static void on_grace_timeout(uv_timer_t *t);

/* Unlinks c from everything that may still point at it. */
void server_conn_detach(struct conn *c) {
  struct server *s = c->srv;
  store_drop_waiters(&s->store, c);
  if (s->barrier && c->has_rank && s->barrier[c->rank].c == c) {
    s->barrier[c->rank].c = NULL;
    s->barrier_arrived--;
  }
  if (c->has_rank && --s->rank_conns[c->rank] == 0) s->rank_left_ms[c->rank] = uv_now(&s->loop);
  if (c->prev)
    c->prev->next = c->next;
  else if (s->conns == c)
    s->conns = c->next;
  if (c->next) c->next->prev = c->prev;
  c->prev = c->next = NULL;
  s->num_conns--;
  if (s->stopping && s->num_conns == 0 && uv_is_active((uv_handle_t *)&s->grace))
    on_grace_timeout(&s->grace);
}

/* Rejects the client: one error frame naming the problem, then close. */

/* ---- handlers --------------------------------------------------------- */

/* The client is who it says (authenticated, or nobody checks): take the
 * rank it claimed in HELLO. The frame limits rise once this frame is done
 * (conn_finish_upgrade). */
static void accept_worker(struct conn *c, const wire_header *h) {
  struct server *s = c->srv;
  if (c->hello_world != s->opts.num_workers) {
    conn_fail(c, PS__ERROR_CODE__ERR_BAD_RANK,
              "worker says world size %" PRIu32
              ", this shard was started with --num-workers %" PRIu32,
              c->hello_world, s->opts.num_workers);
    return;
  }
  if (c->hello_rank >= s->opts.num_workers) {
    conn_fail(c, PS__ERROR_CODE__ERR_BAD_RANK, "rank %" PRIu32 " is outside [0, %" PRIu32 ")",
              c->hello_rank, s->opts.num_workers);
    return;
  }
  c->has_rank = true;
  c->rank = c->hello_rank;
  c->state = CONN_READY;
  s->rank_conns[c->rank]++;
  log_info("worker connected", "peer=%s rank=%" PRIu32 " authenticated=%d", c->peer, c->rank,
           c->sess != NULL);
  if (store_is_gone(&s->store, c->rank)) {
    store_worker_back(&s->store, c->rank);
    log_warn("worker rejoined", "rank=%" PRIu32 " clock=%" PRIu64 " live_workers=%" PRIu32, c->rank,
             store_worker_clock(&s->store, c->rank), s->opts.num_workers - s->store.num_gone);
  }
  conn_ack(c, h, 0);
}

static void handle_hello(struct conn *c, const wire_header *h, const void *payload) {
  (void)payload;
  if (h->body_case != PS__HEADER__BODY_HELLO) {
    conn_fail(c, PS__ERROR_CODE__ERR_PROTOCOL, "hello without a hello body");
    return;
  }
  if (c->state != CONN_HELLO) { /* one rank per connection: the liveness count relies on it */
    conn_fail(c, PS__ERROR_CODE__ERR_PROTOCOL, "hello twice on one connection");
    return;
  }
  c->hello_rank = h->hello->rank;
  c->hello_world = h->hello->world_size;
  Ps__Auth auth;
  char err[300];
  int r = hs_acceptor_on_hello(&c->hs, frame_decoder_header(&c->dec),
                               frame_decoder_header_len(&c->dec), h, &auth, err, sizeof(err));
  if (r < 0) {
    conn_auth_fail(c, err);
    return;
  }
  if (r == 0) {
    accept_worker(c, h);
    return;
  }
  c->state = CONN_AUTH;
  wire_header rep = PS__HEADER__INIT;
  rep.type = PS__MSG_TYPE__MSG_AUTH;
  rep.request_id = h->request_id;
  rep.body_case = PS__HEADER__BODY_AUTH;
  rep.auth = &auth;
  conn_send(c, &rep, NULL);
}

/* The worker's proof: from here on every frame both ways carries a tag. */
static void handle_auth(struct conn *c, const wire_header *h, const void *payload) {
  (void)payload;
  char err[300];
  if (c->state != CONN_AUTH) {
    conn_fail(c, PS__ERROR_CODE__ERR_PROTOCOL, "auth message out of order");
    return;
  }
  if (hs_acceptor_on_auth(&c->hs, h, err, sizeof(err)) < 0) {
    conn_auth_fail(c, err);
    return;
  }
  c->sess = hs_take_session(&c->hs);
  frame_decoder_set_tag_len(&c->dec, AUTH_TAG_BYTES);
  accept_worker(c, h);
}

static void handle_layout(struct conn *c, const wire_header *h, const void *payload) {
  struct server *s = c->srv;
  (void)payload;
  if (h->body_case != PS__HEADER__BODY_LAYOUT) {
    conn_fail(c, PS__ERROR_CODE__ERR_PROTOCOL, "layout message without a layout body");
    return;
  }
  const Ps__Layout *pl = h->layout;
  struct store_layout l = {0};
  char msg[400] = "";
  int r = -ENOMEM;
  l.num_tensors = (uint32_t)pl->n_tensors;
  l.names = calloc(pl->n_tensors ? pl->n_tensors : 1, sizeof(char *));
  l.counts = calloc(pl->n_tensors ? pl->n_tensors : 1, sizeof(uint64_t));
  if (!l.names || !l.counts) goto out;
  for (size_t i = 0; i < pl->n_tensors; i++) {
    const Ps__Tensor *t = pl->tensors[i];
    uint64_t n = 1;
    if (t->dtype != 0) {
      snprintf(msg, sizeof(msg), "tensor %zu (%s): dtype %" PRIu32 " unsupported (only float32)", i,
               t->name, t->dtype);
      r = -EINVAL;
      goto out;
    }
    for (size_t d = 0; d < t->n_shape; d++) {
      if (t->shape[d] != 0 && n > UINT64_MAX / 4 / t->shape[d]) {
        snprintf(msg, sizeof(msg), "tensor %zu (%s): shape overflows", i, t->name);
        r = -EINVAL;
        goto out;
      }
      n *= t->shape[d];
    }
    l.names[i] = t->name;
    l.counts[i] = n;
  }
  l.chunk_bytes = pl->chunk_bytes;
  l.num_shards = pl->num_shards;
  l.hash = pl->hash;
  bool first = !s->store.has_layout;
  r = store_set_layout(&s->store, &l, msg, sizeof(msg));
  if (r == 0 && first) {
    s->barrier = calloc(s->opts.num_workers, sizeof(*s->barrier));
    if (!s->barrier) r = -ENOMEM;
    /* ranks never seen start being missed now */
    for (uint32_t i = 0; i < s->opts.num_workers; i++)
      if (s->rank_conns[i] == 0) s->rank_left_ms[i] = uv_now(&s->loop);
    log_info("layout registered",
             "tensors=%" PRIu32 " keys=%zu param_bytes=%" PRIu64 " hash=%016" PRIx64, l.num_tensors,
             s->store.num_keys, s->store.param_bytes, l.hash);
  }
out:
  free(l.names);
  free(l.counts);
  if (r == 0) {
    conn_ack(c, h, 0);
    return;
  }
  if (!msg[0]) snprintf(msg, sizeof(msg), "%s", strerror(-r));
  conn_fail(c, r == -EEXIST ? PS__ERROR_CODE__ERR_LAYOUT_MISMATCH : PS__ERROR_CODE__ERR_BAD_FRAME,
            "%s", msg);
}

/* Once every key has its initial values, they are checkpointed as clock 0:
 * a shard killed before its first periodic checkpoint restores them and
 * the job rolls back to step 0 instead of waiting for values it lost. */
static void initial_checkpoint(struct server *s) {
  for (size_t i = 0; i < s->store.num_keys; i++)
    if (!s->store.keys[i].params || s->store.keys[i].version != 0) return;
  struct ckpt_snapshot *snap = ckpt_snapshot_take(&s->store);
  if (snap) ckpt_writer_submit(s->ckw, snap);
}

/* --reject-nonfinite: a payload holding NaN or Inf is refused (error reply,
 * the connection stays) and counted. Returns true if it was. */
static bool reject_nonfinite(struct conn *c, const wire_header *h, const struct store_key *k,
                             const float *values) {
  struct server *s = c->srv;
  if (!s->opts.reject_nonfinite) return false;
  size_t bad = tm_count_nonfinite(values, k->count);
  if (bad == 0) return false;
  char msg[300];
  snprintf(msg, sizeof(msg),
           "%s of key %016" PRIx64 " (rank %" PRIu32 ", step %" PRIu64
           ") holds %zu NaN/Inf of %" PRIu64 " values: rejected (--reject-nonfinite)",
           wire_type_name(h->type), k->key, c->rank, h->step, bad, k->count);
  log_warn("rejected a non-finite payload",
           "peer=%s rank=%" PRIu32 " key=%016" PRIx64 " step=%" PRIu64 " nonfinite=%zu", c->peer,
           c->rank, k->key, h->step, bad);
  s->traffic.rejected_nonfinite++;
  shard_http_count_error(s->opts.http, PS__ERROR_CODE__ERR_NONFINITE);
  conn_error(c, h->request_id, PS__ERROR_CODE__ERR_NONFINITE, msg);
  return true;
}

static void handle_init(struct conn *c, const wire_header *h, const void *payload) {
  struct store_key *k = store_find(&c->srv->store, h->key); /* checked in server_on_header */
  if (reject_nonfinite(c, h, k, payload)) return;
  int r = store_init_key(&c->srv->store, k, payload);
  if (r < 0) {
    conn_fail(c, PS__ERROR_CODE__ERR_BAD_FRAME, "out of memory initialising a key");
    return;
  }
  conn_ack(c, h, r == 1 ? 1 : 0);
  if (r == 0 && c->srv->ckw) initial_checkpoint(c->srv);
}

static void drain_check(struct server *s);

/* Draining: would this push start a step (BSP) or be an update of its own
 * (ASP/SSP) rather than complete a started step or be a duplicate? */
static bool push_starts_step(const struct server *s, const struct store_key *k,
                             const wire_header *h) {
  if (!k->params || h->rank >= s->opts.num_workers || h->step < k->next_step[h->rank]) return false;
  if (s->opts.consistency == STORE_BSP) return k->pushed == 0 && h->step >= k->version;
  return true;
}

static void handle_push(struct conn *c, const wire_header *h, const void *payload) {
  struct server *s = c->srv;
  struct store_key *k = store_find(&s->store, h->key);
  char msg[400];
  if (h->rank != c->rank) {
    conn_fail(c, PS__ERROR_CODE__ERR_BAD_RANK,
              "push as rank %" PRIu32 " on rank %" PRIu32 "'s connection", h->rank, c->rank);
    return;
  }
  if (s->restored && s->opts.consistency == STORE_BSP && k->params && h->step > k->version) {
    char why[200];
    snprintf(why, sizeof(why),
             "push for step %" PRIu64 " of key %016" PRIx64 " at version %" PRIu64
             ": shard %" PRIu32 " is back at checkpoint clock %" PRIu64,
             h->step, k->key, k->version, s->opts.shard, s->restored_clock);
    send_rollback(c, h->request_id, s->restored_clock, why);
    return;
  }
  if (reject_nonfinite(c, h, k, payload)) return;
  if (s->draining && push_starts_step(s, k, h)) {
    s->held_pushes++; /* no reply: the worker resends it after reconnecting */
    return;
  }
  /* payload is c->scratch: the store may keep it as the step's sum and give
   * back a buffer of about the same size (no copy of the first push) */
  (void)payload;
  int r = store_push_buffer(&s->store, k, h->rank, h->step, &c->scratch, &c->scratch_bytes, msg,
                            sizeof(msg));
  if (r < 0) {
    conn_fail(c, r == -ENOMEM ? PS__ERROR_CODE__ERR_TOO_LARGE : PS__ERROR_CODE__ERR_BAD_STEP, "%s",
              msg);
    return;
  }
  conn_ack(c, h, r == STORE_DUPLICATE ? 1 : 0);
  if (s->draining) drain_check(s);
}

static void send_pull_reply(struct conn *c, const struct store_key *k, uint64_t request_id) {
  wire_header h = PS__HEADER__INIT;
  h.type = PS__MSG_TYPE__MSG_PULL_REPLY;
  h.request_id = request_id;
  h.key = k->key;
  h.version = k->version;
  c->srv->traffic.pulls++;
  conn_send(c, &h, k->params);
}

/* store_serve_fn: a waiting pull's version has arrived. */
static void serve_waiter(struct store_key *k, struct store_waiter *w, void *arg) {
  (void)arg;
  ((struct conn *)w->conn)->waiting--;
  send_pull_reply(w->conn, k, w->request_id);
  free(w);
}

static void handle_pull(struct conn *c, const wire_header *h, const void *payload) {
  struct server *s = c->srv;
  (void)payload;
  struct store_key *k = store_find(&s->store, h->key);
  if (store_ready(&s->store, k, h->version)) {
    send_pull_reply(c, k, h->request_id);
    return;
  }
  /* BSP: a worker at step s pushed step s-1 of every key (on this
   * connection, before this pull), so a key is at version >= s-1 and, if it
   * is at s-1, holds the puller's push. A pull further ahead means this shard went back to an
   * older checkpoint (kill -9 after its last one) while the job went on:
   * ERR_ROLLBACK tells the worker the clock to roll the job back to. */
  if (s->opts.consistency == STORE_BSP && k->params &&
      (h->version > k->version + 1 || (s->restored && h->version == k->version + 1 && c->has_rank &&
                                       k->next_step[c->rank] <= k->version))) {
    char msg[300];
    snprintf(msg, sizeof(msg),
             "pull for version %" PRIu64 " of key %016" PRIx64 " at version %" PRIu64
             ": shard %" PRIu32
             " restarted from an older checkpoint than the job's step; "
             "restart the job from its checkpoints (docs/RELIABILITY.md)",
             h->version, k->key, k->version, s->opts.shard);
    log_error("worker ahead of the restored state",
              "rank=%" PRIu32 " key=%016" PRIx64 " version=%" PRIu64 " wanted=%" PRIu64, c->rank,
              k->key, k->version, h->version);
    send_rollback(c, h->request_id, s->restored ? s->restored_clock : k->version, msg);
    return;
  }
  if (c->waiting >= s->opts.max_waiting) {
    conn_fail(c, PS__ERROR_CODE__ERR_LIMIT,
              "more than %" PRIu32 " pulls waiting on one connection (--max-waiting-pulls)",
              s->opts.max_waiting);
    return;
  }
  struct store_waiter *w = calloc(1, sizeof(*w));
  if (!w) {
    conn_fail(c, PS__ERROR_CODE__ERR_BAD_FRAME, "out of memory queueing a pull");
    return;
  }
  c->waiting++;
  w->conn = c;
  w->request_id = h->request_id;
  w->min_version = h->version;
  store_wait(&s->store, k, w);
}

/* The barrier completes once every live rank arrived (gone ranks are not
 * waited for). */
static void barrier_try_complete(struct server *s) {
  if (!s->barrier || s->barrier_arrived == 0) return;
  for (uint32_t r = 0; r < s->opts.num_workers; r++)
    if (!s->barrier[r].c && !store_is_gone(&s->store, r)) return;
  for (uint32_t r = 0; r < s->opts.num_workers; r++) {
    if (!s->barrier[r].c) continue;
    wire_header ack = PS__HEADER__INIT;
    ack.type = PS__MSG_TYPE__MSG_ACK;
    ack.request_id = s->barrier[r].request_id;
    conn_send(s->barrier[r].c, &ack, NULL);
    s->barrier[r].c = NULL;
  }
  s->barrier_arrived = 0;
}

static void handle_barrier(struct conn *c, const wire_header *h, const void *payload) {
  struct server *s = c->srv;
  (void)payload;
  if (!s->barrier) {
    conn_fail(c, PS__ERROR_CODE__ERR_NO_LAYOUT, "barrier before any layout was declared");
    return;
  }
  struct barrier_slot *slot = &s->barrier[c->rank];
  if (!slot->c) s->barrier_arrived++;
  slot->c = c;
  slot->request_id = h->request_id;
  barrier_try_complete(s);
}

static void handle_stats(struct conn *c, const wire_header *h, const void *payload) {
  struct server *s = c->srv;
  (void)payload;
  Ps__Stats st = PS__STATS__INIT;
  st.pushes = s->store.stats.pushes;
  st.pulls = s->traffic.pulls;
  st.bytes_in = s->traffic.bytes_in;
  st.bytes_out = s->traffic.bytes_out;
  st.updates = s->store.stats.updates;
  st.duplicates = s->store.stats.duplicates;
  st.rejected_frames = s->traffic.rejected_frames;
  st.connected_workers = s->num_conns;
  st.shard = s->opts.shard;
  st.num_keys = (uint32_t)s->store.num_keys;
  st.param_bytes = s->store.param_bytes;
  st.min_version = UINT64_MAX;
  for (size_t i = 0; i < s->store.num_keys; i++) {
    uint64_t v = s->store.keys[i].version;
    if (v < st.min_version) st.min_version = v;
    if (v > st.max_version) st.max_version = v;
  }
  if (s->store.num_keys == 0) st.min_version = 0;
  uint32_t w = s->opts.num_workers;
  uint64_t *clocks = NULL;
  if (s->store.num_keys > 0 && w <= 4096 && (clocks = malloc(w * sizeof(uint64_t)))) {
    for (uint32_t i = 0; i < w; i++) clocks[i] = store_worker_clock(&s->store, i);
    st.n_worker_clocks = w;
    st.worker_clocks = clocks;
  }
  st.live_workers = w - s->store.num_gone;
  char mode[32];
  st.consistency =
      (char *)store_consistency_name(s->opts.consistency, s->opts.staleness, mode, sizeof(mode));
  st.optimizer = (char *)opt_name(s->opts.opt.kind);
  wire_header r = PS__HEADER__INIT;
  r.type = PS__MSG_TYPE__MSG_STATS;
  r.request_id = h->request_id;
  r.body_case = PS__HEADER__BODY_STATS;
  r.stats = &st;
  conn_send(c, &r, NULL);
  free(clocks);
}

static void server_stop(struct server *s, const char *why, bool graceful);

static void handle_shutdown(struct conn *c, const wire_header *h, const void *payload) {
  (void)payload;
  if (c->rank != 0) {
    conn_fail(c, PS__ERROR_CODE__ERR_BAD_RANK, "only rank 0 may shut the shards down");
    return;
  }
  conn_ack(c, h, 0);
  server_stop(c->srv, "shutdown requested by worker 0", true);
}

/* store_serve_fn for a rollback: a waiting pull is from the abandoned
 * timeline and fails with ERR_ROLLBACK. */
static void rollback_waiter(struct store_key *k, struct store_waiter *w, void *arg) {
  struct server *s = arg;
  (void)k;
  ((struct conn *)w->conn)->waiting--;
  send_rollback(w->conn, w->request_id, s->restored_clock, "the shard rolled back");
  free(w);
}

static void on_key_update(struct store *st, struct store_key *k, void *arg);

/* MSG_ROLLBACK(clock): a shard restarted from checkpoint `clock` while the
 * job was ahead; every shard goes back to its own checkpoint of that clock
 * (each keeps its two newest, written at the same clocks), so the whole job
 * continues from one consistent state. A shard already at or below clock
 * (rolled back by another worker's request, or the restarted one) only
 * acks. */
static void handle_rollback(struct conn *c, const wire_header *h, const void *payload) {
  struct server *s = c->srv;
  (void)payload;
  uint64_t clock = h->version;
  /* a worker waiting in the barrier is done with steps the job redoes now */
  for (uint32_t r = 0; s->barrier && r < s->opts.num_workers; r++) {
    if (!s->barrier[r].c) continue;
    send_rollback(s->barrier[r].c, s->barrier[r].request_id, clock, "the job rolled back");
    s->barrier[r].c = NULL;
  }
  s->barrier_arrived = 0;
  bool ahead = !s->store.has_layout;
  for (size_t i = 0; i < s->store.num_keys; i++)
    if (s->store.keys[i].version > clock) ahead = true;
  if (!ahead) {
    conn_ack(c, h, 1);
    return;
  }
  char err[600] = "";
  if (!s->ckw) {
    conn_error(c, h->request_id, PS__ERROR_CODE__ERR_BAD_STEP,
               "cannot roll back: this shard runs without --checkpoint-dir");
    return;
  }
  uint64_t t0 = uv_hrtime();
  ckpt_writer_wait_idle(s->ckw);
  ckpt_snapshot_free(s->pending);
  s->pending = NULL;
  struct store fresh;
  struct ckpt_info info;
  int r = store_init(&fresh, &s->store.opts, serve_waiter, s);
  if (r == 0) r = ckpt_load_clock(s->opts.checkpoint_dir, &fresh, clock, &info, err, sizeof(err));
  if (r < 0) {
    store_deinit(&fresh);
    log_error("cannot roll back", "clock=%" PRIu64 " error=\"%s\"", clock, err);
    char msg[700];
    snprintf(msg, sizeof(msg), "shard %" PRIu32 " cannot roll back to clock %" PRIu64 ": %s",
             s->opts.shard, clock, err);
    conn_error(c, h->request_id, PS__ERROR_CODE__ERR_BAD_STEP, msg);
    return;
  }
  s->restored = true;
  s->restored_clock = clock;
  store_take_waiters(&s->store, rollback_waiter, s);
  fresh.stats = s->store.stats; /* the traffic counters are the server's: they carry on */
  for (uint32_t i = 0; i < s->opts.num_workers; i++)
    if (s->store.gone[i]) store_worker_gone(&fresh, i);
  store_deinit(&s->store);
  s->store = fresh;
  s->store.on_update = on_key_update;
  s->store.on_update_arg = s;
  ckpt_remove_after(s->opts.checkpoint_dir, s->opts.shard, clock);
  log_warn("rolled back to a checkpoint", "rank=%" PRIu32 " clock=%" PRIu64 " path=%s seconds=%.3f",
           c->rank, clock, info.path, (uv_hrtime() - t0) / 1e9);
  conn_ack(c, h, 0);
}

/* What each type needs before its handler runs. */
struct handler_entry {
  handler_fn fn;
  bool needs_layout; /* data messages */
  bool has_payload;  /* payload = the key's values */
  bool needs_key;
};

static const struct handler_entry handlers[] = {
    [PS__MSG_TYPE__MSG_HELLO] = {handle_hello, false, false, false},
    [PS__MSG_TYPE__MSG_AUTH] = {handle_auth, false, false, false},
    [PS__MSG_TYPE__MSG_LAYOUT] = {handle_layout, false, false, false},
    [PS__MSG_TYPE__MSG_INIT] = {handle_init, true, true, true},
    [PS__MSG_TYPE__MSG_PUSH] = {handle_push, true, true, true},
    [PS__MSG_TYPE__MSG_PULL] = {handle_pull, true, false, true},
    [PS__MSG_TYPE__MSG_BARRIER] = {handle_barrier, false, false, false},
    [PS__MSG_TYPE__MSG_STATS] = {handle_stats, false, false, false},
    [PS__MSG_TYPE__MSG_SHUTDOWN] = {handle_shutdown, false, false, false},
    [PS__MSG_TYPE__MSG_ROLLBACK] = {handle_rollback, false, false, false},
};
#define NUM_HANDLERS (sizeof(handlers) / sizeof(handlers[0]))

/* ---- reading ---------------------------------------------------------- */

/* A whole frame is in: its tag is checked (authenticated connections), then
 * its handler runs. */
void server_dispatch(struct conn *c) {
  const wire_header *h = c->hdr;
  if (c->sess && conn_mac_finish(c) < 0) {
    char why[200];
    snprintf(why, sizeof(why),
             "%s frame failed authentication (altered, replayed, reordered or not from the "
             "authenticated peer)",
             wire_type_name(h->type));
    c->hdr = NULL; /* its request id is as unauthenticated as the rest: answer none */
    conn_auth_fail(c, why);
    return;
  }
  c->frame_start_ms = 0;
  handlers[h->type].fn(c, h, c->scratch);
  c->hdr = NULL;
  frame_decoder_reset(&c->dec);
  conn_finish_upgrade(c);
}

/* A header is complete: validate it and choose where its payload goes.
 * Returns FRAME_DONE if the frame is complete, FRAME_NEED_MORE, or -1 after
 * conn_fail. */
int server_on_header(struct conn *c) {
  struct server *s = c->srv;
  int r = wire_header_unpack(&c->arena, frame_decoder_header(&c->dec),
                             frame_decoder_header_len(&c->dec), &c->hdr);
  if (r < 0) {
    c->hdr = NULL;
    conn_fail(c, r == -ENOMEM ? PS__ERROR_CODE__ERR_TOO_LARGE : PS__ERROR_CODE__ERR_BAD_FRAME,
              r == -ENOMEM ? "header exceeds the decode budget"
                           : "header is not a valid protobuf Header");
    return -1;
  }
  const wire_header *h = c->hdr;
  uint64_t plen = frame_decoder_payload_len(&c->dec);
  if ((unsigned)h->type >= NUM_HANDLERS || !handlers[h->type].fn) {
    conn_fail(c, PS__ERROR_CODE__ERR_UNKNOWN_TYPE,
              "message type %d (%s) is not accepted by a shard", (int)h->type,
              wire_type_name(h->type));
    return -1;
  }
  const struct handler_entry *e = &handlers[h->type];
  if (c->state == CONN_HELLO && h->type != PS__MSG_TYPE__MSG_HELLO) {
    if (c->srv->opts.auth_token)
      conn_auth_fail(c, "data before authentication: only HELLO and AUTH are accepted until then");
    else
      conn_fail(c, PS__ERROR_CODE__ERR_PROTOCOL, "%s before hello", wire_type_name(h->type));
    return -1;
  }
  if (c->state == CONN_AUTH && h->type != PS__MSG_TYPE__MSG_AUTH) {
    char why[160];
    snprintf(why, sizeof(why), "%s before authentication completed", wire_type_name(h->type));
    conn_auth_fail(c, why);
    return -1;
  }
  if (e->needs_layout && !s->store.has_layout) {
    conn_fail(c, PS__ERROR_CODE__ERR_NO_LAYOUT, "%s before any layout was declared",
              wire_type_name(h->type));
    return -1;
  }
  uint64_t want = 0;
  if (e->needs_key) {
    struct store_key *k = store_find(&s->store, h->key);
    if (!k) {
      conn_fail(c, PS__ERROR_CODE__ERR_BAD_KEY, "key %016" PRIx64 " is not held by shard %" PRIu32,
                h->key, s->opts.shard);
      return -1;
    }
    if (e->has_payload) want = k->count * sizeof(float);
  }
  if (plen != want) {
    conn_fail(c, PS__ERROR_CODE__ERR_BAD_SIZE,
              "%s carries %" PRIu64 " payload bytes, expected %" PRIu64, wire_type_name(h->type),
              plen, want);
    return -1;
  }
  if (want > c->scratch_bytes) {
    float *p = realloc(c->scratch, want);
    if (!p) {
      conn_fail(c, PS__ERROR_CODE__ERR_TOO_LARGE, "out of memory for a %" PRIu64 "-byte payload",
                want);
      return -1;
    }
    c->scratch = p;
    c->scratch_bytes = want;
  }
  s->traffic.bytes_in += FRAME_PREAMBLE_BYTES + frame_decoder_header_len(&c->dec) + plen;
  if (c->sess) conn_mac_begin(c);
  return frame_decoder_set_payload(&c->dec, want ? c->scratch : NULL);
}

/* ---- accepting and stopping ------------------------------------------- */

static void on_grace_timeout(uv_timer_t *t) {
  struct server *s = container_of(t, struct server, grace);
  if (s->num_conns)
    log_warn("closing connections still open after shutdown", "connections=%" PRIu32, s->num_conns);
  uv_close((uv_handle_t *)&s->grace, NULL);
  while (s->conns) conn_close(s->conns, true);
}

/* Waits for the periodic write in progress, then writes every key as it is
 * (a rank's clock clamped to its key's version in BSP: pushes of a step not
 * finished are not in the file and are taken again after a restart). */
static void final_checkpoint(struct server *s, const char *why) {
  struct ckpt_snapshot *snap = s->store.has_layout ? ckpt_snapshot_take(&s->store) : NULL;
  ckpt_snapshot_free(s->pending);
  s->pending = NULL;
  if (s->store.has_layout && !snap)
    log_error("no final checkpoint: out of memory", "shard=%" PRIu32, s->opts.shard);
  struct ckpt_write_result res = {0};
  int r = ckpt_writer_finish(s->ckw, snap, &res);
  if (snap && r == 0)
    log_info("final checkpoint",
             "reason=\"%s\" path=%s held_pushes=%" PRIu64 " unfinished_steps=%d", why, res.path,
             s->held_pushes, !store_at_step_boundary(&s->store));
  s->ckw_done = s->ckw;
  s->ckw = NULL;
}

/* Stops accepting and closes the loop's handles. Graceful (a SHUTDOWN from
 * worker 0 at the end of training): the workers get a few seconds to hang up
 * by themselves, so none of them mistakes the end of the job for a lost
 * shard; the loop ends when the last one has gone. Otherwise (signals):
 * every connection is closed now, after its queued replies. */
static void server_stop(struct server *s, const char *why, bool graceful) {
  if (s->stopping) return;
  s->stopping = true;
  shard_http_stopping(s->opts.http, graceful); /* graceful = worker 0 ended the training */
  log_info("stopping",
           "reason=\"%s\" pushes=%" PRIu64 " pulls=%" PRIu64 " updates=%" PRIu64
           " duplicates=%" PRIu64 " rejected_frames=%" PRIu64 " auth_failures=%" PRIu64
           " rejected_nonfinite=%" PRIu64 " dropped_connections=%" PRIu64
           " refused_connections=%" PRIu64,
           why, s->store.stats.pushes, s->traffic.pulls, s->store.stats.updates,
           s->store.stats.duplicates, s->traffic.rejected_frames, s->traffic.auth_failures,
           s->traffic.rejected_nonfinite, s->traffic.dropped, s->traffic.refused);
  if (s->drain_timer_on) uv_close((uv_handle_t *)&s->drain_timer, NULL);
  s->drain_timer_on = false;
  if (s->ckw) final_checkpoint(s, why);
  if (!uv_is_closing((uv_handle_t *)&s->listener)) uv_close((uv_handle_t *)&s->listener, NULL);
  uv_close((uv_handle_t *)&s->sigint, NULL);
  uv_close((uv_handle_t *)&s->sigterm, NULL);
  if (s->watchdog_on) uv_close((uv_handle_t *)&s->watchdog, NULL);
  s->watchdog_on = false;
  if (!uv_is_closing((uv_handle_t *)&s->sweep)) uv_close((uv_handle_t *)&s->sweep, NULL);
  if (graceful && s->num_conns) {
    uv_timer_init(&s->loop, &s->grace);
    uv_timer_start(&s->grace, on_grace_timeout, 5000, 0);
    return;
  }
  while (s->conns) conn_close(s->conns, true);
}

/* ---- missing workers ------------------------------------------------------ */

static bool barrier_waits_for(const struct server *s, uint32_t rank) {
  return s->barrier && s->barrier_arrived > 0 && !s->barrier[rank].c;
}

/* store_serve_fn for WORKER_TIMEOUT_FAIL: the waiting pull fails. */
static void fail_waiter(struct store_key *k, struct store_waiter *w, void *arg) {
  struct server *s = arg;
  (void)k;
  ((struct conn *)w->conn)->waiting--;
  conn_error(w->conn, w->request_id, PS__ERROR_CODE__ERR_WORKER_LOST, s->fail_msg);
  free(w);
}

/* WORKER_TIMEOUT_FAIL: every waiting request learns why, then the shard
 * stops; server_run returns -ENOTCONN. */
static void fail_job(struct server *s, uint32_t rank, uint64_t away_ms) {
  snprintf(s->fail_msg, sizeof(s->fail_msg),
           "worker rank %" PRIu32 " has been gone for %.1f s and shard %" PRIu32
           " cannot go on without it (--on-worker-timeout fail): stopping the job",
           rank, (double)away_ms / 1000.0, s->opts.shard);
  log_error("worker lost", "rank=%" PRIu32 " away_s=%.1f action=fail", rank,
            (double)away_ms / 1000.0);
  store_take_waiters(&s->store, fail_waiter, s);
  for (uint32_t r = 0; s->barrier && r < s->opts.num_workers; r++) {
    if (!s->barrier[r].c) continue;
    conn_error(s->barrier[r].c, s->barrier[r].request_id, PS__ERROR_CODE__ERR_WORKER_LOST,
               s->fail_msg);
    s->barrier[r].c = NULL;
  }
  s->barrier_arrived = 0;
  s->exit_error = -ENOTCONN;
  server_stop(s, "a worker is gone (--on-worker-timeout fail)", false);
}

/* Each tick: ranks away for longer than the timeout are declared gone
 * (continue) or, once the shard waits for one of them, stop the job (fail). */
static void on_watchdog(uv_timer_t *t) {
  struct server *s = container_of(t, struct server, watchdog);
  if (!s->store.has_layout || s->stopping) return;
  uint64_t now = uv_now(&s->loop);
  for (uint32_t r = 0; r < s->opts.num_workers; r++) {
    if (s->rank_conns[r] > 0 || store_is_gone(&s->store, r)) continue;
    uint64_t away = now - s->rank_left_ms[r];
    if (away < s->opts.worker_timeout_ms) continue;
    if (s->opts.on_worker_timeout == WORKER_TIMEOUT_FAIL) {
      if (store_blocked_on(&s->store, r) || barrier_waits_for(s, r)) {
        fail_job(s, r, away);
        return;
      }
      continue;
    }
    int e = store_worker_gone(&s->store, r);
    log_warn("worker gone, continuing without it",
             "rank=%" PRIu32 " away_s=%.1f live_workers=%" PRIu32, r, (double)away / 1000.0,
             s->opts.num_workers - s->store.num_gone);
    if (e < 0)
      log_error("cannot complete a step without the gone worker", "error=%s", strerror(-e));
    barrier_try_complete(s);
  }
  drain_check(s);
}

static void drain_check(struct server *s) {
  if (!s->draining || s->stopping) return;
  if (s->opts.consistency == STORE_BSP && !store_at_step_boundary(&s->store)) return;
  log_info("drained: every started step finished", "held_pushes=%" PRIu64, s->held_pushes);
  server_stop(s, "SIGTERM", false);
}

static void on_drain_timeout(uv_timer_t *t) {
  struct server *s = container_of(t, struct server, drain_timer);
  log_warn("steps still unfinished after the drain timeout; their pushes will be taken again",
           "timeout_s=%d", DRAIN_TIMEOUT_MS / 1000);
  server_stop(s, "SIGTERM (drain timeout)", false);
}

/* With checkpoints, the first SIGTERM/SIGINT drains (see server.h); without,
 * or on a second signal, the shard stops at once. */
static void on_signal(uv_signal_t *h, int signum) {
  struct server *s = h->data;
  const char *name = signum == SIGTERM ? "SIGTERM" : "SIGINT";
  if (!s->ckw || s->draining) {
    server_stop(s, name, false);
    return;
  }
  s->draining = true;
  uv_close((uv_handle_t *)&s->listener, NULL); /* stop accepting */
  log_info("draining before the final checkpoint", "signal=%s", name);
  uv_timer_init(&s->loop, &s->drain_timer);
  uv_timer_start(&s->drain_timer, on_drain_timeout, DRAIN_TIMEOUT_MS, 0);
  s->drain_timer_on = true;
  drain_check(s);
}

/* Listens on --listen, logging what went wrong. */
static int bind_listener(struct server *s, char *bound, size_t boundlen) {
  char why[256];
  struct listener_error e = {.reason = why, .reason_len = sizeof(why)};
  int r =
      listener_open(&s->loop, &s->listener, s->opts.listen, 512, conn_accept, bound, boundlen, &e);
  if (r == 0) return 0;
  if (e.step == LISTENER_PARSE)
    log_error("bad --listen", "value=\"%s\" error=\"%s\"", s->opts.listen, why);
  else if (e.step == LISTENER_RESOLVE)
    log_error("cannot resolve --listen", "host=%s error=\"%s\"", e.host, why);
  else
    log_error("cannot listen", "addr=%s error=\"%s\"", s->opts.listen, why);
  return r;
}

/* Writes the bound address atomically (temp file + rename) for launchers. */
static int write_port_file(const char *path, const char *bound) {
  char tmp[4096];
  snprintf(tmp, sizeof(tmp), "%s.tmp.%d", path, (int)getpid());
  FILE *f = fopen(tmp, "w");
  if (!f) return -errno;
  fprintf(f, "%s\n", bound);
  if (fclose(f) != 0 || rename(tmp, path) != 0) {
    int e = -errno;
    unlink(tmp);
    return e;
  }
  return 0;
}

/* store on_update hook: periodic checkpoints. BSP: each key is captured as
 * it reaches a multiple of checkpoint_every (keys reach version v before
 * any key goes past v+1, since a step-v push follows a pull of every key at
 * v), and the snapshot goes to the writer once every key is in. ASP/SSP
 * have no common step: all keys are taken as they are. */
static void on_key_update(struct store *st, struct store_key *k, void *arg) {
  struct server *s = arg;
  uint64_t every = s->opts.checkpoint_every;
  if (!s->ckw || every == 0 || k->version % every != 0 || s->draining || s->stopping) return;
  if (st->opts.consistency != STORE_BSP) {
    if (ckpt_writer_busy(s->ckw)) return;
    struct ckpt_snapshot *snap = ckpt_snapshot_take(st);
    if (snap) ckpt_writer_submit(s->ckw, snap);
    return;
  }
  if (s->pending && s->pending->clock != k->version) {
    if (s->pending->clock > k->version) return;
    log_warn("checkpoint abandoned: not every key reached its version",
             "clock=%" PRIu64 " keys=%zu of %zu", s->pending->clock, s->pending->filled,
             s->pending->num_keys);
    ckpt_snapshot_free(s->pending);
    s->pending = NULL;
  }
  if (!s->pending && !(s->pending = ckpt_snapshot_new(st, k->version))) return;
  if (ckpt_snapshot_add(s->pending, st, (size_t)(k - st->keys)) < 0) {
    log_error("checkpoint abandoned: out of memory", "clock=%" PRIu64, k->version);
    ckpt_snapshot_free(s->pending);
    s->pending = NULL;
    return;
  }
  if (ckpt_snapshot_complete(s->pending)) {
    ckpt_writer_submit(s->ckw, s->pending);
    s->pending = NULL;
  }
}

/* Opens the checkpoint directory, loads the newest valid checkpoint and
 * starts the writer. Returns 0 or a negative errno (logged). */
static int checkpoints_start(struct server *s) {
  const char *dir = s->opts.checkpoint_dir;
  if (mkdir(dir, 0755) != 0 && errno != EEXIST) {
    int e = -errno;
    log_error("cannot create --checkpoint-dir", "path=%s error=\"%s\"", dir, strerror(-e));
    return e;
  }
  ckpt_remove_temps(dir, s->opts.shard);
  uint64_t t0 = uv_hrtime();
  struct ckpt_info info;
  char err[600] = "";
  int r = ckpt_load_latest(dir, &s->store, &info, err, sizeof(err));
  if (r == 0) {
    s->restored = true;
    s->restored_clock = info.clock;
    s->barrier = calloc(s->opts.num_workers, sizeof(*s->barrier));
    if (!s->barrier) return -ENOMEM;
    for (uint32_t i = 0; i < s->opts.num_workers; i++) s->rank_left_ms[i] = uv_now(&s->loop);
    log_info("checkpoint loaded",
             "path=%s clock=%" PRIu64 " keys=%zu param_bytes=%" PRIu64 " seconds=%.3f", info.path,
             info.clock, s->store.num_keys, s->store.param_bytes, (uv_hrtime() - t0) / 1e9);
  } else if (r == -ENOENT) {
    log_info("no checkpoint to load, starting empty", "dir=%s detail=\"%s\"", dir, err);
  } else {
    log_error("cannot load checkpoint", "error=\"%s\"", err);
    return r;
  }
  r = ckpt_writer_start(&s->loop, dir, s->opts.shard, &s->ckw);
  if (r < 0) {
    log_error("cannot start the checkpoint writer", "error=\"%s\"", strerror(-r));
    return r;
  }
  s->store.on_update = on_key_update;
  s->store.on_update_arg = s;
  return 0;
}

/* shard_http_snapshot_fn: runs on the loop when a scrape or probe wants fresh values. */
static void publish_metrics(void *arg) {
  struct server *s = arg;
  shard_http_publish(s->opts.http, &s->store, &s->traffic, s->num_conns);
  const struct ckpt_writer *w = s->ckw ? s->ckw : s->ckw_done;
  struct shard_http_ckpt c = {0};
  if (w) {
    struct ckpt_writer_stats st = ckpt_writer_stats(w);
    c = (struct shard_http_ckpt){st.written,    st.failed,     st.skipped,
                                 st.last_clock, st.last_bytes, st.last_seconds};
  }
  shard_http_publish_checkpoints(s->opts.http, w ? &c : NULL);
}

int server_run(const struct server_opts *opts) {
  struct server *s = calloc(1, sizeof(*s));
  if (!s) return -ENOMEM;
  int ret = 0;
  s->opts = *opts;
  if (!s->opts.max_connections) s->opts.max_connections = 1024;
  if (!s->opts.out_queue_bytes) s->opts.out_queue_bytes = 256ull << 20;
  if (!s->opts.max_waiting) s->opts.max_waiting = 65536;
  s->out_high = s->opts.out_queue_bytes / 4;
  s->out_low = s->opts.out_queue_bytes / 16;
  s->lim.max_header = opts->max_header_bytes;
  s->lim.max_payload = opts->max_frame_bytes;
  struct store_opts so = {.shard = opts->shard,
                          .num_shards = opts->num_shards,
                          .num_workers = opts->num_workers,
                          .consistency = opts->consistency,
                          .staleness = opts->staleness,
                          .opt = opts->opt};
  ret = -ENOMEM;
  s->rank_conns = calloc(opts->num_workers, sizeof(*s->rank_conns));
  s->rank_left_ms = calloc(opts->num_workers, sizeof(*s->rank_left_ms));
  if (!s->rank_conns || !s->rank_left_ms || store_init(&s->store, &so, serve_waiter, s) < 0)
    goto out_free;
  ret = uv_loop_init(&s->loop);
  if (ret < 0) goto out_free;

  if (opts->checkpoint_dir && opts->checkpoint_dir[0]) {
    ret = checkpoints_start(s);
    if (ret < 0) goto out_loop;
  }
  char bound[300];
  ret = bind_listener(s, bound, sizeof(bound));
  if (ret < 0) goto out_loop;
  uv_signal_init(&s->loop, &s->sigint);
  uv_signal_init(&s->loop, &s->sigterm);
  s->sigint.data = s->sigterm.data = s;
  uv_signal_start(&s->sigint, on_signal, SIGINT);
  uv_signal_start(&s->sigterm, on_signal, SIGTERM);
  shard_http_attach(opts->http, &s->loop, publish_metrics, s);
  uv_timer_init(&s->loop, &s->sweep);
  uv_timer_start(&s->sweep, conn_sweep, SWEEP_MS, SWEEP_MS);
  if (!opts->auth_token)
    log_warn(
        "AUTHENTICATION IS OFF: anyone who can reach this port can push gradients, "
        "read the model and stop the shard; set --auth-token-file",
        "listen=%s", opts->listen);
  if (opts->worker_timeout_ms > 0) {
    uint64_t tick = opts->worker_timeout_ms / 4;
    tick = tick < 20 ? 20 : tick > 1000 ? 1000 : tick;
    uv_timer_init(&s->loop, &s->watchdog);
    uv_timer_start(&s->watchdog, on_watchdog, tick, tick);
    s->watchdog_on = true;
  }
  char mode[32];
  log_info("listening",
           "addr=%s shard=%" PRIu32 " num_shards=%" PRIu32 " num_workers=%" PRIu32
           " consistency=%s optimizer=%s lr=%g momentum=%g nesterov=%d weight_decay=%g"
           " beta1=%g beta2=%g eps=%g worker_timeout_s=%g on_worker_timeout=%s",
           bound, opts->shard, opts->num_shards, opts->num_workers,
           store_consistency_name(opts->consistency, opts->staleness, mode, sizeof(mode)),
           opt_name(opts->opt.kind), opts->opt.lr, opts->opt.momentum, opts->opt.nesterov,
           opts->opt.weight_decay, opts->opt.beta1, opts->opt.beta2, opts->opt.eps,
           (double)opts->worker_timeout_ms / 1000.0,
           opts->on_worker_timeout == WORKER_TIMEOUT_FAIL ? "fail" : "continue");
  shard_http_set_ready(opts->http); /* listening, the newest checkpoint (if any) loaded */
  if (opts->port_file && opts->port_file[0]) {
    ret = write_port_file(opts->port_file, bound);
    if (ret < 0) {
      log_error("cannot write --port-file", "path=\"%s\" error=\"%s\"", opts->port_file,
                strerror(-ret));
      server_stop(s, "port file", false);
    }
  }
  uv_run(&s->loop, UV_RUN_DEFAULT);
  log_info("stopped", "shard=%" PRIu32, opts->shard);
  shard_http_detach(opts->http); /* final values (connections closed) for a lingering /metrics */
  if (ret == 0) ret = s->exit_error;
out_loop:
  if (s->ckw) { /* the start failed after the writer started: nothing new to save */
    ckpt_writer_finish(s->ckw, NULL, NULL);
    s->ckw_done = s->ckw;
    s->ckw = NULL;
  }
  listener_close_loop(&s->loop);
  ckpt_writer_free(s->ckw_done);
out_free:
  store_deinit(&s->store);
  free(s->barrier);
  free(s->rank_conns);
  free(s->rank_left_ms);
  free(s);
  return ret;
}
