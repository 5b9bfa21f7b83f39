/* nccl_loader: collective_nccl.h's functions in libps, every build. The NCCL
 * backend itself is the plugin libps-nccl.so (nccl_plugin.h), loaded with
 * dlopen() the first time the backend is asked for (ps_nccl_built,
 * ps_nccl_device_count, ps_nccl_open), as NCCL loads its net plugins; so
 * libps.so.0 links no CUDA library and a node without CUDA runs the same
 * install with the TCP backend.
 *
 * Where the plugin is looked for, first found wins:
 *  1. $PS_NCCL_PLUGIN, a path to the plugin file: only there when set
 *     (ignored in a set-user-ID program, as LD_LIBRARY_PATH is);
 *  2. PS_NCCL_PLUGIN_DIR, the directory this libps was installed with
 *     (<libdir>/ps, compiled in);
 *  3. relative to the object that holds this code (dladdr): libps.so.0's
 *     directory D gives D/ps/ (an install moved elsewhere) and D/ (the build
 *     tree, where the plugin sits next to libps.so.0); a program that linked
 *     libps.a gives its own directory plus PS_NCCL_PLUGIN_FROM_BIN (bindir
 *     to <libdir>/ps);
 *  4. the bare name, dlopen's default search (LD_LIBRARY_PATH, RUNPATH,
 *     ld.so.cache).
 * A file that exists but does not load (libnccl.so.2 or libcudart missing)
 * stops the search with dlerror()'s text; so does a plugin of another ABI
 * version. The outcome is decided once per process, under a mutex, and kept
 * (with its message) for every later call; the plugin is never unloaded. */
#include <dlfcn.h>
#include <errno.h>
#include <link.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "collective_nccl.h"
#include "log.h"
#include "nccl_plugin.h"

#ifndef PS_NCCL_PLUGIN_DIR
#error "meson defines PS_NCCL_PLUGIN_DIR (coll/meson.build)"
#endif

#define TRIED_BYTES 1500

static pthread_mutex_t load_lock = PTHREAD_MUTEX_INITIALIZER;
static bool load_done;
static const struct ps_nccl_plugin *plugin;
static char load_error[2048];

static void host_log_info(const char *msg, const char *fields) {
  log_write(LOG_INFO, msg, "%s", fields);
}

static const struct ps_nccl_host host = {
    .coll_rank = ps_coll_rank,
    .coll_world_size = ps_coll_world_size,
    .coll_status = ps_coll_status,
    .coll_errmsg = ps_coll_errmsg,
    .coll_broadcast = ps_coll_broadcast,
    .dtype_size = ps_dtype_size,
    .log_info = host_log_info,
};

/* The directory of the object holding this code into dir (libps.so.0, or
 * the program that linked libps.a); false if unknown. */
static bool own_dir(char *dir, size_t len, bool *is_program) {
  Dl_info info;
  struct link_map *map = NULL;
  if (!dladdr1((void *)own_dir, &info, (void **)&map, RTLD_DL_LINKMAP) || !map) return false;
  /* the main program's link map has an empty name */
  *is_program = !map->l_name || !map->l_name[0];
  char path[4096];
  if (*is_program) {
    ssize_t n = readlink("/proc/self/exe", path, sizeof(path) - 1);
    if (n <= 0) return false;
    path[n] = '\0';
  } else if (!realpath(map->l_name, path)) {
    return false;
  }
  char *slash = strrchr(path, '/');
  if (!slash) return false;
  *slash = '\0';
  return snprintf(dir, len, "%s", path[0] ? path : "/") < (int)len;
}

/* The first plugin file that exists among the candidates of steps 2 and 3
 * into path; each candidate is appended to tried. */
static bool find_plugin(char *path, size_t len, char *tried, size_t tried_len) {
  char cand[4][4096];
  int n = 0;
  snprintf(cand[n++], sizeof(cand[0]), "%s/%s", PS_NCCL_PLUGIN_DIR, PS_NCCL_PLUGIN_FILE);
  char dir[4000];
  bool is_program = false;
  if (own_dir(dir, sizeof(dir), &is_program)) {
    if (is_program) {
      snprintf(cand[n++], sizeof(cand[0]), "%s/%s/%s", dir, PS_NCCL_PLUGIN_FROM_BIN,
               PS_NCCL_PLUGIN_FILE);
    } else {
      snprintf(cand[n++], sizeof(cand[0]), "%s/ps/%s", dir, PS_NCCL_PLUGIN_FILE);
      snprintf(cand[n++], sizeof(cand[0]), "%s/%s", dir, PS_NCCL_PLUGIN_FILE);
    }
  }
  for (int i = 0; i < n; i++) {
    bool seen = false;
    for (int j = 0; j < i; j++) seen = seen || !strcmp(cand[i], cand[j]);
    if (seen) continue;
    size_t used = strlen(tried);
    /* the list for the error message; cut short when it does not fit */
    if (snprintf(tried + used, tried_len - used, "%s%s", used ? ", " : "", cand[i]) < 0)
      tried[used] = '\0';
    if (access(cand[i], F_OK) == 0) return snprintf(path, len, "%s", cand[i]) < (int)len;
  }
  return false;
}

