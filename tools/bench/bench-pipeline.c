/* bench-pipeline: pipeline schedules run for real against the simulator's
 * prediction (pipeline.h).
 *
 * For each P of --stages it starts P ranks as processes on 127.0.0.1 (the
 * parent binds P listening sockets on port 0 and forks one child per rank,
 * as allreduce-bench does), one job group with point-to-point connections
 * (the job group is the pipeline group: W = P). Each rank executes its
 * stage's actions of every schedule for M = P, 2P, 4P, 8P micro-batches:
 * a computation is a deterministic amount of work (--compute loop: a busy
 * loop calibrated at start to take --forward-ms per forward, twice that per
 * backward, half of it each for ZB-H1's B and W, and 1/v of each per chunk
 * for interleaved, so every schedule runs the same model), a send or receive
 * is ps_coll_send / ps_coll_recv of --act-bytes, blocking, in list order, as
 * the trainer's executor runs them. --compute sleep sleeps instead, for a
 * machine with fewer cores than ranks, where busy loops would time-share.
 *
 * A step starts after a barrier; its time is the slowest rank's (an
 * all-reduce of max). Rank 0 prints, per schedule and M, the median of
 * --steps steps (after one warm-up step), the simulator's prediction with
 * the costs the ranks measured (the mean duration of each kind of
 * computation over all ranks, and the transfer time of one message, half a
 * ping-pong's round trip between ranks 0 and 1), the ideal (no bubble, no
 * transfer) and measured / predicted. */
#include <errno.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "clock.h"
#include "collective.h"
#include "net.h"
#include "pipeline.h"

enum { MAX_P = 16, MAX_LIST = 8, OP_KINDS = 4 };

struct opts {
  int stages[MAX_LIST], nstages;
  int scheds[4], nscheds;
  double forward_ms;
  size_t act_bytes;
  int steps;
  int sleep_compute;
};

static volatile uint64_t sink;

static void spin(uint64_t iters) {
  uint64_t x = sink;
  for (uint64_t i = 0; i < iters; i++) x = x * 6364136223846793005ULL + 1442695040888963407ULL;
  sink = x;
}

/* Busy-loop iterations per millisecond: the fastest of a few trials (the
 * least disturbed by other processes). */
static double calibrate(void) {
  double best = 0;
  for (int t = 0; t < 7; t++) {
    uint64_t n = 2000000;
    uint64_t t0 = clock_now_ns();
    spin(n);
    double ms = (clock_now_ns() - t0) / 1e6;
    if (ms > 0 && n / ms > best) best = n / ms;
  }
  return best;
}

struct rank {
  const struct opts *o;
  ps_coll *c;
  int rank, P;
  double iters_per_ms;
  char *buf;
  double spent[OP_KINDS]; /* ms per kind of computation, this rank */
  long count[OP_KINDS];
};

static void compute(struct rank *k, ps_pipe_op op, double ms) {
  uint64_t t0 = clock_now_ns();
  if (k->o->sleep_compute) {
    struct timespec ts = {(time_t)(ms / 1000), (long)(ms * 1e6) % 1000000000L};
    while (nanosleep(&ts, &ts) != 0 && errno == EINTR) {
    }
  } else {
    spin((uint64_t)(ms * k->iters_per_ms));
  }
  k->spent[op] += (clock_now_ns() - t0) / 1e6;
  k->count[op]++;
}

/* The nominal cost of op in ms for shape sh (per chunk). */
static double nominal(const struct opts *o, const struct ps_pipe_shape *sh, ps_pipe_op op) {
  double f = o->forward_ms / sh->chunks;
  return op == PS_PIPE_FORWARD ? f : op == PS_PIPE_BACKWARD ? 2 * f : f;
}

