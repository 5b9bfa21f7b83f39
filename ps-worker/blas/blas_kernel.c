/* blas_kernel: choosing OpenBLAS's kernel (blas_kernel.h). Two halves:
 *  - the pure decision (blas_kernel_impl.h): the table of kernels with the
 *    features each needs and its rank, the parser of a choice, and
 *    blas_plan_make, which turns (choice, CPU, what the process sees) into
 *    a plan; tests/unit/test_blas_kernel drives it with fake CPUs;
 *  - the process: the CPU read by blas_cpu_detect, OpenBLAS found with
 *    dlsym(RTLD_DEFAULT) (never linked: a program without it is left
 *    alone), the re-execution, and one timed sgemm through the program's
 *    own cblas_sgemm.
 *
 * The guard. Before the exec, PS_BLAS_REEXEC is set to "PID:WHY:WAS" (WHY
 * auto or user, WAS the kernel OpenBLAS had picked). execv keeps the pid,
 * so the new image recognises itself by the pid and never execs again; a
 * child process that inherits the variable has another pid and decides
 * afresh (and then finds OPENBLAS_CORETYPE set: a user's choice to it). */
#include "blas_kernel.h"

#include <dlfcn.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <unistd.h>

#include "blas_kernel_impl.h"
#include "clock.h"
#include "errbuf.h"
#include "log.h"

#define GUARD_VAR "PS_BLAS_REEXEC"
#define CORETYPE_VAR "OPENBLAS_CORETYPE"

/* ---- the table --------------------------------------------------------- */

static const char *const feature_names[BLAS_NUM_FEATURES] = {
    "SSE2", "SSE3", "SSSE3",   "SSE4.1",   "SSE4.2",   "SSE4a",    "AVX",      "FMA",
    "FMA4", "AVX2", "AVX512F", "AVX512DQ", "AVX512CD", "AVX512BW", "AVX512VL", "AVX512_BF16",
};

const char *blas_feature_name(int bit) {
  return bit >= 0 && bit < BLAS_NUM_FEATURES ? feature_names[bit] : "?";
}

/* Each set includes what the ones below it imply: OpenBLAS compiles a
 * kernel's C code for its CPU (-mavx2, -march=skylake-avx512, ...), so the
 * compiler may use any of them. */
#define F_SSE3 (BLAS_SSE2 | BLAS_SSE3)
#define F_SSSE3 (F_SSE3 | BLAS_SSSE3)
#define F_SSE41 (F_SSSE3 | BLAS_SSE41)
#define F_SSE42 (F_SSE41 | BLAS_SSE42)
#define F_AVX (F_SSE42 | BLAS_AVX)
#define F_AMD15H (F_AVX | BLAS_SSE4A | BLAS_FMA4)
#define F_HASWELL (F_AVX | BLAS_FMA3 | BLAS_AVX2)
#define F_SKYLAKEX \
  (F_HASWELL | BLAS_AVX512F | BLAS_AVX512DQ | BLAS_AVX512CD | BLAS_AVX512BW | BLAS_AVX512VL)

static const struct kernel {
  const char *name;
  int rank;
  uint32_t needs;
} kernels[] = {
    {"Prescott", 0, F_SSE3},
    {"Atom", 0, F_SSSE3},
    {"Core2", 0, F_SSSE3},
    {"Penryn", 0, F_SSE41},
    {"Dunnington", 0, F_SSE41},
    {"Nehalem", 0, F_SSE42},
    {"Opteron", 0, BLAS_SSE2},
    {"Opteron_SSE3", 0, F_SSE3},
    {"Barcelona", 0, F_SSE3 | BLAS_SSE4A},
    {"Nano", 0, F_SSSE3},
    {"Bobcat", 0, F_SSSE3 | BLAS_SSE4A},
    {"Sandybridge", 1, F_AVX},
    {"Bulldozer", 1, F_AMD15H},
    {"Piledriver", 1, F_AMD15H | BLAS_FMA3},
    {"Steamroller", 1, F_AMD15H | BLAS_FMA3},
    /* AVX2: OpenBLAS runs it where it would otherwise run Haswell/Zen */
    {"Excavator", 2, F_AMD15H | BLAS_FMA3 | BLAS_AVX2},
    {"Haswell", 2, F_HASWELL},
    {"Zen", 2, F_HASWELL},
    {"SkylakeX", 3, F_SKYLAKEX},
    {"Cooperlake", 4, F_SKYLAKEX | BLAS_AVX512BF16},
};
#define NUM_KERNELS (sizeof(kernels) / sizeof(kernels[0]))

