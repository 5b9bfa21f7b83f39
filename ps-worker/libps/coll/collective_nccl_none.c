/* collective_nccl_none: the NCCL backend of a build without NCCL (meson
 * feature `nccl` off or CUDA/NCCL not found). Opening says so; nothing else
 * can be reached without an open handle. */
#include "collective_nccl.h"

#include <stdio.h>

struct ps_nccl {
  int unused;
};

bool ps_nccl_built(void) {
  return false;
}

int ps_nccl_device_count(char *why, size_t len) {
  snprintf(why, len, "this build has no NCCL backend");
  return 0;
}

ps_status ps_nccl_open(ps_coll *boot, struct ps_nccl **out, char *err, size_t errlen) {
  *out = NULL;
  snprintf(err, errlen,
           "this build has no NCCL backend (meson feature 'nccl' is off or CUDA/NCCL were not "
           "found when it was configured); use --allreduce-backend tcp");
  return PS_ERR_INVALID;
}

ps_status ps_nccl_split(struct ps_nccl *parent, ps_coll *group, int color, int key,
                        struct ps_nccl **out, char *err, size_t errlen) {
  *out = NULL;
  snprintf(err, errlen, "this build has no NCCL");
  return PS_ERR_INVALID;
}

void ps_nccl_close(struct ps_nccl *n) {}

int ps_nccl_device(const struct ps_nccl *n) {
  return -1;
}

const char *ps_nccl_describe(const struct ps_nccl *n, char *buf, size_t len) {
  snprintf(buf, len, "none");
  return buf;
}

ps_status ps_nccl_dev_alloc(struct ps_nccl *n, size_t bytes, void **dev) {
  *dev = NULL;
  return PS_ERR_INVALID;
}

void ps_nccl_dev_free(struct ps_nccl *n, void *dev) {}

ps_status ps_nccl_to_device(struct ps_nccl *n, void *dev, const void *host, size_t bytes) {
  return PS_ERR_INVALID;
}

ps_status ps_nccl_to_host(struct ps_nccl *n, void *host, const void *dev, size_t bytes) {
  return PS_ERR_INVALID;
}

ps_status ps_nccl_allreduce_dev(struct ps_nccl *n, void *dev, size_t count, enum ps_redop op) {
  return PS_ERR_INVALID;
}

ps_status ps_nccl_allgather_dev(struct ps_nccl *n, const void *send, void *recv, size_t bytes) {
  return PS_ERR_INVALID;
}

ps_status ps_nccl_reduce_scatter_dev(struct ps_nccl *n, const void *send, void *recv, size_t count,
                                     enum ps_redop op) {
  return PS_ERR_INVALID;
}

ps_status ps_nccl_reduce_dev(struct ps_nccl *n, void *dev, size_t count, enum ps_redop op,
                             int root) {
  return PS_ERR_INVALID;
}

ps_status ps_nccl_broadcast_dev(struct ps_nccl *n, void *dev, size_t bytes, int root) {
  return PS_ERR_INVALID;
}

ps_status ps_nccl_alltoall_dev(struct ps_nccl *n, const void *send, void *recv, size_t bytes) {
  return PS_ERR_INVALID;
}

ps_status ps_nccl_send_dev(struct ps_nccl *n, const void *dev, size_t bytes, int peer) {
  return PS_ERR_INVALID;
}

ps_status ps_nccl_recv_dev(struct ps_nccl *n, void *dev, size_t bytes, int peer) {
  return PS_ERR_INVALID;
}

ps_status ps_nccl_allreduce_typed_dev(struct ps_nccl *n, void *dev, size_t count, ps_dtype dtype,
                                      enum ps_redop op) {
  return PS_ERR_INVALID;
}

ps_status ps_nccl_reduce_scatter_typed_dev(struct ps_nccl *n, const void *send, void *recv,
                                           size_t count, ps_dtype dtype, enum ps_redop op) {
  return PS_ERR_INVALID;
}

ps_status ps_nccl_reduce_typed_dev(struct ps_nccl *n, void *dev, size_t count, ps_dtype dtype,
                                   enum ps_redop op, int root) {
  return PS_ERR_INVALID;
}

ps_status ps_nccl_sync(struct ps_nccl *n) {
  return PS_ERR_INVALID;
}

ps_status ps_nccl_allreduce_host_async(struct ps_nccl *n, int slot, float *host, size_t count,
                                       enum ps_redop op) {
  return PS_ERR_INVALID;
}

ps_status ps_nccl_wait_slot(struct ps_nccl *n, int slot) {
  return PS_ERR_INVALID;
}

const char *ps_nccl_errmsg(struct ps_nccl *n, char *buf, size_t len) {
  snprintf(buf, len, "no NCCL in this build");
  return buf;
}
