/* kill -9 of a shard in asp or ssp:2 (argv[1]), restarted by the test on its
 * address with its checkpoint directory, as a StatefulSet would: the job
 * completes, nothing is applied twice, and what the kill lost is exactly
 * what the shard counts as lost.
 *
 * The ledger of applied pushes: W=2 workers push STEPS steps of NT tensors
 * (one key each, two per shard); the push of rank r at step s is a one-hot
 * vector, W at element r*STEPS+s, so with SGD at lr 1 (divided by the W live
 * workers, no staleness scaling) each applied push moves that one element
 * by exactly -1. At the end every element of every key reads -1 (applied
 * once), 0 (lost: made after the checkpoint the shard came back from) or
 * anything else (applied twice, or wrong): the test requires no element
 * other than -1 and 0, no 0 on the shard that was not killed, and the
 * killed shard's zeros to equal its ps_server_lost_updates_total. */
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "clock.h"
#include "harness.h"
#include "ps.h"
#include "scrape.h"

#define S 2
#define W 2
#define STEPS 400
#define NT 4
#define N (W * STEPS)
static const char *const names[NT] = {"a", "b", "c", "d"};
static const uint64_t counts[NT] = {N, N, N, N};
static struct test_server servers[S];

static ps_client *connect_client(int rank) {
  const char *addrs[S] = {servers[0].addr, servers[1].addr};
  struct ps_client_opts o = {.servers = addrs,
                             .num_servers = S,
                             .rank = rank,
                             .world_size = W,
                             .job_id = "test_async_restore",
                             .reconnect_timeout_ms = 60000};
  ps_client *c;
  char err[256];
  REQUIRE(ps_client_new(&o, &c, err, sizeof(err)) == PS_OK, "rank %d connect: %s", rank, err);
  REQUIRE(ps_declare(c, NT, names, counts) == PS_OK, "declare");
  return c;
}

static int worker(void *arg) {
  int rank = (int)(intptr_t)arg;
  ps_client *c = connect_client(rank);
  static float p[N], g[N];
  if (rank == 0)
    for (int t = 0; t < NT; t++) REQUIRE(ps_init(c, t, p) == PS_OK, "init");
  for (uint64_t s = 0; s < STEPS; s++) {
    for (int t = 0; t < NT; t++) {
      uint64_t v;
      ps_status st = ps_pull(c, t, s, p, &v);
      REQUIRE(st == PS_OK && v >= s, "rank %d step %llu: pull %s, version %llu", rank,
              (unsigned long long)s, ps_strerror(st), (unsigned long long)v);
    }
    memset(g, 0, sizeof(g));
    g[rank * STEPS + s] = W;
    for (int t = 0; t < NT; t++)
      REQUIRE(ps_push(c, t, s, g) == PS_OK, "rank %d push %llu", rank, (unsigned long long)s);
    clock_sleep_ms(3);
  }
  REQUIRE(ps_barrier(c) == PS_OK, "barrier");
  ps_client_free(c);
  return 0;
}

/* Waits until the shard logging to file wrote a checkpoint. */
static void wait_checkpoint(const char *file) {
  for (int i = 0; i < 3000 && harness_grep(file, "msg=\"checkpoint written\"") == 0; i++)
    clock_sleep_ms(5);
  REQUIRE(harness_grep(file, "msg=\"checkpoint written\"") > 0, "no checkpoint in %s", file);
}

