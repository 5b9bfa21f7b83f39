/* rollback: the job rollback on one shard (rollback.h says how it works;
 * server_impl.h who calls whom).
 *
 * Everything here runs on the shard's loop. The state is struct rollback
 * (server.rb), written only here; the store is replaced only here
 * (rollback_replace_store), after the checkpoint writer went idle
 * (server_checkpoint_quiesce) and the waiting pulls of the abandoned
 * timeline failed with ERR_ROLLBACK. */
#include "rollback.h"

#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <uv.h>

#include "auth.h"
#include "ckpt.h"
#include "ckpt_dir.h"
#include "log.h"
#include "server_impl.h"
#include "store.h"

int rollback_init(struct rollback *rb, uint32_t num_workers) {
  *rb = (struct rollback){0};
  rb->rolled_back = calloc(num_workers ? num_workers : 1, sizeof(*rb->rolled_back));
  return rb->rolled_back ? 0 : -ENOMEM;
}

void rollback_deinit(struct rollback *rb) {
  free(rb->rolled_back);
  rb->rolled_back = NULL;
}

void rollback_restored(struct rollback *rb, uint64_t clock) {
  rb->restored = true;
  rb->restored_clock = clock;
}

void rollback_forget(struct rollback *rb) {
  rb->restored = false;
  rb->open = false;
}

bool rollback_waits_for(const struct rollback *rb, uint32_t rank) {
  return rb->open && !rb->rolled_back[rank];
}

void rollback_replace_store(struct server *s, struct store *fresh) {
  fresh->stats = s->store.stats; /* the traffic counters are the server's own */
  /* Not who left the steps: that was in the abandoned timeline, and every
   * rank replays its steps from the clock (and leaves again). */
  for (uint32_t i = 0; i < s->opts.num_workers; i++)
    if (s->store.gone[i]) store_worker_gone(fresh, i);
  store_deinit(&s->store);
  s->store = *fresh;
  server_checkpoints_hook(s);
}

/* ERR_ROLLBACK: the request is behind-the-shard's-state; version = the
 * clock the job must roll back to, rollback_id = the job rollback (0 =
 * none: the worker's MSG_ROLLBACK then follows the rule of old clients). */
static void send_rollback(struct conn *c, uint64_t request_id, uint64_t clock, uint64_t id,
                          const char *msg) {
  wire_header h;
  Ps__Error err;
  wire_error_frame(&h, &err, request_id, PS__ERROR_CODE__ERR_ROLLBACK, msg);
  h.version = clock;
  h.rollback_id = id;
  conn_send(c, &h, NULL);
}

/* store_serve_fn for a rollback: a waiting pull is from the abandoned
 * timeline and fails with ERR_ROLLBACK. */
static void rollback_waiter(struct store_key *k, struct store_waiter *w, void *arg) {
  struct server *s = arg;
  (void)k;
  ((struct conn *)w->conn)->waiting--;
  send_rollback(w->conn, w->request_id, s->rb.restored_clock, s->rb.id, "the shard rolled back");
  free(w);
}

/* Whether the shard holds more than its checkpoint of clock would: a key
 * past it, or (strict) half a step, which the abandoned timeline pushed. */
static bool beyond_clock(const struct server *s, uint64_t clock, bool strict) {
  if (!s->store.has_layout) return true;
  for (size_t i = 0; i < s->store.num_keys; i++)
    if (s->store.keys[i].version > clock) return true;
  return strict && !store_at_step_boundary(&s->store);
}

/* Replaces the store with this shard's checkpoint of clock: waits for the
 * writer, fails the waiting pulls (ERR_ROLLBACK with the current id) and
 * deletes the checkpoints after clock (a later restart must not load the
 * abandoned timeline). Returns 0, or a negative errno with err set. */
