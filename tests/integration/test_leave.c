/* ps_leave, and the steps that can never complete (ERR_UNEVEN_STEPS), with
 * real shards: every rank is a libps client of its own in this process, and
 * a call that waits for another rank (the barrier) runs on a thread. The
 * shards run --optimizer sum, so a pulled version is exactly the mean of the
 * gradients pushed for its step (rank r pushes r + 1 + 10 s at step s), and
 * anything that must end is waited for at most WAIT_MS.
 *
 *  - barrier, W = 2 and 3 (one shard: it alone gets the barrier): the ranks
 *    run STEPS steps, rank 1 pushes one more, the others enter the barrier
 *    (ps.shutdown without leaving). Rank 1's pull and every barrier request
 *    fail with PS_ERR_STATE, naming both ranks, both steps, the tensor and
 *    the fix (join); the shard logs it once per stuck rank at error level.
 *  - finished, W = 2 and 3 (two shards): the same after ps_leave(FINISHED)
 *    on the ranks that stop: rank 1's extra push fails at once on every
 *    shard, and their barrier requests later too.
 *  - joined, W = 3: rank 2 joins while ranks 0 and 1 wait for it in step
 *    STEPS, which then completes with the mean of their two gradients, and
 *    so do two more steps without it; a further push of rank 2 is refused
 *    naming ps_leave, FINISHED after JOINED keeps it joined, and the
 *    barrier completes for all three once 0 and 1 arrive.
 *  - ssp:1: a joined rank does not hold the bound back; a finished one
 *    makes the pull that would wait for it fail.
 *  - reconnect: rank 1 joins and its connection keeps being dropped (no
 *    heartbeats, --idle-timeout 1); each reconnect's hello makes the shard
 *    forget the leave and libps says it again, so rank 0 goes on alone.
 *  - the API: bad kinds, before ps_declare, ps_lost_workers' arguments. */
#include <errno.h>
#include <pthread.h>
#include <sys/wait.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "clock.h"
#include "harness.h"
#include "ps.h"

#define N 3000 /* three keys of 4 KiB */
#define STEPS 2
#define WAIT_MS 10000
#define MAXW 3
#define TENSOR "bucket0#ab12"
static const char *const names[] = {TENSOR};
static const uint64_t counts[] = {N};

struct job {
  int shards, workers;
  struct test_server srv[2];
  ps_client *c[MAXW];
};

static float grads[MAXW][N], pulled[MAXW][N];

static ps_client *connect_rank(const struct job *j, int rank) {
  const char *addrs[2] = {j->srv[0].addr, j->srv[1].addr};
  struct ps_client_opts o = {.servers = addrs,
                             .num_servers = j->shards,
                             .rank = rank,
                             .world_size = j->workers,
                             .chunk_bytes = 4096,
                             .job_id = "test_leave"};
  ps_client *c;
  char err[256];
  REQUIRE(ps_client_new(&o, &c, err, sizeof(err)) == PS_OK, "rank %d connect: %s", rank, err);
  REQUIRE(ps_declare(c, 1, names, counts) == PS_OK, "rank %d declare", rank);
  return c;
}

static const char *const SUM[] = {"--optimizer", "sum", NULL};

/* Shards (with args), then the clients: rank 0 initialises the tensor with
 * zeros. */
static void job_start(struct job *j, int shards, int workers, const char *const *args) {
  memset(j, 0, sizeof(*j));
  j->shards = shards;
  j->workers = workers;
  for (int i = 0; i < shards; i++) harness_start_server(&j->srv[i], i, shards, workers, 1.0, args);
  for (int r = 0; r < workers; r++) j->c[r] = connect_rank(j, r);
  memset(pulled[0], 0, sizeof(pulled[0]));
  REQUIRE(ps_init(j->c[0], 0, pulled[0]) == PS_OK, "init");
}

/* Rank 0 ends the job: every shard exits 0 (under the sanitizers: nothing
 * leaked or misused on the way), whatever the job went through. */
