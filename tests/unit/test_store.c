/* The shard's sync engine without sockets: BSP quorum, averaging and resends;
 * ASP per-push updates and in-order clocks; SSP's read bound; gone workers
 * (steps complete without them, rescaled) and their return (clocks
 * fast-forwarded, stale pushes duplicates); ranks that joined (left out of
 * the BSP quorum and the SSP bound) or finished (still awaited); sum mode; copy on write; the
 * per-key optimizer state allocated on first use; the first push of a step
 * kept as the sum without a copy. Exact arithmetic: SGD
 * with lr 1 and gradients whose means are exact in float. */
#include <errno.h>
#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "store.h"
#include "check.h"

#define N 10

/* Served waiters are counted per request id and freed. */
static int served[64];
static void on_serve(struct store_key *k, struct store_waiter *w, void *arg) {
  (void)k;
  (void)arg;
  if (w->request_id < 64) served[w->request_id]++;
  free(w);
}

static struct store_key *setup(struct store *s, uint32_t workers, enum store_consistency mode,
                               uint32_t staleness, enum opt_kind kind, float init) {
  struct store_opts o = {
      .shard = 0,
      .num_shards = 1,
      .num_workers = workers,
      .consistency = mode,
      .staleness = staleness,
      .opt = {.kind = kind, .lr = 1.0, .beta1 = 0.9, .beta2 = 0.999, .eps = 1e-8}};
  memset(served, 0, sizeof(served));
  CHECK(store_init(s, &o, on_serve, NULL) == 0, "init");
  char *names[] = {"w"};
  uint64_t counts[] = {N};
  struct store_layout l = {
      .num_tensors = 1, .names = names, .counts = counts, .chunk_bytes = 1 << 20, .num_shards = 1};
  l.hash = placement_layout_hash((const char *const *)names, counts, 1, l.chunk_bytes, 1);
  char msg[256] = "";
  CHECK(store_set_layout(s, &l, msg, sizeof(msg)) == 0, "layout: %s", msg);
  struct store_key *k = store_find(s, PLACEMENT_KEY(0, 0));
  float v[N];
  for (int i = 0; i < N; i++) v[i] = init;
  CHECK(k && store_init_key(s, k, v) == 0, "init key");
  return k;
}

static int push(struct store *s, struct store_key *k, uint32_t rank, uint64_t step, float g) {
  float v[N];
  char msg[256] = "";
  for (int i = 0; i < N; i++) v[i] = g;
  return store_push(s, k, rank, step, STORE_NO_BASE, v, msg, sizeof(msg));
}

static int push_on(struct store *s, struct store_key *k, uint32_t rank, uint64_t step,
                   uint64_t base, float g) {
  float v[N];
  char msg[256] = "";
  for (int i = 0; i < N; i++) v[i] = g;
  return store_push(s, k, rank, step, base, v, msg, sizeof(msg));
}

static void wait_pull(struct store *s, struct store_key *k, uint64_t id, uint64_t min_version) {
  struct store_waiter *w = calloc(1, sizeof(*w));
  w->request_id = id;
  w->min_version = min_version;
  store_wait(s, k, w);
}

static void expect_all(const struct store_key *k, float want, const char *what) {
  for (int i = 0; i < N; i++)
    if (k->params->data[i] != want) {
      CHECK(0, "%s: p[%d] = %g, expected %g", what, i, (double)k->params->data[i], (double)want);
      return;
    }
}

