/* A worker's checkpoint directory that cannot be used, and writes that fail
 * (issue 30): one ps-worker in --sync-mode allreduce (a ring of 1) trains
 * Fashion-MNIST for 40 steps with --checkpoint-every 5.
 * - --checkpoint-dir under a regular file (FILE/sub: root cannot create it
 *   either, unlike a chmod 0500 directory) is refused at start: exit 2,
 *   naming the option, the path and the errno, no checkpoint attempted;
 * - the writes of steps 5, 10 and 15 fail (a directory sits where each
 *   one's .tmp goes: open fails with EISDIR, as root too): with the default
 *   --checkpoint-max-failures 3 the third failure in a row stops the worker
 *   with exit 1 and an error saying so, no fourth write tried;
 * - steps 5, 10, 20 and 25 fail: never three in a row (15 succeeds), so it
 *   trains to the end and writes step 40;
 * - steps 5 to 20 fail with --checkpoint-max-failures 0: it keeps training,
 *   logs each failure, and writes steps 25 to 40. */
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "harness.h"
#include "ring_workers.h"

static int seq;

/* A run in a fresh dir whose writes of the given steps (0-terminated) fail;
 * *status is the worker's wait status, log its log. */
static void run(const int *fail_steps, const char *max_failures, char *dir, size_t dirlen,
                int *status, char *log, size_t loglen) {
  snprintf(dir, dirlen, "%s/run-%d", harness_dir(), ++seq);
  REQUIRE(mkdir(dir, 0755) == 0, "mkdir %s", dir);
  for (int i = 0; fail_steps[i]; i++) {
    char p[700];
    snprintf(p, sizeof(p), "%s/worker-0000-step-%016d.ckpt.tmp", dir, fail_steps[i]);
    REQUIRE(mkdir(p, 0755) == 0, "mkdir %s", p);
  }
  const char *args[] = {"--max-steps",
                        "40",
                        "--checkpoint-every",
                        "5",
                        "--checkpoint-dir",
                        dir,
                        "--checkpoint-max-failures",
                        max_failures,
                        NULL};
  if (!max_failures) args[6] = NULL;
  struct ring_workers rw;
  ring_workers_start(&rw, 1, args, NULL);
  *status = harness_wait(rw.pid[0], 60000);
  snprintf(log, loglen, "%s", rw.log[0]);
}

static long newest_on_disk(const char *dir) {
  long best = -1;
  for (long s = 5; s <= 40; s += 5) {
    char p[700];
    snprintf(p, sizeof(p), "%s/worker-0000-step-%016ld.ckpt", dir, s);
    if (access(p, F_OK) == 0) best = s;
  }
  return best;
}

int main(void) {
  harness_require_dataset();
  char dir[600], log[512], path[700];

  /* a --checkpoint-dir that cannot be created */
  snprintf(path, sizeof(path), "%s/afile", harness_dir());
  FILE *f = fopen(path, "w");
  REQUIRE(f && fclose(f) == 0, "creating %s", path);
  snprintf(dir, sizeof(dir), "%s/afile/sub", harness_dir());
  const char *args[] = {"--max-steps", "40", "--checkpoint-every", "5", "--checkpoint-dir",
                        dir,           NULL};
  struct ring_workers rw;
  ring_workers_start(&rw, 1, args, NULL);
  int st = harness_wait(rw.pid[0], 60000);
  REQUIRE(ring_exited(st, 2), "--checkpoint-dir %s: status %d, want exit 2", dir, st);
  char want[800];
  snprintf(want, sizeof(want), "option --checkpoint-dir: cannot create directory %s: ", dir);
  REQUIRE(harness_grep(rw.log[0], want) == 1 && harness_grep(rw.log[0], "(errno 20)") == 1,
          "the refusal does not name the option, %s and ENOTDIR", dir);
  REQUIRE(harness_grep(rw.log[0], "cannot write a checkpoint") == 0, "a checkpoint was attempted");
  printf("unusable: --checkpoint-dir FILE/sub refused at start, exit 2, ENOTDIR named\n");

  /* three failures in a row stop the worker */
  static const int three[] = {5, 10, 15, 0};
  run(three, NULL, dir, sizeof(dir), &st, log, sizeof(log));
  REQUIRE(ring_exited(st, 1), "3 writes failing in a row: status %d, want exit 1", st);
  int failed = harness_grep(log, "cannot write a checkpoint");
  REQUIRE(failed == 3 && harness_grep(log, "Is a directory (errno 21") >= 3,
          "3 writes failing in a row: %d failure lines naming EISDIR, want 3", failed);
  REQUIRE(harness_grep(log, "checkpoint writes failed 3 times in a row") == 1,
          "no error saying the failures stopped the worker");
  REQUIRE(harness_grep(log, "step=15 failures_in_a_row=3") == 1, "it did not stop at step 15");
  REQUIRE(newest_on_disk(dir) < 0, "a checkpoint counted though its write failed");
  printf("in a row: writes of steps 5, 10, 15 failed: stopped at step 15, exit 1\n");

  /* not in a row: goes on */
  static const int apart[] = {5, 10, 20, 25, 0};
  run(apart, NULL, dir, sizeof(dir), &st, log, sizeof(log));
  REQUIRE(ring_exited(st, 0), "writes of steps 5, 10, 20, 25 failing: status %d, want 0", st);
  failed = harness_grep(log, "cannot write a checkpoint");
  REQUIRE(failed == 4 && newest_on_disk(dir) == 40,
          "failures apart: %d failures logged (want 4), newest checkpoint %ld (want 40)", failed,
          newest_on_disk(dir));
  printf("apart: writes of steps 5, 10, 20, 25 failed, never 3 in a row: trained on, wrote 40\n");

  /* --checkpoint-max-failures 0: goes on whatever fails */
  static const int four[] = {5, 10, 15, 20, 0};
  run(four, "0", dir, sizeof(dir), &st, log, sizeof(log));
  REQUIRE(ring_exited(st, 0), "--checkpoint-max-failures 0: status %d, want 0", st);
  failed = harness_grep(log, "cannot write a checkpoint");
  REQUIRE(failed == 4 && newest_on_disk(dir) == 40,
          "--checkpoint-max-failures 0: %d failures logged (want 4), newest checkpoint %ld", failed,
          newest_on_disk(dir));
  printf("max 0: writes of steps 5 to 20 failed: trained on, wrote 25 to 40\n");
  return 0;
}
