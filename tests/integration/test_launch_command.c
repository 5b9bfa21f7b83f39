/* ps-local -- CMD: the launcher runs a user's command as every worker
 * (no Python needed: the commands are /bin/sh scripts).
 *
 * 1. Usage: nothing after --, flags that would do nothing for a command, a
 *    command's own --help: refused with exit 2, or left to the command.
 * 2. PS mode (2 shards, 2 workers): each rank writes its environment and
 *    the targets of its open descriptors, then waits for a go file. Before
 *    it is written the test checks every variable of the contract, that the
 *    shards in PS_SERVERS accept connections, and that PS_PEER_LISTEN_FD is
 *    the rank's only socket, listening (/proc/net/tcp) on its PS_PEERS
 *    port; stale PS_SERVER_TEMPLATE / PS_PEER_TEMPLATE / PS_WORKERS of the
 *    caller are gone. Then: rank 0's stdout and stderr are ps-local's, rank
 *    1's are in its log, the shards (never told to shut down) are stopped
 *    within seconds without a warning, exit 0.
 * 3. Allreduce mode, 3 workers, --no-auth: no shard variables (even when the
 *    caller had some), no token, PYTHONPATH keeps the caller's after ours.
 * 4. A rank that exits 3: the others are stopped, exit 1 well under 10 s,
 *    with its status and its log's tail; the shards ran the --optimizer,
 *    --lr, --worker-timeout and --on-worker-timeout given (ps-local's debug
 *    log shows their command lines). A rank that exits 129 (a lost peer):
 *    exit 129, and the shards got no timeout flag that was not given.
 * 5. SIGINT while the commands sleep: exit 130, nothing left running.
 * 6. A command that does not exist or is not executable: exit 1 with the
 *    exec error naming it, promptly.
 * 7. A rank that stops itself (SIGSTOP) while the other exits 0: ps-local
 *    names it with its pid, kills it and exits 129, the stopped pid gone.
 *    A stopped rank when another fails: the SIGTERM of the stop reaches it
 *    (with SIGCONT), so its TERM trap runs before any SIGKILL.
 * After every run nothing of it may be left running (launcher.h), and its
 * temp dir must be gone. */
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
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
#include "net.h"

enum { MAX_RANKS = 4, VALUE_BYTES = 1024 };

/* Each rank: its descriptors and environment into $OUTDIR/r<rank>.{fd,env},
 * then waits for $OUTDIR/go (20 s at most) and writes one line to each of
 * its streams. */
static const char env_script[] =
    "o=$OUTDIR/r$PS_RANK\n"
    "for f in /proc/$$/fd/*; do echo \"${f##*/} $(readlink \"$f\")\"; done > $o.fd\n"
    "env > $o.tmp && mv $o.tmp $o.env\n"
    "i=0; while [ ! -e $OUTDIR/go ]; do sleep 0.02; i=$((i+1)); [ $i -lt 1000 ] || exit 9; done\n"
    "echo out-of-rank-$PS_RANK; echo err-of-rank-$PS_RANK >&2\n";

/* Each rank writes its pid and sleeps; rank 1 fails (status $FAIL_STATUS)
 * once the others wrote theirs. */
static const char fail_script[] =
    "echo $$ > $OUTDIR/pid$PS_RANK.tmp && mv $OUTDIR/pid$PS_RANK.tmp $OUTDIR/pid$PS_RANK\n"
    "if [ \"$PS_RANK\" = 1 ]; then\n"
    "  i=0; while [ ! -e $OUTDIR/pid0 ] || [ ! -e $OUTDIR/pid$((PS_WORLD_SIZE-1)) ]; do\n"
    "    sleep 0.02; i=$((i+1)); [ $i -lt 500 ] || exit 9; done\n"
    "  echo \"rank $PS_RANK gives up here\" >&2; exit $FAIL_STATUS\n"
    "fi\n"
    "exec sleep 30\n";

/* Rank 1 writes its pid and stops itself; rank 0 finishes at once. */
static const char stop_script[] =
    "echo $$ > $OUTDIR/pid$PS_RANK.tmp && mv $OUTDIR/pid$PS_RANK.tmp $OUTDIR/pid$PS_RANK\n"
    "if [ \"$PS_RANK\" = 1 ]; then kill -STOP $$; exec sleep 30; fi\n"
    "exit 0\n";

/* Rank 1 writes its pid, traps SIGTERM (writing $OUTDIR/term1) and stops
 * itself; rank 0 fails (exit 5) once it sees rank 1 stopped (state T). */