static void test_bsp(void) {
  struct store s;
  struct store_key *k = setup(&s, 3, STORE_BSP, 0, OPT_SGD, 10);
  CHECK(store_ready(&s, k, 0) && !store_ready(&s, k, 1), "version 0 only");
  wait_pull(&s, k, 1, 1);
  CHECK(push(&s, k, 0, 0, 1) == STORE_APPLIED && push(&s, k, 1, 0, 2) == STORE_APPLIED, "pushes");
  CHECK(k->version == 0 && served[1] == 0, "version moved before the last push");
  CHECK(store_blocked_on(&s, 2) && !store_blocked_on(&s, 0), "blocked on rank 2 only");
  CHECK(push(&s, k, 1, 0, 2) == STORE_DUPLICATE, "resend of rank 1's push was not a duplicate");
  CHECK(push(&s, k, 2, 0, 3) == STORE_APPLIED, "last push");
  CHECK(k->version == 1 && served[1] == 1, "version %" PRIu64 ", served %d", k->version, served[1]);
  expect_all(k, 8, "after step 0 (10 - mean(1,2,3))");
  CHECK(push(&s, k, 2, 0, 3) == STORE_DUPLICATE, "resend after the step completed");
  CHECK(push(&s, k, 0, 2, 1) == -EINVAL, "a push ahead of the version was accepted");
  CHECK(s.stats.duplicates == 2 && s.stats.updates == 1, "counters");
  CHECK(store_worker_clock(&s, 0) == 1 && store_worker_clock(&s, 2) == 1, "clocks");

  /* rank 2 disappears during step 1: the step completes with the others */
  push(&s, k, 0, 1, 1);
  push(&s, k, 1, 1, 3);
  CHECK(k->version == 1, "step 1 completed without rank 2");
  CHECK(store_worker_gone(&s, 2) == 0 && store_is_gone(&s, 2), "gone");
  CHECK(k->version == 2, "step 1 did not complete when rank 2 went");
  expect_all(k, 6, "after step 1 (8 - mean(1,3), rescaled over 2)");
  /* step 2 needs only ranks 0 and 1 */
  push(&s, k, 0, 2, 2);
  push(&s, k, 1, 2, 2);
  CHECK(k->version == 3, "step 2 waits for the gone rank");
  /* rank 2 returns: it resumes at the current version, its old step is stale */
  store_worker_back(&s, 2);
  CHECK(!store_is_gone(&s, 2) && store_worker_clock(&s, 2) == 3,
        "clock of the returned rank %" PRIu64, store_worker_clock(&s, 2));
  CHECK(push(&s, k, 2, 1, 100) == STORE_DUPLICATE, "stale push applied");
  push(&s, k, 0, 3, 1);
  push(&s, k, 1, 3, 1);
  CHECK(k->version == 3 && store_blocked_on(&s, 2), "step 3 must wait for the returned rank");
  push(&s, k, 2, 3, 4);
  CHECK(k->version == 4, "step 3 with all three");
  expect_all(k, 2, "after step 3 (4 - mean(1,1,4))");
  store_deinit(&s);
}

static void test_asp(void) {
  struct store s;
  struct store_key *k = setup(&s, 2, STORE_ASP, 0, OPT_SGD, 0);
  /* each push is one update of g / live_workers */
  CHECK(push(&s, k, 0, 0, 2) == STORE_APPLIED && k->version == 1, "push applied at once");
  expect_all(k, -1, "after one push");
  CHECK(push(&s, k, 0, 1, 2) == STORE_APPLIED && push(&s, k, 0, 2, 2) == STORE_APPLIED,
        "a fast rank goes on alone");
  CHECK(store_ready(&s, k, 3) && store_ready(&s, k, 99), "asp pulls wait for nothing");
  CHECK(push(&s, k, 0, 1, 2) == STORE_DUPLICATE, "resend applied twice");
  CHECK(push(&s, k, 1, 3, 2) == -EINVAL, "a gap in rank 1's steps was accepted");
  CHECK(push(&s, k, 1, 0, 2) == STORE_APPLIED, "slow rank");
  CHECK(k->version == 4, "version = pushes applied, got %" PRIu64, k->version);
  CHECK(k->version >= store_worker_clock(&s, 0), "version below a clock");
  expect_all(k, -4, "after 4 pushes");
  /* a gone rank no longer divides: g / 1 */
  store_worker_gone(&s, 1);
  push(&s, k, 0, 3, 2);
  expect_all(k, -6, "after a push with one live worker");
  store_worker_back(&s, 1);
  CHECK(store_worker_clock(&s, 1) == 4, "returned rank fast-forwarded to %" PRIu64,
        store_worker_clock(&s, 1));
  CHECK(push(&s, k, 1, 1, 2) == STORE_DUPLICATE, "stale push after return applied");
  CHECK(k->version >= store_worker_clock(&s, 1), "version below a clock after return");
  store_deinit(&s);
}

