/* All-reduce mode resumes after a lost rank (issue 18): two ps-worker
 * processes in a ring, each with its own --checkpoint-dir (a pod's volume)
 * and --checkpoint-every 50, train 2 epochs of Fashion-MNIST. Once both
 * wrote a checkpoint of step >= 150, rank 1 gets kill -9: rank 0 stops with
 * 129 (lost rank, as designed), and both are started again with the same
 * command, as a StatefulSet restarts its pods. They agree on the newest step
 * both hold (both logs say "resumed from a checkpoint" at that step, which
 * is exactly the newer of the two ranks' newest complete checkpoints),
 * finish, and rank 0's test accuracy equals the fault-free run's to the bit
 * (the resumed state is exact: parameters, momentum, step, data position),
 * having redone at most --checkpoint-every steps (+1: the step a rank that
 * died while writing the next checkpoint had begun).
 * Also (issue 30), each against the fault-free accuracy where the ring
 * trains to the end:
 * - the fault-free run's --checkpoint-dir is nested (a/b under a fresh
 *   directory): ps-worker creates it and writes there;
 * - a corrupt newest checkpoint on one rank makes the ring fall back to the
 *   previous one that every rank holds, with a warning on every rank naming
 *   the rank, the file, the reason and the step resumed from;
 * - rank 0 one checkpoint behind (its newest file removed, as if it was lost
 *   before writing it) AND its newest remaining one corrupt: the ring falls
 *   back two checkpoints, to the one step both still hold (each rank keeps
 *   three), warning about both ranks;
 * - every file of rank 0 corrupt: a fresh start, as a warning saying why;
 * - --checkpoint-every in ps mode is refused. */
#include <dirent.h>
#include <signal.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "clock.h"
#include "harness.h"
#include "ring_workers.h"

#define EVERY 50

static char dirs[2][600];

/* Both ranks with their dirs, and more (NULL-terminated, may be NULL). */
static void start_more(struct ring_workers *rw, const char *out0, const char *const *more) {
  static const char *const common[] = {"--epochs",    "2",  "--batch-size",       "64",
                                       "--log-every", "10", "--checkpoint-every", "50"};
  static const char *args[2][24];
  for (int r = 0; r < 2; r++) {
    int n = 0;
    for (size_t i = 0; i < sizeof(common) / sizeof(common[0]); i++) args[r][n++] = common[i];
    args[r][n++] = "--checkpoint-dir";
    args[r][n++] = dirs[r];
    for (int i = 0; more && more[i] && n < 23; i++) args[r][n++] = more[i];
    args[r][n] = NULL;
  }
  const char *const *extra[2] = {args[0], args[1]};
  ring_workers_start_ranks(rw, 2, extra, out0);
}

static void start(struct ring_workers *rw, const char *out0) {
  start_more(rw, out0, NULL);
}

/* Lines of log at level=warn holding every one of the NULL-terminated needles. */
static int warned(const char *log, const char *const *needles) {
  FILE *f = fopen(log, "r");
  int n = 0;
  char line[4096];
  while (f && fgets(line, sizeof(line), f)) {
    bool all = strstr(line, "level=warn") != NULL;
    for (int i = 0; all && needles[i]; i++) all = strstr(line, needles[i]) != NULL;
    n += all;
  }
  if (f) fclose(f);
  return n;
}

/* Overwrites 4 bytes in the middle of rank's step file in dir[rank]. */
static void corrupt(int rank, long step) {
  char cmd[1400];
  snprintf(cmd, sizeof(cmd),
           "printf 'XXXX' | dd of=%s/worker-%04d-step-%016ld.ckpt bs=1 seek=100 "
           "conv=notrunc 2>/dev/null",
           dirs[rank], rank, step);
  REQUIRE(system(cmd) == 0, "corrupting rank %d's step-%ld checkpoint", rank, step);
}

/* The number after needle on the lines of log that hold it (and also
 * `also`, if given): the largest (newest) or the last one; -1 if none. */
