/* harness: process control for integration tests (see harness.h). */
#include "harness.h"

#include <errno.h>
#include <stdbool.h>
#include <fcntl.h>
#include <signal.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "clock.h"
#include "server_argv.h"

#define MAX_PROCS 64

static pid_t procs[MAX_PROCS];
static char logs[MAX_PROCS][512];
static int num_procs;
static char dir[256];
static pid_t owner;

/* With PS_TEST_UCX_LANES=a,b (the UCX variants of the tests, meson.build):
 * every connection a shard of this test logged went over UCX on lanes
 * that include one of those transports, so a run forced to shared memory
 * fails if UCX quietly fell back to TCP. */
static bool check_ucx_lanes(void) {
  const char *want = getenv("PS_TEST_UCX_LANES");
  if (!want || !want[0]) return true;
  int seen = 0, bad = 0;
  for (int i = 0; i < num_procs; i++) {
    FILE *f = logs[i][0] ? fopen(logs[i], "r") : NULL;
    if (!f) continue;
    char line[4096];
    while (fgets(line, sizeof(line), f)) {
      if (!strstr(line, "msg=\"worker connected\"")) continue;
      seen++;
      const char *l = strstr(line, " ucx_lanes=");
      bool ok = false;
      char names[128];
      snprintf(names, sizeof(names), "%s", want);
      for (char *save = NULL, *n = strtok_r(names, ",", &save); l && n && !ok;
           n = strtok_r(NULL, ",", &save))
        ok = strstr(l, n) != NULL;
      if (!ok) {
        bad++;
        fprintf(stderr, "PS_TEST_UCX_LANES=%s: a connection not on those lanes: %s", want, line);
      }
    }
    fclose(f);
  }
  fprintf(stderr, "ucx lanes: %d connections logged, %d not on %s\n", seen, bad, want);
  return bad == 0;
}

static void cleanup(void) {
  if (getpid() != owner) return;
  for (int i = 0; i < num_procs; i++)
    if (procs[i] > 0) {
      kill(procs[i], SIGKILL);
      waitpid(procs[i], NULL, 0);
    }
  bool lanes_ok = check_ucx_lanes();
  if (dir[0]) {
    char cmd[400];
    snprintf(cmd, sizeof(cmd), "rm -rf '%s'", dir);
    if (system(cmd) != 0) fprintf(stderr, "could not remove %s\n", dir);
  }
  if (!lanes_ok) _exit(1);
}

const char *harness_dir(void) {
  if (!dir[0]) {
    owner = getpid();
    const char *base = getenv("TMPDIR");
    snprintf(dir, sizeof(dir), "%s/ps-test-XXXXXX", base && *base ? base : "/tmp");
    if (!mkdtemp(dir)) {
      perror("mkdtemp");
      exit(1);
    }
    atexit(cleanup);
    signal(SIGPIPE, SIG_IGN);
  }
  return dir;
}

void harness_token_file(const char *name, char *path, size_t len) {
  unsigned char raw[32];
  char hex[2 * sizeof(raw) + 2];
  int rnd = open("/dev/urandom", O_RDONLY | O_CLOEXEC);
  REQUIRE(rnd >= 0 && read(rnd, raw, sizeof(raw)) == (ssize_t)sizeof(raw), "no randomness");
  close(rnd);
  for (size_t i = 0; i < sizeof(raw); i++) snprintf(hex + 2 * i, 3, "%02x", raw[i]);
  hex[2 * sizeof(raw)] = '\n';
  snprintf(path, len, "%s/%s", harness_dir(), name);
  int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
  REQUIRE(fd >= 0 && write(fd, hex, 2 * sizeof(raw) + 1) == (ssize_t)(2 * sizeof(raw) + 1),
          "cannot write %s: %s", path, strerror(errno));
  close(fd);
}

const char *harness_bin(const char *rel, char *buf, size_t len) {
  const char *b = getenv("PS_BUILD_DIR");
  snprintf(buf, len, "%s/%s", b && *b ? b : ".", rel);
  return buf;
}

static void track(pid_t pid, const char *log) {
  if (num_procs < MAX_PROCS) {
    procs[num_procs] = pid;
    snprintf(logs[num_procs], sizeof(logs[0]), "%s", log ? log : "");
    num_procs++;
  }
}

static void untrack(pid_t pid) {
  for (int i = 0; i < num_procs; i++)
    if (procs[i] == pid) procs[i] = 0;
}