/* dlopen()s the plugin at path (NULL: the bare name, dlopen's default
 * search) and checks its ABI. 1 = loaded, 0 = the bare name was not found,
 * -1 = failed with load_error set. */
static int open_plugin(const char *path) {
  const char *name = path ? path : PS_NCCL_PLUGIN_FILE;
  void *h = dlopen(name, RTLD_NOW | RTLD_LOCAL);
  if (!h) {
    const char *e = dlerror();
    e = e ? e : "unknown dlopen error";
    /* dlopen names the file it could not find first: the plugin itself
     * (not found) or one of its libraries (found, libnccl/libcudart not) */
    size_t nl = strlen(PS_NCCL_PLUGIN_FILE);
    if (!path && !strncmp(e, PS_NCCL_PLUGIN_FILE, nl) && strstr(e, "No such file")) return 0;
    snprintf(load_error, sizeof(load_error),
             "the NCCL plugin %s was found but does not load: %s (it needs libnccl.so.2 and "
             "libcudart of the CUDA it was built with: install them or add their directory to "
             "LD_LIBRARY_PATH)",
             name, e);
    return -1;
  }
  const struct ps_nccl_plugin *p = dlsym(h, PS_NCCL_PLUGIN_SYMBOL);
  if (!p) {
    snprintf(load_error, sizeof(load_error),
             "%s is not a ps NCCL plugin: it has no symbol %s (is PS_NCCL_PLUGIN right?)", name,
             PS_NCCL_PLUGIN_SYMBOL);
    dlclose(h);
    return -1;
  }
  if (p->abi_version != PS_NCCL_PLUGIN_ABI) {
    snprintf(load_error, sizeof(load_error),
             "the NCCL plugin %s has plugin ABI version %u but this libps needs version %u: "
             "install the plugin built with this libps (libps %s)",
             name, (unsigned)p->abi_version, PS_NCCL_PLUGIN_ABI, PS_VERSION_STRING);
    dlclose(h);
    return -1;
  }
  if (p->init(&host) != 0) {
    snprintf(load_error, sizeof(load_error), "the NCCL plugin %s failed to initialise", name);
    dlclose(h);
    return -1;
  }
  char where[4096] = "";
  struct link_map *map = NULL;
  if (dlinfo(h, RTLD_DI_LINKMAP, &map) == 0 && map && map->l_name)
    snprintf(where, sizeof(where), "%s", map->l_name);
  log_info("nccl plugin loaded", "path=\"%s\" abi=%u %s", where[0] ? where : name,
           (unsigned)p->abi_version, p->describe ? p->describe : "");
  plugin = p;
  return 1;
}

/* Decides once whether the plugin loads; false with load_error set if not. */
static bool load(void) {
  pthread_mutex_lock(&load_lock);
  if (!load_done) {
    load_done = true;
    /* secure_getenv: a set-user-ID program loads no code a caller names */
    const char *env = secure_getenv("PS_NCCL_PLUGIN");
    char path[4096], tried[TRIED_BYTES] = "";
    if (env && env[0]) {
      if (access(env, F_OK) != 0)
        snprintf(load_error, sizeof(load_error),
                 "PS_NCCL_PLUGIN=%s: %s (it names the NCCL plugin file, %s)", env, strerror(errno),
                 PS_NCCL_PLUGIN_FILE);
      else
        open_plugin(env);
    } else if (find_plugin(path, sizeof(path), tried, sizeof(tried))) {
      open_plugin(path);
    } else if (open_plugin(NULL) == 0) {
      snprintf(load_error, sizeof(load_error),
               "no NCCL backend on this node: the plugin %s is not in %s nor on the library search "
               "path%s; set PS_NCCL_PLUGIN to its path, or use --allreduce-backend tcp",
               PS_NCCL_PLUGIN_FILE, tried,
               PS_NCCL_PLUGIN_BUILT ? ""
                                    : " (this libps was built without NCCL: meson feature 'nccl' "
                                      "off or CUDA/NCCL not found, so it installed no plugin)");
    }
  }
  bool ok = plugin != NULL;
  pthread_mutex_unlock(&load_lock);
  return ok;
}

bool ps_nccl_built(void) {
  return load();
}

int ps_nccl_device_count(char *why, size_t len) {
  if (!load()) {
    snprintf(why, len, "%s", load_error);
    return 0;
  }
  return plugin->device_count(why, len);
}

ps_status ps_nccl_open(ps_coll *boot, struct ps_nccl **out, char *err, size_t errlen) {
  *out = NULL;
  if (!load()) {
    snprintf(err, errlen, "%s", load_error);
    return PS_ERR_INVALID;
  }
  return plugin->open(boot, out, err, errlen);
}

ps_status ps_nccl_split(struct ps_nccl *parent, ps_coll *group, int color, int key,
                        struct ps_nccl **out, char *err, size_t errlen) {
  *out = NULL;
  if (!load()) {
    snprintf(err, errlen, "%s", load_error);
    return PS_ERR_INVALID;
  }
  return plugin->split(parent, group, color, key, out, err, errlen);
}

