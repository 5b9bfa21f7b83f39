/* allreduce-bench: all-reduce time and bandwidth of libps's ring (TCP) or
 * NCCL backend, printed like nccl-tests' all_reduce_perf: one line per size
 * with size, count, type, redop, time_us, algbw, busbw and wrong, where
 * algbw = size / time and busbw = algbw * 2(W-1)/W (GB/s, 1 GB = 1e9 bytes),
 * the figure that compares with the link speed whatever W is.
 *
 * --collective measures the ring's other collectives the same way, with
 * nccl-tests' conventions: size is the larger buffer (all-gather's output,
 * reduce-scatter's input, all-to-all's W blocks; rounded down to W equal
 * parts), busbw = algbw * (W-1)/W for all-gather, reduce-scatter and
 * all-to-all, = algbw for reduce and broadcast (root 0). sendrecv is
 * nccl-tests' sendrecv_perf: every rank sends size bytes to rank+1 while
 * it receives as many from rank-1 (ps_coll_sendrecv over the point-to-point
 * connections), busbw = algbw.
 *
 * Processes. Without --rank the program starts W ranks itself on 127.0.0.1:
 * the parent binds W listening sockets on port 0 (so no port can be taken
 * between choosing and using it), forks one child per rank that keeps only its
 * own socket, waits for them and kills the rest as soon as one fails. With
 * --rank R and --peers/--peer-template it is one rank of a ring spread over
 * machines (start one per rank). Rank 0 prints.
 *
 * One measurement, per size: fill the buffer, --warmup all-reduces (rank 0
 * times them and, with --iters 0, broadcasts an iteration count that fills
 * --seconds), a barrier, the timed all-reduces back to back on the same
 * buffer, then the mean time over ranks (an all-reduce of the per-rank
 * times, as nccl-tests reports). NCCL runs are queued on the stream and timed
 * to its completion. Then one checked all-reduce: every rank fills
 * x_r[i] = ((131 i + 7 r) mod 61) - 30, small integers whose sum over ranks is
 * exact in float32 in any order, so `wrong` counts (over all ranks) elements
 * that differ from the exact sum, or from sum/W for --op avg (checked to
 * 1e-6 relative there, since the division may round differently).
 *
 * --dtype runs all-reduce, reduce-scatter and reduce on another element type
 * (ps_coll_*_typed, ps_nccl_*_typed_dev): the same pattern in that type
 * (exact in every floating type; integer sums wrap, and the reference wraps
 * them too), checked exactly (float16 and bfloat16 means to their own
 * rounding), so the table compares types at the same bytes.
 *
 * With --auth-token-file every rank loads the job's token and the ring
 * authenticates as in a real job (a handshake per connection, a tag per
 * operation and direction), so running the same sizes with and without it
 * measures what authentication costs. */
#include <errno.h>
#include <inttypes.h>
#include <math.h>
#include <sched.h>
#include <signal.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/utsname.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "clock.h"
#include "collective.h"
#include "collective_nccl.h"
#include "config.h"
#include "dtype.h"
#include "log.h"
#include "net.h"

#define MAX_SIZES 64
#define MAX_LOCAL_RANKS 64
#define MAX_BYTES (1ull << 32)

struct bench_config {
  int64_t world_size;
  int64_t rank; /* -1: start every rank locally */
  char peers[8192];
  char peer_template[256];
  char backend[16];
  char sizes[512];
  char op[8];
  char dtype[16];
  char collective[16];
  char algorithm[16];
  char node_name[256];
  int64_t iters;
  int64_t warmup;
  double seconds;
  uint64_t slice_bytes;
  uint64_t small_bytes;
  uint64_t round_bytes;
  int64_t spin_us;
  int64_t peer_timeout_ms;
  int64_t connect_timeout_ms;
  char job_id[128];
  char auth_token_file[1024];
  char log_level[16];
  bool bind;
  bool p2p;
};

