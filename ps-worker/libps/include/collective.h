/* collective: libps's collectives over a ring of W workers on TCP:
 * all-reduce, reduce-scatter and reduce (sum, mean, max or min of float32
 * buffers, or of any ps_dtype with the _typed calls), all-gather, broadcast
 * from any root, all-to-all and barrier, and
 * send and receive between two ranks over connections of their own (p2p).
 *
 * Rendezvous. Rank r listens on the port of its own peer address (or takes
 * over a socket a launcher already bound), connects to rank r+1 with capped
 * backoff (DNS names may not resolve yet) and accepts rank r-1; every rank
 * r > 0 also opens a control connection to rank 0. Each connection starts with
 * a hello frame (proto/ps.proto: job id, world size, sender rank, addressed
 * rank, connection kind) that the acceptor checks and answers with ACK or an
 * ERROR naming what differs; a stranger is refused and the rank keeps
 * waiting for the right peer until the rendezvous deadline.
 *
 * Failure. The control connections form a star on rank 0 that carries
 * heartbeats in both directions (a background thread per rank, asleep in
 * poll between beats). A rank that dies closes its sockets: rank 0 sees it at
 * once (or after peer_timeout_ms of silence, for a stopped or unreachable
 * process) and tells every other rank which rank was lost; every rank sees
 * rank 0's death the same way, and neighbours see a broken ring connection
 * directly. Any operation in progress or called later then fails with
 * PS_ERR_IO and ps_coll_errmsg names the lost rank. There is no recovery: a
 * collective group that lost a member is closed and the job restarts
 * (Kubernetes restart semantics, exit 129).
 *
 * The data path is ring.h. Every rank must issue the same collectives with the
 * same sizes in the same order; a mismatch is detected and fails with
 * PS_ERR_STATE instead of producing garbage. Sizes are per rank (count or
 * bytes, as each function says); 0 is valid and moves nothing.
 *
 * Threads: the blocking calls run on the caller's thread (one thread at a
 * time). The first asynchronous call starts a worker thread that runs queued
 * operations in order; from then on the blocking calls queue behind them. */
#ifndef PS_COLLECTIVE_H
#define PS_COLLECTIVE_H

#include <stddef.h>
#include <stdint.h>

#include "ps.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct ps_coll ps_coll;
typedef struct ps_coll_request ps_coll_request;

/* max and min: a NaN on any rank is the result (as torch.maximum, NCCL). */
enum ps_redop { PS_REDOP_SUM = 0, PS_REDOP_AVG = 1, PS_REDOP_MAX = 2, PS_REDOP_MIN = 3 };

/* The element types of the reductions (NCCL's ncclDataType_t set). Each is
 * added, compared and divided in its own arithmetic, as torch does on the
 * CPU: float16 and bfloat16 through float32, rounded back to nearest-even at
 * every step; integers wrap modulo 2^bits; a mean multiplies the sum by 1/W
 * for the floating types and divides it by W, truncating toward zero, for
 * the integers (NCCL's ncclAvg). A rank calling with another type than its
 * peers fails every rank with PS_ERR_STATE naming both. */
typedef enum {
  PS_DTYPE_FLOAT32 = 0,
  PS_DTYPE_FLOAT64 = 1,
  PS_DTYPE_FLOAT16 = 2,
  PS_DTYPE_BFLOAT16 = 3,
  PS_DTYPE_INT8 = 4,
  PS_DTYPE_UINT8 = 5,
  PS_DTYPE_INT32 = 6,
  PS_DTYPE_UINT32 = 7,
  PS_DTYPE_INT64 = 8,
  PS_DTYPE_UINT64 = 9,
} ps_dtype;

/* "float32", "bfloat16", "int64", ...; NULL for a number that is no type. */
const char *ps_dtype_name(ps_dtype dtype);
/* Bytes per element; 0 for a number that is no type. */
size_t ps_dtype_size(ps_dtype dtype);

/* The transport of the all-reduce (ps-worker --allreduce-backend): the TCP
 * ring of this header, or NCCL on GPUs, bootstrapped over it
 * (collective_nccl.h). */
typedef enum { PS_COLL_TCP = 0, PS_COLL_NCCL = 1 } ps_coll_backend;