void harness_start_server(struct test_server *s, int shard, int num_shards, int num_workers,
                          double lr, const char *const *extra) {
  const char *d = harness_dir();
  static int seq;
  char bin[512], portfile[512], a_lr[32];
  harness_bin("ps-server/ps-server", bin, sizeof(bin));
  snprintf(portfile, sizeof(portfile), "%s/server-%d-%d.port", d, shard, seq);
  snprintf(s->log, sizeof(s->log), "%s/server-%d-%d.log", d, shard, seq++);
  snprintf(a_lr, sizeof(a_lr), "%.9g", lr);
  /* --http on loopback: every test also runs the HTTP thread, and nothing
   * binds the default 0.0.0.0:9090 */
  struct server_argv a;
  server_argv_init(&a, bin, "127.0.0.1:0", portfile, shard, num_shards, num_workers);
  server_argv_add(&a, "--lr", a_lr);
  server_argv_add(&a, "--http", "127.0.0.1:0");
  int n = a.argc;
  const char *argv[SERVER_ARGV_MAX + 2];
  memcpy(argv, a.argv, sizeof(a.argv[0]) * (size_t)n);
  for (int i = 0; extra && extra[i] && n < SERVER_ARGV_MAX; i++) argv[n++] = extra[i];
  argv[n] = NULL;
  unlink(portfile);
  pid_t pid = fork();
  if (pid == 0) {
    /* a test that aborts (no atexit) must not leave its shard behind */
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    int fd = open(s->log, O_WRONLY | O_CREAT | O_TRUNC, 0644);
    if (fd >= 0) {
      dup2(fd, 2);
      close(fd);
    }
    execv(bin, (char *const *)argv);
    perror("execv ps-server");
    _exit(127);
  }
  REQUIRE(pid > 0, "fork failed");
  s->pid = pid;
  track(pid, s->log);
  for (int waited = 0; waited < 10000; waited += 10) {
    FILE *f = fopen(portfile, "r");
    if (f) {
      char line[64] = "";
      if (fgets(line, sizeof(line), f)) {
        line[strcspn(line, "\n")] = 0;
        snprintf(s->addr, sizeof(s->addr), "%s", line);
      }
      fclose(f);
      if (s->addr[0]) return;
    }
    int st;
    REQUIRE(waitpid(pid, &st, WNOHANG) == 0, "ps-server exited early (status %d)", st);
    clock_sleep_ms(10);
  }
  REQUIRE(0, "ps-server did not start listening within 10 s");
}

int harness_wait(pid_t pid, int timeout_ms) {
  for (int waited = 0;; waited += 5) {
    int st;
    pid_t r = waitpid(pid, &st, WNOHANG);
    if (r == pid) {
      untrack(pid);
      return st;
    }
    if (r < 0 || waited >= timeout_ms) return -1;
    clock_sleep_ms(5);
  }
}

int harness_stop(pid_t pid, int sig, int timeout_ms) {
  kill(pid, sig);
  return harness_wait(pid, timeout_ms);
}

pid_t harness_fork(int (*fn)(void *), void *arg) {
  harness_dir();
  fflush(NULL);
  pid_t pid = fork();
  if (pid == 0) _exit(fn(arg));
  REQUIRE(pid > 0, "fork failed");
  track(pid, NULL);
  return pid;
}

void harness_dump_logs(void) {
  if (getpid() != owner) return;
  for (int i = 0; i < num_procs; i++) {
    if (!logs[i][0]) continue;
    FILE *f = fopen(logs[i], "r");
    if (!f) continue;
    fprintf(stderr, "---- %s ----\n", logs[i]);
    char line[1024];
    while (fgets(line, sizeof(line), f)) fputs(line, stderr);
    fclose(f);
  }
}

int harness_grep(const char *file, const char *needle) {
  FILE *f = fopen(file, "r");
  if (!f) return 0;
  int n = 0;
  char line[4096];
  while (fgets(line, sizeof(line), f)) n += strstr(line, needle) != NULL;
  fclose(f);
  return n;
}

int harness_wait_grep(const char *file, const char *needle, int want, int timeout_ms) {
  uint64_t end = clock_now_ms() + (uint64_t)timeout_ms;
  int n;
  while ((n = harness_grep(file, needle)) < want && clock_now_ms() < end) clock_sleep_ms(10);
  return n;
}

pid_t harness_spawn(const char *const *argv, const char *out_path, const char *log_path) {
  harness_dir();
  fflush(NULL);
  pid_t pid = fork();
  if (pid == 0) {
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (out_path) {
      int fd = open(out_path, O_WRONLY | O_CREAT | O_TRUNC, 0644);
      if (fd >= 0) dup2(fd, 1);
    }
    if (log_path) {
      int fd = open(log_path, O_WRONLY | O_CREAT | O_TRUNC, 0644);
      if (fd >= 0) dup2(fd, 2);
    }
    setenv("OPENBLAS_NUM_THREADS", "1", 1);
    setenv("OMP_NUM_THREADS", "1", 1);
    execv(argv[0], (char *const *)argv);
    perror("execv");
    _exit(127);
  }
  REQUIRE(pid > 0, "fork failed");
  track(pid, log_path);
  return pid;
}

