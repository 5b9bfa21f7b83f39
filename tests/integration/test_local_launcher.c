/* ps-local end to end: usage errors, a failing run that must leave no
 * process behind, a run stopped by SIGTERM, and a tiny real training run.
 * Before the training runs, stand-ins for ps-server and ps-worker (/bin/sh
 * scripts, --bin-dir) check what ps-local makes of rank 0's summary line
 * (workers_lost= is passed on when present, left out when absent) and the
 * case of the bug: rank 1 stopped (SIGSTOP) while rank 0 finished and the
 * shards exited; ps-local must name and kill it and exit 129, no summary.
 *
 * Every run of ps-local gets a private TMPDIR, and this process is a child
 * subreaper, so the test sees that nothing was left running or behind
 * (launcher.h). */
#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/stat.h>
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

/* ps-server's stand-in: writes its port file, then exits 0 once rank 0
 * ended the training ($OUTDIR/stop-shards). */
static const char standin_server[] =
    "#!/bin/sh\n"
    "while [ $# -gt 0 ]; do [ \"$1\" = --port-file ] && f=$2; shift; done\n"
    "echo 127.0.0.1:9 > $f.tmp && mv $f.tmp $f\n"
    "i=0; while [ ! -e $OUTDIR/stop-shards ]; do sleep 0.02; i=$((i+1)); [ $i -lt 1500 ] || exit "
    "9; "
    "done\n";

/* ps-worker's stand-in: writes its pid, then runs $STANDIN_RANK0 or
 * $STANDIN_RANK1 (shell code) as rank 0 or 1. */
static const char standin_worker[] =
    "#!/bin/sh\n"
    "while [ $# -gt 0 ]; do [ \"$1\" = --rank ] && r=$2; shift; done\n"
    "echo $$ > $OUTDIR/pid$r.tmp && mv $OUTDIR/pid$r.tmp $OUTDIR/pid$r\n"
    "if [ \"$r\" = 0 ]; then eval \"$STANDIN_RANK0\"; else eval \"$STANDIN_RANK1\"; fi\n";

static void write_script(const char *dir, const char *name, const char *text) {
  char path[600];
  snprintf(path, sizeof(path), "%s/%s", dir, name);
  FILE *f = fopen(path, "w");
  REQUIRE(f && fputs(text, f) >= 0 && fclose(f) == 0 && chmod(path, 0755) == 0, "cannot write %s",
          path);
}

/* One run of ps-local with the stand-ins in bin, in a fresh $OUTDIR (into
 * outdir): rank 0 prints summary (a line of its stdout) and ends the
 * training; rank 1 runs the shell code rank1. Returns its wait status. */
static int standin_run(struct launcher_run *r, const char *tag, const char *bin,
                       const char *summary, const char *rank1, char *outdir, size_t len) {
  char rank0[600];
  snprintf(outdir, len, "%s/%s.cmd", harness_dir(), tag);
  REQUIRE(mkdir(outdir, 0755) == 0, "mkdir %s", outdir);
  snprintf(rank0, sizeof(rank0), "echo '%s'; touch $OUTDIR/stop-shards; exit 0", summary);
  setenv("OUTDIR", outdir, 1);
  setenv("STANDIN_RANK0", rank0, 1);
  setenv("STANDIN_RANK1", rank1, 1);
  int st = launcher_run(r, tag,
                        (const char *[]){"--bin-dir", bin, "--shards", "2", "--workers", "2",
                                         "--lr-schedule", "constant", NULL},
                        30);
  unsetenv("STANDIN_RANK0");
  unsetenv("STANDIN_RANK1");
  return st;
}

/* The summary line through the stand-ins: with and without workers_lost=,
 * then rank 1 stopped while the training ended without it. */
