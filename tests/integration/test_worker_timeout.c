/* A worker that disappears in BSP: kill -9 of a worker process, with the
 * shard's --worker-timeout 0.5 s, and what --on-worker-timeout does then:
 * never go on silently.
 *
 * continue: W=2 (this process is rank 0; rank 1 is this binary re-executed
 * as a child). Both push step 0; rank 1 is killed; rank 0's pull of version
 * 2 is answered once the timeout has passed, with step 1 averaged over the
 * one worker that pushed it; step 2 then needs rank 0 alone. The shard says
 * so at error level, counts it in ps_server_workers_lost_total, and ps_lost_workers
 * names rank 1, also after it rejoined. A new rank-1 process (same rank,
 * fresh client) asks where to resume (step 3), pulls the current parameters
 * (version 3), pushes a stale step 0 as a restarted trainer would
 * (acknowledged as a duplicate, not applied) and step 3, which the shard now
 * waits for again. Twice: the default with --optimizer sgd (auto chooses
 * continue), where SGD with lr 1 keeps every value exact, and --optimizer
 * sum with an explicit continue, where each version is the step's exact
 * mean gradient.
 *
 * fail: the default with --optimizer sum (auto chooses fail: the parameters
 * live on the workers): the same kill makes rank 0's waiting pull fail with
 * PS_ERR_IO (retryable) and an error naming rank 1, and the shard exits 129.
 *
 * Then the real trainer: two ps-worker processes on two shards (bsp,
 * momentum: auto chooses continue); rank 1 is killed mid-run, rank 0 trains
 * alone once the shards declare it lost, and rank 1 restarted with the same
 * command rejoins (the unchanged trainer replays its early steps as
 * duplicates until it reaches the shards' step); both finish, the shards
 * exit 0 and rank 0's summary says workers_lost=1. With --on-worker-timeout
 * fail and three trainers, the same kill makes ranks 0 and 2 and both shards
 * exit 129.
 *
 * Stopped, not gone: the same two trainers, with --worker-timeout 2, and
 * rank 1 SIGSTOPped mid-run with its sockets open. Its heartbeats stop, so
 * each shard closes its connection within the timeout (plus a sweep) and
 * declares it lost; rank 0, which beats on while it waits for rank 1's
 * pushes, is not taken for silent and then trains alone. After SIGCONT rank
 * 1's libps finds its connections closed, reconnects and rejoins; both
 * finish, workers_lost=1 in the summary and in each shard's /metrics. */
#include <errno.h>
#include <stdbool.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "clock.h"
#include "harness.h"
#include "ps.h"
#include "scrape.h"

#define N 5000 /* 5 keys of 4 KiB */
static const char *names[] = {"w"};
static const uint64_t counts[] = {N};

static ps_client *connect_as(const char *addr, int rank) {
  const char *addrs[1] = {addr};
  struct ps_client_opts o = {.servers = addrs,
                             .num_servers = 1,
                             .rank = rank,
                             .world_size = 2,
                             .chunk_bytes = 4096,
                             .reconnect_timeout_ms = 2000};
  ps_client *c;
  char err[256];
  REQUIRE(ps_client_new(&o, &c, err, sizeof(err)) == PS_OK, "rank %d connect: %s", rank, err);
  REQUIRE(ps_declare(c, 1, names, counts) == PS_OK, "rank %d declare", rank);
  return c;
}

static void fill(float *v, float x) {
  for (int i = 0; i < N; i++) v[i] = x;
}

static void expect_all(const float *v, float want, const char *what) {
  for (int i = 0; i < N; i++)
    REQUIRE(v[i] == want, "%s: [%d] = %g, expected %g", what, i, v[i], want);
}

/* ---- rank 1, run as a child process: argv = self child ADDR first|rejoin ---- */