/* ASP with the base version each push names: staleness = updates since it,
 * the update divided by staleness + 1 (on top of 1/live_workers) when aware;
 * counted either way; BSP neither scales nor counts. */
static void test_staleness(void) {
  for (int aware = 0; aware <= 1; aware++) {
    struct store s;
    struct store_key *k = setup(&s, 2, STORE_ASP, 0, OPT_SGD, 0);
    s.opts.staleness_aware = aware;
    CHECK(push_on(&s, k, 0, 0, 0, 4) == STORE_APPLIED, "push");
    expect_all(k, -2, "fresh: 4 / 2 workers");
    push_on(&s, k, 1, 0, 0, 4); /* computed on version 0, now at 1 */
    expect_all(k, aware ? -3 : -4, "staleness 1");
    push_on(&s, k, 0, 1, 0, 12); /* two updates since version 0 */
    expect_all(k, aware ? -5 : -10, "staleness 2");
    push_on(&s, k, 1, 1, STORE_NO_BASE, 2); /* an older client: fresh */
    expect_all(k, aware ? -6 : -11, "no base");
    push_on(&s, k, 0, 2, 99, 2); /* a base not reached yet (an older checkpoint): fresh */
    expect_all(k, aware ? -7 : -12, "base ahead");
    CHECK(s.stats.staleness[0] == 2 && s.stats.staleness[1] == 1 && s.stats.staleness[2] == 1 &&
              s.stats.no_base == 1,
          "staleness counts %llu %llu %llu, no base %llu", (unsigned long long)s.stats.staleness[0],
          (unsigned long long)s.stats.staleness[1], (unsigned long long)s.stats.staleness[2],
          (unsigned long long)s.stats.no_base);
    for (uint64_t i = 0; i < 70; i++) push_on(&s, k, 1, 2 + i, 0, 0); /* ever staler */
    CHECK(s.stats.staleness[STORE_STALENESS_SLOTS - 1] == 70 - 59 &&
              s.stats.staleness_over_sum == (64 + 74) * 11 / 2,
          "staleness >= 64: %llu, sum %llu",
          (unsigned long long)s.stats.staleness[STORE_STALENESS_SLOTS - 1],
          (unsigned long long)s.stats.staleness_over_sum);
    store_deinit(&s);
  }
  struct store s;
  struct store_key *k = setup(&s, 2, STORE_BSP, 0, OPT_SGD, 0);
  s.opts.staleness_aware = true;
  push_on(&s, k, 0, 0, 0, 2);
  push_on(&s, k, 1, 0, 0, 6);
  expect_all(k, -4, "bsp: the plain mean");
  uint64_t counted = s.stats.no_base;
  for (int i = 0; i < STORE_STALENESS_SLOTS; i++) counted += s.stats.staleness[i];
  CHECK(counted == 0, "bsp counted %llu pushes' staleness", (unsigned long long)counted);
  store_deinit(&s);
}

/* ASP with momentum and the look-ahead, against DANA-Zero computed here in
 * double: each rank's own velocity, theta = phi + lr_prev * mu * sum of the
 * velocities, the key holding phi = theta - lr * mu * sum; pushes staler
 * than one round (staleness + 1 > W) also scaled by W / (staleness + 1);
 * the cosine schedule at updates / W. Then what falls back to dividing:
 * --staleness-method divide, Nesterov, plain sgd, and bsp (no scaling). */
