/* test_rollback_race: two ranks rolling the job back at different moments
 * after a kill -9 must not undo each other's redone step.
 *
 * The interleaving, driven step by step (rank a = 0, rank b = 1; shard X is
 * killed, shard Y is not; checkpoints every 2 versions):
 *   1. steps 0 and 1, then a does step 2 and b pulls it;
 *   2. X is stopped, b pushes step 2 (Y takes it, X's part waits in the
 *      socket), X is killed and restarted: it is back at clock 2 and takes
 *      b's resent push of step 2, a push of the timeline the job abandons;
 *   3. a pulls step 3: X refuses (it lacks a's push), a rolls the job back
 *      to 2 (Y reloads), redoes step 2;
 *   4. b pulls step 3, is refused, rolls back to 2 as well and redoes step 2;
 *   5. a pulls step 3 and must get it.
 * Before rollbacks had ids, X counted b's resent push and a's redone one and
 * moved to version 3, b's later rollback reloaded X to 2 and threw a's
 * redone step away, and a's pull in 5 was refused: with more ranks and
 * real timing the two rollbacks chased each other for ever (a livelock seen
 * in test_shard_restart kill9). Then the job trains to step K and every
 * parameter must equal the replay (0 lost, 0 doubled updates). */
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "bsp_ledger.h"
#include "clock.h"
#include "harness.h"
#include "ps.h"

#define S 2
#define W 2
#define K 8
#define NT 3
#define X 1 /* the shard that is killed */
static const char *const names[NT] = {"w0", "b0", "big"};
static const uint64_t counts[NT] = {1000, 10, 5000};
static const float lr = 0.05f;

struct rank {
  int r;
  ps_client *c;
  float *p[NT], *g[NT];
  ps_request *req[NT];
};

static void rank_open(struct rank *k, int r, const struct test_server *srv) {
  const char *addrs[S] = {srv[0].addr, srv[1].addr};
  struct ps_client_opts o = {.servers = addrs,
                             .num_servers = S,
                             .rank = r,
                             .world_size = W,
                             .chunk_bytes = 4096,
                             .job_id = "test_rollback_race",
                             .reconnect_timeout_ms = 30000};
  char err[256];
  k->r = r;
  REQUIRE(ps_client_new(&o, &k->c, err, sizeof(err)) == PS_OK, "rank %d: %s", r, err);
  REQUIRE(ps_declare(k->c, NT, names, counts) == PS_OK, "rank %d declare", r);
  for (int t = 0; t < NT; t++) {
    k->p[t] = malloc(counts[t] * sizeof(float));
    k->g[t] = malloc(counts[t] * sizeof(float));
    REQUIRE(k->p[t] && k->g[t], "out of memory");
    for (uint64_t i = 0; i < counts[t]; i++) k->p[t][i] = bsp_init_value(t, i);
    if (r == 0) REQUIRE(ps_init(k->c, t, k->p[t]) == PS_OK, "init");
  }
}

static void rank_close(struct rank *k) {
  ps_client_free(k->c);
  for (int t = 0; t < NT; t++) {
    free(k->p[t]);
    free(k->g[t]);
  }
}

/* Pulls every tensor at version s; the first failure, or PS_OK with every
 * version exactly s. */
static ps_status pull_step(struct rank *k, uint64_t s) {
  ps_status bad = PS_OK;
  for (int t = 0; t < NT; t++)
    REQUIRE(ps_pull_async(k->c, t, s, k->p[t], NULL, NULL, &k->req[t]) == PS_OK, "pull");
  for (int t = 0; t < NT; t++) {
    uint64_t v = 0;
    ps_status st = ps_wait(k->req[t], &v);
    if (st != PS_OK && bad == PS_OK) bad = st;
    if (st == PS_OK)
      REQUIRE(v == s, "rank %d pulled version %llu of tensor %d for step %llu", k->r,
              (unsigned long long)v, t, (unsigned long long)s);
  }
  return bad;
}

static void push_start(struct rank *k, uint64_t s) {
  for (int t = 0; t < NT; t++) {
    for (uint64_t i = 0; i < counts[t]; i++) k->g[t][i] = bsp_grad_value(k->r, s, i, k->p[t][i]);
    REQUIRE(ps_push_async(k->c, t, s, k->g[t], NULL, NULL, &k->req[t]) == PS_OK, "push");
  }
}

static ps_status push_wait(struct rank *k) {
  ps_status bad = PS_OK;
  for (int t = 0; t < NT; t++) {
    ps_status st = ps_wait(k->req[t], NULL);
    if (st != PS_OK && bad == PS_OK) bad = st;
  }
  return bad;
}

static void step_ok(struct rank *k, uint64_t s) {
  ps_status st = pull_step(k, s);
  char msg[512];
  REQUIRE(st == PS_OK, "rank %d pull of step %llu: %s (%s)", k->r, (unsigned long long)s,
          ps_strerror(st), ps_errmsg(k->c, msg, sizeof(msg)));
  push_start(k, s);
  REQUIRE((st = push_wait(k)) == PS_OK, "rank %d push of step %llu: %s (%s)", k->r,
          (unsigned long long)s, ps_strerror(st), ps_errmsg(k->c, msg, sizeof(msg)));
}

/* Steps [from, to) of both ranks, each step's pulls before its pushes. */
static void steps_together(struct rank *a, struct rank *b, uint64_t from, uint64_t to) {
  for (uint64_t s = from; s < to; s++) {
    REQUIRE(pull_step(a, s) == PS_OK && pull_step(b, s) == PS_OK, "pulls of step %llu",
            (unsigned long long)s);
    push_start(a, s);
    push_start(b, s);
    REQUIRE(push_wait(a) == PS_OK && push_wait(b) == PS_OK, "pushes of step %llu",
            (unsigned long long)s);
  }
}