bool harness_have_dataset(void) {
  static const char *const files[] = {"train-images-idx3-ubyte", "train-labels-idx1-ubyte",
                                      "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"};
  for (size_t i = 0; i < sizeof(files) / sizeof(files[0]); i++) {
    char raw[256], gz[260];
    snprintf(raw, sizeof(raw), "%s/%s", HARNESS_DATA_DIR, files[i]);
    snprintf(gz, sizeof(gz), "%s.gz", raw);
    if (access(raw, R_OK) != 0 && access(gz, R_OK) != 0) return false;
  }
  return true;
}

void harness_require_dataset(void) {
  if (harness_have_dataset()) return;
  printf("SKIP: Fashion-MNIST is missing under %s (apt-get install dataset-fashion-mnist)\n",
         HARNESS_DATA_DIR);
  exit(77);
}

static bool part_skipped;

void harness_skip(const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  printf("SKIP: ");
  vprintf(fmt, ap);
  printf("\n");
  va_end(ap);
  part_skipped = true;
}

int harness_status(void) {
  return part_skipped ? 77 : 0;
}

int harness_parse_summary(const char *line, struct harness_summary *out) {
  int end = -1;
  int n = sscanf(line, "summary accuracy=%lf epochs=%d wall_s=%lf samples_per_s=%lf%n",
                 &out->accuracy, &out->epochs, &out->wall_s, &out->samples_per_s, &end);
  if (n != 4 || end < 0) return -EINVAL;
  out->workers_lost = -1;
  int more = -1;
  if (sscanf(line + end, " workers_lost=%d%n", &out->workers_lost, &more) == 1 && more > 0)
    end += more;
  return line[end] == '\0' || strcmp(line + end, "\n") == 0 ? 0 : -EINVAL;
}

int harness_read_summary(const char *path, struct harness_summary *out) {
  FILE *f = fopen(path, "r");
  if (!f) return -ENOENT;
  char line[1024];
  int r = -ENOENT;
  while (r != 0 && fgets(line, sizeof(line), f))
    if (strncmp(line, "summary ", 8) == 0) r = harness_parse_summary(line, out) == 0 ? 0 : -ENOENT;
  fclose(f);
  return r;
}

int harness_train(int shards, int workers, const char *const *server_args,
                  const char *const *worker_args, const char *out_path, int timeout_ms) {
  harness_require_dataset();
  struct test_server srv[16];
  char servers[1024] = "";
  for (int i = 0; i < shards; i++) {
    harness_start_server(&srv[i], i, shards, workers, 0.1, server_args);
    snprintf(servers + strlen(servers), sizeof(servers) - strlen(servers), "%s%s", i ? "," : "",
             srv[i].addr);
  }
  char bin[512], ws[16], ranks[16][16], logs_[16][512];
  harness_bin("ps-worker/ps-worker", bin, sizeof(bin));
  snprintf(ws, sizeof(ws), "%d", workers);
  pid_t pids[16];
  for (int r = 0; r < workers; r++) {
    const char *argv[64] = {bin, "--servers", servers, "--world-size", ws, "--rank", ranks[r]};
    int n = 7;
    snprintf(ranks[r], sizeof(ranks[r]), "%d", r);
    for (int i = 0; worker_args && worker_args[i] && n < 62; i++) argv[n++] = worker_args[i];
    argv[n] = NULL;
    snprintf(logs_[r], sizeof(logs_[r]), "%s/worker-%d.log", harness_dir(), r);
    pids[r] = harness_spawn(argv, r == 0 ? out_path : NULL, logs_[r]);
  }
  int failed = 0;
  for (int r = 0; r < workers; r++) {
    int st = harness_wait(pids[r], timeout_ms);
    if (st < 0 || !WIFEXITED(st) || WEXITSTATUS(st) != 0) {
      fprintf(stderr, "worker %d failed (status %d)\n", r, st);
      failed = 1;
    }
  }
  for (int i = 0; i < shards; i++) {
    int st = harness_wait(srv[i].pid, 10000);
    if (st < 0 || !WIFEXITED(st) || WEXITSTATUS(st) != 0) {
      fprintf(stderr, "shard %d did not exit cleanly after training (status %d)\n", i, st);
      failed = 1;
    }
  }
  if (failed) harness_dump_logs();
  return failed;
}
