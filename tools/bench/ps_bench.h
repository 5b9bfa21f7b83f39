/* ps_bench: what the two halves of ps-bench share (ps-bench.c, the
 * options and the parent; bench_client.c, a client process): the
 * configuration, the plan, the messages on a client's channel. Internal to
 * tools/ps-bench. */
#ifndef PS_BENCH_H
#define PS_BENCH_H

#include <stdbool.h>
#include <stdint.h>

#include "log.h"
#include "ps.h"

enum {
  MAX_DEPTH = 1024,
  MAX_SHARDS = 256,
  MAX_CLIENTS = 256,
  MAX_SIZES = 32,
  MIN_ADAPTIVE_ITERS = 20,
  MAX_SAMPLES = 4000000,    /* all clients together, adaptive mode */
  START_TIMEOUT_MS = 10000, /* every local shard must write its port file by then */
  EXIT_TIMEOUT_MS = 30000,
  LOG_TAIL_LINES = 20, /* of each shard's log after a failure */
  MAX_REPORTED_MISMATCHES = 10,
  DIR_BYTES = 1024,
  PATH_BYTES = DIR_BYTES + 64, /* DIR_BYTES + "/shard-N.port" */
};
#define DEFAULT_MAX_FRAME_BYTES (64ull << 20)
#define MAX_VALUE_BYTES (1ull << 30)
#define MAX_ROUND_BYTES (1ull << 30) /* depth * size: what one client holds per size, twice */
#define POISON_BITS 0x7fa5a5a5u      /* a NaN no pattern value equals */

struct bench_config {
  char servers[4096];
  int64_t local_shards;
  int64_t clients;
  char sizes[1024];
  int64_t iters;
  int64_t warmup;
  double seconds;
  uint64_t chunk_bytes;
  char server_bin[4096];
  char log_level[16];
  char auth_token_file[4096];
  int64_t depth;
  bool no_batch;
  char ops[64];
  char consistency[16];
  char transport[8];
};

enum bench_op { OP_PUSH, OP_PUSH_NB, OP_PULL, NUM_OPS };
extern const char *const op_names[NUM_OPS];

/* ---- the plan shared by parent and clients ------------------------------ */

struct bench_plan {
  const struct bench_config *cfg;
  bool local;
  int num_shards;
  int world;
  int num_sizes;
  uint64_t sizes[MAX_SIZES];
  const char *servers[MAX_SHARDS]; /* point into addrs */
  char addrs[MAX_SHARDS][300];
  enum log_level log_level;
  ps_token *token; /* NULL = no authentication */
  int depth;       /* tensors per size: requests in flight per client */
  unsigned ops;    /* bit set of enum bench_op */
  bool asp;
};

/* The tensor index of request j of size t. */
static inline int tensor_of(const struct bench_plan *p, int t, int j) {
  return t * p->depth + j;
}

static inline uint64_t chunks_of(const struct bench_plan *p, uint64_t bytes) {
  uint64_t per = p->cfg->chunk_bytes / 4, n = bytes / 4;
  return (n + per - 1) / per; /* as placement_build cuts tensors */
}

/* Messages on a client's channel. Client to parent: struct msg (then, for
 * MSG_RESULT and MSG_PLACEMENT, num_values u64s); parent to client: one u64
 * iteration count per measurement, 0 = stop. */
enum msg_type { MSG_PLACEMENT = 1, MSG_WARM = 2, MSG_RESULT = 3 };
struct msg {
  uint32_t type;
  uint32_t rank;
  uint64_t warm_ns;          /* MSG_WARM: mean time of one warm-up iteration */
  uint64_t start_ns, end_ns; /* MSG_RESULT: this client's timed window */
  uint64_t bad;              /* MSG_RESULT: failed checks */
  uint64_t num_values;       /* latencies in ns (RESULT) or bytes per shard (PLACEMENT) */
};

/* A client process: rank of world p->world, talking to the parent over fd.
 * Returns its exit status (0, 1 after printing why, 3 when the parent gave up). */
int bench_client_main(const struct bench_plan *p, int rank, int fd);

#endif
