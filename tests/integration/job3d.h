/* job3d: what the 3D resume tests share (test_3d_resume, test_3d_ps_resume,
 * tests/faults/test_3d_shard_rollback): the t=2 p=2 ps-mode job, dumps
 * compared, numbers read back from the logs. */
#ifndef PS_TEST_JOB3D_H
#define PS_TEST_JOB3D_H

#include <stdbool.h>

#include "ring_workers.h"

/* Four ps-worker processes, t=2 p=2 d=1 in ps mode against servers
 * ("h:p,h:p"): steps steps of mlp:784-64-10 (seed 7, batch 32, 4
 * micro-batches, progress every 10 steps); rank 0 dumps the model to dump. */
void job3d_start_ps(struct ring_workers *rw, const char *servers, const char *steps,
                    const char *dump);
/* The largest difference between the dumps a and b relative to b's largest
 * magnitude; *same: bit-identical. Fails the test if either is missing or
 * they differ in length. */
double job3d_dump_diff(const char *a, const char *b, bool *same);
/* The largest value of `key` (e.g. " step=") on the lines of log holding
 * msg, or -1 if none. */
long job3d_logged(const char *log, const char *msg, const char *key);
/* The step the 4 ranks of rw resumed at in ps mode ("resumed at the shards'
 * step"), which must be one step for all (REQUIRE). */
long job3d_resumed_step(const struct ring_workers *rw);

#endif
