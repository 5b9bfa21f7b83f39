/* Checkpoints of the real ps-server that belong to a job, and storage faults
 * that stop it. One shard, two workers (two libps clients in this process),
 * two keys a and b, SGD, --checkpoint-every 1.
 *
 * jobs: job "old" trains 6 steps into DIR (a nested path that does not exist
 * yet: created); its files are kept aside byte for byte. Job "new" starts on
 * the same DIR: it logs one warning naming the old job's files, loads
 * nothing, trains 3 steps, and stops; its own two newest checkpoints (clocks
 * 2 and 3) are there, the old job's (higher clocks) are untouched. Restarted
 * as "new", the shard loads its own clock 3, not the old job's 6.
 *
 * write-fail: after two good steps DIR is replaced by a file (works as
 * root, unlike chmod). Each step's checkpoint fails (ENOTDIR); after two,
 * /metrics counts them; the third stops the job: rank 0's pull waiting on
 * key a gets the error naming the directory, and the shard exits 3. */
#include <dirent.h>
#include <signal.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "harness.h"
#include "ps.h"
#include "scrape.h"

#define N 4

static ps_client *client(const char *addr, int rank) {
  const char *addrs[1] = {addr};
  struct ps_client_opts o = {.servers = addrs,
                             .num_servers = 1,
                             .rank = rank,
                             .world_size = 2,
                             .reconnect_timeout_ms = 2000};
  ps_client *c;
  char err[256];
  REQUIRE(ps_client_new(&o, &c, err, sizeof(err)) == PS_OK, "rank %d: %s", rank, err);
  const char *names[] = {"a", "b"};
  uint64_t counts[] = {N, N};
  REQUIRE(ps_declare(c, 2, names, counts) == PS_OK, "declare");
  return c;
}

static float g[N] = {1, 1, 1, 1}, out[N];

/* BSP step s on both keys by both ranks, then both pull both keys at s+1. */
static void step(ps_client *c0, ps_client *c1, uint64_t s) {
  for (int k = 0; k < 2; k++) {
    REQUIRE(ps_push(c0, k, s, g) == PS_OK, "rank 0 push key %d step %llu", k,
            (unsigned long long)s);
    REQUIRE(ps_push(c1, k, s, g) == PS_OK, "rank 1 push key %d step %llu", k,
            (unsigned long long)s);
  }
  for (int k = 0; k < 2; k++) {
    REQUIRE(ps_pull(c0, k, s + 1, out, NULL) == PS_OK, "rank 0 pull");
    REQUIRE(ps_pull(c1, k, s + 1, out, NULL) == PS_OK, "rank 1 pull");
  }
}

/* Waits (bounded) until the shard logged its checkpoint of clock as
 * written: a step's checkpoint taken while the previous one is still being
 * written would be skipped. */
static void wait_written(const struct test_server *srv, uint64_t clock) {
  char needle[64];
  snprintf(needle, sizeof(needle), " clock=%llu bytes=", (unsigned long long)clock);
  for (int i = 0; i < 2000 && harness_grep(srv->log, needle) == 0; i++) usleep(10000);
  REQUIRE(harness_grep(srv->log, needle) >= 1, "checkpoint of clock %llu not written",
          (unsigned long long)clock);
}

static void start(struct test_server *srv, const char *dir, const char *job) {
  const char *extra[] = {"--checkpoint-dir", dir, "--checkpoint-every", "1", "--job-id", job, NULL};
  harness_start_server(srv, 0, 1, 2, 1.0, extra);
}

static void stop_job(struct test_server *srv, ps_client *c0, ps_client *c1) {
  REQUIRE(ps_shutdown_servers(c0) == PS_OK, "shutdown");
  ps_client_free(c0);
  ps_client_free(c1);
  int st = harness_wait(srv->pid, 30000);
  REQUIRE(st >= 0 && WIFEXITED(st) && WEXITSTATUS(st) == 0, "shard exit status %d", st);
}

struct file {
  char name[256];
  char *bytes;
  size_t n;
};