static const struct kernel *kernel_find(const char *name) {
  for (size_t i = 0; name && i < NUM_KERNELS; i++)
    if (strcasecmp(name, kernels[i].name) == 0) return &kernels[i];
  return NULL;
}

const char *blas_kernel_canonical(const char *name) {
  const struct kernel *k = kernel_find(name);
  return k ? k->name : NULL;
}

int blas_kernel_rank(const char *name) {
  const struct kernel *k = kernel_find(name);
  return k ? k->rank : -1;
}

bool blas_kernel_supported(const char *name, const struct blas_cpu *cpu, char *err, size_t errlen) {
  const struct kernel *k = kernel_find(name);
  if (!k) {
    errbuf_set(0, err, errlen, "%s is not an OpenBLAS x86_64 kernel", name);
    return false;
  }
  if (!cpu->x86_64) {
    errbuf_set(0, err, errlen, "%s is an x86_64 kernel and this CPU is not x86_64", k->name);
    return false;
  }
  uint32_t missing = k->needs & ~cpu->features;
  if (!missing) return true;
  char list[200] = "";
  size_t len = 0;
  for (int bit = 0; bit < BLAS_NUM_FEATURES && len < sizeof(list); bit++)
    if (missing & (1u << bit))
      len += (size_t)snprintf(list + len, sizeof(list) - len, "%s%s", len ? ", " : "",
                              feature_names[bit]);
  errbuf_set(0, err, errlen, "kernel %s needs %s, which this CPU lacks (or its OS does not enable)",
             k->name, list);
  return false;
}

const char *blas_kernel_best(const struct blas_cpu *cpu) {
  const char *ladder[] = {"Cooperlake", "SkylakeX",
                          cpu->vendor == BLAS_VENDOR_AMD ? "Zen" : "Haswell", "Sandybridge"};
  for (size_t i = 0; i < sizeof(ladder) / sizeof(ladder[0]); i++)
    if (blas_kernel_supported(ladder[i], cpu, NULL, 0)) return ladder[i];
  return NULL;
}

int blas_choice_parse(const char *choice, const struct blas_cpu *cpu, const char **kernel,
                      bool *keep, char *err, size_t errlen) {
  *kernel = NULL;
  *keep = false;
  if (strcmp(choice, "auto") == 0) return 0;
  if (strcmp(choice, "keep") == 0) {
    *keep = true;
    return 0;
  }
  const struct kernel *k = kernel_find(choice);
  if (!k) {
    char names[300] = "";
    size_t len = 0;
    for (size_t i = 0; i < NUM_KERNELS && len < sizeof(names); i++)
      len += (size_t)snprintf(names + len, sizeof(names) - len, "%s%s", i ? ", " : "",
                              kernels[i].name);
    return errbuf_set(-EINVAL, err, errlen, "expected auto, keep or an OpenBLAS x86_64 kernel: %s",
                      names);
  }
  if (!blas_kernel_supported(k->name, cpu, err, errlen)) return -EINVAL;
  *kernel = k->name;
  return 0;
}

const char *blas_why_name(enum blas_why why) {
  static const char *const names[] = {[BLAS_WHY_NONE] = "none",
                                      [BLAS_WHY_DEFAULT] = "default",
                                      [BLAS_WHY_AUTO] = "auto",
                                      [BLAS_WHY_USER] = "user",
                                      [BLAS_WHY_KEEP] = "keep"};
  return (unsigned)why < sizeof(names) / sizeof(names[0]) ? names[why] : "?";
}

