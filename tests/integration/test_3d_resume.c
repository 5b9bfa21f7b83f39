/* A 3D job resumes after a lost rank (issue 32, Deliver 7): four ps-worker
 * processes, t=2 p=2 d=1 in allreduce mode (1F1B, 4 micro-batches, SGD with
 * momentum 0.9), each rank writing its slice every EVERY steps into one
 * shared --checkpoint-dir; the same with t=1 p=2 d=2 (the slices' velocity
 * after the data-parallel mean).
 * - Uninterrupted: STEPS steps, rank 0 dumps the assembled model.
 * - Faulted: once every rank wrote a checkpoint of step >= 2 * EVERY, rank 3
 *   gets kill -9; the others stop with 129 naming it. All four start again
 *   with the same command: every rank logs "resumed from a checkpoint" at
 *   the same step, the newest one that every rank holds (>= 2 * EVERY), the
 *   job finishes, and its dump equals the uninterrupted one bit for bit
 *   (parameters, velocity, step and data position restored exactly).
 * - The same directory with another layout (t=1 p=2 d=2, same world size)
 *   is refused at start on every rank: exit 2, naming --checkpoint-dir,
 *   the file and both layouts; nothing loaded, nothing set aside.
 * - Rank 2's files removed (a lost volume): every rank starts at step 0
 *   with a warning naming rank 2 ("no checkpoint files"), and ends as the
 *   uninterrupted run. */
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
#define EVERY 20

static char dir[600];

/* The four ranks: layout t x p, dump to dump (may be NULL). */
static void start(struct ring_workers *rw, const char *t, const char *p, const char *dump) {
  char every[16];
  snprintf(every, sizeof(every), "%d", EVERY);
  const char *args[40] = {"--epochs",
                          "1",
                          "--max-steps",
                          STEPS,
                          "--seed",
                          "7",
                          "--batch-size",
                          "32",
                          "--model",
                          "mlp:784-64-10",
                          "--tensor-parallel",
                          t,
                          "--pipeline-stages",
                          p,
                          "--micro-batches",
                          "4",
                          "--log-every",
                          "20",
                          "--peer-timeout-ms",
                          "1500",
                          "--checkpoint-every",
                          every,
                          "--checkpoint-dir",
                          dir};
  int n = 24;
  if (dump) {
    args[n++] = "--dump-params";
    args[n++] = dump;
  }
  args[n] = NULL;
  ring_workers_start(rw, 4, args, NULL);
}

/* Uninterrupted, then killed and restarted, in layout t x p (d = 4 / (t *
 * p)), checkpoints into harness_dir()/ckpt-TAG; false if the run finished
 * before the kill (skipped). */
