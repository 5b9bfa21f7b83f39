/* bench_client: one ps-bench client process (see ps-bench.c for the
 * measurements it takes part in): its own ps_client, the patterns it pushes
 * and checks pulls against, and the rounds of --depth requests in flight. */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "clock.h"
#include "log.h"
#include "net.h"
#include "ps.h"
#include "ps_bench.h"

/* ---- client process ----------------------------------------------------- */

struct client {
  const struct bench_plan *plan;
  int rank;
  int fd; /* channel to the parent */
  ps_client *c;
  int num_tensors;             /* num_sizes * depth */
  float **expect;              /* per tensor: the pattern; also the pushed gradient */
  uint64_t version[MAX_SIZES]; /* what a pull of size t must see now */
  uint64_t step[MAX_SIZES];    /* the step this client pushes next to size t's tensors */
  uint64_t bad_init[MAX_SIZES];
  float **buf;             /* depth pull destinations, as large as the largest size */
  ps_request **req;        /* depth requests of one iteration */
  uint64_t *issued, *done; /* depth timestamps of one iteration (done: receiver thread) */
  uint64_t *samples;
  uint64_t samples_cap;
  int reported;
};

/* Value i of tensor t: finite, nonzero, exact in float32 and different per
 * tensor and offset, so a chunk delivered to the wrong place is caught. */
static float pattern(int t, uint64_t i) {
  uint32_t h = (uint32_t)(i + 1) * 2654435761u ^ (uint32_t)(t + 1) * 0x85ebca6bu;
  return (float)(h >> 9) + 0.5f;
}

static int client_fail(struct client *x, const char *what, int t, ps_status st) {
  char msg[512];
  const char *detail = x->c ? ps_errmsg(x->c, msg, sizeof(msg)) : "";
  fprintf(stderr, "ps-bench: client %d: %s", x->rank, what);
  if (t >= 0) fprintf(stderr, " of bench.%" PRIu64, x->plan->sizes[t]);
  fprintf(stderr, ": %s%s%s\n", ps_strerror(st), detail[0] ? ": " : "", detail);
  return 1;
}

static void report_mismatch(struct client *x, int t, int j, uint64_t i, float got) {
  if (x->reported++ >= MAX_REPORTED_MISMATCHES) return;
  uint32_t bits;
  memcpy(&bits, &got, sizeof(bits));
  fprintf(stderr,
          "ps-bench: client %d: bench.%" PRIu64 " tensor %d [%" PRIu64 "] = %.9g (0x%08" PRIx32
          "), expected %.9g (version %" PRIu64 ")\n",
          x->rank, x->plan->sizes[t], j, i, (double)got, bits,
          (double)x->expect[tensor_of(x->plan, t, j)][i], x->version[t]);
}

/* Counts elements of pull destination j that differ from the pattern of
 * request j of size t, bit for bit. */
static uint64_t check_all(struct client *x, int t, int j) {
  uint64_t n = x->plan->sizes[t] / 4, bad = 0;
  const float *want = x->expect[tensor_of(x->plan, t, j)], *got = x->buf[j];
  if (memcmp(got, want, n * 4) == 0) return 0;
  for (uint64_t i = 0; i < n; i++) {
    if (memcmp(&got[i], &want[i], 4) != 0) {
      bad++;
      report_mismatch(x, t, j, i, got[i]);
    }
  }
  return bad;
}

/* Spot k of nspots spread evenly over [0, n), first and last included. */
static uint64_t spot(uint64_t k, uint64_t nspots, uint64_t n) {
  return nspots > 1 ? k * (n - 1) / (nspots - 1) : 0;
}

static uint64_t num_spots(const struct client *x, int t) {
  uint64_t n = x->plan->sizes[t] / 4, want = 2 * chunks_of(x->plan, x->plan->sizes[t]);
  if (want < 64) want = 64;
  return want < n ? want : n;
}

static void poison_spots(struct client *x, int t, int j) {
  uint64_t n = x->plan->sizes[t] / 4, ns = num_spots(x, t);
  uint32_t poison = POISON_BITS;
  for (uint64_t k = 0; k < ns; k++) memcpy(&x->buf[j][spot(k, ns, n)], &poison, 4);
}

static uint64_t check_spots(struct client *x, int t, int j) {
  uint64_t n = x->plan->sizes[t] / 4, ns = num_spots(x, t), bad = 0;
  const float *want = x->expect[tensor_of(x->plan, t, j)];
  for (uint64_t k = 0; k < ns; k++) {
    uint64_t i = spot(k, ns, n);
    if (memcmp(&x->buf[j][i], &want[i], 4) != 0) {
      bad++;
      report_mismatch(x, t, j, i, x->buf[j][i]);
    }
  }
  return bad;
}