static int child_main(const char *addr, const char *phase) {
  static float p[N], g[N];
  ps_client *c = connect_as(addr, 1);
  fill(g, 3);
  if (strcmp(phase, "first") == 0) {
    uint64_t v;
    REQUIRE(ps_pull(c, 0, 0, p, &v) == PS_OK && v == 0, "first: pull 0");
    REQUIRE(ps_push(c, 0, 0, g) == PS_OK, "first: push 0");
    printf("pushed 0\n");
    fflush(stdout);
    pause(); /* until kill -9 */
    return 1;
  }
  uint64_t resume = 99, v = 99;
  REQUIRE(ps_resume_step(c, &resume) == PS_OK, "rejoin: resume step");
  REQUIRE(ps_pull(c, 0, 0, p, &v) == PS_OK, "rejoin: pull");
  printf("resume %llu version %llu value %g\n", (unsigned long long)resume, (unsigned long long)v,
         (double)p[0]);
  fflush(stdout);
  REQUIRE(ps_push(c, 0, 0, g) == PS_OK, "rejoin: stale push of step 0");
  REQUIRE(ps_push(c, 0, resume, g) == PS_OK, "rejoin: push %llu", (unsigned long long)resume);
  REQUIRE(ps_pull(c, 0, resume + 1, p, &v) == PS_OK, "rejoin: pull %llu",
          (unsigned long long)resume + 1);
  printf("after version %llu value %g\n", (unsigned long long)v, (double)p[0]);
  fflush(stdout);
  REQUIRE(ps_barrier(c) == PS_OK, "rejoin: barrier");
  ps_client_free(c);
  return 0;
}

static pid_t spawn_child(const char *self, const char *addr, const char *phase, const char *out) {
  char log[600];
  snprintf(log, sizeof(log), "%s.log", out);
  const char *argv[] = {self, "child", addr, phase, NULL};
  return harness_spawn(argv, out, log);
}

/* Waits up to 10 s for a line of file starting with prefix; copies it. */
static void wait_line(const char *file, const char *prefix, char *line, size_t len) {
  for (int i = 0; i < 1000; i++) {
    FILE *f = fopen(file, "r");
    if (f) {
      while (fgets(line, (int)len, f))
        if (strncmp(line, prefix, strlen(prefix)) == 0) {
          fclose(f);
          return;
        }
      fclose(f);
    }
    clock_sleep_ms(10);
  }
  REQUIRE(0, "no \"%s\" line in %s", prefix, file);
}

static void kill9(pid_t pid) {
  int st = harness_stop(pid, SIGKILL, 5000);
  REQUIRE(st >= 0 && WIFSIGNALED(st) && WTERMSIG(st) == SIGKILL, "child not killed (status %d)",
          st);
}

/* ---- what the shards say about a worker they went on without ---------------- */

/* The lost rank is reported: an error-level line on the shard, the shard's
 * ps_server_workers_lost_total, and every shard's Stats through ps_lost_workers. */
static void expect_reported(ps_client *c, const struct test_server *srv, int shard, int lost) {
  char needle[160];
  snprintf(needle, sizeof(needle),
           "level=error proc=ps-server-%d msg=\"worker lost: the job now trains without it\" "
           "rank=%d",
           shard, lost);
  REQUIRE(harness_grep(srv->log, needle) == 1,
          "shard %d did not say at error level that it "
          "went on without rank %d",
          shard, lost);
  char http[64], body[65536];
  REQUIRE(scrape_http_addr(srv->log, http, sizeof(http), 5000) == 0, "shard %d: no http", shard);
  REQUIRE(scrape_get(http, "/metrics", body, sizeof(body)) == 200, "shard %d: /metrics", shard);
  double n = scrape_value(body, "ps_server_workers_lost_total");
  REQUIRE(n == 1, "shard %d: ps_server_workers_lost_total %g, expected 1", shard, n);
  if (!c) return;
  int ranks[4] = {-1, -1, -1, -1}, count = -1;
  REQUIRE(ps_lost_workers(c, ranks, 4, &count) == PS_OK && count == 1 && ranks[0] == lost,
          "ps_lost_workers: %d ranks, the first %d (expected only %d)", count, ranks[0], lost);
}

/* ---- continue ---------------------------------------------------------------- */

/* What rank 0 pulls after each step: the parameters (sgd, lr 1), or with
 * --optimizer sum the step's mean gradient. Gradients: rank 0 pushes 1,
 * rank 1 pushes 3. */
struct continue_case {
  const char *name;
  const char *const *extra;
  const char *start_line; /* how the shard says it chose continue */
  float step0, step1, step2, step3;
};