/* Parses "tcp" or "nccl" into *out. Anything else is PS_ERR_INVALID, with
 * the reason ("expected tcp or nccl") in err when errlen > 0. Whether this
 * build has NCCL is ps_nccl_built's question, not this one's. */
ps_status ps_coll_backend_parse(const char *s, ps_coll_backend *out, char *err, size_t errlen);

struct ps_coll_opts {
  int rank, world_size;
  const char *const *peers; /* world_size "host:port": where rank i listens */
  const char *job_id;       /* must be equal on every rank (NULL = "") */
  const char *listen_addr;  /* NULL: 0.0.0.0 and the port of peers[rank] */
  int listen_fd;            /* > 0: a listening socket to use instead of binding (taken over) */
  int connect_timeout_ms;   /* rendezvous deadline; 0 = 60000, -1 = forever */
  int peer_timeout_ms;      /* a silent peer is lost after this; 0 = 10000 */
  size_t slice_bytes;       /* pipeline slice; 0 = 128 KiB */
  size_t small_bytes; /* (W-1) x bytes up to this use the low-latency algorithm; 0 = 256 KiB */
  size_t round_bytes; /* large all-reduces go in rounds of W times this; 0 = 128 KiB */
  int spin_us;        /* spin before sleeping in poll; 0 = default (50), -1 = never */
  /* The job's token (ps.h: ps_token_load): peers authenticate each other
   * at rendezvous and every later frame carries a tag. NULL = no
   * authentication. Borrowed: it must outlive the group. */
  const ps_token *auth_token;
  /* Non-zero on every rank: the rendezvous also connects every pair of
   * ranks for ps_coll_send / ps_coll_recv (W-1 more sockets per rank). */
  int p2p;
  /* Node-first all-reduce (Horovod's hierarchical all-reduce): non-zero on
   * every rank, with each rank's node (the host it runs on; Kubernetes:
   * spec.nodeName) in `node`. When ranks share nodes and there are several
   * nodes, all-reduces (and barriers) reduce within each node to its lowest
   * rank, all-reduce among those leaders, and send the result back within
   * the node, so far less crosses between nodes than with the flat ring.
   * Otherwise (one node, one rank per node, a rank without a node) the ring
   * all-reduces as usual. Implies p2p. */
  int node_first;
  const char *node;
};

/* Connects the ring. On failure *out is NULL, err names the problem and the
 * status says whether retrying may help (PS_ERR_CONNECT: a peer never came up;
 * PS_ERR_REMOTE: a peer refused us, or we refused everyone who came, because
 * the configurations differ; PS_ERR_INVALID: bad options). */
ps_status ps_coll_open(const struct ps_coll_opts *o, ps_coll **out, char *err, size_t errlen);
/* Orderly leave: waits for queued operations, tells the others this is not
 * a failure, closes everything. Accepts NULL. On a group (ps_coll_split) it
 * only frees the group (its operations must be finished); close every group
 * before the job group it came from. A job group closed first logs a warning
 * naming how many are open, leaves the job at once, and is freed by the last
 * group's close; operations on those groups fail with PS_ERR_STATE. */
void ps_coll_close(ps_coll *c);

int ps_coll_rank(const ps_coll *c);
int ps_coll_world_size(const ps_coll *c);

/* buf (count floats) becomes the element-wise sum (mean, max, min) over all
 * ranks; every rank gets the bit-identical result. */
ps_status ps_coll_allreduce(ps_coll *c, float *buf, size_t count, enum ps_redop op);
/* Copies root's buf (bytes) into every other rank's buf. */
ps_status ps_coll_broadcast(ps_coll *c, void *buf, size_t bytes, int root);
/* recv (world_size * bytes) gets every rank's send (bytes), rank 0's first.
 * In place: send = recv + rank * bytes. */
ps_status ps_coll_allgather(ps_coll *c, const void *send, void *recv, size_t bytes);
/* send holds world_size chunks of count floats; recv (count floats) gets
 * chunk `rank` of their element-wise combination over all ranks (NCCL's
 * ncclReduceScatter, recvcount = count). In place: recv = send + rank *
 * count; otherwise the two must not overlap. */
