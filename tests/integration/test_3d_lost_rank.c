/* A lost rank of a running 3D job (t=2 p=2, allreduce mode) stops every
 * other rank with the retryable exit 129, naming the lost job rank, in
 * bounded time (never a hang): its pipeline and tensor partners fail on
 * their group first, the others through the job's watchdog. Killed: rank 3
 * (the last stage's second tensor rank) and rank 0 (the hub of the control
 * connections, first stage); and rank 3 in ps mode, where the others may be
 * waiting on the shards for its push rather than on a group; and rank 3 of
 * t=2 p=1 d=2 with ZeRO-1 (--shard-optimizer-state), where its data-parallel
 * partner waits in the reduce-scatter or the all-gather. */
#include <signal.h>
#include <stdbool.h>
#include <stdio.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "clock.h"
#include "harness.h"
#include "ring_workers.h"

static void lost_rank(bool ps, int victim, bool zero) {
  const char *args[40] = {
      "--epochs",          "50",   "--batch-size",      "32", "--model",         "mlp:784-64-10",
      "--tensor-parallel", "2",    "--pipeline-stages", "2",  "--micro-batches", "4",
      "--peer-timeout-ms", "1500", "--log-every",       "20"};
  int n = 16;
  if (zero) { /* t=2 p=1 d=2 */
    args[9] = "1";
    args[n++] = "--shard-optimizer-state";
    args[n++] = "true";
  }
  struct test_server s[2];
  char servers[160];
  if (ps) { /* the shards' own wait for a lost worker (60 s) must not be what ends it */
    const char *sargs[] = {"--optimizer", "sgd", NULL};
    for (int i = 0; i < 2; i++) harness_start_server(&s[i], i, 2, 4, 0.1, sargs);
    snprintf(servers, sizeof(servers), "%s,%s", s[0].addr, s[1].addr);
    const char *more[] = {"--sync-mode", "ps", "--servers", servers};
    for (int i = 0; i < 4; i++) args[n++] = more[i];
  }
  args[n] = NULL;
  const char *mode = ps ? "ps" : zero ? "allreduce zero-1" : "allreduce";
  struct ring_workers rw;
  ring_workers_start(&rw, 4, args, NULL);
  double t0 = clock_now_s();
  for (;;) {
    int ready = 1;
    for (int r = 0; r < 4; r++) ready = ready && harness_grep(rw.log[r], "msg=\"training 3d\"") > 0;
    ready = ready && harness_grep(rw.log[0], "msg=\"progress\"") > 0;
    if (ready) break;
    for (int r = 0; r < 4; r++) {
      int st;
      REQUIRE(waitpid(rw.pid[r], &st, WNOHANG) == 0, "rank %d exited before the fault", r);
    }
    REQUIRE(clock_now_s() - t0 < 60, "training did not start within 60 s");
    clock_sleep_ms(20);
  }
  kill(rw.pid[victim], SIGKILL);
  double t_fault = clock_now_s();
  char needle[32];
  snprintf(needle, sizeof(needle), "lost rank %d", victim);
  for (int r = 0; r < 4; r++) {
    if (r == victim) continue;
    int st = harness_wait(rw.pid[r], 20000);
    double took = clock_now_s() - t_fault;
    REQUIRE(st >= 0, "rank %d still running %.1f s after rank %d was killed", r, took, victim);
    REQUIRE(ring_exited(st, 129), "rank %d should exit 129, got status 0x%x", r, st);
    REQUIRE(harness_grep(rw.log[r], needle) > 0, "rank %d's log does not say \"%s\"", r, needle);
    printf("%s t=2 p=%s: rank %d exited 129 %.2f s after rank %d was killed, naming it\n", mode,
           args[9], r, took, victim);
  }
  harness_wait(rw.pid[victim], 5000);
  if (ps)
    for (int i = 0; i < 2; i++) harness_stop(s[i].pid, SIGKILL, 10000);
}

int main(void) {
  harness_require_dataset();
  lost_rank(false, 3, false);
  lost_rank(false, 0, false);
  lost_rank(true, 3, false);
  lost_rank(false, 3, true);
  return 0;
}