static void test_continue(const char *self, const struct continue_case *cc) {
  struct test_server srv;
  harness_start_server(&srv, 0, 1, 2, 1.0, cc->extra);
  REQUIRE(harness_grep(srv.log, cc->start_line) == 1, "%s: the start line does not say %s",
          cc->name, cc->start_line);
  char out1[512], out2[512], line[256];
  snprintf(out1, sizeof(out1), "%s/child-first-%s.out", harness_dir(), cc->name);
  snprintf(out2, sizeof(out2), "%s/child-rejoin-%s.out", harness_dir(), cc->name);
  pid_t child = spawn_child(self, srv.addr, "first", out1);

  static float p[N], g[N];
  ps_client *c = connect_as(srv.addr, 0);
  fill(p, 0);
  REQUIRE(ps_init(c, 0, p) == PS_OK, "init");
  fill(g, 1);
  uint64_t v;
  int count = -1;
  REQUIRE(ps_push(c, 0, 0, g) == PS_OK && ps_pull(c, 0, 1, p, &v) == PS_OK && v == 1, "step 0");
  expect_all(p, cc->step0, "step 0 (mean of 1 and 3)");
  REQUIRE(ps_lost_workers(c, NULL, 0, &count) == PS_OK && count == 0, "%d lost before any", count);
  wait_line(out1, "pushed 0", line, sizeof(line));
  kill9(child);

  double t0 = clock_now_s();
  REQUIRE(ps_push(c, 0, 1, g) == PS_OK, "push 1");
  REQUIRE(ps_pull(c, 0, 2, p, &v) == PS_OK && v == 2, "pull 2 after the timeout");
  double waited = clock_now_s() - t0;
  expect_all(p, cc->step1, "step 1 (rank 0 alone)");
  REQUIRE(waited < 10, "step 1 completed after %.2f s (timeout 0.5 s)", waited);
  struct ps_shard_stats st;
  REQUIRE(ps_stats(c, 0, &st) == PS_OK && st.live_workers == 1, "live workers %u", st.live_workers);
  expect_reported(c, &srv, 0, 1);
  /* step 2 does not wait for the gone worker: it completes, and the shard
   * did not have to time the worker out again to complete it (one loss,
   * counted once) */
  REQUIRE(ps_push(c, 0, 2, g) == PS_OK && ps_pull(c, 0, 3, p, &v) == PS_OK && v == 3, "step 2");
  expect_all(p, cc->step2, "step 2");
  expect_reported(c, &srv, 0, 1);

  /* the same rank comes back as a new process */
  child = spawn_child(self, srv.addr, "rejoin", out2);
  wait_line(out2, "resume ", line, sizeof(line));
  unsigned long long resume, rv;
  double value;
  REQUIRE(sscanf(line, "resume %llu version %llu value %lf", &resume, &rv, &value) == 3, "%s",
          line);
  REQUIRE(resume == 3 && rv == 3 && value == cc->step2, "rejoined worker: %s", line);
  REQUIRE(ps_push(c, 0, 3, g) == PS_OK, "push 3");
  REQUIRE(ps_pull(c, 0, 4, p, &v) == PS_OK && v == 4, "pull 4");
  expect_all(p, cc->step3, "step 3 with both");
  REQUIRE(ps_barrier(c) == PS_OK, "barrier");
  int cst = harness_wait(child, 10000);
  REQUIRE(cst >= 0 && WIFEXITED(cst) && WEXITSTATUS(cst) == 0, "rejoined worker failed (%d)", cst);
  wait_line(out2, "after ", line, sizeof(line));
  char want[64];
  snprintf(want, sizeof(want), "after version 4 value %g\n", (double)cc->step3);
  REQUIRE(strcmp(line, want) == 0, "rejoined worker saw: %s", line);

  uint64_t clocks[2];
  REQUIRE(ps_stats(c, 0, &st) == PS_OK && ps_worker_clocks(c, 0, clocks, 2) == PS_OK, "stats");
  REQUIRE(st.live_workers == 2 && clocks[0] == 4 && clocks[1] == 4, "live %u, clocks %llu %llu",
          st.live_workers, (unsigned long long)clocks[0], (unsigned long long)clocks[1]);
  REQUIRE(st.duplicates == st.num_keys, "%llu duplicates for %u keys (the stale step 0)",
          (unsigned long long)st.duplicates, st.num_keys);
  REQUIRE(st.updates == 4ull * st.num_keys, "updates %llu", (unsigned long long)st.updates);
  REQUIRE(harness_grep(srv.log, "worker rejoined") == 1,
          "the shard log does not say rank 1 "
          "came back");
  expect_reported(c, &srv, 0, 1); /* it rejoined, but the job went on without it meanwhile */
  REQUIRE(ps_shutdown_servers(c) == PS_OK, "shutdown");
  ps_client_free(c);
  int sst = harness_wait(srv.pid, 10000);
  REQUIRE(sst >= 0 && WIFEXITED(sst) && WEXITSTATUS(sst) == 0, "shard exit %d", sst);
  printf(
      "continue (%s): step 1 completed %.2f s after the kill without rank 1, reported as lost; "
      "rank 1 rejoined at step %llu and both went on\n",
      cc->name, waited, resume);
}