/* "4K,64K,1M" or a doubling range "4K:256M" (or "4K:256M:4", factor 4). */
static int parse_sizes(const char *s, uint64_t *out, int max, char *err, size_t errlen) {
  const char *colon = strchr(s, ':');
  if (colon) {
    char a[64] = "", b[64] = "", f[16] = "2";
    if (sscanf(s, "%63[^:]:%63[^:]:%15s", a, b, f) < 2) {
      snprintf(err, errlen, "a range is FROM:TO[:FACTOR], e.g. 4K:256M");
      return -EINVAL;
    }
    uint64_t lo, hi;
    char *end;
    long fac = strtol(f, &end, 10);
    if (config_parse_size(a, &lo) || config_parse_size(b, &hi) || *end || fac < 2 || lo == 0 ||
        lo > hi) {
      snprintf(err, errlen, "bad range \"%s\" (want FROM:TO[:FACTOR], FROM <= TO, FACTOR >= 2)", s);
      return -EINVAL;
    }
    int n = 0;
    for (uint64_t v = lo; v <= hi && n < max; v *= (uint64_t)fac) out[n++] = v;
    s = NULL;
    for (int i = 0; i < n; i++)
      if (out[i] % 4 || out[i] > MAX_BYTES) {
        snprintf(err, errlen, "size %" PRIu64 " is not a multiple of 4 up to 4GiB", out[i]);
        return -EINVAL;
      }
    return n;
  }
  int n = 0;
  for (const char *p = s;;) {
    size_t len = strcspn(p, ",");
    char elem[64];
    if (len == 0 || len >= sizeof(elem)) {
      snprintf(err, errlen, "size element %d is %s", n, len ? "too long" : "empty");
      return -EINVAL;
    }
    memcpy(elem, p, len);
    elem[len] = 0;
    uint64_t v;
    if (config_parse_size(elem, &v) || v % 4 || v > MAX_BYTES) {
      snprintf(err, errlen, "\"%s\" is not a size in bytes, a multiple of 4 up to 4GiB", elem);
      return -EINVAL;
    }
    if (n == max) {
      snprintf(err, errlen, "more than %d sizes", max);
      return -EINVAL;
    }
    out[n++] = v;
    if (!p[len]) return n;
    p += len + 1;
  }
}

static int check_sizes(const char *v, char *err, size_t n) {
  uint64_t tmp[MAX_SIZES];
  return parse_sizes(v, tmp, MAX_SIZES, err, n) < 0 ? -EINVAL : 0;
}

static int check_backend(const char *v, char *err, size_t n) {
  if (strcmp(v, "tcp") == 0 || strcmp(v, "nccl") == 0) return 0;
  snprintf(err, n, "want tcp or nccl");
  return -EINVAL;
}

static int check_op(const char *v, char *err, size_t n) {
  if (strcmp(v, "sum") == 0 || strcmp(v, "avg") == 0) return 0;
  snprintf(err, n, "want sum or avg");
  return -EINVAL;
}

enum coll {
  C_ALLREDUCE,
  C_ALLGATHER,
  C_REDUCE_SCATTER,
  C_REDUCE,
  C_ALLTOALL,
  C_BROADCAST,
  C_SENDRECV
};
static const char *const coll_names[] = {"allreduce", "allgather", "reduce_scatter", "reduce",
                                         "alltoall",  "broadcast", "sendrecv"};
#define NUM_COLLS 7

static const char *const algo_names[] = {"ring", "node-first"};

static int dtype_of(const char *v) {
  for (int t = 0; t < DTYPE_COUNT; t++)
    if (strcmp(v, dtype_name(t)) == 0) return t;
  return -1;
}

static int check_dtype(const char *v, char *err, size_t n) {
  if (dtype_of(v) >= 0) return 0;
  snprintf(err, n,
           "want one of float32, float64, float16, bfloat16, int8, uint8, int32, uint32, "
           "int64, uint64");
  return -EINVAL;
}

static int check_algorithm(const char *v, char *err, size_t n) {
  return config_choice(v, algo_names, 2, err, n) < 0 ? -EINVAL : 0;
}

static int check_collective(const char *v, char *err, size_t n) {
  return config_choice(v, coll_names, NUM_COLLS, err, n) < 0 ? -EINVAL : 0;
}

