/* ps-local end to end: usage errors, a failing run that must leave no
 * process behind, a run stopped by SIGTERM, and a tiny real training run.
 *
 * Every run of ps-local gets TMPDIR set to a private directory of this test,
 * so afterwards the test can see that ps-local removed its temp dir. This
 * process makes itself a child subreaper (PR_SET_CHILD_SUBREAPER): a
 * ps-server or ps-worker orphaned by ps-local would be re-parented here
 * instead of to init, so "no live process has us as its parent once ps-local
 * is reaped" proves that nothing was left running. Processes whose command
 * line names our directory are counted as well. */
#include <dirent.h>
#include <fcntl.h>
#include <signal.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "clock.h"
#include "harness.h"

struct run {
  const char *argv[32];
  char out[512], err[512]; /* files holding its stdout and stderr */
  char tmpdir[512];        /* its TMPDIR */
};

static int exec_run(void *arg) {
  struct run *r = arg;
  int out = open(r->out, O_WRONLY | O_CREAT | O_TRUNC, 0644);
  int err = open(r->err, O_WRONLY | O_CREAT | O_TRUNC, 0644);
  if (out < 0 || err < 0) return 126;
  dup2(out, 1);
  dup2(err, 2);
  setenv("TMPDIR", r->tmpdir, 1);
  execv(r->argv[0], (char *const *)r->argv);
  perror("execv ps-local");
  return 127;
}

/* Starts ps-local with the given options (NULL-terminated); tag names its files. */
static pid_t start(struct run *r, const char *tag, const char *const *opts) {
  static char bin[512];
  const char *d = harness_dir();
  harness_bin("tools/ps-local", bin, sizeof(bin));
  r->argv[0] = bin;
  int n = 1;
  for (int i = 0; opts[i] && n < 31; i++) r->argv[n++] = opts[i];
  r->argv[n] = NULL;
  snprintf(r->out, sizeof(r->out), "%s/%s.out", d, tag);
  snprintf(r->err, sizeof(r->err), "%s/%s.err", d, tag);
  snprintf(r->tmpdir, sizeof(r->tmpdir), "%s/%s.tmp", d, tag);
  REQUIRE(mkdir(r->tmpdir, 0755) == 0, "mkdir %s", r->tmpdir);
  return harness_fork(exec_run, r);
}

static void show(const char *path) {
  FILE *f = fopen(path, "r");
  if (!f) return;
  char line[4096];
  fprintf(stderr, "---- %s ----\n", path);
  while (fgets(line, sizeof(line), f)) fputs(line, stderr);
  fclose(f);
}

/* Runs ps-local to the end (timeout_s at most) and returns its wait status. */
static int run(struct run *r, const char *tag, const char *const *opts, int timeout_s) {
  pid_t pid = start(r, tag, opts);
  int st = harness_wait(pid, timeout_s * 1000);
  if (st < 0) {
    show(r->err);
    REQUIRE(0, "ps-local %s did not finish within %d s", tag, timeout_s);
  }
  return st;
}

static int exit_code(int st) {
  return WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
}

/* Counts entries of dir other than . and .. */
static int dir_entries(const char *dir) {
  DIR *d = opendir(dir);
  if (!d) return -1;
  int n = 0;
  struct dirent *e;
  while ((e = readdir(d)))
    if (strcmp(e->d_name, ".") && strcmp(e->d_name, "..")) n++;
  closedir(d);
  return n;
}

/* Live processes that are our children (orphans re-parented to this
 * subreaper; ps-local itself was reaped already) or whose command line
 * contains needle; each one found is killed. Zombies are reaped first. */
/* Processes of ours still alive: children of this test (the subreaper) or
 * whose command line holds needle. With kill_them, they are also killed and
 * reported. */
static int scan_leftovers(const char *needle, bool kill_them);

/* A child that ps-local's exit orphans is killed by PR_SET_PDEATHSIG, but the
 * kernel takes a moment to tear it down (seconds for an ASan process): what
 * still runs 3 s later is a real leftover. */
static int leftovers(const char *needle) {
  for (int i = 0; i < 60 && scan_leftovers(needle, false) > 0; i++) usleep(50 * 1000);
  return scan_leftovers(needle, true);
}