static const char stop_term_script[] =
    "echo $$ > $OUTDIR/pid$PS_RANK.tmp && mv $OUTDIR/pid$PS_RANK.tmp $OUTDIR/pid$PS_RANK\n"
    "if [ \"$PS_RANK\" = 1 ]; then\n"
    "  trap 'echo term > $OUTDIR/term1; exit 0' TERM; kill -STOP $$; exec sleep 30\n"
    "fi\n"
    "i=0; until [ -e $OUTDIR/pid1 ] && grep -q '^[^)]*) T' /proc/$(cat $OUTDIR/pid1)/stat; do\n"
    "  sleep 0.02; i=$((i+1)); [ $i -lt 1000 ] || exit 9; done\n"
    "exit 5\n";

static const char sleep_script[] =
    "echo $$ > $OUTDIR/pid$PS_RANK.tmp && mv $OUTDIR/pid$PS_RANK.tmp $OUTDIR/pid$PS_RANK\n"
    "exec sleep 30\n";

/* A fresh $OUTDIR for the commands of run tag, in path. */
static void make_outdir(const char *tag, char *path, size_t len) {
  snprintf(path, len, "%s/%s.cmd", harness_dir(), tag);
  REQUIRE(mkdir(path, 0755) == 0, "mkdir %s", path);
  setenv("OUTDIR", path, 1);
}

/* Waits until path exists while ps-local (pid) runs; 20 s at most. */
static void wait_file(const char *path, pid_t pid, const struct launcher_run *r) {
  for (int waited = 0; access(path, F_OK) != 0; waited += 10) {
    if (waited >= 20000 || kill(pid, 0) != 0) launcher_show(r->err);
    REQUIRE(waited < 20000, "no %s after 20 s", path);
    REQUIRE(kill(pid, 0) == 0, "ps-local exited before %s appeared", path);
    clock_sleep_ms(10);
  }
}

/* The value of name in an `env` dump; false if it is not set. */
static bool env_value(const char *path, const char *name, char *out, size_t len) {
  FILE *f = fopen(path, "r");
  REQUIRE(f, "cannot read %s", path);
  char line[4096];
  size_t n = strlen(name);
  bool found = false;
  while (!found && fgets(line, sizeof(line), f)) {
    if (strncmp(line, name, n) != 0 || line[n] != '=') continue;
    line[strcspn(line, "\n")] = '\0';
    snprintf(out, len, "%s", line + n + 1);
    found = true;
  }
  fclose(f);
  return found;
}

/* name's value in rank r's dump, which must be set. */
static const char *need(const char *env, const char *name, char *buf) {
  REQUIRE(env_value(env, name, buf, VALUE_BYTES), "%s: %s is not set", env, name);
  return buf;
}

static void expect(const char *env, const char *name, const char *want) {
  char v[VALUE_BYTES];
  need(env, name, v);
  REQUIRE(strcmp(v, want) == 0, "%s: %s=%s, want %s", env, name, v, want);
}

static void expect_unset(const char *env, const char *name) {
  char v[VALUE_BYTES];
  REQUIRE(!env_value(env, name, v, sizeof(v)), "%s: %s=%s should not be set", env, name, v);
}

static void expect_int(const char *env, const char *name, int want) {
  char w[24];
  snprintf(w, sizeof(w), "%d", want);
  expect(env, name, w);
}

/* The socket inodes among a rank's descriptors ("N socket:[INODE]" lines):
 * returns how many, the first one's fd and inode in *fd and *inode. */
static int sockets_of(const char *fd_list, int *fd, unsigned long *inode) {
  FILE *f = fopen(fd_list, "r");
  REQUIRE(f, "cannot read %s", fd_list);
  char line[1024];
  int n = 0;
  while (fgets(line, sizeof(line), f)) {
    int d;
    unsigned long ino;
    if (sscanf(line, "%d socket:[%lu]", &d, &ino) != 2) continue;
    if (n++ == 0) {
      *fd = d;
      *inode = ino;
    }
  }
  fclose(f);
  return n;
}

/* Whether the TCP socket inode listens on 127.0.0.1:port (/proc/net/tcp). */
static bool listens_on(unsigned long inode, int port) {
  FILE *f = fopen("/proc/net/tcp", "r");
  REQUIRE(f, "cannot read /proc/net/tcp");
  char line[512];
  bool found = false;
  while (!found && fgets(line, sizeof(line), f)) {
    unsigned ip, p, st;
    unsigned long ino;
    if (sscanf(line, " %*s %x:%x %*s %x %*s %*s %*s %*s %*s %lu", &ip, &p, &st, &ino) != 4)
      continue;
    found = ino == inode && ip == 0x0100007F && (int)p == port && st == 0x0A; /* TCP_LISTEN */
  }
  fclose(f);
  return found;
}