static int rollback_reload(struct server *s, uint64_t clock, struct ckpt_info *info, char *err,
                           size_t errlen) {
  if (server_checkpoint_quiesce(s) < 0) {
    snprintf(err, errlen, "this shard runs without --checkpoint-dir");
    return -ENOENT;
  }
  struct store fresh;
  int r = store_init(&fresh, &s->store.opts, handlers_serve_waiter, s);
  if (r == 0) r = ckpt_load_clock(s->opts.checkpoint_dir, &fresh, clock, info, err, errlen);
  if (r < 0) {
    store_deinit(&fresh);
    return r;
  }
  s->rb.restored = true;
  s->rb.restored_clock = clock;
  store_take_waiters(&s->store, rollback_waiter, s);
  rollback_replace_store(s, &fresh);
  ckpt_remove_after(s->opts.checkpoint_dir, s->opts.shard, s->opts.job_id, clock);
  return 0;
}

/* This shard cannot follow the job back to clock: no rank and no shard may
 * go on (half the job would be back at clock and half not), so the job is
 * lost, with advice that works: the shards' checkpoints cannot give the
 * job a common clock any more. */
static void rollback_impossible(struct server *s, uint64_t clock, const char *err) {
  lost_enter(s,
             "shard %" PRIu32 " cannot roll back to clock %" PRIu64
             " (%s): the job cannot continue from its checkpoints; restart every shard and worker "
             "from step 0 (move the shards' checkpoint directories away), or give shard %" PRIu32
             " its checkpoint of clock %" PRIu64,
             s->opts.shard, clock, err, s->opts.shard, clock);
}

/* Counts rank in; the rollback is over once every live rank is. */
static void rollback_count_in(struct server *s, uint32_t rank) {
  s->rb.rolled_back[rank] = true;
  for (uint32_t r = 0; r < s->opts.num_workers; r++)
    if (!s->rb.rolled_back[r] && !store_is_gone(&s->store, r)) return;
  s->rb.open = false;
  log_info("every live rank rolled back", "rollback=%016" PRIx64 " clock=%" PRIu64, s->rb.id,
           s->rb.clock);
}

/* Enters job rollback `id` to clock: reloads the checkpoint of clock unless
 * the shard is exactly there, then refuses the ranks not counted in yet.
 * Returns 1 if it reloaded, 0 if not, or a negative errno with err set. */
static int rollback_enter(struct server *s, uint64_t clock, uint64_t id, char *err, size_t errlen) {
  s->rb.id = id;
  s->rb.clock = clock;
  s->rb.open = true;
  memset(s->rb.rolled_back, 0, s->opts.num_workers * sizeof(*s->rb.rolled_back));
  if (!beyond_clock(s, clock, true)) return 0;
  uint64_t t0 = uv_hrtime();
  struct ckpt_info info;
  int r = rollback_reload(s, clock, &info, err, errlen);
  if (r < 0) {
    s->rb.open = false;
    return r;
  }
  log_warn("rolled back to a checkpoint",
           "rollback=%016" PRIx64 " clock=%" PRIu64 " path=%s seconds=%.3f", id, clock, info.path,
           (uv_hrtime() - t0) / 1e9);
  return 1;
}

/* The job is ahead of this restored shard: the first refusal starts the
 * job rollback to its checkpoint (with a fresh id); later ones belong to
 * it. Returns the id to refuse with. */
static uint64_t rollback_found(struct server *s) {
  if (s->rb.open && s->rb.clock == s->rb.restored_clock) return s->rb.id;
  uint64_t id = 0;
  if (auth_random(&id, sizeof(id)) < 0 || id == 0) id = uv_hrtime() | 1;
  char err[600] = "";
  if (rollback_enter(s, s->rb.restored_clock, id, err, sizeof(err)) < 0)
    rollback_impossible(s, s->rb.restored_clock, err);
  log_warn("the job is ahead of this shard: rolling it back",
           "rollback=%016" PRIx64 " clock=%" PRIu64, id, s->rb.restored_clock);
  return id;
}

/* While a rollback is open, a rank not counted in is refused: it still
 * works in the abandoned timeline. Returns true if c's request was. */
bool rollback_refuses(struct conn *c, const wire_header *h) {
  struct server *s = c->srv;
  if (!s->rb.open || !c->has_rank || s->rb.rolled_back[c->rank]) return false;
  char why[200];
  snprintf(why, sizeof(why),
           "rank %" PRIu32 " has not rolled back to clock %" PRIu64
           " yet (the job is rolling back)",
           c->rank, s->rb.clock);
  send_rollback(c, h->request_id, s->rb.clock, s->rb.id, why);
  return true;
}

