/* A 3D job in ps mode resumes at the shards' step (issue 32, Deliver 7):
 * two shards (SGD) and four ps-worker processes, t=2 p=2 d=1, every
 * (stage, slice) its own keys with owners.
 * - Uninterrupted: STEPS steps against fresh shards; rank 0 dumps the
 *   assembled model.
 * - Faulted, against other fresh shards: once rank 0 logged step >= 40,
 *   rank 3 gets kill -9; the others stop with 129 naming it. The shards
 *   live on. All four start again with the same command: no rank
 *   initialises the keys again, every rank logs "resumed at the shards'
 *   step" at the same step S > 0 (the shards' version: the step counter
 *   and the data position go on from there, nothing replayed), the job
 *   finishes and its dump equals the uninterrupted one bit for bit.
 *   Unless the step was pushed in part (rank 3 died amid its pushes, or
 *   tensor rank 0 of both stages finished the step without it): then every rank warns that the step
 * was pushed in part, the job redoes it pushing only what the shards still wait for (a push of a
 * step the shards hold from the earlier process would stop the job as lost state) and finishes; its
 * parameters are not the uninterrupted run's (that step's gradients saw slices one step newer; 360
 * steps later the largest difference was 2.6% of the largest parameter in the run seen here),
 * checked within 10%. Seen in 2 runs of 20 here. */
#include <signal.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "clock.h"
#include "harness.h"
#include "job3d.h"
#include "ring_workers.h"

#define STEPS "400"

static void shards(struct test_server *s, char *servers, size_t len) {
  const char *sargs[] = {"--optimizer", "sgd", NULL};
  for (int i = 0; i < 2; i++) harness_start_server(&s[i], i, 2, 4, 0.1, sargs);
  snprintf(servers, len, "%s,%s", s[0].addr, s[1].addr);
}

int main(void) {
  harness_require_dataset();
  char ref[600], got[600], servers[160];
  snprintf(ref, sizeof(ref), "%s/uninterrupted.bin", harness_dir());
  snprintf(got, sizeof(got), "%s/resumed.bin", harness_dir());
  struct test_server s[2];
  struct ring_workers rw;
  double t0 = clock_now_s();
  shards(s, servers, sizeof(servers));
  job3d_start_ps(&rw, servers, STEPS, ref);
  REQUIRE(ring_workers_wait(&rw, 60000) == 0, "the uninterrupted run failed");
  for (int i = 0; i < 2; i++) harness_stop(s[i].pid, SIGTERM, 10000);
  printf("uninterrupted ps t=2 p=2: %s steps in %.1f s\n", STEPS, clock_now_s() - t0);

  shards(s, servers, sizeof(servers));
  job3d_start_ps(&rw, servers, STEPS, got);
  REQUIRE(harness_wait_grep(rw.log[0], "step=40/", 1, 60000) == 1,
          "rank 0 did not reach step 40 within 60 s");
  kill(rw.pid[3], SIGKILL);
  for (int r = 0; r < 3; r++) {
    int st = harness_wait(rw.pid[r], 20000);
    if (ring_exited(st, 0)) {
      harness_skip("rank %d finished before rank 3 was killed", r);
      return harness_status();
    }
    REQUIRE(ring_exited(st, 129), "rank %d should exit 129 after rank 3's kill, got 0x%x", r, st);
  }
  harness_wait(rw.pid[3], 5000);
  for (int i = 0; i < 2; i++)
    REQUIRE(kill(s[i].pid, 0) == 0, "shard %d did not outlive the workers", i);

  job3d_start_ps(&rw, servers, STEPS, got);
  REQUIRE(ring_workers_wait(&rw, 60000) == 0, "the restarted job failed");
  long at = job3d_resumed_step(&rw);
  REQUIRE(at >= 40, "resumed at step %ld, want >= 40 (the shards' step)", at);
  REQUIRE(harness_grep(rw.log[0], " step=10/") == 0, "the restarted job trained step 10 again");
  for (int r = 0; r < 4; r++)
    REQUIRE(harness_grep(rw.log[r], "model slices declared") == 1, "rank %d declared no slices", r);
  int torn = harness_grep(rw.log[0], "pushed in part");
  bool same;
  double diff = job3d_dump_diff(got, ref, &same);
  printf(
      "kill -9 rank 3, restart against live shards: all 4 ranks resumed at step %ld%s; final "
      "parameters %s the uninterrupted run's (largest difference %.3g of the largest "
      "parameter)\n",
      at, torn ? " (a step pushed in part, redone, warned)" : "",
      same ? "bit-identical to" : "differ from", diff);
  FILE *f = torn ? fopen(rw.log[0], "r") : NULL;
  char line[4096];
  while (f && fgets(line, sizeof(line), f))
    if (strstr(line, "pushed in part")) printf("warned: %s", strstr(line, "step="));
  if (f) fclose(f);
  REQUIRE(torn || same, "resumed cleanly, yet the parameters differ from the uninterrupted run's");
  REQUIRE(diff < 0.1, "the redone step moved the parameters by %.3g", diff);
  for (int i = 0; i < 2; i++) harness_stop(s[i].pid, SIGTERM, 10000);
  return harness_status();
}
