/* handlers: what a shard does with each message (server_impl.h says who
 * calls whom).
 *
 * Messages dispatch through a table of handlers indexed by the header's
 * type (handlers_find). An entry also says what its type needs before the
 * handler runs, and conn.c checks all of it as soon as a header is in,
 * before any payload is read: the type is known, the connection's state
 * allows it (only HELLO before hello, only AUTH while authenticating), a
 * data message comes after the layout, its key is held by this shard, and
 * the payload length is exactly the key's size (or 0). Once the frame is
 * whole, conn.c runs its handler. So a handler never revalidates those; it
 * checks what only it can (ranks, steps, the consistency model) and either
 * answers through conn.c (ack, reply, error frame) or refuses the client
 * with conn_fail. Payloads arrive in the connection's scratch buffer; a
 * push's may be kept by the store as the step's sum (store_push_buffer).
 *
 * A pull that cannot be answered yet waits in the store and is answered by
 * handlers_serve_waiter; the barrier completes when every live rank has
 * arrived (handlers_barrier_complete, also run when the watchdog declares a
 * rank gone). A push, a pull that would wait and a rank arriving at the
 * barrier first pass leave.c, which refuses what can never complete because
 * a rank finished or waits in the barrier (ERR_UNEVEN_STEPS); MSG_LEAVE's
 * handler is there too. The job rollback (ERR_ROLLBACK, MSG_ROLLBACK) is
 * rollback.c's: a push and a pull pass its refusals first. */
#include <errno.h>
#include <inttypes.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "frame.h"
#include "handshake.h"
#include "log.h"
#include "shard_http.h"
#include "store.h"
#include "tensor_math.h"
#include "wire.h"
#include "server_impl.h"

/* ---- replies ------------------------------------------------------------ */

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
void handlers_serve_waiter(struct store_key *k, struct store_waiter *w, void *arg) {
  (void)arg;
  ((struct conn *)w->conn)->waiting--;
  send_pull_reply(w->conn, k, w->request_id);
  free(w);
}

/* ---- handshake and layout ----------------------------------------------- */

/* The client is who it says (authenticated, or nobody checks): take the
 * rank it claimed in HELLO. The frame limits rise once this frame is done
 * (conn.c). */
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
  conn_ready(c, c->hello_rank);
  server_rank_joined(s, c->rank);
  leave_reset(s, c->rank, false);
  char transport[160];
  c->tp->describe(c, transport, sizeof(transport));
  log_info("worker connected", "peer=%s rank=%" PRIu32 " authenticated=%d transport=%s", c->peer,
           c->rank, c->sess != NULL, transport);
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
  c->beat_ms = h->hello->heartbeat_ms;
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
  conn_challenge(c);
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
  conn_authenticated(c);
  accept_worker(c, h);
}

static void handle_layout(struct conn *c, const wire_header *h, const void *payload) {
  struct server *s = c->srv;
  (void)payload;
  if (h->body_case != PS__HEADER__BODY_LAYOUT) {
    conn_fail(c, PS__ERROR_CODE__ERR_PROTOCOL, "layout message without a layout body");
    return;
  }
  if (lost_on_layout(c, h)) return;
  const Ps__Layout *pl = h->layout;
  struct store_layout l = {0};
  char msg[400] = "";
  int r = -ENOMEM;
  l.num_tensors = (uint32_t)pl->n_tensors;
  l.names = calloc(pl->n_tensors ? pl->n_tensors : 1, sizeof(char *));
  l.counts = calloc(pl->n_tensors ? pl->n_tensors : 1, sizeof(uint64_t));
  l.num_owners = calloc(pl->n_tensors ? pl->n_tensors : 1, sizeof(uint32_t));
  l.owners = calloc(pl->n_tensors ? pl->n_tensors : 1, sizeof(uint32_t *));
  if (!l.names || !l.counts || !l.num_owners || !l.owners) goto out;
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
    if (t->n_owners > s->opts.num_workers) {
      snprintf(msg, sizeof(msg),
               "tensor %zu (%s): %zu owners, more than the %" PRIu32 " workers (--num-workers)", i,
               t->name, t->n_owners, s->opts.num_workers);
      r = -EINVAL;
      goto out;
    }
    l.names[i] = t->name;
    l.counts[i] = n;
    l.num_owners[i] = (uint32_t)t->n_owners; /* checked by store_set_layout */
    l.owners[i] = t->owners;
  }
  l.chunk_bytes = pl->chunk_bytes;
  l.num_shards = pl->num_shards;
  l.hash = pl->hash;
  bool first = !s->store.has_layout;
  r = store_set_layout(&s->store, &l, msg, sizeof(msg));
  if (r == 0 && first) {
    if (handlers_barrier_open(s) < 0) r = -ENOMEM;
    /* ranks never seen start being missed now */
    server_ranks_missed_from_now(s);
    log_info("layout registered",
             "tensors=%" PRIu32 " keys=%zu param_bytes=%" PRIu64 " hash=%016" PRIx64, l.num_tensors,
             s->store.num_keys, s->store.param_bytes, l.hash);
  }
