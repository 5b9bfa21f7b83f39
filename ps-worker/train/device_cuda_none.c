/* device_cuda_none: the CUDA device of a build without CUDA (meson feature
 * 'cuda' disabled, or no nvcc/cuBLAS found at setup). Opening it says so;
 * --device auto then uses the CPU and --device cuda stops with this message. */
#include <errno.h>
#include <stdio.h>

#include "device_impl.h"

int device_cuda_open(const struct device_opts *o, const int *sizes, int num_sizes, int max_batch,
                     struct device_model **out, char *err, size_t errlen) {
  (void)o;
  (void)sizes;
  (void)num_sizes;
  (void)max_batch;
  *out = NULL;
  if (errlen)
    snprintf(err, errlen,
             "this ps-worker was built without CUDA (meson feature 'cuda': install "
             "the CUDA toolkit with cuBLAS and rebuild, or use --device cpu)");
  return -ENODEV;
}