bool rollback_refuses_push(struct conn *c, const wire_header *h, struct store_key *k) {
  struct server *s = c->srv;
  if (rollback_refuses(c, h)) return true;
  if (!s->rb.restored || s->opts.consistency != STORE_BSP || !k->params || h->step <= k->version)
    return false;
  char why[200];
  snprintf(why, sizeof(why),
           "push for step %" PRIu64 " of key %016" PRIx64 " at version %" PRIu64 ": shard %" PRIu32
           " is back at checkpoint clock %" PRIu64,
           h->step, k->key, k->version, s->opts.shard, s->rb.restored_clock);
  uint64_t id = rollback_found(s);
  send_rollback(c, h->request_id, s->rb.restored_clock, id, why);
  return true;
}

bool rollback_refuses_pull(struct conn *c, const wire_header *h, struct store_key *k) {
  struct server *s = c->srv;
  /* BSP: a worker at step s pushed step s-1 of every key (on this
   * connection, before this pull), so a key is at version >= s-1 and, if it
   * is at s-1, holds the puller's push. A pull further ahead means this shard went back to an
   * older checkpoint (kill -9 after its last one) while the job went on:
   * ERR_ROLLBACK tells the worker the clock to roll the job back to. */
  if (s->opts.consistency == STORE_BSP && k->params &&
      (h->version > k->version + 1 || (s->rb.restored && h->version == k->version + 1 &&
                                       c->has_rank && k->next_step[c->rank] <= k->version))) {
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
    if (s->rb.restored) {
      uint64_t id = rollback_found(s);
      send_rollback(c, h->request_id, s->rb.restored_clock, id, msg);
    } else {
      send_rollback(c, h->request_id, k->version, 0, msg);
    }
    return true;
  }
  return false;
}

/* MSG_ROLLBACK(clock, id): a shard restarted from checkpoint `clock` while
 * the job was ahead; every shard goes back to its own checkpoint of that
 * clock (each keeps its two newest, written at the same clocks), so the
 * whole job continues from one consistent state. Once per id (see the
 * header comment): a rank's MSG_ROLLBACK for the rollback this shard is in
 * only counts it in. Without an id (an older client) a shard reloads when a
 * key is past clock, and only acks otherwise. */
void rollback_handle(struct conn *c, const wire_header *h, const void *payload) {
  struct server *s = c->srv;
  (void)payload;
  uint64_t clock = h->version, id = h->rollback_id;
  /* a worker waiting in the barrier is done with steps the job redoes now */
  for (uint32_t r = 0; r < s->opts.num_workers; r++) {
    uint64_t request_id;
    struct conn *w = handlers_barrier_take(s, r, &request_id);
    if (w) send_rollback(w, request_id, clock, id, "the job rolled back");
  }
  char err[600] = "";
  int r = 0;
  if (id != 0 && id != s->rb.id) {
    r = rollback_enter(s, clock, id, err, sizeof(err));
  } else if (id == 0 && beyond_clock(s, clock, false)) {
    uint64_t t0 = uv_hrtime();
    struct ckpt_info info;
    s->rb.id = 0;
    s->rb.open = false;
    r = rollback_reload(s, clock, &info, err, sizeof(err));
    if (r == 0) {
      log_warn("rolled back to a checkpoint",
               "rank=%" PRIu32 " clock=%" PRIu64 " path=%s seconds=%.3f", c->rank, clock, info.path,
               (uv_hrtime() - t0) / 1e9);
      r = 1;
    }
  }
  if (r < 0) {
    rollback_impossible(s, clock, err);
    lost_refuses(c, h); /* tells c, and counts it told */
    return;
  }
  if (id != 0) rollback_count_in(s, c->rank);
  leave_reset(s, c->rank, true); /* it replays its steps, and leaves again */
  conn_ack(c, h, r == 1 ? 0 : 1);
}