static int scan_leftovers(const char *needle, bool kill_them) {
  while (waitpid(-1, NULL, WNOHANG) > 0) {
  }
  int n = 0;
  DIR *d = opendir("/proc");
  REQUIRE(d, "opendir /proc");
  struct dirent *e;
  while ((e = readdir(d))) {
    char *end;
    long pid = strtol(e->d_name, &end, 10);
    if (*end || pid <= 0 || pid == getpid()) continue;
    char path[64], buf[4096];
    snprintf(path, sizeof(path), "/proc/%ld/stat", pid);
    FILE *f = fopen(path, "r");
    if (!f) continue;
    size_t len = fread(buf, 1, sizeof(buf) - 1, f);
    fclose(f);
    buf[len] = '\0';
    char *rp = strrchr(buf, ')'); /* comm may hold spaces and parentheses */
    char state = 0;
    long ppid = 0;
    if (!rp || sscanf(rp + 1, " %c %ld", &state, &ppid) != 2 || state == 'Z') continue;
    bool mine = ppid == (long)getpid();
    snprintf(path, sizeof(path), "/proc/%ld/cmdline", pid);
    f = fopen(path, "r");
    if (f) {
      len = fread(buf, 1, sizeof(buf) - 1, f);
      fclose(f);
      for (size_t i = 0; i < len; i++)
        if (buf[i] == '\0') buf[i] = ' ';
      buf[len] = '\0';
      if (strstr(buf, needle)) mine = true;
    }
    if (mine) {
      if (kill_them) {
        fprintf(stderr, "left running: pid %ld (ppid %ld): %s\n", pid, ppid, buf);
        kill((pid_t)pid, SIGKILL); /* a failed check must not leave it to the CI box */
      }
      n++;
    }
  }
  closedir(d);
  return n;
}

