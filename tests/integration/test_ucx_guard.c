/* A UCX shard's listener against peers that do not speak UCX (issue 30):
 * 4 KiB of random bytes, a flood of garbage connections and silent ones
 * to the --listen port leave the shard's CPU time, fds and sockets where
 * they were (UCX 1.13 spun a core forever and leaked the socket in
 * CLOSE-WAIT), are counted in ps_rejected_frames_total and logged once per
 * address; a shard on 127.0.0.1:0 listens on 127.0.0.1 only (UCX's tcp
 * interfaces listened on eth0 too); bad UCX_TLS and PS_UCX_* settings are
 * named with their fix and exit 2, from ps-server and ps-worker alike. */
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>
#include <arpa/inet.h>
#include <netinet/in.h>

#include "harness.h"

static int count_fds(pid_t pid) {
  char path[64];
  snprintf(path, sizeof(path), "/proc/%d/fd", (int)pid);
  DIR *d = opendir(path);
  int n = 0;
  if (!d) return -1;
  for (struct dirent *e; (e = readdir(d));)
    if (e->d_name[0] != '.') n++;
  closedir(d);
  return n;
}

/* utime + stime of pid, in clock ticks. */
static long cpu_ticks(pid_t pid) {
  char path[64], buf[1024];
  snprintf(path, sizeof(path), "/proc/%d/stat", (int)pid);
  FILE *f = fopen(path, "r");
  if (!f) return -1;
  size_t n = fread(buf, 1, sizeof(buf) - 1, f);
  fclose(f);
  buf[n] = 0;
  char *p = strrchr(buf, ')');
  long ut = 0, st = 0;
  if (!p || sscanf(p + 2, "%*c %*d %*d %*d %*d %*d %*u %*u %*u %*u %*u %ld %ld", &ut, &st) != 2)
    return -1;
  return ut + st;
}

/* Socket inodes of pid. */
static bool pid_has_inode(pid_t pid, unsigned long ino) {
  char path[64], link[64], want[64];
  snprintf(path, sizeof(path), "/proc/%d/fd", (int)pid);
  snprintf(want, sizeof(want), "socket:[%lu]", ino);
  DIR *d = opendir(path);
  bool found = false;
  if (!d) return false;
  for (struct dirent *e; !found && (e = readdir(d));) {
    char p[400];
    snprintf(p, sizeof(p), "%s/%s", path, e->d_name);
    ssize_t n = readlink(p, link, sizeof(link) - 1);
    if (n > 0) {
      link[n] = 0;
      found = !strcmp(link, want);
    }
  }
  closedir(d);
  return found;
}

/* Counts pid's TCP sockets in /proc/net/tcp (and tcp6) with state st
 * ("0A" listen, "08" close-wait); with not_lo, only those whose local
 * address is not 127.0.0.1. */
static int count_tcp(pid_t pid, const char *st, bool not_lo, char *what, size_t whatlen) {
  int n = 0;
  const char *files[] = {"/proc/net/tcp", "/proc/net/tcp6"};
  for (int i = 0; i < 2; i++) {
    FILE *f = fopen(files[i], "r");
    char line[512];
    if (!f) continue;
    while (fgets(line, sizeof(line), f)) {
      char local[64], state[8];
      unsigned long ino = 0;
      if (sscanf(line, " %*d: %63s %*s %7s %*s %*s %*s %*s %*s %lu", local, state, &ino) != 3)
        continue;
      if (strcmp(state, st) || !ino || !pid_has_inode(pid, ino)) continue;
      if (not_lo && !strncmp(local, "0100007F:", 9)) continue;
      n++;
      snprintf(what, whatlen, "%s", local);
    }
    fclose(f);
  }
  return n;
}

static int connect_to(int port) {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port)};
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  REQUIRE(fd >= 0 && connect(fd, (struct sockaddr *)&a, sizeof(a)) == 0, "connect: %s",
          strerror(errno));
  return fd;
}

