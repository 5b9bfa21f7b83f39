/* SIGTERM's drain, deterministically: one shard, two workers (two libps
 * clients in this process), two keys a and b, SGD with lr 1. Rank 0 pushes
 * a's step 0; the shard gets SIGTERM and starts draining. Rank 1 then pushes
 * b's step 0, which would start a step: the shard holds it (no reply), and
 * rank 1's push of a's step 0, which finishes the started step, is applied.
 * No step is unfinished, so the shard writes its final checkpoint and exits
 * 0 (held_pushes=1). Restarted on the same address, it loads the checkpoint;
 * libps resends the held push, rank 0 pushes b's step 0, and both keys end
 * at exactly -(1 + 3) / 2 = -2 at version 1: nothing lost, nothing doubled,
 * no step redone. */
#include <signal.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "harness.h"
#include "ps.h"

#define N 4

static ps_client *client(const char *addr, int rank) {
  const char *addrs[1] = {addr};
  struct ps_client_opts o = {.servers = addrs,
                             .num_servers = 1,
                             .rank = rank,
                             .world_size = 2,
                             .reconnect_timeout_ms = 30000};
  ps_client *c;
  char err[256];
  REQUIRE(ps_client_new(&o, &c, err, sizeof(err)) == PS_OK, "rank %d: %s", rank, err);
  const char *names[] = {"a", "b"};
  uint64_t counts[] = {N, N};
  REQUIRE(ps_declare(c, 2, names, counts) == PS_OK, "declare");
  return c;
}

static void fill(float *v, float x) {
  for (int i = 0; i < N; i++) v[i] = x;
}

int main(void) {
  char ckdir[600];
  snprintf(ckdir, sizeof(ckdir), "%s/ckpt", harness_dir());
  const char *extra[] = {"--checkpoint-dir", ckdir, NULL};
  struct test_server srv;
  harness_start_server(&srv, 0, 1, 2, 1.0, extra);
  ps_client *c0 = client(srv.addr, 0), *c1 = client(srv.addr, 1);
  float zero[N], one[N], three[N], out[N];
  fill(zero, 0);
  fill(one, 1);
  fill(three, 3);
  REQUIRE(ps_init(c0, 0, zero) == PS_OK && ps_init(c0, 1, zero) == PS_OK, "init");
  REQUIRE(ps_push(c0, 0, 0, one) == PS_OK, "rank 0 pushes a");

  char old_log[512];
  snprintf(old_log, sizeof(old_log), "%s", srv.log);
  REQUIRE(kill(srv.pid, SIGTERM) == 0, "SIGTERM");
  for (int i = 0; i < 1000 && harness_grep(old_log, "draining before") == 0; i++) usleep(10000);
  REQUIRE(harness_grep(old_log, "draining before") == 1, "no drain");
  ps_request *held;
  REQUIRE(ps_push_async(c1, 1, 0, three, NULL, NULL, &held) == PS_OK, "rank 1 pushes b");
  usleep(100000); /* b's push reaches the shard first (same connection) */
  REQUIRE(ps_push(c1, 0, 0, three) == PS_OK, "rank 1 pushes a: finishes the started step");
  int st = harness_wait(srv.pid, 20000);
  REQUIRE(st >= 0 && WIFEXITED(st) && WEXITSTATUS(st) == 0, "shard exit status %d", st);
  REQUIRE(harness_grep(old_log, "held_pushes=1 unfinished_steps=0") == 1,
          "final checkpoint should hold 1 push and leave no step unfinished");

  char addr[64];
  snprintf(addr, sizeof(addr), "%s", srv.addr);
  const char *again[] = {"--checkpoint-dir", ckdir, "--listen", addr, NULL};
  harness_start_server(&srv, 0, 1, 2, 1.0, again);
  REQUIRE(harness_grep(srv.log, "checkpoint loaded") == 1, "restart loaded nothing");
  REQUIRE(ps_wait(held, NULL) == PS_OK, "the held push, resent, was taken");
  REQUIRE(ps_push(c0, 1, 0, one) == PS_OK, "rank 0 pushes b");
  for (int t = 0; t < 2; t++) {
    uint64_t v;
    REQUIRE(ps_pull(c0, t, 1, out, &v) == PS_OK && v == 1, "pull %d: version %llu", t,
            (unsigned long long)v);
    for (int i = 0; i < N; i++) REQUIRE(out[i] == -2.0f, "key %d [%d] = %g, want -2", t, i, out[i]);
  }
  REQUIRE(ps_shutdown_servers(c0) == PS_OK, "shutdown");
  ps_client_free(c0);
  ps_client_free(c1);
  harness_wait(srv.pid, 20000);
  printf("drain: 1 push held across the restart, both keys exact\n");
  return 0;
}
