/* BSP arithmetic through real shards: S=2 ps-server processes, W=3 worker
 * processes using libps, k steps. Each worker's gradient depends on the
 * parameters it pulled, so a wrong pull shows up as a wrong result. The test
 * replays the same arithmetic locally and compares every parameter after
 * k steps; it also checks the shards' counters and the placement balance.
 * Rank 1 issues each step's pulls and pushes inside ps_batch_begin/end
 * (corked sockets), the others one frame at a time; W=3 takes the shard
 * through every kind of push of a step (the first kept as the sum, an add,
 * the last fused with the update). */
#include <math.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>

#include "bsp_ledger.h"
#include "harness.h"
#include "ps.h"

#define S 2
#define W 3
#define K 6
#define NT 4
static const char *const names[NT] = {"w0", "b0", "big", "tiny"};
static const uint64_t counts[NT] = {1000, 10, 5000, 1}; /* big spans several 4 KiB chunks */
static const float lr = 0.05f;
static struct test_server servers[S];

static ps_client *connect_client(int rank) {
  const char *addrs[S];
  for (int i = 0; i < S; i++) addrs[i] = servers[i].addr;
  struct ps_client_opts o = {.servers = addrs,
                             .num_servers = S,
                             .rank = rank,
                             .world_size = W,
                             .chunk_bytes = 4096,
                             .job_id = "test_bsp"};
  ps_client *c;
  char err[256];
  ps_status st = ps_client_new(&o, &c, err, sizeof(err));
  REQUIRE(st == PS_OK, "rank %d connect: %s", rank, err);
  st = ps_declare(c, NT, names, counts);
  REQUIRE(st == PS_OK, "rank %d declare: %s", rank, ps_strerror(st));
  return c;
}

static int worker(void *arg) {
  int rank = (int)(intptr_t)arg;
  ps_client *c = connect_client(rank);
  float *p[NT], *g[NT];
  bsp_ledger_tensors(c, rank, NT, counts, p, g);
  bool batch = rank == 1;
  if (rank == 2) REQUIRE(ps_batch_end(c) == PS_ERR_INVALID, "batch end without begin");
  for (uint64_t s = 0; s < K; s++) {
    ps_request *req[NT];
    if (batch) REQUIRE(ps_batch_begin(c) == PS_OK && ps_batch_begin(c) == PS_OK, "batch begin");
    for (int t = 0; t < NT; t++)
      REQUIRE(ps_pull_async(c, t, s, p[t], NULL, NULL, &req[t]) == PS_OK, "pull");
    if (batch) REQUIRE(ps_batch_end(c) == PS_OK && ps_batch_end(c) == PS_OK, "batch end");
    for (int t = 0; t < NT; t++) {
      uint64_t v;
      REQUIRE(ps_wait(req[t], &v) == PS_OK, "pull wait");
      REQUIRE(v == s, "rank %d pulled version %llu at step %llu", rank, (unsigned long long)v,
              (unsigned long long)s);
      for (uint64_t i = 0; i < counts[t]; i++) g[t][i] = bsp_grad_value(rank, s, i, p[t][i]);
    }
    if (batch) REQUIRE(ps_batch_begin(c) == PS_OK, "batch begin");
    for (int t = 0; t < NT; t++)
      REQUIRE(ps_push_async(c, t, s, g[t], NULL, NULL, &req[t]) == PS_OK, "push");
    if (batch) REQUIRE(ps_batch_end(c) == PS_OK, "batch end");
    for (int t = 0; t < NT; t++) REQUIRE(ps_wait(req[t], NULL) == PS_OK, "push wait");
  }
  /* final values, checked by the parent's replay */
  int bad = 0;
  for (int t = 0; t < NT; t++) {
    uint64_t v;
    REQUIRE(ps_pull(c, t, K, p[t], &v) == PS_OK && v == K, "final pull");
    bad += bsp_replay_compare(rank, names[t], t, counts[t], W, K, lr, p[t]);
  }
  REQUIRE(bad == 0, "%d parameters differ from the replay", bad);
  REQUIRE(ps_barrier(c) == PS_OK, "barrier");
  bsp_ledger_tensors_free(NT, p, g);
  ps_client_free(c);
  return 0;
}

int main(void) {
  for (int i = 0; i < S; i++) harness_start_server(&servers[i], i, S, W, lr, NULL);
  pid_t pids[W];
  for (int r = 0; r < W; r++) pids[r] = harness_fork(worker, (void *)(intptr_t)r);
  for (int r = 0; r < W; r++) {
    int st = harness_wait(pids[r], 60000);
    REQUIRE(st >= 0 && WIFEXITED(st) && WEXITSTATUS(st) == 0, "worker %d failed (status %d)", r,
            st);
  }

  /* Counters and placement seen from a fresh client (rank 0 of the job). */
  ps_client *c = connect_client(0);
  uint64_t bytes[S], total = 0, expect_keys = 0;
  REQUIRE(ps_shard_bytes(c, bytes) == PS_OK, "shard bytes");
  for (int i = 0; i < S; i++) total += bytes[i];
  REQUIRE(total == (1000 + 10 + 5000 + 1) * 4, "placement holds %llu bytes",
          (unsigned long long)total);
  for (int i = 0; i < S; i++) {
    struct ps_shard_stats st;
    REQUIRE(ps_stats(c, i, &st) == PS_OK, "stats");
    REQUIRE(st.param_bytes == bytes[i], "shard %d holds %llu bytes, placement says %llu", i,
            (unsigned long long)st.param_bytes, (unsigned long long)bytes[i]);
    REQUIRE(st.min_version == K && st.max_version == K, "shard %d versions %llu..%llu", i,
            (unsigned long long)st.min_version, (unsigned long long)st.max_version);
    REQUIRE(st.updates == (uint64_t)K * st.num_keys, "shard %d: %llu updates for %u keys", i,
            (unsigned long long)st.updates, st.num_keys);
    REQUIRE(st.pushes == (uint64_t)K * W * st.num_keys, "shard %d pushes %llu", i,
            (unsigned long long)st.pushes);
    REQUIRE(st.duplicates == 0, "duplicates %llu", (unsigned long long)st.duplicates);
    expect_keys += st.num_keys;
  }
  /* 4096-byte chunks: w0 1 chunk, b0 1, big 5 (20000 B), tiny 1 */
  REQUIRE(expect_keys == 8, "%llu keys in total", (unsigned long long)expect_keys);
  uint64_t diff = bytes[0] > bytes[1] ? bytes[0] - bytes[1] : bytes[1] - bytes[0];
  REQUIRE(diff <= 4096, "shards unbalanced: %llu vs %llu", (unsigned long long)bytes[0],
          (unsigned long long)bytes[1]);

  REQUIRE(ps_shutdown_servers(c) == PS_OK, "shutdown");
  ps_client_free(c);
  for (int i = 0; i < S; i++) {
    int st = harness_wait(servers[i].pid, 10000);
    REQUIRE(st >= 0 && WIFEXITED(st) && WEXITSTATUS(st) == 0, "shard %d did not exit cleanly", i);
  }
  printf("bsp: %d shards, %d workers, %d steps: all parameters match the replay\n", S, W, K);
  return 0;
}