static bool same_kernel(const char *a, const char *b) {
  return a && b && strcasecmp(a, b) == 0;
}

void blas_plan_make(const char *kernel, bool keep, const struct blas_cpu *cpu,
                    const struct blas_state *st, struct blas_plan *out) {
  memset(out, 0, sizeof(*out));
  out->why = BLAS_WHY_NONE;
  if (!st->running) return;
  if (st->reexec_why != BLAS_WHY_NONE) { /* the exec happened: never again */
    out->why = st->reexec_why;
    out->target = st->env;
    out->mismatch = !same_kernel(st->running, st->env);
    return;
  }
  if (kernel) {
    out->why = BLAS_WHY_USER;
    out->target = kernel;
    if (same_kernel(st->running, kernel)) return;
    out->reexec = st->dynamic;
    out->mismatch = !st->dynamic;
    return;
  }
  if (st->env) { /* the user's OPENBLAS_CORETYPE, under auto or keep */
    out->why = BLAS_WHY_USER;
    out->target = st->env;
    out->mismatch = !same_kernel(st->running, st->env);
    return;
  }
  if (keep) {
    out->why = BLAS_WHY_KEEP;
    return;
  }
  out->why = BLAS_WHY_DEFAULT;
  const char *best = blas_kernel_best(cpu);
  int have = blas_kernel_rank(st->running); /* -1: newer than the table, leave it */
  if (!best || have < 0 || have >= blas_kernel_rank(best)) return;
  out->target = best;
  if (st->dynamic) {
    out->why = BLAS_WHY_AUTO;
    out->reexec = true;
  } else {
    out->mismatch = true; /* a generic kernel fixed at build time: say so */
  }
}

/* ---- the process ------------------------------------------------------- */

typedef char *(*str_fn)(void);
/* cblas_sgemm of the CBLAS ABI: its enums are ints (CblasRowMajor 101,
 * CblasNoTrans 111, CblasTrans 112), blasint is int (not the 64-bit-index
 * libopenblas64, whose symbols carry a 64_ suffix). */
typedef void (*sgemm_fn)(int order, int transa, int transb, int m, int n, int k, float alpha,
                         const float *a, int lda, const float *b, int ldb, float beta, float *c,
                         int ldc);

/* An OpenBLAS loaded privately (RTLD_LOCAL: the dependency of a Python
 * extension, say) is not in the global scope RTLD_DEFAULT searches: a
 * handle to the first mapped file named *blas* that has
 * openblas_get_corename (dlclose it), or NULL. RTLD_NOLOAD loads nothing
 * new. */
static void *mapped_openblas(void) {
  FILE *f = fopen("/proc/self/maps", "r");
  if (!f) return NULL;
  char line[4096];
  void *h = NULL;
  while (!h && fgets(line, sizeof(line), f)) {
    char *path = strchr(line, '/');
    if (!path) continue;
    path[strcspn(path, "\n")] = '\0';
    if (!strstr(strrchr(path, '/'), "blas")) continue;
    void *c = dlopen(path, RTLD_NOLOAD | RTLD_LAZY);
    if (c && dlsym(c, "openblas_get_corename"))
      h = c;
    else if (c)
      dlclose(c);
  }
  fclose(f);
  return h;
}

/* Function name of the program's libraries (or of handle, if not NULL) into
 * *fn; false if there is none. (memcpy: ISO C has no cast between object
 * and function pointers.) */
static bool find_fn(void *handle, const char *name, void *fn, size_t size) {
  void *sym = dlsym(handle ? handle : RTLD_DEFAULT, name);
  if (sym) memcpy(fn, &sym, size);
  return sym != NULL;
}

static const char *call_str(void *handle, const char *name) {
  str_fn fn;
  return find_fn(handle, name, &fn, sizeof(fn)) ? fn() : NULL;
}

