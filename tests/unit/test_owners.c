/* Per-key owners (ps_declare_owned) in the shard's store, without sockets:
 * 4 workers, tensor A owned by ranks {0,1}, B by {2,3}. The layout's owners
 * are checked (a rank outside the job, a rank named twice) and compared (a
 * layout whose owners differ is refused naming both sets; the same set in
 * another order, or every rank named, is equal); BSP completes a key's step
 * when its owners pushed and averages over them only; a non-owner's push is
 * refused naming the tensor and the rank; resends stay duplicates; a gone
 * owner leaves the key's quorum, a key whose owners are all gone keeps its
 * version and its owners come back fast-forwarded; ASP divides by the live
 * owners; SSP's bound is the slowest owner of the key; store_worker_clock
 * counts only owned keys; a checkpoint keeps the owners (and the inspector
 * prints them). Exact arithmetic: SGD with lr 1. */
#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "ckpt.h"
#include "store.h"
#include "check.h"

#define N 8
#define W 4u

static int served[64];
static void on_serve(struct store_key *k, struct store_waiter *w, void *arg) {
  (void)k;
  (void)arg;
  if (w->request_id < 64) served[w->request_id]++;
  free(w);
}

static char *names[] = {"A", "B"};
static uint64_t counts[] = {N, N};
static uint32_t own_a[] = {0, 1}, own_b[] = {2, 3};

/* The layout with A's and B's owners as given (n 0 = every rank). */
static struct store_layout layout(uint32_t *a, uint32_t na, uint32_t *b, uint32_t nb, uint32_t *num,
                                  uint32_t **lists) {
  num[0] = na;
  num[1] = nb;
  lists[0] = a;
  lists[1] = b;
  struct store_layout l = {.num_tensors = 2,
                           .names = names,
                           .counts = counts,
                           .chunk_bytes = 1 << 20,
                           .num_shards = 1,
                           .num_owners = num,
                           .owners = lists};
  l.hash = placement_layout_hash((const char *const *)names, counts, 2, l.chunk_bytes, 1);
  return l;
}

static void setup(struct store *s, enum store_consistency mode, uint32_t staleness,
                  struct store_key **a, struct store_key **b) {
  struct store_opts o = {.num_shards = 1,
                         .num_workers = W,
                         .consistency = mode,
                         .staleness = staleness,
                         .opt = {.kind = OPT_SGD, .lr = 1.0}};
  memset(served, 0, sizeof(served));
  CHECK(store_init(s, &o, on_serve, NULL) == 0, "init");
  uint32_t num[2], *lists[2];
  struct store_layout l = layout(own_a, 2, own_b, 2, num, lists);
  char msg[400] = "";
  CHECK(store_set_layout(s, &l, msg, sizeof(msg)) == 0, "layout: %s", msg);
  *a = store_find(s, PLACEMENT_KEY(0, 0));
  *b = store_find(s, PLACEMENT_KEY(1, 0));
  float v[N];
  for (int i = 0; i < N; i++) v[i] = 10;
  CHECK(*a && *b && store_init_key(s, *a, v) == 0 && store_init_key(s, *b, v) == 0, "init keys");
}

static int push(struct store *s, struct store_key *k, uint32_t rank, uint64_t step, float g,
                char *msg, size_t msglen) {
  float v[N];
  for (int i = 0; i < N; i++) v[i] = g;
  return store_push(s, k, rank, step, STORE_NO_BASE, v, msg, msglen);
}

static int push1(struct store *s, struct store_key *k, uint32_t rank, uint64_t step, float g) {
  char msg[400];
  return push(s, k, rank, step, g, msg, sizeof(msg));
}

static void wait_pull(struct store *s, struct store_key *k, uint64_t id, uint64_t min_version) {
  struct store_waiter *w = calloc(1, sizeof(*w));
  w->request_id = id;
  w->min_version = min_version;
  store_wait(s, k, w);
}

static bool all(const struct store_key *k, float want) {
  for (int i = 0; i < N; i++)
    if (k->params->data[i] != want) return false;
  return true;
}