/* k's pull of step s is refused for a rollback to `clock`; k rolls back. */
static void refused_then_roll_back(struct rank *k, uint64_t s, uint64_t clock) {
  ps_status st = pull_step(k, s);
  REQUIRE(st == PS_ERR_ROLLBACK, "rank %d pull of step %llu: %s, want a rollback", k->r,
          (unsigned long long)s, ps_strerror(st));
  REQUIRE(ps_rollback_clock(k->c) == clock, "rank %d: rollback to %llu, want %llu", k->r,
          (unsigned long long)ps_rollback_clock(k->c), (unsigned long long)clock);
  char msg[512];
  REQUIRE((st = ps_rollback(k->c, clock)) == PS_OK, "rank %d ps_rollback: %s (%s)", k->r,
          ps_strerror(st), ps_errmsg(k->c, msg, sizeof(msg)));
}

static void wait_for(const char *log, const char *needle) {
  for (int i = 0; i < 1000 && harness_grep(log, needle) == 0; i++) clock_sleep_ms(10);
  REQUIRE(harness_grep(log, needle) > 0, "%s never logged %s", log, needle);
}

int main(void) {
  char ckdir[600];
  snprintf(ckdir, sizeof(ckdir), "%s/ckpt", harness_dir());
  const char *extra[] = {"--checkpoint-dir", ckdir, "--checkpoint-every", "2", NULL};
  struct test_server srv[S];
  for (int i = 0; i < S; i++) harness_start_server(&srv[i], i, S, W, lr, extra);
  struct rank a, b;
  rank_open(&a, 0, srv);
  rank_open(&b, 1, srv);

  /* 1 (a writer still busy skips a checkpoint: let the initial one finish) */
  for (int i = 0; i < S; i++) wait_for(srv[i].log, "clock=0 ");
  steps_together(&a, &b, 0, 2);
  for (int i = 0; i < S; i++) wait_for(srv[i].log, "clock=2 ");
  step_ok(&a, 2);
  REQUIRE(pull_step(&b, 2) == PS_OK, "b's pull of step 2");

  /* 2 */
  REQUIRE(kill(srv[X].pid, SIGSTOP) == 0, "SIGSTOP");
  push_start(&b, 2);
  clock_sleep_ms(200); /* Y takes its part; X's waits in the socket */
  REQUIRE(kill(srv[X].pid, SIGKILL) == 0, "SIGKILL");
  int st = harness_wait(srv[X].pid, 10000);
  REQUIRE(st >= 0 && WIFSIGNALED(st), "shard %d not killed: %d", X, st);
  char addr[64];
  snprintf(addr, sizeof(addr), "%s", srv[X].addr);
  const char *again[] = {
      "--checkpoint-dir", ckdir, "--checkpoint-every", "2", "--listen", addr, NULL};
  harness_start_server(&srv[X], X, S, W, lr, again);
  REQUIRE(harness_grep(srv[X].log, "checkpoint loaded") == 1, "shard %d loaded nothing", X);
  REQUIRE(push_wait(&b) == PS_OK, "b's push of step 2, resent to the restarted shard");
  printf("shard %d killed with b's push of step 2 in flight, restarted at clock 2\n", X);

  /* 3 */
  refused_then_roll_back(&a, 3, 2);
  step_ok(&a, 2);
  /* 4 */
  refused_then_roll_back(&b, 3, 2);
  step_ok(&b, 2);
  printf("a and b each rolled back to 2 and redid step 2, a before b\n");

  /* 5 */
  ps_status r = pull_step(&a, 3);
  char msg[512];
  REQUIRE(r == PS_OK,
          "a's pull of step 3 after both rollbacks: %s (%s): b's rollback undid a's redone step",
          ps_strerror(r), ps_errmsg(a.c, msg, sizeof(msg)));
  push_start(&a, 3);
  REQUIRE(pull_step(&b, 3) == PS_OK, "b's pull of step 3");
  push_start(&b, 3);
  REQUIRE(push_wait(&a) == PS_OK && push_wait(&b) == PS_OK, "pushes of step 3");
  steps_together(&a, &b, 4, K);
  int bad = 0;
  struct rank *ranks[W] = {&a, &b};
  for (int k = 0; k < W; k++) {
    REQUIRE(pull_step(ranks[k], K) == PS_OK, "final pull");
    for (int t = 0; t < NT; t++)
      bad += bsp_replay_compare(ranks[k]->r, names[t], t, counts[t], W, K, lr, ranks[k]->p[t]);
  }
  REQUIRE(bad == 0, "%d parameters differ from the replay (lost or doubled updates)", bad);
  REQUIRE(harness_grep(srv[X].log, "every live rank rolled back") == 1 &&
              harness_grep(srv[1 - X].log, "every live rank rolled back") == 1,
          "a shard did not see both ranks roll back exactly once");
  printf("a's step 3 went through; %d steps equal the replay (0 lost, 0 doubled)\n", K);
  REQUIRE(ps_shutdown_servers(a.c) == PS_OK, "shutdown");
  rank_close(&a);
  rank_close(&b);
  for (int i = 0; i < S; i++) {
    st = harness_wait(srv[i].pid, 20000);
    REQUIRE(st >= 0 && WIFEXITED(st) && WEXITSTATUS(st) == 0, "shard %d exit status %d", i, st);
  }
  return 0;
}