/* Completion callback (a receiver thread): when request *arg finished.
 * record() waits for the store: libps runs the callback before ps_wait
 * returns, but older builds (a baseline) ran it just after. */
static void on_done(ps_status st, void *arg) {
  (void)st;
  __atomic_store_n((uint64_t *)arg, clock_now_ns(), __ATOMIC_RELEASE);
}

/* Records the latencies of one iteration's requests in lat (may be NULL)
 * and clears the completion times for the next. */
static void record(struct client *x, uint64_t *lat) {
  for (int j = 0; j < x->plan->depth; j++) {
    uint64_t done;
    while ((done = __atomic_load_n(&x->done[j], __ATOMIC_ACQUIRE)) == 0) {
    }
    if (lat) lat[j] = done - x->issued[j];
    x->done[j] = 0;
  }
}

/* Pulls the current version of every tensor of size t at once and checks
 * them: all elements (full) or the spots. Adds failed checks to *bad; lat
 * (may be NULL) gets depth latencies. Returns 0 or 1 after printing why a
 * pull failed. */
static int pull_round(struct client *x, int t, bool full, uint64_t *lat, uint64_t *bad) {
  int D = x->plan->depth, issued = 0, ret = 0;
  ps_status st = PS_OK, first = PS_OK;
  for (int j = 0; j < D; j++) {
    if (full)
      memset(x->buf[j], 0xff, x->plan->sizes[t]);
    else
      poison_spots(x, t, j);
  }
  bool batch = D > 1 && !x->plan->cfg->no_batch;
  if (batch) ps_batch_begin(x->c);
  for (; issued < D; issued++) {
    x->issued[issued] = clock_now_ns();
    st = ps_pull_async(x->c, tensor_of(x->plan, t, issued), x->version[t], x->buf[issued], on_done,
                       &x->done[issued], &x->req[issued]);
    if (st != PS_OK) break;
  }
  if (batch) ps_batch_end(x->c);
  if (st != PS_OK) ret = client_fail(x, "pull", t, first = st);
  for (int j = 0; j < issued; j++) {
    uint64_t version = 0;
    st = ps_wait(x->req[j], &version);
    if (st != PS_OK) {
      if (first == PS_OK) ret = client_fail(x, "pull", t, first = st);
      continue;
    }
    if (version != x->version[t]) {
      (*bad)++;
      if (x->reported++ < MAX_REPORTED_MISMATCHES)
        fprintf(stderr,
                "ps-bench: client %d: pulled bench.%" PRIu64 " tensor %d at version %" PRIu64
                ", expected %" PRIu64 "\n",
                x->rank, x->plan->sizes[t], j, version, x->version[t]);
    }
    *bad += full ? check_all(x, t, j) : check_spots(x, t, j);
  }
  if (ret == 0) record(x, lat);
  return ret;
}

/* Pushes the next step of every tensor of size t at once (timed per
 * request); with barrier, then waits for every worker's pushes. */
static int push_round(struct client *x, int t, bool barrier, uint64_t *lat) {
  const struct bench_plan *p = x->plan;
  int D = p->depth, issued = 0, ret = 0;
  ps_status st = PS_OK, first = PS_OK;
  bool batch = D > 1 && !p->cfg->no_batch;
  if (batch) ps_batch_begin(x->c);
  for (; issued < D; issued++) {
    int k = tensor_of(p, t, issued);
    x->issued[issued] = clock_now_ns();
    st = ps_push_async(x->c, k, x->step[t], x->expect[k], on_done, &x->done[issued],
                       &x->req[issued]);
    if (st != PS_OK) break;
  }
  if (batch) ps_batch_end(x->c);
  if (st != PS_OK) ret = client_fail(x, "push", t, first = st);
  for (int j = 0; j < issued; j++)
    if ((st = ps_wait(x->req[j], NULL)) != PS_OK && first == PS_OK)
      ret = client_fail(x, "push", t, first = st);
  if (ret) return ret;
  record(x, lat);
  if (barrier && (st = ps_barrier(x->c)) != PS_OK)
    return client_fail(x, "barrier after push", t, st);
  x->step[t]++;
  /* BSP: the keys moved once every client pushed the step; ASP: by one per
   * push of any client (known once all have pushed as often, at a barrier) */
  x->version[t] += p->asp ? (uint64_t)p->world : 1;
  return 0;
}

static int send_msg(struct client *x, struct msg *m, const uint64_t *values) {
  m->rank = (uint32_t)x->rank;
  int r = net_write_all(x->fd, m, sizeof(*m));
  if (r == 0 && m->num_values) r = net_write_all(x->fd, values, m->num_values * sizeof(uint64_t));
  if (r < 0) fprintf(stderr, "ps-bench: client %d: lost the parent: %s\n", x->rank, strerror(-r));
  return r < 0 ? 1 : 0;
}