/* Splits "h:p,h:p" into addrs; returns the count. */
static int addr_list(const char *list, struct net_addr *addrs) {
  char err[256];
  int n = net_parse_addr_list(list, addrs, MAX_RANKS, err, sizeof(err));
  REQUIRE(n > 0, "\"%s\" is not an address list: %s", list, err);
  for (int i = 0; i < n; i++)
    REQUIRE(strcmp(addrs[i].host, "127.0.0.1") == 0, "%s: not on 127.0.0.1", list);
  return n;
}

/* What every rank of a run must agree on, taken from rank 0. */
struct job_view {
  char peers[VALUE_BYTES], servers[VALUE_BYTES], token[VALUE_BYTES], job[VALUE_BYTES];
  char master_port[VALUE_BYTES];
};

/* Checks rank r's environment and descriptors against the contract; W
 * workers, S shards (0 = allreduce), auth as given. Rank 0 fills *job, the
 * others must match it. */
static void check_rank(const char *outdir, int r, int W, int S, bool auth, struct job_view *job) {
  char env[600], fds[600], v[VALUE_BYTES], buf[VALUE_BYTES];
  snprintf(env, sizeof(env), "%s/r%d.env", outdir, r);
  snprintf(fds, sizeof(fds), "%s/r%d.fd", outdir, r);
  expect(env, "PS_SYNC_MODE", S ? "ps" : "allreduce");
  expect_int(env, "PS_RANK", r);
  expect_int(env, "PS_WORLD_SIZE", W);
  expect_int(env, "RANK", r);
  expect_int(env, "WORLD_SIZE", W);
  expect_int(env, "LOCAL_RANK", r);
  expect_int(env, "LOCAL_WORLD_SIZE", W);
  expect(env, "OPENBLAS_NUM_THREADS", "1");
  expect(env, "OMP_NUM_THREADS", "1");
  expect(env, "MASTER_ADDR", "127.0.0.1");
  expect_unset(env, "PS_SERVER_TEMPLATE"); /* the caller's, stale */
  expect_unset(env, "PS_PEER_TEMPLATE");
  expect_unset(env, "PS_WORKERS"); /* ps-local's own option */
  need(env, "OUTDIR", v);          /* the caller's other variables pass */

  struct net_addr peers[MAX_RANKS], servers[MAX_RANKS];
  REQUIRE(addr_list(need(env, "PS_PEERS", v), peers) == W, "%s: PS_PEERS=%s, want %d", env, v, W);
  if (S) {
    expect_int(env, "PS_NUM_SHARDS", S);
    REQUIRE(addr_list(need(env, "PS_SERVERS", v), servers) == S, "%s: PS_SERVERS=%s, want %d", env,
            v, S);
  } else {
    expect_unset(env, "PS_SERVERS");
    expect_unset(env, "PS_NUM_SHARDS");
  }

  /* Its ring socket: its only socket, already listening on its PS_PEERS port. */
  int fd = -1;
  unsigned long inode = 0;
  int fd_env = atoi(need(env, "PS_PEER_LISTEN_FD", v));
  int socks = sockets_of(fds, &fd, &inode);
  if (socks != 1) launcher_show(fds);
  REQUIRE(socks == 1, "rank %d has %d sockets open, want 1 (its ring socket)", r, socks);
  REQUIRE(fd == fd_env, "rank %d: its socket is fd %d, PS_PEER_LISTEN_FD=%d", r, fd, fd_env);
  REQUIRE(listens_on(inode, peers[r].port), "rank %d: fd %d does not listen on 127.0.0.1:%u", r, fd,
          peers[r].port);

  /* PYTHONPATH: the build tree's python/ first. */
  char root[PATH_MAX], want[2 * PATH_MAX];
  REQUIRE(realpath(getenv("PS_BUILD_DIR"), root), "realpath $PS_BUILD_DIR");
  snprintf(want, sizeof(want), "%s/python", root);
  const char *caller = getenv("PYTHONPATH");
  if (caller && caller[0])
    snprintf(want + strlen(want), sizeof(want) - strlen(want), ":%s", caller);
  expect(env, "PYTHONPATH", want);

  bool has_token = env_value(env, "PS_AUTH_TOKEN_FILE", buf, sizeof(buf));
  REQUIRE(has_token == auth, "%s: PS_AUTH_TOKEN_FILE is %s", env, has_token ? "set" : "missing");
  if (auth) REQUIRE(access(buf, R_OK) == 0, "%s: PS_AUTH_TOKEN_FILE=%s is not readable", env, buf);

  int mport = atoi(need(env, "MASTER_PORT", v));
  REQUIRE(mport > 0 && mport < 65536, "%s: MASTER_PORT=%s", env, v);
  for (int i = 0; i < W; i++)
    REQUIRE(mport != peers[i].port, "MASTER_PORT %d is rank %d's ring port", mport, i);

  struct {
    const char *name;
    char *rank0;
  } same[] = {{"PS_PEERS", job->peers},
              {"PS_SERVERS", job->servers},
              {"PS_AUTH_TOKEN_FILE", job->token},
              {"PS_JOB_ID", job->job},
              {"MASTER_PORT", job->master_port}};
  for (size_t i = 0; i < sizeof(same) / sizeof(same[0]); i++) {
    if (!env_value(env, same[i].name, v, sizeof(v))) v[0] = '\0';
    if (r == 0) snprintf(same[i].rank0, VALUE_BYTES, "%s", v);
    REQUIRE(strcmp(v, same[i].rank0) == 0, "rank %d: %s=%s, rank 0 has %s", r, same[i].name, v,
            same[i].rank0);
  }
  REQUIRE(job->job[0], "PS_JOB_ID is empty");
}

