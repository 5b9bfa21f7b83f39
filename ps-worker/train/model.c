/* model: MLP forward/backward on CBLAS.
 *
 * Memory: one 64-byte-aligned float block holds, in order, the parameters, the
 * gradients, and per layer output l (1..L) an activation buffer act[l] and an
 * error buffer delta[l] of max_batch * sizes[l] floats. Each piece starts on a
 * 64-byte boundary so the element-wise loops vectorise without peeling
 * surprises. act[0] is the caller's input, borrowed for the duration of a call.
 *
 * Forward for layer l (W: [out][in], a: [batch][in]):
 *   z = a W^T + b     one sgemm onto rows pre-filled with b (beta = 1)
 *   act = relu(z)     except for the last layer, whose act holds the logits
 * Only the post-ReLU value is kept: relu'(z) = (z > 0) = (act > 0).
 *
 * Backward walks layers from the last down; with d = dLoss/dz of layer l:
 *   db = column sums of d            -> gradient of tensor 2l+1 final, callback
 *   dW = d^T a                        -> gradient of tensor 2l final, callback
 *   d_prev = (d W) * (act_prev > 0)   skipped for layer 0 (no input gradient)
 * so the last layer's gradients can go on the wire while the rest of backward
 * still runs. BLAS threading is left to the caller (OPENBLAS_NUM_THREADS): on
 * the 2-core machines here (docs/ARCHITECTURE.md, Pitfalls) several processes share the cores. */
#include "model.h"

#include <cblas.h>
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "errbuf.h"
#include "tensor_math.h"

#define ALIGN_FLOATS 16 /* 64 bytes */

struct mlp_tensor {
  char name[32];
  uint32_t dims[2];
  int ndim;
  size_t count;
  float *param;
  float *grad;
};

struct mlp {
  int num_layers; /* L = num_sizes - 1 */
  int max_batch;
  int sizes[MLP_MAX_SIZES];
  struct mlp_tensor tensors[2 * (MLP_MAX_SIZES - 1)];
  float *block;
  const float *act[MLP_MAX_SIZES]; /* act[0] borrowed from the caller */
  float *act_buf[MLP_MAX_SIZES];
  float *delta[MLP_MAX_SIZES];
  int grad_blocks;                         /* row blocks of tensor 0's gradient, 0 = one */
  int grad_block_end[MLP_MAX_GRAD_BLOCKS]; /* last row + 1 of each */
};

int mlp_parse_spec(const char *spec, int *sizes, int max_sizes, int *num_sizes, char *err,
                   size_t errlen) {
  static const char prefix[] = "mlp:";
  const char *p;
  int count = 0;

  *num_sizes = 0;
  if (spec == NULL || strncmp(spec, prefix, sizeof(prefix) - 1) != 0) {
    errbuf_set(0, err, errlen, "model spec \"%s\": must start with \"mlp:\" (e.g. mlp:784-256-10)",
               spec ? spec : "(null)");
    return -EINVAL;
  }
  p = spec + sizeof(prefix) - 1;
  for (;;) {
    long v = 0;
    const char *start = p;

    /* Digits only, parsed by hand: strtol would accept spaces, signs and "0x". */
    while (*p >= '0' && *p <= '9') {
      if (v <= MLP_MAX_LAYER_SIZE) v = v * 10 + (*p - '0');
      p++;
    }
    if (p == start) {
      errbuf_set(0, err, errlen, "model spec \"%s\": expected a layer size at offset %d", spec,
                 (int)(start - spec));
      return -EINVAL;
    }
    if (v < 1 || v > MLP_MAX_LAYER_SIZE) {
      errbuf_set(0, err, errlen, "model spec \"%s\": layer size %.*s outside 1..%d", spec,
                 (int)(p - start), start, MLP_MAX_LAYER_SIZE);
      return -EINVAL;
    }
    if (count >= max_sizes) {
      errbuf_set(0, err, errlen, "model spec \"%s\": more than %d layer sizes", spec, max_sizes);
      return -EINVAL;
    }
    sizes[count++] = (int)v;
    if (*p == '\0') break;
    if (*p != '-') {
      errbuf_set(0, err, errlen, "model spec \"%s\": unexpected '%c' at offset %d", spec, *p,
                 (int)(p - spec));
      return -EINVAL;
    }
    p++;
  }
  if (count < 2) {
    errbuf_set(0, err, errlen, "model spec \"%s\": needs at least an input and an output size",
               spec);
    return -EINVAL;
  }
  *num_sizes = count;
  return 0;
}

