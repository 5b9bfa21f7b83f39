/* Per-key owners (ps_declare_owned) against S=2 real shards: W=4 worker
 * processes, tensor A owned by ranks {0,1}, B by {2,3}; each rank pushes
 * and pulls only its own tensor.
 *  - bsp: each key's version advances when its two owners pushed (every
 *    pull of step s gets version s exactly), and the value is the mean over
 *    the owners only: with SGD lr 1, rank r pushing (r + 1) * (s + 1) at
 *    step s, A ends at -1.5 * sum(s + 1) and B at -3.5 * sum(s + 1). A rank
 *    pushing or pulling the other tensor is refused (PS_ERR_INVALID naming
 *    the tensor and the rank); a new process resumes at STEPS
 *    (ps_resume_step counts only the keys it owns); a layout whose owners
 *    differ is refused with a message naming both owner sets.
 *  - ssp:1: rank 1 holds back until B's owners have finished every step:
 *    B never waits for it (its bound is B's owners), while rank 0, which
 *    shares A with it, stops at clock 2 (K = 1) until rank 1 moves. The
 *    final values are those of bsp (every push applied once, g / 2 owners).
 * Resends after a reconnect stay duplicates per key: tests/unit/test_owners
 * (the store) and test_reconnect (the path) cover them. */
#include <stdatomic.h>
#include <stdint.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include "clock.h"
#include "harness.h"
#include "ps.h"

#define S 2
#define W 4
#define STEPS 6
#define NT 2
static const char *const names[NT] = {"A", "B"};
static const uint64_t counts[NT] = {3000, 1000}; /* 4 KiB chunks: 3 + 1 keys */
static const int own_a[] = {0, 1}, own_b[] = {2, 3};
static const int *const owners[NT] = {own_a, own_b};
static const int num_owners[NT] = {2, 2};

struct shared {
  _Atomic int b_done;        /* B's owners that finished every step */
  _Atomic uint64_t pushed0;  /* rank 0: steps pushed */
  _Atomic uint64_t at_b_end; /* rank 0's steps pushed when B's owners were done */
};
static struct shared *sh;
static struct test_server servers[S];
static const char *mode;

/* A client of rank that declares the layout with own as owners; *st gets
 * what ps_declare_owned answered (NULL: it must succeed). */
static ps_client *connect_client(int rank, const int *const *own, ps_status *st) {
  const char *addrs[S];
  for (int i = 0; i < S; i++) addrs[i] = servers[i].addr;
  struct ps_client_opts o = {.servers = addrs,
                             .num_servers = S,
                             .rank = rank,
                             .world_size = W,
                             .chunk_bytes = 4096,
                             .job_id = "test_owners"};
  ps_client *c;
  char err[256];
  REQUIRE(ps_client_new(&o, &c, err, sizeof(err)) == PS_OK, "rank %d connect: %s", rank, err);
  ps_status got = ps_declare_owned(c, NT, names, counts, own, num_owners);
  if (st)
    *st = got;
  else
    REQUIRE(got == PS_OK, "rank %d declare: %s", rank, ps_errmsg(c, err, sizeof(err)));
  return c;
}

/* The value every element of tensor t has after STEPS steps. */
static float expected(int t) {
  float mean = t == 0 ? 1.5f : 3.5f; /* mean of (r + 1) over the owners */
  return -mean * (float)(STEPS * (STEPS + 1) / 2);
}

