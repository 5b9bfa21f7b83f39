/* server: a shard's lifecycle (see server.h; server_impl.h says who owns
 * what and who calls whom).
 *
 * server_run builds everything before the loop runs, in this order: the
 * store, the loop, the checkpoints (the newest valid one is loaded before
 * the shard listens, so a worker never sees a half-restored shard), the
 * listener, signals, the metrics hook, the sweep and watchdog timers; then
 * it reports ready and writes the port file. Every handle lives inside
 * struct server, and the loop ends once all of them are closed.
 *
 * Stopping happens once (server_stop, guarded by `stopping`): a final
 * checkpoint is written if the shard keeps them, every handle of the shard
 * is closed, and the connections are closed after their queued replies,
 * at once or, after a SHUTDOWN from worker 0, when the workers have hung up
 * (or the grace timer fires). With checkpoints, the first SIGTERM/SIGINT
 * drains instead: the listener closes, the handlers hold pushes that would
 * start a step, and server_drain_check stops the shard once every started
 * step is complete (or the drain timer does, after DRAIN_TIMEOUT_MS).
 *
 * Worker liveness. The server counts each rank's open (hello'd)
 * connections (rank_conns) and remembers when its last one closed
 * (rank_left_ms; for a rank never seen: when the layout was registered or
 * the checkpoint loaded). The watchdog timer, ticking at a quarter of
 * worker_timeout_ms (20 ms to 1 s), acts on ranks away for longer.
 *
 * Checkpoints. The store's update hook (on_key_update) captures each key
 * as it reaches a multiple of checkpoint_every and hands the complete
 * snapshot to the writer thread (ckpt_writer.h); the initial values are
 * taken as clock 0 (server_checkpoint_initial). Writes failing
 * checkpoint_max_failures times in a row stop the job (on_ckpt_failures),
 * as --on-worker-timeout fail does, but with a permanent exit code. */
#include "server.h"

#include <errno.h>
#include <inttypes.h>
#include <signal.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>
#include <uv.h>

#include "ckpt.h"
#include "ckpt_dir.h"
#include "ckpt_writer.h"
#include "config.h"
#include "conn_transports.h"
#include "listener.h"
#include "log.h"
#include "shard_http.h"
#include "store.h"
#include "server_impl.h"

#define DRAIN_TIMEOUT_MS 10000

static const char *const timeout_actions[] = {[WORKER_TIMEOUT_AUTO] = "auto",
                                              [WORKER_TIMEOUT_FAIL] = "fail",
                                              [WORKER_TIMEOUT_CONTINUE] = "continue"};
#define NUM_TIMEOUT_ACTIONS (sizeof(timeout_actions) / sizeof(timeout_actions[0]))

int server_timeout_action_parse(const char *s, enum worker_timeout_action *out) {
  int i = config_choice(s, timeout_actions, NUM_TIMEOUT_ACTIONS, NULL, 0);
  if (i < 0) return i;
  *out = (enum worker_timeout_action)i;
  return 0;
}

int server_timeout_action_check(const char *value, char *err, size_t errlen) {
  return config_choice(value, timeout_actions, NUM_TIMEOUT_ACTIONS, err, errlen) < 0 ? -EINVAL : 0;
}

/* --on-worker-timeout auto becomes fail under --optimizer sum, where the
 * parameters live on the workers (a worker restarted from its initial
 * values cannot rejoin a job that went on without it), and continue with an
 * optimizer on the shard (a restarted worker pulls the current parameters).
 * Writes what was chosen and why into desc. */
static void resolve_timeout_action(struct server_opts *o, char *desc, size_t len) {
  if (o->on_worker_timeout != WORKER_TIMEOUT_AUTO) {
    const char *a = timeout_actions[o->on_worker_timeout];
    snprintf(desc, len, "%s (--on-worker-timeout %s)", a, a);
    return;
  }
  o->on_worker_timeout = o->opt.kind == OPT_SUM ? WORKER_TIMEOUT_FAIL : WORKER_TIMEOUT_CONTINUE;
  snprintf(desc, len, "%s (auto: --optimizer %s)", timeout_actions[o->on_worker_timeout],
           opt_name(o->opt.kind));
}