static void test_lookahead(void) {
  enum { W = 3, PUSHES = 9 };
  const uint32_t ranks[PUSHES] = {0, 1, 2, 1, 0, 2, 2, 0, 1};
  const uint64_t stale[PUSHES] = {0, 1, 1, 2, 4, 3, 0, 7, 0}; /* version - base */
  struct store s;
  struct store_key *k = setup(&s, W, STORE_ASP, 0, OPT_MOMENTUM, 0);
  s.opts.staleness_aware = true;
  s.opts.method = STALENESS_LOOKAHEAD;
  s.opts.opt.momentum = 0.9;
  s.opts.opt.weight_decay = 0.01;
  s.opts.opt.lr = 0.5;
  s.opts.opt.decay_steps = 4;
  CHECK(store_lookahead(&s) && store_state_floats(&s) == W + 1, "look-ahead on, %zu floats",
        store_state_floats(&s));
  CHECK(strcmp(store_staleness_name(&s.opts), "lookahead") == 0, "name");
  for (int i = 0; i < N; i++) k->params->data[i] = 0.25f * (float)(i + 1);
  double theta[N], v[W][N] = {{0}};
  for (int i = 0; i < N; i++) theta[i] = 0.25 * (i + 1);
  uint64_t clock[W] = {0};
  const double mu = 0.9, wd = 0.01;
  for (int p = 0; p < PUSHES; p++) {
    uint32_t r = ranks[p];
    float g[N];
    for (int i = 0; i < N; i++) g[i] = (float)((i * 7 + p * 3) % 5) - 2.0f;
    char msg[256] = "";
    uint64_t base = k->version >= stale[p] ? k->version - stale[p] : 0;
    uint64_t tau = k->version - base;
    CHECK(store_push(&s, k, r, clock[r]++, base, g, msg, sizeof(msg)) == STORE_APPLIED, "%s", msg);
    double scale = 1.0 / W * (tau + 1 > W ? (double)W / (double)(tau + 1) : 1.0);
    double lr = opt_lr_at(&s.opts.opt, (k->version - 1) / W);
    for (int i = 0; i < N; i++) {
      v[r][i] = mu * v[r][i] + scale * g[i] + wd * theta[i];
      theta[i] -= lr * v[r][i];
    }
    double worst = 0;
    for (int i = 0; i < N; i++) {
      double sum = v[0][i] + v[1][i] + v[2][i];
      double phi = theta[i] - lr * mu * sum;
      double e = fabs((double)k->params->data[i] - phi);
      if (e > worst) worst = e;
      double se = fabs((double)k->opt_state[W * N + i] - sum) +
                  fabs((double)k->opt_state[r * N + i] - v[r][i]);
      if (se > worst) worst = se;
    }
    CHECK(worst < 1e-5, "push %d (rank %u, staleness %llu): off by %g", p, r,
          (unsigned long long)tau, worst);
  }
  store_deinit(&s);

  struct {
    enum store_consistency mode;
    enum store_staleness_method method;
    bool nesterov, aware;
    double momentum;
    const char *name;
  } other[] = {
      {STORE_ASP, STALENESS_DIVIDE, false, true, 0.9, "divide"},
      {STORE_ASP, STALENESS_LOOKAHEAD, true, true, 0.9, "divide"},  /* Nesterov */
      {STORE_ASP, STALENESS_LOOKAHEAD, false, true, 0.0, "divide"}, /* no momentum */
      {STORE_SSP, STALENESS_LOOKAHEAD, false, false, 0.9, "off"},
      {STORE_BSP, STALENESS_LOOKAHEAD, false, true, 0.9, "off"},
  };
  for (size_t c = 0; c < sizeof(other) / sizeof(other[0]); c++) {
    k = setup(&s, 2, other[c].mode, 1, OPT_MOMENTUM, 0);
    s.opts.staleness_aware = other[c].aware;
    s.opts.method = other[c].method;
    s.opts.opt.momentum = other[c].momentum;
    s.opts.opt.nesterov = other[c].nesterov;
    CHECK(!store_lookahead(&s) && store_state_floats(&s) == 1 &&
              strcmp(store_staleness_name(&s.opts), other[c].name) == 0,
          "case %zu: look-ahead %d, %zu floats, \"%s\"", c, store_lookahead(&s),
          store_state_floats(&s), store_staleness_name(&s.opts));
    push_on(&s, k, 0, 0, 0, 4);
    push_on(&s, k, 1, 0, 0, 4); /* asp/ssp: staleness 1 */
    /* lr 1: the first push 4 / 2 workers, the second the same at staleness 1 */
    float m = (float)other[c].momentum, d = other[c].aware ? 1.0f : 2.0f, v2 = 2.0f * m + d;
    float want = other[c].nesterov ? -2.0f * (1.0f + m) - (d + m * v2) : -2.0f - v2;
    if (other[c].mode == STORE_BSP) want = -4.0f; /* one step of the mean, unscaled */
    expect_all(k, want, other[c].name);
    store_deinit(&s);
  }
  enum store_staleness_method m;
  CHECK(store_staleness_method_parse("divide", &m) == 0 && m == STALENESS_DIVIDE &&
            store_staleness_method_parse("lookahead", &m) == 0 && m == STALENESS_LOOKAHEAD &&
            store_staleness_method_parse("dana", &m) < 0,
        "method names");
}

