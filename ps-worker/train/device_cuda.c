/* device_cuda: the CUDA implementation of device.h, and the one file that
 * includes CUDA's and cuBLAS's headers: every cudaError_t and cublasStatus_t
 * is translated here into a negative errno and a message naming the call.
 *
 * Memory. One cudaMalloc holds, 256-byte aligned: the parameter block and the
 * gradient block (tensor t at the same float offset in both, each tensor
 * padded to 16 floats as in model.c, padding zero forever so SGD can run over
 * a whole block), per layer output l the activations act[l] and errors
 * delta[l] for max_batch rows, the input as bytes and as floats, labels,
 * per-row loss and hit, and cuBLAS's workspace (set explicitly, so nothing is
 * allocated while a graph is captured). The host mirror is an mlp
 * (model.h) whose parameter and gradient buffers are page-locked with
 * cudaHostRegister, so copies go straight between them and the device; where
 * registering is refused (some sandboxes), copies go through a page-locked
 * stage of the same layout and the host copies between stage and mirror.
 * Page-locked staging also holds the input bytes, labels and per-row results.
 *
 * Streams. All computation runs on one stream; gradient copies to the host
 * run on a second one. A step with a gradient callback records an event
 * after each gradient is produced; the copy stream waits for it, copies the
 * gradient into the mirror and records a second event; the host waits for
 * those in order and calls back, so pushing layer l's gradient overlaps the
 * device computing layers < l, and the copy engine works beside the SMs.
 *
 * Launches. At the default model and batch a step is ~15 small kernels and
 * copies of a few microseconds each: launch-bound, so the whole step is
 * captured once per (batch size, with or without gradient copies) into a
 * CUDA graph and replayed with one launch; the copy-done events are external
 * event nodes of the graph, which the host can wait on. opts.eager launches
 * the same sequence call by call instead (to compare the two paths).
 *
 * Arithmetic follows model.c (see kernels.h): the matrix products are
 * cublasSgemm in FP32 (cuBLAS's default math mode: no TF32), the row-major
 * products written as their column-major transposes.
 *
 * cuBLAS is opened with dlopen when a CUDA model is opened, not linked:
 * linking it costs every ps-worker ~150 MB of resident memory at start (the
 * loader relocates cuBLASLt's 500 MB), CPU runs included. Its prototypes
 * still come from cublas_v2.h. It is never closed: unloading a CUDA library
 * while the process's CUDA context lives is asking for trouble. */
#include <cublas_v2.h>
#include <cuda_runtime_api.h>
#include <dlfcn.h>
#include <errno.h>
#include <math.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "device_impl.h"
#include "kernels.h"

#define ALIGN_FLOATS 16 /* model.c's tensor alignment */
#define ALIGN_BYTES 256
#define WORKSPACE_BYTES ((size_t)32 << 20) /* cuBLAS's recommendation for Hopper */
#define MAX_TENSORS (2 * (MLP_MAX_SIZES - 1))
#define STR_(x) #x
#define STR(x) STR_(x) /* expands macros first: STR(cublasCreate) = "cublasCreate_v2" */
#define CUBLAS_SONAME "libcublas.so." STR(CUBLAS_VER_MAJOR)

/* The cuBLAS entry points used here, typed by cublas_v2.h. */
struct blas_api {
  __typeof__(cublasCreate) *create;
  __typeof__(cublasDestroy) *destroy;
  __typeof__(cublasSetStream) *set_stream;
  __typeof__(cublasSetWorkspace) *set_workspace;
  __typeof__(cublasSetMathMode) *set_math_mode;
  __typeof__(cublasSgemm) *sgemm;
  __typeof__(cublasGetStatusString) *status_string;
  __typeof__(cublasGetStatusName) *status_name;
};

struct cuda_model {
  struct device_model base;
  int gpu;
  bool eager;
  bool broken; /* a device error happened: every later call fails */
  int layers;  /* L */
  int nt;      /* 2L tensors */
  size_t off[MAX_TENSORS];
  size_t count[MAX_TENSORS];
  size_t used;          /* floats of a block up to the last tensor's end */
  size_t total;         /* floats of a block, padding included */
  bool host_contiguous; /* the mirror's tensors sit at off[] like the device's */

  /* device memory (one allocation) */
  void *dmem;
  float *params, *grads;
  float *act[MLP_MAX_SIZES];   /* act[0] = x */
  float *delta[MLP_MAX_SIZES]; /* [1..L] */
  uint8_t *x_bytes, *y;
  float *row_loss;
  int *row_correct;
  void *workspace;