/* ---- stopping ----------------------------------------------------------- */

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
  /* after the writes failed (on_ckpt_failures), a last one would too */
  struct ckpt_snapshot *snap =
      s->store.has_layout && !s->ckpt_failed ? ckpt_snapshot_take(&s->store) : NULL;
  ckpt_snapshot_free(s->pending);
  s->pending = NULL;
  if (s->store.has_layout && !snap && !s->ckpt_failed)
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
/* Closes the listener, once (its transport keeps track). */
static void stop_accepting(struct server *s) {
  if (s->tp) s->tp->stop_accepting(s);
}

void server_stop(struct server *s, const char *why, bool graceful) {
  if (s->stopping) return;
  s->stopping = true;
  if (graceful) s->stop_signal = 0; /* worker 0 ended the training while we drained */
  shard_http_stopping(s->opts.http, graceful); /* graceful = worker 0 ended the training */
  log_info("stopping",
           "reason=\"%s\" pushes=%" PRIu64 " pulls=%" PRIu64 " updates=%" PRIu64
           " duplicates=%" PRIu64 " lost_updates=%" PRIu64 " rejected_frames=%" PRIu64
           " auth_failures=%" PRIu64 " rejected_nonfinite=%" PRIu64 " dropped_connections=%" PRIu64
           " refused_connections=%" PRIu64,
           why, s->store.stats.pushes, s->traffic.pulls, s->store.stats.updates,
           s->store.stats.duplicates, s->store.stats.lost, s->traffic.rejected_frames,
           s->traffic.auth_failures, s->traffic.rejected_nonfinite, s->traffic.dropped,
           s->traffic.refused);
  if (s->drain_timer_on) uv_close((uv_handle_t *)&s->drain_timer, NULL);
  s->drain_timer_on = false;
  /* a lost job's state is not worth keeping: its checkpoints stay as they were */
  if (s->ckw && !s->lost) final_checkpoint(s, why);
  if (s->ckw) { /* the writer's handle must close for the loop to end */
    ckpt_snapshot_free(s->pending);
    s->pending = NULL;
    ckpt_writer_finish(s->ckw, NULL, NULL);
    s->ckw_done = s->ckw;
    s->ckw = NULL;
  }
  lost_close(s);
  stop_accepting(s);
  uv_close((uv_handle_t *)&s->sigint, NULL);
  uv_close((uv_handle_t *)&s->sigterm, NULL);
  if (s->watchdog_on) uv_close((uv_handle_t *)&s->watchdog, NULL);
  s->watchdog_on = false;
  if (s->first_timer_on) uv_close((uv_handle_t *)&s->first_timer, NULL);
  s->first_timer_on = false;
  if (!uv_is_closing((uv_handle_t *)&s->sweep)) uv_close((uv_handle_t *)&s->sweep, NULL);
  if (graceful && s->num_conns) {
    uv_timer_init(&s->loop, &s->grace);
    uv_timer_start(&s->grace, on_grace_timeout, 5000, 0);
    return;
  }
  while (s->conns) conn_close(s->conns, true);
}

void server_fail(struct server *s, int err, const char *why) {
  if (s->stopping) return;
  s->exit_error = err;
  server_stop(s, why, false);
}

/* Unlinks c from everything that may still point at it; the last
 * connection gone ends a graceful stop's wait. */
void server_conn_detach(struct conn *c) {
  struct server *s = c->srv;
  store_drop_waiters(&s->store, c);
  handlers_barrier_drop(c);
  if (c->has_rank && --s->rank_conns[c->rank] == 0) s->rank_left_ms[c->rank] = uv_now(&s->loop);
  if (s->stopping && s->num_conns == 0 && uv_is_active((uv_handle_t *)&s->grace))
    on_grace_timeout(&s->grace);
}

/* ---- missing workers ---------------------------------------------------- */

void server_rank_joined(struct server *s, uint32_t rank) {
  s->rank_conns[rank]++;
}

void server_rank_silent(struct server *s, uint32_t rank, uint64_t since) {
  if (s->rank_conns[rank] == 0) s->rank_left_ms[rank] = since;
}

void server_ranks_missed_from_now(struct server *s) {
  for (uint32_t i = 0; i < s->opts.num_workers; i++)
    if (s->rank_conns[i] == 0) s->rank_left_ms[i] = uv_now(&s->loop);
}