static uint64_t clock_at_update;
static void seen_update(struct store *st, struct store_key *k, void *arg) {
  (void)st;
  (void)arg;
  clock_at_update = k->next_step[0];
}

/* ASP after a restore (accept_gaps): a rank beyond its checkpointed clock
 * lost what it pushed since; it is counted, the clock and version move on,
 * and resends below the clock stay duplicates. */
static void test_restored(void) {
  struct store s;
  struct store_key *k = setup(&s, 2, STORE_ASP, 0, OPT_SGD, 0);
  /* a checkpoint taken in the update hook sees the clock of the push in it */
  s.on_update = seen_update;
  push(&s, k, 0, 0, 2); /* the checkpoint had rank 0 at clock 1, rank 1 at 0 */
  CHECK(clock_at_update == 1, "the update hook saw rank 0 at clock %llu with its step-0 push in",
        (unsigned long long)clock_at_update);
  s.on_update = NULL;
  CHECK(push(&s, k, 0, 4, 2) == -EINVAL, "a gap accepted before any restore");
  s.accept_gaps = true;
  CHECK(push(&s, k, 0, 4, 2) == STORE_APPLIED, "rank 0's push beyond the checkpoint");
  CHECK(s.stats.lost == 3 && k->version == 5 && store_worker_clock(&s, 0) == 5,
        "lost %llu, version %llu, clock %llu", (unsigned long long)s.stats.lost,
        (unsigned long long)k->version, (unsigned long long)store_worker_clock(&s, 0));
  expect_all(k, -2, "two pushes applied, three lost");
  CHECK(push(&s, k, 0, 3, 2) == STORE_DUPLICATE, "a resend below the new clock was applied");
  CHECK(store_rank_at(&s, k, 1, 2) == 2 && store_worker_clock(&s, 1) == 2 && k->version == 7,
        "rank 1's pull at clock 2");
  CHECK(store_rank_at(&s, k, 1, 1) == 0 && s.stats.lost == 5, "a clock below moved back");
  CHECK(push(&s, k, 1, 2, 2) == STORE_APPLIED && k->version == 8, "rank 1 goes on");
  expect_all(k, -3, "three pushes applied in all");
  store_deinit(&s);
  s = (struct store){0};
  k = setup(&s, 2, STORE_BSP, 0, OPT_SGD, 0);
  s.accept_gaps = true;
  CHECK(store_rank_at(&s, k, 0, 3) == 0 && store_worker_clock(&s, 0) == 0, "bsp moved a clock");
  store_deinit(&s);
}