#define CONFIG_STRUCT struct bench_config
static const struct config_option bench_options[] = {
    CONFIG_OPT("world-size", CONFIG_INT, world_size, "2", 1, 65536, "number of ranks W"),
    CONFIG_OPT("rank", CONFIG_INT, rank, "-1", -1, 65535,
               "this process's rank in a ring given by --peers/--peer-template; -1 = start all W "
               "ranks here on 127.0.0.1"),
    CONFIG_OPT("peers", CONFIG_STRING, peers, "", 0, 0, "with --rank: ring addresses h:p,... "),
    CONFIG_OPT("peer-template", CONFIG_STRING, peer_template, "", 0, 0,
               "with --rank: ring address with {i}, e.g. ps-worker-{i}.ps-worker:7071"),
    CONFIG_CHOICE("backend", backend, "tcp", check_backend,
                  "tcp (ring over TCP, host memory) or nccl (device memory, one GPU per rank)"),
    CONFIG_CHOICE("sizes", sizes, "4K:256M", check_sizes,
                  "sizes in bytes: a list 4K,1M or a doubling range FROM:TO[:FACTOR]"),
    CONFIG_CHOICE("op", op, "sum", check_op, "reduction: sum or avg"),
    CONFIG_CHOICE(
        "dtype", dtype, "float32", check_dtype,
        "element type of all-reduce, reduce-scatter and reduce: float32, float64, float16, "
        "bfloat16, int8, uint8, int32, uint32, int64 or uint64"),
    CONFIG_CHOICE(
        "collective", collective, "allreduce", check_collective,
        "allreduce, or (tcp) allgather, reduce_scatter, reduce, alltoall, broadcast or sendrecv"),
    CONFIG_CHOICE(
        "allreduce-algorithm", algorithm, "ring", check_algorithm,
        "tcp all-reduce: ring, or node-first (as ps-worker's: reduce within each --node-name, "
        "all-reduce among one leader per node, back within the node)"),
    CONFIG_OPT("node-name", CONFIG_STRING, node_name, "", 0, 0,
               "the node this rank runs on, for --allreduce-algorithm node-first (with --rank)"),
    CONFIG_OPT("iters", CONFIG_INT, iters, "0", 0, 100000000,
               "timed iterations per size; 0 = enough for --seconds (at least 3)"),
    CONFIG_OPT("warmup", CONFIG_INT, warmup, "5", 1, 1000000, "untimed iterations per size"),
    CONFIG_OPT("seconds", CONFIG_DOUBLE, seconds, "0.3", 0.001, 3600,
               "target length of one timed loop when --iters is 0"),
    CONFIG_OPT("slice-bytes", CONFIG_SIZE, slice_bytes, "0", 0, 1073741824.0,
               "tcp: pipeline slice (0 = the library's default)"),
    CONFIG_OPT("round-bytes", CONFIG_SIZE, round_bytes, "0", 0, 1073741824.0,
               "tcp: bytes per rank and round of the pipelined ring (0 = the library's default)"),
    CONFIG_OPT("small-bytes", CONFIG_SIZE, small_bytes, "0", 0, 1073741824.0,
               "tcp: threshold of the low-latency algorithm (0 = default)"),
    CONFIG_OPT("spin-us", CONFIG_INT, spin_us, "0", -1, 1000000,
               "tcp: spin before sleeping in poll (0 = default, -1 = never)"),
    CONFIG_OPT("peer-timeout-ms", CONFIG_INT, peer_timeout_ms, "10000", 100, 1e8,
               "a silent peer is lost after this"),
    CONFIG_OPT("connect-timeout-ms", CONFIG_INT, connect_timeout_ms, "60000", -1, 1e9,
               "rendezvous deadline (-1 = forever)"),
    CONFIG_OPT("job-id", CONFIG_STRING, job_id, "allreduce-bench", 0, 0, "job id of the ring"),
    CONFIG_OPT(
        "auth-token-file", CONFIG_STRING, auth_token_file, "", 0, 0,
        "the job's token (as ps-worker's): ranks authenticate and tag every operation; empty "
        "= no authentication"),
    CONFIG_OPT("p2p", CONFIG_BOOL, p2p, "false", 0, 0,
               "tcp: connect every pair of ranks (as ps.torch does): all-to-all then goes pairwise "
               "over those connections instead of around the ring (sendrecv always has them)"),
    CONFIG_OPT("bind", CONFIG_BOOL, bind, "false", 0, 0,
               "pin rank r to CPU r mod CPUs (as mpirun binds ranks to cores by default)"),
    CONFIG_CHOICE("log-level", log_level, "warn", log_level_check,
                  "debug, info, warn, error or off"),
};

static const struct config_spec bench_spec = {
    "allreduce-bench",
    "all-reduce time, algbw and busbw per size (nccl-tests style) of the ring (tcp) or NCCL",
    bench_options, sizeof(bench_options) / sizeof(bench_options[0]), NULL};

struct plan {
  const struct bench_config *cfg;
  int world, nsizes;
  uint64_t sizes[MAX_SIZES];
  bool nccl;
  enum ps_redop op;
  enum coll coll;
  int dtype;  /* of the reductions; float32 for the others */
  size_t esz; /* its size */
  char **peers;
};

/* --auth-token-file: "" = no token (*out NULL). A file that cannot be used
 * is bad usage: the message names the option, and the caller exits 2. */
static int token_option(const struct bench_config *cfg, ps_token **out) {
  *out = NULL;
  char err[600];
  if (!cfg->auth_token_file[0] ||
      ps_token_load(cfg->auth_token_file, out, err, sizeof(err)) == PS_OK)
    return 0;
  fprintf(stderr, "allreduce-bench: option --auth-token-file: %s\n", err);
  return -EINVAL;
}

static float pattern(size_t i, int r) {
  return (float)((int)((131u * (uint64_t)i + 7u * (uint64_t)r) % 61u) - 30);
}