static void job_stop(struct job *j) {
  REQUIRE(ps_shutdown_servers(j->c[0]) == PS_OK, "shutdown");
  for (int r = 0; r < j->workers; r++) ps_client_free(j->c[r]);
  for (int i = 0; i < j->shards; i++) {
    int st = harness_wait(j->srv[i].pid, WAIT_MS);
    REQUIRE(st >= 0 && WIFEXITED(st) && WEXITSTATUS(st) == 0, "shard %d: status %d", i, st);
  }
}

static float grad_value(int rank, uint64_t step) {
  return (float)rank + 1.0f + 10.0f * (float)step;
}

/* ---- waiting with a bound ------------------------------------------------ */

struct done {
  atomic_int over;
  ps_status st;
};

static void on_done(ps_status st, void *arg) {
  struct done *d = arg;
  d->st = st;
  atomic_store(&d->over, 1);
}

static ps_status wait_done(struct done *d, const char *what) {
  for (int i = 0; i < WAIT_MS / 5 && !atomic_load(&d->over); i++) clock_sleep_ms(5);
  REQUIRE(atomic_load(&d->over), "%s did not end within %d ms", what, WAIT_MS);
  return d->st;
}

static void push_async(struct job *j, int rank, uint64_t step, struct done *d) {
  for (int i = 0; i < N; i++) grads[rank][i] = grad_value(rank, step);
  *d = (struct done){0};
  REQUIRE(ps_push_async(j->c[rank], 0, step, grads[rank], on_done, d, NULL) == PS_OK, "push");
}

static void pull_async(struct job *j, int rank, uint64_t min_version, struct done *d) {
  *d = (struct done){0};
  REQUIRE(ps_pull_async(j->c[rank], 0, min_version, pulled[rank], on_done, d, NULL) == PS_OK,
          "pull");
}

struct barrier_call {
  pthread_t t;
  ps_client *c;
  struct done d;
};

static void *barrier_main(void *arg) {
  struct barrier_call *b = arg;
  on_done(ps_barrier(b->c), &b->d);
  return NULL;
}

static void barrier_start(struct barrier_call *b, ps_client *c) {
  *b = (struct barrier_call){.c = c};
  REQUIRE(pthread_create(&b->t, NULL, barrier_main, b) == 0, "barrier thread");
}

static ps_status barrier_end(struct barrier_call *b, const char *what) {
  ps_status st = wait_done(&b->d, what);
  pthread_join(b->t, NULL);
  return st;
}

/* ---- checks --------------------------------------------------------------- */

static void expect_all(int rank, float want, const char *what) {
  for (int i = 0; i < N; i++)
    REQUIRE(pulled[rank][i] == want, "%s: rank %d pulled [%d] = %g, expected %g", what, rank, i,
            (double)pulled[rank][i], (double)want);
}

/* The ranks in `ranks` run step s (push, then pull s+1) and pull the mean
 * of their gradients, exactly. */
static void step(struct job *j, const int *ranks, int n, uint64_t s) {
  struct done pd[MAXW], ld[MAXW];
  float mean = 0;
  for (int i = 0; i < n; i++) {
    push_async(j, ranks[i], s, &pd[i]);
    pull_async(j, ranks[i], s + 1, &ld[i]);
    mean += grad_value(ranks[i], s);
  }
  mean /= (float)n;
  for (int i = 0; i < n; i++) {
    REQUIRE(wait_done(&pd[i], "push") == PS_OK, "rank %d: push of step %llu", ranks[i],
            (unsigned long long)s);
    REQUIRE(wait_done(&ld[i], "pull") == PS_OK, "rank %d: pull after step %llu", ranks[i],
            (unsigned long long)s);
    expect_all(ranks[i], mean, "the mean over the ranks that pushed");
  }
}

static void steps_all(struct job *j, uint64_t from, uint64_t to) {
  static const int all[MAXW] = {0, 1, 2};
  for (uint64_t s = from; s < to; s++) step(j, all, j->workers, s);
}