static void test_layout_checks(void) {
  struct store s;
  struct store_opts o = {.num_shards = 1, .num_workers = W, .opt = {.kind = OPT_SGD, .lr = 1}};
  CHECK(store_init(&s, &o, on_serve, NULL) == 0, "init");
  uint32_t num[2], *lists[2], bad_rank[] = {0, 4}, twice[] = {2, 2};
  char msg[400] = "";
  struct store_layout l = layout(bad_rank, 2, own_b, 2, num, lists);
  CHECK(store_set_layout(&s, &l, msg, sizeof(msg)) == -EINVAL && strstr(msg, "tensor 0 (A)") &&
            strstr(msg, "owner rank 4"),
        "rank 4 of 4 workers: %s", msg);
  l = layout(own_a, 2, twice, 2, num, lists);
  CHECK(store_set_layout(&s, &l, msg, sizeof(msg)) == -EINVAL && strstr(msg, "tensor 1 (B)") &&
            strstr(msg, "rank 2 is named twice"),
        "repeat: %s", msg);
  CHECK(!s.has_layout, "a refused layout was kept");
  l = layout(own_a, 2, own_b, 2, num, lists);
  CHECK(store_set_layout(&s, &l, msg, sizeof(msg)) == 0, "layout: %s", msg);
  uint32_t swapped[] = {1, 0}, every[] = {3, 1, 0, 2}, other[] = {1, 2};
  l = layout(swapped, 2, own_b, 2, num, lists);
  CHECK(store_set_layout(&s, &l, msg, sizeof(msg)) == 0, "same owners in another order: %s", msg);
  l = layout(own_a, 2, other, 2, num, lists);
  msg[0] = 0;
  CHECK(store_set_layout(&s, &l, msg, sizeof(msg)) == -EEXIST && strstr(msg, "tensor 1 (B)") &&
            strstr(msg, "ranks {2,3}") && strstr(msg, "ranks {1,2}"),
        "owners differ: %s", msg);
  printf("different owners refused: %s\n", msg);
  l = layout(own_a, 2, NULL, 0, num, lists);
  CHECK(store_set_layout(&s, &l, msg, sizeof(msg)) == -EEXIST && strstr(msg, "every rank"),
        "owners dropped: %s", msg);
  l = (struct store_layout){.num_tensors = 2,
                            .names = names,
                            .counts = counts,
                            .chunk_bytes = 1 << 20,
                            .num_shards = 1,
                            .hash = l.hash};
  CHECK(store_set_layout(&s, &l, msg, sizeof(msg)) == -EEXIST, "a layout without owners matched");
  store_deinit(&s);

  /* naming every rank is the same as naming none */
  CHECK(store_init(&s, &o, on_serve, NULL) == 0, "init");
  l = layout(every, 4, NULL, 0, num, lists);
  CHECK(store_set_layout(&s, &l, msg, sizeof(msg)) == 0, "every rank: %s", msg);
  l = layout(NULL, 0, every, 4, num, lists);
  CHECK(store_set_layout(&s, &l, msg, sizeof(msg)) == 0, "every rank vs none: %s", msg);
  CHECK(s.keys[0].num_owners == W, "owners %" PRIu32, s.keys[0].num_owners);
  store_deinit(&s);
}

static void test_bsp(void) {
  struct store s;
  struct store_key *a, *b;
  setup(&s, STORE_BSP, 0, &a, &b);
  CHECK(a->num_owners == 2 && store_owns(a, 1) && !store_owns(a, 2), "A's owners");
  char msg[400] = "";
  CHECK(push(&s, a, 2, 0, 5, msg, sizeof(msg)) == -EPERM && strstr(msg, "rank 2") &&
            strstr(msg, "\"A\"") && strstr(msg, "ranks {0,1}"),
        "a non-owner's push: %s", msg);
  printf("non-owner push refused: %s\n", msg);
  CHECK(store_check_owner(&s, b, 0, msg, sizeof(msg)) == -EPERM, "rank 0 pulls B");
  wait_pull(&s, a, 1, 1);
  CHECK(push1(&s, a, 0, 0, 1) == STORE_APPLIED, "rank 0 pushes A");
  CHECK(a->version == 0 && store_blocked_on(&s, 1) && !store_blocked_on(&s, 2),
        "A waits for rank 1 only");
  CHECK(push1(&s, a, 0, 0, 1) == STORE_DUPLICATE, "a resend was applied");
  CHECK(push1(&s, a, 1, 0, 3) == STORE_APPLIED, "rank 1 pushes A");
  CHECK(a->version == 1 && served[1] == 1, "A's step 0 did not complete with its owners");
  CHECK(all(a, 8), "A: 10 - mean(1, 3) over its 2 owners");
  CHECK(b->version == 0 && all(b, 10), "B moved");
  CHECK(push1(&s, a, 1, 0, 3) == STORE_DUPLICATE, "a resend after the step was applied");
  CHECK(push1(&s, b, 2, 0, 2) == STORE_APPLIED && push1(&s, b, 3, 0, 6) == STORE_APPLIED, "B");
  CHECK(b->version == 1 && all(b, 6), "B: 10 - mean(2, 6)");
  /* clocks count only owned keys */
  CHECK(store_worker_clock(&s, 0) == 1 && store_worker_clock(&s, 3) == 1, "clocks");
  CHECK(push1(&s, a, 0, 1, 1) == STORE_APPLIED, "step 1");
  CHECK(store_worker_clock(&s, 0) == 2 && store_worker_clock(&s, 1) == 1, "clocks after step 1");

  /* a gone owner leaves A's quorum; B does not notice */
  CHECK(store_worker_gone(&s, 1) == 0 && a->version == 2 && all(a, 7), "A without rank 1");
  CHECK(b->version == 1, "B moved when rank 1 went");
  /* A's owners all gone: it keeps its version, nobody else may push it */
  CHECK(store_worker_gone(&s, 0) == 0 && a->version == 2, "A with no owner left");
  CHECK(push1(&s, a, 3, 2, 1) == -EPERM, "rank 3 pushed A");
  store_worker_back(&s, 0);
  CHECK(store_worker_clock(&s, 0) == 2, "rank 0 back at A's version: %" PRIu64,
        store_worker_clock(&s, 0));
  CHECK(b->next_step[0] == 0, "a non-owned key's clock was fast-forwarded");
  CHECK(push1(&s, a, 0, 2, 4) == STORE_APPLIED && a->version == 3 && all(a, 3), "A goes on");
  store_deinit(&s);
}

