/* A worker that disappears in BSP: kill -9 of a worker process, with the
 * shard's --worker-timeout 0.5 s.
 *
 * continue: W=2 (this process is rank 0; rank 1 is this binary re-executed
 * as a child). Both push step 0; rank 1 is killed; rank 0's pull of version
 * 2 is answered once the timeout has passed, with step 1 averaged over the
 * one worker that pushed it; step 2 then needs rank 0 alone. A new rank-1
 * process (same rank, fresh client) asks where to resume (step 3), pulls the
 * current parameters (version 3), pushes a stale step 0 as a restarted
 * trainer would (acknowledged as a duplicate, not applied) and step 3, which
 * the shard now waits for again. SGD with lr 1 keeps every value exact.
 *
 * fail (--on-worker-timeout fail): the same kill makes rank 0's waiting
 * pull fail with an error naming rank 1, and the shard exits 129.
 *
 * Then the real trainer: two ps-worker processes on two shards (bsp); rank 1
 * is killed mid-run, rank 0 trains alone once the shards declare it gone,
 * and rank 1 restarted with the same command rejoins (the unchanged trainer
 * replays its early steps as duplicates until it reaches the shards' step);
 * both finish and the shards exit 0.
 *
 * Stopped, not gone: the same two trainers, with --worker-timeout 2, and
 * rank 1 SIGSTOPped mid-run with its sockets open. Its heartbeats stop, so
 * each shard closes its connection within the timeout (plus a sweep) and
 * declares it gone; rank 0, which beats on while it waits for rank 1's
 * pushes, is not taken for silent and then trains alone. After SIGCONT rank
 * 1's libps finds its connections closed, reconnects and rejoins; both
 * finish and the shards exit 0. */
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
  char log[512];
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

/* ---- continue ---------------------------------------------------------------- */

static void test_continue(const char *self) {
  struct test_server srv;
  const char *extra[] = {"--optimizer", "sgd", "--worker-timeout", "0.5", NULL};
  harness_start_server(&srv, 0, 1, 2, 1.0, extra);
  char out1[512], out2[512], line[256];
  snprintf(out1, sizeof(out1), "%s/child-first.out", harness_dir());
  snprintf(out2, sizeof(out2), "%s/child-rejoin.out", harness_dir());
  pid_t child = spawn_child(self, srv.addr, "first", out1);

  static float p[N], g[N];
  ps_client *c = connect_as(srv.addr, 0);
  fill(p, 0);
  REQUIRE(ps_init(c, 0, p) == PS_OK, "init");
  fill(g, 1);
  uint64_t v;
  REQUIRE(ps_push(c, 0, 0, g) == PS_OK && ps_pull(c, 0, 1, p, &v) == PS_OK && v == 1, "step 0");
  expect_all(p, -2, "step 0 (mean of 1 and 3)");
  wait_line(out1, "pushed 0", line, sizeof(line));
  kill9(child);

  double t0 = clock_now_s();
  REQUIRE(ps_push(c, 0, 1, g) == PS_OK, "push 1");
  REQUIRE(ps_pull(c, 0, 2, p, &v) == PS_OK && v == 2, "pull 2 after the timeout");
  double waited = clock_now_s() - t0;
  expect_all(p, -3, "step 1 (rank 0 alone)");
  REQUIRE(waited >= 0.4 && waited < 5, "step 1 completed after %.2f s (timeout 0.5 s)", waited);
  struct ps_shard_stats st;
  REQUIRE(ps_stats(c, 0, &st) == PS_OK && st.live_workers == 1, "live workers %u", st.live_workers);
  t0 = clock_now_s();
  REQUIRE(ps_push(c, 0, 2, g) == PS_OK && ps_pull(c, 0, 3, p, &v) == PS_OK && v == 3, "step 2");
  REQUIRE(clock_now_s() - t0 < 0.4, "step 2 waited for the gone worker (%.2f s)",
          clock_now_s() - t0);
  expect_all(p, -4, "step 2");

  /* the same rank comes back as a new process */
  child = spawn_child(self, srv.addr, "rejoin", out2);
  wait_line(out2, "resume ", line, sizeof(line));
  unsigned long long resume, rv;
  double value;
  REQUIRE(sscanf(line, "resume %llu version %llu value %lf", &resume, &rv, &value) == 3, "%s",
          line);
  REQUIRE(resume == 3 && rv == 3 && value == -4, "rejoined worker: %s", line);
  REQUIRE(ps_push(c, 0, 3, g) == PS_OK, "push 3");
  REQUIRE(ps_pull(c, 0, 4, p, &v) == PS_OK && v == 4, "pull 4");
  expect_all(p, -6, "step 3 with both (4 - mean(1,3))");
  REQUIRE(ps_barrier(c) == PS_OK, "barrier");
  int cst = harness_wait(child, 10000);
  REQUIRE(cst >= 0 && WIFEXITED(cst) && WEXITSTATUS(cst) == 0, "rejoined worker failed (%d)", cst);
  wait_line(out2, "after ", line, sizeof(line));
  REQUIRE(strcmp(line, "after version 4 value -6\n") == 0, "rejoined worker saw: %s", line);

  uint64_t clocks[2];
  REQUIRE(ps_stats(c, 0, &st) == PS_OK && ps_worker_clocks(c, 0, clocks, 2) == PS_OK, "stats");
  REQUIRE(st.live_workers == 2 && clocks[0] == 4 && clocks[1] == 4, "live %u, clocks %llu %llu",
          st.live_workers, (unsigned long long)clocks[0], (unsigned long long)clocks[1]);
  REQUIRE(st.duplicates == st.num_keys, "%llu duplicates for %u keys (the stale step 0)",
          (unsigned long long)st.duplicates, st.num_keys);
  REQUIRE(st.updates == 4ull * st.num_keys, "updates %llu", (unsigned long long)st.updates);
  REQUIRE(
      harness_grep(srv.log, "worker gone") == 1 && harness_grep(srv.log, "worker rejoined") == 1,
      "the shard log does not say who left and came back");
  REQUIRE(ps_shutdown_servers(c) == PS_OK, "shutdown");
  ps_client_free(c);
  int sst = harness_wait(srv.pid, 10000);
  REQUIRE(sst >= 0 && WIFEXITED(sst) && WEXITSTATUS(sst) == 0, "shard exit %d", sst);
  printf(
      "continue: step 1 completed %.2f s after the kill without rank 1; rank 1 rejoined at "
      "step %llu and both went on\n",
      waited, resume);
}