/* Every address of list accepts a TCP connection. */
static void check_listening(const char *list) {
  struct net_addr a[MAX_RANKS];
  int n = addr_list(list, a);
  for (int i = 0; i < n; i++) {
    char err[256];
    struct net_backoff once = {50, 50, 0};
    int fd = net_connect(&a[i], &once, err, sizeof(err));
    REQUIRE(fd >= 0, "shard %d at 127.0.0.1:%u does not accept connections: %s", i, a[i].port, err);
    close(fd);
  }
}

/* Writes the go file the env script waits for. */
static void say_go(const char *outdir) {
  char go[600];
  snprintf(go, sizeof(go), "%s/go", outdir);
  FILE *f = fopen(go, "w");
  REQUIRE(f && fclose(f) == 0, "cannot write %s", go);
}

/* The pid a rank wrote to $OUTDIR/pid<r>. */
static pid_t rank_pid(const char *outdir, int r) {
  char path[600];
  snprintf(path, sizeof(path), "%s/pid%d", outdir, r);
  FILE *f = fopen(path, "r");
  REQUIRE(f, "cannot read %s", path);
  long pid = 0;
  bool ok = fscanf(f, "%ld", &pid) == 1;
  fclose(f);
  REQUIRE(ok && pid > 0, "%s holds no pid", path);
  return (pid_t)pid;
}

static void expect_gone(pid_t pid, const char *what) {
  REQUIRE(kill(pid, 0) != 0 && errno == ESRCH, "%s (pid %d) still runs", what, (int)pid);
}

/* Nothing of run r left running or behind. */
static void expect_clean(const struct launcher_run *r, const char *needle, const char *what) {
  REQUIRE(launcher_leftovers(needle) == 0, "%s: processes left running", what);
  REQUIRE(launcher_dir_entries(r->tmpdir) == 0, "%s: ps-local did not remove its temp dir", what);
}

/* A run that must be refused before it starts anything: exit 2, saying says. */
static void refused(const char *tag, const char *const *opts, const char *says) {
  struct launcher_run r;
  int st = launcher_run(&r, tag, opts, 10);
  if (launcher_exit_code(st) != 2 || harness_grep(r.err, says) < 1) launcher_show(r.err);
  REQUIRE(launcher_exit_code(st) == 2, "%s: exit %d, want 2", tag, launcher_exit_code(st));
  REQUIRE(harness_grep(r.err, says) >= 1, "%s: stderr does not say \"%s\"", tag, says);
  REQUIRE(launcher_dir_entries(r.tmpdir) == 0, "%s: ps-local wrote to TMPDIR", tag);
}

