/* leave: ranks that stop taking part in the steps (MSG_LEAVE, ps_leave),
 * and the steps that can never complete because of them (ERR_UNEVEN_STEPS).
 * server_impl.h says who calls what here.
 *
 * A rank that joined (it ran out of data: Horovod's join) is no longer
 * waited for (store.h: Leaving the steps). A rank that finished, or that
 * waits in the barrier now, is "stuck": it pushes nothing before the
 * barrier completes, which needs every rank. So a step that needs a stuck
 * rank's push (another rank pushed it; the stuck rank counts and has not)
 * means the ranks ran different numbers of steps: without this the pushing
 * rank waits for its pull and the stuck rank in the barrier, for ever, and
 * nobody says why. Each time that becomes true (a rank finishes or enters
 * the barrier, a push starts such a step, a pull would wait for such a
 * rank) everything that waits on it fails with ERR_UNEVEN_STEPS naming both
 * ranks, both steps, the key and its tensor, and the fix: the key's waiting
 * pulls, the push or pull that found it, and the stuck rank's barrier
 * request, now or whenever it comes (the first refusal is kept per stuck
 * rank, and logged once). A barrier of ranks that all pushed the same steps
 * never sees any of this: no step then waits for anyone.
 *
 * The shard knows only of the barrier requests it gets, so shard 0 alone
 * sees a rank in ps_barrier; ps_leave(PS_LEAVE_FINISHED) tells every shard.
 * A rank's state lasts until its next hello (leave_reset: a restarted
 * process is a new participant, and libps says it again after a reconnect,
 * before anything else on that connection) or its rollback (it replays its
 * steps and leaves again when it runs out; until it has rolled back, an
 * open rollback keeps it from being taken for stuck, and a reload forgets
 * every rank's state: rollback_replace_store). */
#include <inttypes.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "log.h"
#include "shard_http.h"
#include "store.h"
#include "wire.h"
#include "server_impl.h"

#define WHY_FINISHED "it finished: ps.shutdown / ps_leave"
#define WHY_BARRIER "it waits in the barrier: ps.shutdown / ps_barrier"
#define UNEVEN_FIX                                                                       \
  "every rank must run the same number of steps, or a rank that runs out of data calls " \
  "ps.torch.join() (C: ps_leave(c, PS_LEAVE_JOINED)) so the others finish without it"

/* One stuck rank and what its refusals say. */
struct uneven {
  struct server *s;
  uint32_t stuck;
  const char *why; /* WHY_FINISHED or WHY_BARRIER */
  char first[800]; /* the first refusal's text: the stuck rank's barrier gets it too */
};

/* Why rank pushes nothing for now (WHY_*), or NULL if it may push. A rank
 * the open rollback still waits for will replay its steps. */
static const char *stuck_why(const struct server *s, uint32_t rank) {
  if (store_is_gone(&s->store, rank) || rollback_waits_for(&s->rb, rank)) return NULL;
  switch (store_left(&s->store, rank)) {
    case STORE_JOINED:
      return NULL;
    case STORE_FINISHED:
      return WHY_FINISHED;
    case STORE_IN:
      break;
  }
  return s->barrier.slot && s->barrier.slot[rank].c ? WHY_BARRIER : NULL;
}

/* The refusal's text for rank g at step `step` of k (BSP: pushed says
 * whether g pushed it, or waits for it; SSP: its pull's clock). */
static void uneven_text(const struct uneven *u, const struct store_key *k, uint32_t g,
                        uint64_t step, bool pushed, char *buf, size_t len) {
  const struct store *st = &u->s->store;
  uint64_t tensor = k->key >> 32;
  const char *name = tensor < st->layout.num_tensors ? st->layout.names[tensor] : "?";
  char ssp[40] = "", stopped[64];
  if (st->opts.consistency == STORE_SSP)
    snprintf(ssp, sizeof(ssp), " under ssp:%" PRIu32, st->opts.staleness);
  uint64_t next = k->next_step[u->stuck];
  if (next)
    snprintf(stopped, sizeof(stopped), "stopped after step %" PRIu64, next - 1);
  else
    snprintf(stopped, sizeof(stopped), "stopped before its first step");
  snprintf(buf, len,
           "worker %" PRIu32 " %s step %" PRIu64 " of key %" PRIu64
           " (tensor \"%s\")%s, which can never complete: worker %" PRIu32
           " %s (%s) without joining; " UNEVEN_FIX,
           g, pushed && !ssp[0] ? "pushed" : "waits for", step, k->key, name, ssp, u->stuck,
           stopped, u->why);
}