static bool barrier_waits_for(const struct server *s, uint32_t rank) {
  return s->barrier.slot && s->barrier.arrived > 0 && !s->barrier.slot[rank].c;
}

struct fail_all {
  struct server *s;
  Ps__ErrorCode code;
  const char *msg;
};

/* store_serve_fn for server_fail_waiting: the waiting pull fails. */
static void fail_waiter(struct store_key *k, struct store_waiter *w, void *arg) {
  struct fail_all *f = arg;
  struct conn *c = w->conn;
  (void)k;
  c->waiting--;
  conn_error(c, w->request_id, f->code, f->msg);
  if (c->has_rank) lost_told(f->s, c->rank);
  free(w);
}

void server_fail_waiting(struct server *s, Ps__ErrorCode code, const char *msg) {
  struct fail_all f = {s, code, msg};
  store_take_waiters(&s->store, fail_waiter, &f);
  for (uint32_t r = 0; r < s->opts.num_workers; r++) {
    uint64_t request_id;
    struct conn *c = handlers_barrier_take(s, r, &request_id);
    if (!c) continue;
    conn_error(c, request_id, code, msg);
    lost_told(s, r);
  }
}

/* WORKER_TIMEOUT_FAIL: every waiting request learns why, then the shard
 * stops; server_run returns -ENOTCONN. */
static void fail_job(struct server *s, uint32_t rank, uint64_t away_ms) {
  snprintf(s->fail_msg, sizeof(s->fail_msg),
           "worker rank %" PRIu32 " has been gone for %.1f s and shard %" PRIu32
           " cannot go on without it (--on-worker-timeout %s): stopping the job",
           rank, (double)away_ms / 1000.0, s->opts.shard,
           s->timeout_auto ? "auto: fail with --optimizer sum" : "fail");
  log_error("worker lost", "rank=%" PRIu32 " away_s=%.1f action=fail", rank,
            (double)away_ms / 1000.0);
  server_fail_waiting(s, PS__ERROR_CODE__ERR_WORKER_LOST, s->fail_msg);
  server_fail(s, -ENOTCONN, "a worker is gone (--on-worker-timeout fail)");
}

/* rank is gone: steps and the barrier go on without it. A rank that left
 * the steps (ps_leave) had pushed all it would; any other is a lost worker,
 * whose data the job no longer trains on: said at error level, counted
 * (ps_server_workers_lost_total) and remembered (Stats.lost_ranks). */
static void declare_gone(struct server *s, uint32_t rank, uint64_t away_ms) {
  bool left = store_left(&s->store, rank) != STORE_IN;
  int e = store_worker_gone(&s->store, rank);
  uint32_t live = s->opts.num_workers - s->store.num_gone;
  if (left) {
    log_info("worker gone after it left the steps", "rank=%" PRIu32 " away_s=%.1f", rank,
             (double)away_ms / 1000.0);
  } else {
    s->lost_ever[rank] = true;
    s->traffic.workers_lost++;
    log_error("worker lost: the job now trains without it",
              "rank=%" PRIu32 " away_s=%.1f live_workers=%" PRIu32
              " detail=\"its data is no longer used; steps complete with the live workers until "
              "it rejoins (--on-worker-timeout continue)\"",
              rank, (double)away_ms / 1000.0, live);
  }
  if (e < 0) log_error("cannot complete a step without the gone worker", "error=%s", strerror(-e));
  handlers_barrier_complete(s);
}

/* Whether no rank has a connection open (every worker is away). */
static bool no_worker_connected(const struct server *s) {
  for (uint32_t r = 0; r < s->opts.num_workers; r++)
    if (s->rank_conns[r] > 0) return false;
  return true;
}

/* Each tick: ranks away for longer than the timeout are declared gone
 * (continue, or a rank that left the steps) or stop the job (fail) once
 * the shard waits for one of them, or once no worker is connected at all
 * (the others failed elsewhere, say on another shard that did wait: nobody
 * is left to need this shard, which would otherwise run on for ever). */