static int round_of(struct client *x, int t, enum bench_op op, bool full, uint64_t *lat,
                    uint64_t *bad) {
  return op == OP_PULL ? pull_round(x, t, full, lat, bad) : push_round(x, t, op == OP_PUSH, lat);
}

/* Warm-up, iteration count from the parent, timed loop, check, report. */
static int client_measure(struct client *x, int t, enum bench_op op) {
  const struct bench_config *cfg = x->plan->cfg;
  uint64_t D = (uint64_t)x->plan->depth;
  uint64_t bad = x->bad_init[t], iters = 0;
  ps_status st = ps_barrier(x->c);
  if (st != PS_OK) return client_fail(x, "barrier", t, st);
  uint64_t t0 = clock_now_ns();
  for (int64_t i = 0; i < cfg->warmup; i++) {
    int r = round_of(x, t, op, true, NULL, &bad);
    if (r) return r;
  }
  struct msg m = {.type = MSG_WARM};
  m.warm_ns = cfg->warmup ? (clock_now_ns() - t0) / (uint64_t)cfg->warmup : 0;
  if (send_msg(x, &m, NULL)) return 1;
  int r = net_read_all(x->fd, &iters, sizeof(iters));
  if (r < 0 || iters == 0) return r < 0 ? 1 : 3; /* the parent gave up */
  if (iters * D > x->samples_cap) {
    free(x->samples);
    x->samples_cap = 0;
    if (!(x->samples = malloc(iters * D * sizeof(uint64_t))))
      return client_fail(x, "samples", t, PS_ERR_NOMEM);
    x->samples_cap = iters * D;
  }
  if ((st = ps_barrier(x->c)) != PS_OK) return client_fail(x, "barrier", t, st);
  uint64_t start = clock_now_ns();
  for (uint64_t i = 0; i < iters; i++)
    if ((r = round_of(x, t, op, false, &x->samples[i * D], &bad))) return r;
  uint64_t end = clock_now_ns();
  /* Pushes without barriers: everyone must be done before the versions are
   * known. Then the pushes must have made exactly the steps counted and
   * changed nothing. */
  if (op == OP_PUSH_NB && (st = ps_barrier(x->c)) != PS_OK) return client_fail(x, "barrier", t, st);
  if ((r = pull_round(x, t, true, NULL, &bad))) return r;
  m = (struct msg){
      .type = MSG_RESULT, .start_ns = start, .end_ns = end, .bad = bad, .num_values = iters * D};
  return send_msg(x, &m, x->samples);
}

/* Frees what client_alloc allocated (NULL members are fine). */
static void client_free_values(struct client *x) {
  for (int k = 0; x->expect && k < x->num_tensors; k++) free(x->expect[k]);
  for (int j = 0; x->buf && j < x->plan->depth; j++) free(x->buf[j]);
  free(x->expect);
  free(x->buf);
  free(x->req);
  free(x->issued);
  free(x->done);
  free(x->samples);
}

/* The patterns, pull destinations and per-request slots. Returns 0 or -1. */
static int client_alloc(struct client *x, uint64_t largest) {
  const struct bench_plan *p = x->plan;
  size_t D = (size_t)p->depth;
  x->num_tensors = p->num_sizes * p->depth;
  if (!(x->expect = calloc((size_t)x->num_tensors, sizeof(*x->expect))) ||
      !(x->buf = calloc(D, sizeof(*x->buf))) || !(x->req = calloc(D, sizeof(*x->req))) ||
      !(x->issued = calloc(D, sizeof(uint64_t))) || !(x->done = calloc(D, sizeof(uint64_t))))
    return -1;
  for (size_t j = 0; j < D; j++)
    if (!(x->buf[j] = malloc(largest))) return -1;
  for (int t = 0; t < p->num_sizes; t++) {
    for (int j = 0; j < p->depth; j++) {
      int k = tensor_of(p, t, j);
      uint64_t n = p->sizes[t] / 4;
      if (!(x->expect[k] = malloc(p->sizes[t]))) return -1;
      for (uint64_t i = 0; i < n; i++) x->expect[k][i] = pattern(k, i);
    }
  }
  return 0;
}

