/* ps-local end to end: usage errors, a failing run that must leave no
 * process behind, a run stopped by SIGTERM, and a tiny real training run.
 *
 * Every run of ps-local gets a private TMPDIR, and this process is a child
 * subreaper, so the test sees that nothing was left running or behind
 * (launcher.h). */
#include <signal.h>
#include <stdio.h>
#include <string.h>
#include <sys/prctl.h>
#include <unistd.h>

#include "clock.h"
#include "harness.h"
#include "launcher.h"

static char *last_line(const char *path, char *buf, size_t len) {
  FILE *f = fopen(path, "r");
  buf[0] = '\0';
  if (!f) return buf;
  char line[1024];
  while (fgets(line, sizeof(line), f)) {
    line[strcspn(line, "\n")] = '\0';
    if (line[0]) snprintf(buf, len, "%s", line);
  }
  fclose(f);
  return buf;
}

int main(void) {
  const char *d = harness_dir();
  struct launcher_run r;
  int st;
  REQUIRE(prctl(PR_SET_CHILD_SUBREAPER, 1) == 0, "PR_SET_CHILD_SUBREAPER");

  /* 1. --help */
  st = launcher_run(&r, "help", (const char *[]){"--help", NULL}, 10);
  REQUIRE(launcher_exit_code(st) == 0, "--help exited %d", launcher_exit_code(st));
  REQUIRE(harness_grep(r.out, "--shards") >= 1, "--help does not mention --shards");
  REQUIRE(harness_grep(r.out, "PS_WORKERS") >= 1, "--help does not name the env variables");

  /* 2. bad usage names the option */
  st = launcher_run(&r, "workers0", (const char *[]){"--workers", "0", NULL}, 10);
  REQUIRE(launcher_exit_code(st) == 2, "--workers 0 exited %d, want 2", launcher_exit_code(st));
  REQUIRE(harness_grep(r.err, "--workers") >= 1, "the message does not name --workers");

  /* 3. the ring mode runs SGD on the workers: a shard-only optimizer is refused clearly */
  st = launcher_run(&r, "allreduce-adam",
                    (const char *[]){"--sync-mode", "allreduce", "--optimizer", "adam", NULL}, 10);
  REQUIRE(launcher_exit_code(st) == 2, "--sync-mode allreduce --optimizer adam exited %d, want 2",
          launcher_exit_code(st));
  REQUIRE(harness_grep(r.err, "allreduce") >= 1, "the message does not name the mode");

  /* 4a. bad data with the cosine schedule: refused before anything starts */
  char logs[512], data[512];
  snprintf(data, sizeof(data), "%s/nonexistent", d);
  st = launcher_run(&r, "baddata-early", (const char *[]){"--data", data, "--epochs", "1", NULL},
                    30);
  REQUIRE(launcher_exit_code(st) == 1, "--data %s exited %d, want 1", data, launcher_exit_code(st));
  REQUIRE(harness_grep(r.err, data) >= 1, "no message names %s", data);

  /* 4b. bad data, constant schedule: the workers fail, everything is stopped,
   * the path is reported */
  snprintf(logs, sizeof(logs), "%s/logs-baddata", d);
  st = launcher_run(&r, "baddata",
                    (const char *[]){"--data", data, "--keep-logs", logs, "--epochs", "1",
                                     "--lr-schedule", "constant", NULL},
                    30);
  if (launcher_exit_code(st) == 0 || harness_grep(r.err, data) < 1) launcher_show(r.err);
  REQUIRE(launcher_exit_code(st) != 0, "--data %s exited 0", data);
  REQUIRE(harness_grep(r.err, data) >= 1, "no message names %s", data);
  REQUIRE(launcher_leftovers(logs) == 0, "processes left running after a failed run");
  char p[600];
  snprintf(p, sizeof(p), "%s/shard-0.log", logs);
  REQUIRE(access(p, F_OK) == 0, "--keep-logs: no %s", p);
  snprintf(p, sizeof(p), "%s/shard-0.port", logs);
  REQUIRE(access(p, F_OK) != 0, "--keep-logs: %s was left behind", p);
  REQUIRE(launcher_dir_entries(r.tmpdir) == 0, "with --keep-logs, ps-local still wrote to TMPDIR");

  if (!harness_have_dataset()) {
    harness_skip("no Fashion-MNIST under %s: the training runs", HARNESS_DATA_DIR);
    return harness_status();
  }

  /* 5. SIGTERM in the middle of training: exit 143, nothing left, temp dir gone */
  pid_t pid = launcher_start(&r, "sigterm", (const char *[]){"--epochs", "50", NULL});
  /* Wait until all four children run, then give the workers a moment. */
  int waited = 0;
  for (; waited < 20000 && launcher_count_children(pid) < 4; waited += 20) clock_sleep_ms(20);
  if (waited >= 20000) launcher_show(r.err);
  REQUIRE(waited < 20000, "ps-local did not start 2 shards and 2 workers within 20 s");
  clock_sleep_ms(300);
  st = harness_stop(pid, SIGTERM, 15000);
  if (st < 0 || launcher_exit_code(st) != 143) launcher_show(r.err);
  REQUIRE(st >= 0, "ps-local did not stop within 15 s of SIGTERM");
  REQUIRE(launcher_exit_code(st) == 143, "SIGTERM: exit %d, want 143", launcher_exit_code(st));
  REQUIRE(launcher_leftovers(r.tmpdir) == 0, "processes left running after SIGTERM");
  REQUIRE(launcher_dir_entries(r.tmpdir) == 0,
          "ps-local did not remove its temp dir after SIGTERM");

  /* 6. a tiny real run */
  st = launcher_run(&r, "train",
                    (const char *[]){"--epochs", "1", "--max-steps", "30", "--shards", "2",
                                     "--workers", "2", NULL},
                    60);
  if (launcher_exit_code(st) != 0) launcher_show(r.err);
  REQUIRE(launcher_exit_code(st) == 0, "training run exited %d", launcher_exit_code(st));
  char line[1024];
  last_line(r.out, line, sizeof(line));
  struct harness_summary sum;
  REQUIRE(harness_parse_summary(line, &sum) == 0, "last stdout line is not a summary: \"%s\"",
          line);
  REQUIRE(sum.accuracy >= 0 && sum.accuracy <= 1, "accuracy %g is not in [0, 1]", sum.accuracy);
  REQUIRE(sum.epochs == 1, "epochs=%d, want 1", sum.epochs);
  REQUIRE(sum.wall_s > 0 && sum.samples_per_s > 0, "wall_s=%g samples_per_s=%g", sum.wall_s,
          sum.samples_per_s);
  REQUIRE(launcher_leftovers(r.tmpdir) == 0, "processes left running after training");
  REQUIRE(launcher_dir_entries(r.tmpdir) == 0, "ps-local did not remove its temp dir");

  /* 7. the same with --sync-mode allreduce: no shards, a ring of 2 workers */
  st = launcher_run(&r, "train-allreduce",
                    (const char *[]){"--sync-mode", "allreduce", "--epochs", "1", "--max-steps",
                                     "30", "--workers", "2", NULL},
                    60);
  if (launcher_exit_code(st) != 0) launcher_show(r.err);
  REQUIRE(launcher_exit_code(st) == 0, "allreduce training run exited %d", launcher_exit_code(st));
  REQUIRE(harness_grep(r.err, "0 shard(s) + 2 worker(s)") == 1 &&
              harness_grep(r.err, "sync allreduce") == 1,
          "the banner should say 0 shards, sync allreduce");
  REQUIRE(harness_grep(r.err, "sync_mode=allreduce") >= 1,
          "rank 0 did not train in allreduce mode");
  char line2[1024];
  last_line(r.out, line2, sizeof(line2));
  REQUIRE(harness_parse_summary(line2, &sum) == 0,
          "allreduce: last stdout line is not a summary: \"%s\"", line2);
  REQUIRE(launcher_leftovers(r.tmpdir) == 0, "processes left running after allreduce training");
  REQUIRE(launcher_dir_entries(r.tmpdir) == 0, "ps-local did not remove its temp dir (allreduce)");
  printf(
      "ps-local: usage errors exit 2; bad data fails cleanly; SIGTERM exits 143; %s; "
      "allreduce: %s\n",
      line, line2);
  return 0;
}