/* c's last error contains every needle (NULL-terminated). */
static void expect_msg(ps_client *c, const char *who, const char *const *needles) {
  char msg[1024];
  ps_errmsg(c, msg, sizeof(msg));
  for (int i = 0; needles[i]; i++)
    REQUIRE(strstr(msg, needles[i]), "%s's error does not say \"%s\": %s", who, needles[i], msg);
}

#define UNEVEN_LOG "level=error proc=ps-server-0 msg=\"a step can never complete"

/* ---- a rank in the barrier while another pushes one more step --------------- */

static void test_barrier(int workers) {
  struct job j;
  job_start(&j, 1, workers, SUM);
  steps_all(&j, 0, STEPS);
  /* rank 1 runs one more step: its push is in before the others stop */
  struct done pd, ld;
  push_async(&j, 1, STEPS, &pd);
  REQUIRE(wait_done(&pd, "the extra push") == PS_OK, "the extra push, before anyone stopped");
  pull_async(&j, 1, STEPS + 1, &ld);
  struct barrier_call b[MAXW];
  for (int r = 0; r < workers; r++)
    if (r != 1) barrier_start(&b[r], j.c[r]);
  REQUIRE(wait_done(&ld, "rank 1's pull") == PS_ERR_STATE, "rank 1's pull: %s", ps_strerror(ld.st));
  expect_msg(j.c[1], "rank 1",
             (const char *[]){"worker 1 pushed step 2 of key ", "(tensor \"" TENSOR "\")",
                              "stopped after step 1 (it waits in the barrier", "ps.torch.join()",
                              "ps_leave(c, PS_LEAVE_JOINED)", NULL});
  for (int r = 0; r < workers; r++) {
    if (r == 1) continue;
    char who[32], stuck[64];
    snprintf(who, sizeof(who), "rank %d's barrier", r);
    snprintf(stuck, sizeof(stuck), "worker %d stopped after step 1", r);
    ps_status st = barrier_end(&b[r], who);
    REQUIRE(st == PS_ERR_STATE, "%s: %s", who, ps_strerror(st));
    expect_msg(j.c[r], who,
               (const char *[]){"worker 1 pushed step 2 of key 0 (tensor \"" TENSOR "\")", stuck,
                                "join", NULL});
  }
  REQUIRE(harness_grep(j.srv[0].log, UNEVEN_LOG) == workers - 1,
          "the shard logged %d errors, expected one per rank in the barrier",
          harness_grep(j.srv[0].log, UNEVEN_LOG));
  job_stop(&j);
  printf("barrier, W=%d: rank 1's extra step and the barrier failed, naming both ranks\n", workers);
}

/* ---- ranks that finished (ps_leave) while another pushes one more step ------ */

static void test_finished(int workers) {
  struct job j;
  job_start(&j, 2, workers, SUM);
  steps_all(&j, 0, STEPS);
  for (int r = 0; r < workers; r++)
    if (r != 1) REQUIRE(ps_leave(j.c[r], PS_LEAVE_FINISHED) == PS_OK, "rank %d: leave finished", r);
  struct done pd, ld;
  push_async(&j, 1, STEPS, &pd);
  pull_async(&j, 1, STEPS + 1, &ld);
  REQUIRE(wait_done(&pd, "the extra push") == PS_ERR_STATE, "the extra push: %s",
          ps_strerror(pd.st));
  REQUIRE(wait_done(&ld, "the extra pull") == PS_ERR_STATE, "the extra pull: %s",
          ps_strerror(ld.st));
  expect_msg(j.c[1], "rank 1",
             (const char *[]){"worker 1 ", " step 2 of key ", "(tensor \"" TENSOR "\")",
                              "stopped after step 1 (it finished", "join", NULL});
  for (int r = 0; r < workers; r++) {
    if (r == 1) continue;
    char who[32], stuck[64];
    snprintf(who, sizeof(who), "rank %d's barrier", r);
    snprintf(stuck, sizeof(stuck), "worker %d stopped after step 1 (it finished", r);
    struct barrier_call b;
    barrier_start(&b, j.c[r]);
    ps_status st = barrier_end(&b, who);
    REQUIRE(st == PS_ERR_STATE, "%s: %s", who, ps_strerror(st));
    expect_msg(j.c[r], who,
               (const char *[]){"worker 1 pushed step 2 of key ", stuck, "join", NULL});
  }
  for (int i = 0; i < 2; i++)
    REQUIRE(harness_grep(j.srv[i].log, "msg=\"a step can never complete") == workers - 1,
            "shard %d: not one error line per finished rank", i);
  job_stop(&j);
  printf(
      "finished, W=%d: rank 1's extra step failed at once on both shards, and so did the "
      "barrier of the ranks that finished\n",
      workers);
}