static void test_usage(void) {
  refused("dashdash", (const char *[]){"--", NULL}, "nothing after --");
  refused("epochs", (const char *[]){"--epochs", "2", "--", "/bin/true", NULL},
          "option --epochs: belongs to the built-in trainer");
  refused("sum-lr", (const char *[]){"--lr=0.1", "--", "/bin/true", NULL},
          "option --lr: is the shards' optimizer's");
  refused(
      "allreduce-optimizer",
      (const char *[]){"--sync-mode", "allreduce", "--optimizer", "sgd", "--", "/bin/true", NULL},
      "option --optimizer: is the shards', and --sync-mode allreduce starts none");
  refused("sum-asp", (const char *[]){"--consistency", "asp", "--", "/bin/true", NULL},
          "needs bsp");
  refused("shard-state-command",
          (const char *[]){"--sync-mode", "allreduce", "--shard-optimizer-state", "true", "--",
                           "/bin/true", NULL},
          "pass shard_optimizer_state=True to ps.torch.DistributedOptimizer");
  refused("shard-state-ps", (const char *[]){"--shard-optimizer-state", "true", NULL},
          "option --shard-optimizer-state: --sync-mode allreduce only");
  refused(
      "cosine",
      (const char *[]){"--optimizer", "sgd", "--lr-schedule", "cosine", "--", "/bin/true", NULL},
      "option --lr-schedule: cosine needs the run's length");
  refused("on-worker-timeout",
          (const char *[]){"--on-worker-timeout", "never", "--", "/bin/true", NULL},
          "option --on-worker-timeout: \"never\": expected auto, fail or continue (flag)");
  refused("worker-timeout-negative",
          (const char *[]){"--worker-timeout", "-1", "--", "/bin/true", NULL},
          "option --worker-timeout: \"-1\": out of range [0, 1e+07]");
  refused("worker-timeout-word",
          (const char *[]){"--worker-timeout", "soon", "--", "/bin/true", NULL},
          "option --worker-timeout: \"soon\": not a finite number of seconds");
  refused("allreduce-worker-timeout",
          (const char *[]){"--sync-mode", "allreduce", "--on-worker-timeout", "continue", "--",
                           "/bin/true", NULL},
          "option --on-worker-timeout: is the shards', and --sync-mode allreduce starts none");
  refused("allreduce-worker-timeout-builtin",
          (const char *[]){"--sync-mode", "allreduce", "--worker-timeout", "5", NULL},
          "option --worker-timeout: is the shards', and --sync-mode allreduce starts none");
  /* After --, --help is the command's: it runs (and fails with its 4), no help is printed. */
  struct launcher_run r;
  int st = launcher_run(&r, "cmd-help",
                        (const char *[]){"--sync-mode", "allreduce", "--workers", "1", "--",
                                         "/bin/sh", "-c", "exit 4", "sh", "--help", NULL},
                        10);
  if (launcher_exit_code(st) != 1) launcher_show(r.err);
  REQUIRE(launcher_exit_code(st) == 1, "-- sh ... --help: exit %d, want 1 (the command's 4)",
          launcher_exit_code(st));
  REQUIRE(harness_grep(r.err, "worker rank 0 failed: exit status 4") == 1,
          "-- sh ... --help: no message on rank 0's status 4");
  REQUIRE(harness_grep(r.out, "Command mode") == 0, "-- sh ... --help printed ps-local's help");
  expect_clean(&r, r.tmpdir, "cmd-help");
}

