/* blas_cpu_none: blas_cpu_detect on an architecture other than x86_64,
 * where none of the kernels of the table (OpenBLAS's x86_64 core names)
 * runs: auto keeps whatever OpenBLAS picked and a kernel name is refused.
 * meson chooses it instead of blas_cpu_x86.c (docs/ARCHITECTURE.md, Conventions). */
#include <string.h>

#include "blas_kernel_impl.h"

void blas_cpu_detect(struct blas_cpu *out) {
  memset(out, 0, sizeof(*out));
}