  /* page-locked host memory */
  void *hmem;
  uint8_t *h_x_bytes, *h_y;
  float *h_row_loss;
  int *h_row_correct;
  void *registered;                      /* start of the mirror's registered range, NULL if none */
  float *h_params_stage, *h_grads_stage; /* only when registering was refused */

  cudaStream_t compute, copy;
  cudaEvent_t ready[MAX_TENSORS], copied[MAX_TENSORS], fork, join;
  struct blas_api api;
  cublasHandle_t blas;
  cudaGraphExec_t graph[2]; /* [with gradient copies] */
  int graph_batch[2];
};

static struct cuda_model *cuda_of(struct device_model *dm) {
  return container_of(dm, struct cuda_model, base);
}

/* Translates e (0 = success) for the call `what`; after a failure the model
 * is broken for good (errors may be sticky, and a half-done step has left
 * the buffers undefined). */
static int cuda_check(struct cuda_model *cm, cudaError_t e, const char *what) {
  int code;

  if (e == cudaSuccess) return 0;
  switch (e) {
    case cudaErrorMemoryAllocation:
      code = -ENOMEM;
      break;
    case cudaErrorNoDevice:
    case cudaErrorInsufficientDriver:
    case cudaErrorInvalidDevice:
    case cudaErrorDevicesUnavailable:
      code = -ENODEV;
      break;
    default:
      code = -EIO;
  }
  if (!cm->broken)
    device_fail(&cm->base, code, "%s: %s (%s)", what, cudaGetErrorString(e), cudaGetErrorName(e));
  cm->broken = true;
  (void)cudaGetLastError(); /* clear a non-sticky error so cleanup calls work */
  return code;
}

static int kernel_check(struct cuda_model *cm, int e, const char *what) {
  return cuda_check(cm, (cudaError_t)e, what);
}

static int blas_check(struct cuda_model *cm, cublasStatus_t s, const char *what) {
  if (s == CUBLAS_STATUS_SUCCESS) return 0;
  if (!cm->broken)
    device_fail(&cm->base, s == CUBLAS_STATUS_ALLOC_FAILED ? -ENOMEM : -EIO, "%s: %s (%s)", what,
                cm->api.status_string(s), cm->api.status_name(s));
  cm->broken = true;
  return s == CUBLAS_STATUS_ALLOC_FAILED ? -ENOMEM : -EIO;
}

/* Every entry point starts here: -EIO once the model is broken (the first
 * error's text stays), else 0 with the model's GPU current on this thread
 * (other code in the process, e.g. the NCCL backend, may have made another
 * one current). */
static int cuda_enter(struct cuda_model *cm) {
  if (cm->broken) return -EIO;
  return cuda_check(cm, cudaSetDevice(cm->gpu), "cudaSetDevice");
}

static size_t align_floats(size_t n) {
  return (n + ALIGN_FLOATS - 1) / ALIGN_FLOATS * ALIGN_FLOATS;
}

/* Bump allocation inside one block: returns the offset of `bytes` and
 * advances *at, 256-byte aligned. */
static size_t carve(size_t *at, size_t bytes) {
  size_t o = (*at + ALIGN_BYTES - 1) / ALIGN_BYTES * ALIGN_BYTES;
  *at = o + bytes;
  return o;
}

static void cuda_close(struct device_model *dm) {
  struct cuda_model *cm = cuda_of(dm);

  /* Errors are ignored here: there is nothing left to report them to. */
  if (cm->compute || cm->dmem || cm->hmem || cm->registered) cudaSetDevice(cm->gpu);
  if (cm->compute) cudaStreamSynchronize(cm->compute);
  if (cm->copy) cudaStreamSynchronize(cm->copy);
  for (int i = 0; i < 2; i++)
    if (cm->graph[i]) cudaGraphExecDestroy(cm->graph[i]);
  if (cm->blas) cm->api.destroy(cm->blas);
  for (int t = 0; t < cm->nt; t++) {
    if (cm->ready[t]) cudaEventDestroy(cm->ready[t]);
    if (cm->copied[t]) cudaEventDestroy(cm->copied[t]);
  }
  if (cm->fork) cudaEventDestroy(cm->fork);
  if (cm->join) cudaEventDestroy(cm->join);
  if (cm->compute) cudaStreamDestroy(cm->compute);
  if (cm->copy) cudaStreamDestroy(cm->copy);
  if (cm->dmem) cudaFree(cm->dmem);
  if (cm->hmem) cudaFreeHost(cm->hmem);
  if (cm->registered) cudaHostUnregister(cm->registered);
  mlp_free(dm->host);
  free(cm);
}