/* 2 and 3: the environment of W ranks; S shards (0 = allreduce). */
static void test_env(const char *tag, int S, int W, bool auth) {
  char outdir[512], logs[512], a_s[16], a_w[16];
  make_outdir(tag, outdir, sizeof(outdir));
  snprintf(logs, sizeof(logs), "%s/%s.logs", harness_dir(), tag);
  snprintf(a_s, sizeof(a_s), "%d", S ? S : 1);
  snprintf(a_w, sizeof(a_w), "%d", W);
  const char *opts[24] = {"--shards",    a_s,  "--workers",   a_w,
                          "--keep-logs", logs, "--log-level", "debug"};
  int n = 8;
  opts[n++] = "--sync-mode";
  opts[n++] = S ? "ps" : "allreduce";
  if (!auth) opts[n++] = "--no-auth";
  const char *tail[] = {"--", "/bin/sh", "-c", env_script};
  for (size_t i = 0; i < sizeof(tail) / sizeof(tail[0]); i++) opts[n++] = tail[i];
  opts[n] = NULL;

  struct launcher_run r;
  pid_t pid = launcher_start(&r, tag, opts);
  struct job_view job;
  memset(&job, 0, sizeof(job));
  for (int rank = 0; rank < W; rank++) {
    char env[600];
    snprintf(env, sizeof(env), "%s/r%d.env", outdir, rank);
    wait_file(env, pid, &r);
    check_rank(outdir, rank, W, S, auth, &job);
  }
  if (S) check_listening(job.servers);
  uint64_t go = clock_now_ms();
  say_go(outdir);
  int st = harness_wait(pid, 15000);
  uint64_t took = clock_now_ms() - go;
  if (st < 0 || launcher_exit_code(st) != 0) launcher_show(r.err);
  REQUIRE(st >= 0, "%s: ps-local did not exit within 15 s of the commands' end", tag);
  REQUIRE(launcher_exit_code(st) == 0, "%s: exit %d, want 0", tag, launcher_exit_code(st));
  /* Shards never told to shut down: a command's 2 s of grace (not the
   * trainer's 10 s), then SIGTERM; the event is ps-local saying which */
  REQUIRE(!S || (harness_grep(r.err, "msg=\"workers done\"") == 1 &&
                 harness_grep(r.err, " grace_ms=2000") == 1),
          "%s: ps-local did not give the shards a command's 2 s of grace", tag);
  REQUIRE(harness_grep(r.err, "warning") == 0, "%s: a warning on stderr", tag);
  REQUIRE(harness_grep(r.out, "out-of-rank-0") == 1 && harness_grep(r.err, "err-of-rank-0") == 1,
          "%s: rank 0's stdout and stderr are not ps-local's", tag);
  REQUIRE(harness_grep(r.out, "out-of-rank-1") == 0, "%s: rank 1's stdout reached ours", tag);
  char log1[600];
  snprintf(log1, sizeof(log1), "%s/worker-1.log", logs);
  REQUIRE(harness_grep(log1, "out-of-rank-1") == 1 && harness_grep(log1, "err-of-rank-1") == 1,
          "%s: rank 1's output is not in %s", tag, log1);
  REQUIRE(launcher_leftovers(logs) == 0, "%s: processes left running", tag);
  REQUIRE(launcher_leftovers(r.tmpdir) == 0, "%s: processes left running", tag);
  printf(
      "%s: %d shard(s), %d worker(s): every variable right, ring sockets listening, exit 0 "
      "%llu ms after the commands\n",
      tag, S, W, (unsigned long long)took);
}

/* 4. A rank that fails. */
static void test_failing_rank(void) {
  char outdir[512];
  make_outdir("fail", outdir, sizeof(outdir));
  setenv("FAIL_STATUS", "5", 1); /* a permanent failure other than 3 (which passes through) */
  struct launcher_run r;
  uint64_t t0 = clock_now_ms();
  pid_t pid = launcher_start(
      &r, "fail",
      (const char *[]){"--shards", "1", "--workers", "3", "--optimizer", "momentum", "--lr", "0.05",
                       "--worker-timeout", "7.5", "--on-worker-timeout", "continue", "--log-level",
                       "debug", "--", "/bin/sh", "-c", fail_script, NULL});
  int st = harness_wait(pid, 20000);
  uint64_t took = clock_now_ms() - t0;
  if (st < 0 || launcher_exit_code(st) != 1) launcher_show(r.err);
  REQUIRE(st >= 0, "a failing rank: ps-local did not exit within 20 s");
  REQUIRE(launcher_exit_code(st) == 1, "a failing rank: exit %d, want 1", launcher_exit_code(st));
  /* the other ranks sleep 30 s: ps-local's exit within 20 s is the event */
  REQUIRE(harness_grep(r.err, "worker rank 1 failed: exit status 5") == 1,
          "no message naming rank 1 and its status 5");
  REQUIRE(harness_grep(r.err, "rank 1 gives up here") == 1, "rank 1's log tail is not shown");
  REQUIRE(harness_grep(r.err, "--optimizer momentum") >= 1 && harness_grep(r.err, "--lr 0.05") >= 1,
          "the shard was not started with --optimizer momentum --lr 0.05");
  REQUIRE(harness_grep(r.err, "--worker-timeout 7.5 --on-worker-timeout continue") == 1,
          "the shard was not started with --worker-timeout 7.5 --on-worker-timeout continue");
  expect_gone(rank_pid(outdir, 0), "rank 0");
  expect_gone(rank_pid(outdir, 2), "rank 2");
  expect_clean(&r, r.tmpdir, "a failing rank");
  printf("a rank exiting 5: the others stopped, exit 1 after %llu ms\n", (unsigned long long)took);
}

