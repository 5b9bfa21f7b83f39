/* Consistency models with one deliberately slowed worker: W=3 worker
 * processes (rank 2 sleeps before every push) against S=2 real shards, one
 * run each of bsp, ssp:2 and asp.
 *
 * Each worker, before computing step c, pulls every tensor with min_version
 * = c (the BSP loop, unchanged in every mode) and measures how far ahead it
 * is: lead = c - (the lowest clock another worker has published). A worker
 * publishes clock s+1 in shared memory just before it pushes step s, so a
 * published clock is never behind what the shards know, and a shard that
 * lets a worker read early shows up as a lead above the bound.
 *  - bsp: no worker ever leads (lead <= 0).
 *  - ssp:2: no worker ever leads by more than 2, and the fast workers do
 *    reach 2 (the bound is what holds them, not lockstep).
 *  - asp: the fast workers finish all their steps while the slow one has
 *    done only a few; nothing holds them.
 * In every mode each push is applied exactly once: SGD with lr 1 and
 * gradient 3 moves every parameter by exactly 3 per round (BSP: the mean;
 * ASP/SSP: g / 3 per push), so the final value is -3 * STEPS, and the
 * shards report every rank at clock STEPS, no duplicates, and the
 * consistency model and optimizer they were started with. */
#include <stdatomic.h>
#include <stdint.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "clock.h"
#include "harness.h"
#include "ps.h"
#include "scrape.h"

#define S 2
#define W 3
#define STEPS 24
#define SLOW_RANK 2
#define SLOW_MS 25
#define NT 2
static const char *const names[NT] = {"a", "b"};
static const uint64_t counts[NT] = {1000, 3000}; /* 4 KiB chunks: 1 + 3 keys */

struct shared {
  _Atomic uint64_t published[W]; /* clock each worker published */
  _Atomic int64_t max_lead[W];
  _Atomic uint64_t slow_clock_at_done[W]; /* the slow worker's clock when r finished */
};
static struct shared *sh;
static struct test_server servers[S];

static ps_client *connect_client(int rank) {
  const char *addrs[S];
  for (int i = 0; i < S; i++) addrs[i] = servers[i].addr;
  struct ps_client_opts o = {.servers = addrs,
                             .num_servers = S,
                             .rank = rank,
                             .world_size = W,
                             .chunk_bytes = 4096,
                             .job_id = "test_consistency"};
  ps_client *c;
  char err[256];
  REQUIRE(ps_client_new(&o, &c, err, sizeof(err)) == PS_OK, "rank %d connect: %s", rank, err);
  REQUIRE(ps_declare(c, NT, names, counts) == PS_OK, "rank %d declare", rank);
  return c;
}

static int worker(void *arg) {
  int rank = (int)(intptr_t)arg;
  ps_client *c = connect_client(rank);
  float *p[NT], *g[NT];
  for (int t = 0; t < NT; t++) {
    p[t] = calloc(counts[t], sizeof(float));
    g[t] = malloc(counts[t] * sizeof(float));
    for (uint64_t i = 0; i < counts[t]; i++) g[t][i] = 3.0f;
    if (rank == 0) REQUIRE(ps_init(c, t, p[t]) == PS_OK, "init");
  }
  for (uint64_t s = 0; s < STEPS; s++) {
    ps_request *req[NT];
    for (int t = 0; t < NT; t++)
      REQUIRE(ps_pull_async(c, t, s, p[t], NULL, NULL, &req[t]) == PS_OK, "pull");
    for (int t = 0; t < NT; t++) {
      uint64_t v;
      REQUIRE(ps_wait(req[t], &v) == PS_OK, "rank %d pull at step %llu", rank,
              (unsigned long long)s);
      REQUIRE(v >= s, "rank %d got version %llu at step %llu", rank, (unsigned long long)v,
              (unsigned long long)s);
    }
    uint64_t slowest = UINT64_MAX;
    for (int q = 0; q < W; q++) {
      uint64_t pq = atomic_load(&sh->published[q]);
      if (q != rank && pq < slowest) slowest = pq;
    }
    int64_t lead = (int64_t)s - (int64_t)slowest;
    if (lead > atomic_load(&sh->max_lead[rank])) atomic_store(&sh->max_lead[rank], lead);
    if (rank == SLOW_RANK) clock_sleep_ms(SLOW_MS);
    atomic_store(&sh->published[rank], s + 1);
    for (int t = 0; t < NT; t++)
      REQUIRE(ps_push_async(c, t, s, g[t], NULL, NULL, &req[t]) == PS_OK, "push");
    for (int t = 0; t < NT; t++) REQUIRE(ps_wait(req[t], NULL) == PS_OK, "push wait");
  }
  atomic_store(&sh->slow_clock_at_done[rank], atomic_load(&sh->published[SLOW_RANK]));
  REQUIRE(ps_barrier(c) == PS_OK, "barrier");
  /* every push of every rank is in: each parameter moved by exactly 3 per round */
  for (int t = 0; t < NT; t++) {
    uint64_t v;
    REQUIRE(ps_pull(c, t, STEPS, p[t], &v) == PS_OK, "final pull");
    for (uint64_t i = 0; i < counts[t]; i++)
      REQUIRE(p[t][i] == -3.0f * STEPS, "rank %d %s[%llu] = %g, expected %g", rank, names[t],
              (unsigned long long)i, (double)p[t][i], -3.0 * STEPS);
    free(p[t]);
    free(g[t]);
  }
  ps_client_free(c);
  return 0;
}

/* Runs the job under one consistency model; returns the fast workers'
 * largest lead and the slow worker's clock when the first fast one ended. */
