/* nccl_plugin_stub: a plugin that libps must refuse (test_nccl_plugin.sh).
 * Its abi_version is one above PS_NCCL_PLUGIN_ABI, so where it is built the
 * loader reads that and refuses it, naming both versions. It needs the
 * library of nccl_plugin_stub_dep.c (found through meson's $ORIGIN build
 * RUNPATH): copied away from it, it is a plugin whose libraries do not
 * load, as libps-nccl.so on a node without libnccl.so.2. Never called. */
#include "nccl_plugin.h"

int nccl_plugin_stub_dep(void);
int nccl_plugin_stub_use(void);
int nccl_plugin_stub_use(void) {
  return nccl_plugin_stub_dep();
}

const struct ps_nccl_plugin ps_nccl_plugin = {.abi_version = PS_NCCL_PLUGIN_ABI + 1,
                                              .describe = "test stub"};