/* Lays out the tensors as model.c does and checks the mirror against it. */
static void plan_tensors(struct cuda_model *cm) {
  struct mlp *h = cm->base.host;
  size_t at = 0;

  cm->host_contiguous = true;
  for (int t = 0; t < cm->nt; t++) {
    cm->off[t] = at;
    cm->count[t] = mlp_tensor_count(h, t);
    at += align_floats(cm->count[t]);
    if (mlp_param(h, t) != mlp_param(h, 0) + cm->off[t] ||
        mlp_grad(h, t) != mlp_grad(h, 0) + cm->off[t])
      cm->host_contiguous = false;
  }
  cm->total = at;
  cm->used = cm->off[cm->nt - 1] + cm->count[cm->nt - 1];
}

/* Page-locks the mirror's parameters and gradients: the smallest range that
 * covers them all (one registration: ranges may not overlap). */
static void pin_mirror(struct cuda_model *cm) {
  struct mlp *h = cm->base.host;
  uintptr_t lo = UINTPTR_MAX, hi = 0;

  for (int t = 0; t < cm->nt; t++) {
    uintptr_t p = (uintptr_t)mlp_param(h, t), g = (uintptr_t)mlp_grad(h, t);
    uintptr_t n = cm->count[t] * sizeof(float);
    lo = p < lo ? p : lo;
    lo = g < lo ? g : lo;
    hi = p + n > hi ? p + n : hi;
    hi = g + n > hi ? g + n : hi;
  }
  if (cudaHostRegister((void *)lo, hi - lo, cudaHostRegisterDefault) == cudaSuccess)
    cm->registered = (void *)lo;
  else
    (void)cudaGetLastError(); /* not sticky: alloc_buffers adds a stage instead */
}

static int alloc_buffers(struct cuda_model *cm) {
  const int *s = cm->base.sizes;
  size_t B = (size_t)cm->base.max_batch, at = 0;
  size_t o_params, o_grads, o_act[MLP_MAX_SIZES], o_delta[MLP_MAX_SIZES], o_x, o_xb, o_y, o_loss,
      o_hit, o_ws;
  int r;

  o_params = carve(&at, cm->total * sizeof(float));
  o_grads = carve(&at, cm->total * sizeof(float));
  o_x = carve(&at, B * (size_t)s[0] * sizeof(float));
  for (int l = 1; l <= cm->layers; l++) {
    o_act[l] = carve(&at, B * (size_t)s[l] * sizeof(float));
    o_delta[l] = carve(&at, B * (size_t)s[l] * sizeof(float));
  }
  o_xb = carve(&at, B * (size_t)s[0]);
  o_y = carve(&at, B);
  o_loss = carve(&at, B * sizeof(float));
  o_hit = carve(&at, B * sizeof(int));
  o_ws = carve(&at, WORKSPACE_BYTES);
  if ((r = cuda_check(cm, cudaMalloc(&cm->dmem, at), "cudaMalloc(model)")) < 0) return r;
  /* Zero: padding stays zero for whole-block SGD, and parameters start at 0. */
  if ((r = cuda_check(cm, cudaMemset(cm->dmem, 0, at), "cudaMemset(model)")) < 0) return r;
  char *d = cm->dmem;
  cm->params = (float *)(d + o_params);
  cm->grads = (float *)(d + o_grads);
  cm->act[0] = (float *)(d + o_x);
  for (int l = 1; l <= cm->layers; l++) {
    cm->act[l] = (float *)(d + o_act[l]);
    cm->delta[l] = (float *)(d + o_delta[l]);
  }
  cm->x_bytes = (uint8_t *)(d + o_xb);
  cm->y = (uint8_t *)(d + o_y);
  cm->row_loss = (float *)(d + o_loss);
  cm->row_correct = (int *)(d + o_hit);
  cm->workspace = d + o_ws;

  at = 0;
  o_xb = carve(&at, B * (size_t)s[0]);
  o_y = carve(&at, B);
  o_loss = carve(&at, B * sizeof(float));
  o_hit = carve(&at, B * sizeof(int));
  size_t o_stage = carve(&at, cm->registered ? 0 : 2 * cm->total * sizeof(float));
  if ((r = cuda_check(cm, cudaHostAlloc(&cm->hmem, at, cudaHostAllocDefault),
                      "cudaHostAlloc(input staging)")) < 0)
    return r;
  char *h = cm->hmem;
  cm->h_x_bytes = (uint8_t *)(h + o_xb);
  cm->h_y = (uint8_t *)(h + o_y);
  cm->h_row_loss = (float *)(h + o_loss);
  cm->h_row_correct = (int *)(h + o_hit);
  if (!cm->registered) {
    cm->h_params_stage = (float *)(h + o_stage);
    cm->h_grads_stage = cm->h_params_stage + cm->total;
  }
  return 0;
}