/* The checkpoint files in dir (at most max), with their contents. */
static int list(const char *dir, struct file *f, int max) {
  DIR *d = opendir(dir);
  REQUIRE(d, "opendir %s", dir);
  int n = 0;
  struct dirent *e;
  while ((e = readdir(d)) && n < max) {
    if (strncmp(e->d_name, "shard-", 6) != 0) continue;
    snprintf(f[n].name, sizeof(f[n].name), "%s", e->d_name);
    char p[1200];
    snprintf(p, sizeof(p), "%s/%s", dir, e->d_name);
    FILE *fp = fopen(p, "rb");
    REQUIRE(fp, "open %s", p);
    fseek(fp, 0, SEEK_END);
    f[n].n = (size_t)ftell(fp);
    fseek(fp, 0, SEEK_SET);
    f[n].bytes = malloc(f[n].n + 1);
    REQUIRE(fread(f[n].bytes, 1, f[n].n, fp) == f[n].n, "read %s", p);
    fclose(fp);
    n++;
  }
  closedir(d);
  return n;
}

static unsigned long long clock_of(const char *name) {
  return strtoull(name + strlen("shard-0000-v"), NULL, 10);
}

static int jobs(void) {
  char dir[600];
  snprintf(dir, sizeof(dir), "%s/pvc/ckpt", harness_dir());
  struct test_server srv;
  start(&srv, dir, "old");
  ps_client *c0 = client(srv.addr, 0), *c1 = client(srv.addr, 1);
  float zero[N] = {0};
  REQUIRE(ps_init(c0, 0, zero) == PS_OK && ps_init(c0, 1, zero) == PS_OK, "init");
  wait_written(&srv, 0);
  for (uint64_t s = 0; s < 6; s++) {
    step(c0, c1, s);
    wait_written(&srv, s + 1);
  }
  stop_job(&srv, c0, c1);
  struct file old[16];
  int nold = list(dir, old, 16);
  REQUIRE(nold == 2 && clock_of(old[0].name) >= 5 && clock_of(old[1].name) >= 5,
          "job old left %d files (%s)", nold, nold ? old[0].name : "");

  start(&srv, dir, "new");
  REQUIRE(harness_grep(srv.log, "checkpoints of another job") == 1 &&
              harness_grep(srv.log, "job \"old\"") == 1,
          "no single warning naming the old job's files");
  REQUIRE(harness_grep(srv.log, old[0].name) == 1 && harness_grep(srv.log, old[1].name) == 1,
          "the warning does not name the files");
  REQUIRE(harness_grep(srv.log, "checkpoint loaded") == 0, "job new loaded job old's checkpoint");
  c0 = client(srv.addr, 0);
  c1 = client(srv.addr, 1);
  REQUIRE(ps_init(c0, 0, zero) == PS_OK && ps_init(c0, 1, zero) == PS_OK, "init");
  wait_written(&srv, 0);
  for (uint64_t s = 0; s < 3; s++) {
    step(c0, c1, s);
    wait_written(&srv, s + 1);
  }
  stop_job(&srv, c0, c1);

  struct file now[16];
  int nnow = list(dir, now, 16);
  int old_seen = 0, mine = 0;
  unsigned long long clocks = 0;
  for (int i = 0; i < nnow; i++) {
    int j = 0;
    while (j < nold && strcmp(now[i].name, old[j].name) != 0) j++;
    if (j < nold) {
      REQUIRE(now[i].n == old[j].n && memcmp(now[i].bytes, old[j].bytes, old[j].n) == 0,
              "job old's %s was changed", old[j].name);
      old_seen++;
    } else {
      mine++;
      clocks += clock_of(now[i].name);
    }
  }
  REQUIRE(old_seen == nold, "job old's files deleted: %d of %d left", old_seen, nold);
  REQUIRE(mine == 2 && clocks == 2 + 3, "job new kept %d files, clocks summing to %llu (want 2, 3)",
          mine, clocks);

  start(&srv, dir, "new");
  REQUIRE(harness_grep(srv.log, "checkpoint loaded") == 1 &&
              harness_grep(srv.log, "job=\"new\" clock=3 ") == 1,
          "restart of job new did not load its clock 3");
  REQUIRE(harness_stop(srv.pid, SIGKILL, 10000) >= 0, "kill");
  for (int i = 0; i < nold; i++) free(old[i].bytes);
  for (int i = 0; i < nnow; i++) free(now[i].bytes);
  printf("jobs: old job's %d files untouched and not loaded, new job's clocks 2 and 3 kept\n",
         nold);
  return 0;
}

static double metric(const char *http, const char *series) {
  static char body[1 << 17];
  REQUIRE(scrape_get(http, "/metrics", body, sizeof(body)) == 200, "GET /metrics");
  return scrape_value(body, series);
}

