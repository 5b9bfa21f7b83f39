/* test_nccl: the NCCL all-reduce backend on every GPU of this machine.
 *
 * 1. W = 1, and W = number of GPUs when there are several (one rank per
 *    GPU, each a process with its own pre-bound TCP bootstrap socket):
 *    in-place all-reduce of device buffers (sum and mean) for awkward counts,
 *    and the host-buffer path the CPU trainer uses (two slots in flight),
 *    against the exact sums of small-integer patterns; then all-gather,
 *    reduce-scatter, reduce and broadcast to the last rank, all-to-all and
 *    a send from rank 0 to the last rank, each against its reference; then
 *    the typed all-reduce, reduce-scatter and reduce (sum, max, min) on
 *    every ps_dtype against the TCP ring's own (ps_coll_*_typed on the
 *    bootstrap group: whole numbers for the floating types, so every order
 *    gives the same bits; any bits for the integers, which wrap).
 * 2. The CPU/GPU equivalence of results: the same 20 training steps (SGD
 *    with momentum) with ps-worker --allreduce-backend tcp and nccl, model on
 *    the CPU in both, W = min(GPUs, 4); the final parameters must agree
 *    within float tolerance (bit for bit for W <= 2, where a sum of two has
 *    one rounding in any order).
 * Exits 77 (skipped) where NCCL cannot be used: a build without it, or a
 * machine without a driver or GPU. */
#include <math.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "collective.h"
#include "collective_nccl.h"
#include "dtype.h"
#include "harness.h"
#include "net.h"
#include "ring_workers.h"

#define MAX_W 8

struct child_arg {
  struct ring_ports *g;
  int rank;
  int out_fd;
};

static float pattern(size_t i, int r) {
  return (float)((int)((131u * (uint64_t)i + 7u * (uint64_t)r) % 61u) - 30);
}

#define EXPECT(cond, ...)                                         \
  do {                                                            \
    if (!(cond)) {                                                \
      dprintf(a->out_fd, "rank %d line %d: ", a->rank, __LINE__); \
      dprintf(a->out_fd, __VA_ARGS__);                            \
      return 1;                                                   \
    }                                                             \
  } while (0)

static size_t count_wrong(const float *x, size_t n, int world, bool avg) {
  size_t bad = 0;
  for (size_t i = 0; i < n; i++) {
    float sum = 0;
    for (int r = 0; r < world; r++) sum += pattern(i, r);
    float want = avg ? sum / (float)world : sum;
    bad += !(fabsf(x[i] - want) <= 1e-6f * fabsf(want));
  }
  return bad;
}

/* Rank r's element i of type t (see the header comment) */
static void typed_pattern(int t, void *p, size_t i, int r) {
  float f = pattern(i, r);
  uint64_t bits = ((uint64_t)i * 0x9e3779b97f4a7c15ull) ^ ((uint64_t)r << 40) ^ (uint64_t)r;
  switch (t) {
    case DTYPE_FLOAT32:
      ((float *)p)[i] = f;
      break;
    case DTYPE_FLOAT64:
      ((double *)p)[i] = f;
      break;
    case DTYPE_FLOAT16:
      ((uint16_t *)p)[i] = dtype_float_to_half(f);
      break;
    case DTYPE_BFLOAT16:
      ((uint16_t *)p)[i] = dtype_float_to_bf16(f);
      break;
    default:
      memcpy((char *)p + i * dtype_size(t), &bits, dtype_size(t));
  }
}