static int create_streams(struct cuda_model *cm) {
  int r;

  if ((r = cuda_check(cm, cudaStreamCreateWithFlags(&cm->compute, cudaStreamNonBlocking),
                      "cudaStreamCreate(compute)")) < 0 ||
      (r = cuda_check(cm, cudaStreamCreateWithFlags(&cm->copy, cudaStreamNonBlocking),
                      "cudaStreamCreate(copy)")) < 0 ||
      (r = cuda_check(cm, cudaEventCreateWithFlags(&cm->fork, cudaEventDisableTiming),
                      "cudaEventCreate")) < 0 ||
      (r = cuda_check(cm, cudaEventCreateWithFlags(&cm->join, cudaEventDisableTiming),
                      "cudaEventCreate")) < 0)
    return r;
  for (int t = 0; t < cm->nt; t++) {
    if ((r = cuda_check(cm, cudaEventCreateWithFlags(&cm->ready[t], cudaEventDisableTiming),
                        "cudaEventCreate")) < 0 ||
        (r = cuda_check(cm, cudaEventCreateWithFlags(&cm->copied[t], cudaEventDisableTiming),
                        "cudaEventCreate")) < 0)
      return r;
  }
  if ((r = blas_check(cm, cm->api.create(&cm->blas), "cublasCreate")) < 0) return r;
  /* SetStream resets the workspace to cuBLAS's own pool: set ours after it. */
  if ((r = blas_check(cm, cm->api.set_stream(cm->blas, cm->compute), "cublasSetStream")) < 0 ||
      (r = blas_check(cm, cm->api.set_workspace(cm->blas, cm->workspace, WORKSPACE_BYTES),
                      "cublasSetWorkspace")) < 0 ||
      (r = blas_check(cm, cm->api.set_math_mode(cm->blas, CUBLAS_DEFAULT_MATH),
                      "cublasSetMathMode")) < 0)
    return r;
  return 0;
}

/* Fills cm->api from the cuBLAS of the major version this file was built
 * against; -ENODEV with the loader's message if it is missing. */
static int load_cublas(struct cuda_model *cm) {
  static const struct {
    const char *name;
    size_t offset;
  } syms[] = {
      {STR(cublasCreate), offsetof(struct blas_api, create)},
      {STR(cublasDestroy), offsetof(struct blas_api, destroy)},
      {STR(cublasSetStream), offsetof(struct blas_api, set_stream)},
      {STR(cublasSetWorkspace), offsetof(struct blas_api, set_workspace)},
      {STR(cublasSetMathMode), offsetof(struct blas_api, set_math_mode)},
      {STR(cublasSgemm), offsetof(struct blas_api, sgemm)},
      {STR(cublasGetStatusString), offsetof(struct blas_api, status_string)},
      {STR(cublasGetStatusName), offsetof(struct blas_api, status_name)},
  };
  void *lib = dlopen(CUBLAS_SONAME, RTLD_NOW | RTLD_LOCAL);

  if (lib == NULL) return device_fail(&cm->base, -ENODEV, "cannot load cuBLAS: %s", dlerror());
  for (size_t i = 0; i < sizeof(syms) / sizeof(syms[0]); i++) {
    void *p = dlsym(lib, syms[i].name);
    if (p == NULL)
      return device_fail(&cm->base, -ENODEV, "%s has no %s", CUBLAS_SONAME, syms[i].name);
    /* POSIX: function and object pointers share a representation. */
    memcpy((char *)&cm->api + syms[i].offset, &p, sizeof(p));
  }
  return 0;
}

/* C = op(A) op(B), column-major, alpha 1, beta 0. */
static int gemm(struct cuda_model *cm, cublasOperation_t ta, cublasOperation_t tb, int m, int n,
                int k, const float *a, int lda, const float *b, int ldb, float *c, int ldc,
                const char *what) {
  const float one = 1.0f, zero = 0.0f;

  return blas_check(
      cm, cm->api.sgemm(cm->blas, ta, tb, m, n, k, &one, a, lda, b, ldb, &zero, c, ldc), what);
}

/* act[1..L] for `batch` rows of act[0] (row-major Z = A W^T is column-major
 * Z^T = W A^T: op(W buffer) = T, A buffer as is). */
