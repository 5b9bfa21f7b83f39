/* test_model: spec parsing, layout, init, gradients, callbacks, evaluation and
 * SGD of the CBLAS MLP.
 *
 * Gradients are checked against central differences of an independent
 * double-precision forward pass written here (h = 1e-5 in double): far more
 * precise than differencing the float model with a large step, and it also
 * checks that the model's own forward loss matches the reference. The init
 * values hard-coded below were computed once by a plain Python transcription of
 * model.h's algorithm; they lock the C code and tools/bench/ps-torch-ref together.
 * Exit 0 pass, 1 fail. */
#include "model.h"

#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "check.h"

/* Test data generator, unrelated to the model's own splitmix64 use. */
static uint64_t rng_state = 12345;

static double rng_uniform(void) { /* [-1, 1) */
  rng_state = rng_state * 6364136223846793005ull + 1442695040888963407ull;
  return (double)(rng_state >> 11) * 0x1p-53 * 2.0 - 1.0;
}

static void test_parse(void) {
  static const char *bad[] = {
      "",
      "mlp:",
      "mlp:784",
      "mlp:784-",
      "mlp:-784-10",
      "mlp:784--10",
      "mlp:784-0-10",
      "mlp:784-65537-10",
      "cnn:784-10",
      "mlp: 784-10",
      "mlp:784-+10",
      "mlp:784-10x",
      "MLP:784-10",
      "mlp:784-99999999999999999999-10",
  };
  int sizes[8], n = -1, rc;
  char err[256];

  rc = mlp_parse_spec("mlp:784-256-10", sizes, 8, &n, err, sizeof(err));
  CHECK(rc == 0 && n == 3 && sizes[0] == 784 && sizes[1] == 256 && sizes[2] == 10,
        "784-256-10: rc %d n %d", rc, n);
  rc = mlp_parse_spec("mlp:784-512-256-10", sizes, 8, &n, err, sizeof(err));
  CHECK(rc == 0 && n == 4 && sizes[1] == 512 && sizes[3] == 10, "784-512-256-10: rc %d", rc);
  rc = mlp_parse_spec("mlp:65536-1", sizes, 8, &n, err, sizeof(err));
  CHECK(rc == 0 && n == 2 && sizes[0] == 65536 && sizes[1] == 1, "65536-1: rc %d", rc);
  rc = mlp_parse_spec("mlp:0010-2", sizes, 8, &n, err, sizeof(err));
  CHECK(rc == 0 && sizes[0] == 10, "leading zeros: rc %d", rc);

  for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
    err[0] = '\0';
    n = -1;
    rc = mlp_parse_spec(bad[i], sizes, 8, &n, err, sizeof(err));
    CHECK(rc == -EINVAL, "\"%s\" accepted (rc %d)", bad[i], rc);
    CHECK(n == 0, "\"%s\": num_sizes %d after failure", bad[i], n);
    CHECK(strstr(err, bad[i]) != NULL, "\"%s\": message \"%s\" does not quote the spec", bad[i],
          err);
  }
  rc = mlp_parse_spec("mlp:1-2-3-4", sizes, 3, &n, err, sizeof(err));
  CHECK(rc == -EINVAL && strstr(err, "more than 3") != NULL, "max_sizes: rc %d \"%s\"", rc, err);
  rc = mlp_parse_spec(NULL, sizes, 3, &n, err, sizeof(err));
  CHECK(rc == -EINVAL, "NULL spec: rc %d", rc);
  rc = mlp_parse_spec("mlp:1", sizes, 3, &n, NULL, 0); /* no error buffer is fine */
  CHECK(rc == -EINVAL, "no err buffer: rc %d", rc);
}