/* ---- a rank that joins: the others go on, averaging over themselves --------- */

static void test_joined(void) {
  struct job j;
  job_start(&j, 2, 3, SUM);
  steps_all(&j, 0, STEPS);
  /* ranks 0 and 1 push step STEPS and wait: it needs rank 2 until it joins */
  struct done pd[2], ld[2];
  for (int r = 0; r < 2; r++) {
    push_async(&j, r, STEPS, &pd[r]);
    pull_async(&j, r, STEPS + 1, &ld[r]);
    REQUIRE(wait_done(&pd[r], "push") == PS_OK, "rank %d: push", r);
  }
  REQUIRE(!atomic_load(&ld[0].over), "step %d completed without rank 2", STEPS);
  REQUIRE(ps_leave(j.c[2], PS_LEAVE_JOINED) == PS_OK, "rank 2: join");
  float mean = (grad_value(0, STEPS) + grad_value(1, STEPS)) / 2;
  for (int r = 0; r < 2; r++) {
    REQUIRE(wait_done(&ld[r], "the pull after the join") == PS_OK, "rank %d: pull", r);
    expect_all(r, mean, "the step rank 2 joined in");
  }
  REQUIRE(ps_leave(j.c[2], PS_LEAVE_JOINED) == PS_OK, "rank 2: join again");
  REQUIRE(ps_leave(j.c[2], PS_LEAVE_FINISHED) == PS_OK, "rank 2: finished after joined");
  struct done xd;
  push_async(&j, 2, STEPS, &xd);
  REQUIRE(wait_done(&xd, "a joined rank's push") == PS_ERR_REMOTE, "a joined rank's push: %s",
          ps_strerror(xd.st));
  expect_msg(j.c[2], "rank 2", (const char *[]){"worker 2 pushed step 2", "ps_leave", NULL});
  struct barrier_call b[3];
  barrier_start(&b[2], j.c[2]);
  static const int two[] = {0, 1};
  for (uint64_t s = STEPS + 1; s < STEPS + 3; s++) step(&j, two, 2, s);
  for (int r = 0; r < 2; r++) barrier_start(&b[r], j.c[r]);
  for (int r = 0; r < 3; r++) REQUIRE(barrier_end(&b[r], "the barrier") == PS_OK, "barrier %d", r);
  /* a next epoch: rank 2 takes part again from where the others are, and
   * the step waits for it */
  uint64_t next = 0;
  REQUIRE(ps_rejoin(j.c[2], &next) == PS_OK && next == STEPS + 3, "rank 2: rejoin at %llu",
          (unsigned long long)next);
  for (int r = 0; r < 2; r++) {
    push_async(&j, r, next, &pd[r]);
    pull_async(&j, r, next + 1, &ld[r]);
    REQUIRE(wait_done(&pd[r], "push") == PS_OK, "rank %d: push after the rejoin", r);
  }
  REQUIRE(!atomic_load(&ld[0].over), "step %llu completed without the rank that rejoined",
          (unsigned long long)next);
  struct done pd2, ld2;
  push_async(&j, 2, next, &pd2);
  pull_async(&j, 2, next + 1, &ld2);
  REQUIRE(wait_done(&pd2, "push") == PS_OK && wait_done(&ld2, "pull") == PS_OK,
          "rank 2: its step after the rejoin");
  mean = (grad_value(0, next) + grad_value(1, next) + grad_value(2, next)) / 3;
  expect_all(2, mean, "the step after the rejoin, all 3");
  for (int r = 0; r < 2; r++) {
    REQUIRE(wait_done(&ld[r], "the pull after the rejoin") == PS_OK, "rank %d: pull", r);
    expect_all(r, mean, "the step after the rejoin, all 3");
  }
  REQUIRE(ps_rejoin(j.c[2], &next) == PS_ERR_STATE, "a second rejoin");
  int lost = -1;
  REQUIRE(ps_lost_workers(j.c[0], NULL, 0, &lost) == PS_OK && lost == 0, "%d lost", lost);
  for (int i = 0; i < 2; i++)
    REQUIRE(harness_grep(j.srv[i].log, "msg=\"worker left the steps\" rank=2 how=joined") == 1 &&
                harness_grep(j.srv[i].log, "a step can never complete") == 0,
            "shard %d: rank 2 did not join exactly once, or a step was refused", i);
  job_stop(&j);
  printf(
      "joined: ranks 0 and 1 finished 3 steps without rank 2 (mean of 2), the barrier "
      "completed for all 3, and after ps_rejoin a step waited for rank 2 (mean of 3)\n");
}

