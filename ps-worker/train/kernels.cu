/* kernels: the GPU model's element-wise, softmax and reduction kernels (see
 * kernels.h). Built by nvcc only when meson's feature 'cuda' is on.
 *
 * Shapes are small (a batch of 128 by a few hundred units), so each kernel is
 * a plain grid-stride loop or one warp per row; what costs time at these
 * sizes is launches, which device_cuda.c removes by replaying the whole step
 * as one CUDA graph. Products use __fmul_rn so nvcc does not contract them
 * into fused multiply-adds that model.c (built without FMA) does not do. */
#include <cuda_runtime.h>
#include <math.h>

#include "kernels.h"

namespace {

constexpr int kThreads = 256;
constexpr int kMaxBlocks = 4096;

int blocks_for(size_t n) {
  size_t b = (n + kThreads - 1) / kThreads;
  return b > (size_t)kMaxBlocks ? kMaxBlocks : (int)b;
}

__global__ void pixels_to_float(const uint8_t *src, float *dst, size_t n) {
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
       i += (size_t)gridDim.x * blockDim.x)
    dst[i] = (float)src[i] / 255.0f;
}

__global__ void bias_act(float *z, const float *b, int rows, int cols, int relu) {
  size_t n = (size_t)rows * cols;
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
       i += (size_t)gridDim.x * blockDim.x) {
    float v = z[i] + b[i % cols];
    z[i] = relu && v < 0.0f ? 0.0f : v;
  }
}

/* One warp per row. Lane l holds classes l, l+32, ...; the arg-max keeps the
 * first index among equal maxima, as model.c's strict '>' scan does. */
__global__ void softmax_xent(const float *logits, const uint8_t *y, int rows, int classes,
                             float scale, float *dlogits, float *row_loss, int *row_correct) {
  int row = (int)((blockIdx.x * (size_t)blockDim.x + threadIdx.x) / 32);
  int lane = threadIdx.x & 31;
  if (row >= rows) return; /* whole warps leave together: rows map to warps */
  const float *z = logits + (size_t)row * classes;
  float mx = -INFINITY;
  int arg = classes;
  for (int j = lane; j < classes; j += 32) {
    if (arg == classes || z[j] > mx) {
      mx = z[j];
      arg = j;
    }
  }
  for (int off = 16; off > 0; off >>= 1) {
    float omx = __shfl_xor_sync(0xffffffffu, mx, off);
    int oarg = __shfl_xor_sync(0xffffffffu, arg, off);
    if (oarg < classes && (arg == classes || omx > mx || (omx == mx && oarg < arg))) {
      mx = omx;
      arg = oarg;
    }
  }
  float sum = 0.0f;
  for (int j = lane; j < classes; j += 32) sum += expf(z[j] - mx);
  for (int off = 16; off > 0; off >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, off);
  int label = y[row];
  if (dlogits != NULL) {
    float k = scale / sum;
    float *d = dlogits + (size_t)row * classes;
    for (int j = lane; j < classes; j += 32) {
      float v = __fmul_rn(expf(z[j] - mx), k);
      d[j] = j == label ? v - scale : v;
    }
  }
  if (lane == 0) {
    row_loss[row] = (float)((double)mx + log((double)sum) - (double)z[label]);
    row_correct[row] = arg == label;
  }
}

/* Block (32, 8): 32 columns, 8 row phases; each thread sums rows ty, ty+8, ...
 * of its column, then row phase 0 adds the 8 partial sums in order. */
__global__ void column_sums(const float *d, int rows, int cols, float *out) {
  __shared__ float part[8][33];
  int col = blockIdx.x * 32 + threadIdx.x;
  float s = 0.0f;
  if (col < cols)
    for (int r = threadIdx.y; r < rows; r += 8) s += d[(size_t)r * cols + col];
  part[threadIdx.y][threadIdx.x] = s;
  __syncthreads();
  if (threadIdx.y == 0 && col < cols) {
    float t = part[0][threadIdx.x];
    for (int k = 1; k < 8; k++) t += part[k][threadIdx.x];
    out[col] = t;
  }
}

__global__ void relu_backward(float *dp, const float *a, size_t n) {
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
       i += (size_t)gridDim.x * blockDim.x)
    dp[i] = a[i] > 0.0f ? dp[i] : 0.0f;
}

__global__ void sgd(float *p, const float *g, size_t n, float lr) {
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
       i += (size_t)gridDim.x * blockDim.x)
    p[i] = p[i] - __fmul_rn(lr, g[i]);
}

int launched(void) {
  return (int)cudaGetLastError();
}

}  // namespace

extern "C" int kernels_pixels_to_float(void *stream, const uint8_t *src, float *dst, size_t n) {
  if (n == 0) return 0;
  pixels_to_float<<<blocks_for(n), kThreads, 0, (cudaStream_t)stream>>>(src, dst, n);
  return launched();
}

extern "C" int kernels_bias_act(void *stream, float *z, const float *b, int rows, int cols,
                                int relu) {
  size_t n = (size_t)rows * (size_t)cols;
  if (n == 0) return 0;
  bias_act<<<blocks_for(n), kThreads, 0, (cudaStream_t)stream>>>(z, b, rows, cols, relu);
  return launched();
}

extern "C" int kernels_softmax_xent(void *stream, const float *logits, const uint8_t *y, int rows,
                                    int classes, float scale, float *dlogits, float *row_loss,
                                    int *row_correct) {
  const int warps = 4;
  if (rows == 0) return 0;
  softmax_xent<<<(rows + warps - 1) / warps, warps * 32, 0, (cudaStream_t)stream>>>(
      logits, y, rows, classes, scale, dlogits, row_loss, row_correct);
  return launched();
}

extern "C" int kernels_column_sums(void *stream, const float *d, int rows, int cols, float *out) {
  if (cols == 0) return 0;
  column_sums<<<(cols + 31) / 32, dim3(32, 8), 0, (cudaStream_t)stream>>>(d, rows, cols, out);
  return launched();
}

extern "C" int kernels_relu_backward(void *stream, float *dp, const float *a, size_t n) {
  if (n == 0) return 0;
  relu_backward<<<blocks_for(n), kThreads, 0, (cudaStream_t)stream>>>(dp, a, n);
  return launched();
}

extern "C" int kernels_sgd(void *stream, float *p, const float *g, size_t n, float lr) {
  if (n == 0) return 0;
  sgd<<<blocks_for(n), kThreads, 0, (cudaStream_t)stream>>>(p, g, n, lr);
  return launched();
}
