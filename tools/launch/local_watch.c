/* local_watch: once a worker of a ps-local run exited 0, the others are
 * watched so that the launcher never waits on one that can never finish:
 * one stopped (SIGSTOP, Ctrl-Z of its own, a tracer) for STOPPED_MS, or one
 * still running left_behind_ms after every shard exited by itself (rank 0
 * ended the training). Each is named on stderr, killed (SIGKILL reaches a
 * stopped process) and the job stopped as after a failure; ps-local then
 * exits 129 (a lost rank: retryable). */
#include <signal.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>

#include "clock.h"
#include "local_run_impl.h"
#include "procs.h"

/* The first worker that exited 0, or NULL: the job is decided for a rank
 * that can no longer finish once one has. */
const struct child *local_finished_worker(const struct launcher *L) {
  for (int i = 0; i < L->num_kids; i++)
    if (L->kids[i].kind == CHILD_WORKER && procs_exited_ok(&L->kids[i].proc)) return &L->kids[i];
  return NULL;
}

/* Whether every shard exited by itself (rank 0 told them training is
 * over; one that failed has stopped the job already). Never in allreduce
 * mode, which has none to tell us. */
static bool shards_gone(const struct launcher *L) {
  int shards = 0;
  for (int i = 0; i < L->num_kids; i++) {
    const struct child *k = &L->kids[i];
    if (k->kind != CHILD_SHARD) continue;
    if (k->proc.running || k->proc.signalled) return false;
    shards++;
  }
  return shards > 0;
}

static const char *stop_signal_name(int sig) {
  switch (sig) {
    case SIGSTOP:
      return "SIGSTOP";
    case SIGTSTP:
      return "SIGTSTP";
    case SIGTTIN:
      return "SIGTTIN";
    case SIGTTOU:
      return "SIGTTOU";
    default:
      return "a stop signal";
  }
}

/* Kills worker k, which can no longer finish, saying why (one line naming
 * it); the caller stops the job. SIGKILL, since it may be stopped. */
static void lose_worker(struct launcher *L, struct child *k, const char *why) {
  fprintf(stderr, "ps-local: %s (pid %d) %s: killed it; the job did not complete\n", k->proc.name,
          (int)k->proc.pid, why);
  procs_kill(&k->proc, SIGKILL);
  if (!L->first_lost) L->first_lost = k;
}

/* TRAIN, once a worker exited 0: a worker that has been stopped (SIGSTOP,
 * Ctrl-Z of its own, a tracer) for STOPPED_MS, or that still runs
 * left_behind_ms after every shard exited by itself, would be waited on
 * for ever: it is killed and the job stopped as after a failure (exit
 * 129). The caller wakes us every WATCH_MS meanwhile. */
void local_watch(struct launcher *L) {
  const struct child *done = L->phase == PHASE_TRAIN ? local_finished_worker(L) : NULL;
  if (!done) return;
  uint64_t now = clock_now_ms();
  if (!L->shards_gone_ms && shards_gone(L)) L->shards_gone_ms = now;
  bool late = L->shards_gone_ms && now - L->shards_gone_ms >= (uint64_t)L->left_behind_ms;
  int running = local_running_count(L, true);
  for (int i = 0; i < L->num_kids; i++) {
    struct child *k = &L->kids[i];
    if (k->kind != CHILD_WORKER || !k->proc.running) continue;
    int sig = 0;
    enum procs_stop st = procs_stopped(&k->proc, &sig);
    if (st == PROCS_NOT_STOPPED)
      k->stopped_ms = 0;
    else if (!k->stopped_ms)
      k->stopped_ms = now;
    bool stuck = k->stopped_ms && now - k->stopped_ms >= STOPPED_MS;
    if (!stuck && !late) continue;
    char why[200], others[40];
    if (running == 1)
      snprintf(others, sizeof(others), "the others");
    else
      snprintf(others, sizeof(others), "rank %d", done->index);
    if (st == PROCS_TRACED)
      snprintf(why, sizeof(why), "was stopped (traced) while %s had finished", others);
    else if (st == PROCS_STOPPED)
      snprintf(why, sizeof(why), "was stopped (%s) while %s had finished", stop_signal_name(sig),
               others);
    else
      snprintf(why, sizeof(why), "still ran %d s after the shards had exited (training was over)",
               L->left_behind_ms / 1000);
    lose_worker(L, k, why);
  }
  if (L->first_lost) local_begin_stop(L);
}