/* ---- ssp:1 ------------------------------------------------------------------ */

static void test_ssp(bool finished) {
  struct job j;
  const char *args[] = {"--optimizer", "sgd", "--consistency", "ssp:1", NULL};
  job_start(&j, 1, 2, args);
  struct done d;
  push_async(&j, 1, 0, &d);
  REQUIRE(wait_done(&d, "rank 1's push") == PS_OK, "rank 1's step 0");
  REQUIRE(ps_leave(j.c[1], finished ? PS_LEAVE_FINISHED : PS_LEAVE_JOINED) == PS_OK, "leave");
  /* rank 0 at clock c may read once the slowest counted clock is >= c - 1:
   * rank 1's clock 1 would hold back its pull for clock 3 */
  for (uint64_t c = 0; c < 5; c++) {
    push_async(&j, 0, c, &d);
    REQUIRE(wait_done(&d, "rank 0's push") == PS_OK, "rank 0's step %llu", (unsigned long long)c);
    pull_async(&j, 0, c + 1, &d);
    ps_status st = wait_done(&d, "rank 0's pull");
    if (finished && c + 1 >= 3) {
      REQUIRE(st == PS_ERR_STATE, "the pull for clock 3: %s", ps_strerror(st));
      expect_msg(j.c[0], "rank 0",
                 (const char *[]){"worker 0 waits for step 3 of key ", "under ssp:1",
                                  "worker 1 stopped after step 0 (it finished", "join", NULL});
      break;
    }
    REQUIRE(st == PS_OK, "rank 0's pull for clock %llu: %s", (unsigned long long)c + 1,
            ps_strerror(st));
  }
  job_stop(&j);
  printf("ssp:1: a %s rank %s\n", finished ? "finished" : "joined",
         finished ? "fails the pull that would wait for it" : "does not hold the bound back");
}

/* ---- a reconnect keeps the leave --------------------------------------------- */