static void test_layout(void) {
  static const int sizes[] = {7, 5, 4, 3};
  static const char *names[] = {"fc0.weight", "fc0.bias",   "fc1.weight",
                                "fc1.bias",   "fc2.weight", "fc2.bias"};
  static const size_t counts[] = {35, 5, 20, 4, 12, 3};
  struct mlp *m = mlp_new(sizes, 4, 4);
  uint32_t dims[2];
  static const int zero_size[] = {3, 0};

  CHECK(m != NULL, "mlp_new failed");
  if (m == NULL) return;
  CHECK(mlp_num_tensors(m) == 6, "num_tensors %d", mlp_num_tensors(m));
  CHECK(mlp_num_params(m) == 79, "num_params %zu", mlp_num_params(m));
  for (int i = 0; i < 6; i++) {
    CHECK(strcmp(mlp_tensor_name(m, i), names[i]) == 0, "name %d: %s", i, mlp_tensor_name(m, i));
    CHECK(mlp_tensor_count(m, i) == counts[i], "count %d: %zu", i, mlp_tensor_count(m, i));
    CHECK(mlp_param(m, i) != NULL && mlp_grad(m, i) != NULL, "buffers %d", i);
    CHECK(((uintptr_t)mlp_param(m, i) & 63) == 0, "param %d not 64-byte aligned", i);
    CHECK(mlp_param(m, i)[0] == 0.0f && mlp_grad(m, i)[0] == 0.0f, "not zeroed %d", i);
  }
  CHECK(mlp_tensor_shape(m, 2, dims) == 2 && dims[0] == 4 && dims[1] == 5, "fc1.weight shape");
  CHECK(mlp_tensor_shape(m, 5, dims) == 1 && dims[0] == 3, "fc2.bias shape");
  CHECK(mlp_tensor_name(m, 6) == NULL && mlp_tensor_name(m, -1) == NULL, "name out of range");
  CHECK(mlp_tensor_count(m, 6) == 0 && mlp_param(m, 6) == NULL && mlp_grad(m, -1) == NULL,
        "out of range");
  CHECK(mlp_tensor_shape(m, 6, dims) == -EINVAL, "shape out of range");
  mlp_free(m);
  mlp_free(NULL);

  errno = 0;
  CHECK(mlp_new(sizes, 1, 4) == NULL && errno == EINVAL, "one size accepted");
  CHECK(mlp_new(sizes, 4, 0) == NULL && errno == EINVAL, "max_batch 0 accepted");
  CHECK(mlp_new(zero_size, 2, 4) == NULL && errno == EINVAL, "size 0 accepted");
}

static void test_init(void) {
  static const int sizes[] = {7, 5, 4, 3};
  static const int big_sizes[] = {400, 300, 10};
  /* Python: first 4 of fc0.weight and all of fc2.bias for seed 1. */
  static const float want_w0[4] = {0x1.9c2fd6p-5f, 0x1.7c815p-3f, 0x1.6c96f2p-2f, -0x1.588f46p-5f};
  static const float want_b2[3] = {0x1.fbd96p-4f, 0x1.70cc8p-2f, 0x1.39168cp-2f};
  struct mlp *a = mlp_new(sizes, 4, 2), *b = mlp_new(sizes, 4, 2);
  struct mlp *big = mlp_new(big_sizes, 3, 1);
  int same = 1, differs = 0;

  if (a == NULL || b == NULL || big == NULL) {
    CHECK(0, "mlp_new failed");
    goto cleanup;
  }
  mlp_init_params(a, 1);
  mlp_init_params(b, 1);
  for (int i = 0; i < 6; i++)
    same &= memcmp(mlp_param(a, i), mlp_param(b, i), mlp_tensor_count(a, i) * 4) == 0;
  CHECK(same, "same seed gives different parameters");
  CHECK(memcmp(mlp_param(a, 0), want_w0, sizeof(want_w0)) == 0,
        "fc0.weight head %a %a differs from the Python values", mlp_param(a, 0)[0],
        mlp_param(a, 0)[1]);
  CHECK(memcmp(mlp_param(a, 5), want_b2, sizeof(want_b2)) == 0,
        "fc2.bias %a differs from the Python values", mlp_param(a, 5)[0]);
  mlp_init_params(b, 2);
  for (int i = 0; i < 6; i++)
    differs += memcmp(mlp_param(a, i), mlp_param(b, i), mlp_tensor_count(a, i) * 4) != 0;
  CHECK(differs == 6, "seeds 1 and 2 share %d tensors", 6 - differs);

  mlp_init_params(big, 99);
  for (int i = 0; i < 4; i++) {
    float bound = (float)(1.0 / sqrt((double)big_sizes[i / 2]));
    const float *p = mlp_param(big, i);
    size_t n = mlp_tensor_count(big, i);
    double sum = 0.0, mx = 0.0;

    for (size_t k = 0; k < n; k++) {
      CHECK(fabsf(p[k]) <= bound, "tensor %d element %zu = %g outside +-%g", i, k, p[k], bound);
      sum += p[k];
      mx = fabs(p[k]) > mx ? fabs(p[k]) : mx;
    }
    /* Uniform on [-bound, bound): mean ~ 0 (sd bound/sqrt(3n)), extremes near bound. */
    CHECK(fabs(sum / n) < 5.0 * bound / sqrt(3.0 * n), "tensor %d mean %g", i, sum / n);
    if (n >= 300) CHECK(mx > 0.95 * bound, "tensor %d max |v| %g of %g", i, mx, bound);
  }

cleanup:
  mlp_free(a);
  mlp_free(b);
  mlp_free(big);
}

