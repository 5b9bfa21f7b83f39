/* A ps-worker checkpoint (ps-worker/train/worker_ckpt.c) survives a crash
 * at each step of its commit, and a write whose fsync fails is not taken
 * for written. Built with worker_ckpt.c compiled again with -DPS_FAILPOINTS
 * (common/failpoint.h):
 * - a child process holding checkpoint A (step 4) writes B (step 8) with
 *   PS_FAILPOINT set to one step and _exit()s there as a kill -9 would; the
 *   parent prepares the directory as a restarted worker does (the leftover
 *   .tmp removed) and scans it: the newest valid step is exactly A before
 *   the rename and B after, its contents bit for bit, nothing skipped;
 * - through a ckpt_io whose fsync fails (-EIO) on the file, then on the
 *   directory: the save returns the error, naming the fsync and the path,
 *   and a file whose fsync failed is not left behind;
 * - four saves keep the newest three.
 * Both I/O backends: one this machine refuses (io_uring under a seccomp
 * profile, or PS_DISABLE_IO_URING=1) is said and the test exits 77
 * (skipped) once the rest passed; a failure still exits 1. */
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "log.h"
#include "worker_ckpt.h"
#include "check.h"
#include "faulty_io.h"

static const char *const points[] = {"wckpt-open",  "wckpt-half",   "wckpt-written",
                                     "wckpt-fsync", "wckpt-rename", "wckpt-dirsync",
                                     "wckpt-pruned"};
#define NPOINTS (sizeof(points) / sizeof(points[0]))
#define RENAMED 4 /* points from here on are after the rename */

static const struct worker_ckpt_id id = {.rank = 0, .world = 2, .batch = 16, .seed = 7};
static const int sizes[] = {12, 8, 3};

/* A model and its velocity with values from seed. */
struct state {
  struct mlp *m;
  float *vel[4];
};

static void state_init(struct state *s, uint64_t seed) {
  s->m = mlp_new(sizes, 3, 1);
  mlp_init_params(s->m, seed);
  memset(s->vel, 0, sizeof(s->vel));
  for (int t = 0; t < mlp_num_tensors(s->m); t++) {
    s->vel[t] = calloc(mlp_tensor_count(s->m, t), sizeof(float));
    for (size_t i = 0; i < mlp_tensor_count(s->m, t); i++) s->vel[t][i] = (float)(seed * 1000 + i);
  }
}

static void state_free(struct state *s) {
  for (int t = 0; t < 4; t++) free(s->vel[t]);
  mlp_free(s->m);
}

static bool state_equal(struct state *a, struct state *b) {
  for (int t = 0; t < mlp_num_tensors(a->m); t++) {
    size_t n = mlp_tensor_count(a->m, t) * sizeof(float);
    if (memcmp(mlp_param(a->m, t), mlp_param(b->m, t), n) || memcmp(a->vel[t], b->vel[t], n))
      return false;
  }
  return true;
}

static int save(struct ckpt_io *io, const char *dir, uint64_t step, struct state *s, char *err,
                size_t errlen) {
  return worker_ckpt_save(io, dir, &id, step, s->m, s->vel, err, errlen);
}

static void rm_rf(const char *dir) {
  char cmd[200];
  snprintf(cmd, sizeof(cmd), "rm -rf %s", dir);
  if (system(cmd) != 0) fprintf(stderr, "cannot remove %s\n", dir);
}

/* A save through a backend of its own (an io_uring is not shared across fork). */
static int save_with(enum ckpt_io_kind kind, const char *dir, uint64_t step, struct state *s,
                     char *err, size_t errlen) {
  struct ckpt_io *io;
  int r = ckpt_io_open(kind, &io);
  if (r < 0) {
    snprintf(err, errlen, "no backend %d", kind);
    return r;
  }
  r = save(io, dir, step, s, err, errlen);
  ckpt_io_close(io);
  return r;
}

static int refused; /* backends this machine refuses */