out:
  free(l.names);
  free(l.counts);
  free(l.num_owners);
  free(l.owners);
  if (r == 0) {
    conn_ack(c, h, 0);
    return;
  }
  if (!msg[0]) snprintf(msg, sizeof(msg), "%s", strerror(-r));
  conn_fail(c, r == -EEXIST ? PS__ERROR_CODE__ERR_LAYOUT_MISMATCH : PS__ERROR_CODE__ERR_BAD_FRAME,
            "%s", msg);
}

/* ---- data --------------------------------------------------------------- */

/* --reject-nonfinite: a payload holding NaN or Inf is refused (error reply,
 * the connection stays) and counted. Returns true if it was. */
static bool reject_nonfinite(struct conn *c, const wire_header *h, const struct store_key *k) {
  struct server *s = c->srv;
  if (!s->opts.reject_nonfinite) return false;
  uint64_t bad = c->nonfinite; /* counted as the payload arrived (conn.c) */
  if (bad == 0) return false;
  char msg[300];
  snprintf(msg, sizeof(msg),
           "%s of key %016" PRIx64 " (rank %" PRIu32 ", step %" PRIu64 ") holds %" PRIu64
           " NaN/Inf of %" PRIu64 " values: rejected (--reject-nonfinite)",
           wire_type_name(h->type), k->key, c->rank, h->step, bad, k->count);
  log_warn("rejected a non-finite payload",
           "peer=%s rank=%" PRIu32 " key=%016" PRIx64 " step=%" PRIu64 " nonfinite=%" PRIu64,
           c->peer, c->rank, k->key, h->step, bad);
  s->traffic.rejected_nonfinite++;
  shard_http_count_error(s->opts.http, PS__ERROR_CODE__ERR_NONFINITE);
  conn_error(c, h->request_id, PS__ERROR_CODE__ERR_NONFINITE, msg);
  return true;
}

static void handle_init(struct conn *c, const wire_header *h, const void *payload) {
  struct store_key *k = store_find(&c->srv->store, h->key); /* checked by conn.c (needs_key) */
  if (reject_nonfinite(c, h, k)) return;
  int r = store_init_key(&c->srv->store, k, payload);
  if (r < 0) {
    conn_fail(c, PS__ERROR_CODE__ERR_BAD_FRAME, "out of memory initialising a key");
    return;
  }
  conn_ack(c, h, r == 1 ? 1 : 0);
  if (r == 0 && c->srv->ckw) server_checkpoint_initial(c->srv);
}

/* Draining: would this push start a step (BSP) or be an update of its own
 * (ASP/SSP) rather than complete a started step or be a duplicate? */
static bool push_starts_step(const struct server *s, const struct store_key *k,
                             const wire_header *h) {
  if (!k->params || h->rank >= s->opts.num_workers || h->step < k->next_step[h->rank]) return false;
  if (s->opts.consistency == STORE_BSP) return k->pushed == 0 && h->step >= k->version;
  return true;
}

/* ASP/SSP after a restore: a rank beyond the checkpoint's clock lost the
 * updates it made since (store.h, Restored); said once per rank, counted in
 * ps_server_lost_updates_total and the stopping line. */
static void note_lost(struct conn *c, uint64_t lost) {
  struct server *s = c->srv;
  if (!lost || s->lost_said[c->rank]) return;
  s->lost_said[c->rank] = true;
  log_warn("updates lost since the checkpoint",
           "rank=%" PRIu32 " checkpoint_clock=%" PRIu64 " first_key_lost=%" PRIu64
           " detail=\"this rank's pushes after the checkpoint died with the shard; its clocks "
           "move on, nothing is applied twice\"",
           c->rank, s->rb.restored_clock, lost);
}