static void test_standins(void) {
  char bin[512], outdir[512], line[1024], want[600];
  snprintf(bin, sizeof(bin), "%s/standin-bin", harness_dir());
  REQUIRE(mkdir(bin, 0755) == 0, "mkdir %s", bin);
  write_script(bin, "ps-server", standin_server);
  write_script(bin, "ps-worker", standin_worker);
  struct launcher_run r;
  struct harness_summary sum;

  const char *with_lost =
      "summary accuracy=0.8603 epochs=3 wall_s=2.02 samples_per_s=108925 "
      "workers_lost=1";
  int st = standin_run(&r, "standin-lost", bin, with_lost, "exit 0", outdir, sizeof(outdir));
  if (launcher_exit_code(st) != 0) launcher_show(r.err);
  REQUIRE(launcher_exit_code(st) == 0, "stand-ins, workers_lost=1: exit %d, want 0",
          launcher_exit_code(st));
  last_line(r.out, line, sizeof(line));
  char *lost = strstr(line, " workers_lost=");
  REQUIRE(lost && strcmp(lost, " workers_lost=1") == 0,
          "rank 0 said workers_lost=1, ps-local's summary does not end with it: \"%s\"", line);
  *lost = '\0';
  REQUIRE(harness_parse_summary(line, &sum) == 0 && sum.epochs == 3 && sum.accuracy == 0.8603 &&
              sum.samples_per_s == 108925,
          "not rank 0's figures: \"%s\"", line);
  REQUIRE(launcher_leftovers(r.tmpdir) == 0, "stand-ins: processes left running");

  const char *without = "summary accuracy=0.8603 epochs=3 wall_s=2.02 samples_per_s=108925";
  st = standin_run(&r, "standin-plain", bin, without, "exit 0", outdir, sizeof(outdir));
  if (launcher_exit_code(st) != 0) launcher_show(r.err);
  REQUIRE(launcher_exit_code(st) == 0, "stand-ins, no workers_lost=: exit %d, want 0",
          launcher_exit_code(st));
  last_line(r.out, line, sizeof(line));
  REQUIRE(harness_parse_summary(line, &sum) == 0,
          "rank 0 had no workers_lost=, ps-local's summary is not the plain one: \"%s\"", line);
  REQUIRE(launcher_leftovers(r.tmpdir) == 0, "stand-ins: processes left running");

  /* The bug: rank 1 stopped, rank 0 finished, the shards exited. */
  st = standin_run(&r, "standin-stopped", bin, with_lost, "kill -STOP $$; exec sleep 30", outdir,
                   sizeof(outdir));
  if (launcher_exit_code(st) != 129) launcher_show(r.err);
  REQUIRE(launcher_exit_code(st) == 129, "stand-ins, rank 1 stopped: exit %d, want 129",
          launcher_exit_code(st));
  char pid_file[600];
  snprintf(pid_file, sizeof(pid_file), "%s/pid1", outdir);
  FILE *f = fopen(pid_file, "r");
  int rank1 = 0;
  REQUIRE(f && fscanf(f, "%d", &rank1) == 1 && rank1 > 0, "no pid in %s", pid_file);
  fclose(f);
  snprintf(want, sizeof(want),
           "ps-worker rank 1 (pid %d) was stopped (SIGSTOP) while the others had finished: killed "
           "it; the job did not complete",
           rank1);
  if (harness_grep(r.err, want) != 1) launcher_show(r.err);
  REQUIRE(harness_grep(r.err, want) == 1, "stderr does not say \"%s\" once", want);
  REQUIRE(harness_grep(r.out, "summary ") == 0, "a summary after a rank was lost");
  REQUIRE(kill(rank1, 0) != 0 && errno == ESRCH, "the stopped rank 1 (pid %d) still runs", rank1);
  REQUIRE(launcher_leftovers(r.tmpdir) == 0, "stand-ins, rank 1 stopped: processes left running");
  REQUIRE(launcher_dir_entries(r.tmpdir) == 0, "ps-local did not remove its temp dir");
  unsetenv("OUTDIR");
  printf(
      "stand-ins: workers_lost= passed on or left out as rank 0 says; a stopped rank 1: "
      "killed, exit 129\n");
}

/* A real run's summary line: ps-worker may add workers_lost= (0 in a clean
 * run), which harness_parse_summary does not know; cut it off first. */
static void cut_workers_lost(char *line) {
  char *lost = strstr(line, " workers_lost=");
  if (!lost) return;
  REQUIRE(strcmp(lost, " workers_lost=0") == 0, "a clean run lost workers: \"%s\"", line);
  *lost = '\0';
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

  /* 4c. stand-ins: the summary's workers_lost=, a stopped rank */
  test_standins();

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
  cut_workers_lost(line);
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
  cut_workers_lost(line2);
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