/* Double-precision reference: mean softmax cross-entropy of an MLP whose
 * tensors are given in model order in p[]. */
static double ref_loss(const int *sizes, int num_sizes, double *const *p, const double *x,
                       const uint8_t *y, int batch, int *pred) {
  double act[2][64], total = 0.0;

  for (int r = 0; r < batch; r++) {
    const double *in = x + (size_t)r * sizes[0];
    double *out = NULL;

    for (int l = 0; l + 1 < num_sizes; l++) {
      out = act[l & 1];
      for (int j = 0; j < sizes[l + 1]; j++) {
        double z = p[2 * l + 1][j];
        for (int k = 0; k < sizes[l]; k++) z += p[2 * l][j * sizes[l] + k] * in[k];
        out[j] = l + 2 < num_sizes && z < 0.0 ? 0.0 : z;
      }
      in = out;
    }
    int classes = sizes[num_sizes - 1], arg = 0;
    double mx = out[0], s = 0.0;
    for (int j = 1; j < classes; j++)
      if (out[j] > mx) {
        mx = out[j];
        arg = j;
      }
    for (int j = 0; j < classes; j++) s += exp(out[j] - mx);
    total += mx + log(s) - out[y[r]];
    if (pred != NULL) pred[r] = arg;
  }
  return total / batch;
}

struct cb_log {
  struct mlp *m;
  int order[16];
  size_t done[16];
  int count;
  float *snap[16]; /* copies of each gradient taken inside the callback */
};

static void record_cb(int tensor, size_t done, void *arg) {
  struct cb_log *rec = arg;

  if (rec->count < 16) {
    rec->order[rec->count] = tensor;
    rec->done[rec->count] = done;
  }
  rec->count++;
  if (tensor >= 0 && tensor < 16 && rec->snap[tensor] != NULL)
    memcpy(rec->snap[tensor], mlp_grad(rec->m, tensor),
           mlp_tensor_count(rec->m, tensor) * sizeof(float));
}