/* A push or pull of a key c's rank does not own (ps_declare_owned): an
 * error reply, the connection stays (libps refuses it before sending). */
static bool refuse_not_owner(struct conn *c, const wire_header *h, const struct store_key *k) {
  char msg[400];
  if (store_check_owner(&c->srv->store, k, c->rank, msg, sizeof(msg)) == 0) return false;
  shard_http_count_error(c->srv->opts.http, PS__ERROR_CODE__ERR_BAD_RANK);
  conn_error(c, h->request_id, PS__ERROR_CODE__ERR_BAD_RANK, msg);
  return true;
}

/* A push to a key no INIT has reached yet (a rank ran ahead of rank 0's
 * ps_init): an error reply, the connection stays. Closing it, as for other
 * bad pushes, made the client reconnect saying its job had started, which
 * a shard holding no values takes for its own lost state: the first push
 * that came too early stopped the whole job. */
static bool refuse_uninitialised(struct conn *c, const wire_header *h, const struct store_key *k) {
  if (k->params) return false;
  char msg[300];
  snprintf(msg, sizeof(msg),
           "push to key %016" PRIx64
           " before it was initialised (rank 0 calls ps_init, then "
           "every rank ps_wait_initialised before its first push)",
           k->key);
  shard_http_count_error(c->srv->opts.http, PS__ERROR_CODE__ERR_NOT_INITIALISED);
  conn_error(c, h->request_id, PS__ERROR_CODE__ERR_NOT_INITIALISED, msg);
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
  if (refuse_not_owner(c, h, k) || refuse_uninitialised(c, h, k)) return;
  if (rollback_refuses_push(c, h, k)) return;
  if (reject_nonfinite(c, h, k) || leave_refuses_push(c, h, k) || lost_false_duplicate(c, h, k))
    return;
  if (s->draining && push_starts_step(s, k, h)) {
    s->held_pushes++; /* no reply: the worker resends it after reconnecting */
    return;
  }
  /* payload is c->scratch: the store may keep it as the step's sum and give
   * back a buffer of about the same size (no copy of the first push) */
  (void)payload;
  uint64_t base = h->flags & WIRE_PUSH_BASE ? h->version : STORE_NO_BASE;
  note_lost(c, store_rank_at(&s->store, k, h->rank, h->step));
  int r = store_push_buffer(&s->store, k, h->rank, h->step, base, &c->scratch, &c->scratch_bytes,
                            msg, sizeof(msg));
  if (r < 0) {
    conn_fail(c, r == -ENOMEM ? PS__ERROR_CODE__ERR_TOO_LARGE : PS__ERROR_CODE__ERR_BAD_STEP, "%s",
              msg);
    return;
  }
  conn_ack(c, h, r == STORE_DUPLICATE ? WIRE_ACK_DUPLICATE : 0);
  if (s->draining) server_drain_check(s);
}