static void test_ssp(void) {
  struct store s;
  struct store_key *k = setup(&s, 2, STORE_SSP, 1, OPT_SGD, 0);
  push(&s, k, 0, 0, 1);
  CHECK(store_ready(&s, k, 1), "clock 1 is within K=1 of clock 0");
  push(&s, k, 0, 1, 1);
  CHECK(!store_ready(&s, k, 2), "clock 2 ran 2 ahead of the slowest");
  wait_pull(&s, k, 2, 2);
  CHECK(store_blocked_on(&s, 1) && !store_blocked_on(&s, 0), "blocked on the slow rank");
  push(&s, k, 1, 0, 1);
  CHECK(served[2] == 1, "the slow rank's push did not release the fast one");
  push(&s, k, 0, 2, 1);
  wait_pull(&s, k, 3, 3);
  CHECK(served[3] == 0, "clock 3 released with the slowest at 1");
  store_worker_gone(&s, 1);
  CHECK(served[3] == 1, "a gone rank still holds the others back");
  store_worker_back(&s, 1);
  CHECK(store_worker_clock(&s, 1) == 3, "returned rank at clock %" PRIu64,
        store_worker_clock(&s, 1));
  CHECK(k->version == 4 && k->version >= 3, "version %" PRIu64, k->version);
  store_deinit(&s);

  /* K = 0 reads like BSP */
  k = setup(&s, 2, STORE_SSP, 0, OPT_SGD, 0);
  push(&s, k, 0, 0, 1);
  CHECK(!store_ready(&s, k, 1), "ssp:0 let a worker read ahead");
  push(&s, k, 1, 0, 1);
  CHECK(store_ready(&s, k, 1), "ssp:0 blocked a worker at the slowest clock");
  store_deinit(&s);
}

/* A rank that joined leaves the BSP quorum (the step it was awaited in
 * completes, averaged over the pushers) and the SSP minimum; back in, it
 * counts again. store_waits_for says who a step or pull waits for. */
static void test_left(void) {
  struct store s;
  struct store_key *k = setup(&s, 3, STORE_BSP, 0, OPT_SGD, 10);
  push(&s, k, 0, 0, 1);
  push(&s, k, 1, 0, 3);
  CHECK(store_waits_for(&s, k, 2, 1) && !store_waits_for(&s, k, 0, 1),
        "step 0 should wait for rank 2 alone");
  CHECK(!store_waits_for(&s, k, 2, 0), "a pull of the current version waited");
  wait_pull(&s, k, 1, 1);
  CHECK(store_set_left(&s, 2, STORE_FINISHED) == 0 && k->version == 0 && served[1] == 0,
        "a finished rank was not awaited");
  CHECK(store_waits_for(&s, k, 2, 1), "the step did not wait for the finished rank");
  CHECK(store_set_left(&s, 2, STORE_JOINED) == 0 && k->version == 1 && served[1] == 1,
        "joining did not complete the step it was awaited in");
  expect_all(k, 8, "after step 0 (10 - mean(1,3))");
  CHECK(!store_waits_for(&s, k, 2, 2) && !store_blocked_on(&s, 2), "a joined rank was awaited");
  push(&s, k, 0, 1, 2);
  push(&s, k, 1, 1, 2);
  CHECK(k->version == 2 && store_worker_clock(&s, 2) == 0,
        "step 1 waited for the joined rank, or its clock moved");
  CHECK(store_set_left(&s, 2, STORE_IN) == 0 && s.num_joined == 0, "not back in");
  push(&s, k, 0, 2, 1);
  CHECK(k->version == 2 && store_waits_for(&s, k, 2, 3), "a rank back in was not awaited");
  store_deinit(&s);

  k = setup(&s, 2, STORE_SSP, 1, OPT_SGD, 0);
  push(&s, k, 1, 0, 1);
  for (uint64_t c = 0; c < 3; c++) push(&s, k, 0, c, 1);
  CHECK(!store_ready(&s, k, 3) && store_waits_for(&s, k, 1, 3), "clock 3 should wait for rank 1");
  wait_pull(&s, k, 2, 3);
  store_set_left(&s, 1, STORE_JOINED);
  CHECK(served[2] == 1 && store_ready(&s, k, 4) && !store_waits_for(&s, k, 1, 4),
        "the joined rank still holds the bound back");
  store_deinit(&s);
}