static int enqueue_forward(struct cuda_model *cm, int batch) {
  const int *s = cm->base.sizes;
  int r;

  for (int l = 0; l < cm->layers; l++) {
    int in = s[l], out = s[l + 1];
    if ((r = gemm(cm, CUBLAS_OP_T, CUBLAS_OP_N, out, batch, in, cm->params + cm->off[2 * l], in,
                  cm->act[l], in, cm->act[l + 1], out, "cublasSgemm(forward)")) < 0 ||
        (r = kernel_check(
             cm,
             kernels_bias_act(cm->compute, cm->act[l + 1], cm->params + cm->off[2 * l + 1], batch,
                              out, l + 1 < cm->layers),
             "bias/ReLU kernel")) < 0)
      return r;
  }
  return 0;
}

/* Gradient t is final on the compute stream: copy it into the mirror on the
 * copy stream and record copied[t] (an external event node when captured). */
static int enqueue_grad_copy(struct cuda_model *cm, int t, bool capturing) {
  int r;

  if ((r = cuda_check(cm, cudaEventRecord(cm->ready[t], cm->compute), "cudaEventRecord")) < 0 ||
      (r = cuda_check(cm, cudaStreamWaitEvent(cm->copy, cm->ready[t], 0), "cudaStreamWaitEvent")) <
          0 ||
      (r = cuda_check(cm,
                      cudaMemcpyAsync(cm->registered ? mlp_grad(cm->base.host, t)
                                                     : cm->h_grads_stage + cm->off[t],
                                      cm->grads + cm->off[t], cm->count[t] * sizeof(float),
                                      cudaMemcpyDeviceToHost, cm->copy),
                      "cudaMemcpyAsync(gradient to host)")) < 0)
    return r;
  return cuda_check(cm,
                    capturing
                        ? cudaEventRecordWithFlags(cm->copied[t], cm->copy, cudaEventRecordExternal)
                        : cudaEventRecord(cm->copied[t], cm->copy),
                    "cudaEventRecord(gradient copied)");
}

/* One training step on the loaded batch, queued on the compute stream (and
 * the copy stream if copies): the sequence a graph captures. */
static int enqueue_step(struct cuda_model *cm, int batch, bool copies, bool capturing) {
  const int *s = cm->base.sizes;
  int L = cm->layers, r;

  if ((r = kernel_check(cm,
                        kernels_pixels_to_float(cm->compute, cm->x_bytes, cm->act[0],
                                                (size_t)batch * (size_t)s[0]),
                        "input kernel")) < 0 ||
      (r = enqueue_forward(cm, batch)) < 0 ||
      (r = kernel_check(
           cm,
           kernels_softmax_xent(cm->compute, cm->act[L], cm->y, batch, s[L], 1.0f / (float)batch,
                                cm->delta[L], cm->row_loss, cm->row_correct),
           "softmax cross-entropy kernel")) < 0 ||
      (r = cuda_check(cm,
                      cudaMemcpyAsync(cm->h_row_loss, cm->row_loss, (size_t)batch * sizeof(float),
                                      cudaMemcpyDeviceToHost, cm->compute),
                      "cudaMemcpyAsync(loss to host)")) < 0)
    return r;
  if (copies &&
      ((r = cuda_check(cm, cudaEventRecord(cm->fork, cm->compute), "cudaEventRecord")) < 0 ||
       (r = cuda_check(cm, cudaStreamWaitEvent(cm->copy, cm->fork, 0), "cudaStreamWaitEvent")) < 0))
    return r;
  for (int l = L - 1; l >= 0; l--) {
    int in = s[l], out = s[l + 1];
    const float *d = cm->delta[l + 1];
    if ((r = kernel_check(
             cm, kernels_column_sums(cm->compute, d, batch, out, cm->grads + cm->off[2 * l + 1]),
             "bias gradient kernel")) < 0 ||
        (copies && (r = enqueue_grad_copy(cm, 2 * l + 1, capturing)) < 0))
      return r;
    /* dW = D^T A  ->  column-major dW^T = A^T D: A buffer as is, op(D buffer) = T */
    if ((r = gemm(cm, CUBLAS_OP_N, CUBLAS_OP_T, in, out, batch, cm->act[l], in, d, out,
                  cm->grads + cm->off[2 * l], in, "cublasSgemm(weight gradient)")) < 0 ||
        (copies && (r = enqueue_grad_copy(cm, 2 * l, capturing)) < 0))
      return r;
    if (l == 0) break;
    /* dP = D W  ->  column-major dP^T = W^T D^T: both buffers as they are */
    if ((r = gemm(cm, CUBLAS_OP_N, CUBLAS_OP_N, in, batch, out, cm->params + cm->off[2 * l], in, d,
                  out, cm->delta[l], in, "cublasSgemm(input gradient)")) < 0 ||
        (r = kernel_check(cm,
                          kernels_relu_backward(cm->compute, cm->delta[l], cm->act[l],
                                                (size_t)batch * (size_t)in),
                          "ReLU gradient kernel")) < 0)
      return r;
  }
  if (copies && ((r = cuda_check(cm, cudaEventRecord(cm->join, cm->copy), "cudaEventRecord")) < 0 ||
                 (r = cuda_check(cm, cudaStreamWaitEvent(cm->compute, cm->join, 0),
                                 "cudaStreamWaitEvent")) < 0))
    return r;
  return 0;
}