/* Below, n != NULL means ps_nccl_open succeeded, so plugin is set. */
void ps_nccl_close(struct ps_nccl *n) {
  if (n) plugin->close(n);
}

int ps_nccl_device(const struct ps_nccl *n) {
  return n ? plugin->device(n) : -1;
}

const char *ps_nccl_describe(const struct ps_nccl *n, char *buf, size_t len) {
  if (n) return plugin->describe_comm(n, buf, len);
  snprintf(buf, len, "none");
  return buf;
}

const char *ps_nccl_errmsg(struct ps_nccl *n, char *buf, size_t len) {
  if (n) return plugin->errmsg(n, buf, len);
  pthread_mutex_lock(&load_lock);
  snprintf(buf, len, "%s", load_done && !plugin ? load_error : "no NCCL communicator");
  pthread_mutex_unlock(&load_lock);
  return buf;
}

ps_status ps_nccl_dev_alloc(struct ps_nccl *n, size_t bytes, void **dev) {
  *dev = NULL;
  return n ? plugin->dev_alloc(n, bytes, dev) : PS_ERR_INVALID;
}

void ps_nccl_dev_free(struct ps_nccl *n, void *dev) {
  if (n) plugin->dev_free(n, dev);
}

ps_status ps_nccl_to_device(struct ps_nccl *n, void *dev, const void *host_buf, size_t bytes) {
  return n ? plugin->to_device(n, dev, host_buf, bytes) : PS_ERR_INVALID;
}

ps_status ps_nccl_to_host(struct ps_nccl *n, void *host_buf, const void *dev, size_t bytes) {
  return n ? plugin->to_host(n, host_buf, dev, bytes) : PS_ERR_INVALID;
}

ps_status ps_nccl_allreduce_dev(struct ps_nccl *n, void *dev, size_t count, enum ps_redop op) {
  return ps_nccl_allreduce_typed_dev(n, dev, count, PS_DTYPE_FLOAT32, op);
}

ps_status ps_nccl_allreduce_typed_dev(struct ps_nccl *n, void *dev, size_t count, ps_dtype dtype,
                                      enum ps_redop op) {
  return n ? plugin->allreduce_typed_dev(n, dev, count, dtype, op) : PS_ERR_INVALID;
}

ps_status ps_nccl_allgather_dev(struct ps_nccl *n, const void *send, void *recv, size_t bytes) {
  return n ? plugin->allgather_dev(n, send, recv, bytes) : PS_ERR_INVALID;
}

ps_status ps_nccl_reduce_scatter_dev(struct ps_nccl *n, const void *send, void *recv, size_t count,
                                     enum ps_redop op) {
  return ps_nccl_reduce_scatter_typed_dev(n, send, recv, count, PS_DTYPE_FLOAT32, op);
}

ps_status ps_nccl_reduce_scatter_typed_dev(struct ps_nccl *n, const void *send, void *recv,
                                           size_t count, ps_dtype dtype, enum ps_redop op) {
  return n ? plugin->reduce_scatter_typed_dev(n, send, recv, count, dtype, op) : PS_ERR_INVALID;
}

ps_status ps_nccl_reduce_dev(struct ps_nccl *n, void *dev, size_t count, enum ps_redop op,
                             int root) {
  return ps_nccl_reduce_typed_dev(n, dev, count, PS_DTYPE_FLOAT32, op, root);
}

ps_status ps_nccl_reduce_typed_dev(struct ps_nccl *n, void *dev, size_t count, ps_dtype dtype,
                                   enum ps_redop op, int root) {
  return n ? plugin->reduce_typed_dev(n, dev, count, dtype, op, root) : PS_ERR_INVALID;
}

ps_status ps_nccl_broadcast_dev(struct ps_nccl *n, void *dev, size_t bytes, int root) {
  return n ? plugin->broadcast_dev(n, dev, bytes, root) : PS_ERR_INVALID;
}

ps_status ps_nccl_alltoall_dev(struct ps_nccl *n, const void *send, void *recv, size_t bytes) {
  return n ? plugin->alltoall_dev(n, send, recv, bytes) : PS_ERR_INVALID;
}

ps_status ps_nccl_send_dev(struct ps_nccl *n, const void *dev, size_t bytes, int peer) {
  return n ? plugin->send_dev(n, dev, bytes, peer) : PS_ERR_INVALID;
}

ps_status ps_nccl_recv_dev(struct ps_nccl *n, void *dev, size_t bytes, int peer) {
  return n ? plugin->recv_dev(n, dev, bytes, peer) : PS_ERR_INVALID;
}

ps_status ps_nccl_sync(struct ps_nccl *n) {
  return n ? plugin->sync(n) : PS_ERR_INVALID;
}

ps_status ps_nccl_allreduce_host_async(struct ps_nccl *n, int slot, float *host_buf, size_t count,
                                       enum ps_redop op) {
  return n ? plugin->allreduce_host_async(n, slot, host_buf, count, op) : PS_ERR_INVALID;
}

ps_status ps_nccl_wait_slot(struct ps_nccl *n, int slot) {
  return n ? plugin->wait_slot(n, slot) : PS_ERR_INVALID;
}