static void on_watchdog(uv_timer_t *t) {
  struct server *s = container_of(t, struct server, watchdog);
  if (!s->store.has_layout || s->stopping) return;
  uint64_t now = uv_now(&s->loop);
  for (uint32_t r = 0; r < s->opts.num_workers; r++) {
    if (s->rank_conns[r] > 0 || store_is_gone(&s->store, r)) continue;
    uint64_t away = now - s->rank_left_ms[r];
    if (away < s->opts.worker_timeout_ms) continue;
    if (s->opts.on_worker_timeout == WORKER_TIMEOUT_FAIL && store_left(&s->store, r) == STORE_IN) {
      if (store_blocked_on(&s->store, r) || barrier_waits_for(s, r) || no_worker_connected(s)) {
        fail_job(s, r, away);
        return;
      }
      continue;
    }
    declare_gone(s, r, away);
  }
  server_drain_check(s);
}

/* --first-worker-timeout: the worker timeout counts from the layout, so a
 * shard no worker ever reached (their job failed before it started, a wrong
 * address) would wait forever; this bounds that wait. A layout from a
 * worker or a checkpoint disarms it. The exit is permanent (main.c: 1): a
 * restarted shard would only wait again for the same absent workers. */
static void on_first_worker_timeout(uv_timer_t *t) {
  struct server *s = container_of(t, struct server, first_timer);
  if (s->store.has_layout || s->stopping) return;
  uint64_t ms = s->opts.first_worker_timeout_ms;
  uint32_t connected = 0;
  for (uint32_t r = 0; r < s->opts.num_workers; r++)
    if (s->rank_conns[r] > 0) connected++;
  log_error("no worker sent a layout within --first-worker-timeout: stopping (exit 1)",
            "timeout_s=%.1f shard=%" PRIu32 " connected_workers=%" PRIu32 " num_workers=%" PRIu32
            " detail=\"check that the workers run and reach this shard's address\"",
            (double)ms / 1000.0, s->opts.shard, connected, s->opts.num_workers);
  server_fail(s, -ETIMEDOUT, "no layout within --first-worker-timeout");
}

/* ---- draining ----------------------------------------------------------- */

/* Draining: stops the shard once no step is left unfinished (BSP; in
 * ASP/SSP there is no step to finish). */
void server_drain_check(struct server *s) {
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
  if (!s->stopping && !s->stop_signal) s->stop_signal = signum;
  if (!s->ckw || s->draining) {
    server_stop(s, name, false);
    return;
  }
  s->draining = true;
  stop_accepting(s);
  log_info("draining before the final checkpoint", "signal=%s", name);
  uv_timer_init(&s->loop, &s->drain_timer);
  uv_timer_start(&s->drain_timer, on_drain_timeout, DRAIN_TIMEOUT_MS, 0);
  s->drain_timer_on = true;
  server_drain_check(s);
}

/* ---- checkpoints -------------------------------------------------------- */

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

void server_checkpoints_hook(struct server *s) {
  s->store.on_update = on_key_update;
  s->store.on_update_arg = s;
}

/* Once every key has its initial values, they are checkpointed as clock 0:
 * a shard killed before its first periodic checkpoint restores them and
 * the job rolls back to step 0 instead of waiting for values it lost. */
void server_checkpoint_initial(struct server *s) {
  for (size_t i = 0; i < s->store.num_keys; i++)
    if (!s->store.keys[i].params || s->store.keys[i].version != 0) return;
  struct ckpt_snapshot *snap = ckpt_snapshot_take(&s->store);
  if (snap) ckpt_writer_submit(s->ckw, snap);
}

int server_checkpoint_quiesce(struct server *s) {
  if (!s->ckw) return -ENOENT;
  ckpt_writer_wait_idle(s->ckw);
  ckpt_snapshot_free(s->pending);
  s->pending = NULL;
  return 0;
}

/* store_serve_fn for on_ckpt_failures: the waiting pull fails. */
/* ckpt_writer_fail_fn: checkpoint_max_failures writes failed in a row (a
 * full, read-only or vanished volume). Training on would lose everything
 * since the last checkpoint at the next crash, unnoticed: every waiting
 * request learns why (ERR_SHUTTING_DOWN: a permanent error for the
 * workers) and the shard stops; server_run returns -EIO (exit 3). */