/* The guard of this process (file comment): the reason before the exec and
 * the kernel OpenBLAS had picked then (into was), or BLAS_WHY_NONE. */
static enum blas_why guard_read(char *was, size_t len) {
  const char *g = getenv(GUARD_VAR);
  was[0] = '\0';
  if (!g) return BLAS_WHY_NONE;
  char *end;
  long pid = strtol(g, &end, 10);
  if (end == g || *end != ':' || pid != (long)getpid()) return BLAS_WHY_NONE;
  const char *why = end + 1, *colon = strchr(why, ':');
  size_t wlen = colon ? (size_t)(colon - why) : strlen(why);
  if (colon) snprintf(was, len, "%s", colon + 1);
  return wlen == 4 && strncmp(why, "auto", 4) == 0 ? BLAS_WHY_AUTO : BLAS_WHY_USER;
}

/* Replaces the process image with argv under OPENBLAS_CORETYPE=kernel.
 * Returns only on failure: -errno, the environment as it was. */
static int reexec(char *const *argv, const char *kernel, enum blas_why why, const char *running) {
  char guard[96], saved[64] = "";
  const char *old = getenv(CORETYPE_VAR);
  bool had = old != NULL;
  if (had) snprintf(saved, sizeof(saved), "%s", old);
  snprintf(guard, sizeof(guard), "%ld:%s:%s", (long)getpid(), blas_why_name(why), running);
  int r = 0;
  if (setenv(CORETYPE_VAR, kernel, 1) < 0 || setenv(GUARD_VAR, guard, 1) < 0) {
    r = -errno;
  } else {
    log_debug("re-executing for the BLAS kernel", "kernel=%s wanted=%s why=%s", running, kernel,
              blas_why_name(why));
    fflush(NULL);
    execv("/proc/self/exe", argv);
    r = -errno;
  }
  unsetenv(GUARD_VAR);
  if (had)
    setenv(CORETYPE_VAR, saved, 1);
  else
    unsetenv(CORETYPE_VAR);
  return r;
}

/* GFLOP/s of the first layer's forward product (batch 256, 784 -> 256) through
 * the program's cblas_sgemm: one warm-up call, then the best call of those
 * that fit in ~50 ms (at least 3). 0 without cblas_sgemm or memory. */
static double sgemm_gflops(void *handle) {
  enum { M = 256, N = 256, K = 784 };
  sgemm_fn sgemm;
  if (!find_fn(handle, "cblas_sgemm", &sgemm, sizeof(sgemm)) &&
      (!handle || !find_fn(NULL, "cblas_sgemm", &sgemm, sizeof(sgemm))))
    return 0;
  float *a = malloc(sizeof(float) * M * K), *b = malloc(sizeof(float) * N * K),
        *c = malloc(sizeof(float) * M * N);
  double gflops = 0;
  if (!a || !b || !c) goto out;
  for (int i = 0; i < M * K; i++) a[i] = (float)(i % 17) / 17.0f - 0.5f;
  for (int i = 0; i < N * K; i++) b[i] = (float)(i % 13) / 13.0f - 0.5f;
  sgemm(101, 111, 112, M, N, K, 1.0f, a, K, b, K, 0.0f, c, N);
  uint64_t start = clock_now_ns(), best = UINT64_MAX;
  for (int i = 0; i < 10000; i++) {
    uint64_t t0 = clock_now_ns();
    sgemm(101, 111, 112, M, N, K, 1.0f, a, K, b, K, 0.0f, c, N);
    uint64_t t1 = clock_now_ns();
    if (t1 - t0 < best) best = t1 - t0;
    if (i >= 2 && t1 - start >= 50000000u) break;
  }
  gflops = 2.0 * M * N * K / (double)(best ? best : 1); /* flop per ns = GFLOP/s */
out:
  free(a);
  free(b);
  free(c);
  return gflops;
}