/* The error frame answering request_id on c, counted. */
static void send_refusal(struct server *s, struct conn *c, Ps__ErrorCode code, uint64_t request_id,
                         const char *msg) {
  shard_http_count_error(s->opts.http, code);
  conn_error(c, request_id, code, msg);
}

/* One refusal of an uneven step; the first text is kept for the stuck
 * rank's barrier. */
static void refuse(struct uneven *u, struct conn *c, uint64_t request_id, const char *msg) {
  send_refusal(u->s, c, PS__ERROR_CODE__ERR_UNEVEN_STEPS, request_id, msg);
  if (!u->first[0]) snprintf(u->first, sizeof(u->first), "%s", msg);
}

/* store_serve_fn: a waiting pull that can never be answered. */
static void fail_waiter(struct store_key *k, struct store_waiter *w, void *arg) {
  struct uneven *u = arg;
  struct conn *c = w->conn;
  bool ssp = u->s->opts.consistency == STORE_SSP;
  char msg[800];
  c->waiting--;
  uneven_text(u, k, c->rank, ssp ? w->min_version : k->version, k->next_step[c->rank] > k->version,
              msg, sizeof(msg));
  refuse(u, c, w->request_id, msg);
  free(w);
}

/* Fails k's pulls that wait for the stuck rank, then (once something
 * failed) its barrier request. The first failure for a stuck rank is logged
 * and kept: its barrier request fails with it whenever it comes. */
static void fail_waiting(struct uneven *u, struct store_key *k) {
  struct server *s = u->s;
  if (k) store_take_waiters_on(&s->store, k, u->stuck, fail_waiter, u);
  if (!u->first[0]) return;
  uint64_t request_id;
  struct conn *w = handlers_barrier_take(s, u->stuck, &request_id);
  if (w) send_refusal(s, w, PS__ERROR_CODE__ERR_UNEVEN_STEPS, request_id, u->first);
  if (s->uneven[u->stuck]) return;
  s->uneven[u->stuck] = strdup(u->first); /* NULL: it is only logged again */
  char q[900];
  log_error("a step can never complete: the ranks ran different numbers of steps",
            "stuck_rank=%" PRIu32 " error=%s", u->stuck, log_quote(q, sizeof(q), u->first));
}

/* BSP: a rank other than the stuck one that pushed k's current step. */
static uint32_t a_pusher(const struct server *s, const struct store_key *k, uint32_t stuck) {
  for (uint32_t r = 0; r < s->opts.num_workers; r++)
    if (r != stuck && k->next_step[r] > k->version) return r;
  return stuck;
}

void leave_check(struct server *s, uint32_t rank) {
  struct uneven u = {.s = s, .stuck = rank, .why = stuck_why(s, rank)};
  if (!u.why) return;
  bool bsp = s->opts.consistency == STORE_BSP;
  for (size_t i = 0; i < s->store.num_keys; i++) {
    struct store_key *k = &s->store.keys[i];
    if (bsp && !u.first[0] && k->pushed > 0 && store_waits_for(&s->store, k, rank, k->version + 1))
      uneven_text(&u, k, a_pusher(s, k, rank), k->version, true, u.first, sizeof(u.first));
    store_take_waiters_on(&s->store, k, rank, fail_waiter, &u);
  }
  if (!u.first[0] && s->uneven[rank]) /* a step it never pushed was refused before */
    snprintf(u.first, sizeof(u.first), "%s", s->uneven[rank]);
  fail_waiting(&u, NULL);
}

/* A request of c's rank about k at `step` (BSP push: pushed; pull: waiting
 * for min_version) that waits for stuck ranks other than `skip`: refused
 * once, naming the first of them, and for each the pulls of k that wait
 * for it and its barrier request fail too. Returns whether it was. */