/* Element i of type t: set from a whole number (integers keep its low
 * bytes, so sums wrap as the ring's do) and read back (integers sign- or
 * zero-extended). */
static void elem_put(int t, void *p, size_t i, double v) {
  if (t == DTYPE_FLOAT32) {
    ((float *)p)[i] = (float)v;
  } else if (t == DTYPE_FLOAT64) {
    ((double *)p)[i] = v;
  } else if (t == DTYPE_FLOAT16 || t == DTYPE_BFLOAT16) {
    ((uint16_t *)p)[i] =
        t == DTYPE_FLOAT16 ? dtype_float_to_half((float)v) : dtype_float_to_bf16((float)v);
  } else {
    int64_t x = (int64_t)v;
    memcpy((char *)p + i * dtype_size(t), &x, dtype_size(t)); /* little-endian: low bytes */
  }
}

static double elem_get(int t, const void *p, size_t i) {
  if (t == DTYPE_FLOAT32) return ((const float *)p)[i];
  if (t == DTYPE_FLOAT64) return ((const double *)p)[i];
  if (t == DTYPE_FLOAT16) return dtype_half_to_float(((const uint16_t *)p)[i]);
  if (t == DTYPE_BFLOAT16) return dtype_bf16_to_float(((const uint16_t *)p)[i]);
  size_t z = dtype_size(t);
  uint64_t v = 0;
  memcpy(&v, (const char *)p + i * z, z);
  bool neg = (t == DTYPE_INT8 || t == DTYPE_INT32 || t == DTYPE_INT64) && (v >> (8 * z - 1)) & 1;
  if (neg && z < 8) v |= ~0ull << (8 * z);
  return neg ? (double)(int64_t)v : (double)v;
}

/* Whether element i of x (type t) is the reduction over the W ranks of
 * pattern(base + i, q): the exact sum in the type (wrapped for integers),
 * or the mean as the ring forms it. */
static bool reduced_ok(int t, const void *x, size_t i, size_t base, int W, enum ps_redop op) {
  double sum = 0;
  for (int q = 0; q < W; q++) sum += pattern(base + i, q);
  unsigned char w[8];
  elem_put(t, w, 0, sum); /* the sum as the type holds it */
  double want = elem_get(t, w, 0), got = elem_get(t, x, i);
  if (op == PS_REDOP_SUM) return got == want;
  if (t >= DTYPE_INT8) return got == trunc(want / W);
  if (t == DTYPE_FLOAT16 || t == DTYPE_BFLOAT16) {
    elem_put(t, w, 0, (double)((float)want * (1.0f / (float)W)));
    return got == elem_get(t, w, 0);
  }
  want = want / W; /* float32 and float64; NCCL's mean may round otherwise */
  return fabs(got - want) <= 1e-6 * fabs(want) + 1e-30;
}

static uint64_t count_wrong(int t, const void *x, size_t n, size_t base, int world,
                            enum ps_redop op) {
  uint64_t bad = 0;
  for (size_t i = 0; i < n; i++) bad += !reduced_ok(t, x, i, base, world, op);
  return bad;
}

/* One rank's collectives on x (and y, the other buffer where there is one;
 * host memory for tcp, device memory for nccl). per is floats per rank. */
struct rank_ctx {
  ps_coll *c;
  struct ps_nccl *n;
  enum ps_redop op;
  enum coll coll;
  int dtype;
  size_t esz;
  int rank, world;
};

static ps_status reduce(struct rank_ctx *k, void *x, void *y, size_t per) {
  const ps_dtype t = (ps_dtype)k->dtype;
  if (k->n) return ps_nccl_allreduce_typed_dev(k->n, x, per, t, k->op);
  size_t b = per * k->esz;
  switch (k->coll) {
    case C_ALLGATHER:
      return ps_coll_allgather(k->c, x, y, b);
    case C_REDUCE_SCATTER:
      return ps_coll_reduce_scatter_typed(k->c, x, y, per, t, k->op);
    case C_REDUCE:
      return ps_coll_reduce_typed(k->c, x, per, t, k->op, 0);
    case C_ALLTOALL:
      return ps_coll_alltoall(k->c, x, y, b);
    case C_BROADCAST:
      return ps_coll_broadcast(k->c, x, b, 0);
    case C_SENDRECV:
      return ps_coll_sendrecv(k->c, x, b, (k->rank + 1) % k->world, y, b,
                              (k->rank + k->world - 1) % k->world);
    default:
      return ps_coll_allreduce_typed(k->c, x, per, t, k->op);
  }
}

/* elements (of esz bytes) per rank of a `bytes` measurement, and the bytes
 * it really moves */