static void on_ckpt_failures(void *arg, int err, const char *msg, uint32_t failures) {
  struct server *s = arg;
  if (s->stopping) return;
  s->ckpt_failed = true;
  snprintf(s->fail_msg, sizeof(s->fail_msg),
           "shard %" PRIu32 " cannot write checkpoints to %s: %s (%s, %" PRIu32
           " failures in a row, --checkpoint-max-failures %" PRIu32 "): stopping the job",
           s->opts.shard, s->opts.checkpoint_dir, strerror(-err),
           strerrorname_np(-err) ? strerrorname_np(-err) : "?", failures,
           s->opts.checkpoint_max_failures);
  log_error("checkpoints cannot be written: stopping the job",
            "dir=%s errno=%s failures=%" PRIu32 " error=\"%s\"", s->opts.checkpoint_dir,
            strerrorname_np(-err) ? strerrorname_np(-err) : "?", failures, msg);
  server_fail_waiting(s, PS__ERROR_CODE__ERR_SHUTTING_DOWN, s->fail_msg);
  server_fail(s, -EIO, "checkpoints cannot be written (--checkpoint-max-failures)");
}

/* Opens the checkpoint directory, loads this job's newest valid checkpoint
 * (saying once which files belong to another job) and starts the writer.
 * Returns 0 or a negative errno (logged). */