/* ---- fail: the default with --optimizer sum ------------------------------------------ */

static void test_fail(const char *self) {
  struct test_server srv;
  const char *extra[] = {"--optimizer", "sum", "--worker-timeout", "0.5", NULL};
  harness_start_server(&srv, 0, 1, 2, 1.0, extra);
  REQUIRE(harness_grep(srv.log, "on_worker_timeout=\"fail (auto: --optimizer sum)\"") == 1,
          "the start line does not say why it fails");
  char out1[512], line[256];
  snprintf(out1, sizeof(out1), "%s/child-fail.out", harness_dir());
  pid_t child = spawn_child(self, srv.addr, "first", out1);
  static float p[N], g[N];
  ps_client *c = connect_as(srv.addr, 0);
  fill(p, 0);
  fill(g, 1);
  REQUIRE(ps_init(c, 0, p) == PS_OK, "init");
  uint64_t v;
  REQUIRE(ps_push(c, 0, 0, g) == PS_OK && ps_pull(c, 0, 1, p, &v) == PS_OK, "step 0");
  wait_line(out1, "pushed 0", line, sizeof(line));
  kill9(child);
  double t0 = clock_now_s();
  REQUIRE(ps_push(c, 0, 1, g) == PS_OK, "push 1");
  ps_status st = ps_pull(c, 0, 2, p, &v);
  double waited = clock_now_s() - t0;
  char msg[512];
  ps_errmsg(c, msg, sizeof(msg));
  REQUIRE(st == PS_ERR_IO, "pull ended with %s after %.2f s (a lost worker is retryable)",
          ps_strerror(st), waited);
  REQUIRE(strstr(msg, "worker rank 1") && strstr(msg, "--on-worker-timeout auto: fail"),
          "message: %s", msg);
  REQUIRE(waited < 10, "failed after %.2f s (timeout 0.5 s)", waited);
  int sst = harness_wait(srv.pid, 10000);
  REQUIRE(sst >= 0 && WIFEXITED(sst) && WEXITSTATUS(sst) == 129, "shard exit status %d", sst);
  ps_client_free(c);
  printf("fail: the waiting pull failed %.2f s after the kill (\"%s\"); the shard exited 129\n",
         waited, msg);
}

/* fail, on a shard no step waits on: the workers went away (failed on
 * another shard, say) without leaving the steps. Nobody is left to need
 * this shard, so it stops the job too instead of running on for ever; a
 * rank that left the steps (ps_leave) does not count. */
static void test_fail_idle(void) {
  struct test_server srv;
  const char *extra[] = {"--optimizer", "sum", "--worker-timeout", "0.5", NULL};
  harness_start_server(&srv, 0, 1, 2, 1.0, extra);
  static float p[N];
  ps_client *c0 = connect_as(srv.addr, 0), *c1 = connect_as(srv.addr, 1);
  fill(p, 0);
  REQUIRE(ps_init(c0, 0, p) == PS_OK, "init");
  REQUIRE(ps_leave(c0, PS_LEAVE_FINISHED) == PS_OK, "rank 0 leaves");
  ps_client_free(c0);
  ps_client_free(c1); /* rank 1 just goes, no step pending */
  int sst = harness_wait(srv.pid, 10000);
  REQUIRE(sst >= 0 && WIFEXITED(sst) && WEXITSTATUS(sst) == 129, "shard exit status %d", sst);
  REQUIRE(harness_grep(srv.log, "msg=\"worker lost\" rank=1") == 1 &&
              harness_grep(srv.log, "msg=\"worker lost\" rank=0") == 0,
          "the shard did not blame rank 1 alone");
  printf("fail, idle: every worker away, rank 1 without leaving: the shard exited 129\n");
}