/* Live children of pid. */
static int count_children(pid_t parent) {
  int n = 0;
  DIR *d = opendir("/proc");
  REQUIRE(d, "opendir /proc");
  struct dirent *e;
  while ((e = readdir(d))) {
    char path[300], buf[1024];
    snprintf(path, sizeof(path), "/proc/%s/stat", e->d_name);
    FILE *f = fopen(path, "r");
    if (!f) continue;
    size_t len = fread(buf, 1, sizeof(buf) - 1, f);
    fclose(f);
    buf[len] = '\0';
    char *rp = strrchr(buf, ')');
    char state = 0;
    long ppid = 0;
    if (rp && sscanf(rp + 1, " %c %ld", &state, &ppid) == 2 && state != 'Z' && ppid == (long)parent)
      n++;
  }
  closedir(d);
  return n;
}

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
  struct run r;
  int st;
  REQUIRE(prctl(PR_SET_CHILD_SUBREAPER, 1) == 0, "PR_SET_CHILD_SUBREAPER");

  /* 1. --help */
  st = run(&r, "help", (const char *[]){"--help", NULL}, 10);
  REQUIRE(exit_code(st) == 0, "--help exited %d", exit_code(st));
  REQUIRE(harness_grep(r.out, "--shards") >= 1, "--help does not mention --shards");
  REQUIRE(harness_grep(r.out, "PS_WORKERS") >= 1, "--help does not name the env variables");

  /* 2. bad usage names the option */
  st = run(&r, "workers0", (const char *[]){"--workers", "0", NULL}, 10);
  REQUIRE(exit_code(st) == 2, "--workers 0 exited %d, want 2", exit_code(st));
  REQUIRE(harness_grep(r.err, "--workers") >= 1, "the message does not name --workers");

  /* 3. the ring mode runs SGD on the workers: a shard-only optimizer is refused clearly */
  st = run(&r, "allreduce-adam",
           (const char *[]){"--sync-mode", "allreduce", "--optimizer", "adam", NULL}, 10);
  REQUIRE(exit_code(st) == 2, "--sync-mode allreduce --optimizer adam exited %d, want 2",
          exit_code(st));
  REQUIRE(harness_grep(r.err, "allreduce") >= 1, "the message does not name the mode");

  /* 4a. bad data with the cosine schedule: refused before anything starts */
  char logs[512], data[512];
  snprintf(data, sizeof(data), "%s/nonexistent", d);
  st = run(&r, "baddata-early", (const char *[]){"--data", data, "--epochs", "1", NULL}, 30);
  REQUIRE(exit_code(st) == 1, "--data %s exited %d, want 1", data, exit_code(st));
  REQUIRE(harness_grep(r.err, data) >= 1, "no message names %s", data);

  /* 4b. bad data, constant schedule: the workers fail, everything is stopped,
   * the path is reported */
  snprintf(logs, sizeof(logs), "%s/logs-baddata", d);
  st = run(&r, "baddata",
           (const char *[]){"--data", data, "--keep-logs", logs, "--epochs", "1", "--lr-schedule",
                            "constant", NULL},
           30);
  if (exit_code(st) == 0 || harness_grep(r.err, data) < 1) show(r.err);
  REQUIRE(exit_code(st) != 0, "--data %s exited 0", data);
  REQUIRE(harness_grep(r.err, data) >= 1, "no message names %s", data);
  REQUIRE(leftovers(logs) == 0, "processes left running after a failed run");
  char p[600];
  snprintf(p, sizeof(p), "%s/shard-0.log", logs);
  REQUIRE(access(p, F_OK) == 0, "--keep-logs: no %s", p);
  snprintf(p, sizeof(p), "%s/shard-0.port", logs);
  REQUIRE(access(p, F_OK) != 0, "--keep-logs: %s was left behind", p);
  REQUIRE(dir_entries(r.tmpdir) == 0, "with --keep-logs, ps-local still wrote to TMPDIR");

  if (!harness_have_dataset()) {
    harness_skip("no Fashion-MNIST under %s: the training runs", HARNESS_DATA_DIR);
    return harness_status();
  }

  /* 5. SIGTERM in the middle of training: exit 143, nothing left, temp dir gone */
  pid_t pid = start(&r, "sigterm", (const char *[]){"--epochs", "50", NULL});
  /* Wait until all four children run, then give the workers a moment. */
  int waited = 0;
  for (; waited < 20000 && count_children(pid) < 4; waited += 20) clock_sleep_ms(20);
  if (waited >= 20000) show(r.err);
  REQUIRE(waited < 20000, "ps-local did not start 2 shards and 2 workers within 20 s");
  clock_sleep_ms(300);
  st = harness_stop(pid, SIGTERM, 15000);
  if (st < 0 || exit_code(st) != 143) show(r.err);
  REQUIRE(st >= 0, "ps-local did not stop within 15 s of SIGTERM");
  REQUIRE(exit_code(st) == 143, "SIGTERM: exit %d, want 143", exit_code(st));
  REQUIRE(leftovers(r.tmpdir) == 0, "processes left running after SIGTERM");
  REQUIRE(dir_entries(r.tmpdir) == 0, "ps-local did not remove its temp dir after SIGTERM");

  /* 6. a tiny real run */
  st = run(&r, "train",
           (const char *[]){"--epochs", "1", "--max-steps", "30", "--shards", "2", "--workers", "2",
                            NULL},
           60);
  if (exit_code(st) != 0) show(r.err);
  REQUIRE(exit_code(st) == 0, "training run exited %d", exit_code(st));
  char line[1024];
  last_line(r.out, line, sizeof(line));
  struct harness_summary sum;
  REQUIRE(harness_parse_summary(line, &sum) == 0, "last stdout line is not a summary: \"%s\"",
          line);
  REQUIRE(sum.accuracy >= 0 && sum.accuracy <= 1, "accuracy %g is not in [0, 1]", sum.accuracy);
  REQUIRE(sum.epochs == 1, "epochs=%d, want 1", sum.epochs);
  REQUIRE(sum.wall_s > 0 && sum.samples_per_s > 0, "wall_s=%g samples_per_s=%g", sum.wall_s,
          sum.samples_per_s);
  REQUIRE(leftovers(r.tmpdir) == 0, "processes left running after training");
  REQUIRE(dir_entries(r.tmpdir) == 0, "ps-local did not remove its temp dir");

  /* 7. the same with --sync-mode allreduce: no shards, a ring of 2 workers */
  st = run(&r, "train-allreduce",
           (const char *[]){"--sync-mode", "allreduce", "--epochs", "1", "--max-steps", "30",
                            "--workers", "2", NULL},
           60);
  if (exit_code(st) != 0) show(r.err);
  REQUIRE(exit_code(st) == 0, "allreduce training run exited %d", exit_code(st));
  REQUIRE(harness_grep(r.err, "0 shard(s) + 2 worker(s)") == 1 &&
              harness_grep(r.err, "sync allreduce") == 1,
          "the banner should say 0 shards, sync allreduce");
  REQUIRE(harness_grep(r.err, "sync_mode=allreduce") >= 1,
          "rank 0 did not train in allreduce mode");
  char line2[1024];
  last_line(r.out, line2, sizeof(line2));
  REQUIRE(harness_parse_summary(line2, &sum) == 0,
          "allreduce: last stdout line is not a summary: \"%s\"", line2);
  REQUIRE(leftovers(r.tmpdir) == 0, "processes left running after allreduce training");
  REQUIRE(dir_entries(r.tmpdir) == 0, "ps-local did not remove its temp dir (allreduce)");
  printf(
      "ps-local: usage errors exit 2; bad data fails cleanly; SIGTERM exits 143; %s; "
      "allreduce: %s\n",
      line, line2);
  return 0;
}