static long log_number(const char *log, const char *needle, const char *also, bool largest) {
  FILE *f = fopen(log, "r");
  long v = -1;
  char line[2048];
  while (f && fgets(line, sizeof(line), f)) {
    const char *p = also ? strstr(line, also) : line;
    if (!p || !(p = strstr(p, needle))) continue;
    long x = atol(p + strlen(needle));
    if (!largest || x > v) v = x;
  }
  if (f) fclose(f);
  return v;
}
static long newest_written(const char *log) {
  return log_number(log, "msg=\"checkpoint written\" step=", NULL, true);
}
static long resumed_at(const char *log) {
  return log_number(log, "msg=\"resumed from a checkpoint\" step=", NULL, false);
}
/* The step a rank was at when it failed (its error line). */
static long failed_step(const char *log) {
  return log_number(log, " step=", "level=error", false);
}

/* The newest step of rank's checkpoint files in dir (-1: none): what it
 * holds, whether or not it lived to log it (a kill between the rename and
 * the log line leaves a whole checkpoint the log does not name). */
static long newest_on_disk(const char *dir, int rank) {
  DIR *d = opendir(dir);
  long best = -1;
  struct dirent *e;
  char prefix[32];
  snprintf(prefix, sizeof(prefix), "worker-%04d-step-", rank);
  while (d && (e = readdir(d))) {
    char tail[16];
    long s;
    if (strncmp(e->d_name, prefix, strlen(prefix)) == 0 &&
        sscanf(e->d_name + strlen(prefix), "%ld%15s", &s, tail) == 2 &&
        strcmp(tail, ".ckpt") == 0 && s > best)
      best = s;
  }
  if (d) closedir(d);
  return best;
}

static double accuracy(const char *out) {
  struct harness_summary sum;
  REQUIRE(harness_read_summary(out, &sum) == 0, "no summary line in %s", out);
  return sum.accuracy;
}