/* ---- real trainers ------------------------------------------------------------- */

#define LOST "msg=\"worker lost: the job now trains without it\""

/* ps-worker rank of world on servers; its log to log, its stdout (rank 0's
 * summary) to out (NULL: inherited). */
static pid_t start_trainer(const char *servers, int world, int rank, const char *log,
                           const char *out) {
  char bin[512], r[8], w[8];
  harness_bin("ps-worker/ps-worker", bin, sizeof(bin));
  snprintf(r, sizeof(r), "%d", rank);
  snprintf(w, sizeof(w), "%d", world);
  const char *argv[] = {
      bin, "--servers",    servers, "--world-size", w,    "--rank",        r,        "--epochs",
      "3", "--batch-size", "64",    "--log-every",  "20", "--chunk-bytes", "256KiB", NULL};
  return harness_spawn(argv, out, log);
}

/* Whether the trainers' data is here; else this part is skipped. */
static bool have_dataset(const char *part) {
  if (harness_have_dataset()) return true;
  harness_skip("%s: no Fashion-MNIST under %s", part, HARNESS_DATA_DIR);
  return false;
}

static void start_shards(struct test_server *srv, int workers, const char *const *extra,
                         char *servers, size_t len) {
  for (int i = 0; i < 2; i++) harness_start_server(&srv[i], i, 2, workers, 0.05, extra);
  snprintf(servers, len, "%s,%s", srv[0].addr, srv[1].addr);
}

/* Upper bounds of the waits for the trainers' progress and the shards'
 * verdicts: generous, since the suite must pass on a loaded machine (a
 * trainer starting among a whole suite on 2 cores took more than 10 s). */
#define PROGRESS_WAIT_MS 60000
#define VERDICT_WAIT_MS 30000

static void wait_progress(const char *log0) {
  for (int i = 0; i < PROGRESS_WAIT_MS / 10 && harness_grep(log0, "progress") < 2; i++)
    clock_sleep_ms(10);
  REQUIRE(harness_grep(log0, "progress") >= 2, "rank 0 made no progress");
}

/* Rank 0's summary ends with workers_lost=1, and its log names the rank. */
static void expect_summary_lost(const char *out0, const char *log0) {
  struct harness_summary sum;
  REQUIRE(harness_read_summary(out0, &sum) == 0, "no summary line in %s", out0);
  REQUIRE(sum.workers_lost == 1, "the summary says workers_lost=%d, expected 1", sum.workers_lost);
  REQUIRE(harness_grep(log0, "workers_lost=1 ranks=1") == 1 &&
              harness_grep(log0, "level=error proc=ps-worker-0 msg=\"the job went on without") == 1,
          "rank 0 did not name the lost rank at error level");
}

/* Default with an optimizer on the shards (auto: continue): rank 1 killed,
 * rank 0 trains alone, rank 1 restarted rejoins; reported as lost. */