static size_t per_rank(enum coll c, int world, size_t esz, size_t bytes, size_t *used) {
  bool split = c == C_ALLGATHER || c == C_REDUCE_SCATTER || c == C_ALLTOALL;
  size_t per = bytes / esz / (split ? (size_t)world : 1);
  *used = per * esz * (split ? (size_t)world : 1);
  return per;
}

/* The checked run's input: x (all-to-all: W blocks, block d = pattern from
 * d * per; reduce-scatter: W chunks, likewise), in the reductions' type. */
static void fill_for(const struct rank_ctx *k, void *x, size_t per) {
  size_t n = k->coll == C_ALLTOALL || k->coll == C_REDUCE_SCATTER ? per * (size_t)k->world : per;
  for (size_t i = 0; i < n; i++) elem_put(k->dtype, x, i, pattern(i, k->rank));
}

/* Elements of the result (x in place, else y) that differ from the reference. */
static uint64_t wrong_for(const struct rank_ctx *k, const void *xv, const void *yv, size_t per) {
  const float *x = xv, *y = yv; /* what only moves is float32 */
  const int W = k->world, r = k->rank;
  uint64_t bad = 0;
  switch (k->coll) {
    case C_ALLGATHER:
      for (int q = 0; q < W; q++)
        for (size_t i = 0; i < per; i++) bad += y[(size_t)q * per + i] != pattern(i, q);
      return bad;
    case C_REDUCE_SCATTER:
      return count_wrong(k->dtype, yv, per, (size_t)r * per, W, k->op);
    case C_REDUCE:
      if (r == 0) return count_wrong(k->dtype, xv, per, 0, W, k->op);
      for (size_t i = 0; i < per; i++) { /* only read */
        unsigned char w[8];
        elem_put(k->dtype, w, 0, pattern(i, r));
        bad += elem_get(k->dtype, xv, i) != elem_get(k->dtype, w, 0);
      }
      return bad;
    case C_ALLTOALL:
      for (int s = 0; s < W; s++)
        for (size_t i = 0; i < per; i++)
          bad += y[(size_t)s * per + i] != pattern((size_t)r * per + i, s);
      return bad;
    case C_BROADCAST:
      for (size_t i = 0; i < per; i++) bad += x[i] != pattern(i, 0);
      return bad;
    case C_SENDRECV:
      for (size_t i = 0; i < per; i++) bad += y[i] != pattern(i, (r + W - 1) % W);
      return bad;
    default:
      return count_wrong(k->dtype, xv, per, 0, W, k->op);
  }
}

static double bus_factor(enum coll c, int world) {
  if (c == C_ALLREDUCE) return 2.0 * (world - 1) / world;
  if (c == C_REDUCE || c == C_BROADCAST || c == C_SENDRECV) return 1.0;
  return (double)(world - 1) / world;
}

static ps_status settle(struct rank_ctx *k) {
  return k->n ? ps_nccl_sync(k->n) : PS_OK;
}

static int fail(struct rank_ctx *k, const char *what, ps_status st) {
  char buf[512] = "";
  if (k->n)
    ps_nccl_errmsg(k->n, buf, sizeof(buf));
  else if (k->c)
    ps_coll_errmsg(k->c, buf, sizeof(buf));
  fprintf(stderr, "allreduce-bench: %s: %s: %s\n", what, ps_strerror(st), buf);
  return 1;
}

static void print_header(const struct plan *p, int rank, struct rank_ctx *k) {
  struct utsname u;
  uname(&u);
  time_t t = time(NULL);
  char date[64];
  strftime(date, sizeof(date), "%Y-%m-%dT%H:%MZ", gmtime(&t));
  char dev[300] = "host memory";
  if (k->n) ps_nccl_describe(k->n, dev, sizeof(dev));
  printf("# allreduce-bench: %s, world %d, backend %s (%s), op %s, %s\n", coll_names[p->coll],
         p->world, p->nccl ? "nccl" : "tcp", dev, p->cfg->op,
         p->cfg->rank < 0 ? "local ranks on 127.0.0.1" : "given peers");
  if (p->coll == C_ALLREDUCE && !p->nccl)
    printf("# algorithm: %s%s%s\n", p->cfg->algorithm, p->cfg->node_name[0] ? ", node " : "",
           p->cfg->node_name);
  printf("# host %s, %ld CPUs, %s %s, %s\n", u.nodename, sysconf(_SC_NPROCESSORS_ONLN), u.sysname,
         u.release, date);
  printf("# authentication: %s\n", p->cfg->auth_token_file[0]
                                       ? "on (--auth-token-file: a tag per operation and direction)"
                                       : "off");
  printf("# busbw = algbw * %s; GB/s = 1e9 bytes/s; time_us is the mean over ranks\n",
         p->coll == C_ALLREDUCE                                                   ? "2(W-1)/W"
         : p->coll == C_REDUCE || p->coll == C_BROADCAST || p->coll == C_SENDRECV ? "1"
                                                                                  : "(W-1)/W");
  printf("#%12s %12s %8s %6s %11s %8s %8s %8s\n", "size", "count", "type", "redop", "time_us",
         "algbw", "busbw", "wrong");
  fflush(stdout);
  (void)rank;
}

