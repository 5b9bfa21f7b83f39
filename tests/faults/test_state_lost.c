/* test_state_lost: a job whose state is gone stops on every rank and every
 * shard with one error that names it, or (sum mode, workers restarted)
 * starts over correctly; it never trains on silently (ps-server/lost.c).
 *
 * Two real shards on 127.0.0.1, two ranks driven step by step from this
 * process (one libps client each; a "restarted worker" is a new client,
 * which is a new process to the shards: a new Hello.incarnation).
 *
 *   empty_sgd    kill -9 shard 1 (no checkpoints) and restart it empty: both
 *                ranks fail with PS_ERR_STATE_LOST naming shard 1 and the
 *                step; both shards exit 3.
 *   empty_sum    the same with --optimizer sum (the pushes it took are gone).
 *   corrupt,     the same with checkpoints, shard 1's files cut short or its
 *   deleted      directory removed before the restart (it starts empty).
 *   restart_sum  --optimizer sum, shard 1 and both workers die, shard 1 and
 *                the workers restart: shard 0 starts the job over with them
 *                (the initial values, not the old run's last mean; no push
 *                dropped as a duplicate), and step 0 gives the exact mean.
 *   restart_one_sum  only rank 1's process restarts: the job starts over with
 *                it; the old rank 0 is refused and its MSG_ABORT ignored.
 *   false_dup    sgd, the same restart: rank 0's step-0 push to shard 0 (which
 *                holds its steps up to 2) is refused, not dropped silently.
 *   rollback     checkpoints every 2 steps; shard 0's checkpoint of clock 4
 *                deleted, shard 1 killed after writing it and restarted from
 *                it: the rollback is impossible on shard 0, and both ranks
 *                and both shards stop with the same message naming shard 0
 *                and clock 4.
 * Each bound is an upper one; alarm() turns a hang into a failure. */
#include <errno.h>
#include <signal.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "clock.h"
#include "harness.h"
#include "ps.h"

#define W 2
#define S 2
#define N 4096 /* floats: 4 keys of 4 KiB over the two shards */
#define HANG_S 90

static struct test_server srv[S];
static const char *names[] = {"w"};
static const uint64_t counts[] = {N};
static float params[W][N], grad[W][N];

static ps_client *open_client(int rank) {
  const char *addrs[S] = {srv[0].addr, srv[1].addr};
  struct ps_client_opts o = {.servers = addrs,
                             .num_servers = S,
                             .rank = rank,
                             .world_size = W,
                             .chunk_bytes = 4096,
                             .job_id = "test_state_lost",
                             .reconnect_timeout_ms = 20000};
  ps_client *c;
  char err[256];
  REQUIRE(ps_client_new(&o, &c, err, sizeof(err)) == PS_OK, "rank %d connect: %s", rank, err);
  REQUIRE(ps_declare(c, 1, names, counts) == PS_OK, "rank %d declare", rank);
  return c;
}

static void fill(float *v, float x) {
  for (int i = 0; i < N; i++) v[i] = x;
}

/* One BSP step of both ranks: push step s, pull version s+1. st[r] gets
 * each rank's first failure (PS_OK if none). */
static void step(ps_client *c[W], uint64_t s, ps_status st[W]) {
  ps_request *push[W], *pull[W];
  for (int r = 0; r < W; r++) {
    fill(grad[r], (float)(r + 1) * (float)(s + 1));
    st[r] = ps_push_async(c[r], 0, s, grad[r], NULL, NULL, &push[r]);
    if (st[r] == PS_OK) st[r] = ps_pull_async(c[r], 0, s + 1, params[r], NULL, NULL, &pull[r]);
  }
  for (int r = 0; r < W; r++) {
    ps_status a = ps_wait(push[r], NULL);
    ps_status b = ps_wait(pull[r], NULL);
    if (st[r] == PS_OK) st[r] = a != PS_OK ? a : b;
  }
}

static void start_shards(const char *const *extra) {
  for (int i = 0; i < S; i++) harness_start_server(&srv[i], i, S, W, 0.5, extra);
}

static void kill9(int i) {
  REQUIRE(kill(srv[i].pid, SIGKILL) == 0, "kill shard %d", i);
  int st = harness_wait(srv[i].pid, 10000);
  REQUIRE(st >= 0 && WIFSIGNALED(st), "shard %d not killed: %d", i, st);
}