static void test_reconnect(void) {
  struct job j = {.shards = 1, .workers = 2};
  const char *args[] = {"--optimizer", "sum", "--idle-timeout", "1", NULL};
  harness_start_server(&j.srv[0], 0, 1, 2, 1.0, args);
  setenv("PS_HEARTBEAT_MS", "200", 1); /* rank 0 beats: never idle */
  j.c[0] = connect_rank(&j, 0);
  setenv("PS_HEARTBEAT_MS", "0", 1); /* rank 1 does not: dropped when idle */
  j.c[1] = connect_rank(&j, 1);
  unsetenv("PS_HEARTBEAT_MS");
  memset(pulled[0], 0, sizeof(pulled[0]));
  REQUIRE(ps_init(j.c[0], 0, pulled[0]) == PS_OK, "init");
  steps_all(&j, 0, STEPS);
  REQUIRE(ps_leave(j.c[1], PS_LEAVE_JOINED) == PS_OK, "rank 1: join");
  struct ps_client_counters cc = {0};
  for (int i = 0; i < WAIT_MS / 10 && cc.reconnects < 2; i++) {
    clock_sleep_ms(10);
    ps_client_counters(j.c[1], &cc);
  }
  REQUIRE(cc.reconnects >= 2, "rank 1 reconnected %llu times, expected 2",
          (unsigned long long)cc.reconnects);
  static const int zero[] = {0};
  for (uint64_t s = STEPS; s < STEPS + 3; s++) step(&j, zero, 1, s);
  REQUIRE(harness_grep(j.srv[0].log,
                       "msg=\"worker takes part in the steps again\" rank=1 why=hello") >= 2 &&
              harness_grep(j.srv[0].log, "msg=\"worker left the steps\" rank=1 how=joined") >= 3,
          "the shard did not forget rank 1's leave at each hello and learn it again");
  job_stop(&j);
  printf(
      "reconnect: rank 1 reconnected %llu times after joining, said it again each time, and "
      "rank 0 went on alone\n",
      (unsigned long long)cc.reconnects);
}

/* ---- the API ----------------------------------------------------------------- */

static void test_api(void) {
  struct job j = {.shards = 1, .workers = 1};
  harness_start_server(&j.srv[0], 0, 1, 1, 1.0, SUM);
  const char *addrs[1] = {j.srv[0].addr};
  struct ps_client_opts o = {.servers = addrs, .num_servers = 1, .rank = 0, .world_size = 1};
  ps_client *c;
  char err[256];
  REQUIRE(ps_client_new(&o, &c, err, sizeof(err)) == PS_OK, "connect: %s", err);
  REQUIRE(ps_leave(NULL, PS_LEAVE_JOINED) == PS_ERR_INVALID, "ps_leave(NULL)");
  REQUIRE(ps_leave(c, PS_LEAVE_JOINED) == PS_ERR_STATE, "ps_leave before ps_declare");
  REQUIRE(ps_declare(c, 1, names, counts) == PS_OK, "declare");
  REQUIRE(ps_leave(c, (ps_leave_kind)0) == PS_ERR_INVALID, "kind 0");
  REQUIRE(ps_leave(c, (ps_leave_kind)3) == PS_ERR_INVALID, "kind 3");
  uint64_t step;
  REQUIRE(ps_rejoin(NULL, &step) == PS_ERR_INVALID && ps_rejoin(c, NULL) == PS_ERR_INVALID,
          "ps_rejoin(NULL)");
  REQUIRE(ps_rejoin(c, &step) == PS_ERR_STATE, "ps_rejoin without joining");
  int ranks[2], n = -1;
  REQUIRE(ps_lost_workers(c, NULL, 1, &n) == PS_ERR_INVALID, "ranks NULL with max 1");
  REQUIRE(ps_lost_workers(c, ranks, -1, &n) == PS_ERR_INVALID, "max -1");
  REQUIRE(ps_lost_workers(c, ranks, 2, NULL) == PS_ERR_INVALID, "count NULL");
  REQUIRE(ps_lost_workers(c, ranks, 2, &n) == PS_OK && n == 0, "%d lost", n);
  j.c[0] = c;
  job_stop(&j);
  printf(
      "api: bad kinds, ps_leave before ps_declare, ps_rejoin without a join and "
      "ps_lost_workers' arguments refused\n");
}

int main(void) {
  test_api();
  test_barrier(2);
  test_barrier(3);
  test_finished(2);
  test_finished(3);
  test_joined();
  test_ssp(false);
  test_ssp(true);
  test_reconnect();
  return harness_status();
}