/* One step of this rank's list; its time in ms. */
static int run_step(struct rank *k, const struct ps_pipe_shape *sh, const struct ps_pipe_action *a,
                    size_t n, double *ms) {
  if (ps_coll_barrier(k->c) != PS_OK) return -1;
  uint64_t t0 = clock_now_ns();
  for (size_t i = 0; i < n; i++) {
    ps_status st = PS_OK;
    switch (a[i].op) {
      case PS_PIPE_FORWARD:
      case PS_PIPE_BACKWARD:
      case PS_PIPE_BACKWARD_INPUT:
      case PS_PIPE_BACKWARD_WEIGHT:
        compute(k, a[i].op, nominal(k->o, sh, a[i].op));
        break;
      case PS_PIPE_SEND_ACT:
      case PS_PIPE_SEND_GRAD:
        st = ps_coll_send(k->c, k->buf, k->o->act_bytes, a[i].peer_stage);
        break;
      case PS_PIPE_RECV_ACT:
      case PS_PIPE_RECV_GRAD:
        st = ps_coll_recv(k->c, k->buf, k->o->act_bytes, a[i].peer_stage);
        break;
      default:
        break; /* no data parallelism here: nothing to reduce or step */
    }
    if (st != PS_OK) return -1;
  }
  float t = (float)((clock_now_ns() - t0) / 1e6);
  if (ps_coll_allreduce(k->c, &t, 1, PS_REDOP_MAX) != PS_OK) return -1;
  *ms = t;
  return 0;
}

/* Half the median round trip of one message between ranks 0 and 1. */
static int transfer_ms(struct rank *k, double *out) {
  enum { N = 41 };
  float rt[N];
  for (int i = 0; i < N; i++) {
    uint64_t t0 = clock_now_ns();
    ps_status st = PS_OK;
    if (k->rank == 0) {
      st = ps_coll_send(k->c, k->buf, k->o->act_bytes, 1);
      if (st == PS_OK) st = ps_coll_recv(k->c, k->buf, k->o->act_bytes, 1);
    } else if (k->rank == 1) {
      st = ps_coll_recv(k->c, k->buf, k->o->act_bytes, 0);
      if (st == PS_OK) st = ps_coll_send(k->c, k->buf, k->o->act_bytes, 0);
    }
    if (st != PS_OK) return -1;
    rt[i] = (float)((clock_now_ns() - t0) / 1e6);
  }
  for (int i = 1; i < N; i++) {
    for (int j = i; j > 0 && rt[j - 1] > rt[j]; j--) {
      float t = rt[j];
      rt[j] = rt[j - 1];
      rt[j - 1] = t;
    }
  }
  float half = rt[N / 2] / 2;
  if (ps_coll_broadcast(k->c, &half, sizeof(half), 0) != PS_OK) return -1;
  *out = half;
  return 0;
}

static int cmp_double(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return x < y ? -1 : x > y;
}

static int bench_one(struct rank *k, struct ps_pipe_shape sh, double transfer) {
  char err[512];
  struct ps_pipe_action *a = NULL;
  size_t n = 0;
  double times[64];
  if (ps_pipe_actions(&sh, k->rank, &a, &n, err, sizeof(err)) != PS_OK) {
    fprintf(stderr, "bench-pipeline: %s\n", err);
    return -1;
  }
  memset(k->spent, 0, sizeof(k->spent));
  memset(k->count, 0, sizeof(k->count));
  int steps = k->o->steps, rc = 0;
  for (int s = 0; s <= steps && rc == 0; s++) {
    double ms;
    rc = run_step(k, &sh, a, n, &ms);
    if (s > 0) times[s - 1] = ms; /* step 0 warms up */
  }
  free(a);
  if (rc != 0) return -1;
  qsort(times, (size_t)steps, sizeof(double), cmp_double);
  /* the mean measured duration of each kind of computation over all ranks */
  float sums[2 * OP_KINDS];
  for (int i = 0; i < OP_KINDS; i++) sums[i] = (float)k->spent[i], sums[OP_KINDS + i] = k->count[i];
  if (ps_coll_allreduce(k->c, sums, 2 * OP_KINDS, PS_REDOP_SUM) != PS_OK) return -1;
  double mean[OP_KINDS];
  for (int i = 0; i < OP_KINDS; i++) {
    mean[i] = sums[OP_KINDS + i] > 0 ? sums[i] / sums[OP_KINDS + i] : 0;
  }
  if (k->rank != 0) return 0;
  struct ps_pipe_costs c = {mean[PS_PIPE_FORWARD], mean[PS_PIPE_BACKWARD],
                            mean[PS_PIPE_BACKWARD_INPUT], mean[PS_PIPE_BACKWARD_WEIGHT], transfer};
  if (sh.kind == PS_PIPE_ZBH1) c.backward = c.backward_input + c.weight;
  struct ps_pipe_sim sim;
  if (ps_pipe_simulate(&sh, &c, &sim, err, sizeof(err)) != PS_OK) {
    fprintf(stderr, "bench-pipeline: %s\n", err);
    return -1;
  }
  double med = times[steps / 2];
  printf("%-12s %2d %3d %2d %12.2f %13.2f %9.2f %8.3f %11.3f %6.2f\n",
         ps_pipe_schedule_name(sh.kind), sh.stages, sh.micro, sh.chunks, med, sim.step_time,
         sim.ideal_time, med / sim.step_time, sim.bubble, c.forward);
  fflush(stdout);
  return 0;
}