/* Restarts shard i on its port with extra (+ --listen). */
static void restart(int i, const char *const *extra) {
  const char *argv[16];
  int n = 0;
  for (; extra && extra[n]; n++) argv[n] = extra[n];
  char addr[64];
  snprintf(addr, sizeof(addr), "%s", srv[i].addr);
  argv[n++] = "--listen";
  argv[n++] = addr;
  argv[n] = NULL;
  harness_start_server(&srv[i], i, S, W, 0.5, argv);
  REQUIRE(strcmp(srv[i].addr, addr) == 0, "shard %d restarted on %s, not %s", i, srv[i].addr, addr);
}

static void expect_shard_exit(int i, int code) {
  int st = harness_wait(srv[i].pid, 30000);
  REQUIRE(st >= 0 && WIFEXITED(st) && WEXITSTATUS(st) == code,
          "shard %d: wanted exit %d within 30 s, got status %d", i, code, st);
}

static void train(ps_client *c[W], uint64_t from, uint64_t to) {
  for (uint64_t s = from; s < to; s++) {
    ps_status st[W];
    step(c, s, st);
    for (int r = 0; r < W; r++) {
      char m[1024];
      REQUIRE(st[r] == PS_OK, "rank %d step %llu: %s (%s)", r, (unsigned long long)s,
              ps_strerror(st[r]), ps_errmsg(c[r], m, sizeof(m)));
    }
  }
}

static ps_client **fresh_job(ps_client *c[W], float init) {
  for (int r = 0; r < W; r++) c[r] = open_client(r);
  fill(params[0], init);
  REQUIRE(ps_init(c[0], 0, params[0]) == PS_OK, "init");
  return c;
}

/* Both ranks' next step fails with PS_ERR_STATE_LOST, and each message
 * holds want. */
static void expect_lost(ps_client *c[W], uint64_t s, const char *want) {
  ps_status st[W];
  step(c, s, st);
  for (int r = 0; r < W; r++) {
    char m[1024];
    ps_errmsg(c[r], m, sizeof(m));
    REQUIRE(st[r] == PS_ERR_STATE_LOST, "rank %d step %llu: %s (%s), wanted PS_ERR_STATE_LOST", r,
            (unsigned long long)s, ps_strerror(st[r]), m);
    REQUIRE(strstr(m, want), "rank %d: message \"%s\" does not say \"%s\"", r, m, want);
    if (r == 0) printf("rank 0 was told: %s\n", m);
  }
}

static void case_empty(const char *opt, const char *want) {
  const char *extra[] = {"--optimizer", opt, NULL};
  start_shards(extra);
  ps_client *c[W];
  fresh_job(c, 1.0f);
  train(c, 0, 3);
  kill9(1);
  restart(1, extra);
  expect_lost(c, 3, want);
  expect_shard_exit(1, 3);
  expect_shard_exit(0, 3); /* told by the ranks (MSG_ABORT) */
  REQUIRE(harness_grep(srv[0].log, "the job's state is lost: stopping") == 1,
          "shard 0 did not say why");
  for (int r = 0; r < W; r++) ps_client_free(c[r]);
}

/* Whether the shard logging to file wrote the checkpoint `clock` says (its
 * writer is idle again once it logs). */
static bool written(const char *file, const char *clock) {
  FILE *f = fopen(file, "r");
  char line[4096];
  bool yes = false;
  while (f && !yes && fgets(line, sizeof(line), f))
    yes = strstr(line, "msg=\"checkpoint written\"") && strstr(line, clock);
  if (f) fclose(f);
  return yes;
}

/* Steps 0..4 with --checkpoint-every 2: each clock's checkpoints (0, 2, 4)
 * are written once the step before completed on every key; waiting for them
 * keeps a writer still busy from skipping one. */
static void train_checkpointed(ps_client *c[W]) {
  for (uint64_t clock = 0; clock <= 4; clock += 2) {
    if (clock > 0) train(c, clock - 2, clock);
    char want[64];
    snprintf(want, sizeof(want), " clock=%llu ", (unsigned long long)clock);
    for (int i = 0; i < S; i++) {
      double t0 = clock_now_s();
      while (!written(srv[i].log, want) && clock_now_s() - t0 < 30) usleep(20000);
      REQUIRE(written(srv[i].log, want), "shard %d wrote no checkpoint of%s", i, want);
    }
  }
  train(c, 4, 5);
}

/* With checkpoints: shard 1 killed, then its files made useless (how =
 * "corrupt": every file of shard 1 cut short; "deleted": the directory
 * removed), restarted: it starts empty and the job is lost, as without
 * checkpoints, instead of waiting for ever. */