/* NCCL's reductions of every type against the ring's on the same inputs */
static int typed_checks(struct child_arg *a, ps_coll *c, struct ps_nccl *n) {
  const int W = a->g->world;
  const size_t m = 4099;
  char err[512];
  unsigned char *x = malloc((size_t)W * m * 8), *y = malloc((size_t)W * m * 8);
  void *d, *d2;
  EXPECT(x && y && ps_nccl_dev_alloc(n, (size_t)W * m * 8, &d) == PS_OK &&
             ps_nccl_dev_alloc(n, m * 8, &d2) == PS_OK,
         "allocation");
  for (int t = 0; t < DTYPE_COUNT; t++)
    for (int op = PS_REDOP_SUM; op <= PS_REDOP_MIN; op++) {
      if (op == PS_REDOP_AVG) continue; /* NCCL pre-multiplies floats: other roundings */
      const size_t z = dtype_size(t), all = (size_t)W * m * z;
      for (int kind = 0; kind < 3; kind++) {
        for (size_t i = 0; i < (size_t)W * m; i++) typed_pattern(t, x, i, a->rank);
        memcpy(y, x, all);
        ps_status gpu = ps_nccl_to_device(n, d, x, all);
        ps_status cpu;
        /* bytes of the result to compare: a reduce's only on the root */
        size_t out = kind == 2 && a->rank != W - 1 ? 0 : m * z;
        if (kind == 0) {
          if (gpu == PS_OK) gpu = ps_nccl_allreduce_typed_dev(n, d, m, (ps_dtype)t, op);
          cpu = ps_coll_allreduce_typed(c, y, m, (ps_dtype)t, op);
        } else if (kind == 1) {
          if (gpu == PS_OK) gpu = ps_nccl_reduce_scatter_typed_dev(n, d, d2, m, (ps_dtype)t, op);
          cpu = ps_coll_reduce_scatter_typed(c, x, y, m, (ps_dtype)t, op);
        } else {
          if (gpu == PS_OK) gpu = ps_nccl_reduce_typed_dev(n, d, m, (ps_dtype)t, op, W - 1);
          cpu = ps_coll_reduce_typed(c, y, m, (ps_dtype)t, op, W - 1);
        }
        if (gpu == PS_OK) gpu = ps_nccl_sync(n);
        if (gpu == PS_OK) gpu = ps_nccl_to_host(n, x, kind == 1 ? d2 : d, out);
        EXPECT(gpu == PS_OK && cpu == PS_OK, "%s %d of %s: %s",
               kind == 0   ? "allreduce"
               : kind == 1 ? "reduce_scatter"
                           : "reduce",
               op, dtype_name(t), ps_nccl_errmsg(n, err, sizeof(err)));
        EXPECT(memcmp(x, y, out) == 0, "%s op %d of %s: NCCL's result differs from the ring's",
               kind == 0   ? "allreduce"
               : kind == 1 ? "reduce_scatter"
                           : "reduce",
               op, dtype_name(t));
      }
    }
  ps_nccl_dev_free(n, d2);
  ps_nccl_dev_free(n, d);
  free(x);
  free(y);
  return 0;
}