static void garbage(int fd, size_t n, unsigned *seed) {
  char buf[4096];
  for (size_t i = 0; i < sizeof(buf); i++) buf[i] = (char)rand_r(seed);
  (void)!write(fd, buf, n < sizeof(buf) ? n : sizeof(buf));
}

static void sleep_ms(int ms) {
  struct timespec ts = {ms / 1000, (ms % 1000) * 1000000L};
  nanosleep(&ts, NULL);
}

/* Waits up to 20 s for pid's fds to be back at want and no CLOSE-WAIT. */
static void wait_settled(pid_t pid, int want, const char *after) {
  char what[64] = "";
  int fds = -1, cw = -1;
  for (int i = 0; i < 200; i++) {
    fds = count_fds(pid);
    cw = count_tcp(pid, "08", false, what, sizeof(what));
    if (fds <= want && cw == 0) return;
    sleep_ms(100);
  }
  REQUIRE(false, "after %s: %d fds (%d at start), %d sockets in CLOSE-WAIT", after, fds, want, cw);
}

/* CPU time over 2 s once settled: an idle shard uses little; UCX's spin
 * used all 200 ticks. Upper bound only. */
static void require_idle(pid_t pid, const char *after) {
  long t0 = cpu_ticks(pid);
  sleep_ms(2000);
  long used = cpu_ticks(pid) - t0;
  long hz = sysconf(_SC_CLK_TCK);
  REQUIRE(used < hz / 2, "after %s the shard used %ld ticks of CPU in 2 s (spinning)", after, used);
}

/* Runs ps-server with env name=value set; returns its exit status, its
 * stderr in log. */
static int server_with_env(const char *name, const char *value, const char *log) {
  char bin[512];
  harness_bin("ps-server/ps-server", bin, sizeof(bin));
  const char *argv[] = {bin,      "--transport",   "ucx",     "--listen", "127.0.0.1:0",
                        "--http", "127.0.0.1:0",   "--shard", "0",        "--num-shards",
                        "1",      "--num-workers", "1",       NULL};
  setenv(name, value, 1);
  pid_t pid = harness_spawn(argv, NULL, log);
  unsetenv(name);
  int st = harness_wait(pid, 30000);
  if (st == -1) {
    harness_stop(pid, SIGKILL, 5000);
    return -1;
  }
  return WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
}

/* Runs ps-worker (ps mode, --transport ucx, a shard nobody listens on) with
 * env name=value set; returns its exit status, its stderr in log. */
static int worker_with_env(const char *name, const char *value, const char *log) {
  char bin[512];
  harness_bin("ps-worker/ps-worker", bin, sizeof(bin));
  const char *argv[] = {
      bin,      "--transport", "ucx",          "--servers", "127.0.0.1:1",
      "--rank", "0",           "--world-size", "1",         "--connect-timeout-ms",
      "2000",   NULL};
  setenv(name, value, 1);
  pid_t pid = harness_spawn(argv, NULL, log);
  unsetenv(name);
  int st = harness_wait(pid, 30000);
  if (st == -1) {
    harness_stop(pid, SIGKILL, 5000);
    return -1;
  }
  return WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
}

/* Every bad UCX setting is a bad setting: exit 2 naming it (docs/ARCHITECTURE.md, Options),
 * from ps-server and from ps-worker in ps mode alike. */