/* The captured step for (batch, copies), capturing it on first use. */
static int step_graph(struct cuda_model *cm, int batch, bool copies, cudaGraphExec_t *out) {
  int slot = copies, r;
  cudaGraph_t g = NULL;

  if (cm->graph[slot] && cm->graph_batch[slot] == batch) {
    *out = cm->graph[slot];
    return 0;
  }
  if (cm->graph[slot]) {
    cudaGraphExecDestroy(cm->graph[slot]);
    cm->graph[slot] = NULL;
  }
  /* One eager run first: every kernel (ours, and those cuBLAS picks) is then
   * loaded, so nothing is loaded lazily while capturing. The graph then
   * repeats the same computation on the same inputs. */
  if ((r = enqueue_step(cm, batch, copies, false)) < 0 ||
      (r = cuda_check(cm, cudaStreamSynchronize(cm->compute), "step (before capture)")) < 0)
    return r;
  if ((r = cuda_check(cm, cudaStreamBeginCapture(cm->compute, cudaStreamCaptureModeThreadLocal),
                      "cudaStreamBeginCapture")) < 0)
    return r;
  r = enqueue_step(cm, batch, copies, true);
  /* End the capture even after a failure, so the streams leave capture mode. */
  cudaError_t e = cudaStreamEndCapture(cm->compute, &g);
  if (r == 0) r = cuda_check(cm, e, "cudaStreamEndCapture");
  if (r == 0)
    r = cuda_check(cm, cudaGraphInstantiate(&cm->graph[slot], g, 0), "cudaGraphInstantiate");
  if (g) cudaGraphDestroy(g);
  if (r < 0) return r;
  cm->graph_batch[slot] = batch;
  *out = cm->graph[slot];
  return 0;
}

static int cuda_load_params(struct device_model *dm) {
  struct cuda_model *cm = cuda_of(dm);
  int r = cuda_enter(cm);

  if (r < 0) return r;
  if (!cm->registered) {
    /* A copy still queued from the stage reads it later; any values it sees
     * are overwritten by this one, queued after it. */
    for (int t = 0; t < cm->nt; t++)
      memcpy(cm->h_params_stage + cm->off[t], mlp_param(dm->host, t), cm->count[t] * sizeof(float));
    return cuda_check(cm,
                      cudaMemcpyAsync(cm->params, cm->h_params_stage, cm->used * sizeof(float),
                                      cudaMemcpyHostToDevice, cm->compute),
                      "cudaMemcpyAsync(parameters to device)");
  }
  if (cm->host_contiguous)
    return cuda_check(cm,
                      cudaMemcpyAsync(cm->params, mlp_param(dm->host, 0), cm->used * sizeof(float),
                                      cudaMemcpyHostToDevice, cm->compute),
                      "cudaMemcpyAsync(parameters to device)");
  for (int t = 0; t < cm->nt && r == 0; t++)
    r = cuda_check(
        cm,
        cudaMemcpyAsync(cm->params + cm->off[t], mlp_param(dm->host, t),
                        cm->count[t] * sizeof(float), cudaMemcpyHostToDevice, cm->compute),
        "cudaMemcpyAsync(parameters to device)");
  return r;
}

static int cuda_store_params(struct device_model *dm) {
  struct cuda_model *cm = cuda_of(dm);
  int r = cuda_enter(cm);

  if (r < 0) return r;
  if (!cm->registered) {
    if ((r = cuda_check(cm,
                        cudaMemcpyAsync(cm->h_params_stage, cm->params, cm->used * sizeof(float),
                                        cudaMemcpyDeviceToHost, cm->compute),
                        "cudaMemcpyAsync(parameters to host)")) < 0 ||
        (r = cuda_check(cm, cudaStreamSynchronize(cm->compute), "cudaStreamSynchronize")) < 0)
      return r;
    for (int t = 0; t < cm->nt; t++)
      memcpy(mlp_param(dm->host, t), cm->h_params_stage + cm->off[t], cm->count[t] * sizeof(float));
    return 0;
  }
  if (cm->host_contiguous) {
    r = cuda_check(cm,
                   cudaMemcpyAsync(mlp_param(dm->host, 0), cm->params, cm->used * sizeof(float),
                                   cudaMemcpyDeviceToHost, cm->compute),
                   "cudaMemcpyAsync(parameters to host)");
  } else {
    for (int t = 0; t < cm->nt && r == 0; t++)
      r = cuda_check(
          cm,
          cudaMemcpyAsync(mlp_param(dm->host, t), cm->params + cm->off[t],
                          cm->count[t] * sizeof(float), cudaMemcpyDeviceToHost, cm->compute),
          "cudaMemcpyAsync(parameters to host)");
  }
  if (r < 0) return r;
  return cuda_check(cm, cudaStreamSynchronize(cm->compute), "cudaStreamSynchronize");
}