/* ---- fail ------------------------------------------------------------------------ */

static void test_fail(const char *self) {
  struct test_server srv;
  const char *extra[] = {"--optimizer", "sgd", "--worker-timeout", "0.5", "--on-worker-timeout",
                         "fail",        NULL};
  harness_start_server(&srv, 0, 1, 2, 1.0, extra);
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
  REQUIRE(st == PS_ERR_REMOTE, "pull ended with %s after %.2f s", ps_strerror(st), waited);
  REQUIRE(strstr(msg, "worker rank 1") && strstr(msg, "--on-worker-timeout fail"), "message: %s",
          msg);
  REQUIRE(waited >= 0.4 && waited < 5, "failed after %.2f s", waited);
  int sst = harness_wait(srv.pid, 10000);
  REQUIRE(sst >= 0 && WIFEXITED(sst) && WEXITSTATUS(sst) == 129, "shard exit status %d", sst);
  ps_client_free(c);
  printf("fail: the waiting pull failed %.2f s after the kill (\"%s\"); the shard exited 129\n",
         waited, msg);
}

/* ---- real trainers ------------------------------------------------------------- */

static pid_t start_trainer(const char *servers, int rank, const char *log) {
  char bin[512], r[8];
  harness_bin("ps-worker/ps-worker", bin, sizeof(bin));
  snprintf(r, sizeof(r), "%d", rank);
  const char *argv[] = {
      bin, "--servers",    servers, "--world-size", "2",  "--rank",        r,        "--epochs",
      "3", "--batch-size", "64",    "--log-every",  "20", "--chunk-bytes", "256KiB", NULL};
  return harness_spawn(argv, NULL, log);
}

static void test_trainers(void) {
  if (!harness_have_dataset()) {
    harness_skip("trainers: no Fashion-MNIST under %s", HARNESS_DATA_DIR);
    return;
  }
  struct test_server srv[2];
  const char *extra[] = {"--optimizer", "momentum", "--worker-timeout", "0.5", NULL};
  char servers[256];
  for (int i = 0; i < 2; i++) harness_start_server(&srv[i], i, 2, 2, 0.05, extra);
  snprintf(servers, sizeof(servers), "%s,%s", srv[0].addr, srv[1].addr);
  char log0[512], log1[512], log1b[512];
  snprintf(log0, sizeof(log0), "%s/trainer-0.log", harness_dir());
  snprintf(log1, sizeof(log1), "%s/trainer-1.log", harness_dir());
  snprintf(log1b, sizeof(log1b), "%s/trainer-1-again.log", harness_dir());
  pid_t w0 = start_trainer(servers, 0, log0);
  pid_t w1 = start_trainer(servers, 1, log1);
  for (int i = 0; i < 1000 && harness_grep(log0, "progress") < 2; i++) clock_sleep_ms(10);
  REQUIRE(harness_grep(log0, "progress") >= 2, "rank 0 made no progress");
  kill9(w1);
  /* once the shards have given up on it, rank 0 trains alone until it is back */
  for (int i = 0; i < 500 && harness_grep(srv[0].log, "worker gone") == 0; i++) clock_sleep_ms(10);
  REQUIRE(harness_grep(srv[0].log, "worker gone") == 1, "shard 0 never declared rank 1 gone");
  w1 = start_trainer(servers, 1, log1b);
  int st0 = harness_wait(w0, 60000), st1 = harness_wait(w1, 60000);
  REQUIRE(st0 >= 0 && WIFEXITED(st0) && WEXITSTATUS(st0) == 0, "rank 0 failed (status %d)", st0);
  REQUIRE(st1 >= 0 && WIFEXITED(st1) && WEXITSTATUS(st1) == 0, "restarted rank 1 failed (%d)", st1);
  for (int i = 0; i < 2; i++) {
    int st = harness_wait(srv[i].pid, 10000);
    REQUIRE(st >= 0 && WIFEXITED(st) && WEXITSTATUS(st) == 0, "shard %d exit %d", i, st);
    REQUIRE(harness_grep(srv[i].log, "worker gone") >= 1 &&
                harness_grep(srv[i].log, "worker rejoined") >= 1,
            "shard %d did not see rank 1 leave and come back", i);
  }
  printf("trainers: rank 1 killed mid-run and restarted; both finished, shards exited 0\n");
}