static void case_unusable(const char *how) {
  char dir[600], cmd[1400];
  snprintf(dir, sizeof(dir), "%s/ckpt", harness_dir());
  const char *extra[] = {"--checkpoint-dir", dir, "--checkpoint-every", "2", NULL};
  start_shards(extra);
  ps_client *c[W];
  fresh_job(c, 1.0f);
  train_checkpointed(c);
  kill9(1);
  if (strcmp(how, "corrupt") == 0)
    snprintf(cmd, sizeof(cmd), "for f in '%s'/shard-0001-*.ckpt; do truncate -s 100 \"$f\"; done",
             dir);
  else
    snprintf(cmd, sizeof(cmd), "rm -rf '%s'", dir);
  REQUIRE(system(cmd) == 0, "%s", cmd);
  restart(1, extra);
  if (strcmp(how, "corrupt") == 0)
    REQUIRE(harness_grep(srv[1].log, "every checkpoint of this shard is unusable") == 1,
            "shard 1 did not warn that its checkpoints are unusable");
  expect_lost(c, 5, "shard 1 restarted without a checkpoint at step");
  expect_shard_exit(1, 3);
  expect_shard_exit(0, 3);
  for (int r = 0; r < W; r++) ps_client_free(c[r]);
}

/* Shard 1 and both workers die; shard 1 and the workers restart. */
static void restart_all_but_shard0(ps_client *c[W], const char *const *extra) {
  train(c, 0, 3);
  for (int r = 0; r < W; r++) ps_client_free(c[r]);
  kill9(1);
  restart(1, extra);
}

static void case_restart_sum(void) {
  const char *extra[] = {"--optimizer", "sum", NULL};
  start_shards(extra);
  ps_client *c[W];
  fresh_job(c, 1.0f);
  restart_all_but_shard0(c, extra);
  struct ps_shard_stats before;
  fresh_job(c, 7.0f);
  REQUIRE(ps_stats(c[0], 0, &before) == PS_OK, "stats");
  for (int r = 0; r < W; r++) {
    uint64_t resume = 99, v = 99;
    REQUIRE(ps_resume_step(c[r], &resume) == PS_OK && resume == 0, "rank %d resumes at %llu", r,
            (unsigned long long)resume);
    REQUIRE(ps_pull(c[r], 0, 0, params[r], &v) == PS_OK, "rank %d pull 0", r);
    for (int i = 0; i < N; i++)
      REQUIRE(params[r][i] == 7.0f, "rank %d element %d is %g after the restart, not the initial 7",
              r, i, (double)params[r][i]);
  }
  train(c, 0, 2);
  /* the mean of (r+1)*(s+1) over r = 0, 1 at step 1 */
  for (int r = 0; r < W; r++)
    for (int i = 0; i < N; i++)
      REQUIRE(params[r][i] == 3.0f, "rank %d element %d is %g, not the mean 3", r, i,
              (double)params[r][i]);
  struct ps_shard_stats after;
  REQUIRE(ps_stats(c[0], 0, &after) == PS_OK, "stats");
  REQUIRE(after.duplicates == before.duplicates, "shard 0 dropped %llu pushes as duplicates",
          (unsigned long long)(after.duplicates - before.duplicates));
  REQUIRE(harness_grep(srv[0].log, "a worker started the job over") == 1,
          "shard 0 did not say it started the job over");
  for (int r = 0; r < W; r++) ps_client_free(c[r]);
  for (int i = 0; i < S; i++) harness_stop(srv[i].pid, SIGTERM, 10000);
  printf("restart_sum: shard 0 started over with the restarted workers; step 1 mean exact\n");
}

/* --optimizer sum, only rank 1's process restarts: the shards start the job
 * over with it; rank 0's old process is refused as belonging to the
 * earlier run, and its relay of that refusal (MSG_ABORT) must not stop the
 * job the new processes run. */
static void case_restart_one_sum(void) {
  const char *extra[] = {"--optimizer", "sum", NULL};
  start_shards(extra);
  ps_client *c[W];
  fresh_job(c, 1.0f);
  train(c, 0, 3);
  ps_client_free(c[1]);
  c[1] = open_client(1); /* a new process: the shards start over */
  ps_status st[W];
  fill(grad[0], 1.0f);
  st[0] = ps_push(c[0], 0, 3, grad[0]);
  char m[1024];
  ps_errmsg(c[0], m, sizeof(m));
  REQUIRE(st[0] == PS_ERR_STATE_LOST && strstr(m, "belongs to the earlier run"),
          "rank 0's old process: %s (%s)", ps_strerror(st[0]), m);
  ps_client_free(c[0]);
  c[0] = open_client(0);
  fill(params[0], 7.0f);
  REQUIRE(ps_init(c[0], 0, params[0]) == PS_OK, "init");
  for (int r = 0; r < W; r++) {
    uint64_t v;
    REQUIRE(ps_pull(c[r], 0, 0, params[r], &v) == PS_OK && params[r][0] == 7.0f,
            "rank %d after the start over: %g", r, (double)params[r][0]);
  }
  train(c, 0, 2);
  REQUIRE(params[0][N - 1] == 3.0f && params[1][0] == 3.0f, "step 1's mean: %g %g",
          (double)params[0][N - 1], (double)params[1][0]);
  REQUIRE(harness_grep(srv[0].log, "the job's state is lost") == 0,
          "the old process stopped the job");
  for (int r = 0; r < W; r++) ps_client_free(c[r]);
  for (int i = 0; i < S; i++) harness_stop(srv[i].pid, SIGTERM, 10000);
  printf("restart_one_sum: the old rank 0 was refused, its abort ignored, the new run exact\n");
}

