/* A shard keeps the first layout a worker declares and refuses any other
 * with an error that says what differs; a wrong world size or rank is
 * refused at hello. The shard goes on serving the good client after each. */
#include <string.h>
#include <sys/wait.h>

#include "harness.h"
#include "ps.h"

static struct test_server srv;

static ps_status try_client(int rank, int world, int nt, const char *const *names,
                            const uint64_t *counts, char *err, size_t errlen, ps_client **keep) {
  const char *addrs[1] = {srv.addr};
  struct ps_client_opts o = {.servers = addrs,
                             .num_servers = 1,
                             .rank = rank,
                             .world_size = world,
                             .connect_timeout_ms = 2000};
  ps_client *c;
  err[0] = 0;
  ps_status st = ps_client_new(&o, &c, err, errlen);
  if (st != PS_OK) return st;
  st = ps_declare(c, nt, names, counts);
  if (st != PS_OK) ps_errmsg(c, err, errlen);
  if (st == PS_OK && keep)
    *keep = c;
  else
    ps_client_free(c);
  return st;
}

int main(void) {
  harness_start_server(&srv, 0, 1, 2, 0.1, NULL);
  const char *names[] = {"fc.weight", "fc.bias"};
  uint64_t counts[] = {100, 10};
  char err[512];
  ps_client *good = NULL;
  REQUIRE(try_client(0, 2, 2, names, counts, err, sizeof(err), &good) == PS_OK, "first: %s", err);
  float init[100] = {0};
  for (int i = 0; i < 100; i++) init[i] = (float)i;
  REQUIRE(ps_init(good, 0, init) == PS_OK, "init");

  /* the same layout again is fine */
  REQUIRE(try_client(1, 2, 2, names, counts, err, sizeof(err), NULL) == PS_OK, "same: %s", err);

  /* a different size of one tensor */
  uint64_t counts2[] = {100, 11};
  ps_status st = try_client(1, 2, 2, names, counts2, err, sizeof(err), NULL);
  REQUIRE(st == PS_ERR_LAYOUT_MISMATCH, "size change gave %s", ps_strerror(st));
  REQUIRE(strstr(err, "layout mismatch") && strstr(err, "fc.bias"), "message: %s", err);

  /* a different number of tensors */
  st = try_client(1, 2, 1, names, counts, err, sizeof(err), NULL);
  REQUIRE(st == PS_ERR_LAYOUT_MISMATCH, "tensor count change gave %s", ps_strerror(st));
  REQUIRE(strstr(err, "tensors"), "message: %s", err);

  /* a renamed tensor */
  const char *names3[] = {"fc.weight", "fc.b"};
  st = try_client(1, 2, 2, names3, counts, err, sizeof(err), NULL);
  REQUIRE(st == PS_ERR_LAYOUT_MISMATCH && strstr(err, "fc.b"), "rename: %s (%s)", ps_strerror(st),
          err);

  /* wrong world size and rank are refused at hello */
  st = try_client(0, 3, 2, names, counts, err, sizeof(err), NULL);
  REQUIRE(st != PS_OK && strstr(err, "world size 3") && strstr(err, "--num-workers 2"), "world: %s",
          err);
  st = try_client(5, 7, 2, names, counts, err, sizeof(err), NULL);
  REQUIRE(st != PS_OK, "rank 5 accepted");

  /* the first client still works: its pull of version 0 sees the init */
  float got[100];
  uint64_t v;
  REQUIRE(ps_pull(good, 0, 0, got, &v) == PS_OK && v == 0, "pull after mismatches");
  REQUIRE(memcmp(got, init, sizeof(init)) == 0, "values changed");
  REQUIRE(harness_grep(srv.log, "layout mismatch") >= 3, "shard did not log the mismatches");
  ps_client_free(good);
  int status = harness_stop(srv.pid, SIGTERM, 5000);
  REQUIRE(status >= 0 && WIFEXITED(status) && WEXITSTATUS(status) == 0, "shard exit %d", status);
  printf("layout mismatch, world size and rank refused with clear messages\n");
  return 0;
}
