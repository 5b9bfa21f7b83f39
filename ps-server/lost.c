/* lost: a shard that finds the job's state gone says so to every rank and
 * stops, rather than serve the job wrongly (docs/RELIABILITY.md, "When the
 * job's state is lost").
 *
 * The state goes in four ways, each found here:
 *  - This shard restarted without a checkpoint (none configured, none valid,
 *    the directory gone) while the job had started: a worker's LAYOUT after
 *    its reconnect says so (WIRE_LAYOUT_STARTED and its clock). With an
 *    optimizer the parameters died with the process; with --optimizer sum
 *    the pushes it had acknowledged did, so the step can never complete.
 *  - A rollback this shard cannot follow (its checkpoint of the clock is
 *    missing or invalid): half the job would move back and half not.
 *  - A push that the rank's clock would take for a resend but that its
 *    process never sent here: a restarted worker (a new incarnation in its
 *    LAYOUT that started fresh) pushing steps the shard already holds from
 *    its earlier process. Taken as a duplicate it would be dropped silently.
 *  - Another shard found one of these: a worker relays it (MSG_ABORT).
 * In each case the shard enters the lost state once, with one message:
 * every waiting pull and barrier, and every later request of every rank,
 * fails with ERR_STATE_LOST and that message (libps: PS_ERR_STATE_LOST,
 * which relays MSG_ABORT to the other shards; ps-worker exits 3). Once
 * every live rank was told, or LOST_GRACE_MS passed, the shard stops
 * without a final checkpoint and server_run returns -ESTALE (exit 3).
 *
 * One fault is not lost: with --optimizer sum the workers hold the
 * parameters, so a worker process that restarts fresh (nothing pushed,
 * step 0) starts the job over. The shard then drops its keys for rank 0 to
 * initialise again, and the processes of the earlier run (their
 * incarnations) are refused as stale. A fresh process of a rank that had
 * pushed nothing here is a late joiner, not a restart; workers of one run
 * restarting one after the other reset the shard once: the second finds
 * none of its steps left.
 *
 * A worker's process is told apart by the incarnation in its LAYOUT (sent
 * on every connection before any request); a client that gives none (0, an
 * older libps or one that declared nothing) is never judged. */
#include <errno.h>
#include <inttypes.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ckpt.h"
#include "ckpt_writer.h"
#include "log.h"
#include "shard_http.h"
#include "server_impl.h"

#define LOST_GRACE_MS 15000u

/* ---- the lost state ------------------------------------------------------- */

static void lost_stop(struct server *s) {
  server_fail(s, -ESTALE, "the job's state is lost (ERR_STATE_LOST)");
}

void lost_told(struct server *s, uint32_t rank) {
  s->ranks[rank].told = true;
}

static void on_lost_grace(uv_timer_t *t) {
  struct server *s = container_of(t, struct server, lost_timer);
  log_warn("not every rank was told the job is lost; stopping anyway", "grace_ms=%u",
           LOST_GRACE_MS);
  lost_stop(s);
}

/* Whether every rank not declared gone was told (a rank still
 * reconnecting will be: the shard waits for it, up to LOST_GRACE_MS). */
static bool all_told(const struct server *s) {
  for (uint32_t r = 0; r < s->opts.num_workers; r++)
    if (!s->ranks[r].told && !store_is_gone(&s->store, r)) return false;
  return true;
}

/* rank was told: the shard stops once every live rank was. */
static void told(struct server *s, uint32_t rank) {
  lost_told(s, rank);
  if (all_told(s)) lost_stop(s);
}

void lost_enter(struct server *s, const char *fmt, ...) {
  if (s->lost) return;
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(s->lost_msg, sizeof(s->lost_msg), fmt, ap);
  va_end(ap);
  s->lost = true;
  log_error("the job's state is lost: stopping", "detail=\"%s\"", s->lost_msg);
  server_fail_waiting(s, PS__ERROR_CODE__ERR_STATE_LOST, s->lost_msg);
  if (s->stopping) return;
  uv_timer_init(&s->loop, &s->lost_timer);
  uv_timer_start(&s->lost_timer, on_lost_grace, LOST_GRACE_MS, 0);
  uv_unref((uv_handle_t *)&s->lost_timer);
  s->lost_timer_on = true;
  if (all_told(s)) lost_stop(s);
}