static int write_fail(void) {
  char dir[600], moved[700];
  snprintf(dir, sizeof(dir), "%s/ckpt", harness_dir());
  snprintf(moved, sizeof(moved), "%s.moved", dir);
  struct test_server srv;
  start(&srv, dir, "wf");
  char http[64];
  REQUIRE(scrape_http_addr(srv.log, http, sizeof(http), 10000) == 0, "no http address");
  ps_client *c0 = client(srv.addr, 0), *c1 = client(srv.addr, 1);
  float zero[N] = {0};
  REQUIRE(ps_init(c0, 0, zero) == PS_OK && ps_init(c0, 1, zero) == PS_OK, "init");
  wait_written(&srv, 0);
  step(c0, c1, 0);
  wait_written(&srv, 1);
  step(c0, c1, 1);
  wait_written(&srv, 2);
  /* the volume goes away: the directory becomes a file */
  REQUIRE(rename(dir, moved) == 0, "rename");
  FILE *f = fopen(dir, "w");
  REQUIRE(f && fclose(f) == 0, "file in place of the directory");
  for (uint64_t s = 2; s < 4; s++) {
    step(c0, c1, s);
    int want = (int)(s - 1);
    for (int i = 0; i < 1000 && harness_grep(srv.log, "checkpoint failed") < want; i++)
      usleep(10000);
    REQUIRE(harness_grep(srv.log, "checkpoint failed") == want, "failures: want %d", want);
  }
  REQUIRE(harness_grep(srv.log, "errno=ENOTDIR") == 2, "the failures do not name the errno");
  double failures = -1;
  for (int i = 0; i < 500 && failures != 2; i++, usleep(10000))
    failures = metric(http, "ps_server_checkpoint_failures_total");
  REQUIRE(failures == 2, "ps_server_checkpoint_failures_total %g, want 2", failures);
  REQUIRE(metric(http, "ps_server_checkpoint_failures_in_a_row") == 2, "in a row");
  REQUIRE(metric(http, "ps_server_last_checkpoint_timestamp_seconds") > 1e9, "timestamp");
  REQUIRE(harness_grep(srv.log, "stopping the job") == 0, "stopped after 2 failures");

  /* step 4: key a completes; rank 0 goes on to a's step 5 and waits for
   * rank 1's; b completing step 4 makes the third failing checkpoint */
  REQUIRE(ps_push(c0, 0, 4, g) == PS_OK && ps_push(c1, 0, 4, g) == PS_OK, "push a");
  REQUIRE(ps_pull(c0, 0, 5, out, NULL) == PS_OK, "pull a");
  REQUIRE(ps_push(c0, 0, 5, g) == PS_OK, "rank 0 push a step 5");
  ps_request *waiting;
  REQUIRE(ps_pull_async(c0, 0, 6, out, NULL, NULL, &waiting) == PS_OK, "pull a at 6");
  REQUIRE(ps_push(c0, 1, 4, g) == PS_OK && ps_push(c1, 1, 4, g) == PS_OK, "push b");
  int st = harness_wait(srv.pid, 30000);
  REQUIRE(st >= 0 && WIFEXITED(st) && WEXITSTATUS(st) == 3,
          "shard did not stop with exit 3 after 3 failed checkpoints (status %d)", st);
  ps_status ws = ps_wait(waiting, NULL);
  char msg[600];
  ps_errmsg(c0, msg, sizeof(msg));
  REQUIRE(ws == PS_ERR_REMOTE && strstr(msg, "cannot write checkpoints to") && strstr(msg, dir) &&
              strstr(msg, "ENOTDIR"),
          "rank 0's waiting pull: status %d (%s), message \"%s\"", ws, ps_strerror(ws), msg);
  REQUIRE(harness_grep(srv.log, "checkpoints cannot be written: stopping the job") == 1,
          "no error line");
  REQUIRE(harness_grep(srv.log, "final checkpoint") == 0, "a final checkpoint was attempted");
  ps_client_free(c0);
  ps_client_free(c1);
  unlink(dir);
  printf("write-fail: 3 failures in a row (ENOTDIR) stopped the shard (exit 3), rank 0 told: %s\n",
         msg);
  return 0;
}

int main(int argc, char **argv) {
  if (argc > 1 && strcmp(argv[1], "jobs") == 0) return jobs();
  if (argc > 1 && strcmp(argv[1], "write-fail") == 0) return write_fail();
  fprintf(stderr, "usage: test_ckpt_jobs jobs|write-fail\n");
  return 2;
}
