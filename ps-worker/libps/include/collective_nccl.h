/* collective_nccl: all-reduce and the other collectives (all-gather,
 * reduce-scatter, reduce, broadcast, all-to-all, send and receive) on GPUs
 * through NCCL, bootstrapped over the TCP ring (collective.h).
 *
 * Rank 0 creates the NCCL unique id and broadcasts it over the TCP group,
 * which has already checked job id, world size and ranks; every rank then
 * joins the NCCL communicator on GPU (rank mod visible GPUs). One CUDA stream
 * per communicator carries copies and collectives in order.
 *
 * Waiting never blocks blindly inside CUDA: it polls the stream (sleeping
 * between polls) together with NCCL's asynchronous error and the TCP group's
 * health, so a lost peer, which would leave NCCL waiting forever, aborts the
 * communicator and fails the call with the TCP group's message naming the
 * lost rank.
 *
 * The backend is a plugin, libps-nccl.so, which libps loads with dlopen()
 * the first time it is asked for (ps_nccl_built, ps_nccl_device_count,
 * ps_nccl_open), so libps itself links no CUDA library and one install
 * serves CPU and GPU nodes. libps looks for it at $PS_NCCL_PLUGIN (a file;
 * only there when set), in <libdir>/ps as installed, next to libps.so.0 (its
 * ps/ subdirectory and its own directory), and on the library search path.
 * Where it cannot be used, ps_nccl_open fails with PS_ERR_INVALID and says
 * why: no plugin (naming the paths tried), a plugin whose libnccl.so.2 or
 * libcudart do not load (dlerror's text), a plugin of another ABI version
 * (both versions), or no usable GPU. */
#ifndef PS_COLLECTIVE_NCCL_H
#define PS_COLLECTIVE_NCCL_H

#include <stdbool.h>
#include <stddef.h>

#include "collective.h"
#include "ps.h"

struct ps_nccl;

/* True if the NCCL backend's plugin is found and loads in this process
 * (loading it if not yet done); says nothing of GPUs. */
bool ps_nccl_built(void);
/* Number of CUDA devices this process can use (0 without the plugin, a
 * driver or a GPU; why then says which). Sends nothing anywhere. */
int ps_nccl_device_count(char *why, size_t len);

/* Joins the NCCL communicator of boot's ranks (a collective call on boot).
 * Fails with PS_ERR_INVALID and a message when the plugin cannot be used or
 * this machine has no usable GPU; both are checked before anything is sent
 * on boot. A rank that fails here and exits makes the others fail (peer
 * lost), never hang. */
ps_status ps_nccl_open(ps_coll *boot, struct ps_nccl **out, char *err, size_t errlen);
/* The NCCL communicator of a group (ps_coll_split): ncclCommSplit of parent's
 * communicator with the same color and key, so its ranks are group's. Every
 * rank of parent calls it, with the color and key it gave ps_coll_split (a
 * rank with PS_COLL_UNDEFINED gets *out NULL and PS_OK); group watches for
 * lost ranks as boot does for ps_nccl_open. */
ps_status ps_nccl_split(struct ps_nccl *parent, ps_coll *group, int color, int key,
                        struct ps_nccl **out, char *err, size_t errlen);
/* Accepts NULL. */
void ps_nccl_close(struct ps_nccl *n);

/* The CUDA device this rank uses, and a one-line description of it. */
int ps_nccl_device(const struct ps_nccl *n);
const char *ps_nccl_describe(const struct ps_nccl *n, char *buf, size_t len);

/* Device memory for callers without CUDA headers (the benchmark, tests). */
ps_status ps_nccl_dev_alloc(struct ps_nccl *n, size_t bytes, void **dev);
void ps_nccl_dev_free(struct ps_nccl *n, void *dev);
ps_status ps_nccl_to_device(struct ps_nccl *n, void *dev, const void *host, size_t bytes);
ps_status ps_nccl_to_host(struct ps_nccl *n, void *host, const void *dev, size_t bytes);

/* Queues an in-place all-reduce of count floats of device memory on the
 * stream; ps_nccl_sync waits for everything queued. */
ps_status ps_nccl_allreduce_dev(struct ps_nccl *n, void *dev, size_t count, enum ps_redop op);
/* The others, queued on the stream the same way, with collective.h's
 * semantics on device memory (float32; counts and bytes per rank): recv of
 * all-gather and all-to-all holds W blocks, send of reduce-scatter W chunks;
 * all-to-all is NCCL's grouped sends and receives. */
ps_status ps_nccl_allgather_dev(struct ps_nccl *n, const void *send, void *recv, size_t bytes);
ps_status ps_nccl_reduce_scatter_dev(struct ps_nccl *n, const void *send, void *recv, size_t count,
                                     enum ps_redop op);
ps_status ps_nccl_reduce_dev(struct ps_nccl *n, void *dev, size_t count, enum ps_redop op,
                             int root);
/* The three reductions on count elements of any ps_dtype (NCCL's own
 * arithmetic on the device; an unknown dtype is PS_ERR_INVALID). */
ps_status ps_nccl_allreduce_typed_dev(struct ps_nccl *n, void *dev, size_t count, ps_dtype dtype,
                                      enum ps_redop op);
ps_status ps_nccl_reduce_scatter_typed_dev(struct ps_nccl *n, const void *send, void *recv,
                                           size_t count, ps_dtype dtype, enum ps_redop op);
ps_status ps_nccl_reduce_typed_dev(struct ps_nccl *n, void *dev, size_t count, ps_dtype dtype,
                                   enum ps_redop op, int root);
ps_status ps_nccl_broadcast_dev(struct ps_nccl *n, void *dev, size_t bytes, int root);
ps_status ps_nccl_alltoall_dev(struct ps_nccl *n, const void *send, void *recv, size_t bytes);
/* Point to point: bytes to (from) rank peer; the peer must post the
 * matching call. */
ps_status ps_nccl_send_dev(struct ps_nccl *n, const void *dev, size_t bytes, int peer);
ps_status ps_nccl_recv_dev(struct ps_nccl *n, void *dev, size_t bytes, int peer);
ps_status ps_nccl_sync(struct ps_nccl *n);

/* Host buffers (the CPU trainer): queues copy to device slot `slot` (grown
 * as needed), all-reduce, copy back, and returns; host must stay untouched
 * until ps_nccl_wait_slot(slot). The host buffer is page-locked on first use
 * so the copies overlap the caller's work. */
ps_status ps_nccl_allreduce_host_async(struct ps_nccl *n, int slot, float *host, size_t count,
                                       enum ps_redop op);
ps_status ps_nccl_wait_slot(struct ps_nccl *n, int slot);

/* Last error of n. */
const char *ps_nccl_errmsg(struct ps_nccl *n, char *buf, size_t len);

#endif