int bench_client_main(const struct bench_plan *p, int rank, int fd) {
  struct client x = {.plan = p, .rank = rank, .fd = fd};
  char err[512];
  int T = p->num_sizes * p->depth, ret = 1;
  char(*names_buf)[48] = calloc((size_t)T, sizeof(*names_buf));
  const char **names = calloc((size_t)T, sizeof(*names));
  uint64_t *counts = calloc((size_t)T, sizeof(*counts)), largest = 0;
  ps_status st;
  struct ps_client_opts o = {.servers = p->servers,
                             .num_servers = p->num_shards,
                             .rank = rank,
                             .world_size = p->world,
                             .job_id = "ps-bench",
                             .auth_token = p->token,
                             .chunk_bytes = p->cfg->chunk_bytes,
                             .transport = p->cfg->transport};
  char proc[32];
  snprintf(proc, sizeof(proc), "ps-bench-%d", rank);
  log_setup(proc, p->log_level);
  if (!names_buf || !names || !counts) goto nomem;
  if ((st = ps_client_new(&o, &x.c, err, sizeof(err))) != PS_OK) {
    fprintf(stderr, "ps-bench: client %d: %s: %s\n", rank, ps_strerror(st), err);
    goto out;
  }
  for (int t = 0; t < p->num_sizes; t++) {
    for (int j = 0; j < p->depth; j++) {
      int k = tensor_of(p, t, j);
      if (p->depth == 1)
        snprintf(names_buf[k], sizeof(names_buf[k]), "bench.%" PRIu64, p->sizes[t]);
      else
        snprintf(names_buf[k], sizeof(names_buf[k]), "bench.%" PRIu64 ".%d", p->sizes[t], j);
      names[k] = names_buf[k];
      counts[k] = p->sizes[t] / 4;
    }
    if (p->sizes[t] > largest) largest = p->sizes[t];
  }
  if ((st = ps_declare(x.c, T, names, counts)) != PS_OK) {
    client_fail(&x, "declare", -1, st);
    goto out;
  }
  if (client_alloc(&x, largest) < 0) goto nomem;
  /* a shard that already holds a tensor keeps its values */
  for (int k = 0; rank == 0 && k < T; k++) {
    if ((st = ps_init(x.c, k, x.expect[k])) != PS_OK) {
      client_fail(&x, "init", k / p->depth, st);
      goto out;
    }
  }
  if ((st = ps_barrier(x.c)) != PS_OK) {
    client_fail(&x, "barrier after init", -1, st);
    goto out;
  }
  if (rank == 0) {
    uint64_t bytes[MAX_SHARDS];
    if ((st = ps_shard_bytes(x.c, bytes)) != PS_OK) {
      client_fail(&x, "shard bytes", -1, st);
      goto out;
    }
    struct msg m = {.type = MSG_PLACEMENT, .num_values = (uint64_t)p->num_shards};
    if (send_msg(&x, &m, bytes)) goto out;
  }
  /* Running shards may be past step 0 from an earlier run: start there. */
  for (int t = 0; t < p->num_sizes; t++) {
    for (int j = 0; j < p->depth; j++) {
      uint64_t v = 0;
      memset(x.buf[j], 0xff, p->sizes[t]);
      if ((st = ps_pull(x.c, tensor_of(p, t, j), 0, x.buf[j], &v)) != PS_OK) {
        client_fail(&x, "first pull", t, st);
        goto out;
      }
      if (j == 0) x.version[t] = v;
      if (v != x.version[t]) x.bad_init[t]++; /* one size's tensors move together */
      x.bad_init[t] += check_all(&x, t, j);
    }
    x.step[t] = p->asp ? 0 : x.version[t];
    if (x.bad_init[t] && rank == 0 && !p->local)
      fprintf(stderr,
              "ps-bench: bench.%" PRIu64
              " does not hold the pattern: were the shards "
              "started with --lr 0 and only used by ps-bench?\n",
              p->sizes[t]);
  }
  for (int t = 0; t < p->num_sizes; t++)
    for (int op = 0; op < NUM_OPS; op++)
      if ((p->ops & (1u << op)) && (ret = client_measure(&x, t, (enum bench_op)op)) != 0) goto out;
  ret = 1;
  if ((st = ps_barrier(x.c)) != PS_OK) {
    client_fail(&x, "final barrier", -1, st);
    goto out;
  }
  if (rank == 0 && p->local) {
    /* Only once the others have closed their connections, or they would
     * see the shards go away and try to reconnect. */
    uint64_t go = 0;
    if (net_read_all(fd, &go, sizeof(go)) < 0 || go == 0) goto out;
    if ((st = ps_shutdown_servers(x.c)) != PS_OK) {
      client_fail(&x, "shutdown", -1, st);
      goto out;
    }
  }
  ret = 0;
  goto out;
nomem:
  fprintf(stderr, "ps-bench: client %d: out of memory for the values\n", rank);
out:
  /* On failure, tell the parent first (EOF on the channel): it stops the run
   * even if freeing the client were to hang. */
  if (ret != 0) close(fd);
  ps_client_free(x.c);
  client_free_values(&x);
  free(names_buf);
  free(names);
  free(counts);
  return ret;
}