static void handle_pull(struct conn *c, const wire_header *h, const void *payload) {
  struct server *s = c->srv;
  (void)payload;
  struct store_key *k = store_find(&s->store, h->key);
  if (c->has_rank && refuse_not_owner(c, h, k)) return;
  if (rollback_refuses(c, h)) return;
  if (c->has_rank) note_lost(c, store_rank_at(&s->store, k, c->rank, h->version));
  if (store_ready(&s->store, k, h->version)) {
    send_pull_reply(c, k, h->request_id);
    return;
  }
  if (rollback_refuses_pull(c, h, k)) return;
  if (leave_refuses_pull(c, h, k)) return;
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

/* ---- control ------------------------------------------------------------ */

/* The barrier completes once every live rank arrived (gone ranks are not
 * waited for): each waiting rank gets its ack. */
void handlers_barrier_complete(struct server *s) {
  struct barrier *b = &s->barrier;
  if (!b->slot || b->arrived == 0) return;
  for (uint32_t r = 0; r < s->opts.num_workers; r++)
    if (!b->slot[r].c && !store_is_gone(&s->store, r)) return;
  for (uint32_t r = 0; r < s->opts.num_workers; r++) {
    if (!b->slot[r].c) continue;
    wire_header ack = PS__HEADER__INIT;
    ack.type = PS__MSG_TYPE__MSG_ACK;
    ack.request_id = b->slot[r].request_id;
    conn_send(b->slot[r].c, &ack, NULL);
    b->slot[r].c = NULL;
  }
  b->arrived = 0;
}

int handlers_barrier_open(struct server *s) {
  if (!s->barrier.slot) s->barrier.slot = calloc(s->opts.num_workers, sizeof(*s->barrier.slot));
  return s->barrier.slot ? 0 : -ENOMEM;
}

void handlers_barrier_free(struct server *s) {
  free(s->barrier.slot);
  s->barrier.slot = NULL;
}

struct conn *handlers_barrier_take(struct server *s, uint32_t rank, uint64_t *request_id) {
  struct barrier *b = &s->barrier;
  struct conn *c = b->slot ? b->slot[rank].c : NULL;
  if (!c) return NULL;
  *request_id = b->slot[rank].request_id;
  b->slot[rank].c = NULL;
  b->arrived--;
  return c;
}

void handlers_barrier_drop(struct conn *c) {
  struct barrier *b = &c->srv->barrier;
  if (b->slot && c->has_rank && b->slot[c->rank].c == c) {
    b->slot[c->rank].c = NULL;
    b->arrived--;
  }
}

static void handle_barrier(struct conn *c, const wire_header *h, const void *payload) {
  struct server *s = c->srv;
  (void)payload;
  if (!s->barrier.slot) {
    conn_fail(c, PS__ERROR_CODE__ERR_NO_LAYOUT, "barrier before any layout was declared");
    return;
  }
  struct barrier_slot *slot = &s->barrier.slot[c->rank];
  if (!slot->c) s->barrier.arrived++;
  slot->c = c;
  slot->request_id = h->request_id;
  leave_check(s, c->rank); /* it pushes nothing now: does a step need it? */
  handlers_barrier_complete(s);
}

/* Proof of life from a worker's libps when it has nothing else to send (no
 * reply; its arrival is what counts, conn_sweep). */
static void handle_heartbeat(struct conn *c, const wire_header *h, const void *payload) {
  (void)c;
  (void)h;
  (void)payload;
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
  uint32_t *lost = malloc(w * sizeof(uint32_t));
  for (uint32_t i = 0; lost && i < w; i++)
    if (s->lost_ever[i]) lost[st.n_lost_ranks++] = i;
  st.lost_ranks = lost;
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
  free(lost);
}

static void handle_shutdown(struct conn *c, const wire_header *h, const void *payload) {
  (void)payload;
  if (c->rank != 0) {
    conn_fail(c, PS__ERROR_CODE__ERR_BAD_RANK, "only rank 0 may shut the shards down");
    return;
  }
  conn_ack(c, h, 0);
  server_stop(c->srv, "shutdown requested by worker 0", true);
}

/* ---- the table ---------------------------------------------------------- */

static const struct handler_entry handlers[] = {
    [PS__MSG_TYPE__MSG_HELLO] = {handle_hello, false, false, false, false},
    [PS__MSG_TYPE__MSG_AUTH] = {handle_auth, false, false, false, false},
    [PS__MSG_TYPE__MSG_LAYOUT] = {handle_layout, false, false, false, false},
    [PS__MSG_TYPE__MSG_INIT] = {handle_init, true, true, true, true},
    [PS__MSG_TYPE__MSG_PUSH] = {handle_push, true, true, true, true},
    [PS__MSG_TYPE__MSG_PULL] = {handle_pull, true, false, true, true},
    [PS__MSG_TYPE__MSG_BARRIER] = {handle_barrier, false, false, false, true},
    [PS__MSG_TYPE__MSG_STATS] = {handle_stats, false, false, false, false},
    [PS__MSG_TYPE__MSG_SHUTDOWN] = {handle_shutdown, false, false, false, true},
    [PS__MSG_TYPE__MSG_ROLLBACK] = {rollback_handle, false, false, false, true},
    [PS__MSG_TYPE__MSG_HEARTBEAT] = {handle_heartbeat, false, false, false, false},
    [PS__MSG_TYPE__MSG_LEAVE] = {leave_handle, false, false, false, true},
    [PS__MSG_TYPE__MSG_ABORT] = {lost_handle_abort, false, false, false, false},
};
#define NUM_HANDLERS (sizeof(handlers) / sizeof(handlers[0]))

const struct handler_entry *handlers_find(int type) {
  return type >= 0 && (unsigned)type < NUM_HANDLERS && handlers[type].fn ? &handlers[type] : NULL;
}
