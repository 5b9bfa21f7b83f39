/* harness_client: see harness_client.h. */
#include "harness_client.h"

#include <stdlib.h>

ps_client *harness_client(const struct test_server *shards, int n, int rank, int world_size,
                          uint64_t chunk_bytes, const char *job_id) {
  const char **addrs = calloc((size_t)n, sizeof(*addrs));
  REQUIRE(addrs, "out of memory");
  for (int i = 0; i < n; i++) addrs[i] = shards[i].addr;
  struct ps_client_opts o = {.servers = addrs,
                             .num_servers = n,
                             .rank = rank,
                             .world_size = world_size,
                             .chunk_bytes = chunk_bytes,
                             .job_id = job_id};
  ps_client *c;
  char err[256];
  ps_status st = ps_client_new(&o, &c, err, sizeof(err));
  free(addrs);
  REQUIRE(st == PS_OK, "rank %d: cannot connect to the %d shard(s): %s", rank, n, err);
  return c;
}
