/* nccl_plugin_stub_dep: the library a stub plugin needs (nccl_plugin_stub.c). */
int nccl_plugin_stub_dep(void);
int nccl_plugin_stub_dep(void) {
  return 0;
}