static int run_rank(const struct opts *o, int P, int rank, int lfd, char **peers) {
  char err[512];
  struct rank k = {.o = o, .rank = rank, .P = P};
  struct ps_coll_opts co = {.rank = rank,
                            .world_size = P,
                            .peers = (const char *const *)peers,
                            .job_id = "bench-pipeline",
                            .listen_fd = lfd,
                            .p2p = 1};
  if (ps_coll_open(&co, &k.c, err, sizeof(err)) != PS_OK) {
    fprintf(stderr, "bench-pipeline: rank %d: %s\n", rank, err);
    return 1;
  }
  k.buf = calloc(1, o->act_bytes ? o->act_bytes : 1);
  k.iters_per_ms = o->sleep_compute ? 0 : calibrate();
  double transfer = 0;
  int rc = k.buf && transfer_ms(&k, &transfer) == 0 ? 0 : 1;
  if (rc == 0 && rank == 0) {
    printf(
        "\n# P=%d act_bytes=%zu transfer=%.3f ms compute=%s forward=%.2f ms (per chunk: "
        "/v)\n",
        P, o->act_bytes, transfer, o->sleep_compute ? "sleep" : "loop", o->forward_ms);
    printf("%-12s %2s %3s %2s %12s %13s %9s %8s %11s %6s\n", "schedule", "P", "M", "v",
           "measured_ms", "predicted_ms", "ideal_ms", "meas/pred", "sim_bubble", "F_ms");
  }
  for (int si = 0; si < o->nscheds && rc == 0; si++) {
    for (int mult = 1; mult <= 8 && rc == 0; mult *= 2) {
      struct ps_pipe_shape sh = {(ps_pipe_schedule)o->scheds[si], P, P * mult,
                                 o->scheds[si] == PS_PIPE_INTERLEAVED ? 2 : 1};
      rc = bench_one(&k, sh, transfer) == 0 ? 0 : 1;
    }
  }
  if (rc != 0)
    fprintf(stderr, "bench-pipeline: rank %d failed: %s\n", rank,
            ps_coll_errmsg(k.c, err, sizeof(err)));
  free(k.buf);
  ps_coll_close(k.c);
  return rc;
}

static int run_local(const struct opts *o, int P) {
  int lfd[MAX_P];
  pid_t pid[MAX_P];
  char *peers[MAX_P], addrs[MAX_P][64], err[256];
  for (int r = 0; r < P; r++) {
    struct net_addr a = {.host = "127.0.0.1", .port = 0};
    lfd[r] = net_listen(&a, 16, err, sizeof(err));
    if (lfd[r] < 0) {
      fprintf(stderr, "bench-pipeline: %s\n", err);
      return 1;
    }
    snprintf(addrs[r], sizeof(addrs[r]), "127.0.0.1:%d", net_bound_port(lfd[r]));
    peers[r] = addrs[r];
  }
  fflush(NULL);
  for (int r = 0; r < P; r++) {
    pid[r] = fork();
    if (pid[r] == 0) {
      for (int q = 0; q < P; q++) {
        if (q != r) close(lfd[q]);
      }
      _exit(run_rank(o, P, r, lfd[r], peers));
    }
    if (pid[r] < 0) {
      perror("bench-pipeline: fork");
      for (int q = 0; q < r; q++) kill(pid[q], SIGKILL);
      return 1;
    }
  }
  for (int r = 0; r < P; r++) close(lfd[r]);
  int failed = 0;
  for (int left = P; left > 0; left--) {
    int status;
    pid_t done = wait(&status);
    if (done < 0) break;
    if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
      failed = 1;
      for (int q = 0; q < P; q++) {
        if (pid[q] != done) kill(pid[q], SIGTERM);
      }
    }
  }
  return failed;
}