int main(int argc, char **argv) {
  REQUIRE(argc == 2 && (!strcmp(argv[1], "asp") || !strcmp(argv[1], "ssp:2")),
          "usage: test_async_restore asp|ssp:2");
  char ckdir[600], every[16];
  snprintf(ckdir, sizeof(ckdir), "%s/ckpt", harness_dir());
  snprintf(every, sizeof(every), "%d", 2 * W * 20); /* versions: about 20 steps of both */
  const char *extra[] = {"--consistency",
                         argv[1],
                         "--optimizer",
                         "sgd",
                         "--staleness-aware",
                         "false",
                         "--checkpoint-dir",
                         ckdir,
                         "--checkpoint-every",
                         every,
                         "--http",
                         "127.0.0.1:0",
                         NULL};
  for (int i = 0; i < S; i++) harness_start_server(&servers[i], i, S, W, 1.0, extra);
  pid_t pids[W];
  for (int r = 0; r < W; r++) pids[r] = harness_fork(worker, (void *)(intptr_t)r);

  /* mid-run, some steps after shard 0's first checkpoint */
  wait_checkpoint(servers[0].log);
  clock_sleep_ms(150);
  REQUIRE(kill(servers[0].pid, SIGKILL) == 0, "kill");
  int st = harness_wait(servers[0].pid, 10000);
  REQUIRE(st >= 0 && WIFSIGNALED(st), "shard 0 not killed: %d", st);
  char addr[64];
  snprintf(addr, sizeof(addr), "%s", servers[0].addr);
  const char *again[16];
  size_t na = 0;
  while (extra[na]) again[na] = extra[na], na++;
  again[na++] = "--listen";
  again[na++] = addr;
  again[na] = NULL;
  harness_start_server(&servers[0], 0, S, W, 1.0, again);
  REQUIRE(harness_grep(servers[0].log, "checkpoint loaded") == 1, "the restart loaded nothing");
  for (int r = 0; r < W; r++) {
    st = harness_wait(pids[r], 90000);
    REQUIRE(st >= 0 && WIFEXITED(st) && WEXITSTATUS(st) == 0, "worker %d failed (status %d)", r,
            st);
  }

  /* the ledger: which shard holds each tensor, and what each element says */
  ps_client *c = connect_client(0);
  double lost_counted[S];
  for (int i = 0; i < S; i++) {
    char http[64], body[1 << 16];
    REQUIRE(scrape_http_addr(servers[i].log, http, sizeof(http), 5000) == 0, "http address");
    REQUIRE(scrape_get(http, "/metrics", body, sizeof(body)) == 200, "GET /metrics");
    lost_counted[i] = scrape_value(body, "ps_server_lost_updates_total");
  }
  static float p[N];
  long zeros = 0, applied = 0, wrong = 0;
  for (int t = 0; t < NT; t++) {
    uint64_t v;
    REQUIRE(ps_pull(c, t, 0, p, &v) == PS_OK, "final pull");
    for (uint64_t i = 0; i < N; i++) {
      if (p[i] == -1.0f) {
        applied++;
      } else if (p[i] == 0.0f) {
        zeros++;
        if (getenv("DEBUG_LEDGER"))
          fprintf(stderr, "lost: tensor %s rank %llu step %llu\n", names[t],
                  (unsigned long long)(i / STEPS), (unsigned long long)(i % STEPS));
      } else if (wrong++ < 5) {
        fprintf(stderr, "tensor %s element %llu (rank %llu step %llu) = %g\n", names[t],
                (unsigned long long)i, (unsigned long long)(i / STEPS),
                (unsigned long long)(i % STEPS), (double)p[i]);
      }
    }
  }
  REQUIRE(wrong == 0, "%ld ledger elements are neither -1 (applied once) nor 0 (lost)", wrong);
  /* only the killed shard can lose: every zero is one of its lost updates */
  REQUIRE(zeros > 0, "the kill lost nothing: was shard 0 killed after its last push?");
  REQUIRE((double)zeros == lost_counted[0] && lost_counted[1] == 0,
          "lost: the ledger says %ld, shard 0 counted %g, shard 1 %g", zeros, lost_counted[0],
          lost_counted[1]);
  int said = harness_grep(servers[0].log, "updates lost since the checkpoint");
  REQUIRE(said >= 1 && said <= W,
          "the restarted shard said %d times that updates were lost "
          "(once per rank that lost some)",
          said);
  REQUIRE(ps_shutdown_servers(c) == PS_OK, "shutdown");
  ps_client_free(c);
  for (int i = 0; i < S; i++) {
    st = harness_wait(servers[i].pid, 20000);
    REQUIRE(st >= 0 && WIFEXITED(st) && WEXITSTATUS(st) == 0, "shard %d exit %d", i, st);
  }
  printf(
      "%s: kill -9 of shard 0 after its checkpoint, restarted: %ld pushes applied once, %ld "
      "lost (counted %g by the shard), 0 applied twice\n",
      argv[1], applied, zeros, lost_counted[0]);
  return 0;
}
