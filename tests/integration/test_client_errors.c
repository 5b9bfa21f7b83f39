/* test_client_errors: ps_client_new refuses bad options with a status and a
 * message naming what is wrong, and cleans up what it had set up: a bad
 * address after a good one, a shard that cannot be reached before the
 * others, a bad rank or no servers. Nothing crashes, and no descriptor of
 * the caller's (stdin here) is closed on the way out. */
#include <fcntl.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

#include "harness.h"
#include "ps.h"

/* ps_client_new with these servers; the status, the message in err. */
static ps_status open_client(const char *const *servers, int n, int rank, int world, char *err,
                             size_t errlen) {
  struct ps_client_opts o = {.servers = servers,
                             .num_servers = n,
                             .rank = rank,
                             .world_size = world,
                             .connect_timeout_ms = 300};
  ps_client *c = NULL;
  ps_status st = ps_client_new(&o, &c, err, errlen);
  REQUIRE((st == PS_OK) == (c != NULL), "status %s but client %p", ps_strerror(st), (void *)c);
  ps_client_free(c);
  return st;
}

int main(void) {
  char err[512];
  /* A real shard, and port 1, where nothing listens on a test machine. */
  struct test_server srv;
  harness_start_server(&srv, 0, 1, 1, 0.1, NULL);
  const char *closed = "127.0.0.1:1";

  const char *bad_addr[] = {srv.addr, "no-port-here", srv.addr};
  ps_status st = open_client(bad_addr, 3, 0, 1, err, sizeof(err));
  REQUIRE(st == PS_ERR_INVALID && strstr(err, "no-port-here"), "a bad second address: %s \"%s\"",
          ps_strerror(st), err);
  printf("bad address of shard 1: %s: %s\n", ps_strerror(st), err);

  const char *unreachable[] = {closed, srv.addr};
  st = open_client(unreachable, 2, 0, 1, err, sizeof(err));
  REQUIRE(st == PS_ERR_CONNECT && strstr(err, closed), "an unreachable shard 0: %s \"%s\"",
          ps_strerror(st), err);
  printf("unreachable shard 0: %s: %s\n", ps_strerror(st), err);

  const char *one[] = {srv.addr};
  REQUIRE(open_client(one, 1, 2, 2, err, sizeof(err)) == PS_ERR_INVALID, "rank 2 of 2 accepted");
  REQUIRE(open_client(one, 0, 0, 1, err, sizeof(err)) == PS_ERR_INVALID, "no servers accepted");
  REQUIRE(open_client(one, 1, 0, 1, err, sizeof(err)) == PS_OK, "the good shard alone: %s", err);
  REQUIRE(fcntl(0, F_GETFD) != -1, "stdin was closed by a failed ps_client_new");
  printf("bad rank and no servers refused; the shard alone connects; stdin still open\n");
  return 0;
}