static void describe_cpu(const struct blas_cpu *cpu, char *buf, size_t len) {
  if (!cpu->x86_64)
    snprintf(buf, len, "not x86_64");
  else
    snprintf(buf, len, "%s family %d model %d", cpu->vendor_id[0] ? cpu->vendor_id : "unknown",
             cpu->family, cpu->model);
}

ps_status ps_blas_kernel_check(const char *choice, char *err, size_t errlen) {
  struct blas_cpu cpu;
  const char *kernel;
  bool keep;
  if (!choice) return errbuf_set(PS_ERR_INVALID, err, errlen, "no choice given");
  blas_cpu_detect(&cpu);
  return blas_choice_parse(choice, &cpu, &kernel, &keep, err, errlen) < 0 ? PS_ERR_INVALID : PS_OK;
}

ps_status ps_blas_select(const char *choice, char *const *argv, ps_blas_info *out, char *err,
                         size_t errlen) {
  if (!choice || !argv || !argv[0] || !out)
    return errbuf_set(PS_ERR_INVALID, err, errlen, "ps_blas_select: choice, argv and out needed");
  memset(out, 0, sizeof(*out));
  struct blas_cpu cpu;
  const char *kernel;
  bool keep;
  blas_cpu_detect(&cpu);
  describe_cpu(&cpu, out->cpu, sizeof(out->cpu));
  if (blas_choice_parse(choice, &cpu, &kernel, &keep, err, errlen) < 0) return PS_ERR_INVALID;

  void *handle = dlsym(RTLD_DEFAULT, "openblas_get_corename") ? NULL : mapped_openblas();
  const char *config = call_str(handle, "openblas_get_config");
  struct blas_state st = {.running = call_str(handle, "openblas_get_corename"),
                          .dynamic = config && strstr(config, "DYNAMIC_ARCH"),
                          .env = getenv(CORETYPE_VAR)};
  char was[32];
  st.reexec_why = guard_read(was, sizeof(was));
  struct blas_plan plan;
  blas_plan_make(kernel, keep, &cpu, &st, &plan);
  if (plan.reexec) {
    int r = reexec(argv, plan.target, plan.why, st.running);
    log_warn("cannot re-execute for the BLAS kernel, going on with OpenBLAS's pick",
             "kernel=%s wanted=%s error=\"%s\"", st.running, plan.target, strerror(-r));
    plan.why = BLAS_WHY_DEFAULT;
  } else if (plan.mismatch) {
    const char *hint = st.reexec_why != BLAS_WHY_NONE
                           ? "OpenBLAS did not load the kernel OPENBLAS_CORETYPE named after the "
                             "re-execution (a version without it?)"
                       : !st.dynamic ? "this OpenBLAS is built without DYNAMIC_ARCH: its kernel "
                                       "is fixed at build time"
                                     : "OpenBLAS does not know the OPENBLAS_CORETYPE given";
    log_warn("the BLAS kernel is not the one chosen", "kernel=%s wanted=%s why=%s hint=\"%s\"",
             st.running, plan.target, blas_why_name(plan.why), hint);
  }

  if (!st.running) {
    snprintf(out->blas, sizeof(out->blas), "no OpenBLAS loaded");
    snprintf(out->kernel, sizeof(out->kernel), "none");
  } else {
    /* "OpenBLAS 0.3.21 NO_LAPACKE DYNAMIC_ARCH ...": its first two words */
    size_t n = config ? strcspn(config, " ") : 0;
    if (n && config[n] == ' ') n += 1 + strcspn(config + n + 1, " ");
    snprintf(out->blas, sizeof(out->blas), "%.*s", n ? (int)n : 8, n ? config : "OpenBLAS");
    snprintf(out->kernel, sizeof(out->kernel), "%s", st.running);
  }
  snprintf(out->why, sizeof(out->why), "%s", blas_why_name(plan.why));
  if (st.reexec_why != BLAS_WHY_NONE) snprintf(out->was, sizeof(out->was), "%s", was);
  out->gflops = sgemm_gflops(handle);
  if (handle) dlclose(handle);
  return PS_OK;
}