static size_t align_up(size_t n) {
  return (n + ALIGN_FLOATS - 1) / ALIGN_FLOATS * ALIGN_FLOATS;
}

struct mlp *mlp_new(const int *sizes, int num_sizes, int max_batch) {
  struct mlp *m = NULL;
  size_t total = 0, off = 0;
  int L;

  if (num_sizes < 2 || num_sizes > MLP_MAX_SIZES || max_batch < 1 || max_batch > MLP_MAX_BATCH)
    goto invalid;
  for (int i = 0; i < num_sizes; i++)
    if (sizes[i] < 1 || sizes[i] > MLP_MAX_LAYER_SIZE) goto invalid;

  m = calloc(1, sizeof(*m));
  if (m == NULL) return NULL;
  L = num_sizes - 1;
  m->num_layers = L;
  m->max_batch = max_batch;
  memcpy(m->sizes, sizes, sizeof(int) * (size_t)num_sizes);

  /* Sizes are bounded (2^16 units, 2^20 batch, 63 layers), so these sums of
   * products stay far below SIZE_MAX on a 64-bit size_t. */
  for (int l = 0; l < L; l++) {
    struct mlp_tensor *w = &m->tensors[2 * l], *b = &m->tensors[2 * l + 1];
    snprintf(w->name, sizeof(w->name), "fc%d.weight", l);
    snprintf(b->name, sizeof(b->name), "fc%d.bias", l);
    w->ndim = 2;
    w->dims[0] = (uint32_t)sizes[l + 1];
    w->dims[1] = (uint32_t)sizes[l];
    w->count = (size_t)sizes[l + 1] * (size_t)sizes[l];
    b->ndim = 1;
    b->dims[0] = (uint32_t)sizes[l + 1];
    b->count = (size_t)sizes[l + 1];
    total += 2 * (align_up(w->count) + align_up(b->count));
  }
  for (int l = 1; l <= L; l++) total += 2 * align_up((size_t)max_batch * (size_t)sizes[l]);

  m->block = aligned_alloc(ALIGN_FLOATS * sizeof(float), total * sizeof(float));
  if (m->block == NULL) {
    free(m);
    errno = ENOMEM;
    return NULL;
  }
  /* Zeroed so the padding between tensors is never NaN garbage and a model
   * used before mlp_init_params behaves deterministically. */
  memset(m->block, 0, total * sizeof(float));
  for (int i = 0; i < 2 * L; i++) {
    m->tensors[i].param = m->block + off;
    off += align_up(m->tensors[i].count);
  }
  for (int i = 0; i < 2 * L; i++) {
    m->tensors[i].grad = m->block + off;
    off += align_up(m->tensors[i].count);
  }
  for (int l = 1; l <= L; l++) {
    size_t n = align_up((size_t)max_batch * (size_t)sizes[l]);
    m->act_buf[l] = m->block + off;
    m->act[l] = m->act_buf[l];
    m->delta[l] = m->block + off + n;
    off += 2 * n;
  }
  return m;

invalid:
  errno = EINVAL;
  return NULL;
}

void mlp_free(struct mlp *m) {
  if (m == NULL) return;
  free(m->block);
  free(m);
}

int mlp_num_tensors(const struct mlp *m) {
  return 2 * m->num_layers;
}

static const struct mlp_tensor *tensor_at(const struct mlp *m, int i) {
  return i >= 0 && i < 2 * m->num_layers ? &m->tensors[i] : NULL;
}

const char *mlp_tensor_name(const struct mlp *m, int i) {
  const struct mlp_tensor *t = tensor_at(m, i);
  return t ? t->name : NULL;
}

size_t mlp_tensor_count(const struct mlp *m, int i) {
  const struct mlp_tensor *t = tensor_at(m, i);
  return t ? t->count : 0;
}