void lost_close(struct server *s) {
  if (s->lost_timer_on) uv_close((uv_handle_t *)&s->lost_timer, NULL);
  s->lost_timer_on = false;
}

/* ---- what each request meets ------------------------------------------------ */

bool lost_refuses(struct conn *c, const wire_header *h) {
  struct server *s = c->srv;
  if (!c->has_rank) return false;
  struct rank_run *rr = &s->ranks[c->rank];
  if (s->lost) {
    conn_error(c, h->request_id, PS__ERROR_CODE__ERR_STATE_LOST, s->lost_msg);
    told(s, c->rank);
    return true;
  }
  if (c->incarnation == 0 || (c->incarnation == rr->incarnation && !rr->stale)) return false;
  char msg[400];
  if (c->incarnation != rr->incarnation)
    snprintf(msg, sizeof(msg),
             "rank %" PRIu32
             " restarted in another process since this one connected to shard %" PRIu32
             ": this process is superseded and must stop",
             c->rank, s->opts.shard);
  else
    snprintf(msg, sizeof(msg),
             "the job started over from step 0 on shard %" PRIu32
             " (--optimizer sum: a worker "
             "restarted as a new process); this process of rank %" PRIu32
             " belongs to the earlier run: restart it too",
             s->opts.shard, c->rank);
  conn_error(c, h->request_id, PS__ERROR_CODE__ERR_STATE_LOST, msg);
  return true;
}

bool lost_false_duplicate(struct conn *c, const wire_header *h, const struct store_key *k) {
  struct server *s = c->srv;
  if (c->incarnation == 0 || !k->params || h->rank >= s->opts.num_workers) return false;
  /* a rank the steps went on without rejoins fast-forwarded: its steps
   * below the clock are stale by design (--on-worker-timeout continue) */
  if (s->lost_ever[h->rank]) return false;
  struct rank_run *rr = &s->ranks[h->rank];
  uint64_t next = k->next_step[h->rank];
  if (h->step >= next) {
    if (h->step < rr->first_step) rr->first_step = h->step;
    return false;
  }
  if (h->step >= rr->first_step) return false; /* this process pushed it: a resend */
  lost_enter(
      s,
      "rank %" PRIu32 " (a new process) pushed step %" PRIu64 " of key %016" PRIx64
      ", but shard %" PRIu32 " holds this rank's steps up to %" PRIu64
      " from an earlier process: the shards and the workers disagree on where the job is "
      "(a shard restarted without its checkpoint, or a worker resumed at the wrong step); "
      "restart every shard and worker, from step 0 or from checkpoints that every shard holds",
      h->rank, h->step, k->key, s->opts.shard, next - 1);
  conn_error(c, h->request_id, PS__ERROR_CODE__ERR_STATE_LOST, s->lost_msg);
  told(s, c->rank);
  return true;
}

/* ---- layout ------------------------------------------------------------------------ */

/* The LAYOUT names c's process (Header.incarnation). */
static void note_process(struct conn *c, uint64_t incarnation) {
  struct server *s = c->srv;
  c->incarnation = incarnation;
  if (incarnation == 0) return;
  struct rank_run *rr = &s->ranks[c->rank];
  if (rr->incarnation != 0 && rr->incarnation != incarnation)
    log_warn("worker restarted as a new process", "rank=%" PRIu32 " peer=%s", c->rank, c->peer);
  if (rr->incarnation != incarnation) {
    rr->incarnation = incarnation;
    rr->stale = false;
    rr->first_step = 0; /* unknown until its LAYOUT says whether it pushed before */
  }
}

/* Whether the shard holds steps an earlier process of rank pushed. */
static bool rank_progressed(const struct server *s, uint32_t rank) {
  for (size_t i = 0; i < s->store.num_keys; i++) {
    const struct store_key *k = &s->store.keys[i];
    if (k->params && k->next_step[rank] > 0) return true;
  }
  return false;
}

static bool any_initialised(const struct server *s) {
  for (size_t i = 0; i < s->store.num_keys; i++)
    if (s->store.keys[i].params) return true;
  return false;
}

