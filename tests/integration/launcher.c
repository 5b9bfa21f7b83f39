/* launcher: runs of tools/ps-local (see launcher.h). */
#include "launcher.h"

#include <dirent.h>
#include <fcntl.h>
#include <signal.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "harness.h"

static int exec_run(void *arg) {
  struct launcher_run *r = arg;
  int out = open(r->out, O_WRONLY | O_CREAT | O_TRUNC, 0644);
  int err = open(r->err, O_WRONLY | O_CREAT | O_TRUNC, 0644);
  if (out < 0 || err < 0) return 126;
  dup2(out, 1);
  dup2(err, 2);
  close(out);
  close(err);
  setenv("TMPDIR", r->tmpdir, 1);
  execv(r->argv[0], (char *const *)r->argv);
  perror("execv ps-local");
  return 127;
}

pid_t launcher_start(struct launcher_run *r, const char *tag, const char *const *opts) {
  static char bin[512];
  const char *d = harness_dir();
  harness_bin("tools/ps-local", bin, sizeof(bin));
  r->argv[0] = bin;
  int n = 1;
  for (int i = 0; opts[i]; i++) {
    REQUIRE(n <= LAUNCHER_MAX_ARGS, "ps-local %s: more than %d arguments", tag, LAUNCHER_MAX_ARGS);
    r->argv[n++] = opts[i];
  }
  r->argv[n] = NULL;
  snprintf(r->out, sizeof(r->out), "%s/%s.out", d, tag);
  snprintf(r->err, sizeof(r->err), "%s/%s.err", d, tag);
  snprintf(r->tmpdir, sizeof(r->tmpdir), "%s/%s.tmp", d, tag);
  REQUIRE(mkdir(r->tmpdir, 0755) == 0, "mkdir %s", r->tmpdir);
  return harness_fork(exec_run, r);
}

void launcher_show(const char *path) {
  FILE *f = fopen(path, "r");
  if (!f) return;
  char line[4096];
  fprintf(stderr, "---- %s ----\n", path);
  while (fgets(line, sizeof(line), f)) fputs(line, stderr);
  fclose(f);
}

int launcher_run(struct launcher_run *r, const char *tag, const char *const *opts, int timeout_s) {
  pid_t pid = launcher_start(r, tag, opts);
  int st = harness_wait(pid, timeout_s * 1000);
  if (st < 0) {
    launcher_show(r->err);
    REQUIRE(0, "ps-local %s did not finish within %d s", tag, timeout_s);
  }
  return st;
}

int launcher_exit_code(int status) {
  return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

int launcher_dir_entries(const char *dir) {
  DIR *d = opendir(dir);
  if (!d) return -1;
  int n = 0;
  struct dirent *e;
  while ((e = readdir(d)))
    if (strcmp(e->d_name, ".") && strcmp(e->d_name, "..")) n++;
  closedir(d);
  return n;
}

/* The state and parent of a process from /proc/<pid>/stat; false if it is gone. */
static bool proc_stat(const char *pid, char *state, long *ppid) {
  char path[300], buf[1024];
  snprintf(path, sizeof(path), "/proc/%s/stat", pid);
  FILE *f = fopen(path, "r");
  if (!f) return false;
  size_t len = fread(buf, 1, sizeof(buf) - 1, f);
  fclose(f);
  buf[len] = '\0';
  char *rp = strrchr(buf, ')'); /* comm may hold spaces and parentheses */
  return rp && sscanf(rp + 1, " %c %ld", state, ppid) == 2;
}

/* Processes of ours still alive (launcher.h); with kill_them, they are also
 * killed and reported. Zombies are reaped first. */
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
    char state = 0, path[64], buf[4096];
    long ppid = 0;
    if (!proc_stat(e->d_name, &state, &ppid) || state == 'Z') continue;
    bool mine = ppid == (long)getpid();
    snprintf(path, sizeof(path), "/proc/%ld/cmdline", pid);
    FILE *f = fopen(path, "r");
    buf[0] = '\0';
    if (f) {
      size_t len = fread(buf, 1, sizeof(buf) - 1, f);
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

int launcher_leftovers(const char *needle) {
  for (int i = 0; i < 60 && scan_leftovers(needle, false) > 0; i++) usleep(50 * 1000);
  return scan_leftovers(needle, true);
}

int launcher_count_children(pid_t parent) {
  int n = 0;
  DIR *d = opendir("/proc");
  REQUIRE(d, "opendir /proc");
  struct dirent *e;
  while ((e = readdir(d))) {
    char state = 0;
    long ppid = 0;
    if (proc_stat(e->d_name, &state, &ppid) && state != 'Z' && ppid == (long)parent) n++;
  }
  closedir(d);
  return n;
}