static int child(void *p) {
  struct child_arg *a = p;
  struct ring_ports *g = a->g;
  for (int q = 0; q < g->world; q++)
    if (q != a->rank) close(g->lfd[q]);
  struct ps_coll_opts o = {.rank = a->rank,
                           .world_size = g->world,
                           .peers = g->peers,
                           .job_id = "nccl-test",
                           .listen_fd = g->lfd[a->rank],
                           .connect_timeout_ms = 30000};
  ps_coll *c;
  struct ps_nccl *n;
  char err[512];
  EXPECT(ps_coll_open(&o, &c, err, sizeof(err)) == PS_OK, "TCP bootstrap: %s", err);
  EXPECT(ps_nccl_open(c, &n, err, sizeof(err)) == PS_OK, "NCCL: %s", err);
  size_t counts[] = {1, 3, 1000, 4097, (size_t)1 << 20 | 7};
  size_t maxn = (size_t)1 << 20 | 7;
  float *h = malloc(maxn * sizeof(float));
  void *d;
  EXPECT(h && ps_nccl_dev_alloc(n, maxn * sizeof(float), &d) == PS_OK, "allocation");
  for (size_t k = 0; k < sizeof(counts) / sizeof(counts[0]); k++) {
    for (int avg = 0; avg < 2; avg++) {
      size_t cnt = counts[k];
      for (size_t i = 0; i < cnt; i++) h[i] = pattern(i, a->rank);
      enum ps_redop op = avg ? PS_REDOP_AVG : PS_REDOP_SUM;
      EXPECT(ps_nccl_to_device(n, d, h, cnt * sizeof(float)) == PS_OK &&
                 ps_nccl_allreduce_dev(n, d, cnt, op) == PS_OK && ps_nccl_sync(n) == PS_OK &&
                 ps_nccl_to_host(n, h, d, cnt * sizeof(float)) == PS_OK,
             "device all-reduce of %zu: %s", cnt, ps_nccl_errmsg(n, err, sizeof(err)));
      size_t bad = count_wrong(h, cnt, g->world, avg);
      EXPECT(bad == 0, "device %s of %zu floats: %zu wrong", avg ? "avg" : "sum", cnt, bad);
    }
  }
  /* The trainer's path: host buffers, two slots in flight at once. */
  float *h2 = malloc(5000 * sizeof(float));
  EXPECT(h2, "allocation");
  for (size_t i = 0; i < maxn; i++) h[i] = pattern(i, a->rank);
  for (size_t i = 0; i < 5000; i++) h2[i] = pattern(i, a->rank);
  EXPECT(ps_nccl_allreduce_host_async(n, 0, h2, 5000, PS_REDOP_SUM) == PS_OK &&
             ps_nccl_allreduce_host_async(n, 1, h, maxn, PS_REDOP_AVG) == PS_OK,
         "host all-reduce: %s", ps_nccl_errmsg(n, err, sizeof(err)));
  EXPECT(ps_nccl_wait_slot(n, 0) == PS_OK && ps_nccl_wait_slot(n, 1) == PS_OK, "wait: %s",
         ps_nccl_errmsg(n, err, sizeof(err)));
  EXPECT(count_wrong(h2, 5000, g->world, false) == 0, "host sum wrong");
  EXPECT(count_wrong(h, maxn, g->world, true) == 0, "host avg wrong");
  /* The other collectives, 4099 floats per rank (sizes in d: W blocks). */
  const int W = g->world, r = a->rank;
  const size_t m = 4099;
  void *d2;
  EXPECT((size_t)W * m <= maxn && ps_nccl_dev_alloc(n, (size_t)W * m * sizeof(float), &d2) == PS_OK,
         "allocation");
  for (size_t i = 0; i < (size_t)W * m; i++) h[i] = pattern(i, r);
  const size_t mb = m * sizeof(float), all = (size_t)W * mb;
  EXPECT(ps_nccl_to_device(n, d, h, all) == PS_OK && ps_nccl_allgather_dev(n, d, d2, mb) == PS_OK &&
             ps_nccl_sync(n) == PS_OK,
         "allgather: %s", ps_nccl_errmsg(n, err, sizeof(err)));
  float *hb = malloc(all);
  EXPECT(hb && ps_nccl_to_host(n, hb, d2, all) == PS_OK, "copy");
  for (int q = 0; q < W; q++)
    for (size_t i = 0; i < m; i++) EXPECT(hb[(size_t)q * m + i] == pattern(i, q), "allgather");
  EXPECT(ps_nccl_reduce_scatter_dev(n, d, d2, m, PS_REDOP_SUM) == PS_OK &&
             ps_nccl_sync(n) == PS_OK && ps_nccl_to_host(n, hb, d2, mb) == PS_OK,
         "reduce_scatter: %s", ps_nccl_errmsg(n, err, sizeof(err)));
  for (size_t i = 0; i < m; i++) {
    float s = 0;
    for (int q = 0; q < W; q++) s += pattern((size_t)r * m + i, q);
    EXPECT(hb[i] == s, "reduce_scatter element %zu", i);
  }
  EXPECT(ps_nccl_alltoall_dev(n, d, d2, mb) == PS_OK && ps_nccl_sync(n) == PS_OK &&
             ps_nccl_to_host(n, hb, d2, all) == PS_OK,
         "alltoall: %s", ps_nccl_errmsg(n, err, sizeof(err)));
  for (int s = 0; s < W; s++)
    for (size_t i = 0; i < m; i++)
      EXPECT(hb[(size_t)s * m + i] == pattern((size_t)r * m + i, s), "alltoall");
  EXPECT(ps_nccl_reduce_dev(n, d, m, PS_REDOP_MAX, W - 1) == PS_OK &&
             ps_nccl_broadcast_dev(n, d, mb, W - 1) == PS_OK && ps_nccl_sync(n) == PS_OK &&
             ps_nccl_to_host(n, hb, d, mb) == PS_OK,
         "reduce + broadcast: %s", ps_nccl_errmsg(n, err, sizeof(err)));
  for (size_t i = 0; i < m; i++) {
    float mx = pattern(i, 0);
    for (int q = 1; q < W; q++) mx = fmaxf(mx, pattern(i, q));
    EXPECT(hb[i] == mx, "reduce max to %d, then broadcast from it: element %zu", W - 1, i);
  }
  if (W > 1 && (r == 0 || r == W - 1)) {
    for (size_t i = 0; i < m; i++) h[i] = r == 0 ? pattern(i, 77) : 0;
    EXPECT(ps_nccl_to_device(n, d2, h, mb) == PS_OK &&
               (r == 0 ? ps_nccl_send_dev(n, d2, mb, W - 1) : ps_nccl_recv_dev(n, d2, mb, 0)) ==
                   PS_OK &&
               ps_nccl_sync(n) == PS_OK && ps_nccl_to_host(n, hb, d2, mb) == PS_OK,
           "send/recv: %s", ps_nccl_errmsg(n, err, sizeof(err)));
    for (size_t i = 0; r == W - 1 && i < m; i++) EXPECT(hb[i] == pattern(i, 77), "recv");
  }
  if (typed_checks(a, c, n)) return 1;
  free(hb);
  ps_nccl_dev_free(n, d2);
  ps_nccl_dev_free(n, d);
  free(h);
  free(h2);
  ps_nccl_close(n);
  EXPECT(ps_coll_barrier(c) == PS_OK, "barrier");
  ps_coll_close(c);
  return 0;
}

