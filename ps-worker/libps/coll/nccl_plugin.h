/* nccl_plugin: the interface between libps and its NCCL plugin
 * (libps-nccl.so), the only object that links CUDA and NCCL, so that
 * libps.so.0 itself needs neither and one install serves CPU and GPU nodes.
 *
 * The plugin (collective_nccl.c) exports one symbol, PS_NCCL_PLUGIN_SYMBOL: a
 * struct ps_nccl_plugin whose first member is its ABI version. libps
 * (nccl_loader.c) dlopen()s the plugin the first time the NCCL backend is
 * asked for, reads that version before anything else and refuses a plugin
 * whose version is not PS_NCCL_PLUGIN_ABI; then it calls init once with a
 * table of the libps functions the plugin needs (the TCP group's status and
 * broadcast, logging), so the plugin links nothing of libps and works with a
 * libps.so.0 as well as with a program that linked libps.a.
 *
 * Any change to either struct (a member added, moved or retyped, a
 * signature changed) bumps PS_NCCL_PLUGIN_ABI. */
#ifndef PS_NCCL_PLUGIN_H
#define PS_NCCL_PLUGIN_H

#include <stddef.h>
#include <stdint.h>

#include "collective_nccl.h"

#define PS_NCCL_PLUGIN_ABI 1u
#define PS_NCCL_PLUGIN_SYMBOL "ps_nccl_plugin"
#define PS_NCCL_PLUGIN_FILE "libps-nccl.so"

/* What libps lends the plugin. */
struct ps_nccl_host {
  int (*coll_rank)(const ps_coll *c);
  int (*coll_world_size)(const ps_coll *c);
  ps_status (*coll_status)(ps_coll *c);
  const char *(*coll_errmsg)(ps_coll *c, char *buf, size_t len);
  ps_status (*coll_broadcast)(ps_coll *c, void *buf, size_t bytes, int root);
  size_t (*dtype_size)(ps_dtype dtype);
  /* One INFO line in libps's log: msg, then key=value fields. */
  void (*log_info)(const char *msg, const char *fields);
};

/* The plugin's entry table; the members mirror collective_nccl.h (the
 * float32-only calls are the typed ones with PS_DTYPE_FLOAT32). */
struct ps_nccl_plugin {
  uint32_t abi_version; /* first, at a fixed place: read before anything else */
  const char *describe; /* "NCCL 2.28.3, CUDA runtime 13000": what it was built with */
  /* Called once before anything else; host outlives the plugin. */
  int (*init)(const struct ps_nccl_host *host);
  int (*device_count)(char *why, size_t len);
  ps_status (*open)(ps_coll *boot, struct ps_nccl **out, char *err, size_t errlen);
  ps_status (*split)(struct ps_nccl *parent, ps_coll *group, int color, int key,
                     struct ps_nccl **out, char *err, size_t errlen);
  void (*close)(struct ps_nccl *n);
  int (*device)(const struct ps_nccl *n);
  const char *(*describe_comm)(const struct ps_nccl *n, char *buf, size_t len);
  ps_status (*dev_alloc)(struct ps_nccl *n, size_t bytes, void **dev);
  void (*dev_free)(struct ps_nccl *n, void *dev);
  ps_status (*to_device)(struct ps_nccl *n, void *dev, const void *host, size_t bytes);
  ps_status (*to_host)(struct ps_nccl *n, void *host, const void *dev, size_t bytes);
  ps_status (*allreduce_typed_dev)(struct ps_nccl *n, void *dev, size_t count, ps_dtype dtype,
                                   enum ps_redop op);
  ps_status (*allgather_dev)(struct ps_nccl *n, const void *send, void *recv, size_t bytes);
  ps_status (*reduce_scatter_typed_dev)(struct ps_nccl *n, const void *send, void *recv,
                                        size_t count, ps_dtype dtype, enum ps_redop op);
  ps_status (*reduce_typed_dev)(struct ps_nccl *n, void *dev, size_t count, ps_dtype dtype,
                                enum ps_redop op, int root);
  ps_status (*broadcast_dev)(struct ps_nccl *n, void *dev, size_t bytes, int root);
  ps_status (*alltoall_dev)(struct ps_nccl *n, const void *send, void *recv, size_t bytes);
  ps_status (*send_dev)(struct ps_nccl *n, const void *dev, size_t bytes, int peer);
  ps_status (*recv_dev)(struct ps_nccl *n, void *dev, size_t bytes, int peer);
  ps_status (*sync)(struct ps_nccl *n);
  ps_status (*allreduce_host_async)(struct ps_nccl *n, int slot, float *host, size_t count,
                                    enum ps_redop op);
  ps_status (*wait_slot)(struct ps_nccl *n, int slot);
  const char *(*errmsg)(struct ps_nccl *n, char *buf, size_t len);
};

#endif