int main(void) {
  harness_require_dataset();
  char out[512], cmd[1400];
  /* fault-free */
  for (int r = 0; r < 2; r++)
    snprintf(dirs[r], sizeof(dirs[r]), "%s/clean-%d/a/b", harness_dir(), r);
  snprintf(out, sizeof(out), "%s/clean.out", harness_dir());
  struct ring_workers rw;
  start(&rw, out);
  REQUIRE(ring_workers_wait(&rw, 120000) == 0, "the fault-free ring failed");
  double clean = accuracy(out);
  for (int r = 0; r < 2; r++) {
    long last = newest_written(rw.log[r]);
    REQUIRE(last > 0 && newest_on_disk(dirs[r], r) == last,
            "rank %d: nested --checkpoint-dir %s: newest written %ld, on disk %ld", r, dirs[r],
            last, newest_on_disk(dirs[r], r));
    REQUIRE(harness_grep(rw.log[r], "created the checkpoint directory") == 1,
            "rank %d did not say it created %s", r, dirs[r]);
  }
  printf("nested: both ranks created their a/b --checkpoint-dir and wrote up to step %ld\n",
         newest_written(rw.log[0]));

  /* kill -9 of rank 1 mid-training, then both restarted */
  for (int r = 0; r < 2; r++) snprintf(dirs[r], sizeof(dirs[r]), "%s/fault-%d", harness_dir(), r);
  snprintf(out, sizeof(out), "%s/fault-1.out", harness_dir());
  start(&rw, out);
  double t0 = clock_now_s();
  while (newest_written(rw.log[0]) < 150 || newest_written(rw.log[1]) < 150) {
    REQUIRE(clock_now_s() - t0 < 60, "no checkpoint of step 150 within 60 s");
    clock_sleep_ms(5);
  }
  clock_sleep_ms(100); /* somewhere between two checkpoints */
  REQUIRE(kill(rw.pid[1], SIGKILL) == 0, "kill");
  int st = harness_wait(rw.pid[0], 30000);
  REQUIRE(st >= 0 && WIFEXITED(st) && WEXITSTATUS(st) == 129, "rank 0 after the kill: status %d",
          st);
  harness_wait(rw.pid[1], 5000);
  long a = newest_on_disk(dirs[0], 0), b = newest_on_disk(dirs[1], 1);
  long stopped = failed_step(rw.log[0]);
  long common = a < b ? a : b; /* a rank killed mid-write has the previous one whole */
  snprintf(out, sizeof(out), "%s/fault-2.out", harness_dir());
  start(&rw, out);
  REQUIRE(ring_workers_wait(&rw, 120000) == 0, "the restarted ring failed");
  long r0 = resumed_at(rw.log[0]), r1 = resumed_at(rw.log[1]);
  REQUIRE(r0 == r1 && r0 == common && r0 > 0,
          "resumed at steps %ld and %ld; the newest checkpoint both held is %ld", r0, r1, common);
  /* the steps redone: at most the checkpoint interval, and the one step a
   * rank that died while writing the next checkpoint had begun */
  REQUIRE(stopped >= r0 && stopped - r0 <= EVERY + 1,
          "rank 0 stopped at step %ld and the ring resumed at %ld: %ld steps redone (at most %d)",
          stopped, r0, stopped - r0, EVERY + 1);
  double faulted = accuracy(out);
  REQUIRE(faulted == clean, "accuracy %.4f after the kill and resume, %.4f without", faulted,
          clean);
  printf(
      "resume: rank 1 killed after checkpoints of step %ld/%ld, rank 0 stopped at step %ld, "
      "the ring resumed at %ld (%ld steps redone); accuracy %.4f, equal to the fault-free run\n",
      a, b, stopped, r0, stopped - r0, faulted);

  /* a corrupt newest checkpoint on rank 0: the ring agrees on the previous */
  long newest = newest_written(rw.log[0]);
  corrupt(0, newest);
  snprintf(out, sizeof(out), "%s/fault-3.out", harness_dir());
  start(&rw, out);
  REQUIRE(ring_workers_wait(&rw, 120000) == 0, "the ring with a corrupt checkpoint failed");
  r0 = resumed_at(rw.log[0]);
  REQUIRE(r0 == newest - EVERY && resumed_at(rw.log[1]) == r0,
          "with rank 0's step-%ld checkpoint corrupt the ring resumed at %ld (want %ld)", newest,
          r0, newest - EVERY);
  char file[64], file_step[40], resume_step[40];
  snprintf(file, sizeof(file), "worker-0000-step-%016ld.ckpt", newest);
  snprintf(file_step, sizeof(file_step), "file_step=%ld ", newest);
  snprintf(resume_step, sizeof(resume_step), "resume_step=%ld", r0);
  const char *const fell[] = {"rank=0 ", file, file_step, resume_step, "CRC32C mismatch", NULL};
  for (int r = 0; r < 2; r++)
    REQUIRE(warned(rw.log[r], fell) == 1,
            "rank %d's log has no warning naming rank 0, %s, its CRC and resume step %ld", r, file,
            r0);
  faulted = accuracy(out);
  REQUIRE(faulted == clean, "accuracy %.4f after falling back, %.4f without", faulted, clean);
  printf(
      "corrupt: rank 0's newest (step %ld) refused by its CRC; both resumed at %ld, warned on "
      "both ranks; accuracy %.4f\n",
      newest, r0, faulted);

  /* rank 0 one checkpoint behind (lost before writing its newest) and its
   * newest remaining one corrupt: back to the one before, which both hold */
  newest = newest_on_disk(dirs[0], 0);
  REQUIRE(newest_on_disk(dirs[1], 1) == newest, "the ranks' newest differ after fault-3");
  snprintf(cmd, sizeof(cmd), "%s/worker-0000-step-%016ld.ckpt", dirs[0], newest);
  REQUIRE(unlink(cmd) == 0, "removing %s", cmd);
  corrupt(0, newest - EVERY);
  snprintf(out, sizeof(out), "%s/fault-4.out", harness_dir());
  start(&rw, out);
  REQUIRE(ring_workers_wait(&rw, 120000) == 0, "the ring with rank 0 behind and corrupt failed");
  r0 = resumed_at(rw.log[0]);
  REQUIRE(r0 == newest - 2 * EVERY && resumed_at(rw.log[1]) == r0,
          "rank 0 behind (newest %ld gone) with step %ld corrupt: the ring resumed at %ld and %ld "
          "(want %ld)",
          newest, newest - EVERY, r0, resumed_at(rw.log[1]), newest - 2 * EVERY);
  snprintf(file, sizeof(file), "worker-0000-step-%016ld.ckpt", newest - EVERY);
  snprintf(file_step, sizeof(file_step), "file_step=%ld ", newest - EVERY);
  snprintf(resume_step, sizeof(resume_step), "resume_step=%ld", r0);
  char newest_step[40];
  snprintf(newest_step, sizeof(newest_step), "newest_step=%ld ", newest);
  const char *const fell0[] = {"rank=0 ", file, file_step, resume_step, "CRC32C mismatch", NULL};
  const char *const fell1[] = {"rank=1 ", newest_step, resume_step, NULL};
  for (int r = 0; r < 2; r++)
    REQUIRE(warned(rw.log[r], fell0) == 1 && warned(rw.log[r], fell1) == 1,
            "rank %d's log does not warn about rank 0's %s and rank 1's newer step %ld", r, file,
            newest);
  /* the newer files, of the timeline abandoned, are set aside: rank 0's
   * corrupt one, rank 1's two */
  REQUIRE(harness_grep(rw.log[0], "set aside a checkpoint newer") == 1 &&
              harness_grep(rw.log[1], "set aside a checkpoint newer") == 2,
          "rank 0 set aside %d files (want 1), rank 1 %d (want 2)",
          harness_grep(rw.log[0], "set aside a checkpoint newer"),
          harness_grep(rw.log[1], "set aside a checkpoint newer"));
  faulted = accuracy(out);
  REQUIRE(faulted == clean, "accuracy %.4f after falling back two, %.4f without", faulted, clean);
  printf(
      "behind+corrupt: rank 0 without step %ld and its step %ld corrupt; both resumed at %ld, "
      "warned on both ranks; accuracy %.4f\n",
      newest, newest - EVERY, r0, faulted);

  /* every file of rank 0 corrupt: a fresh start, but not a silent one */
  DIR *d = opendir(dirs[0]);
  struct dirent *e;
  int bad = 0;
  while (d && (e = readdir(d))) {
    long s;
    char tail[16];
    if (sscanf(e->d_name, "worker-0000-step-%ld%15s", &s, tail) == 2 && !strcmp(tail, ".ckpt"))
      corrupt(0, s), bad++;
  }
  if (d) closedir(d);
  REQUIRE(bad >= 2, "rank 0 holds %d checkpoint files", bad);
  snprintf(out, sizeof(out), "%s/fault-5.out", harness_dir());
  static const char *const short_run[] = {"--max-steps", "20", NULL};
  start_more(&rw, out, short_run);
  REQUIRE(ring_workers_wait(&rw, 120000) == 0, "the ring with no common checkpoint failed");
  const char *const fresh[] = {"starting at step 0", "rank 0: ", "none loads", NULL};
  REQUIRE(resumed_at(rw.log[0]) < 0 && resumed_at(rw.log[1]) < 0, "resumed with no common step");
  for (int r = 0; r < 2; r++)
    REQUIRE(warned(rw.log[r], fresh) == 1,
            "rank %d's log has no warning that the ring starts at step 0 and why", r);
  printf("fresh: all %d of rank 0's files corrupt: step 0, warned on both ranks\n", bad);

  /* ps mode has no worker checkpoints */
  char bin[512];
  harness_bin("ps-worker/ps-worker", bin, sizeof(bin));
  snprintf(cmd, sizeof(cmd), "%s --servers 127.0.0.1:1 --checkpoint-every 5 2>%s/ps.err", bin,
           harness_dir());
  st = system(cmd);
  REQUIRE(WIFEXITED(st) && WEXITSTATUS(st) == 2, "ps mode with --checkpoint-every: status %d", st);
  return 0;
}