static void case_false_dup(void) {
  const char *extra[] = {"--optimizer", "sgd", NULL};
  start_shards(extra);
  ps_client *c[W];
  fresh_job(c, 1.0f);
  restart_all_but_shard0(c, extra);
  fresh_job(c, 1.0f);
  uint64_t resume = 99, v;
  REQUIRE(ps_resume_step(c[0], &resume) == PS_OK, "resume");
  REQUIRE(ps_pull(c[0], 0, resume, params[0], &v) == PS_OK, "pull");
  fill(grad[0], 1.0f);
  ps_status st = ps_push(c[0], 0, resume, grad[0]);
  char m[1024];
  ps_errmsg(c[0], m, sizeof(m));
  REQUIRE(st == PS_ERR_STATE_LOST, "a stale push of step %llu by a new process: %s (%s)",
          (unsigned long long)resume, ps_strerror(st), m);
  REQUIRE(strstr(m, "(a new process) pushed step"), "message: %s", m);
  printf("false_dup: %s\n", m);
  expect_shard_exit(0, 3);
  expect_shard_exit(1, 3);
  for (int r = 0; r < W; r++) ps_client_free(c[r]);
}

static void case_rollback(void) {
  char dir[600], victim[700];
  snprintf(dir, sizeof(dir), "%s/ckpt", harness_dir());
  const char *extra[] = {"--checkpoint-dir", dir, "--checkpoint-every", "2", NULL};
  start_shards(extra);
  ps_client *c[W];
  fresh_job(c, 1.0f);
  train_checkpointed(c);
  snprintf(victim, sizeof(victim), "%s/shard-0000-v%020d.ckpt", dir, 4);
  kill9(1);
  REQUIRE(unlink(victim) == 0, "unlink %s", victim);
  restart(1, extra);
  REQUIRE(harness_grep(srv[1].log, "checkpoint loaded") == 1, "shard 1 loaded nothing");
  /* each rank: its next step is refused (ERR_ROLLBACK), its rollback is
   * impossible, and whatever it tries then fails the same way */
  ps_status st[W];
  step(c, 5, st);
  for (int r = 0; r < W; r++) {
    char m[1024];
    if (st[r] == PS_ERR_ROLLBACK) st[r] = ps_rollback(c[r], ps_rollback_clock(c[r]));
    ps_errmsg(c[r], m, sizeof(m));
    REQUIRE(st[r] == PS_ERR_STATE_LOST, "rank %d: %s (%s), wanted PS_ERR_STATE_LOST", r,
            ps_strerror(st[r]), m);
    REQUIRE(strstr(m, "shard 0 cannot roll back to clock 4"), "rank %d: %s", r, m);
    if (r == 0) printf("rollback: rank 0 was told: %s\n", m);
  }
  expect_shard_exit(0, 3);
  expect_shard_exit(1, 3);
  for (int r = 0; r < W; r++) ps_client_free(c[r]);
}

int main(int argc, char **argv) {
  const char *name = argc > 1 ? argv[1] : "empty_sgd";
  alarm(HANG_S); /* a hang is a failure: SIGALRM ends the test */
  if (strcmp(name, "empty_sgd") == 0)
    case_empty("sgd", "shard 1 restarted without a checkpoint at step");
  else if (strcmp(name, "empty_sum") == 0)
    case_empty("sum", "shard 1 restarted without its state at step");
  else if (strcmp(name, "restart_sum") == 0)
    case_restart_sum();
  else if (strcmp(name, "restart_one_sum") == 0)
    case_restart_one_sum();
  else if (strcmp(name, "false_dup") == 0)
    case_false_dup();
  else if (strcmp(name, "rollback") == 0)
    case_rollback();
  else if (strcmp(name, "corrupt") == 0 || strcmp(name, "deleted") == 0)
    case_unusable(name);
  else
    REQUIRE(0, "unknown case %s", name);
  return harness_status();
}