static int run_rank(const struct plan *p, int rank, int listen_fd) {
  const struct bench_config *cfg = p->cfg;
  if (cfg->bind) {
    cpu_set_t set;
    CPU_ZERO(&set);
    CPU_SET(rank % (int)sysconf(_SC_NPROCESSORS_ONLN), &set);
    if (sched_setaffinity(0, sizeof(set), &set) != 0)
      fprintf(stderr, "allreduce-bench: rank %d: cannot pin to a CPU: %s\n", rank, strerror(errno));
  }
  char err[512];
  struct rank_ctx k = {.op = p->op,
                       .coll = p->coll,
                       .dtype = p->dtype,
                       .esz = p->esz,
                       .rank = rank,
                       .world = p->world};
  ps_token *token = NULL;
  if (token_option(cfg, &token) < 0) return 2;
  struct ps_coll_opts o = {.rank = rank,
                           .world_size = p->world,
                           .peers = (const char *const *)p->peers,
                           .job_id = cfg->job_id,
                           .listen_fd = listen_fd,
                           .connect_timeout_ms = (int)cfg->connect_timeout_ms,
                           .peer_timeout_ms = (int)cfg->peer_timeout_ms,
                           .slice_bytes = cfg->slice_bytes,
                           .small_bytes = cfg->small_bytes,
                           .round_bytes = cfg->round_bytes,
                           .spin_us = (int)cfg->spin_us,
                           .auth_token = token,
                           .p2p = p->coll == C_SENDRECV || cfg->p2p,
                           .node_first = strcmp(cfg->algorithm, "node-first") == 0,
                           .node = cfg->node_name};
  ps_status st = ps_coll_open(&o, &k.c, err, sizeof(err));
  if (st != PS_OK) {
    fprintf(stderr, "allreduce-bench: rank %d: cannot form the ring: %s\n", rank, err);
    ps_token_free(token);
    return 1;
  }
  int ret = 1;
  void *dev = NULL;
  float *host = NULL, *other = NULL;
  if (p->nccl) {
    st = ps_nccl_open(k.c, &k.n, err, sizeof(err));
    if (st != PS_OK) {
      fprintf(stderr, "allreduce-bench: rank %d: %s\n", rank, err);
      goto out;
    }
  }
  if (rank == 0) print_header(p, rank, &k);
  uint64_t maxb = 0;
  for (int i = 0; i < p->nsizes; i++)
    if (p->sizes[i] > maxb) maxb = p->sizes[i];
  host = aligned_alloc(64, (maxb + 63) / 64 * 64 + 64);
  other = aligned_alloc(64, (maxb + 63) / 64 * 64 + 64);
  if (!host || !other) {
    fprintf(stderr, "allreduce-bench: rank %d: cannot allocate %" PRIu64 " bytes\n", rank, maxb);
    goto out;
  }
  if (p->nccl && (st = ps_nccl_dev_alloc(k.n, maxb, &dev)) != PS_OK) {
    ret = fail(&k, "device allocation", st);
    goto out;
  }
  double busbw_sum = 0;
  int busbw_n = 0;
  for (int si = 0; si < p->nsizes; si++) {
    size_t bytes, count = per_rank(p->coll, p->world, p->esz, p->sizes[si], &bytes);
    void *x = p->nccl ? dev : (void *)host;
    fill_for(&k, host, count);
    if (p->nccl && (st = ps_nccl_to_device(k.n, dev, host, bytes)) != PS_OK) {
      ret = fail(&k, "copy", st);
      goto out;
    }
    double t0 = clock_now_s();
    for (int64_t w = 0; w < cfg->warmup; w++)
      if ((st = reduce(&k, x, other, count)) != PS_OK) {
        ret = fail(&k, "warm-up all-reduce", st);
        goto out;
      }
    if ((st = settle(&k)) != PS_OK) {
      ret = fail(&k, "warm-up", st);
      goto out;
    }
    int64_t iters = cfg->iters;
    if (iters == 0) {
      double per = (clock_now_s() - t0) / (double)cfg->warmup;
      int64_t want = per > 0 ? (int64_t)(cfg->seconds / per) : 1000;
      iters = want < 3 ? 3 : want > 1000000 ? 1000000 : want;
      if ((st = ps_coll_broadcast(k.c, &iters, sizeof(iters), 0)) != PS_OK) {
        ret = fail(&k, "broadcast", st);
        goto out;
      }
    }
    if ((st = ps_coll_barrier(k.c)) != PS_OK) {
      ret = fail(&k, "barrier", st);
      goto out;
    }
    t0 = clock_now_s();
    for (int64_t it = 0; it < iters; it++)
      if ((st = reduce(&k, x, other, count)) != PS_OK) {
        ret = fail(&k, "all-reduce", st);
        goto out;
      }
    if ((st = settle(&k)) != PS_OK) {
      ret = fail(&k, "all-reduce", st);
      goto out;
    }
    float time_us = (float)((clock_now_s() - t0) / (double)iters * 1e6);
    /* The check: fresh pattern, one all-reduce, compare. */
    fill_for(&k, host, count);
    if (p->nccl) {
      if ((st = ps_nccl_to_device(k.n, dev, host, bytes)) != PS_OK ||
          (st = reduce(&k, dev, NULL, count)) != PS_OK || (st = settle(&k)) != PS_OK ||
          (st = ps_nccl_to_host(k.n, host, dev, bytes)) != PS_OK) {
        ret = fail(&k, "checked all-reduce", st);
        goto out;
      }
    } else if ((st = reduce(&k, host, other, count)) != PS_OK) {
      ret = fail(&k, "checked all-reduce", st);
      goto out;
    }
    float stats[2] = {time_us, (float)wrong_for(&k, host, other, count)};
    /* Mean time and total wrong over the ranks, over the TCP ring. */
    float mean[1] = {stats[0]}, wrong[1] = {stats[1]};
    if ((st = ps_coll_allreduce(k.c, mean, 1, PS_REDOP_AVG)) != PS_OK ||
        (st = ps_coll_allreduce(k.c, wrong, 1, PS_REDOP_SUM)) != PS_OK) {
      ret = fail(&k, "gathering results", st);
      goto out;
    }
    if (rank == 0) {
      double algbw = (double)bytes / ((double)mean[0] * 1e-6) / 1e9;
      double busbw = algbw * bus_factor(p->coll, p->world);
      printf(" %12zu %12zu %8s %6s %11.2f %8.3f %8.3f %8.0f\n", bytes, count, dtype_name(p->dtype),
             cfg->op, (double)mean[0], algbw, busbw, (double)wrong[0]);
      fflush(stdout);
      busbw_sum += busbw;
      busbw_n++;
    }
  }
  if (rank == 0 && busbw_n) printf("# Avg bus bandwidth : %.3f GB/s\n", busbw_sum / busbw_n);
  st = ps_coll_barrier(k.c);
  ret = st == PS_OK ? 0 : fail(&k, "final barrier", st);
out:
  if (p->nccl) ps_nccl_dev_free(k.n, dev);
  free(host);
  free(other);
  ps_nccl_close(k.n);
  ps_coll_close(k.c);
  ps_token_free(token); /* after the group, which borrows it */
  return ret;
}