static bool resume(const char *t, const char *p) {
  char ref[600], got[600];
  snprintf(ref, sizeof(ref), "%s/uninterrupted-t%sp%s.bin", harness_dir(), t, p);
  snprintf(got, sizeof(got), "%s/resumed-t%sp%s.bin", harness_dir(), t, p);
  struct ring_workers rw;
  snprintf(dir, sizeof(dir), "%s/ref-ckpt-t%sp%s", harness_dir(), t, p);
  double t0 = clock_now_s();
  start(&rw, t, p, ref);
  REQUIRE(ring_workers_wait(&rw, 60000) == 0, "the uninterrupted run t=%s p=%s failed", t, p);
  printf("uninterrupted t=%s p=%s: %s steps in %.1f s\n", t, p, STEPS, clock_now_s() - t0);

  snprintf(dir, sizeof(dir), "%s/ckpt-t%sp%s", harness_dir(), t, p);
  start(&rw, t, p, got);
  char needle[64];
  snprintf(needle, sizeof(needle), "msg=\"checkpoint written\" step=%d ", 2 * EVERY);
  for (int r = 0; r < 4; r++)
    REQUIRE(harness_wait_grep(rw.log[r], needle, 1, 60000) == 1,
            "rank %d wrote no checkpoint of step %d within 60 s", r, 2 * EVERY);
  kill(rw.pid[3], SIGKILL);
  for (int r = 0; r < 3; r++) {
    int st = harness_wait(rw.pid[r], 20000);
    if (ring_exited(st, 0)) { /* it finished before the kill landed: no fault to test */
      harness_skip("rank %d finished before rank 3 was killed (machine too fast for %s steps)", r,
                   STEPS);
      return false;
    }
    REQUIRE(ring_exited(st, 129), "rank %d should exit 129 after rank 3's kill, got 0x%x", r, st);
    REQUIRE(harness_grep(rw.log[r], "lost rank 3") > 0, "rank %d does not name lost rank 3", r);
  }
  harness_wait(rw.pid[3], 5000);
  char wrote[4][600];
  for (int r = 0; r < 4; r++) snprintf(wrote[r], sizeof(wrote[r]), "%s", rw.log[r]);

  start(&rw, t, p, got);
  REQUIRE(ring_workers_wait(&rw, 60000) == 0, "the restarted job t=%s p=%s failed", t, p);
  long at = job3d_logged(rw.log[0], "resumed from a checkpoint", " step=");
  for (int r = 1; r < 4; r++)
    REQUIRE(job3d_logged(rw.log[r], "resumed from a checkpoint", " step=") == at,
            "rank %d resumed elsewhere than rank 0 (step %ld)", r, at);
  REQUIRE(at >= 2 * EVERY && at % EVERY == 0, "resumed at step %ld, want >= %d", at, 2 * EVERY);
  char held[64];
  snprintf(held, sizeof(held), "msg=\"checkpoint written\" step=%ld ", at);
  for (int r = 0; r < 4; r++)
    REQUIRE(harness_grep(wrote[r], held) == 1, "rank %d never wrote the step %ld resumed from", r,
            at);
  bool same;
  job3d_dump_diff(got, ref, &same);
  REQUIRE(same, "t=%s p=%s: the resumed job's parameters differ from the uninterrupted run's", t,
          p);
  printf(
      "t=%s p=%s, kill -9 rank 3, restart: all 4 ranks resumed at step %ld; final parameters "
      "equal the uninterrupted run's bit for bit\n",
      t, p, at);
  return true;
}

int main(void) {
  harness_require_dataset();
  if (!resume("1", "2") || !resume("2", "2")) return harness_status();
  struct ring_workers rw;
  /* another layout, same directory and world size: refused, nothing moved */
  start(&rw, "1", "2", NULL);
  for (int r = 0; r < 4; r++) {
    int st = harness_wait(rw.pid[r], 30000);
    REQUIRE(ring_exited(st, 2), "t=1 p=2 over t=2 p=2 checkpoints: rank %d exit 0x%x, want 2", r,
            st);
    REQUIRE(harness_grep(rw.log[r], "option --checkpoint-dir") > 0 &&
                harness_grep(rw.log[r], "written by layout t=2 p=2") > 0 &&
                harness_grep(rw.log[r], "this run is t=1 p=2") > 0,
            "rank %d's refusal does not name the option and both layouts", r);
    REQUIRE(harness_grep(rw.log[r], "set aside") == 0, "rank %d set files aside", r);
  }
  FILE *f = fopen(rw.log[1], "r");
  char line[1024];
  while (f && fgets(line, sizeof(line), f))
    if (strstr(line, "option --checkpoint-dir")) printf("refused: %s", line);
  if (f) fclose(f);

  /* rank 2 without its files (a lost volume): every rank starts at step 0,
   * warning which rank holds what, and sets its files aside */
  char cmd[800], ref[600], got[600];
  snprintf(cmd, sizeof(cmd), "rm -f %s/worker-0002-step-*.ckpt", dir);
  REQUIRE(system(cmd) == 0, "%s", cmd);
  snprintf(ref, sizeof(ref), "%s/uninterrupted-t2p2.bin", harness_dir());
  snprintf(got, sizeof(got), "%s/fresh-t2p2.bin", harness_dir());
  start(&rw, "2", "2", got);
  REQUIRE(ring_workers_wait(&rw, 60000) == 0, "the job without rank 2's files failed");
  for (int r = 0; r < 4; r++)
    REQUIRE(harness_grep(rw.log[r], "no step every rank holds") == 1 &&
                harness_grep(rw.log[r], "rank 2: no checkpoint files") == 1,
            "rank %d does not warn that rank 2 holds no checkpoint", r);
  bool same;
  job3d_dump_diff(got, ref, &same);
  REQUIRE(same, "started over, the job does not end as the uninterrupted one");
  printf(
      "rank 2's files removed: every rank started at step 0, warning \"rank 2: no checkpoint "
      "files\"; final parameters equal the uninterrupted run's\n");
  return harness_status();
}
