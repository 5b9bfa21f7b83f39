/* A shard stopped in the middle of BSP training, with checkpoints on:
 *  - "sigterm": SIGTERM (as Kubernetes sends before deleting a pod); the
 *    shard drains, writes a final checkpoint and exits 0; a supervisor (this
 *    test) starts it again on the same address; it loads the checkpoint and
 *    the workers, which reconnect and resend what was in flight, finish.
 *  - "sigstop": SIGSTOP for a few seconds (argv[2], default 3), then SIGCONT.
 *  - "kill9 N": kill -9 of a random shard N times, each a little after one
 *    of its periodic checkpoints, restarted by the test (as a StatefulSet
 *    would). The restarted shard is behind the job: requests ahead of it
 *    fail with PS_ERR_ROLLBACK, and each worker then waits for its step's
 *    requests, calls ps_rollback(clock) (every shard goes back to its
 *    checkpoint of that clock) and continues from that step.
 * S=2 shards, W=2 worker processes through libps, K steps; every gradient
 * depends on the pulled parameters. The ledger is the replay: the test
 * recomputes every step locally, exactly once, and compares every parameter
 * at the end, so a lost step (a gradient applied 0 times) or a doubled one
 * (applied twice) shows up as a difference; every pull must return exactly
 * the version of its step, so a restart that redid or skipped a step stops
 * the test. In kill9 mode every step after a restored checkpoint is redone
 * once, so equality with the replay means 0 lost and 0 doubled updates up to
 * each restored checkpoint and after it. The shard's final checkpoint is
 * then checked with ps-ckpt-inspect. */
#include <math.h>
#include <signal.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "bsp_ledger.h"
#include "clock.h"
#include "harness.h"
#include "ps.h"

#define S 2
#define W 2
#define K 60
#define NT 3
static const char *const names[NT] = {"w0", "b0", "big"};
static const uint64_t counts[NT] = {1000, 10, 5000};
static const float lr = 0.05f;
static struct test_server servers[S];
static int nshards = S;
static bool kill9;

/* One BSP step: pull every tensor at version s, push its gradient. Waits
 * for every request it issued; returns the first failure. */
static ps_status step_once(ps_client *c, int rank, uint64_t s, float **p, float **g) {
  ps_request *req[NT];
  ps_status bad = PS_OK;
  for (int t = 0; t < NT; t++)
    REQUIRE(ps_pull_async(c, t, s, p[t], NULL, NULL, &req[t]) == PS_OK, "pull");
  for (int t = 0; t < NT; t++) {
    uint64_t v = 0;
    ps_status st = ps_wait(req[t], &v);
    if (st != PS_OK && bad == PS_OK) bad = st;
    if (st == PS_OK)
      REQUIRE(v == s, "rank %d pulled version %llu at step %llu", rank, (unsigned long long)v,
              (unsigned long long)s);
  }
  if (bad != PS_OK) return bad;
  for (int t = 0; t < NT; t++) {
    for (uint64_t i = 0; i < counts[t]; i++) g[t][i] = bsp_grad_value(rank, s, i, p[t][i]);
    REQUIRE(ps_push_async(c, t, s, g[t], NULL, NULL, &req[t]) == PS_OK, "push");
  }
  for (int t = 0; t < NT; t++) {
    ps_status st = ps_wait(req[t], NULL);
    if (st != PS_OK && bad == PS_OK) bad = st;
  }
  return bad;
}