static void test_trainers(void) {
  if (!have_dataset("trainers")) return;
  struct test_server srv[2];
  const char *extra[] = {"--optimizer", "momentum", "--worker-timeout", "0.5", NULL};
  char servers[256];
  start_shards(srv, 2, extra, servers, sizeof(servers));
  char log0[512], out0[512], log1[512], log1b[512];
  snprintf(log0, sizeof(log0), "%s/trainer-0.log", harness_dir());
  snprintf(out0, sizeof(out0), "%s/trainer-0.out", harness_dir());
  snprintf(log1, sizeof(log1), "%s/trainer-1.log", harness_dir());
  snprintf(log1b, sizeof(log1b), "%s/trainer-1-again.log", harness_dir());
  pid_t w0 = start_trainer(servers, 2, 0, log0, out0);
  pid_t w1 = start_trainer(servers, 2, 1, log1, NULL);
  wait_progress(log0);
  kill9(w1);
  /* once the shards have given up on it, rank 0 trains alone until it is back */
  for (int i = 0; i < VERDICT_WAIT_MS / 10 && harness_grep(srv[0].log, LOST) == 0; i++)
    clock_sleep_ms(10);
  REQUIRE(harness_grep(srv[0].log, LOST) == 1, "shard 0 never declared rank 1 lost");
  w1 = start_trainer(servers, 2, 1, log1b, NULL);
  int st0 = harness_wait(w0, 60000), st1 = harness_wait(w1, 60000);
  REQUIRE(st0 >= 0 && WIFEXITED(st0) && WEXITSTATUS(st0) == 0, "rank 0 failed (status %d)", st0);
  REQUIRE(st1 >= 0 && WIFEXITED(st1) && WEXITSTATUS(st1) == 0, "restarted rank 1 failed (%d)", st1);
  for (int i = 0; i < 2; i++) {
    int st = harness_wait(srv[i].pid, 10000);
    REQUIRE(st >= 0 && WIFEXITED(st) && WEXITSTATUS(st) == 0, "shard %d exit %d", i, st);
    REQUIRE(harness_grep(srv[i].log, LOST) >= 1 && harness_grep(srv[i].log, "worker rejoined") >= 1,
            "shard %d did not see rank 1 leave and come back", i);
  }
  expect_summary_lost(out0, log0);
  REQUIRE(harness_grep(log1b, "workers_lost=1") == 1, "restarted rank 1's done line");
  printf(
      "trainers: rank 1 killed mid-run and restarted; both finished, shards exited 0, "
      "workers_lost=1\n");
}

/* --on-worker-timeout fail: a killed rank makes every other rank and the
 * shards exit 129 (retryable: the job restarts). */
static void test_trainers_fail(void) {
  if (!have_dataset("trainers fail")) return;
  struct test_server srv[2];
  const char *extra[] = {
      "--optimizer", "momentum", "--worker-timeout", "0.5", "--on-worker-timeout", "fail", NULL};
  char servers[256];
  start_shards(srv, 3, extra, servers, sizeof(servers));
  char logs[3][512];
  pid_t w[3];
  for (int r = 0; r < 3; r++) {
    snprintf(logs[r], sizeof(logs[r]), "%s/fail-%d.log", harness_dir(), r);
    w[r] = start_trainer(servers, 3, r, logs[r], NULL);
  }
  wait_progress(logs[0]);
  kill9(w[1]);
  for (int r = 0; r < 3; r += 2) {
    int st = harness_wait(w[r], 30000);
    REQUIRE(st >= 0 && WIFEXITED(st) && WEXITSTATUS(st) == 129, "rank %d: status %d, not exit 129",
            r, st);
    REQUIRE(harness_grep(logs[r], "worker rank 1 has been gone") >= 1,
            "rank %d does not say which worker was lost", r);
  }
  for (int i = 0; i < 2; i++) {
    int st = harness_wait(srv[i].pid, 10000);
    REQUIRE(st >= 0 && WIFEXITED(st) && WEXITSTATUS(st) == 129, "shard %d exit %d", i, st);
  }
  printf("trainers, fail: rank 1 killed; ranks 0 and 2 and both shards exited 129\n");
}

/* ---- stopped: heartbeats --------------------------------------------------------- */