/* --optimizer sum, a fresh process of rank: the job starts over. */
static int start_over(struct server *s, uint32_t rank) {
  struct store fresh;
  int r = store_init(&fresh, &s->store.opts, handlers_serve_waiter, s);
  if (r < 0) return r;
  log_warn("a worker started the job over: the shard drops its keys for rank 0 to initialise",
           "rank=%" PRIu32
           " detail=\"--optimizer sum: the workers hold the parameters, and a "
           "restarted one begins at step 0; the others' processes of the earlier run are refused\"",
           rank);
  bool ckpts = server_checkpoint_quiesce(s) == 0;
  server_fail_waiting(s, PS__ERROR_CODE__ERR_STATE_LOST,
                      "the job started over from step 0 (--optimizer sum: a worker restarted as "
                      "a new process); this process belongs to the earlier run: restart it too");
  rollback_replace_store(s, &fresh);
  if (ckpts) ckpt_remove_after(s->opts.checkpoint_dir, s->opts.shard, s->opts.job_id, 0);
  rollback_forget(&s->rb);
  for (uint32_t i = 0; i < s->opts.num_workers; i++) {
    s->ranks[i].stale = i != rank;
    s->ranks[i].told = false; /* server_fail_waiting counted those it told */
  }
  return 0;
}

bool lost_on_layout(struct conn *c, const wire_header *h) {
  struct server *s = c->srv;
  note_process(c, h->incarnation);
  if (c->incarnation == 0) return false;
  struct rank_run *rr = &s->ranks[c->rank];
  bool started = h->flags & WIRE_LAYOUT_STARTED;
  if (!started) {
    rr->first_step = UINT64_MAX; /* a fresh process: nothing it pushes is a resend yet */
    rr->stale = false;
    /* a rank the steps went on without rejoins fast-forwarded instead */
    if (s->opts.opt.kind == OPT_SUM && !s->lost && !s->lost_ever[c->rank] &&
        rank_progressed(s, c->rank) && start_over(s, c->rank) < 0) {
      conn_fail(c, PS__ERROR_CODE__ERR_TOO_LARGE, "out of memory starting the job over");
      return true;
    }
    return false;
  }
  if (rr->stale || s->lost) return false; /* its next request is refused, naming why */
  if (s->rb.restored || any_initialised(s)) return false;
  if (s->opts.opt.kind == OPT_SUM)
    lost_enter(s,
               "shard %" PRIu32 " restarted without its state at step %" PRIu64
               " (--optimizer sum: the pushes it had taken died with it, so the step can never "
               "complete): restart every worker; they start the job over from step 0",
               s->opts.shard, h->step);
  else
    lost_enter(s,
               "shard %" PRIu32 " restarted without a checkpoint at step %" PRIu64
               ": the job cannot continue without its parameters (%s); restart every shard and "
               "worker, from step 0 or from checkpoints that every shard holds",
               s->opts.shard, h->step,
               s->opts.checkpoint_dir[0] ? "no valid checkpoint in --checkpoint-dir"
                                         : "the shards run without --checkpoint-dir");
  conn_fail(c, PS__ERROR_CODE__ERR_STATE_LOST, "%s", s->lost_msg);
  told(s, c->rank);
  return true;
}

/* ---- MSG_ABORT ------------------------------------------------------------------ */

void lost_handle_abort(struct conn *c, const wire_header *h, const void *payload) {
  struct server *s = c->srv;
  (void)payload;
  const char *why = h->body_case == PS__HEADER__BODY_ERROR && h->error->message
                        ? h->error->message
                        : "(no reason given)";
  struct rank_run *rr = c->has_rank ? &s->ranks[c->rank] : NULL;
  /* a superseded process, or one of a run the job started over from, was
   * told so; its relay must not stop the job that replaced it */
  if (rr && c->incarnation && (c->incarnation != rr->incarnation || rr->stale)) {
    log_info("ignoring MSG_ABORT from a process the job no longer runs", "rank=%" PRIu32 " peer=%s",
             c->rank, c->peer);
    conn_ack(c, h, 0);
    return;
  }
  if (!s->lost) lost_enter(s, "rank %" PRIu32 " stopped the job: %s", c->rank, why);
  conn_ack(c, h, 0);
  told(s, c->rank);
}
