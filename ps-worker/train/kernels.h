/* kernels: the CUDA kernels of the GPU model (kernels.cu), behind plain C
 * launchers so that only device_cuda.c sees CUDA's headers and types.
 *
 * Every launcher queues its kernel on `stream` (a cudaStream_t passed as a
 * pointer) and returns the launch's cudaError_t as an int (0 = success), which
 * device_cuda.c translates. Pointers are device memory, matrices row-major
 * float32 as in model.h. The element-wise arithmetic repeats model.c's
 * operation for operation (no fused multiply-add where model.c has none), so
 * results differ from the CPU's only where summation order differs: in the
 * matrix products and the softmax and bias sums. Launchers with nothing to
 * do (a size of 0) launch nothing. */
#ifndef PS_KERNELS_H
#define PS_KERNELS_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* dst[i] = src[i] / 255.0f (a true division, as dataset_gather). */
int kernels_pixels_to_float(void *stream, const uint8_t *src, float *dst, size_t n);

/* z[r][j] += b[j] over rows x cols, then z = max(z, 0) if relu (NaN passes). */
int kernels_bias_act(void *stream, float *z, const float *b, int rows, int cols, int relu);

/* Per row of logits [rows][classes] with label y[r]: row_loss[r] = the
 * cross-entropy (log-sum-exp after subtracting the row max), row_correct[r] =
 * 1 if the first arg-max equals y[r]; if dlogits is not NULL it receives
 * (softmax - onehot(y)) * scale. */
int kernels_softmax_xent(void *stream, const float *logits, const uint8_t *y, int rows, int classes,
                         float scale, float *dlogits, float *row_loss, int *row_correct);

/* out[j] = sum over r of d[r][j] (the bias gradient), in a fixed order. */
int kernels_column_sums(void *stream, const float *d, int rows, int cols, float *out);

/* dp[k] = a[k] > 0 ? dp[k] : 0 (the ReLU derivative). */
int kernels_relu_backward(void *stream, float *dp, const float *a, size_t n);

/* p[k] -= lr * g[k]. */
int kernels_sgd(void *stream, float *p, const float *g, size_t n, float lr);

#ifdef __cplusplus
}
#endif

#endif
