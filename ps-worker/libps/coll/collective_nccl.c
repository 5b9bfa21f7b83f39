/* collective_nccl: the NCCL backend (see collective_nccl.h), built as the
 * plugin libps-nccl.so (nccl_plugin.h), which libps dlopen()s when the
 * backend is first asked for. The only file that includes CUDA and NCCL
 * headers; their errors become ps_status values and messages here. It links
 * nothing of libps: what it needs of the TCP group and the log comes through
 * the host table given to plugin_init, and it exports only the entry table
 * ps_nccl_plugin (nccl_plugin.map), so its ps_nccl_* functions, which carry
 * the public names for reading, never interpose on libps's.
 *
 * The communicator is non-blocking (ncclConfig_t.blocking = 0): init and
 * every call that answers ncclInProgress are finished by polling
 * ncclCommGetAsyncError, and stream work by polling cudaEventQuery, always
 * next to the TCP group's status. When the TCP group fails, the communicator
 * is aborted (ncclCommAbort returns even with a dead peer) and the call fails
 * with the group's message. Polls sleep POLL_US between checks: a waiting
 * rank leaves its CPU to the others. */
#include "collective_nccl.h"

#include <cuda_runtime_api.h>
#include <errno.h>
#include <nccl.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "nccl_plugin.h"

#define POLL_US 20
#define MAX_SLOTS 1024

struct slot {
  void *dev;
  size_t cap;
  const void *registered; /* host buffer page-locked for this slot */
  size_t registered_bytes;
  cudaEvent_t done;
  bool event, pending;
};

struct ps_nccl {
  ps_coll *boot;
  int device;
  ncclComm_t comm;
  cudaStream_t stream;
  bool have_stream, have_comm, broken;
  struct slot slots[MAX_SLOTS];
  char name[300];
  char msg[512];
};

/* libps's functions (plugin_init); set once before any other call. */
static const struct ps_nccl_host *libps;

static int plugin_init(const struct ps_nccl_host *h) {
  libps = h;
  return 0;
}

