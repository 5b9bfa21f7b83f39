/* blas_kernel_impl: the pure part of the BLAS kernel choice (blas_kernel.h),
 * apart from the process it runs in, so tests/unit/test_blas_kernel can feed
 * it fake CPUs and library states. Internal to psblas: not in include/; only
 * this folder and that unit test (through psblas_internal_dep) include it.
 *
 * The kernels are OpenBLAS's x86_64 core names as OPENBLAS_CORETYPE takes
 * them (driver/others/dynamic.c; 0.3.21 accepts these and matches them
 * case-insensitively), each with the CPU features its code needs and a
 * rank. A kernel runs only on a CPU whose cpuid bits say it has every
 * feature it needs and whose OS saves the registers (XGETBV: YMM for AVX,
 * ZMM and the mask registers for AVX-512). The 32-bit kernels (Katmai,
 * Coppermine, Northwood, Banias, Athlon) are not in the table: an x86_64
 * build maps them to Prescott. */
#ifndef PS_BLAS_KERNEL_IMPL_H
#define PS_BLAS_KERNEL_IMPL_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

/* CPU features a kernel may need, as bits of blas_cpu.features. The AVX
 * family counts only when the OS saves its registers. */
enum {
  BLAS_SSE2 = 1u << 0,
  BLAS_SSE3 = 1u << 1,
  BLAS_SSSE3 = 1u << 2,
  BLAS_SSE41 = 1u << 3,
  BLAS_SSE42 = 1u << 4,
  BLAS_SSE4A = 1u << 5, /* AMD only */
  BLAS_AVX = 1u << 6,
  BLAS_FMA3 = 1u << 7,
  BLAS_FMA4 = 1u << 8, /* AMD family 15h only */
  BLAS_AVX2 = 1u << 9,
  BLAS_AVX512F = 1u << 10,
  BLAS_AVX512DQ = 1u << 11,
  BLAS_AVX512CD = 1u << 12,
  BLAS_AVX512BW = 1u << 13,
  BLAS_AVX512VL = 1u << 14,
  BLAS_AVX512BF16 = 1u << 15,
  BLAS_NUM_FEATURES = 16,
};

/* The name of feature bit i (0..BLAS_NUM_FEATURES-1), as cpuid documents it. */
const char *blas_feature_name(int bit);

enum blas_vendor { BLAS_VENDOR_OTHER = 0, BLAS_VENDOR_INTEL, BLAS_VENDOR_AMD /* and Hygon */ };

struct blas_cpu {
  bool x86_64; /* false: another architecture, where no kernel of the table runs */
  enum blas_vendor vendor;
  uint32_t features; /* BLAS_* bits */
  int family, model; /* cpuid leaf 1, extended fields folded in (for the log) */
  char vendor_id[13];
};

/* Reads this CPU (blas_cpu_x86.c, or blas_cpu_none.c on other
 * architectures). */
void blas_cpu_detect(struct blas_cpu *out);

/* The canonical spelling of kernel name (case-insensitive), or NULL if the
 * table has no such kernel. */
const char *blas_kernel_canonical(const char *name);
/* The rank of a kernel (0: SSE-class, 1: Sandybridge and AMD 15h with AVX, 2:
 * Haswell/Zen/Excavator, 3: SkylakeX, 4: Cooperlake), or -1 for a name the
 * table lacks. */
int blas_kernel_rank(const char *name);
/* Whether cpu can run kernel name (in the table). If not and errlen > 0,
 * err says which features it needs and which of them cpu lacks. */
bool blas_kernel_supported(const char *name, const struct blas_cpu *cpu, char *err, size_t errlen);
/* The best kernel cpu verifiably runs: Cooperlake, SkylakeX, Zen (AMD) or
 * Haswell, Sandybridge; NULL below AVX (OpenBLAS's own pick is as good as
 * any SSE kernel there). */
const char *blas_kernel_best(const struct blas_cpu *cpu);

/* A --blas-kernel value: auto, keep, or a kernel of the table that cpu
 * runs. On success *kernel is NULL (auto, keep) or the canonical name and
 * *keep says which of auto and keep it was; -EINVAL with the reason in err
 * otherwise (unknown: every valid value named; unsupported: the features). */
int blas_choice_parse(const char *choice, const struct blas_cpu *cpu, const char **kernel,
                      bool *keep, char *err, size_t errlen);

/* Why the kernel that runs is the one that runs. */
enum blas_why {
  BLAS_WHY_NONE = 0, /* no OpenBLAS in the process: nothing to choose */
  BLAS_WHY_DEFAULT,  /* OpenBLAS's own pick, as good as what the CPU verifiably runs */
  BLAS_WHY_AUTO,     /* OpenBLAS's pick ranked lower (a generic fallback): we chose */
  BLAS_WHY_USER,     /* --blas-kernel NAME, or OPENBLAS_CORETYPE in the environment */
  BLAS_WHY_KEEP,     /* --blas-kernel keep */
};
/* "none", "default", "auto", "user", "keep". */
const char *blas_why_name(enum blas_why why);

/* What the process sees of its BLAS. */
struct blas_state {
  const char *running; /* openblas_get_corename(); NULL = no OpenBLAS loaded */
  bool dynamic;        /* a DYNAMIC_ARCH build: OPENBLAS_CORETYPE is read when it loads */
  const char *env;     /* OPENBLAS_CORETYPE as the process found it; NULL = unset */
  /* Set when this process is its own re-execution for a kernel (the guard
   * variable names its pid): BLAS_WHY_AUTO or BLAS_WHY_USER, the reason of
   * the process before the exec. BLAS_WHY_NONE otherwise. */
  enum blas_why reexec_why;
};

struct blas_plan {
  bool reexec;        /* exec the program again with OPENBLAS_CORETYPE = target */
  const char *target; /* the kernel wanted (canonical, or env as given); NULL = any */
  enum blas_why why;
  /* target is set, no exec is planned and another kernel runs: the
   * chosen one could not be loaded (an OpenBLAS without it, a build
   * without DYNAMIC_ARCH, an OPENBLAS_CORETYPE it does not know). */
  bool mismatch;
};

/* Decides for a parsed choice (blas_choice_parse: kernel NULL or a
 * canonical name, keep) what to do, in this order: no OpenBLAS -> nothing;
 * a re-executed process -> never again (a mismatch is reported); a named
 * kernel (user) -> exec unless it runs; OPENBLAS_CORETYPE set (user) ->
 * kept; keep -> kept; auto -> exec when the running kernel is in the table
 * and ranks below blas_kernel_best(cpu), else default. Without DYNAMIC_ARCH
 * no exec is ever planned. */
void blas_plan_make(const char *kernel, bool keep, const struct blas_cpu *cpu,
                    const struct blas_state *st, struct blas_plan *out);

#endif