/* ---- stopped: heartbeats --------------------------------------------------------- */

static void test_stopped(void) {
  if (!harness_have_dataset()) {
    harness_skip("stopped: no Fashion-MNIST under %s", HARNESS_DATA_DIR);
    return;
  }
  struct test_server srv[2];
  const char *extra[] = {"--optimizer", "momentum", "--worker-timeout", "2", NULL};
  char servers[256];
  for (int i = 0; i < 2; i++) harness_start_server(&srv[i], i, 2, 2, 0.05, extra);
  snprintf(servers, sizeof(servers), "%s,%s", srv[0].addr, srv[1].addr);
  char log0[512], log1[512];
  snprintf(log0, sizeof(log0), "%s/stopped-0.log", harness_dir());
  snprintf(log1, sizeof(log1), "%s/stopped-1.log", harness_dir());
  pid_t w0 = start_trainer(servers, 0, log0);
  pid_t w1 = start_trainer(servers, 1, log1);
  for (int i = 0; i < 1000 && harness_grep(log0, "progress") < 2; i++) clock_sleep_ms(10);
  REQUIRE(harness_grep(log0, "progress") >= 2, "rank 0 made no progress");
  REQUIRE(kill(w1, SIGSTOP) == 0, "SIGSTOP");
  double t0 = clock_now_s();
  bool gone = false;
  while (!gone && clock_now_s() - t0 < 10) {
    gone = harness_grep(srv[0].log, "worker gone") >= 1 &&
           harness_grep(srv[1].log, "worker gone") >= 1;
    if (!gone) clock_sleep_ms(10);
  }
  double noticed = clock_now_s() - t0;
  REQUIRE(gone, "the shards did not declare the stopped rank gone within 10 s");
  REQUIRE(noticed >= 1.5 && noticed < 2 + 1.5,
          "the stopped rank was declared gone %.2f s after SIGSTOP (--worker-timeout 2)", noticed);
  for (int i = 0; i < 2; i++)
    REQUIRE(harness_grep(srv[i].log, "worker silent") == 1 &&
                harness_grep(srv[i].log, "msg=\"worker silent, closing its connection\" peer") == 1,
            "shard %d: not exactly one silent worker", i);
  /* rank 0 goes on alone meanwhile */
  int before = harness_grep(log0, "progress");
  for (int i = 0; i < 500 && harness_grep(log0, "progress") == before; i++) clock_sleep_ms(10);
  REQUIRE(harness_grep(log0, "progress") > before, "rank 0 did not go on without the stopped rank");
  REQUIRE(kill(w1, SIGCONT) == 0, "SIGCONT");
  int st0 = harness_wait(w0, 60000), st1 = harness_wait(w1, 60000);
  REQUIRE(st0 >= 0 && WIFEXITED(st0) && WEXITSTATUS(st0) == 0, "rank 0 failed (status %d)", st0);
  REQUIRE(st1 >= 0 && WIFEXITED(st1) && WEXITSTATUS(st1) == 0, "resumed rank 1 failed (%d)", st1);
  for (int i = 0; i < 2; i++) {
    int st = harness_wait(srv[i].pid, 10000);
    REQUIRE(st >= 0 && WIFEXITED(st) && WEXITSTATUS(st) == 0, "shard %d exit %d", i, st);
    REQUIRE(harness_grep(srv[i].log, "rank=1 silent_s=") == 1 &&
                harness_grep(srv[i].log, "worker rejoined") >= 1,
            "shard %d: rank 1 was not the silent one, or did not rejoin", i);
  }
  printf(
      "stopped: a SIGSTOPped rank declared gone %.2f s after the stop (--worker-timeout 2), "
      "rank 0 went on alone, the resumed rank rejoined; both finished\n",
      noticed);
}

int main(int argc, char **argv) {
  if (argc == 4 && strcmp(argv[1], "child") == 0) return child_main(argv[2], argv[3]);
  char self[1024];
  ssize_t n = readlink("/proc/self/exe", self, sizeof(self) - 1);
  REQUIRE(n > 0, "readlink /proc/self/exe");
  self[n] = 0;
  test_continue(self);
  test_fail(self);
  test_trainers();
  test_stopped();
  return harness_status();
}