/* 4. A rank that lost a peer (exit 129: retryable) or found the job's
 * state lost (exit 3: restart all of it): ps-local's exit says the same. */
static void test_passed_through(int code) {
  char outdir[512], status[16], what[64], named[80];
  snprintf(status, sizeof(status), "%d", code);
  snprintf(what, sizeof(what), "a rank exiting %d", code);
  snprintf(named, sizeof(named), "worker rank 1 failed: exit status %d", code);
  make_outdir(code == 3 ? "lost" : "retry", outdir, sizeof(outdir));
  setenv("FAIL_STATUS", status, 1);
  struct launcher_run r;
  pid_t pid = launcher_start(&r, code == 3 ? "lost" : "retry",
                             (const char *[]){"--shards", "1", "--workers", "2", "--log-level",
                                              "debug", "--", "/bin/sh", "-c", fail_script, NULL});
  int st = harness_wait(pid, 20000);
  if (st < 0 || launcher_exit_code(st) != code) launcher_show(r.err);
  REQUIRE(st >= 0, "%s: ps-local did not exit within 20 s", what);
  REQUIRE(launcher_exit_code(st) == code, "%s: exit %d, want %d", what, launcher_exit_code(st),
          code);
  REQUIRE(harness_grep(r.err, named) == 1, "no message naming rank 1 and its status %d", code);
  REQUIRE(harness_grep(r.err, "--worker-timeout") == 0 &&
              harness_grep(r.err, "--on-worker-timeout") == 0,
          "the shard got a timeout flag that was not given");
  expect_gone(rank_pid(outdir, 0), "rank 0");
  expect_clean(&r, r.tmpdir, what);
  printf("%s: exit %d\n", what, code);
}

/* 7. A rank stopped (SIGSTOP) after the other finished. */
static void test_stopped_rank(void) {
  char outdir[512];
  make_outdir("stopped", outdir, sizeof(outdir));
  struct launcher_run r;
  uint64_t t0 = clock_now_ms();
  pid_t pid = launcher_start(&r, "stopped",
                             (const char *[]){"--shards", "2", "--workers", "2", "--", "/bin/sh",
                                              "-c", stop_script, NULL});
  int st = harness_wait(pid, 30000);
  uint64_t took = clock_now_ms() - t0;
  if (st < 0 || launcher_exit_code(st) != 129) launcher_show(r.err);
  REQUIRE(st >= 0, "a stopped rank: ps-local did not exit within 30 s");
  REQUIRE(launcher_exit_code(st) == 129, "a stopped rank: exit %d, want 129",
          launcher_exit_code(st));
  pid_t rank1 = rank_pid(outdir, 1);
  char says[300];
  snprintf(says, sizeof(says),
           "worker rank 1 (pid %d) was stopped (SIGSTOP) while the others had finished: killed "
           "it; the job did not complete",
           (int)rank1);
  if (harness_grep(r.err, says) != 1) launcher_show(r.err);
  REQUIRE(harness_grep(r.err, says) == 1, "a stopped rank: stderr does not say \"%s\" once", says);
  expect_gone(rank1, "the stopped rank 1");
  expect_clean(&r, r.tmpdir, "a stopped rank");
  printf("a rank stopped after the other finished: named, killed, exit 129 after %llu ms\n",
         (unsigned long long)took);
}

/* 7. A stopped rank while another fails: SIGTERM and SIGCONT reach it. */
static void test_stopped_rank_term(void) {
  char outdir[512], term[600];
  make_outdir("stopped-term", outdir, sizeof(outdir));
  struct launcher_run r;
  int st = launcher_run(&r, "stopped-term",
                        (const char *[]){"--shards", "1", "--workers", "2", "--", "/bin/sh", "-c",
                                         stop_term_script, NULL},
                        30);
  if (launcher_exit_code(st) != 1) launcher_show(r.err);
  REQUIRE(launcher_exit_code(st) == 1, "a stopped rank, another failing: exit %d, want 1",
          launcher_exit_code(st));
  REQUIRE(harness_grep(r.err, "worker rank 0 failed: exit status 5") == 1,
          "no message naming rank 0 and its status 5");
  snprintf(term, sizeof(term), "%s/term1", outdir);
  REQUIRE(access(term, F_OK) == 0,
          "the stopped rank 1 never ran its SIGTERM trap: ps-local sent no SIGCONT");
  expect_gone(rank_pid(outdir, 1), "the stopped rank 1");
  expect_clean(&r, r.tmpdir, "a stopped rank, another failing");
  printf("a stopped rank while another failed: it acted on SIGTERM (SIGCONT came with it)\n");
}

