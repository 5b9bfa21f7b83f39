/* ps-local -- CMD with real shards: a rank left behind once training is
 * over. Rank 0 (this program, through libps) tells the shards that training
 * is over, as ps.shutdown() does, and exits 0; rank 1 never finishes (it
 * waits, as a hung script would). The shards exit by themselves; ps-local
 * must not wait on rank 1 for ever: it names it and its pid, kills it, and
 * exits 129 (a lost rank: retryable) within a bound, leaving nothing
 * running and no temp dir.
 *
 * The same binary is both the test and the command: `test_launch_lost
 * rank` runs as one worker of ps-local (its settings in the environment). */
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
#include "ps.h"

enum { MAX_SHARDS = 8, RANK_WAIT_MS = 20000, RANK1_MAX_S = 120 };

/* The pid file of rank r in the run's $OUTDIR. */
static void pid_path(const char *outdir, int r, char *buf, size_t len) {
  snprintf(buf, len, "%s/pid%d", outdir, r);
}

/* Rank 0: tells every shard of PS_SERVERS that training is over, as rank 0's
 * ps.shutdown() does. Returns 0, or 1 after saying why. */
static int shut_down_shards(void) {
  const char *list = getenv("PS_SERVERS"), *token_path = getenv("PS_AUTH_TOKEN_FILE");
  if (!list) {
    fprintf(stderr, "rank 0: no PS_SERVERS\n");
    return 1;
  }
  char copy[1024], err[512], *save = NULL;
  const char *servers[MAX_SHARDS];
  int n = 0;
  snprintf(copy, sizeof(copy), "%s", list);
  for (char *s = strtok_r(copy, ",", &save); s && n < MAX_SHARDS; s = strtok_r(NULL, ",", &save))
    servers[n++] = s;
  ps_token *token = NULL;
  if (token_path && ps_token_load(token_path, &token, err, sizeof(err)) != PS_OK) {
    fprintf(stderr, "rank 0: %s\n", err);
    return 1;
  }
  struct ps_client_opts opts = {.servers = servers,
                                .num_servers = n,
                                .rank = 0,
                                .world_size = atoi(getenv("PS_WORLD_SIZE")),
                                .auth_token = token};
  ps_client *c = NULL;
  ps_status st = ps_client_new(&opts, &c, err, sizeof(err));
  if (st == PS_OK) st = ps_shutdown_servers(c);
  if (st != PS_OK && c) ps_errmsg(c, err, sizeof(err));
  ps_client_free(c);
  ps_token_free(token);
  if (st != PS_OK) fprintf(stderr, "rank 0: shutting the shards down: %s\n", err);
  return st == PS_OK ? 0 : 1;
}

/* One worker of ps-local. Rank 1 writes its pid, then waits (RANK1_MAX_S
 * at most, should ps-local never kill it). Rank 0 waits for that pid file,
 * then ends the training. */
static int run_rank(void) {
  const char *outdir = getenv("OUTDIR"), *rank = getenv("PS_RANK");
  if (!outdir || !rank) {
    fprintf(stderr, "rank: no OUTDIR or PS_RANK\n");
    return 1;
  }
  char path[600], tmp[640];
  if (strcmp(rank, "0") != 0) {
    pid_path(outdir, atoi(rank), path, sizeof(path));
    snprintf(tmp, sizeof(tmp), "%s.tmp", path);
    FILE *f = fopen(tmp, "w");
    if (!f || fprintf(f, "%d\n", (int)getpid()) < 0 || fclose(f) != 0 || rename(tmp, path) != 0) {
      perror(tmp);
      return 1;
    }
    for (int i = 0; i < RANK1_MAX_S; i++) sleep(1);
    fprintf(stderr, "rank %s: still running after %d s\n", rank, RANK1_MAX_S);
    return 9;
  }
  pid_path(outdir, 1, path, sizeof(path));
  for (int waited = 0; access(path, F_OK) != 0; waited += 10) {
    if (waited >= RANK_WAIT_MS) {
      fprintf(stderr, "rank 0: no %s after %d ms\n", path, RANK_WAIT_MS);
      return 1;
    }
    clock_sleep_ms(10);
  }
  return shut_down_shards();
}

int main(int argc, char **argv) {
  if (argc == 2 && strcmp(argv[1], "rank") == 0) return run_rank();
  REQUIRE(prctl(PR_SET_CHILD_SUBREAPER, 1) == 0, "PR_SET_CHILD_SUBREAPER");
  char self[512], outdir[512], path[600];
  ssize_t len = readlink("/proc/self/exe", self, sizeof(self) - 1);
  REQUIRE(len > 0, "readlink /proc/self/exe");
  self[len] = '\0';
  snprintf(outdir, sizeof(outdir), "%s/left-behind.cmd", harness_dir());
  REQUIRE(mkdir(outdir, 0755) == 0, "mkdir %s", outdir);
  setenv("OUTDIR", outdir, 1);

  struct launcher_run r;
  uint64_t t0 = clock_now_ms();
  pid_t pid =
      launcher_start(&r, "left-behind",
                     (const char *[]){"--shards", "2", "--workers", "2", "--", self, "rank", NULL});
  /* 30 s after the shards exited (a command's bound), plus start-up. */
  int st = harness_wait(pid, 90000);
  uint64_t took = clock_now_ms() - t0;
  if (st < 0 || launcher_exit_code(st) != 129) launcher_show(r.err);
  REQUIRE(st >= 0, "ps-local did not exit within 90 s of its start");
  REQUIRE(launcher_exit_code(st) == 129, "a rank left behind: exit %d, want 129",
          launcher_exit_code(st));

  pid_path(outdir, 1, path, sizeof(path));
  FILE *f = fopen(path, "r");
  REQUIRE(f, "rank 1 wrote no pid file %s", path);
  int rank1 = 0;
  REQUIRE(fscanf(f, "%d", &rank1) == 1 && rank1 > 0, "%s holds no pid", path);
  fclose(f);
  char says[300];
  snprintf(says, sizeof(says),
           "worker rank 1 (pid %d) still ran 30 s after the shards had exited (training was "
           "over): killed it; the job did not complete",
           rank1);
  if (harness_grep(r.err, says) != 1) launcher_show(r.err);
  REQUIRE(harness_grep(r.err, says) == 1, "stderr does not say \"%s\" once", says);
  REQUIRE(harness_grep(r.err, "failed") == 0, "a child failed: rank 0 or a shard");
  REQUIRE(kill(rank1, 0) != 0 && errno == ESRCH, "rank 1 (pid %d) still runs", rank1);
  REQUIRE(launcher_leftovers(r.tmpdir) == 0, "processes left running");
  REQUIRE(launcher_dir_entries(r.tmpdir) == 0, "ps-local did not remove its temp dir");
  printf("a rank left behind after the shards exited: killed, exit 129 after %llu ms\n",
         (unsigned long long)took);
  return 0;
}