static void free_peers(struct plan *p) {
  for (int i = 0; p->peers && i < p->world; i++) free(p->peers[i]);
  free(p->peers);
  p->peers = NULL;
}

/* Starts every rank as a child process with its own pre-bound listener. */
static int run_local(struct plan *p) {
  int W = p->world;
  if (W > MAX_LOCAL_RANKS) {
    fprintf(stderr, "allreduce-bench: at most %d local ranks\n", MAX_LOCAL_RANKS);
    return 2;
  }
  int lfd[MAX_LOCAL_RANKS];
  pid_t pid[MAX_LOCAL_RANKS];
  char err[256];
  p->peers = calloc((size_t)W, sizeof(char *));
  if (!p->peers) return 1;
  for (int r = 0; r < W; r++) {
    struct net_addr a = {.host = "127.0.0.1", .port = 0};
    lfd[r] = net_listen(&a, 16, err, sizeof(err));
    if (lfd[r] < 0) {
      fprintf(stderr, "allreduce-bench: %s\n", err);
      return 1;
    }
    char addr[64];
    snprintf(addr, sizeof(addr), "127.0.0.1:%d", net_bound_port(lfd[r]));
    p->peers[r] = strdup(addr);
  }
  fflush(NULL);
  for (int r = 0; r < W; r++) {
    pid[r] = fork();
    if (pid[r] == 0) {
      for (int q = 0; q < W; q++)
        if (q != r) close(lfd[q]);
      _exit(run_rank(p, r, lfd[r]));
    }
    if (pid[r] < 0) {
      perror("allreduce-bench: fork");
      for (int q = 0; q < r; q++) kill(pid[q], SIGKILL);
      return 1;
    }
  }
  for (int r = 0; r < W; r++) close(lfd[r]);
  int failed = 0, left = W;
  while (left > 0) {
    int status;
    pid_t done = wait(&status);
    if (done < 0) break;
    left--;
    if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
      int r = 0;
      while (r < W && pid[r] != done) r++;
      if (!failed) fprintf(stderr, "allreduce-bench: rank %d failed (status 0x%x)\n", r, status);
      failed = 1;
      /* The others notice the lost peer on their own; this is the backstop. */
      for (int q = 0; q < W; q++)
        if (pid[q] != done) kill(pid[q], SIGTERM);
    }
  }
  return failed;
}