static void crash_points(enum ckpt_io_kind kind, struct state *a, struct state *b) {
  struct ckpt_io *io;
  const char *name = kind == CKPT_IO_URING ? "io_uring" : "sync";
  int pr = ckpt_io_open(kind, &io);
  if (pr < 0) {
    fprintf(stderr, "%s backend refused here (%s): its crash points are skipped\n", name,
            strerror(-pr));
    refused++;
    return;
  }
  ckpt_io_close(io);
  for (size_t p = 0; p < NPOINTS; p++) {
    char dir[] = "/tmp/test_worker_ckpt_crash.XXXXXX", err[600] = "";
    if (!mkdtemp(dir)) return;
    CHECK(worker_ckpt_prepare(dir, 0, err, sizeof(err)) == 0, "prepare: %s", err);
    CHECK(save_with(kind, dir, 4, a, err, sizeof(err)) == 0, "checkpoint A: %s", err);
    fflush(NULL);
    pid_t pid = fork();
    if (pid == 0) {
      setenv("PS_FAILPOINT", points[p], 1);
      save_with(kind, dir, 8, b, err, sizeof(err));
      _exit(0); /* the failpoint did not fire */
    }
    int st = 0;
    waitpid(pid, &st, 0);
    CHECK(WIFEXITED(st) && WEXITSTATUS(st) == 97, "%s: child did not stop at %s (status %d)", name,
          points[p], st);
    CHECK(worker_ckpt_prepare(dir, 0, err, sizeof(err)) == 0, "prepare again: %s", err);
    char tmp[200];
    snprintf(tmp, sizeof(tmp), "%s/worker-0000-step-0000000000000008.ckpt.tmp", dir);
    CHECK(access(tmp, F_OK) != 0, "%s: crash at %s: %s left after prepare", name, points[p], tmp);
    struct worker_ckpt_scan sc;
    worker_ckpt_scan(dir, &id, a->m, true, &sc);
    uint64_t want = p >= RENAMED ? 8 : 4;
    CHECK(sc.n >= 1 && sc.steps[0] == want && sc.skipped == 0,
          "%s: crash at %s: newest valid step %llu of %d (want %llu), %d skipped", name, points[p],
          sc.n ? (unsigned long long)sc.steps[0] : 0ull, sc.n, (unsigned long long)want,
          sc.skipped);
    struct state got;
    state_init(&got, 99);
    int r = worker_ckpt_load(dir, &id, want, got.m, got.vel, err, sizeof(err));
    CHECK(r == 0 && state_equal(&got, want == 8 ? b : a), "%s: crash at %s: step %llu: %s", name,
          points[p], (unsigned long long)want, r ? err : "contents differ");
    fprintf(stderr, "%-8s crash at %-13s -> newest valid step %llu\n", name, points[p],
            (unsigned long long)want);
    state_free(&got);
    rm_rf(dir);
  }
}

static void fsync_failures(struct state *a, struct state *b) {
  struct ckpt_io io = {.ops = &faulty_ops};
  char dir[] = "/tmp/test_worker_ckpt_fsync.XXXXXX", err[600] = "";
  if (!mkdtemp(dir)) return;
  CHECK(save(&io, dir, 4, a, err, sizeof(err)) == 0, "checkpoint A: %s", err);
  faulty_file = true;
  int r = save(&io, dir, 8, b, err, sizeof(err));
  CHECK(r == -EIO && strstr(err, "cannot fsync ") && strstr(err, dir),
        "a failed fsync of the file: %d \"%s\"", r, err);
  char path[200];
  snprintf(path, sizeof(path), "%s/worker-0000-step-0000000000000008.ckpt", dir);
  CHECK(access(path, F_OK) != 0, "the file whose fsync failed was renamed in");
  strcat(path, ".tmp");
  CHECK(access(path, F_OK) != 0, "the .tmp whose fsync failed was left");
  fprintf(stderr, "fsync of the file fails:      %s\n", err);
  faulty_file = false;
  faulty_dir = true;
  r = save(&io, dir, 12, b, err, sizeof(err));
  CHECK(r == -EIO && strstr(err, "cannot fsync the directory ") && strstr(err, dir),
        "a failed fsync of the directory: %d \"%s\"", r, err);
  fprintf(stderr, "fsync of the directory fails: %s\n", err);
  faulty_dir = false;
  /* keep three: 4, 12 (complete, only its directory fsync failed), 16, 20 */
  CHECK(save(&io, dir, 16, b, err, sizeof(err)) == 0, "step 16: %s", err);
  CHECK(save(&io, dir, 20, b, err, sizeof(err)) == 0, "step 20: %s", err);
  struct worker_ckpt_scan sc;
  worker_ckpt_scan(dir, &id, a->m, true, &sc);
  CHECK(sc.files == 3 && sc.n == 3 && sc.steps[0] == 20 && sc.steps[2] == 12,
        "after 4 good saves: %d files, %d valid, newest %llu", sc.files, sc.n,
        sc.n ? (unsigned long long)sc.steps[0] : 0ull);
  rm_rf(dir);
}

int main(void) {
  log_setup("test_worker_ckpt_crash", LOG_ERROR);
  struct state a, b;
  state_init(&a, 1);
  state_init(&b, 2);
  crash_points(CKPT_IO_URING, &a, &b);
  crash_points(CKPT_IO_SYNC, &a, &b);
  fsync_failures(&a, &b);
  state_free(&a);
  state_free(&b);
  if (failures) fprintf(stderr, "%d failure(s)\n", failures);
  return failures ? 1 : refused ? 77 : 0;
}
