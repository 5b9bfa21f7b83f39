/* SIGTERM and SIGINT stop a shard cleanly (exit 0) even with a worker
 * connected and a pull waiting; the worker sees the connection close. */
#include <signal.h>
#include <sys/wait.h>

#include "harness.h"
#include "ps.h"

static void one(int sig) {
  struct test_server srv;
  harness_start_server(&srv, 0, 1, 2, 0.1, NULL);
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
  REQUIRE(WIFEXITED(st) && WEXITSTATUS(st) == 0, "shard exit status %d after signal %d", st, sig);
  REQUIRE(harness_grep(srv.log, sig == SIGTERM ? "reason=\"SIGTERM\"" : "reason=\"SIGINT\"") == 1,
          "no stop reason logged");
  /* the waiting pull fails once reconnection gives up, instead of hanging */
  ps_status ps = ps_wait(req, NULL);
  REQUIRE(ps == PS_ERR_IO, "pending pull ended with %s", ps_strerror(ps));
  ps_client_free(c);
}

int main(void) {
  one(SIGTERM);
  one(SIGINT);
  printf("SIGTERM and SIGINT: exit 0, pending pull failed cleanly\n");
  return 0;
}