int main(int argc, char **argv) {
  struct bench_config cfg;
  memset(&cfg, 0, sizeof(cfg));
  int r = config_parse(&bench_spec, &cfg, argc, argv, NULL, stderr);
  if (r == CONFIG_HELP || r == CONFIG_VERSION) return 0;
  if (r < 0) return 2;
  enum log_level level = LOG_WARN;
  log_level_parse(cfg.log_level, &level);
  signal(SIGPIPE, SIG_IGN);
  struct plan p = {
      .cfg = &cfg,
      .world = (int)cfg.world_size,
      .nccl = strcmp(cfg.backend, "nccl") == 0,
      .op = strcmp(cfg.op, "avg") == 0 ? PS_REDOP_AVG : PS_REDOP_SUM,
      .coll = (enum coll)config_choice(cfg.collective, coll_names, NUM_COLLS, NULL, 0)};
  if (p.nccl && p.coll != C_ALLREDUCE) {
    fprintf(stderr, "allreduce-bench: option --collective: %s runs on the tcp backend only\n",
            cfg.collective);
    return 2;
  }
  p.dtype = dtype_of(cfg.dtype);
  p.esz = dtype_size(p.dtype);
  if (p.dtype != DTYPE_FLOAT32 && p.coll != C_ALLREDUCE && p.coll != C_REDUCE_SCATTER &&
      p.coll != C_REDUCE) {
    fprintf(stderr,
            "allreduce-bench: option --dtype: %s moves bytes; only allreduce, reduce_scatter and "
            "reduce take a type\n",
            cfg.collective);
    return 2;
  }
  char err[256];
  p.nsizes = parse_sizes(cfg.sizes, p.sizes, MAX_SIZES, err, sizeof(err));
  { /* bad usage before any rank starts; each rank loads its own */
    ps_token *t = NULL;
    if (token_option(&cfg, &t) < 0) return 2;
    ps_token_free(t);
  }
  if (cfg.rank < 0) {
    log_setup("allreduce-bench", level);
    if (cfg.peers[0] || cfg.peer_template[0]) {
      fprintf(stderr, "allreduce-bench: --peers/--peer-template need --rank\n");
      return 2;
    }
    r = run_local(&p);
    free_peers(&p);
    return r;
  }
  if (cfg.rank >= cfg.world_size) {
    fprintf(stderr, "allreduce-bench: option --rank: %lld is not below --world-size %lld\n",
            (long long)cfg.rank, (long long)cfg.world_size);
    return 2;
  }
  char proc[48];
  snprintf(proc, sizeof(proc), "allreduce-bench-%lld", (long long)cfg.rank);
  log_setup(proc, level);
  if (p.world > 1) {
    if (!cfg.peers[0] == !cfg.peer_template[0]) {
      fprintf(stderr,
              "allreduce-bench: with --rank give exactly one of --peers and "
              "--peer-template\n");
      return 2;
    }
    p.peers = calloc((size_t)p.world, sizeof(char *));
    struct net_addr *a = calloc((size_t)p.world + 1, sizeof(*a));
    if (!p.peers || !a) return 1;
    if (cfg.peer_template[0]) {
      for (int i = 0; i < p.world; i++) {
        char addr[300];
        if (net_expand_template(cfg.peer_template, i, addr, sizeof(addr)) < 0) {
          fprintf(stderr, "allreduce-bench: option --peer-template: \"%s\" needs one {i}\n",
                  cfg.peer_template);
          return 2;
        }
        p.peers[i] = strdup(addr);
      }
    } else {
      int n = net_parse_addr_list(cfg.peers, a, p.world + 1, err, sizeof(err));
      if (n != p.world) {
        fprintf(stderr, "allreduce-bench: option --peers: %s\n",
                n < 0 ? err : "the list must have --world-size addresses");
        return 2;
      }
      for (int i = 0; i < p.world; i++) {
        char addr[300];
        snprintf(addr, sizeof(addr), strchr(a[i].host, ':') ? "[%s]:%u" : "%s:%u", a[i].host,
                 a[i].port);
        p.peers[i] = strdup(addr);
      }
    }
    free(a);
  }
  r = run_rank(&p, (int)cfg.rank, 0);
  free_peers(&p);
  return r;
}
