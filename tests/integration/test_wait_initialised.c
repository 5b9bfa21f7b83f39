/* ps_wait_initialised (ps.h, "The order of the calls") against S=2 real
 * shards on 127.0.0.1, W=2 ranks in this process, in bsp, asp and ssp:1:
 *  - without it, a rank that pushes before rank 0's ps_init is refused
 *    (PS_ERR_STATE, the message says what to call) and the job goes on (the
 *    shard used to close the connection, and the reconnect stopped the job);
 *  - before ps_declare it is PS_ERR_STATE; with a tensor rank 0 has not
 *    initialised it gives up at its deadline with PS_ERR_STATE naming that
 *    tensor (not the ones that are initialised);
 *  - rank 1 waiting with no deadline while rank 0 initialises (rank 0
 *    starts only once rank 1's pulls were sent) then pushes step 0 at once:
 *    every push is accepted, and in bsp the update is w - lr * mean(g);
 *  - past version 0 (a restarted rank) it returns at once;
 *  - with ps_declare_owned it waits only for the tensors the rank owns.
 * A pull it leaves behind at a timeout completes later, or fails when the
 * client is freed, without leaking (the sanitizer build checks). */
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdint.h>
#include <string.h>

#include "clock.h"
#include "harness.h"
#include "harness_client.h"
#include "ps.h"

#define S 2
#define W 2
#define NT 3
#define CHUNK 1024 /* bytes: a 4 + b 2 + c 1 = 7 keys over both shards */
#define LR 0.5
#define DEADLINE_MS 2000 /* a wait expected to give up */
#define EVENT_MS 30000   /* upper bound for what must happen */
static const char *const names[NT] = {"a", "b", "c"};
static const uint64_t counts[NT] = {1000, 300, 50};
static struct test_server servers[S];

static void start_job(const char *consistency) {
  const char *extra[] = {"--consistency", consistency, "--optimizer", "sgd", NULL};
  for (int i = 0; i < S; i++) harness_start_server(&servers[i], i, S, W, LR, extra);
}

static void stop_job(void) {
  for (int i = 0; i < S; i++) harness_stop(servers[i].pid, SIGTERM, 5000);
}

static ps_client *connect_rank(int rank) {
  return harness_client(servers, S, rank, W, CHUNK, "test_wait_initialised");
}

static const char *msg(ps_client *c) {
  static char buf[1024];
  return ps_errmsg(c, buf, sizeof(buf));
}

static float w0[NT][1000], grad[W][NT][1000];

/* Rank 1 in its own thread: waits with no deadline, then pushes step 0 of
 * every tensor. */
struct rank1 {
  ps_client *c;
  ps_status wait_st, push_st[NT];
  char err[1024];
};

static void *rank1_run(void *arg) {
  struct rank1 *r = arg;
  r->wait_st = ps_wait_initialised(r->c, -1);
  for (int t = 0; t < NT; t++) r->push_st[t] = ps_push(r->c, t, 0, grad[1][t]);
  ps_errmsg(r->c, r->err, sizeof(r->err));
  return NULL;
}

static uint64_t pulls_sent(ps_client *c) {
  struct ps_client_counters k;
  ps_client_counters(c, &k);
  return k.pulls;
}