static void test_sum_and_state(void) {
  struct store s;
  struct store_key *k = setup(&s, 2, STORE_BSP, 0, OPT_SUM, 7);
  struct vbuf *in_flight = vbuf_ref(k->params); /* a reply still being written */
  push(&s, k, 0, 0, 1);
  push(&s, k, 1, 0, 4);
  CHECK(k->version == 1, "sum step");
  expect_all(k, 2.5f, "sum mode holds the mean gradient");
  CHECK(k->params != in_flight && in_flight->data[0] == 7, "copy on write broke a reply");
  vbuf_unref(in_flight);
  store_deinit(&s);

  k = setup(&s, 1, STORE_BSP, 0, OPT_ADAM, 1);
  CHECK(k->opt_state == NULL, "state allocated before the first update");
  push(&s, k, 0, 0, 0.5f);
  CHECK(k->opt_state != NULL, "no state after the first update");
  /* Adam's first step moves every parameter by lr (sign of the gradient) */
  CHECK(k->params->data[0] < 0.0f + 1e-6f && k->params->data[0] > -1e-6f, "adam step 1: %g",
        (double)k->params->data[0]);
  store_deinit(&s);
}

/* The first push of a BSP step is taken as the sum without a copy; the
 * caller gets the old sum buffer back. Later pushes are added. */
static void test_push_buffer(void) {
  struct store s;
  struct store_key *k = setup(&s, 2, STORE_BSP, 0, OPT_SGD, 10);
  char msg[256];
  size_t bytes = N * sizeof(float);
  float *buf = malloc(bytes), *old_sum = k->sum;
  for (int i = 0; i < N; i++) buf[i] = 2;
  float *mine = buf;
  CHECK(store_push_buffer(&s, k, 0, 0, STORE_NO_BASE, &buf, &bytes, msg, sizeof(msg)) ==
            STORE_APPLIED,
        "push");
  CHECK(k->sum == mine && buf == old_sum && bytes == N * sizeof(float), "first push not swapped");
  for (int i = 0; i < N; i++) buf[i] = 4;
  float *second = buf;
  CHECK(store_push_buffer(&s, k, 1, 0, STORE_NO_BASE, &buf, &bytes, msg, sizeof(msg)) ==
            STORE_APPLIED,
        "push");
  CHECK(buf == second, "a second push took the caller's buffer");
  expect_all(k, 7, "after step 0 (10 - mean(2,4))");
  /* a buffer much larger than the key is copied, never kept */
  size_t big_bytes = bytes + 2 * STORE_SWAP_SLACK;
  float *big = malloc(big_bytes), *big0 = big;
  for (int i = 0; i < N; i++) big[i] = 1;
  CHECK(store_push_buffer(&s, k, 0, 1, STORE_NO_BASE, &big, &big_bytes, msg, sizeof(msg)) ==
            STORE_APPLIED,
        "push");
  CHECK(big == big0 && k->sum != big0, "an oversized buffer became a sum");
  free(big);
  free(buf);
  store_deinit(&s);
}

static void test_names(void) {
  enum store_consistency m;
  uint32_t K;
  char buf[32];
  CHECK(store_consistency_parse("bsp", &m, &K) == 0 && m == STORE_BSP, "bsp");
  CHECK(store_consistency_parse("asp", &m, &K) == 0 && m == STORE_ASP, "asp");
  CHECK(store_consistency_parse("ssp:2", &m, &K) == 0 && m == STORE_SSP && K == 2, "ssp:2");
  CHECK(strcmp(store_consistency_name(m, K, buf, sizeof(buf)), "ssp:2") == 0, "name");
  const char *bad[] = {"", "ssp", "ssp:", "ssp:-1", "ssp:2x", "ssp:99999999", "BSP", "async"};
  for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++)
    CHECK(store_consistency_parse(bad[i], &m, &K) == -EINVAL, "\"%s\" accepted", bad[i]);
}

int main(void) {
  test_bsp();
  test_asp();
  test_ssp();
  test_left();
  test_staleness();
  test_lookahead();
  test_restored();
  test_sum_and_state();
  test_push_buffer();
  test_names();
  if (failures)
    fprintf(stderr, "%d failures\n", failures);
  else
    printf(
        "store: bsp, asp, ssp, staleness, gone/rejoin, joined/finished, sum and state all as "
        "specified\n");
  return failures ? 1 : 0;
}