/* Gathers the samples' bytes into page-locked staging and queues their copy. */
static int stage_input(struct cuda_model *cm, const struct dataset *ds, const uint32_t *idx,
                       int n) {
  size_t dim = (size_t)cm->base.sizes[0];
  int r;

  for (int k = 0; k < n; k++) {
    memcpy(cm->h_x_bytes + (size_t)k * dim, ds->pixels + (size_t)idx[k] * dim, dim);
    cm->h_y[k] = ds->labels[idx[k]];
  }
  if ((r = cuda_check(cm,
                      cudaMemcpyAsync(cm->x_bytes, cm->h_x_bytes, (size_t)n * dim,
                                      cudaMemcpyHostToDevice, cm->compute),
                      "cudaMemcpyAsync(input to device)")) < 0)
    return r;
  return cuda_check(cm,
                    cudaMemcpyAsync(cm->y, cm->h_y, (size_t)n, cudaMemcpyHostToDevice, cm->compute),
                    "cudaMemcpyAsync(labels to device)");
}

static int cuda_load_batch(struct device_model *dm, const struct dataset *ds, const uint32_t *idx,
                           int batch) {
  struct cuda_model *cm = cuda_of(dm);
  int r = cuda_enter(cm);

  /* The previous step has returned, so its graph no longer reads staging. */
  return r < 0 ? r : stage_input(cm, ds, idx, batch);
}

static int cuda_step(struct device_model *dm, mlp_grad_ready_fn cb, void *arg, float *loss) {
  struct cuda_model *cm = cuda_of(dm);
  int batch = dm->loaded, r = cuda_enter(cm);
  bool copies = cb != NULL;
  cudaGraphExec_t g;

  *loss = NAN;
  if (r < 0) return r;
  if (cm->eager)
    r = enqueue_step(cm, batch, copies, false);
  else if ((r = step_graph(cm, batch, copies, &g)) == 0)
    r = cuda_check(cm, cudaGraphLaunch(g, cm->compute), "cudaGraphLaunch(step)");
  if (r < 0) return r;
  for (int t = cm->nt - 1; copies && t >= 0; t--) {
    if ((r = cuda_check(cm, cudaEventSynchronize(cm->copied[t]), "step (gradient copy)")) < 0)
      return r;
    if (!cm->registered)
      memcpy(mlp_grad(dm->host, t), cm->h_grads_stage + cm->off[t], cm->count[t] * sizeof(float));
    cb(t, cm->count[t], arg);
  }
  if ((r = cuda_check(cm, cudaStreamSynchronize(cm->compute), "step")) < 0) return r;
  double total = 0.0;
  for (int k = 0; k < batch; k++) total += cm->h_row_loss[k];
  *loss = (float)(total / batch);
  return 0;
}

static int cuda_evaluate(struct device_model *dm, const struct dataset *ds, const uint32_t *idx,
                         int n, double *loss_sum, int *correct) {
  struct cuda_model *cm = cuda_of(dm);
  const int *s = dm->sizes;
  int L = cm->layers, r = cuda_enter(cm);

  if (r < 0 || (r = stage_input(cm, ds, idx, n)) < 0 ||
      (r = kernel_check(
           cm,
           kernels_pixels_to_float(cm->compute, cm->x_bytes, cm->act[0], (size_t)n * (size_t)s[0]),
           "input kernel")) < 0 ||
      (r = enqueue_forward(cm, n)) < 0 ||
      (r = kernel_check(cm,
                        kernels_softmax_xent(cm->compute, cm->act[L], cm->y, n, s[L], 0.0f, NULL,
                                             cm->row_loss, cm->row_correct),
                        "softmax cross-entropy kernel")) < 0 ||
      (r = cuda_check(cm,
                      cudaMemcpyAsync(cm->h_row_loss, cm->row_loss, (size_t)n * sizeof(float),
                                      cudaMemcpyDeviceToHost, cm->compute),
                      "cudaMemcpyAsync(loss to host)")) < 0 ||
      (r = cuda_check(cm,
                      cudaMemcpyAsync(cm->h_row_correct, cm->row_correct, (size_t)n * sizeof(int),
                                      cudaMemcpyDeviceToHost, cm->compute),
                      "cudaMemcpyAsync(hits to host)")) < 0 ||
      (r = cuda_check(cm, cudaStreamSynchronize(cm->compute), "evaluate")) < 0)
    return r;
  for (int k = 0; k < n; k++) {
    *loss_sum += cm->h_row_loss[k];
    *correct += cm->h_row_correct[k];
  }
  return 0;
}