static void collective_checks(int world) {
  struct ring_ports g;
  ring_ports_open(&g, world);
  struct child_arg args[MAX_W];
  pid_t pid[MAX_W];
  int rfd[MAX_W];
  for (int r = 0; r < world; r++) {
    int pfd[2];
    REQUIRE(pipe(pfd) == 0, "pipe");
    args[r] = (struct child_arg){.g = &g, .rank = r, .out_fd = pfd[1]};
    pid[r] = harness_fork(child, &args[r]);
    close(pfd[1]);
    rfd[r] = pfd[0];
  }
  ring_ports_close(&g);
  for (int r = 0; r < world; r++) {
    int st = harness_wait(pid[r], 240000);
    char msg[600] = "";
    ssize_t k = read(rfd[r], msg, sizeof(msg) - 1);
    msg[k > 0 ? k : 0] = 0;
    close(rfd[r]);
    REQUIRE(st >= 0 && WIFEXITED(st) && WEXITSTATUS(st) == 0, "W=%d rank %d: %s", world, r, msg);
  }
  printf("NCCL all-reduce W=%d: device and host paths correct\n", world);
}

static void equivalence(int world) {
  harness_require_dataset();
  char dump[2][512];
  const char *backend[2] = {"tcp", "nccl"};
  for (int b = 0; b < 2; b++) {
    snprintf(dump[b], sizeof(dump[b]), "%s/params-%s.bin", harness_dir(), backend[b]);
    const char *args[] = {"--allreduce-backend", backend[b], "--device",    "cpu", "--epochs", "1",
                          "--batch-size",        "64",       "--max-steps", "20",  "--seed",   "3",
                          "--dump-params",       dump[b],    NULL};
    struct ring_workers rw;
    ring_workers_start(&rw, world, args, NULL);
    REQUIRE(ring_workers_wait(&rw, 240000) == 0, "%s run failed", backend[b]);
  }
  FILE *fa = fopen(dump[0], "rb"), *fb = fopen(dump[1], "rb");
  REQUIRE(fa && fb, "missing dumps");
  double d2 = 0, r2 = 0;
  size_t n = 0, differ = 0;
  float x, y;
  while (fread(&x, 4, 1, fa) == 1 && fread(&y, 4, 1, fb) == 1) {
    d2 += ((double)x - y) * ((double)x - y);
    r2 += (double)x * x;
    differ += x != y;
    n++;
  }
  fclose(fa);
  fclose(fb);
  double rel = sqrt(d2 / r2);
  printf(
      "CPU (tcp) vs GPU (nccl) all-reduce, W=%d, 20 steps: %zu parameters, %zu differ, "
      "relative L2 %.3g\n",
      world, n, differ, rel);
  REQUIRE(n > 0, "empty dumps");
  if (world <= 2) REQUIRE(differ == 0, "W=%d should agree bit for bit", world);
  REQUIRE(rel < 1e-5, "relative L2 %.3g", rel);
}

int main(void) {
  char why[256];
  int ndev = ps_nccl_device_count(why, sizeof(why));
  if (ndev <= 0) { /* no plugin (the loader says why), or no GPU */
    printf("SKIP: %s\n", why);
    return 77;
  }
  harness_dir();
  collective_checks(1);
  if (ndev > 1) collective_checks(ndev < MAX_W ? ndev : MAX_W);
  equivalence(ndev < 4 ? ndev : 4);
  return 0;
}
