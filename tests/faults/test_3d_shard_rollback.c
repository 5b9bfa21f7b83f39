/* A shard of a 3D job in ps mode killed (kill -9) and restarted from its
 * checkpoint while the workers run (issue 32, Deliver 7; issue 30's
 * all-or-nothing rollback): two shards (SGD, --checkpoint-every 10) and
 * four ps-worker processes, t=2 p=2 d=1, every (stage, slice) its own keys
 * with owners.
 * - Uninterrupted: STEPS steps against fresh shards; rank 0 dumps the model.
 * - Faulted: once shard 0 wrote a checkpoint of clock >= 20, it gets kill -9
 *   and is started again on its address from its checkpoint directory. The
 *   restarted shard is behind the job: a worker's request fails with
 *   PS_ERR_ROLLBACK. A pipeline cannot be rolled back in place (its stages
 *   are mid-step, on other steps' activations), so the worker takes every
 *   shard back to the checkpoint's clock (ps_rollback: all or nothing), says
 *   so and exits 129; the others exit 129 too (the rollback, or the lost
 *   rank). All four start again with the same command, resume at that
 *   clock (the shards' step) and finish; the dump equals the uninterrupted
 *   run's bit for bit. */
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

static void shard(struct test_server *s, int i, const char *dir, const char *listen) {
  const char *sargs[] = {"--optimizer",
                         "sgd",
                         "--checkpoint-dir",
                         dir,
                         "--checkpoint-every",
                         "10",
                         listen ? "--listen" : NULL,
                         listen,
                         NULL};
  harness_start_server(s, i, 2, 4, 0.1, sargs);
}

int main(void) {
  harness_require_dataset();
  char ref[600], got[600], servers[160], dir[2][600];
  snprintf(ref, sizeof(ref), "%s/uninterrupted.bin", harness_dir());
  snprintf(got, sizeof(got), "%s/resumed.bin", harness_dir());
  struct test_server s[2];
  struct ring_workers rw;
  for (int i = 0; i < 2; i++) {
    snprintf(dir[i], sizeof(dir[i]), "%s/ref-shard-%d", harness_dir(), i);
    shard(&s[i], i, dir[i], NULL);
  }
  snprintf(servers, sizeof(servers), "%s,%s", s[0].addr, s[1].addr);
  job3d_start_ps(&rw, servers, STEPS, ref);
  REQUIRE(ring_workers_wait(&rw, 60000) == 0, "the uninterrupted run failed");
  for (int i = 0; i < 2; i++) harness_stop(s[i].pid, SIGTERM, 10000);

  /* a kill that lands exactly at a checkpoint's clock needs no rollback
   * (the job goes on, ends 0): then again, with fresh shards */
  long ck = -1;
  for (int attempt = 1;; attempt++) {
    for (int i = 0; i < 2; i++) {
      snprintf(dir[i], sizeof(dir[i]), "%s/shard-%d-%d", harness_dir(), i, attempt);
      shard(&s[i], i, dir[i], NULL);
    }
    snprintf(servers, sizeof(servers), "%s,%s", s[0].addr, s[1].addr);
    job3d_start_ps(&rw, servers, STEPS, got);
    double t0 = clock_now_s();
    while (job3d_logged(s[0].log, "msg=\"checkpoint written\"", " clock=") < 20) {
      REQUIRE(clock_now_s() - t0 < 60, "shard 0 wrote no checkpoint of clock >= 20 within 60 s");
      clock_sleep_ms(5);
    }
    ck = job3d_logged(s[0].log, "msg=\"checkpoint written\"", " clock=");
    char addr[64];
    snprintf(addr, sizeof(addr), "%s", s[0].addr);
    harness_stop(s[0].pid, SIGKILL, 5000);
    shard(&s[0], 0, dir[0], addr);
    REQUIRE(harness_grep(s[0].log, "checkpoint loaded") == 1, "the restarted shard loaded nothing");
    int done = 0;
    for (int r = 0; r < 4; r++) {
      int st = harness_wait(rw.pid[r], 30000);
      done += ring_exited(st, 0);
      REQUIRE(ring_exited(st, 0) || ring_exited(st, 129),
              "rank %d should exit 129 after the shard's rollback, got 0x%x", r, st);
    }
    if (done == 0) break;
    REQUIRE(done == 4 && attempt < 3, "%d ranks finished, %d stopped: the rollback was not for all",
            done, 4 - done);
    printf(
        "attempt %d: shard 0 killed at its checkpoint's clock %ld, nothing to roll back; again\n",
        attempt, ck);
    for (int i = 0; i < 2; i++) harness_stop(s[i].pid, SIGKILL, 10000);
  }
  int said = 0;
  for (int r = 0; r < 4; r++) said += harness_grep(rw.log[r], "rolled the shards back") > 0;
  REQUIRE(said > 0, "no rank says it rolled the shards back");

  job3d_start_ps(&rw, servers, STEPS, got);
  REQUIRE(ring_workers_wait(&rw, 60000) == 0, "the restarted job failed");
  long at = job3d_resumed_step(&rw);
  bool same;
  job3d_dump_diff(got, ref, &same);
  printf(
      "kill -9 shard 0 after its checkpoint of clock %ld, restart it: %d ranks rolled the "
      "shards back and exited 129; restarted, all 4 resumed at step %ld; final parameters %s "
      "the uninterrupted run's\n",
      ck, said, at, same ? "equal" : "DIFFER from");
  REQUIRE(same, "the parameters differ from the uninterrupted run's");
  for (int i = 0; i < 2; i++) harness_stop(s[i].pid, SIGTERM, 10000);
  return harness_status();
}