static void test_stopped(void) {
  if (!have_dataset("stopped")) return;
  struct test_server srv[2];
  /* the shards stay up after the training for their /metrics */
  const char *extra[] = {"--optimizer", "momentum", "--worker-timeout", "2", "--exit-when-done",
                         "false",       NULL};
  char servers[256];
  start_shards(srv, 2, extra, servers, sizeof(servers));
  char log0[512], out0[512], log1[512];
  snprintf(log0, sizeof(log0), "%s/stopped-0.log", harness_dir());
  snprintf(out0, sizeof(out0), "%s/stopped-0.out", harness_dir());
  snprintf(log1, sizeof(log1), "%s/stopped-1.log", harness_dir());
  pid_t w0 = start_trainer(servers, 2, 0, log0, out0);
  pid_t w1 = start_trainer(servers, 2, 1, log1, NULL);
  wait_progress(log0);
  REQUIRE(kill(w1, SIGSTOP) == 0, "SIGSTOP");
  /* the event: each shard says the worker fell silent for --worker-timeout
   * (2 s, the line names it; the default is 60 s) and declares it lost;
   * waited for with 15 times the timeout */
  double t0 = clock_now_s();
  bool gone = harness_wait_grep(srv[0].log, LOST, 1, 30000) >= 1 &&
              harness_wait_grep(srv[1].log, LOST, 1, 30000) >= 1;
  double noticed = clock_now_s() - t0;
  REQUIRE(gone, "the shards did not declare the stopped rank lost within 30 s");
  for (int i = 0; i < 2; i++)
    REQUIRE(
        harness_grep(srv[i].log, "worker silent") == 1 &&
            harness_grep(srv[i].log, "msg=\"worker silent, closing its connection\" peer") == 1 &&
            harness_grep(srv[i].log, " worker_timeout_s=2.0") == 1,
        "shard %d: not exactly one worker silent for --worker-timeout 2", i);
  /* rank 0 goes on alone meanwhile */
  int before = harness_grep(log0, "progress");
  for (int i = 0; i < PROGRESS_WAIT_MS / 10 && harness_grep(log0, "progress") == before; i++)
    clock_sleep_ms(10);
  REQUIRE(harness_grep(log0, "progress") > before, "rank 0 did not go on without the stopped rank");
  REQUIRE(kill(w1, SIGCONT) == 0, "SIGCONT");
  int st0 = harness_wait(w0, 60000), st1 = harness_wait(w1, 60000);
  REQUIRE(st0 >= 0 && WIFEXITED(st0) && WEXITSTATUS(st0) == 0, "rank 0 failed (status %d)", st0);
  REQUIRE(st1 >= 0 && WIFEXITED(st1) && WEXITSTATUS(st1) == 0, "resumed rank 1 failed (%d)", st1);
  expect_summary_lost(out0, log0);
  for (int i = 0; i < 2; i++) {
    REQUIRE(harness_grep(srv[i].log, "rank=1 silent_s=") == 1 &&
                harness_grep(srv[i].log, "worker rejoined") >= 1,
            "shard %d: rank 1 was not the silent one, or did not rejoin", i);
    expect_reported(NULL, &srv[i], i, 1);
    int st = harness_stop(srv[i].pid, SIGTERM, 10000);
    REQUIRE(st >= 0 && WIFEXITED(st) && WEXITSTATUS(st) == 0, "shard %d exit %d", i, st);
  }
  printf(
      "stopped: a SIGSTOPped rank declared lost %.2f s after the stop (--worker-timeout 2), "
      "rank 0 went on alone, the resumed rank rejoined; both finished, workers_lost=1 in the "
      "summary and in /metrics\n",
      noticed);
}

int main(int argc, char **argv) {
  if (argc == 4 && strcmp(argv[1], "child") == 0) return child_main(argv[2], argv[3]);
  char self[1024];
  ssize_t n = readlink("/proc/self/exe", self, sizeof(self) - 1);
  REQUIRE(n > 0, "readlink /proc/self/exe");
  self[n] = 0;
  static const char *const auto_sgd[] = {"--optimizer", "sgd", "--worker-timeout", "0.5", NULL};
  static const char *const sum_continue[] = {
      "--optimizer", "sum", "--worker-timeout", "0.5", "--on-worker-timeout", "continue", NULL};
  static const struct continue_case cases[] = {
      {"auto-sgd", auto_sgd, "on_worker_timeout=\"continue (auto: --optimizer sgd)\"", -2, -3, -4,
       -6},
      {"sum-continue", sum_continue,
       "on_worker_timeout=\"continue (--on-worker-timeout continue)\"", 2, 1, 1, 2},
  };
  for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) test_continue(self, &cases[i]);
  test_fail(self);
  test_fail_idle();
  test_trainers();
  test_trainers_fail();
  test_stopped();
  return harness_status();
}