int mlp_tensor_shape(const struct mlp *m, int i, uint32_t dims[2]) {
  const struct mlp_tensor *t = tensor_at(m, i);

  if (t == NULL) return -EINVAL;
  dims[0] = t->dims[0];
  dims[1] = t->ndim > 1 ? t->dims[1] : 0;
  return t->ndim;
}

size_t mlp_num_params(const struct mlp *m) {
  size_t n = 0;

  for (int i = 0; i < 2 * m->num_layers; i++) n += m->tensors[i].count;
  return n;
}

float *mlp_param(struct mlp *m, int i) {
  return tensor_at(m, i) ? m->tensors[i].param : NULL;
}

float *mlp_grad(struct mlp *m, int i) {
  return tensor_at(m, i) ? m->tensors[i].grad : NULL;
}

/* Same generator as data.c's epoch order (specified in data.h); duplicated
 * rather than shared so each module stays free of the other. */
static uint64_t splitmix64_next(uint64_t *state) {
  uint64_t z = (*state += 0x9E3779B97F4A7C15ull);

  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

void mlp_init_params(struct mlp *m, uint64_t seed) {
  uint64_t state = seed;

  for (int i = 0; i < 2 * m->num_layers; i++) {
    struct mlp_tensor *t = &m->tensors[i];
    double bound = 1.0 / sqrt((double)m->sizes[i / 2]);

    for (size_t k = 0; k < t->count; k++) {
      double u = (double)(splitmix64_next(&state) >> 40) * 0x1p-24;
      t->param[k] = (float)((2.0 * u - 1.0) * bound);
    }
  }
}

static int labels_valid(const struct mlp *m, const uint8_t *y, int n) {
  int classes = m->sizes[m->num_layers];

  for (int i = 0; i < n; i++)
    if (y[i] >= classes) return 0;
  return 1;
}

/* Fills act[1..L] for `batch` rows of x. */
static void mlp_forward(struct mlp *m, const float *x, int batch) {
  int L = m->num_layers;

  m->act[0] = x;
  for (int l = 0; l < L; l++) {
    int in = m->sizes[l], out = m->sizes[l + 1];
    const float *w = m->tensors[2 * l].param, *b = m->tensors[2 * l + 1].param;
    float *z = m->act_buf[l + 1];

    for (int r = 0; r < batch; r++) memcpy(z + (size_t)r * out, b, sizeof(float) * (size_t)out);
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, batch, out, in, 1.0f, m->act[l], in, w, in,
                1.0f, z, out);
    /* tm_relu lets a NaN through, as torch does: divergence must show. */
    if (l + 1 < L) tm_relu(z, (size_t)batch * (size_t)out);
  }
}

/* Log-sum-exp: subtracting the row max keeps expf finite for any logits. */
double mlp_softmax_xent(const float *logits, const uint8_t *y, int batch, int classes,
                        float *dlogits, float scale, int *correct) {
  double total = 0.0;

  for (int r = 0; r < batch; r++) {
    const float *z = logits + (size_t)r * classes;
    float mx = z[0], sum = 0.0f;
    int arg = 0;

    for (int j = 1; j < classes; j++) {
      if (z[j] > mx) {
        mx = z[j];
        arg = j;
      }
    }
    if (dlogits != NULL) {
      float *d = dlogits + (size_t)r * classes;
      for (int j = 0; j < classes; j++) {
        d[j] = expf(z[j] - mx);
        sum += d[j];
      }
      float k = scale / sum;
      for (int j = 0; j < classes; j++) d[j] *= k;
      d[y[r]] -= scale;
    } else {
      for (int j = 0; j < classes; j++) sum += expf(z[j] - mx);
    }
    total += (double)mx + log((double)sum) - (double)z[y[r]];
    *correct += arg == y[r];
  }
  return total;
}