static void test_asp_ssp(void) {
  struct store s;
  struct store_key *a, *b;
  setup(&s, STORE_ASP, 0, &a, &b);
  CHECK(push1(&s, a, 0, 0, 2) == STORE_APPLIED && all(a, 9), "asp: 10 - 2 / 2 live owners");
  CHECK(push1(&s, a, 2, 0, 2) == -EPERM, "asp: non-owner");
  store_deinit(&s);

  setup(&s, STORE_SSP, 1, &a, &b);
  /* rank 0 runs ahead on A; ranks 2 and 3 (clock 0 on A) do not count */
  CHECK(push1(&s, a, 0, 0, 1) == STORE_APPLIED && push1(&s, a, 0, 1, 1) == STORE_APPLIED, "pushes");
  CHECK(store_ready(&s, a, 1), "clock 1 - K = 0 <= slowest owner");
  CHECK(!store_ready(&s, a, 2), "rank 0 at clock 2 read A with rank 1 at 0 (K = 1)");
  wait_pull(&s, a, 2, 2);
  CHECK(store_blocked_on(&s, 1) && !store_blocked_on(&s, 2), "blocked on A's slow owner only");
  CHECK(push1(&s, a, 1, 0, 1) == STORE_APPLIED && served[2] == 1, "served once rank 1 moved");
  /* B's bound is its own owners' */
  CHECK(push1(&s, b, 2, 0, 1) == STORE_APPLIED && push1(&s, b, 2, 1, 1) == STORE_APPLIED, "B");
  CHECK(!store_ready(&s, b, 2), "B ignored its slow owner");
  CHECK(push1(&s, b, 3, 0, 1) == STORE_APPLIED && store_ready(&s, b, 2), "B after rank 3");
  store_deinit(&s);
}

static void test_checkpoint(void) {
  char dir[] = "/tmp/test_owners.XXXXXX";
  CHECK(mkdtemp(dir) != NULL, "mkdtemp");
  struct ckpt_io *io;
  CHECK(ckpt_io_open(CKPT_IO_SYNC, &io) == 0, "io");
  struct store s, t;
  struct store_key *a, *b;
  setup(&s, STORE_BSP, 0, &a, &b);
  push1(&s, a, 0, 0, 1);
  push1(&s, a, 1, 0, 3);
  struct ckpt_snapshot *snap = ckpt_snapshot_take(&s);
  struct ckpt_write_result res;
  char err[400] = "";
  CHECK(snap && ckpt_write(io, dir, snap, &res, err, sizeof(err)) == 0, "write: %s", err);
  ckpt_snapshot_free(snap);
  struct store_opts o = s.opts;
  CHECK(store_init(&t, &o, on_serve, NULL) == 0, "init");
  struct ckpt_info info;
  CHECK(ckpt_load_latest(dir, &t, &info, err, sizeof(err)) == 0, "load: %s", err);
  struct store_key *ta = store_find(&t, PLACEMENT_KEY(0, 0));
  struct store_key *tb = store_find(&t, PLACEMENT_KEY(1, 0));
  CHECK(ta && tb && ta->num_owners == 2 && store_owns(ta, 1) && !store_owns(ta, 2) &&
            store_owns(tb, 3) && !store_owns(tb, 0),
        "owners not restored");
  CHECK(ta->version == 1 && all(ta, 8), "A restored");
  uint32_t num[2], *lists[2], other[] = {1, 2};
  struct store_layout l = layout(own_a, 2, other, 2, num, lists);
  CHECK(store_set_layout(&t, &l, err, sizeof(err)) == -EEXIST, "restored owners not compared");
  char out[4096] = "";
  FILE *f = fmemopen(out, sizeof(out) - 1, "w");
  CHECK(ckpt_verify(res.path, NULL, f, err, sizeof(err)) == 0, "verify: %s", err);
  fclose(f);
  CHECK(strstr(out, "owners 0,1") && strstr(out, "owners 2,3"), "inspector: %s", out);
  store_deinit(&s);
  store_deinit(&t);
  unlink(res.path);
  rmdir(dir);
  ckpt_io_close(io);
}

int main(void) {
  test_layout_checks();
  test_bsp();
  test_asp_ssp();
  test_checkpoint();
  if (failures) {
    fprintf(stderr, "%d failures\n", failures);
    return 1;
  }
  printf("owners: layout checks, per-key bsp/asp/ssp, gone owners and checkpoints as specified\n");
  return 0;
}