static void check_settings(void) {
  static const struct {
    const char *name, *value, *says;
  } bad[] = {
      {"UCX_TLS", "bogus", "add tcp"},                   /* no connecting transport */
      {"UCX_TLS", "sm,self", "add tcp"},                 /* the same */
      {"UCX_TLS", "tcpx", "names no transport UCX has"}, /* UCX's ucp_init: No such device */
      {"UCX_RNDV_THRESH", "abc", "UCX cannot parse"},
      {"PS_UCX_POLL_US", "2000000", "digits only"},
      {"PS_UCX_RNDV_BYTES", " -5", "digits only"},
      {"PS_UCX_RNDV_BYTES", "-5", "digits only"},
      {"PS_UCX_RNDV_BYTES", "+5", "digits only"},
      {"PS_UCX_RNDV_BYTES", " 5", "digits only"},
      {"PS_UCX_RNDV_BYTES", "5 ", "digits only"},
      {"PS_UCX_RNDV_BYTES", "99999999999999999999999", "digits only"},
  };
  char log[512];
  for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
    const char *named =
        strncmp(bad[i].name, "PS_UCX", 6) && strcmp(bad[i].name, "UCX_TLS") ? "UCX_*" : bad[i].name;
    snprintf(log, sizeof(log), "%s/server_%zu.log", harness_dir(), i);
    int r = server_with_env(bad[i].name, bad[i].value, log);
    REQUIRE(r == 2 && harness_grep(log, named) && harness_grep(log, bad[i].says),
            "ps-server with %s=\"%s\": exit %d (want 2 and an error naming it, \"%s\")",
            bad[i].name, bad[i].value, r, bad[i].says);
    if (i % 3) continue; /* the worker: one of each kind is enough */
    snprintf(log, sizeof(log), "%s/worker_%zu.log", harness_dir(), i);
    r = worker_with_env(bad[i].name, bad[i].value, log);
    REQUIRE(r == 2 && harness_grep(log, named) && harness_grep(log, bad[i].says),
            "ps-worker with %s=\"%s\": exit %d (want 2 and an error naming it, \"%s\")",
            bad[i].name, bad[i].value, r, bad[i].says);
  }
}

int main(void) {
  check_settings();
  struct test_server s;
  const char *extra[] = {"--transport", "ucx", NULL};
  harness_start_server(&s, 0, 1, 1, 0.1, extra);
  int port = atoi(strrchr(s.addr, ':') + 1);
  sleep_ms(500);
  char what[64] = "";
  int outside = count_tcp(s.pid, "0A", true, what, sizeof(what));
  REQUIRE(outside == 0, "a UCX shard on 127.0.0.1:0 listens on %d other addresses (e.g. %s)",
          outside, what);
  int fds0 = count_fds(s.pid);

  /* one connection: 4 KiB of random bytes, then closed */
  unsigned seed = 30;
  int fd = connect_to(port);
  garbage(fd, 4096, &seed);
  close(fd);
  wait_settled(s.pid, fds0, "4 KiB of random bytes");
  require_idle(s.pid, "4 KiB of random bytes");
  REQUIRE(harness_grep(s.log, "ucx listener refused a peer"), "the refusal is not logged");

  /* a flood: 200 connections of garbage of random sizes, 20 left open */
  int held[20];
  for (int i = 0; i < 200; i++) {
    fd = connect_to(port);
    garbage(fd, 16 + (size_t)rand_r(&seed) % 4096, &seed);
    if (i % 10 == 0)
      held[i / 10] = fd;
    else
      close(fd);
  }
  sleep_ms(1000);
  for (int i = 0; i < 20; i++) close(held[i]);
  wait_settled(s.pid, fds0, "a flood of 200 garbage connections");
  require_idle(s.pid, "a flood of 200 garbage connections");

  /* once per address and minute: the flood from 127.0.0.1 logged once */
  FILE *f = fopen(s.log, "r");
  char line[1024];
  int logged = 0;
  while (f && fgets(line, sizeof(line), f)) logged += strstr(line, "refused a peer") != NULL;
  if (f) fclose(f);
  REQUIRE(logged == 1, "the refusals were logged %d times (once per address and window)", logged);
  REQUIRE(harness_stop(s.pid, SIGTERM, 20000) != -1, "the shard did not stop on SIGTERM");
  printf("ok: UCX listener refused garbage without spinning; fds back at %d\n", fds0);
  return 0;
}