static int worker(void *arg) {
  int rank = (int)(intptr_t)arg;
  bool ssp = strcmp(mode, "bsp") != 0;
  ps_client *c = connect_client(rank, owners, NULL);
  int t = rank < 2 ? 0 : 1, other = 1 - t;
  float *p = calloc(counts[t], sizeof(float)), *g = malloc(counts[t] * sizeof(float));
  float *q = calloc(counts[other], sizeof(float));
  char err[512];
  /* any rank may initialise; only owners push and pull */
  if (rank == 0)
    for (int i = 0; i < NT; i++) REQUIRE(ps_init(c, i, i == t ? p : q) == PS_OK, "init %d", i);
  uint64_t v;
  REQUIRE(ps_push(c, other, 0, q) == PS_ERR_INVALID, "rank %d pushed a tensor it does not own",
          rank);
  ps_errmsg(c, err, sizeof(err));
  REQUIRE(strstr(err, names[other]) && strstr(err, "rank") && strstr(err, "does not own"),
          "message: %s", err);
  if (rank == 0) printf("non-owner push refused: %s\n", err);
  REQUIRE(ps_pull(c, other, 0, q, &v) == PS_ERR_INVALID, "rank %d pulled a tensor it does not own",
          rank);
  if (ssp && rank == 1) {
    /* B must finish without waiting for rank 1, and rank 0 get as far as
     * K allows; then a window in which it must not get further */
    for (int i = 0; i < 2000 && (atomic_load(&sh->b_done) < 2 || atomic_load(&sh->pushed0) < 2);
         i++)
      clock_sleep_ms(10);
    clock_sleep_ms(200);
    atomic_store(&sh->at_b_end, atomic_load(&sh->pushed0));
  }
  for (uint64_t s = 0; s < STEPS; s++) {
    REQUIRE(ps_pull(c, t, s, p, &v) == PS_OK, "rank %d pull at step %llu: %s", rank,
            (unsigned long long)s, ps_errmsg(c, err, sizeof(err)));
    REQUIRE(ssp ? v >= s : v == s, "%s: rank %d got version %llu at step %llu", mode, rank,
            (unsigned long long)v, (unsigned long long)s);
    for (uint64_t i = 0; i < counts[t]; i++) g[i] = (float)((rank + 1) * (s + 1));
    REQUIRE(ps_push(c, t, s, g) == PS_OK, "rank %d push %llu: %s", rank, (unsigned long long)s,
            ps_errmsg(c, err, sizeof(err)));
    if (rank == 0) atomic_store(&sh->pushed0, s + 1);
  }
  if (t == 1) atomic_fetch_add(&sh->b_done, 1);
  /* the other owner's last push is in once the key reaches STEPS (BSP:
   * STEPS; ASP/SSP: 2 * STEPS updates) */
  REQUIRE(ps_pull(c, t, STEPS, p, &v) == PS_OK, "final pull");
  if (ssp)
    for (int i = 0; i < 2000 && v < 2 * STEPS; i++) {
      clock_sleep_ms(5);
      REQUIRE(ps_pull(c, t, STEPS, p, &v) == PS_OK, "final pull");
    }
  for (uint64_t i = 0; i < counts[t]; i++)
    REQUIRE(p[i] == expected(t), "%s: rank %d %s[%llu] = %g, expected %g (the mean over owners)",
            mode, rank, names[t], (unsigned long long)i, (double)p[i], (double)expected(t));
  free(p);
  free(g);
  free(q);
  ps_client_free(c);
  return 0;
}

static void run(const char *m) {
  mode = m;
  memset(sh, 0, sizeof(*sh));
  const char *extra[] = {"--consistency",     m,       "--optimizer", "sgd",
                         "--staleness-aware", "false", NULL};
  for (int i = 0; i < S; i++) harness_start_server(&servers[i], i, S, W, 1.0, extra);
  pid_t pids[W];
  for (int r = 0; r < W; r++) pids[r] = harness_fork(worker, (void *)(intptr_t)r);
  for (int r = 0; r < W; r++) {
    int st = harness_wait(pids[r], 60000);
    REQUIRE(st >= 0 && WIFEXITED(st) && WEXITSTATUS(st) == 0, "%s: worker %d failed (status %d)", m,
            r, st);
  }
  /* a new process of each rank resumes at STEPS: its clock counts only the
   * keys it owns (the others' clocks stay 0) */
  for (int r = 0; r < W; r += 2) {
    ps_client *c = connect_client(r, owners, NULL);
    uint64_t step = 0;
    REQUIRE(ps_resume_step(c, &step) == PS_OK && step == STEPS, "%s: rank %d resumes at %llu", m, r,
            (unsigned long long)step);
    ps_client_free(c);
  }
  /* the same names and sizes with other owners: refused, both sets named */
  static const int swap_a[] = {0, 2}, swap_b[] = {1, 3};
  static const int *const other[NT] = {swap_a, swap_b};
  ps_status st;
  ps_client *c = connect_client(0, other, &st);
  char err[512];
  ps_errmsg(c, err, sizeof(err));
  REQUIRE(st == PS_ERR_LAYOUT_MISMATCH, "%s: other owners: status %d (%s)", m, (int)st, err);
  REQUIRE(strstr(err, "owned by ranks {0,1}") && strstr(err, "owned by ranks {0,2}"),
          "%s: a layout with other owners: %s", m, err);
  if (strcmp(m, "bsp") == 0) printf("other owners refused: %s\n", err);
  ps_client_free(c);
  for (int i = 0; i < S; i++) harness_stop(servers[i].pid, SIGTERM, 10000);
}

int main(void) {
  sh = mmap(NULL, sizeof(*sh), PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  REQUIRE(sh != MAP_FAILED, "mmap");
  run("bsp");
  run("ssp:1");
  uint64_t at = atomic_load(&sh->at_b_end);
  printf(
      "ssp:1: B's owners finished %d steps while rank 1 held back; rank 0 (A) had pushed "
      "%llu\n",
      STEPS, (unsigned long long)at);
  REQUIRE(atomic_load(&sh->b_done) == 2, "ssp:1: B's owners did not finish");
  REQUIRE(at == 2, "ssp:1: rank 0 pushed %llu steps of A while its co-owner pushed none (K = 1: 2)",
          (unsigned long long)at);
  printf("owners: bsp and ssp:1 per key over the owners as specified\n");
  return 0;
}
