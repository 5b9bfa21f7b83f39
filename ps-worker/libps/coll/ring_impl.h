/* ring_impl: what the modules of the ring share (ring.c: the progress loop,
 * all-reduce and broadcast; ring_coll.c: the other collectives; hier.c
 * borrows ring_combine): the ring itself, the segments of a plan and the
 * helpers that build one. See ring.c for the plan invariants. Internal to
 * libps. */
#ifndef PS_RING_IMPL_H
#define PS_RING_IMPL_H

#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "auth.h"
#include "dtype.h"
#include "ring.h"

enum {
  IOV_BATCH = 64, /* segments per sendmsg/recvmsg */
  NUM_SLOTS = 8,  /* scratch slots of reduce-scatter */
  HDR_BYTES = 24,
  /* bytes: chunks start on 64-byte boundaries of the buffer, whole
   * elements of every dtype */
  CHUNK_ALIGN = 64,
};
/* Bytes taken from the socket before the loop turns to sending again, so the
 * data just summed is forwarded while it is still in cache. */
#define RECV_BATCH_BYTES (512u * 1024u)
#define HDR_MAGIC 0x47525350u /* "PSRG" */

enum op_kind {
  OP_ALLREDUCE = 1,
  OP_BROADCAST = 2,
  OP_ALLGATHER = 3,
  OP_REDUCE_SCATTER = 4,
  OP_REDUCE = 5,
  OP_ALLTOALL = 6,
  OP_NODE_ALLREDUCE = RING_NODE_ALLREDUCE, /* ring_agree only: the data goes elsewhere */
  OP_PAIRWISE_ALLTOALL = RING_PAIRWISE_ALLTOALL,
};
enum act { ACT_NONE, ACT_HDR, ACT_SLOT_SUM, ACT_BUF_SUM, ACT_TAG };

struct rseg {
  char *dst;
  size_t len;
  /* ACT_SLOT_SUM: the local slice added into the slot; ACT_BUF_SUM: where the sum goes */
  char *aux;
  uint32_t need_send, need_recv;
  uint8_t act;
};

struct sseg {
  const char *src;
  size_t len;
  uint32_t need_recv;
};

struct op_hdr {
  uint32_t magic;
  uint8_t kind, redop, small, dtype; /* dtype: enum dtype of a reduction, else 0 */
  uint32_t root;
  uint32_t seq;
  uint64_t count; /* elements (reductions) or bytes (the others) */
};
_Static_assert(sizeof(struct op_hdr) == HDR_BYTES, "op header is 24 bytes on the wire");

struct ring {
  int rank, world, prev, next, abort_fd;
  const atomic_int *abort_flag;
  size_t slice, small, round;
  uint64_t spin_ns;
  char *slots;       /* NUM_SLOTS * slice bytes */
  char *gather;      /* small algorithm: W buffers */
  size_t gather_cap; /* bytes */
  struct sseg *ss;
  struct rseg *rs;
  size_t ns, nr, ss_cap, rs_cap;
  struct op_hdr hdr_out, hdr_in;
  uint32_t seq;
  enum ring_redop op; /* of the reduction being run */
  enum dtype dt;      /* its element type */
  size_t esz;         /* and that type's size */
  char *scratch;      /* all-to-all: the blocks passed on */
  size_t scratch_cap;
  struct auth_session *tx, *rx; /* borrowed; NULL = no authentication */
  uint8_t tag_out[AUTH_TAG_BYTES], tag_in[AUTH_TAG_BYTES];
  int err, lost;
  char msg[512];
};

int ring_fail(struct ring *g, int err, int lost, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));

static inline int ring_mod(int a, int w) {
  return ((a % w) + w) % w;
}
static inline size_t ring_nslices(size_t len, size_t slice) {
  return (len + slice - 1) / slice;
}

/* A plan: room for ns send and nr receive segments (and the tags), the op
 * header first in each list, then the segments in stream order. */
int ring_reserve(struct ring *g, size_t ns, size_t nr);
void ring_add_send(struct ring *g, const void *src, size_t len, size_t need_recv);
void ring_add_recv(struct ring *g, void *dst, size_t len, enum act act, void *aux, size_t need_send,
                   size_t need_recv);
/* The reduction the next plan runs: ACT_SLOT_SUM and ACT_BUF_SUM combine
 * elements of dt with op (and ACT_BUF_SUM divides for a mean). */
void ring_set_reduction(struct ring *g, enum dtype dt, enum ring_redop op);
/* Starts a plan with its op header; dtype is g->dt's for a reduction, else 0. */
void ring_start_op(struct ring *g, enum op_kind kind, int redop, bool small, int root,
                   uint64_t count);
/* Ends each direction that carries anything with its tag (authentication). */
void ring_add_tags(struct ring *g);
/* Runs the plan to its end; 0 or the error (ring_fail has the message). */
int ring_run(struct ring *g);
/* "sum", "avg", "max", "min" */
const char *ring_redop_name(int op);
/* dst = dst (op) src, n elements of dt (sum for both sum and mean). */
void ring_combine(enum dtype dt, enum ring_redop op, void *dst, const void *src, size_t n);
/* The ring's own checks of a reduction's arguments: op and dt known, and
 * count elements (times `times`, the buffers' multiple) addressable twice
 * over. */
bool ring_reduction_ok(enum dtype dt, enum ring_redop op, size_t count, size_t times);

#endif
