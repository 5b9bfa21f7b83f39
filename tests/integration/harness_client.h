/* harness_client: a libps client of the integration tests' shards, in one
 * call (separate from harness.c, which tests that do not link libps use). */
#ifndef PS_TEST_HARNESS_CLIENT_H
#define PS_TEST_HARNESS_CLIENT_H

#include <stdint.h>

#include "harness.h"
#include "ps.h"

/* Connects rank of a job of world_size workers to the n shards (chunks of
 * chunk_bytes, 0 = libps's default), or stops the test (REQUIRE) saying why. */
ps_client *harness_client(const struct test_server *shards, int n, int rank, int world_size,
                          uint64_t chunk_bytes, const char *job_id);

#endif
