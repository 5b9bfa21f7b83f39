/* ring: the data path of the ring collectives, over two connected TCP
 * sockets (from rank-1, to rank+1). rendezvous.c sets the sockets up and
 * checks the peers, watchdog.c watches their liveness; this module only
 * moves and sums bytes.
 *
 * Every collective is compiled into a plan: an ordered list of send segments
 * (what to write to rank+1, each gated on a receive segment it depends on)
 * and of receive segments (where bytes from rank-1 go and what to do once
 * one is complete: check the op header, sum into a scratch slot, sum into the
 * user's buffer). One loop then drives both directions with non-blocking
 * sendmsg/recvmsg over as many ready segments as fit in one call, so sending,
 * receiving and summation overlap in a single thread without locks; when
 * neither direction can move it spins for a bounded time (small operations
 * answer in microseconds) and then sleeps in poll, so it never burns a core
 * while a peer computes.
 *
 * All-reduce of n elements of a dtype.h type (sum, mean, max or min; plans
 * are in bytes and only the combine step knows the type):
 *  - n*size*(W-1) <= small_bytes: every rank forwards whole buffers around the
 *    ring (W-1 hops instead of 2(W-1)) and each rank sums the W buffers in
 *    rank order, so every rank gets the bit-identical result;
 *  - otherwise reduce-scatter then all-gather over W chunks, pipelined in
 *    slices of slice_bytes. A partial sum arriving from rank-1 lands in one
 *    of a few scratch slots (cache-sized, so the reduction never goes to
 *    memory), is summed with the local chunk and forwarded from the slot;
 *    only the final step of reduce-scatter writes the user's buffer, and the
 *    all-gather receives straight into it. The rank that completes a chunk
 *    sends that chunk to everyone, so all ranks hold identical results.
 * Broadcast: slices flow from the root around the ring, each rank forwarding
 * a slice as soon as it has it. All-gather, reduce-scatter, reduce and
 * all-to-all: ring_coll.c.
 *
 * Each operation starts with a 24-byte header in each direction (kind,
 * reduction, element type, root, sequence number, count); a rank whose
 * neighbour started a
 * different operation fails with a message naming both instead of summing
 * garbage. After any error the ring is broken for good: later calls return
 * the first error at once.
 *
 * Authentication (with sessions from rendezvous.c's handshake, auth.h).
 * Each operation's stream in each direction (op header and data, exactly
 * the bytes sent, in stream order) is one streamed MAC message (auth.h) with
 * its 16-byte tag: the sender MACs a send segment when it first becomes
 * ready to go (its contents are fixed from then until it is sent), then
 * sends the tag as the operation's last segment; the receiver MACs bytes as
 * they arrive, before they are summed, and checks the tag as the
 * operation's last receive segment, so an operation never completes on
 * altered, replayed or injected data. The implicit counter of auth.h ties
 * each tag to its operation. Without sessions nothing of this runs. */
#ifndef PS_RING_H
#define PS_RING_H

#include <stdatomic.h>
#include <stddef.h>

#include "dtype.h"

enum ring_redop { RING_SUM = 0, RING_AVG = 1, RING_MAX = 2, RING_MIN = 3 };

struct auth_session; /* auth.h */

struct ring_opts {
  int rank, world_size;
  int prev_fd, next_fd; /* connected sockets (made non-blocking here); -1 when world_size == 1 */
  int abort_fd;         /* readable when the job is aborted elsewhere (-1 = none) */
  const atomic_int *abort_flag; /* non-zero when aborted (may be NULL) */
  size_t slice_bytes;           /* pipeline slice; 0 = RING_DEFAULT_SLICE */
  size_t small_bytes; /* threshold of the small algorithm; 0 = default, SIZE_MAX = always */
  size_t round_bytes; /* bytes per rank and round of the large algorithm; 0 = default */
  int spin_us;        /* spin this long before sleeping in poll; < 0 = default */
  /* Authentication, borrowed (they must outlive the ring): the session of
   * next_fd seals what this rank sends, the one of prev_fd opens what it
   * receives. NULL = none (the same on every rank). */
  struct auth_session *send_auth, *recv_auth;
};

#define RING_DEFAULT_SLICE (128u * 1024u)
#define RING_DEFAULT_SMALL (256u * 1024u)
#define RING_DEFAULT_ROUND (128u * 1024u)
#define RING_DEFAULT_SPIN_US 50

struct ring;

/* Errors of the ring operations (negative errno): -ECONNRESET a neighbour's
 * connection broke (ring_lost_rank names it), -ECANCELED the job was aborted
 * (abort_fd), -EPROTO the neighbour started a different operation,
 * -EBADMSG the data from rank-1 failed authentication (ring_lost_rank names
 * it), -EIO the MAC itself failed, -ENOMEM, -EINVAL bad arguments.
 * ring_errmsg says what happened. */
int ring_new(const struct ring_opts *o, struct ring **out);
/* Does not close the sockets. Accepts NULL. */
void ring_free(struct ring *g);

/* In place: buf (count elements of dt) becomes the sum (mean, max, min) over
 * all ranks. Every rank must call the same operations in the same order. */
int ring_allreduce(struct ring *g, void *buf, size_t count, enum dtype dt, enum ring_redop op);
/* buf (bytes) of rank root is copied into every other rank's buf. */
int ring_broadcast(struct ring *g, void *buf, size_t bytes, int root);
/* recv (W * bytes) gets every rank's send (bytes), in rank order; send may
 * be recv's own block (in place). */
int ring_allgather(struct ring *g, const void *send, void *recv, size_t bytes);
/* send holds W chunks of count elements of dt; recv (count) gets chunk
 * `rank` of their combination over all ranks. recv is send's chunk `rank`
 * (in place) or apart from send. */
int ring_reduce_scatter(struct ring *g, const void *send, void *recv, size_t count, enum dtype dt,
                        enum ring_redop op);
/* root's buf (count elements of dt) becomes the combination over all ranks;
 * the others' buf is only read. */
int ring_reduce(struct ring *g, void *buf, size_t count, enum dtype dt, enum ring_redop op,
                int root);
/* send holds W blocks of bytes, block d for rank d; recv (apart from send)
 * gets block s from rank s. */
int ring_alltoall(struct ring *g, const void *send, void *recv, size_t bytes);

/* Collectives whose data goes elsewhere (hier.c, over p2p.c's connections)
 * but which still agree on the ring first. */
enum ring_agreed { RING_NODE_ALLREDUCE = 7, RING_PAIRWISE_ALLTOALL = 8 };
/* Exchanges only the op header of `kind` (count, dt, op) with both
 * neighbours, so a rank that called another collective, or the same one
 * with another size or type, fails with -EPROTO naming both, as in every
 * other operation. */
int ring_agree(struct ring *g, enum ring_agreed kind, size_t count, enum dtype dt,
               enum ring_redop op);

/* Message of the first error (empty if none) and the rank it blames (-1). */
const char *ring_errmsg(const struct ring *g);
int ring_lost_rank(const struct ring *g);

#endif