ps_status ps_coll_reduce_scatter(ps_coll *c, const float *send, float *recv, size_t count,
                                 enum ps_redop op);
/* root's buf (count floats) becomes the combination over all ranks; every
 * other rank's buf is only read. */
ps_status ps_coll_reduce(ps_coll *c, float *buf, size_t count, enum ps_redop op, int root);
/* The three reductions on count elements of dtype (any ps_dtype; counts are
 * elements, not bytes). An unknown dtype is PS_ERR_INVALID. */
ps_status ps_coll_allreduce_typed(ps_coll *c, void *buf, size_t count, ps_dtype dtype,
                                  enum ps_redop op);
ps_status ps_coll_reduce_scatter_typed(ps_coll *c, const void *send, void *recv, size_t count,
                                       ps_dtype dtype, enum ps_redop op);
ps_status ps_coll_reduce_typed(ps_coll *c, void *buf, size_t count, ps_dtype dtype,
                               enum ps_redop op, int root);
/* send holds world_size blocks of bytes, block d for rank d; recv (as large,
 * not overlapping send) gets block s from rank s. On a group of
 * ps_coll_split it is always W-1 pairwise exchanges, one block each way per
 * pair. On the job group it is those exchanges when opened with p2p and the
 * blocks are 128 KiB or more (or W = 2); otherwise a block passes through the
 * ranks between on the ring, which makes each link carry W(W-1)/2 blocks. */
ps_status ps_coll_alltoall(ps_coll *c, const void *send, void *recv, size_t bytes);
/* Point-to-point, on a group opened with p2p (else PS_ERR_STATE; the peer
 * being this rank or out of range is PS_ERR_INVALID). ps_coll_send sends
 * buf (bytes) to rank peer, ps_coll_recv receives the next message from rank
 * peer into buf, whose bytes must equal the sent length (else the group
 * fails with PS_ERR_STATE naming both). Messages between a pair arrive in
 * the order they were sent; only the two ranks take part. While a rank is in
 * one of these calls it also takes in what any other rank sends it, so
 * ranks that send to each other at once do not deadlock (those messages wait
 * in memory for their receive); a rank in no such call reads nothing, and
 * its sender waits. ps_coll_sendrecv does both at once (MPI_Sendrecv: a
 * shift along a ring, say); dst or src -1 leaves that half out. */
ps_status ps_coll_send(ps_coll *c, const void *buf, size_t bytes, int peer);
ps_status ps_coll_recv(ps_coll *c, void *buf, size_t bytes, int peer);
ps_status ps_coll_sendrecv(ps_coll *c, const void *send, size_t send_bytes, int dst, void *recv,
                           size_t recv_bytes, int src);
/* Returns once every rank has entered the barrier. */
ps_status ps_coll_barrier(ps_coll *c);

/* The same, queued: each returns at once; the buffers must stay untouched
 * until ps_coll_wait(*req) returns, which must be called exactly once.
 * Operations (blocking or not) run in the order they were issued. */
ps_status ps_coll_allreduce_async(ps_coll *c, float *buf, size_t count, enum ps_redop op,
                                  ps_coll_request **req);
ps_status ps_coll_broadcast_async(ps_coll *c, void *buf, size_t bytes, int root,
                                  ps_coll_request **req);
ps_status ps_coll_allgather_async(ps_coll *c, const void *send, void *recv, size_t bytes,
                                  ps_coll_request **req);
ps_status ps_coll_reduce_scatter_async(ps_coll *c, const float *send, float *recv, size_t count,
                                       enum ps_redop op, ps_coll_request **req);
ps_status ps_coll_reduce_async(ps_coll *c, float *buf, size_t count, enum ps_redop op, int root,
                               ps_coll_request **req);
ps_status ps_coll_allreduce_typed_async(ps_coll *c, void *buf, size_t count, ps_dtype dtype,
                                        enum ps_redop op, ps_coll_request **req);
ps_status ps_coll_reduce_scatter_typed_async(ps_coll *c, const void *send, void *recv, size_t count,
                                             ps_dtype dtype, enum ps_redop op,
                                             ps_coll_request **req);