static int worker(void *arg) {
  int rank = (int)(intptr_t)arg;
  const char *addrs[S];
  for (int i = 0; i < nshards; i++) addrs[i] = servers[i].addr;
  struct ps_client_opts o = {.servers = addrs,
                             .num_servers = nshards,
                             .rank = rank,
                             .world_size = W,
                             .chunk_bytes = 4096,
                             .job_id = "test_shard_restart",
                             .reconnect_timeout_ms = 60000};
  ps_client *c;
  char err[256];
  REQUIRE(ps_client_new(&o, &c, err, sizeof(err)) == PS_OK, "rank %d connect: %s", rank, err);
  REQUIRE(ps_declare(c, NT, names, counts) == PS_OK, "declare");
  float *p[NT], *g[NT];
  bsp_ledger_tensors(c, rank, NT, counts, p, g);
  uint64_t step = 0;
  int rollbacks = 0;
  while (step < K) {
    ps_status st = step_once(c, rank, step, p, g);
    if (st == PS_ERR_ROLLBACK && kill9) {
      /* a shard came back from an older checkpoint: the whole job goes
       * back to it (every request of this step has finished) */
      uint64_t back = ps_rollback_clock(c);
      REQUIRE(back != UINT64_MAX && back <= step, "rank %d: rollback to %llu at step %llu", rank,
              (unsigned long long)back, (unsigned long long)step);
      ps_status r = ps_rollback(c, back);
      char msg[512];
      REQUIRE(r == PS_OK, "rank %d: ps_rollback(%llu): %s (%s)", rank, (unsigned long long)back,
              ps_strerror(r), ps_errmsg(c, msg, sizeof(msg)));
      step = back;
      rollbacks++;
      continue;
    }
    char msg[512];
    REQUIRE(st == PS_OK, "rank %d step %llu: %s (%s)", rank, (unsigned long long)step,
            ps_strerror(st), ps_errmsg(c, msg, sizeof(msg)));
    step++;
    usleep(30000); /* steps take time, so the fault lands mid-training */
  }
  if (kill9) fprintf(stderr, "rank %d: %d rollbacks\n", rank, rollbacks);
  int bad = 0;
  for (int t = 0; t < NT; t++) {
    uint64_t v;
    REQUIRE(ps_pull(c, t, K, p[t], &v) == PS_OK && v == K, "final pull");
    bad += bsp_replay_compare(rank, names[t], t, counts[t], W, K, lr, p[t]);
  }
  REQUIRE(bad == 0, "%d parameters differ from the ledger replay (lost or doubled updates)", bad);
  REQUIRE(ps_barrier(c) == PS_OK, "barrier");
  if (rank == 0) REQUIRE(ps_shutdown_servers(c) == PS_OK, "shutdown");
  bsp_ledger_tensors_free(NT, p, g);
  ps_client_free(c);
  return 0;
}

/* The newest clock of the checkpoints the shard logging to file wrote, or
 * -1 if none. */
static long newest_checkpoint(const char *file) {
  FILE *f = fopen(file, "r");
  long newest = -1;
  char line[4096];
  while (f && fgets(line, sizeof(line), f)) {
    const char *at = strstr(line, "msg=\"checkpoint written\"");
    const char *clock = at ? strstr(at, " clock=") : NULL;
    if (clock && atol(clock + 7) > newest) newest = atol(clock + 7);
  }
  if (f) fclose(f);
  return newest;
}

/* Waits until the shard logging to file wrote a checkpoint of clock >=
 * min_clock (a writer still busy skips one, so not exactly that clock);
 * returns seconds waited or -1. */
static double wait_for(const char *file, long min_clock, double timeout_s) {
  double t0 = clock_now_s();
  while (clock_now_s() - t0 < timeout_s) {
    if (newest_checkpoint(file) >= min_clock) return clock_now_s() - t0;
    usleep(20000);
  }
  return -1;
}

