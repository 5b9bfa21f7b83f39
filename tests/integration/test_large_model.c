/* A large model over 4 shards: 100M float32 parameters (400 MB) in 20 tensors
 * of mixed sizes, from 25M elements down to 10, with the default 4 MiB
 * chunks, so large tensors are split across shards.
 *
 * Placement: every shard must hold within 5% of the mean number of bytes,
 * by the client's map (ps_shard_bytes) and by the shards' own count, and the
 * shards must hold every key exactly once.
 * Round trip: one worker initialises the whole model and pulls it back
 * (version 0); then pushes a whole-model gradient and pulls version 1 from
 * shards running --optimizer sum, which hold the mean gradient (here the one
 * worker's gradient, times 1.0f). Both must come back bit for bit. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>

#include "clock.h"
#include "harness.h"
#include "ps.h"

#define S 4
#define NT 20
#define TOTAL 100000000ull

static const uint64_t sizes[NT - 1] = {
    25000000, 16000000, 12000000, 9000000, 7000000, 6000000, 5000000, 4500000, 4000000, 3000000,
    2500000,  2000000,  1500000,  1000000, 600000,  300000,  65537,   4097,    10};

/* Runs op (push/pull/init) on every tensor concurrently and waits. */
enum op { OP_INIT, OP_PUSH, OP_PULL };
static void whole_model(ps_client *c, enum op op, uint64_t version, float *buf,
                        const uint64_t *offset) {
  ps_request *req[NT];
  for (int t = 0; t < NT; t++) {
    ps_status st = op == OP_INIT ? ps_init_async(c, t, buf + offset[t], NULL, NULL, &req[t])
                   : op == OP_PUSH
                       ? ps_push_async(c, t, 0, buf + offset[t], NULL, NULL, &req[t])
                       : ps_pull_async(c, t, version, buf + offset[t], NULL, NULL, &req[t]);
    REQUIRE(st == PS_OK, "op %d on tensor %d: %s", (int)op, t, ps_strerror(st));
  }
  for (int t = 0; t < NT; t++) {
    uint64_t v;
    ps_status st = ps_wait(req[t], &v);
    REQUIRE(st == PS_OK, "op %d on tensor %d: %s", (int)op, t, ps_strerror(st));
    if (op == OP_PULL)
      REQUIRE(v == version, "tensor %d pulled at version %llu", t, (unsigned long long)v);
  }
}

int main(void) {
  struct test_server srv[S];
  const char *extra[] = {"--optimizer", "sum", "--log-level", "warn", NULL};
  for (int i = 0; i < S; i++) harness_start_server(&srv[i], i, S, 1, 1.0, extra);

  uint64_t counts[NT], offset[NT], total = 0;
  char names[NT][32];
  const char *name_ptr[NT];
  for (int t = 0; t < NT; t++) {
    counts[t] = t < NT - 1 ? sizes[t] : 0;
    total += counts[t];
  }
  REQUIRE(total < TOTAL, "sizes too large");
  counts[NT - 1] = TOTAL - total; /* the rest: 100M in all */
  total = 0;
  for (int t = 0; t < NT; t++) {
    snprintf(names[t], sizeof(names[t]), "layer%02d.w", t);
    name_ptr[t] = names[t];
    offset[t] = total;
    total += counts[t];
  }
  REQUIRE(total == TOTAL, "layout holds %llu parameters", (unsigned long long)total);

  const char *addrs[S];
  for (int i = 0; i < S; i++) addrs[i] = srv[i].addr;
  struct ps_client_opts o = {.servers = addrs, .num_servers = S, .rank = 0, .world_size = 1};
  ps_client *c;
  char err[256];
  REQUIRE(ps_client_new(&o, &c, err, sizeof(err)) == PS_OK, "connect: %s", err);
  REQUIRE(ps_declare(c, NT, name_ptr, counts) == PS_OK, "declare");

  uint64_t bytes[S], sum = 0, keys = 0;
  REQUIRE(ps_shard_bytes(c, bytes) == PS_OK, "shard bytes");
  for (int i = 0; i < S; i++) sum += bytes[i];
  REQUIRE(sum == TOTAL * 4, "placement holds %llu bytes", (unsigned long long)sum);
  double mean = (double)sum / S, worst = 0;
  for (int i = 0; i < S; i++) {
    double dev = ((double)bytes[i] - mean) / mean;
    if (dev < 0) dev = -dev;
    if (dev > worst) worst = dev;
    struct ps_shard_stats st;
    REQUIRE(ps_stats(c, i, &st) == PS_OK, "stats");
    REQUIRE(st.param_bytes == bytes[i], "shard %d holds %llu bytes, the map says %llu", i,
            (unsigned long long)st.param_bytes, (unsigned long long)bytes[i]);
    keys += st.num_keys;
    printf("shard %d: %llu bytes (%+.2f%% of the mean), %u keys\n", i, (unsigned long long)bytes[i],
           100.0 * ((double)bytes[i] - mean) / mean, st.num_keys);
  }
  REQUIRE(worst <= 0.05, "a shard holds %.2f%% off the mean", 100 * worst);
  /* 4 MiB chunks of nearly equal size: ceil(count / 1Mi) keys per tensor */
  uint64_t want_keys = 0;
  for (int t = 0; t < NT; t++) want_keys += (counts[t] + (1u << 20) - 1) >> 20;
  REQUIRE(keys == want_keys, "%llu keys on the shards, %llu expected", (unsigned long long)keys,
          (unsigned long long)want_keys);

  float *vals = malloc(TOTAL * sizeof(float)), *back = malloc(TOTAL * sizeof(float));
  REQUIRE(vals && back, "out of memory");
  for (uint64_t i = 0; i < TOTAL; i++) vals[i] = (float)(int32_t)(i * 2654435761u) * 0x1p-31f;
  memset(back, 0xff, TOTAL * sizeof(float));
  double t0 = clock_now_s();
  whole_model(c, OP_INIT, 0, vals, offset);
  double t1 = clock_now_s();
  whole_model(c, OP_PULL, 0, back, offset);
  double t2 = clock_now_s();
  REQUIRE(memcmp(vals, back, TOTAL * sizeof(float)) == 0, "version 0 did not round-trip");

  for (uint64_t i = 0; i < TOTAL; i++) vals[i] = (float)((i * 40503u) % 65521u) - 32760.5f;
  memset(back, 0xff, TOTAL * sizeof(float));
  double t3 = clock_now_s();
  whole_model(c, OP_PUSH, 0, vals, offset);
  double t4 = clock_now_s();
  whole_model(c, OP_PULL, 1, back, offset);
  double t5 = clock_now_s();
  REQUIRE(memcmp(vals, back, TOTAL * sizeof(float)) == 0, "the pushed gradient did not round-trip");
  printf(
      "100M parameters (400 MB) in %d tensors over %d shards, within %.2f%% of the mean; "
      "init %.2f s, pull %.2f s, push %.2f s, pull %.2f s: round trips exact\n",
      NT, S, 100 * worst, t1 - t0, t2 - t1, t4 - t3, t5 - t4);

  free(vals);
  free(back);
  REQUIRE(ps_shutdown_servers(c) == PS_OK, "shutdown");
  ps_client_free(c);
  for (int i = 0; i < S; i++) {
    int st = harness_wait(srv[i].pid, 10000);
    REQUIRE(st >= 0 && WIFEXITED(st) && WEXITSTATUS(st) == 0, "shard %d exit", i);
  }
  return 0;
}