static int checkpoints_start(struct server *s) {
  const char *dir = s->opts.checkpoint_dir;
  const char *job = s->opts.job_id ? s->opts.job_id : "";
  char why[1200];
  int e = ckpt_dir_create(dir, why, sizeof(why));
  if (e < 0) {
    log_error("cannot use --checkpoint-dir", "path=%s error=\"%s\"", dir, why);
    return e;
  }
  ckpt_remove_temps(dir, s->opts.shard, job);
  ckpt_report_foreign(dir, s->opts.shard, job);
  uint64_t t0 = uv_hrtime();
  struct ckpt_info info;
  char err[600] = "";
  int r = ckpt_load_latest(dir, &s->store, &info, err, sizeof(err));
  if (r == 0) {
    rollback_restored(&s->rb, info.clock);
    s->store.accept_gaps = s->opts.consistency != STORE_BSP;
    if (handlers_barrier_open(s) < 0) return -ENOMEM;
    for (uint32_t i = 0; i < s->opts.num_workers; i++) s->rank_left_ms[i] = uv_now(&s->loop);
    log_info("checkpoint loaded",
             "path=%s job=\"%s\" clock=%" PRIu64 " keys=%zu param_bytes=%" PRIu64 " seconds=%.3f",
             info.path, job, info.clock, s->store.num_keys, s->store.param_bytes,
             (uv_hrtime() - t0) / 1e9);
  } else if (r == -ENOENT && strncmp(err, "no usable checkpoint", 20) == 0) {
    /* files were there and none loads: a running job cannot continue here */
    log_warn("every checkpoint of this shard is unusable, starting empty",
             "dir=%s detail=\"%s\" consequence=\"workers of a job that had started are told its "
             "state is lost (exit 3)\"",
             dir, err);
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
  ckpt_writer_on_failures(s->ckw, s->opts.checkpoint_max_failures, on_ckpt_failures, s);
  if (!s->opts.checkpoint_max_failures)
    log_warn("failed checkpoints never stop the job (--checkpoint-max-failures 0)", "dir=%s", dir);
  server_checkpoints_hook(s);
  return 0;
}

/* ---- running ------------------------------------------------------------ */

/* Listens on --listen with the transport --transport names: the one place
 * that picks a struct conn_transport_ops. */
static int bind_listener(struct server *s, char *bound, size_t boundlen) {
  s->tp = conn_transport_find(s->opts.transport);
  if (!s->tp) {
    log_error("unknown transport", "transport=%s", s->opts.transport);
    return -EINVAL;
  }
  return s->tp->listen(s, bound, boundlen);
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

/* shard_http_snapshot_fn: runs on the loop when a scrape or probe wants fresh values. */
static void publish_metrics(void *arg) {
  struct server *s = arg;
  if (s->tp && s->tp->count) s->tp->count(s);
  shard_http_publish(s->opts.http, &s->store, &s->traffic, s->num_conns);
  const struct ckpt_writer *w = s->ckw ? s->ckw : s->ckw_done;
  struct shard_http_ckpt c = {0};
  if (w) {
    struct ckpt_writer_stats st = ckpt_writer_stats(w);
    c = (struct shard_http_ckpt){.written = st.written,
                                 .failed = st.failed,
                                 .skipped = st.skipped,
                                 .failed_in_a_row = st.failed_in_a_row,
                                 .last_clock = st.last_clock,
                                 .last_bytes = st.last_bytes,
                                 .last_seconds = st.last_seconds,
                                 .last_done_s = st.last_done_s,
                                 .last_unix_s = st.last_unix_s};
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
                          .staleness_aware = opts->staleness_aware,
                          .method = opts->staleness_method,
                          .opt = opts->opt,
                          .job_id = opts->job_id};
  ret = -ENOMEM;
  s->rank_conns = calloc(opts->num_workers, sizeof(*s->rank_conns));
  s->rank_left_ms = calloc(opts->num_workers, sizeof(*s->rank_left_ms));
  s->lost_said = calloc(opts->num_workers, sizeof(*s->lost_said));
  s->uneven = calloc(opts->num_workers, sizeof(*s->uneven));
  s->lost_ever = calloc(opts->num_workers, sizeof(*s->lost_ever));
  s->ranks = calloc(opts->num_workers, sizeof(*s->ranks));
  if (!s->rank_conns || !s->rank_left_ms || rollback_init(&s->rb, opts->num_workers) < 0 ||
      !s->lost_said || !s->uneven || !s->lost_ever || !s->ranks ||
      store_init(&s->store, &so, handlers_serve_waiter, s) < 0)
    goto out_free;
  char on_timeout[64];
  s->timeout_auto = s->opts.on_worker_timeout == WORKER_TIMEOUT_AUTO;
  resolve_timeout_action(&s->opts, on_timeout, sizeof(on_timeout));
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
  /* unreferenced: it never keeps the loop alive; closing connections flush
   * their own queues */
  uv_check_init(&s->loop, &s->flush);
  uv_check_start(&s->flush, conn_flush_all);
  uv_unref((uv_handle_t *)&s->flush);
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
  if (opts->first_worker_timeout_ms > 0 && !s->store.has_layout) {
    uv_timer_init(&s->loop, &s->first_timer);
    uv_timer_start(&s->first_timer, on_first_worker_timeout, opts->first_worker_timeout_ms, 0);
    s->first_timer_on = true;
  }
  char mode[32];
  log_info("listening",
           "addr=%s shard=%" PRIu32 " num_shards=%" PRIu32 " num_workers=%" PRIu32
           " consistency=%s staleness=%s optimizer=%s lr=%g momentum=%g nesterov=%d "
           "weight_decay=%g"
           " beta1=%g beta2=%g eps=%g worker_timeout_s=%g on_worker_timeout=\"%s\"",
           bound, opts->shard, opts->num_shards, opts->num_workers,
           store_consistency_name(opts->consistency, opts->staleness, mode, sizeof(mode)),
           store_staleness_name(&s->store.opts), opt_name(opts->opt.kind), opts->opt.lr,
           opts->opt.momentum, opts->opt.nesterov, opts->opt.weight_decay, opts->opt.beta1,
           opts->opt.beta2, opts->opt.eps, (double)opts->worker_timeout_ms / 1000.0, on_timeout);
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
  if (opts->stop_signal) *opts->stop_signal = s->stop_signal;
out_loop:
  if (s->ckw) { /* the start failed after the writer started: nothing new to save */
    ckpt_writer_finish(s->ckw, NULL, NULL);
    s->ckw_done = s->ckw;
    s->ckw = NULL;
  }
  if (s->tp && s->tp->release) s->tp->release(s); /* what it still held of closed connections */
  listener_close_loop(&s->loop);
  if (s->tp) s->tp->free(s);
  ckpt_writer_free(s->ckw_done);
out_free:
  store_deinit(&s->store);
  handlers_barrier_free(s);
  free(s->rank_conns);
  free(s->rank_left_ms);
  free(s->lost_said);
  for (uint32_t i = 0; s->uneven && i < opts->num_workers; i++) free(s->uneven[i]);
  free(s->uneven);
  free(s->lost_ever);
  rollback_deinit(&s->rb);
  free(s->ranks);
  free(s);
  return ret;
}