static void usage(FILE *f) {
  fprintf(f,
          "usage: bench-pipeline [options]\n"
          "  --stages LIST      pipeline sizes P to run (default 2,4; each 2..%d)\n"
          "  --schedules LIST   of gpipe, 1f1b, interleaved, zb-h1 (default all; interleaved "
          "with v=2)\n"
          "  --forward-ms X     one forward's compute in ms (default 2; backward 2X)\n"
          "  --act-bytes N      bytes of each activation or gradient message (default 65536)\n"
          "  --steps N          measured steps per point, median reported (default 5, 1..63)\n"
          "  --compute KIND     loop (calibrated busy loop, default) or sleep\n",
          MAX_P);
}

/* Parses "a,b,c" with item(); 0 or -1. */
static int parse_list(const char *s, int *out, int *n, int max, int (*item)(const char *, int *)) {
  char buf[256];
  snprintf(buf, sizeof(buf), "%s", s);
  *n = 0;
  for (char *save = NULL, *t = strtok_r(buf, ",", &save); t; t = strtok_r(NULL, ",", &save)) {
    if (*n >= max || item(t, &out[*n]) < 0) return -1;
    (*n)++;
  }
  return *n > 0 ? 0 : -1;
}

static int stage_item(const char *s, int *v) {
  char *end;
  long x = strtol(s, &end, 10);
  *v = (int)x;
  return *end || x < 2 || x > MAX_P ? -1 : 0;
}

static int sched_item(const char *s, int *v) {
  ps_pipe_schedule k;
  if (ps_pipe_schedule_parse(s, &k, NULL, 0) != PS_OK) return -1;
  *v = (int)k;
  return 0;
}

static int bad(const char *opt, const char *val) {
  fprintf(stderr, "bench-pipeline: option %s: bad value '%s'\n", opt, val ? val : "");
  return 2;
}

int main(int argc, char **argv) {
  struct opts o = {{2, 4}, 2, {0, 1, 2, 3}, 4, 2.0, 65536, 5, 0};
  signal(SIGPIPE, SIG_IGN);
  for (int i = 1; i < argc; i++) {
    const char *opt = argv[i], *val = NULL;
    if (strcmp(opt, "--help") == 0) {
      usage(stdout);
      return 0;
    }
    const char *eq = strchr(opt, '=');
    char name[64];
    snprintf(name, sizeof(name), "%.*s", eq ? (int)(eq - opt) : (int)strlen(opt), opt);
    val = eq ? eq + 1 : i + 1 < argc ? argv[++i] : NULL;
    char *end = NULL;
    if (strcmp(name, "--stages") == 0) {
      if (!val || parse_list(val, o.stages, &o.nstages, MAX_LIST, stage_item) < 0)
        return bad(name, val);
    } else if (strcmp(name, "--schedules") == 0) {
      if (!val || parse_list(val, o.scheds, &o.nscheds, 4, sched_item) < 0) return bad(name, val);
    } else if (strcmp(name, "--forward-ms") == 0) {
      o.forward_ms = val ? strtod(val, &end) : 0;
      if (!val || *end || !(o.forward_ms > 0 && o.forward_ms <= 1000)) return bad(name, val);
    } else if (strcmp(name, "--act-bytes") == 0) {
      long long b = val ? strtoll(val, &end, 10) : -1;
      if (!val || *end || b < 1 || b > (1LL << 30)) return bad(name, val);
      o.act_bytes = (size_t)b;
    } else if (strcmp(name, "--steps") == 0) {
      long s = val ? strtol(val, &end, 10) : 0;
      if (!val || *end || s < 1 || s > 63) return bad(name, val);
      o.steps = (int)s;
    } else if (strcmp(name, "--compute") == 0) {
      if (!val || (strcmp(val, "loop") != 0 && strcmp(val, "sleep") != 0)) return bad(name, val);
      o.sleep_compute = strcmp(val, "sleep") == 0;
    } else {
      fprintf(stderr, "bench-pipeline: unknown option %s\n", name);
      usage(stderr);
      return 2;
    }
  }
  int failed = 0;
  for (int i = 0; i < o.nstages && !failed; i++) failed = run_local(&o, o.stages[i]);
  return failed;
}