static bool refuse_uneven(struct conn *c, uint64_t request_id, struct store_key *k,
                          uint64_t min_version, uint64_t step, bool pushed, uint32_t skip) {
  struct server *s = c->srv;
  bool refused = false;
  if (!s->store.num_finished && !s->barrier.arrived) return false; /* nobody is stuck */
  for (uint32_t f = 0; f < s->opts.num_workers; f++) {
    struct uneven u = {.s = s, .stuck = f, .why = stuck_why(s, f)};
    if (f == skip || !u.why || !store_waits_for(&s->store, k, f, min_version)) continue;
    uneven_text(&u, k, c->rank, step, pushed, u.first, sizeof(u.first));
    if (!refused) send_refusal(s, c, PS__ERROR_CODE__ERR_UNEVEN_STEPS, request_id, u.first);
    refused = true;
    fail_waiting(&u, k);
  }
  return refused;
}

bool leave_refuses_push(struct conn *c, const wire_header *h, struct store_key *k) {
  struct server *s = c->srv;
  uint32_t g = c->rank;
  if (!k->params || h->step < k->next_step[g]) return false; /* resends are the store's */
  enum store_left left = store_left(&s->store, g);
  if (left != STORE_IN) {
    char msg[400];
    snprintf(msg, sizeof(msg),
             "worker %" PRIu32 " pushed step %" PRIu64 " of key %" PRIu64
             " after it left the steps at step %" PRIu64
             " (ps_leave, %s): a rank that called ps_leave pushes no further step",
             g, h->step, k->key, k->next_step[g], left == STORE_JOINED ? "joined" : "finished");
    send_refusal(s, c, PS__ERROR_CODE__ERR_BAD_STEP, h->request_id, msg);
    return true;
  }
  if (s->opts.consistency != STORE_BSP || h->step != k->version) return false;
  return refuse_uneven(c, h->request_id, k, k->version + 1, h->step, true, g);
}

bool leave_refuses_pull(struct conn *c, const wire_header *h, struct store_key *k) {
  bool ssp = c->srv->opts.consistency == STORE_SSP;
  return refuse_uneven(c, h->request_id, k, h->version, ssp ? h->version : k->version,
                       k->next_step[c->rank] > k->version, UINT32_MAX);
}

void leave_reset(struct server *s, uint32_t rank, bool rollback) {
  if (rollback) { /* the steps are replayed: what was refused may be right now */
    free(s->uneven[rank]);
    s->uneven[rank] = NULL;
  }
  if (store_left(&s->store, rank) == STORE_IN) return;
  store_set_left(&s->store, rank, STORE_IN); /* nothing completes: it counts again */
  log_info("worker takes part in the steps again", "rank=%" PRIu32 " why=%s", rank,
           rollback ? "rollback" : "hello");
}

void leave_handle(struct conn *c, const wire_header *h, const void *payload) {
  struct server *s = c->srv;
  (void)payload;
  if (h->flags != STORE_IN && h->flags != STORE_JOINED && h->flags != STORE_FINISHED) {
    conn_fail(c, PS__ERROR_CODE__ERR_PROTOCOL,
              "leave of kind %" PRIu32 " (expected 0 = back, 1 = joined or 2 = finished)",
              h->flags);
    return;
  }
  enum store_left was = store_left(&s->store, c->rank);
  if (h->flags == STORE_IN) { /* ps_rejoin: a joined rank trains again */
    if (was == STORE_JOINED) {
      store_rejoin(&s->store, c->rank);
      log_info("worker takes part in the steps again", "rank=%" PRIu32 " why=rejoin clock=%" PRIu64,
               c->rank, store_worker_clock(&s->store, c->rank));
    }
    conn_ack(c, h, 0);
    return;
  }
  enum store_left how = was == STORE_JOINED ? STORE_JOINED : (enum store_left)h->flags;
  if (how != was) {
    int r = store_set_left(&s->store, c->rank, how);
    log_info("worker left the steps", "rank=%" PRIu32 " how=%s clock=%" PRIu64, c->rank,
             how == STORE_JOINED ? "joined" : "finished", store_worker_clock(&s->store, c->rank));
    if (r < 0)
      log_error("cannot complete a step without the joined worker", "error=%s", strerror(-r));
  }
  conn_ack(c, h, 0);
  if (how == STORE_FINISHED) leave_check(s, c->rank);
  server_drain_check(s);
}