static void run(const char *mode, int64_t *fast_lead, int64_t *slow_lead, uint64_t *slow_at_done) {
  memset(sh, 0, sizeof(*sh));
  /* the exact arithmetic below is the sync model's: no staleness scaling */
  const char *extra[] = {"--consistency",     mode,    "--optimizer", "sgd",
                         "--staleness-aware", "false", NULL};
  for (int i = 0; i < S; i++) harness_start_server(&servers[i], i, S, W, 1.0, extra);
  pid_t pids[W];
  for (int r = 0; r < W; r++) pids[r] = harness_fork(worker, (void *)(intptr_t)r);
  for (int r = 0; r < W; r++) {
    int st = harness_wait(pids[r], 60000);
    REQUIRE(st >= 0 && WIFEXITED(st) && WEXITSTATUS(st) == 0, "%s: worker %d failed (status %d)",
            mode, r, st);
  }
  ps_client *c = connect_client(0);
  uint64_t updates[S];
  for (int i = 0; i < S; i++) {
    struct ps_shard_stats st;
    uint64_t clocks[W];
    REQUIRE(ps_stats(c, i, &st) == PS_OK && ps_worker_clocks(c, i, clocks, W) == PS_OK, "stats");
    for (int r = 0; r < W; r++)
      REQUIRE(clocks[r] == STEPS, "%s: shard %d has rank %d at clock %llu", mode, i, r,
              (unsigned long long)clocks[r]);
    REQUIRE(st.duplicates == 0 && st.live_workers == W, "%s: %llu duplicates, %u live", mode,
            (unsigned long long)st.duplicates, st.live_workers);
    REQUIRE(strcmp(st.consistency, mode) == 0 && strcmp(st.optimizer, "sgd") == 0,
            "%s: shard %d says it runs consistency \"%s\" and optimizer \"%s\" (started with "
            "--consistency %s --optimizer sgd)",
            mode, i, st.consistency, st.optimizer, mode);
    uint64_t per_key = strcmp(mode, "bsp") == 0 ? STEPS : (uint64_t)STEPS * W;
    REQUIRE(st.updates == per_key * st.num_keys && st.min_version == per_key,
            "%s: shard %d made %llu updates over %u keys (min version %llu)", mode, i,
            (unsigned long long)st.updates, st.num_keys, (unsigned long long)st.min_version);
    updates[i] = st.updates;
  }
  /* every asp/ssp push said the version it was computed on: the staleness
   * histogram counts each applied push once; bsp counts none */
  for (int i = 0; i < S; i++) {
    char http[64], body[1 << 16];
    REQUIRE(scrape_http_addr(servers[i].log, http, sizeof(http), 5000) == 0, "http address");
    REQUIRE(scrape_get(http, "/metrics", body, sizeof(body)) == 200, "GET /metrics");
    double n = scrape_value(body, "ps_server_push_staleness_count");
    double inf = scrape_value(body, "ps_server_push_staleness_bucket{le=\"+Inf\"}");
    double nobase = scrape_value(body, "ps_server_pushes_without_base_total");
    double want = strcmp(mode, "bsp") == 0 ? 0 : (double)updates[i]; /* one per push */
    REQUIRE(n == want && inf == want && nobase == 0,
            "%s: shard %d counted %g pushes' staleness (+Inf bucket %g), %g without a base; want "
            "%g, %g, 0",
            mode, i, n, inf, nobase, want, want);
  }
  REQUIRE(ps_shutdown_servers(c) == PS_OK, "shutdown");
  ps_client_free(c);
  for (int i = 0; i < S; i++) {
    int st = harness_wait(servers[i].pid, 10000);
    REQUIRE(st >= 0 && WIFEXITED(st) && WEXITSTATUS(st) == 0, "shard %d exit", i);
  }
  *fast_lead = atomic_load(&sh->max_lead[0]) > atomic_load(&sh->max_lead[1])
                   ? atomic_load(&sh->max_lead[0])
                   : atomic_load(&sh->max_lead[1]);
  *slow_lead = atomic_load(&sh->max_lead[SLOW_RANK]);
  uint64_t a = atomic_load(&sh->slow_clock_at_done[0]), b = atomic_load(&sh->slow_clock_at_done[1]);
  *slow_at_done = a < b ? a : b;
  printf(
      "%-6s fast workers led the slow one by at most %lld clocks; when the first fast one "
      "finished %d steps the slow one had pushed %llu\n",
      mode, (long long)*fast_lead, STEPS, (unsigned long long)*slow_at_done);
}

int main(void) {
  sh = mmap(NULL, sizeof(*sh), PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  REQUIRE(sh != MAP_FAILED, "mmap");
  int64_t fast, slow;
  uint64_t at_done;

  run("bsp", &fast, &slow, &at_done);
  REQUIRE(fast <= 0 && slow <= 0, "bsp: a worker read %lld clocks ahead", (long long)fast);

  run("ssp:2", &fast, &slow, &at_done);
  REQUIRE(fast <= 2 && slow <= 2, "ssp:2: a worker read %lld clocks ahead of the slowest",
          (long long)fast);
  REQUIRE(fast == 2, "ssp:2: the fast workers never used their slack (lead %lld)", (long long)fast);
  REQUIRE(at_done >= STEPS - 3, "ssp:2: a fast worker finished with the slow one at clock %llu",
          (unsigned long long)at_done);

  run("asp", &fast, &slow, &at_done);
  REQUIRE(at_done <= STEPS / 2,
          "asp: the fast workers were held back (the slow one had pushed %llu of %d steps)",
          (unsigned long long)at_done, STEPS);
  REQUIRE(fast >= STEPS / 2, "asp: the fast workers led by only %lld clocks", (long long)fast);
  return 0;
}