/* 5. Ctrl-C. */
static void test_sigint(void) {
  char outdir[512], p[600];
  make_outdir("sigint", outdir, sizeof(outdir));
  struct launcher_run r;
  pid_t pid = launcher_start(&r, "sigint",
                             (const char *[]){"--shards", "2", "--workers", "2", "--", "/bin/sh",
                                              "-c", sleep_script, NULL});
  for (int rank = 0; rank < 2; rank++) {
    snprintf(p, sizeof(p), "%s/pid%d", outdir, rank);
    wait_file(p, pid, &r);
  }
  pid_t ranks[2] = {rank_pid(outdir, 0), rank_pid(outdir, 1)};
  REQUIRE(launcher_count_children(pid) == 4, "ps-local has %d children, want 2 shards + 2 ranks",
          launcher_count_children(pid));
  int st = harness_stop(pid, SIGINT, 10000);
  if (st < 0 || launcher_exit_code(st) != 130) launcher_show(r.err);
  REQUIRE(st >= 0, "SIGINT: ps-local did not exit within 10 s");
  REQUIRE(launcher_exit_code(st) == 130, "SIGINT: exit %d, want 130", launcher_exit_code(st));
  expect_gone(ranks[0], "rank 0");
  expect_gone(ranks[1], "rank 1");
  expect_clean(&r, r.tmpdir, "SIGINT");
  printf("SIGINT: exit 130, shards and ranks gone\n");
}

/* 6. Commands that cannot be executed. */
static void test_exec_failure(const char *tag, const char *sync, const char *cmd,
                              const char *error) {
  struct launcher_run r;
  char says[700];
  int st = launcher_run(
      &r, tag,
      (const char *[]){"--shards", "1", "--workers", "2", "--sync-mode", sync, "--", cmd, NULL},
      20);
  snprintf(says, sizeof(says), "cannot run %s: %s", cmd, error);
  if (launcher_exit_code(st) != 1 || harness_grep(r.err, says) != 1) launcher_show(r.err);
  REQUIRE(launcher_exit_code(st) == 1, "%s: exit %d, want 1", tag, launcher_exit_code(st));
  REQUIRE(harness_grep(r.err, says) == 1, "%s: stderr does not say \"%s\" once", tag, says);
  expect_clean(&r, r.tmpdir, tag);
}

int main(void) {
  REQUIRE(prctl(PR_SET_CHILD_SUBREAPER, 1) == 0, "PR_SET_CHILD_SUBREAPER");
  setenv("PS_SERVER_TEMPLATE", "stale-{i}:1", 1); /* a caller's leftovers, never the job's */
  setenv("PS_PEER_TEMPLATE", "stale-{i}:2", 1);

  test_usage();
  printf(
      "usage: nothing after --, flags a command ignores: exit 2; a command's --help is its own\n");

  setenv("PS_WORKERS", "2", 1); /* ps-local's own option, through its variable */
  test_env("env-ps", 2, 2, true);
  unsetenv("PS_WORKERS");

  setenv("PS_SERVERS", "127.0.0.1:1", 1); /* stale: allreduce mode has no shards */
  setenv("PS_NUM_SHARDS", "7", 1);
  setenv("PYTHONPATH", "/nonexistent/site", 1);
  test_env("env-allreduce", 0, 3, false);
  unsetenv("PS_SERVERS");
  unsetenv("PS_NUM_SHARDS");
  unsetenv("PYTHONPATH");

  test_failing_rank();
  test_passed_through(129);
  test_passed_through(3);
  test_sigint();
  test_stopped_rank();
  test_stopped_rank_term();

  char noexec[512];
  snprintf(noexec, sizeof(noexec), "%s/not-executable", harness_dir());
  int fd = open(noexec, O_WRONLY | O_CREAT | O_TRUNC, 0644);
  REQUIRE(fd >= 0 && write(fd, "#!/bin/sh\n", 10) == 10 && close(fd) == 0, "cannot write %s",
          noexec);
  test_exec_failure("missing", "ps", "/nonexistent/ps-test-command", "No such file or directory");
  test_exec_failure("not-in-path", "allreduce", "ps-test-no-such-command",
                    "No such file or directory");
  test_exec_failure("noexec", "ps", noexec, "Permission denied");
  printf("commands that cannot run: exit 1 naming them\n");
  return 0;
}
