/* SIGTERM and SIGINT stop a shard cleanly (exit 0) even with a worker
 * connected and a pull waiting; the worker sees the connection close. With
 * --fail-on-signal (a Job's shards) the same stop exits 128+N, since the
 * training was not over; a shard that worker 0 stopped (ps_shutdown_servers)
 * still exits 0 with it. */
#include <signal.h>
#include <stdbool.h>
#include <sys/wait.h>

#include "harness.h"
#include "ps.h"

static void one(int sig, bool fail_on_signal) {
  struct test_server srv;
  const char *extra[] = {"--fail-on-signal=true", NULL};
  harness_start_server(&srv, 0, 1, 2, 0.1, fail_on_signal ? extra : NULL);
  const char *addrs[1] = {srv.addr};
  struct ps_client_opts o = {
      .servers = addrs, .num_servers = 1, .rank = 0, .world_size = 2, .reconnect_timeout_ms = 500};
  ps_client *c;
  char err[256];
  REQUIRE(ps_client_new(&o, &c, err, sizeof(err)) == PS_OK, "connect: %s", err);
  const char *names[] = {"t"};
  uint64_t counts[] = {64};
  float v[64] = {0};
  REQUIRE(ps_declare(c, 1, names, counts) == PS_OK, "declare");
  REQUIRE(ps_init(c, 0, v) == PS_OK, "init");
  ps_request *req;
  /* version 1 never comes: rank 1 never pushes */
  REQUIRE(ps_pull_async(c, 0, 1, v, NULL, NULL, &req) == PS_OK, "pull");
  int st = harness_stop(srv.pid, sig, 5000);
  REQUIRE(st >= 0, "shard ignored signal %d for 5 s", sig);
  int want = fail_on_signal ? 128 + sig : 0;
  REQUIRE(WIFEXITED(st) && WEXITSTATUS(st) == want, "shard exit status %d after signal %d, want %d",
          st, sig, want);
  REQUIRE(!fail_on_signal ||
              harness_grep(srv.log, "stopped by a signal before worker 0 ended the training") == 1,
          "the shard does not say why it exits %d", want);
  REQUIRE(harness_grep(srv.log, sig == SIGTERM ? "reason=\"SIGTERM\"" : "reason=\"SIGINT\"") == 1,
          "no stop reason logged");
  /* the waiting pull fails once reconnection gives up, instead of hanging */
  ps_status ps = ps_wait(req, NULL);
  REQUIRE(ps == PS_ERR_IO, "pending pull ended with %s", ps_strerror(ps));
  ps_client_free(c);
}

/* --fail-on-signal: worker 0 ending the training still means exit 0 */
static void done_by_worker0(void) {
  struct test_server srv;
  const char *extra[] = {"--fail-on-signal=true", NULL};
  harness_start_server(&srv, 0, 1, 1, 0.1, extra);
  const char *addrs[1] = {srv.addr};
  struct ps_client_opts o = {.servers = addrs, .num_servers = 1, .rank = 0, .world_size = 1};
  ps_client *c;
  char err[256];
  REQUIRE(ps_client_new(&o, &c, err, sizeof(err)) == PS_OK, "connect: %s", err);
  REQUIRE(ps_shutdown_servers(c) == PS_OK, "shutdown");
  ps_client_free(c);
  int st = harness_wait(srv.pid, 10000);
  REQUIRE(st >= 0 && WIFEXITED(st) && WEXITSTATUS(st) == 0,
          "a shard stopped by worker 0 exits %d with --fail-on-signal, want 0", st);
}

int main(void) {
  one(SIGTERM, false);
  one(SIGINT, false);
  one(SIGTERM, true);
  one(SIGINT, true);
  done_by_worker0();
  printf("SIGTERM and SIGINT: exit 0, pending pull failed cleanly; with --fail-on-signal 143 "
         "and 130, and 0 when worker 0 ends the training\n");
  return 0;
}