static int cuda_sgd_step(struct device_model *dm, float lr) {
  struct cuda_model *cm = cuda_of(dm);
  int r = cuda_enter(cm);

  if (r < 0) return r;
  return kernel_check(cm, kernels_sgd(cm->compute, cm->params, cm->grads, cm->total, lr),
                      "SGD kernel");
}

static const struct device_model_ops cuda_ops = {
    .close = cuda_close,
    .load_params = cuda_load_params,
    .store_params = cuda_store_params,
    .load_batch = cuda_load_batch,
    .step = cuda_step,
    .evaluate = cuda_evaluate,
    .sgd_step = cuda_sgd_step,
};

int device_cuda_open(const struct device_opts *o, const int *sizes, int num_sizes, int max_batch,
                     struct device_model **out, char *err, size_t errlen) {
  struct cuda_model *cm = calloc(1, sizeof(*cm));
  struct cudaDeviceProp prop;
  int count = 0, r;

  *out = NULL;
  if (cm == NULL) {
    if (errlen) snprintf(err, errlen, "out of memory");
    return -ENOMEM;
  }
  device_model_init_base(&cm->base, &cuda_ops, DEVICE_CUDA, sizes, num_sizes, max_batch);
  cm->eager = o->eager;
  cm->layers = num_sizes - 1;
  cm->nt = 2 * cm->layers;
  cudaError_t e = cudaGetDeviceCount(&count);
  if (e == cudaErrorInsufficientDriver) {
    /* What the runtime says when libcuda.so.1 is missing altogether, too. */
    r = device_fail(&cm->base, -ENODEV,
                    "no usable CUDA device: no NVIDIA driver found, or one older than this "
                    "CUDA %d.%d runtime (cudaErrorInsufficientDriver)",
                    CUDART_VERSION / 1000, CUDART_VERSION % 1000 / 10);
    goto fail;
  }
  if (e != cudaSuccess) {
    cuda_check(cm, e, "no usable CUDA device");
    r = -ENODEV; /* whatever the reason (no device, busy, ...), CUDA is not there */
    goto fail;
  }
  if (count < 1 || o->gpu < 0) {
    r = device_fail(&cm->base, -ENODEV, "no usable CUDA device (%d visible)", count);
    goto fail;
  }
  cm->gpu = o->gpu % count;
  if ((r = cuda_check(cm, cudaSetDevice(cm->gpu), "cudaSetDevice")) < 0 ||
      (r = cuda_check(cm, cudaGetDeviceProperties(&prop, cm->gpu), "cudaGetDeviceProperties")) < 0)
    goto fail;
  snprintf(cm->base.name, sizeof(cm->base.name), "cuda:%d %.96s (sm_%d%d, %.0f GiB)%s", cm->gpu,
           prop.name, prop.major, prop.minor, (double)prop.totalGlobalMem / (1 << 30),
           o->eager ? " eager" : "");
  /* The mirror only holds parameters and gradients: no activations needed. */
  cm->base.host = mlp_new(sizes, num_sizes, 1);
  if (cm->base.host == NULL) {
    r = device_fail(&cm->base, -ENOMEM, "out of memory for the host parameters");
    goto fail;
  }
  plan_tensors(cm);
  pin_mirror(cm);
  if (!cm->registered) {
    size_t len = strlen(cm->base.name);
    snprintf(cm->base.name + len, sizeof(cm->base.name) - len, " staged");
  }
  if ((r = load_cublas(cm)) < 0 || (r = alloc_buffers(cm)) < 0 || (r = create_streams(cm)) < 0 ||
      (r = cuda_check(cm, cudaDeviceSynchronize(), "cudaDeviceSynchronize")) < 0)
    goto fail;
  *out = &cm->base;
  return 0;

fail:
  if (errlen) snprintf(err, errlen, "%s", cm->base.err);
  cuda_close(&cm->base);
  return r;
}
