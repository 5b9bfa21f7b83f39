/* A crash at each step of a checkpoint commit leaves a loadable, complete
 * checkpoint. Built with the checkpoint code compiled again with
 * -DPS_FAILPOINTS (failpoint.h): a child process holding checkpoint A (clock
 * 4) writes checkpoint B (clock 8) with PS_FAILPOINT set to one step, and
 * _exit()s there as a kill -9 would. The parent then loads the directory:
 * it must get exactly A or exactly B (bit for bit, per the fixture), B once
 * the rename has happened, and leftover temp files are removed and never
 * loaded. Both I/O backends: one this machine refuses (io_uring under a
 * seccomp profile, or PS_DISABLE_IO_URING=1) is said and the test exits 77
 * (skipped) once the other passed; a failure still exits 1. Also through
 * a backend whose fsync fails (-EIO) on the file, then on the directory:
 * the write returns the error naming the step and the path, the new file is
 * not loaded after a failed file fsync, and no temp file is left. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "ckpt.h"
#include "ckpt_fixture.h"
#include "log.h"
#include "check.h"
#include "faulty_io.h"

static const char *const points[] = {"ckpt-open",  "ckpt-header", "ckpt-records", "ckpt-written",
                                     "ckpt-fsync", "ckpt-rename", "ckpt-dirsync", "ckpt-pruned"};
#define NPOINTS (sizeof(points) / sizeof(points[0]))

static int write_now(enum ckpt_io_kind kind, const char *dir, struct store *s) {
  struct ckpt_io *io;
  if (ckpt_io_open(kind, &io) < 0) return -1;
  struct ckpt_snapshot *snap = ckpt_snapshot_take(s);
  char err[400];
  int r = ckpt_write(io, dir, snap, NULL, err, sizeof(err));
  if (r < 0) fprintf(stderr, "write: %s\n", err);
  ckpt_snapshot_free(snap);
  ckpt_io_close(io);
  return r;
}

static int refused; /* backends this machine refuses */

static void run_backend(enum ckpt_io_kind kind) {
  struct ckpt_io *probe;
  int pr = ckpt_io_open(kind, &probe);
  if (pr < 0) {
    fprintf(stderr, "%s backend refused here (%s): its crash points are skipped\n",
            kind == CKPT_IO_URING ? "io_uring" : "sync", strerror(-pr));
    refused++;
    return;
  }
  const char *name = ckpt_io_name(probe);
  ckpt_io_close(probe);
  /* the expected contents: A at clock 4, B at clock 8 */
  struct store a, b;
  store_fixture_init(&a, true);
  store_fixture_run(&a, 0, 4, false);
  store_fixture_init(&b, true);
  store_fixture_run(&b, 0, 8, false);
  for (size_t p = 0; p < NPOINTS; p++) {
    char dir[] = "/tmp/test_ckpt_crash.XXXXXX";
    if (!mkdtemp(dir)) return;
    CHECK(write_now(kind, dir, &a) == 0, "checkpoint A");
    fflush(NULL);
    pid_t pid = fork();
    if (pid == 0) {
      setenv("PS_FAILPOINT", points[p], 1);
      write_now(kind, dir, &b);
      _exit(0); /* the failpoint did not fire */
    }
    int st = 0;
    waitpid(pid, &st, 0);
    CHECK(WIFEXITED(st) && WEXITSTATUS(st) == 97, "%s: child did not stop at %s (status %d)", name,
          points[p], st);
    ckpt_remove_temps(dir, 0, "");
    struct store got;
    store_fixture_init(&got, false);
    struct ckpt_info info;
    char err[400] = "";
    int r = ckpt_load_latest(dir, &got, &info, err, sizeof(err));
    CHECK(r == 0, "%s: crash at %s left nothing loadable: %s", name, points[p], err);
    bool renamed = p >= 5;
    if (r == 0) {
      CHECK(info.clock == (renamed ? 8u : 4u), "%s: crash at %s loaded clock %llu", name, points[p],
            (unsigned long long)info.clock);
      CHECK(store_fixture_equal(&got, info.clock == 8 ? &b : &a), "%s: %s: contents", name,
            points[p]);
    }
    fprintf(stderr, "%-8s crash at %-13s -> loaded clock %llu\n", name, points[p],
            (unsigned long long)info.clock);
    store_deinit(&got);
    char cmd[200];
    snprintf(cmd, sizeof(cmd), "rm -rf %s", dir);
    if (system(cmd) != 0) fprintf(stderr, "cannot remove %s\n", dir);
  }
  store_deinit(&a);
  store_deinit(&b);
}

static int write_faulty(const char *dir, struct store *s, char *err, size_t errlen) {
  struct ckpt_io io = {.ops = &faulty_ops};
  struct ckpt_snapshot *snap = ckpt_snapshot_take(s);
  int r = ckpt_write(&io, dir, snap, NULL, err, errlen);
  ckpt_snapshot_free(snap);
  return r;
}

static void fsync_failures(void) {
  struct store a, b;
  store_fixture_init(&a, true);
  store_fixture_run(&a, 0, 4, false);
  store_fixture_init(&b, true);
  store_fixture_run(&b, 0, 8, false);
  char dir[] = "/tmp/test_ckpt_fsync.XXXXXX", err[400] = "";
  if (!mkdtemp(dir)) return;
  CHECK(write_faulty(dir, &a, err, sizeof(err)) == 0, "checkpoint A: %s", err);
  faulty_file = true;
  int r = write_faulty(dir, &b, err, sizeof(err));
  faulty_file = false;
  CHECK(r == -EIO && strstr(err, "cannot fsync ") && strstr(err, dir),
        "a failed fsync of the file: %d \"%s\"", r, err);
  fprintf(stderr, "fsync of the file fails:      %s\n", err);
  char tmp[1100];
  ckpt_file_name(tmp, sizeof(tmp), dir, 0, "", 8, true);
  CHECK(access(tmp, F_OK) != 0, "the temp file whose fsync failed was left");
  struct store got;
  store_fixture_init(&got, false);
  struct ckpt_info info;
  r = ckpt_load_latest(dir, &got, &info, err, sizeof(err));
  CHECK(r == 0 && info.clock == 4, "after a failed file fsync: %d, clock %llu", r,
        (unsigned long long)info.clock);
  store_deinit(&got);
  faulty_dir = true;
  r = write_faulty(dir, &b, err, sizeof(err));
  faulty_dir = false;
  CHECK(r == -EIO && strstr(err, "cannot fsync the directory ") && strstr(err, dir),
        "a failed fsync of the directory: %d \"%s\"", r, err);
  fprintf(stderr, "fsync of the directory fails: %s\n", err);
  char cmd[200];
  snprintf(cmd, sizeof(cmd), "rm -rf %s", dir);
  if (system(cmd) != 0) fprintf(stderr, "cannot remove %s\n", dir);
  store_deinit(&a);
  store_deinit(&b);
}

int main(void) {
  log_setup("test_ckpt_crash", LOG_ERROR);
  run_backend(CKPT_IO_URING);
  run_backend(CKPT_IO_SYNC);
  fsync_failures();
  if (failures) fprintf(stderr, "%d failure(s)\n", failures);
  return failures ? 1 : refused ? 77 : 0;
}