ps_status ps_coll_reduce_typed_async(ps_coll *c, void *buf, size_t count, ps_dtype dtype,
                                     enum ps_redop op, int root, ps_coll_request **req);
ps_status ps_coll_alltoall_async(ps_coll *c, const void *send, void *recv, size_t bytes,
                                 ps_coll_request **req);
ps_status ps_coll_send_async(ps_coll *c, const void *buf, size_t bytes, int peer,
                             ps_coll_request **req);
ps_status ps_coll_recv_async(ps_coll *c, void *buf, size_t bytes, int peer, ps_coll_request **req);
ps_status ps_coll_sendrecv_async(ps_coll *c, const void *send, size_t send_bytes, int dst,
                                 void *recv, size_t recv_bytes, int src, ps_coll_request **req);
/* Waits for req, frees it and returns its status. */
ps_status ps_coll_wait(ps_coll_request *req);

/* PS_OK while the group is healthy, else the status of its failure. Cheap;
 * lets another transport (NCCL) stop waiting when a peer is lost. */
ps_status ps_coll_status(ps_coll *c);
/* Why the group failed (or the last refusal), into buf; "" if all is well. */
const char *ps_coll_errmsg(ps_coll *c, char *buf, size_t len);
/* The rank blamed for the failure, or -1. */
int ps_coll_lost_rank(ps_coll *c);

/* ---- Groups (communicators) ----
 *
 * A group is a subset of a parent group's ranks, formed with MPI_Comm_split's
 * semantics, and is itself a ps_coll: every call of this header (collectives,
 * send/recv, the _async forms, status, errmsg, abort) takes a group, and a
 * group can be split again (groups of groups). Ranks and peers are group ranks
 * (0..size-1); ps_coll_job_rank translates one to the job's rank.
 *
 * A group reuses the job's pairwise connections (the job group opened with
 * ps_coll_opts.p2p; splitting one opened without is PS_ERR_STATE): no new
 * socket, no listening port. Each group has its own identifier, carried by
 * every message of its operations, and its own operation sequence, so its
 * messages never mix with another group's, even when the same two ranks take
 * part in both at once. Its collectives run over those connections (a ring of
 * its members for the reductions, bit-identical on every member); a group's
 * _async operations queue on the job group's worker thread with everything
 * else, in issue order.
 *
 * Failure: a rank lost anywhere in the job fails every group (the job group's
 * watchdog sees it), and ps_coll_errmsg on the group names the rank by its
 * job rank; a mismatch inside a group fails that group and the job. */

/* The color of a rank that joins no group in ps_coll_split (MPI_UNDEFINED). */
#define PS_COLL_UNDEFINED (-1)

/* Collective over parent: every rank of parent calls it, in the same order
 * relative to parent's other operations. The ranks passing the same color
 * (>= 0) form one group, ordered by key, then by their rank in parent; *group
 * is this rank's. A rank passing PS_COLL_UNDEFINED gets a handle of no group:
 * size 0, rank -1, and every operation on it fails with PS_ERR_STATE naming
 * this rank (calling a collective on a group you are not in). Close it with
 * ps_coll_close like any group. Errors: parent NULL or color < -1:
 * PS_ERR_INVALID; parent without p2p connections: PS_ERR_STATE; the parent
 * failed: its status. On the NCCL backend, ps_nccl_split is the same call
 * (ncclCommSplit). */
ps_status ps_coll_split(ps_coll *parent, int color, int key, ps_coll **group);
/* The job rank of this group's rank r (the job group: r itself), or -1 when r
 * is out of range. */
int ps_coll_job_rank(const ps_coll *c, int r);
/* The group's identifier: equal on its members, different between the groups
 * of one job (0 for the job group). For logs and metrics. */
uint64_t ps_coll_group_id(const ps_coll *c);

/* Fails the group on every rank on purpose, with reason (the caller found the ranks
 * inconsistent): this rank's queued and later operations fail at once with PS_ERR_STATE,
 * and every other rank's too, as when the ranks disagree (the watchdog passes it on);
 * ps_coll_errmsg then says "rank R: reason" on every rank. Harmless on a group that
 * already failed (the first failure stands). */
ps_status ps_coll_abort(ps_coll *c, const char *reason);

#ifdef __cplusplus
}
#endif
#endif