static void test_gradients(void) {
  enum { B = 4, NS = 4 };
  static const int sizes[NS] = {7, 5, 4, 3};
  static const uint8_t y[B] = {0, 2, 1, 2};
  struct mlp *m = mlp_new(sizes, NS, B);
  float x[B * 7];
  double xd[B * 7], *p[6] = {0};
  struct cb_log rec = {0};
  float loss, loss2;
  double ref, worst = 0.0;
  int checked = 0, active = 0;

  if (m == NULL) {
    CHECK(0, "mlp_new failed");
    return;
  }
  mlp_init_params(m, 3);
  /* Bigger weights than the default init so the loss is far from log(3) and
   * the gradients are not tiny. */
  for (int i = 0; i < 6; i++)
    for (size_t k = 0; k < mlp_tensor_count(m, i); k++) mlp_param(m, i)[k] *= 3.0f;
  for (int k = 0; k < B * 7; k++) xd[k] = x[k] = (float)rng_uniform();
  rec.m = m;
  for (int i = 0; i < 6; i++) {
    size_t n = mlp_tensor_count(m, i);
    p[i] = malloc(n * sizeof(double));
    rec.snap[i] = malloc(n * sizeof(float));
    if (p[i] == NULL || rec.snap[i] == NULL) {
      CHECK(0, "out of memory");
      goto cleanup;
    }
    for (size_t k = 0; k < n; k++) p[i][k] = mlp_param(m, i)[k];
  }

  loss = mlp_forward_backward(m, x, y, B, record_cb, &rec);
  ref = ref_loss(sizes, NS, p, xd, y, B, NULL);
  CHECK(fabs(loss - ref) < 1e-5 * (1.0 + fabs(ref)), "loss %.8g, reference %.8g", loss, ref);
  CHECK(fabs(ref - log(3.0)) > 0.05, "degenerate test: loss %g ~ log(3)", ref);

  /* Callback: once per tensor, last layer first, gradient already final. */
  CHECK(rec.count == 6, "callback called %d times", rec.count);
  for (int i = 0; i < 6 && i < rec.count; i++) {
    CHECK(rec.order[i] == 5 - i, "callback %d was for tensor %d, want %d", i, rec.order[i], 5 - i);
    CHECK(rec.done[i] == mlp_tensor_count(m, 5 - i), "callback %d: done %zu", i, rec.done[i]);
  }
  for (int i = 0; i < 6; i++)
    CHECK(memcmp(rec.snap[i], mlp_grad(m, i), mlp_tensor_count(m, i) * sizeof(float)) == 0,
          "gradient of tensor %d changed after its callback", i);

  for (int i = 0; i < 6; i++) {
    for (size_t k = 0; k < mlp_tensor_count(m, i); k++) {
      const double h = 1e-5;
      double save = p[i][k], num, ana = mlp_grad(m, i)[k];

      p[i][k] = save + h;
      num = ref_loss(sizes, NS, p, xd, y, B, NULL);
      p[i][k] = save - h;
      num = (num - ref_loss(sizes, NS, p, xd, y, B, NULL)) / (2.0 * h);
      p[i][k] = save;
      double e = fabs(ana - num) / (fabs(num) + 1e-3);
      worst = e > worst ? e : worst;
      CHECK(fabs(ana - num) <= 2e-3 * fabs(num) + 2e-5, "%s[%zu]: analytic %.7g numeric %.7g",
            mlp_tensor_name(m, i), k, ana, num);
      checked++;
      active += fabs(num) > 1e-4;
    }
  }
  CHECK(active > checked / 2, "only %d of %d gradients are non-zero", active, checked);
  printf("gradient check: %d elements (%d non-zero), worst relative error %.2e\n", checked, active,
         worst);

  /* Gradients are overwritten, not accumulated; no callback is fine. */
  loss2 = mlp_forward_backward(m, x, y, B, NULL, NULL);
  CHECK(loss2 == loss, "second call gives loss %g, first %g", loss2, loss);
  for (int i = 0; i < 6; i++)
    CHECK(memcmp(rec.snap[i], mlp_grad(m, i), mlp_tensor_count(m, i) * sizeof(float)) == 0,
          "gradient of tensor %d differs on the second call", i);

  /* A smaller batch than max_batch uses only its rows. */
  loss = mlp_forward_backward(m, x, y, 1, NULL, NULL);
  ref = ref_loss(sizes, NS, p, xd, y, 1, NULL);
  CHECK(fabs(loss - ref) < 1e-5 * (1.0 + fabs(ref)), "batch 1: loss %g, reference %g", loss, ref);

  /* Bad input: nothing computed, no callback. */
  {
    uint8_t bad_y[B] = {0, 3, 1, 2};
    rec.count = 0;
    CHECK(isnan(mlp_forward_backward(m, x, bad_y, B, record_cb, &rec)), "label 3 of 3 accepted");
    CHECK(isnan(mlp_forward_backward(m, x, y, B + 1, record_cb, &rec)), "batch > max accepted");
    CHECK(isnan(mlp_forward_backward(m, x, y, 0, record_cb, &rec)), "batch 0 accepted");
    CHECK(rec.count == 0, "callback called on bad input");
  }

cleanup:
  for (int i = 0; i < 6; i++) {
    free(p[i]);
    free(rec.snap[i]);
  }
  mlp_free(m);
}