static void one_mode(const char *consistency) {
  bool bsp = strcmp(consistency, "bsp") == 0;
  start_job(consistency);
  ps_client *c0 = connect_rank(0), *c1 = connect_rank(1);
  ps_status st = ps_wait_initialised(c1, DEADLINE_MS);
  REQUIRE(st == PS_ERR_STATE && strstr(msg(c1), "before ps_declare"),
          "%s: before declare: %s, '%s'", consistency, ps_strerror(st), msg(c1));
  REQUIRE(ps_declare(c0, NT, names, counts) == PS_OK, "declare 0: %s", msg(c0));
  REQUIRE(ps_declare(c1, NT, names, counts) == PS_OK, "declare 1: %s", msg(c1));
  REQUIRE(ps_wait_initialised(c1, -2) == PS_ERR_INVALID, "timeout -2 accepted");

  /* a and b initialised, c not: the deadline passes, naming c */
  REQUIRE(ps_init(c0, 0, w0[0]) == PS_OK && ps_init(c0, 1, w0[1]) == PS_OK, "init a, b: %s",
          msg(c0));
  st = ps_wait_initialised(c1, DEADLINE_MS);
  REQUIRE(st == PS_ERR_STATE, "%s: wait with c uninitialised: %s, '%s'", consistency,
          ps_strerror(st), msg(c1));
  REQUIRE(strstr(msg(c1), "tensor 2 (c) is not initialised after 2000 ms") &&
              strstr(msg(c1), "ps_init"),
          "%s: the timeout says '%s'", consistency, msg(c1));

  /* rank 1 waits; rank 0 initialises c once rank 1's pulls went out (or
   * after EVENT_MS: a rank 1 that did not wait has pushed by then) */
  uint64_t before = pulls_sent(c1);
  uint64_t chunks = 0;
  for (int t = 0; t < NT; t++) chunks += (counts[t] * sizeof(float) + CHUNK - 1) / CHUNK;
  struct rank1 r1 = {.c = c1};
  pthread_t th;
  REQUIRE(pthread_create(&th, NULL, rank1_run, &r1) == 0, "thread");
  for (uint64_t end = clock_now_ms() + EVENT_MS;
       pulls_sent(c1) < before + chunks && clock_now_ms() < end;)
    clock_sleep_ms(5);
  REQUIRE(ps_init(c0, 2, w0[2]) == PS_OK, "init c: %s", msg(c0));
  REQUIRE(ps_wait_initialised(c0, 0) == PS_OK, "rank 0's own wait: %s", msg(c0));
  for (int t = 0; t < NT; t++)
    REQUIRE(ps_push(c0, t, 0, grad[0][t]) == PS_OK, "rank 0 push %d: %s", t, msg(c0));
  pthread_join(th, NULL);
  REQUIRE(r1.wait_st == PS_OK, "%s: rank 1's wait: %s, '%s'", consistency, ps_strerror(r1.wait_st),
          r1.err);
  for (int t = 0; t < NT; t++)
    REQUIRE(r1.push_st[t] == PS_OK, "%s: rank 1's push of %s after the wait: %s, '%s'", consistency,
            names[t], ps_strerror(r1.push_st[t]), r1.err);

  /* the update; in asp/ssp only that both pushes were applied */
  static float got[1000];
  for (int t = 0; t < NT; t++) {
    uint64_t version = 0;
    REQUIRE(ps_pull(c1, t, 1, got, &version) == PS_OK, "pull %d: %s", t, msg(c1));
    for (uint64_t i = 0; bsp && i < counts[t]; i++) {
      float want = w0[t][i] - (float)LR * 0.5f * (grad[0][t][i] + grad[1][t][i]);
      REQUIRE(got[i] == want || (got[i] - want) * (got[i] - want) < 1e-10f,
              "%s[%llu] = %g, expected %g", names[t], (unsigned long long)i, (double)got[i],
              (double)want);
    }
  }
  /* past version 0: at once (the time is printed, not checked) */
  uint64_t t0 = clock_now_ns();
  REQUIRE(ps_wait_initialised(c1, DEADLINE_MS) == PS_OK, "%s: wait after step 0: %s", consistency,
          msg(c1));
  printf("%s: ps_wait_initialised on initialised keys (3 tensors, 7 keys): %.2f ms\n", consistency,
         (double)(clock_now_ns() - t0) / 1e6);
  ps_client_free(c0);
  ps_client_free(c1);
  stop_job();
  printf("%s: waited for rank 0's ps_init, gave up naming the tensor left out, pushes accepted\n",
         consistency);
}

/* Without the call: the push that comes first is refused, saying what to
 * do. Then, with owners, rank 1 waits only for its own tensor, and a wait
 * given up on leaves a pull that ps_client_free ends. */
static void refusal_and_owners(void) {
  start_job("bsp");
  ps_client *c0 = connect_rank(0), *c1 = connect_rank(1);
  static const int only0[] = {0};
  const int *const owners[NT] = {NULL, only0, only0};
  const int num_owners[NT] = {0, 1, 1};
  REQUIRE(ps_declare_owned(c0, NT, names, counts, owners, num_owners) == PS_OK, "declare 0: %s",
          msg(c0));
  REQUIRE(ps_declare_owned(c1, NT, names, counts, owners, num_owners) == PS_OK, "declare 1: %s",
          msg(c1));
  ps_status st = ps_push(c1, 0, 0, grad[1][0]);
  REQUIRE(st == PS_ERR_STATE && strstr(msg(c1), "before it was initialised") &&
              strstr(msg(c1), "ps_wait_initialised"),
          "a push before init: %s, '%s'", ps_strerror(st), msg(c1));
  /* rank 0 waits for b and c, which nobody initialised; rank 1 owns only a */
  REQUIRE(ps_init(c0, 0, w0[0]) == PS_OK, "init a: %s", msg(c0));
  REQUIRE(ps_wait_initialised(c1, EVENT_MS) == PS_OK, "rank 1 owns only a: %s", msg(c1));
  st = ps_wait_initialised(c0, DEADLINE_MS);
  REQUIRE(st == PS_ERR_STATE && strstr(msg(c0), "tensor 1 (b) and others is not initialised"),
          "rank 0 waits for b and c: %s, '%s'", ps_strerror(st), msg(c0));
  /* the early push cost nothing: a's step 0 completes */
  static float got[1000];
  REQUIRE(ps_push(c0, 0, 0, grad[0][0]) == PS_OK && ps_push(c1, 0, 0, grad[1][0]) == PS_OK,
          "push a after the refusal: '%s' '%s'", msg(c0), msg(c1));
  REQUIRE(ps_pull(c1, 0, 1, got, NULL) == PS_OK, "pull a version 1: %s", msg(c1));
  ps_client_free(c0); /* its pulls of b and c still wait: they end here */
  ps_client_free(c1);
  stop_job();
  printf("a push before init is refused naming ps_wait_initialised; owners: only its own\n");
}

int main(void) {
  for (int t = 0; t < NT; t++) {
    for (uint64_t i = 0; i < counts[t]; i++) {
      w0[t][i] = (float)(t + 1) + (float)i / 1000.0f;
      for (int r = 0; r < W; r++) grad[r][t][i] = (float)(r + 1) * 0.25f + (float)(i % 5);
    }
  }
  refusal_and_owners();
  one_mode("bsp");
  one_mode("asp");
  one_mode("ssp:1");
  return 0;
}