static void plugin_log(const char *msg, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void plugin_log(const char *msg, const char *fmt, ...) {
  char fields[512];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(fields, sizeof(fields), fmt, ap);
  va_end(ap);
  libps->log_info(msg, fields);
}

static void poll_sleep(void) {
  struct timespec ts = {.tv_sec = 0, .tv_nsec = POLL_US * 1000L};
  nanosleep(&ts, NULL);
}

int ps_nccl_device_count(char *why, size_t len) {
  int ndev = 0;
  cudaError_t e = cudaGetDeviceCount(&ndev);
  if (e != cudaSuccess || ndev <= 0) {
    snprintf(why, len, "no usable CUDA GPU on this machine (%s)",
             e != cudaSuccess ? cudaGetErrorString(e) : "0 devices");
    return 0;
  }
  snprintf(why, len, "%d CUDA device%s", ndev, ndev == 1 ? "" : "s");
  return ndev;
}

static ps_status nfail(struct ps_nccl *n, ps_status st, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
static ps_status nfail(struct ps_nccl *n, ps_status st, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(n->msg, sizeof(n->msg), fmt, ap);
  va_end(ap);
  return st;
}

/* The TCP group failed: abort NCCL so nothing waits on a dead peer. */
static ps_status peer_lost(struct ps_nccl *n) {
  char buf[512];
  if (n->have_comm && !n->broken) ncclCommAbort(n->comm);
  n->have_comm = false;
  n->broken = true;
  return nfail(n, libps->coll_status(n->boot), "%s", libps->coll_errmsg(n->boot, buf, sizeof(buf)));
}

/* Finishes an NCCL call that may answer ncclInProgress (non-blocking comm). */
static ps_status nccl_settle(struct ps_nccl *n, ncclResult_t r, const char *what) {
  while (r == ncclInProgress) {
    if (libps->coll_status(n->boot) != PS_OK) return peer_lost(n);
    poll_sleep();
    if (ncclCommGetAsyncError(n->comm, &r) != ncclSuccess) break;
  }
  if (r == ncclSuccess) return PS_OK;
  n->broken = true;
  return nfail(n, r == ncclInvalidArgument || r == ncclInvalidUsage ? PS_ERR_INVALID : PS_ERR_IO,
               "%s: %s (%s)", what, ncclGetErrorString(r),
               n->have_comm ? ncclGetLastError(n->comm) : "");
}

static ps_status cuda_check(struct ps_nccl *n, cudaError_t e, const char *what) {
  if (e == cudaSuccess) return PS_OK;
  return nfail(n, e == cudaErrorMemoryAllocation ? PS_ERR_NOMEM : PS_ERR_IO, "%s: %s", what,
               cudaGetErrorString(e));
}

/* Waits for ev while watching NCCL and the TCP group. */
static ps_status wait_event(struct ps_nccl *n, cudaEvent_t ev) {
  for (;;) {
    cudaError_t e = cudaEventQuery(ev);
    if (e == cudaSuccess) return PS_OK;
    if (e != cudaErrorNotReady) return cuda_check(n, e, "waiting for the stream");
    if (libps->coll_status(n->boot) != PS_OK) return peer_lost(n);
    ncclResult_t ar = ncclSuccess;
    if (n->have_comm && ncclCommGetAsyncError(n->comm, &ar) == ncclSuccess && ar != ncclSuccess &&
        ar != ncclInProgress)
      return nccl_settle(n, ar, "NCCL");
    poll_sleep();
  }
}

ps_status ps_nccl_open(ps_coll *boot, struct ps_nccl **out, char *err, size_t errlen) {
  *out = NULL;
  char why[200];
  int ndev = ps_nccl_device_count(why, sizeof(why));
  if (ndev <= 0) {
    snprintf(err, errlen, "%s; use --allreduce-backend tcp", why);
    return PS_ERR_INVALID;
  }
  struct ps_nccl *n = calloc(1, sizeof(*n));
  if (!n) return PS_ERR_NOMEM;
  n->boot = boot;
  int rank = libps->coll_rank(boot), world = libps->coll_world_size(boot);
  n->device = rank % ndev;
  ps_status st = cuda_check(n, cudaSetDevice(n->device), "cudaSetDevice");
  if (st == PS_OK) {
    st = cuda_check(n, cudaStreamCreateWithFlags(&n->stream, cudaStreamNonBlocking),
                    "cudaStreamCreate");
    n->have_stream = st == PS_OK;
  }
  ncclUniqueId id;
  memset(&id, 0, sizeof(id));
  if (st == PS_OK && rank == 0) {
    ncclResult_t r = ncclGetUniqueId(&id);
    if (r != ncclSuccess) st = nfail(n, PS_ERR_IO, "ncclGetUniqueId: %s", ncclGetErrorString(r));
  }
  /* Every rank takes part in the broadcast even after a local failure, so
   * nobody waits for it; a failed rank then leaves and the group notices. */
  ps_status bst = libps->coll_broadcast(boot, &id, sizeof(id), 0);
  if (st == PS_OK && bst != PS_OK) {
    char buf[400];
    st = nfail(n, bst, "passing the NCCL id over TCP: %s",
               libps->coll_errmsg(boot, buf, sizeof(buf)));
  }
  if (st == PS_OK) {
    ncclConfig_t cfg = NCCL_CONFIG_INITIALIZER;
    cfg.blocking = 0;
    ncclResult_t r = ncclCommInitRankConfig(&n->comm, world, id, rank, &cfg);
    n->have_comm = r == ncclSuccess || r == ncclInProgress;
    st = nccl_settle(n, r, "ncclCommInitRank");
  }
  if (st != PS_OK) {
    snprintf(err, errlen, "%s", n->msg);
    ps_nccl_close(n);
    return st;
  }
  struct cudaDeviceProp prop;
  if (cudaGetDeviceProperties(&prop, n->device) == cudaSuccess)
    snprintf(n->name, sizeof(n->name), "cuda:%d %s", n->device, prop.name);
  else
    snprintf(n->name, sizeof(n->name), "cuda:%d", n->device);
  int v = 0;
  ncclGetVersion(&v);
  plugin_log("nccl ready", "device=\"%s\" nccl_version=%d rank=%d world_size=%d", n->name, v, rank,
             world);
  *out = n;
  return PS_OK;
}

/* ncclCommSplit (MPI_Comm_split semantics, NCCL 2.18+): the parent's ranks
 * with the same color form the group's communicator, ordered by key then
 * parent rank, as ps_coll_split orders group's ranks. */
ps_status ps_nccl_split(struct ps_nccl *parent, ps_coll *group, int color, int key,
                        struct ps_nccl **out, char *err, size_t errlen) {
  *out = NULL;
  if (!parent || color < PS_COLL_UNDEFINED || (color >= 0 && !group)) {
    snprintf(err, errlen, "ps_nccl_split: %s",
             !parent      ? "no parent communicator"
             : color < -1 ? "color below -1"
                          : "no group");
    return PS_ERR_INVALID;
  }
  struct ps_nccl *n = calloc(1, sizeof(*n));
  if (!n) return PS_ERR_NOMEM;
  n->boot = group ? group : parent->boot;
  n->device = parent->device;
  ps_status st = cuda_check(n, cudaSetDevice(n->device), "cudaSetDevice");
  if (st == PS_OK) {
    st = cuda_check(n, cudaStreamCreateWithFlags(&n->stream, cudaStreamNonBlocking),
                    "cudaStreamCreate");
    n->have_stream = st == PS_OK;
  }
  if (st == PS_OK) {
    ncclConfig_t cfg = NCCL_CONFIG_INITIALIZER;
    cfg.blocking = 0;
    ncclResult_t r =
        ncclCommSplit(parent->comm, color < 0 ? NCCL_SPLIT_NOCOLOR : color, key, &n->comm, &cfg);
    if (color < 0) { /* no communicator: the call completes on the parent's */
      st = nccl_settle(parent, r, "ncclCommSplit");
      if (st != PS_OK) snprintf(n->msg, sizeof(n->msg), "%s", parent->msg);
    } else {
      n->have_comm = r == ncclSuccess || r == ncclInProgress;
      st = nccl_settle(n, r, "ncclCommSplit");
    }
  }
  if (st != PS_OK || color < 0) {
    if (st != PS_OK) snprintf(err, errlen, "%s", n->msg);
    ps_nccl_close(n);
    return st;
  }
  snprintf(n->name, sizeof(n->name), "%s", parent->name);
  plugin_log("nccl group ready", "device=\"%s\" color=%d rank=%d size=%d", n->name, color,
             libps->coll_rank(group), libps->coll_world_size(group));
  *out = n;
  return PS_OK;
}

void ps_nccl_close(struct ps_nccl *n) {
  if (!n) return;
  for (int i = 0; i < MAX_SLOTS; i++) {
    struct slot *s = &n->slots[i];
    if (s->registered) cudaHostUnregister((void *)s->registered);
    if (s->dev) cudaFree(s->dev);
    if (s->event) cudaEventDestroy(s->done);
  }
  if (n->have_comm) {
    if (n->broken) {
      ncclCommAbort(n->comm);
    } else {
      ncclResult_t r = ncclCommFinalize(n->comm);
      if (nccl_settle(n, r, "ncclCommFinalize") == PS_OK)
        ncclCommDestroy(n->comm);
      else
        ncclCommAbort(n->comm);
    }
  }
  if (n->have_stream) cudaStreamDestroy(n->stream);
  free(n);
}

int ps_nccl_device(const struct ps_nccl *n) {
  return n->device;
}

const char *ps_nccl_describe(const struct ps_nccl *n, char *buf, size_t len) {
  snprintf(buf, len, "%s", n->name);
  return buf;
}

const char *ps_nccl_errmsg(struct ps_nccl *n, char *buf, size_t len) {
  snprintf(buf, len, "%s", n->msg);
  return buf;
}

ps_status ps_nccl_dev_alloc(struct ps_nccl *n, size_t bytes, void **dev) {
  return cuda_check(n, cudaMalloc(dev, bytes ? bytes : 1), "cudaMalloc");
}

void ps_nccl_dev_free(struct ps_nccl *n, void *dev) {
  (void)n;
  if (dev) cudaFree(dev);
}

ps_status ps_nccl_to_device(struct ps_nccl *n, void *dev, const void *host, size_t bytes) {
  return cuda_check(n, cudaMemcpy(dev, host, bytes, cudaMemcpyHostToDevice),
                    "cudaMemcpy to device");
}

ps_status ps_nccl_to_host(struct ps_nccl *n, void *host, const void *dev, size_t bytes) {
  return cuda_check(n, cudaMemcpy(host, dev, bytes, cudaMemcpyDeviceToHost), "cudaMemcpy to host");
}

static ncclRedOp_t redop(enum ps_redop op) {
  switch (op) {
    case PS_REDOP_AVG:
      return ncclAvg;
    case PS_REDOP_MAX:
      return ncclMax;
    case PS_REDOP_MIN:
      return ncclMin;
    default:
      return ncclSum;
  }
}

/* The checks every queued collective starts with. */
static ps_status ready(struct ps_nccl *n) {
  if (n->broken) return nfail(n, PS_ERR_IO, "%s", n->msg);
  if (libps->coll_status(n->boot) != PS_OK) return peer_lost(n);
  return PS_OK;
}

static bool is_rank(const struct ps_nccl *n, int r) {
  return r >= 0 && r < libps->coll_world_size(n->boot);
}

/* ps_dtype to NCCL's type (the same set, other numbers). */
static ps_status nccl_type(struct ps_nccl *n, ps_dtype dtype, ncclDataType_t *out) {
  static const ncclDataType_t types[] = {
      [PS_DTYPE_FLOAT32] = ncclFloat32, [PS_DTYPE_FLOAT64] = ncclFloat64,
      [PS_DTYPE_FLOAT16] = ncclFloat16, [PS_DTYPE_BFLOAT16] = ncclBfloat16,
      [PS_DTYPE_INT8] = ncclInt8,       [PS_DTYPE_UINT8] = ncclUint8,
      [PS_DTYPE_INT32] = ncclInt32,     [PS_DTYPE_UINT32] = ncclUint32,
      [PS_DTYPE_INT64] = ncclInt64,     [PS_DTYPE_UINT64] = ncclUint64,
  };
  if (!libps->dtype_size(dtype))
    return nfail(n, PS_ERR_INVALID, "dtype %d is not a ps_dtype", dtype);
  *out = types[dtype];
  return PS_OK;
}

ps_status ps_nccl_allreduce_dev(struct ps_nccl *n, void *dev, size_t count, enum ps_redop op) {
  return ps_nccl_allreduce_typed_dev(n, dev, count, PS_DTYPE_FLOAT32, op);
}

ps_status ps_nccl_allreduce_typed_dev(struct ps_nccl *n, void *dev, size_t count, ps_dtype dtype,
                                      enum ps_redop op) {
  ncclDataType_t t = ncclFloat32;
  ps_status st = nccl_type(n, dtype, &t);
  if (st == PS_OK) st = ready(n);
  if (st != PS_OK || count == 0) return st;
  return nccl_settle(n, ncclAllReduce(dev, dev, count, t, redop(op), n->comm, n->stream),
                     "ncclAllReduce");
}

ps_status ps_nccl_allgather_dev(struct ps_nccl *n, const void *send, void *recv, size_t bytes) {
  ps_status st = ready(n);
  if (st != PS_OK || bytes == 0) return st;
  return nccl_settle(n, ncclAllGather(send, recv, bytes, ncclChar, n->comm, n->stream),
                     "ncclAllGather");
}

ps_status ps_nccl_reduce_scatter_dev(struct ps_nccl *n, const void *send, void *recv, size_t count,
                                     enum ps_redop op) {
  return ps_nccl_reduce_scatter_typed_dev(n, send, recv, count, PS_DTYPE_FLOAT32, op);
}

ps_status ps_nccl_reduce_scatter_typed_dev(struct ps_nccl *n, const void *send, void *recv,
                                           size_t count, ps_dtype dtype, enum ps_redop op) {
  ncclDataType_t t = ncclFloat32;
  ps_status st = nccl_type(n, dtype, &t);
  if (st == PS_OK) st = ready(n);
  if (st != PS_OK || count == 0) return st;
  return nccl_settle(n, ncclReduceScatter(send, recv, count, t, redop(op), n->comm, n->stream),
                     "ncclReduceScatter");
}

ps_status ps_nccl_reduce_dev(struct ps_nccl *n, void *dev, size_t count, enum ps_redop op,
                             int root) {
  return ps_nccl_reduce_typed_dev(n, dev, count, PS_DTYPE_FLOAT32, op, root);
}

ps_status ps_nccl_reduce_typed_dev(struct ps_nccl *n, void *dev, size_t count, ps_dtype dtype,
                                   enum ps_redop op, int root) {
  if (!is_rank(n, root)) return nfail(n, PS_ERR_INVALID, "reduce: root %d is not a rank", root);
  ncclDataType_t t = ncclFloat32;
  ps_status st = nccl_type(n, dtype, &t);
  if (st == PS_OK) st = ready(n);
  if (st != PS_OK || count == 0) return st;
  return nccl_settle(n, ncclReduce(dev, dev, count, t, redop(op), root, n->comm, n->stream),
                     "ncclReduce");
}

ps_status ps_nccl_broadcast_dev(struct ps_nccl *n, void *dev, size_t bytes, int root) {
  if (!is_rank(n, root)) return nfail(n, PS_ERR_INVALID, "broadcast: root %d is not a rank", root);
  ps_status st = ready(n);
  if (st != PS_OK || bytes == 0) return st;
  return nccl_settle(n, ncclBroadcast(dev, dev, bytes, ncclChar, root, n->comm, n->stream),
                     "ncclBroadcast");
}

ps_status ps_nccl_alltoall_dev(struct ps_nccl *n, const void *send, void *recv, size_t bytes) {
  ps_status st = ready(n);
  if (st != PS_OK || bytes == 0) return st;
  int W = libps->coll_world_size(n->boot);
  ncclResult_t r = ncclGroupStart();
  for (int q = 0; q < W && r == ncclSuccess; q++) {
    r = ncclSend((const char *)send + (size_t)q * bytes, bytes, ncclChar, q, n->comm, n->stream);
    if (r == ncclSuccess)
      r = ncclRecv((char *)recv + (size_t)q * bytes, bytes, ncclChar, q, n->comm, n->stream);
  }
  ncclResult_t e = ncclGroupEnd();
  return nccl_settle(n, r != ncclSuccess ? r : e, "all-to-all (ncclSend/ncclRecv)");
}

ps_status ps_nccl_send_dev(struct ps_nccl *n, const void *dev, size_t bytes, int peer) {
  if (!is_rank(n, peer)) return nfail(n, PS_ERR_INVALID, "send: %d is not a rank", peer);
  ps_status st = ready(n);
  if (st != PS_OK || bytes == 0) return st;
  return nccl_settle(n, ncclSend(dev, bytes, ncclChar, peer, n->comm, n->stream), "ncclSend");
}

ps_status ps_nccl_recv_dev(struct ps_nccl *n, void *dev, size_t bytes, int peer) {
  if (!is_rank(n, peer)) return nfail(n, PS_ERR_INVALID, "recv: %d is not a rank", peer);
  ps_status st = ready(n);
  if (st != PS_OK || bytes == 0) return st;
  return nccl_settle(n, ncclRecv(dev, bytes, ncclChar, peer, n->comm, n->stream), "ncclRecv");
}

ps_status ps_nccl_sync(struct ps_nccl *n) {
  cudaEvent_t ev;
  ps_status st =
      cuda_check(n, cudaEventCreateWithFlags(&ev, cudaEventDisableTiming), "cudaEventCreate");
  if (st != PS_OK) return st;
  st = cuda_check(n, cudaEventRecord(ev, n->stream), "cudaEventRecord");
  if (st == PS_OK) st = wait_event(n, ev);
  cudaEventDestroy(ev);
  return st;
}

ps_status ps_nccl_allreduce_host_async(struct ps_nccl *n, int slot, float *host, size_t count,
                                       enum ps_redop op) {
  if (slot < 0 || slot >= MAX_SLOTS) return nfail(n, PS_ERR_INVALID, "slot %d out of range", slot);
  struct slot *s = &n->slots[slot];
  size_t bytes = count * sizeof(float);
  ps_status st;
  if (bytes > s->cap) {
    if (s->dev) cudaFree(s->dev);
    s->dev = NULL;
    s->cap = 0;
    st = cuda_check(n, cudaMalloc(&s->dev, bytes), "cudaMalloc");
    if (st != PS_OK) return st;
    s->cap = bytes;
  }
  if (!s->event) {
    st = cuda_check(n, cudaEventCreateWithFlags(&s->done, cudaEventDisableTiming),
                    "cudaEventCreate");
    if (st != PS_OK) return st;
    s->event = true;
  }
  if (s->registered != host || s->registered_bytes != bytes) {
    if (s->registered) cudaHostUnregister((void *)s->registered);
    s->registered = NULL;
    /* Page-locked memory makes the copies truly asynchronous; without it
     * they are merely slower, so a refusal is not an error. */
    if (cudaHostRegister(host, bytes, cudaHostRegisterDefault) == cudaSuccess) {
      s->registered = host;
      s->registered_bytes = bytes;
    } else {
      cudaGetLastError();
    }
  }
  st = cuda_check(n, cudaMemcpyAsync(s->dev, host, bytes, cudaMemcpyHostToDevice, n->stream),
                  "copy to device");
  if (st == PS_OK) st = ps_nccl_allreduce_dev(n, s->dev, count, op);
  if (st == PS_OK)
    st = cuda_check(n, cudaMemcpyAsync(host, s->dev, bytes, cudaMemcpyDeviceToHost, n->stream),
                    "copy to host");
  if (st == PS_OK) st = cuda_check(n, cudaEventRecord(s->done, n->stream), "cudaEventRecord");
  s->pending = st == PS_OK;
  return st;
}

ps_status ps_nccl_wait_slot(struct ps_nccl *n, int slot) {
  if (slot < 0 || slot >= MAX_SLOTS) return nfail(n, PS_ERR_INVALID, "slot %d out of range", slot);
  struct slot *s = &n->slots[slot];
  if (!s->pending) return PS_OK;
  s->pending = false;
  return wait_event(n, s->done);
}

#define STR_(x) #x
#define STR(x) STR_(x)

/* The one exported symbol (nccl_plugin.h); libps checks abi_version first. */
__attribute__((visibility("default"))) const struct ps_nccl_plugin ps_nccl_plugin = {
    .abi_version = PS_NCCL_PLUGIN_ABI,
    .describe = "built against NCCL " STR(NCCL_MAJOR) "." STR(NCCL_MINOR) "." STR(
        NCCL_PATCH) " and CUDA runtime " STR(CUDART_VERSION),
    .init = plugin_init,
    .device_count = ps_nccl_device_count,
    .open = ps_nccl_open,
    .split = ps_nccl_split,
    .close = ps_nccl_close,
    .device = ps_nccl_device,
    .describe_comm = ps_nccl_describe,
    .dev_alloc = ps_nccl_dev_alloc,
    .dev_free = ps_nccl_dev_free,
    .to_device = ps_nccl_to_device,
    .to_host = ps_nccl_to_host,
    .allreduce_typed_dev = ps_nccl_allreduce_typed_dev,
    .allgather_dev = ps_nccl_allgather_dev,
    .reduce_scatter_typed_dev = ps_nccl_reduce_scatter_typed_dev,
    .reduce_typed_dev = ps_nccl_reduce_typed_dev,
    .broadcast_dev = ps_nccl_broadcast_dev,
    .alltoall_dev = ps_nccl_alltoall_dev,
    .send_dev = ps_nccl_send_dev,
    .recv_dev = ps_nccl_recv_dev,
    .sync = ps_nccl_sync,
    .allreduce_host_async = ps_nccl_allreduce_host_async,
    .wait_slot = ps_nccl_wait_slot,
    .errmsg = ps_nccl_errmsg,
};