/* The first rows of tensor 0 (what `done` says) must be final at each
 * partial callback: snapshot them there, compare after the step. */
struct block_log {
  struct mlp *m;
  size_t done[8];
  int calls, early_wrong;
  float *snap;
};

static void block_cb(int tensor, size_t done, void *arg) {
  struct block_log *b = arg;

  if (tensor != 0) return;
  if (b->calls < 8) b->done[b->calls] = done;
  b->calls++;
  if (done < mlp_tensor_count(b->m, 0)) memcpy(b->snap, mlp_grad(b->m, 0), done * sizeof(float));
}

static void test_grad_blocks(void) {
  enum { B = 6, IN = 5, H = 7 };
  static const int sizes[3] = {IN, H, 3};
  static const uint8_t y[B] = {0, 2, 1, 2, 1, 0};
  struct mlp *m = mlp_new(sizes, 3, B), *ref = mlp_new(sizes, 3, B);
  float x[B * IN], want[H * IN];
  struct block_log b = {.m = m};

  b.snap = malloc(sizeof(want));
  if (m == NULL || ref == NULL || b.snap == NULL) {
    CHECK(0, "out of memory");
    goto out;
  }
  mlp_init_params(m, 5);
  mlp_init_params(ref, 5);
  for (int k = 0; k < B * IN; k++) x[k] = (float)rng_uniform();
  mlp_forward_backward(ref, x, y, B, NULL, NULL);
  memcpy(want, mlp_grad(ref, 0), sizeof(want));

  /* Offsets mid-row round up to whole rows: 3 -> row 1, 11 -> row 3, 12 -> row 3
   * (dropped as a duplicate); the rest of the tensor is a last block. */
  static const size_t ends[3] = {3, 11, 12};
  CHECK(mlp_set_grad_blocks(m, ends, 3) == 0, "blocks refused");
  mlp_forward_backward(m, x, y, B, block_cb, &b);
  CHECK(b.calls == 3, "%d callbacks for tensor 0, want 3", b.calls);
  static const size_t want_done[3] = {1 * IN, 3 * IN, H * IN};
  for (int i = 0; i < 3 && i < b.calls; i++)
    CHECK(b.done[i] == want_done[i], "callback %d: done %zu, want %zu", i, b.done[i], want_done[i]);
  for (int k = 0; k < 3 * IN; k++)
    CHECK(b.snap[k] == mlp_grad(m, 0)[k], "element %d changed after its block was final", k);
  for (int k = 0; k < H * IN; k++)
    CHECK(fabsf(mlp_grad(m, 0)[k] - want[k]) <= 1e-6f * (1.0f + fabsf(want[k])),
          "blocked gradient %d: %g, whole %g", k, (double)mlp_grad(m, 0)[k], (double)want[k]);

  /* Refused, nothing changed: not increasing, past the end, too many. */
  static const size_t down[2] = {10, 5}, past[1] = {H * IN + 1};
  CHECK(mlp_set_grad_blocks(m, down, 2) == -EINVAL, "decreasing ends accepted");
  CHECK(mlp_set_grad_blocks(m, past, 1) == -EINVAL, "end past the tensor accepted");
  CHECK(mlp_set_grad_blocks(m, ends, MLP_MAX_GRAD_BLOCKS + 1) == -EINVAL, "too many accepted");
  b.calls = 0;
  mlp_forward_backward(m, x, y, B, block_cb, &b);
  CHECK(b.calls == 3, "a refused setting changed the blocks (%d callbacks)", b.calls);
  CHECK(mlp_set_grad_blocks(m, NULL, 0) == 0, "n = 0 refused");
  b.calls = 0;
  mlp_forward_backward(m, x, y, B, block_cb, &b);
  CHECK(b.calls == 1 && b.done[0] == H * IN, "after n = 0: %d callbacks", b.calls);
out:
  free(b.snap);
  mlp_free(m);
  mlp_free(ref);
}

