/* hier: the node-first all-reduce over the point-to-point connections (see
 * hier.c). Internal to libps. */
#ifndef PS_HIER_H
#define PS_HIER_H

#include <stddef.h>

#include "collective.h"
#include "ring.h"

struct hier;

/* Exchanges every rank's node name over c's ring (an all-gather: every rank
 * must call it, in ps_coll_open) and, when ranks share nodes and there are
 * several nodes, returns the plan in *out; else *out is NULL (flat ring).
 * Returns 0 or the ring's negative errno. */
int hier_new(ps_coll *c, const char *node, struct hier **out);
void hier_free(struct hier *h); /* accepts NULL */

/* buf (count elements of dt) becomes the combination over all ranks, the
 * same bits on every rank. The caller has run ring_agree. Returns PS_OK or
 * the group's failure. */
ps_status hier_allreduce(ps_coll *c, struct hier *h, void *buf, size_t count, enum dtype dt,
                         enum ring_redop op);

#endif
