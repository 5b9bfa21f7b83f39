/* dtype_cpu_none: no CPU-specific kernels (a CPU other than x86_64): the
 * portable ones of dtype.c run (docs/ARCHITECTURE.md, Conventions). */
#include "dtype_impl.h"

dtype_kernel dtype_cpu_combine(enum dtype t, enum dtype_op op) {
  (void)t;
  (void)op;
  return NULL;
}

dtype_scaler dtype_cpu_scale(enum dtype t) {
  (void)t;
  return NULL;
}