int main(int argc, char **argv) {
  const char *mode = argc > 1 ? argv[1] : "sigterm";
  int stop_s = argc > 2 ? atoi(argv[2]) : 3;
  char ckdir[600];
  snprintf(ckdir, sizeof(ckdir), "%s/ckpt", harness_dir());
  const char *extra[] = {"--checkpoint-dir", ckdir, "--checkpoint-every", "5", NULL};
  kill9 = strcmp(mode, "kill9") == 0;
  int kills = kill9 && argc > 2 ? atoi(argv[2]) : 3;
  for (int i = 0; i < nshards; i++) harness_start_server(&servers[i], i, nshards, W, lr, extra);
  pid_t pids[W];
  for (int r = 0; r < W; r++) pids[r] = harness_fork(worker, (void *)(intptr_t)r);

  /* mid-training: after shard 0's second periodic checkpoint */
  REQUIRE(wait_for(servers[0].log, 10, 60) >= 0, "no checkpoint of clock >= 10 within 60 s");
  char old_log[512];
  snprintf(old_log, sizeof(old_log), "%s", servers[0].log);
  if (strcmp(mode, "sigterm") == 0) {
    double t0 = clock_now_s();
    int st = harness_stop(servers[0].pid, SIGTERM, 20000);
    double t_stop = clock_now_s() - t0;
    REQUIRE(st >= 0 && WIFEXITED(st) && WEXITSTATUS(st) == 0, "shard 0 after SIGTERM: status %d",
            st);
    REQUIRE(harness_grep(old_log, "msg=\"final checkpoint\"") == 1, "no final checkpoint logged");
    REQUIRE(harness_grep(old_log, "unfinished_steps=0") == 1, "the drain left a step unfinished");
    const char *again[] = {"--checkpoint-dir", ckdir, "--checkpoint-every", "5", "--listen",
                           servers[0].addr,    NULL};
    char addr[64];
    snprintf(addr, sizeof(addr), "%s", servers[0].addr);
    again[5] = addr;
    t0 = clock_now_s();
    harness_start_server(&servers[0], 0, S, W, lr, again);
    double t_start = clock_now_s() - t0;
    REQUIRE(strcmp(servers[0].addr, addr) == 0, "restarted on %s, not %s", servers[0].addr, addr);
    REQUIRE(harness_grep(servers[0].log, "checkpoint loaded") == 1, "restart loaded no checkpoint");
    printf("sigterm: drain + final checkpoint + exit %.3f s, restart + load %.3f s\n", t_stop,
           t_start);
  } else if (kill9) {
    /* kill -9 a random shard `kills` times, each time after it wrote a
     * newer checkpoint, and restart it as a StatefulSet would */
    srand((unsigned)getpid());
    for (int k = 0; k < kills; k++) {
      int v = rand() % nshards;
      long want = 10 + 10 * k;
      REQUIRE(wait_for(servers[v].log, want, 60) >= 0, "shard %d: no checkpoint of clock >= %ld", v,
              want);
      usleep((useconds_t)(rand() % 150000)); /* somewhere in the next steps */
      double t0 = clock_now_s();
      REQUIRE(kill(servers[v].pid, SIGKILL) == 0, "kill");
      int st = harness_wait(servers[v].pid, 10000);
      REQUIRE(st >= 0 && WIFSIGNALED(st), "shard %d not killed: %d", v, st);
      const char *again[] = {
          "--checkpoint-dir", ckdir, "--checkpoint-every", "5", "--listen", NULL, NULL};
      char addr[64];
      snprintf(addr, sizeof(addr), "%s", servers[v].addr);
      again[5] = addr;
      harness_start_server(&servers[v], v, nshards, W, lr, again);
      REQUIRE(harness_grep(servers[v].log, "checkpoint loaded") == 1, "shard %d loaded nothing", v);
      printf("kill9 %d: shard %d killed and restarted + loaded in %.3f s\n", k + 1, v,
             clock_now_s() - t0);
    }
  } else {
    REQUIRE(kill(servers[0].pid, SIGSTOP) == 0, "SIGSTOP");
    sleep((unsigned)stop_s);
    REQUIRE(kill(servers[0].pid, SIGCONT) == 0, "SIGCONT");
    printf("sigstop: shard 0 stopped %d s\n", stop_s);
  }
  double t0 = clock_now_s();
  for (int r = 0; r < W; r++) {
    int st = harness_wait(pids[r], 90000);
    REQUIRE(st >= 0 && WIFEXITED(st) && WEXITSTATUS(st) == 0, "worker %d failed (status %d)", r,
            st);
  }
  printf("%s: training finished %.2f s after the fault; replay equal (0 lost, 0 doubled)\n", mode,
         clock_now_s() - t0);
  for (int i = 0; i < nshards; i++) {
    int st = harness_wait(servers[i].pid, 20000);
    REQUIRE(st >= 0 && WIFEXITED(st) && WEXITSTATUS(st) == 0, "shard %d exit status %d", i, st);
  }
  /* the final checkpoint of shard 1 is valid for the inspector */
  char bin[512], cmd[2048];
  harness_bin("tools/ps-ckpt-inspect", bin, sizeof(bin));
  snprintf(cmd, sizeof(cmd), "%s %s/shard-0001-v*%d.ckpt > %s/inspect.txt", bin, ckdir, K,
           harness_dir());
  int rc = system(cmd);
  REQUIRE(rc == 0, "ps-ckpt-inspect on the final checkpoint: %d (%s)", rc, cmd);
  return 0;
}