static void test_evaluate(void) {
  enum { N = 10, NS = 3 };
  static const int sizes[NS] = {6, 8, 4};
  struct mlp *m = mlp_new(sizes, NS, 4); /* N is not a multiple of max_batch */
  float x[N * 6], loss, acc;
  double xd[N * 6], *p[4] = {0}, ref;
  uint8_t y[N];
  int pred[N], correct = 0;

  if (m == NULL) {
    CHECK(0, "mlp_new failed");
    return;
  }
  mlp_init_params(m, 11);
  for (int k = 0; k < N * 6; k++) xd[k] = x[k] = (float)rng_uniform();
  for (int i = 0; i < N; i++) y[i] = (uint8_t)(i % 4);
  for (int i = 0; i < 4; i++) {
    p[i] = malloc(mlp_tensor_count(m, i) * sizeof(double));
    if (p[i] == NULL) {
      CHECK(0, "out of memory");
      goto cleanup;
    }
    for (size_t k = 0; k < mlp_tensor_count(m, i); k++) p[i][k] = mlp_param(m, i)[k];
  }
  ref = ref_loss(sizes, NS, p, xd, y, N, pred);
  for (int i = 0; i < N; i++) correct += pred[i] == y[i];
  mlp_evaluate(m, x, y, N, &loss, &acc);
  CHECK(fabs(loss - ref) < 1e-5 * (1.0 + ref), "evaluate loss %g, reference %g", loss, ref);
  CHECK(acc == (float)correct / N, "evaluate accuracy %g, reference %g", acc, (double)correct / N);
  mlp_evaluate(m, x, y, 0, &loss, &acc);
  CHECK(isnan(loss) && isnan(acc), "n = 0 gives %g %g", loss, acc);

  /* All-zero parameters: every logit ties, arg-max is class 0 (as torch's). */
  for (int i = 0; i < 4; i++) memset(mlp_param(m, i), 0, mlp_tensor_count(m, i) * sizeof(float));
  mlp_evaluate(m, x, y, N, &loss, &acc);
  CHECK(fabsf(loss - logf(4.0f)) < 1e-6f, "zero model loss %g, want log 4", loss);
  CHECK(acc == 0.3f, "zero model accuracy %g, want 0.3 (labels 0 of 0..3 cycling)", acc);

cleanup:
  for (int i = 0; i < 4; i++) free(p[i]);
  mlp_free(m);
}

/* Two classes split by the line x0 + x1 = 0: a few SGD steps must learn it. */
static void test_sgd(void) {
  enum { N = 64 };
  static const int sizes[] = {2, 16, 2};
  struct mlp *m = mlp_new(sizes, 3, N);
  float x[N * 2], first = 0.0f, last = 0.0f, loss, acc;
  uint8_t y[N];

  if (m == NULL) {
    CHECK(0, "mlp_new failed");
    return;
  }
  mlp_init_params(m, 5);
  for (int i = 0; i < N; i++) {
    x[2 * i] = (float)rng_uniform();
    x[2 * i + 1] = (float)rng_uniform();
    y[i] = x[2 * i] + x[2 * i + 1] > 0.0f;
  }
  for (int step = 0; step < 200; step++) {
    last = mlp_forward_backward(m, x, y, N, NULL, NULL);
    if (step == 0) first = last;
    mlp_sgd_step(m, 0.5f);
  }
  mlp_evaluate(m, x, y, N, &loss, &acc);
  printf("sgd: loss %.4f -> %.4f, accuracy %.3f\n", first, loss, acc);
  CHECK(loss < 0.5f * first, "loss %g -> %g: not learning", first, loss);
  CHECK(acc >= 0.95f, "accuracy %g on a separable problem", acc);
  mlp_free(m);
}

int main(void) {
  test_parse();
  test_layout();
  test_init();
  test_gradients();
  test_grad_blocks();
  test_evaluate();
  test_sgd();
  if (failures) {
    fprintf(stderr, "test_model: %d check(s) failed\n", failures);
    return 1;
  }
  printf("test_model: all checks passed\n");
  return 0;
}