float mlp_forward_backward(struct mlp *m, const float *x, const uint8_t *y, int batch,
                           mlp_grad_ready_fn cb, void *arg) {
  int L = m->num_layers, correct = 0;
  double loss;

  if (batch < 1 || batch > m->max_batch || !labels_valid(m, y, batch)) return NAN;
  mlp_forward(m, x, batch);
  loss = mlp_softmax_xent(m->act_buf[L], y, batch, m->sizes[L], m->delta[L], 1.0f / (float)batch,
                          &correct);

  for (int l = L - 1; l >= 0; l--) {
    int in = m->sizes[l], out = m->sizes[l + 1];
    const float *d = m->delta[l + 1];
    struct mlp_tensor *w = &m->tensors[2 * l], *b = &m->tensors[2 * l + 1];

    memcpy(b->grad, d, sizeof(float) * (size_t)out);
    for (int r = 1; r < batch; r++) tm_add(b->grad, d + (size_t)r * out, (size_t)out);
    if (cb != NULL) cb(2 * l + 1, b->count, arg);

    if (l == 0 && m->grad_blocks > 0) {
      /* rows [r0, r1) of dW = columns [r0, r1) of d, transposed, times a */
      for (int i = 0, r0 = 0; i < m->grad_blocks; i++) {
        int r1 = m->grad_block_end[i];
        cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, r1 - r0, in, batch, 1.0f, d + r0, out,
                    m->act[0], in, 0.0f, w->grad + (size_t)r0 * in, in);
        if (cb != NULL && r1 < out) cb(0, (size_t)r1 * in, arg);
        r0 = r1;
      }
    } else {
      cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, out, in, batch, 1.0f, d, out, m->act[l],
                  in, 0.0f, w->grad, in);
    }
    if (cb != NULL) cb(2 * l, w->count, arg);

    if (l > 0) {
      float *dp = m->delta[l];

      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, batch, in, out, 1.0f, d, out, w->param,
                  in, 0.0f, dp, in);
      tm_relu_backward(dp, m->act[l], (size_t)batch * (size_t)in);
    }
  }
  m->act[0] = NULL; /* the caller's buffer is not ours to keep */
  return (float)(loss / batch);
}

int mlp_set_grad_blocks(struct mlp *m, const size_t *ends, int n) {
  int rows = m->sizes[1], in = m->sizes[0], ends_rows[MLP_MAX_GRAD_BLOCKS], k = 0;

  if (n < 0 || n > MLP_MAX_GRAD_BLOCKS || (n > 0 && ends == NULL)) return -EINVAL;
  for (int i = 0; i < n; i++) {
    if (ends[i] > m->tensors[0].count || (i > 0 && ends[i] <= ends[i - 1])) return -EINVAL;
    int r = (int)((ends[i] + (size_t)in - 1) / (size_t)in);
    if (r > 0 && (k == 0 || r > ends_rows[k - 1])) ends_rows[k++] = r;
  }
  if (k > 0 && ends_rows[k - 1] < rows) {
    if (k == MLP_MAX_GRAD_BLOCKS) return -EINVAL;
    ends_rows[k++] = rows; /* the rest of the tensor */
  }
  m->grad_blocks = k > 1 ? k : 0;
  memcpy(m->grad_block_end, ends_rows, sizeof(int) * (size_t)k);
  return 0;
}

void mlp_evaluate(struct mlp *m, const float *x, const uint8_t *y, int n, float *loss,
                  float *accuracy) {
  int L = m->num_layers, in = m->sizes[0], classes = m->sizes[L], correct = 0;
  double total = 0.0;

  if (n <= 0 || !labels_valid(m, y, n)) {
    *loss = NAN;
    *accuracy = NAN;
    return;
  }
  for (int start = 0; start < n; start += m->max_batch) {
    int batch = n - start < m->max_batch ? n - start : m->max_batch;

    mlp_forward(m, x + (size_t)start * in, batch);
    total += mlp_softmax_xent(m->act_buf[L], y + start, batch, classes, NULL, 0.0f, &correct);
  }
  m->act[0] = NULL;
  *loss = (float)(total / n);
  *accuracy = (float)correct / (float)n;
}

void mlp_sgd_step(struct mlp *m, float lr) {
  for (int i = 0; i < 2 * m->num_layers; i++) {
    float *p = m->tensors[i].param;
    const float *g = m->tensors[i].grad;
    size_t n = m->tensors[i].count;

    for (size_t k = 0; k < n; k++) p[k] -= lr * g[k];
  }
}
