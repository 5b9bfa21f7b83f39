/* model: a multi-layer perceptron trained on the CPU with CBLAS (float32).
 *
 * Layers are torch.nn.Linear (y = x W^T + b, W row-major [out][in]) with ReLU
 * between them and none after the last; the loss is softmax cross-entropy
 * averaged over the batch. The model is an ordered list of tensors
 *   fc0.weight [s1][s0], fc0.bias [s1], fc1.weight [s2][s1], fc1.bias [s2], ...
 * which is also the order of torch's model.parameters(), of the wire layout
 * and of --dump-params files, so buffers can be compared byte for byte.
 *
 * All memory (parameters, gradients, activations for max_batch samples) is
 * allocated once by mlp_new; training and evaluation never allocate. A model is
 * used by one thread at a time; the gradient callback runs on that thread. */
#ifndef PS_MODEL_H
#define PS_MODEL_H

#include <stddef.h>
#include <stdint.h>

#define MLP_MAX_SIZES 64         /* layer sizes in a spec, input and output included */
#define MLP_MAX_LAYER_SIZE 65536 /* units in one layer */
#define MLP_MAX_BATCH (1 << 20)

struct mlp;

/* Parses "mlp:784-256-10" into sizes[0..*num_sizes): at least 2 and at most
 * max_sizes decimal sizes, each 1..MLP_MAX_LAYER_SIZE, separated by '-', no
 * spaces or signs. Returns 0, or -EINVAL with a message naming the spec and the
 * problem in err (if errlen > 0). */
int mlp_parse_spec(const char *spec, int *sizes, int max_sizes, int *num_sizes, char *err,
                   size_t errlen);

/* Creates an MLP with layer sizes sizes[0..num_sizes) (input first) able to
 * process batches of up to max_batch samples. Parameters and gradients start
 * at zero (call mlp_init_params). Returns NULL with errno = EINVAL for bad
 * sizes (num_sizes outside 2..MLP_MAX_SIZES, a size outside
 * 1..MLP_MAX_LAYER_SIZE, max_batch outside 1..MLP_MAX_BATCH) or ENOMEM. */
struct mlp *mlp_new(const int *sizes, int num_sizes, int max_batch);
/* Accepts NULL. */
void mlp_free(struct mlp *m);

/* 2 * (num_sizes - 1): a weight and a bias per layer, in the order above. */
int mlp_num_tensors(const struct mlp *m);
/* "fc<k>.weight" / "fc<k>.bias"; NULL if i is out of range. */
const char *mlp_tensor_name(const struct mlp *m, int i);
/* Number of float elements of tensor i; 0 if i is out of range. */
size_t mlp_tensor_count(const struct mlp *m, int i);
/* Writes the shape of tensor i ([out, in] or [out]) and returns its number of
 * dimensions (2 or 1), or -EINVAL if i is out of range. */
int mlp_tensor_shape(const struct mlp *m, int i, uint32_t dims[2]);
/* Sum of mlp_tensor_count over all tensors. */
size_t mlp_num_params(const struct mlp *m);
/* Tensor i's values and gradient (mlp_tensor_count floats each, 64-byte
 * aligned, owned by m); NULL if i is out of range. Callers may write
 * parameters (pulled values, their own optimizer) between calls. */
float *mlp_param(struct mlp *m, int i);
float *mlp_grad(struct mlp *m, int i);

/* Initialises every parameter like torch.nn.Linear's default init: uniform
 * with bound = 1/sqrt(fan_in) (fan_in = the layer's input size, for the weight
 * and the bias). Exact algorithm, reproduced by tools/bench/ps-torch-ref:
 *   state = seed
 *   for each tensor in order, for each element in row-major order:
 *     r = splitmix64_next(&state)            (as in data.h)
 *     u = (double)(r >> 40) * 2^-24          (in [0, 1))
 *     value = (float)((2.0 * u - 1.0) * (1.0 / sqrt((double)fan_in)))
 * computed in double and rounded to float once. */
void mlp_init_params(struct mlp *m, uint64_t seed);

/* Called when the first `done` elements of a tensor's gradient are final:
 * once per tensor with done == its element count, and for tensor 0 (the
 * first layer's weight) also after each block set by mlp_set_grad_blocks. */
typedef void (*mlp_grad_ready_fn)(int tensor, size_t done, void *arg);

#define MLP_MAX_GRAD_BLOCKS 64

/* Tensor 0's gradient is the last one backward produces: nothing computed
 * after it can hide its sending. Computing it in row blocks lets the first
 * rows travel while the rest is computed. ends are element offsets into
 * tensor 0, increasing (each rounded up to a whole row, duplicates after
 * rounding dropped); n = 0 restores one block. Returns -EINVAL (nothing
 * changed) for n outside 0..MLP_MAX_GRAD_BLOCKS, or ends not increasing or
 * beyond the tensor. */
int mlp_set_grad_blocks(struct mlp *m, const size_t *ends, int n);

/* One training step's computation on x (batch rows of sizes[0] floats) and
 * labels y (each < the output size): forward, softmax cross-entropy, backward.
 * Returns the mean loss over the batch and leaves the gradient of that mean
 * loss in every mlp_grad buffer (overwritten, not accumulated). If cb is not
 * NULL it is called once per tensor with the whole tensor final, in decreasing
 * tensor order (last layer first, its bias before its weight), as soon as that
 * gradient is final: the caller may start sending it while earlier layers are
 * still computed; tensor 0 first gets one call per earlier block (increasing
 * done) when blocks are set. A
 * gradient buffer is not written again until the next call; parameters must
 * not change until this call returns. If batch is outside 1..max_batch or a
 * label is out of range, nothing is computed, cb is not called and NAN is
 * returned. */
float mlp_forward_backward(struct mlp *m, const float *x, const uint8_t *y, int batch,
                           mlp_grad_ready_fn cb, void *arg);

/* Forward only over n samples, max_batch at a time: *loss is the mean
 * cross-entropy and *accuracy the fraction whose arg-max logit (first one on
 * ties) equals the label. n <= 0 or a label out of range gives NAN for both. */
void mlp_evaluate(struct mlp *m, const float *x, const uint8_t *y, int n, float *loss,
                  float *accuracy);

/* Softmax cross-entropy of each of batch logits rows (classes floats)
 * against its label: returns the summed loss and adds the arg-max hits (first
 * one on ties) to *correct. If dlogits is not NULL it receives (softmax -
 * onehot) * scale, the gradient of scale * summed loss. Shared with mp_model.c
 * so that both compute the loss and its gradient with the same operations in
 * the same order. */
double mlp_softmax_xent(const float *logits, const uint8_t *y, int batch, int classes,
                        float *dlogits, float scale, int *correct);

/* Plain SGD on the local copy: param -= lr * grad for every tensor. */
void mlp_sgd_step(struct mlp *m, float lr);

#endif
