/* blas_kernel: the right OpenBLAS kernel without the user's help.
 *
 * OpenBLAS built with DYNAMIC_ARCH (Debian's) picks its kernel from cpuid
 * when it loads. A CPU newer than the library falls back to a generic
 * kernel in silence: Debian 12's 0.3.21 runs Prescott on Xeon family 6
 * model 207, 7x slower at sgemm than its SkylakeX kernel. The library reads
 * OPENBLAS_CORETYPE only when it loads, so a better kernel needs a new
 * process image: ps_blas_select re-executes the program (/proc/self/exe,
 * same argv, same pid) with OPENBLAS_CORETYPE set.
 *
 * psblas does not link a BLAS: it looks for openblas_get_corename and
 * cblas_sgemm among what the program loaded (dlsym RTLD_DEFAULT, else the
 * mapped *blas* libraries of /proc/self/maps), so a program without
 * OpenBLAS gets "no OpenBLAS loaded" and nothing changes.
 *
 * The choice ("auto", "keep" or a kernel name; ps-worker --blas-kernel):
 *  - a kernel the user chose wins: a name (case-insensitive: Prescott,
 *    Atom, Core2, Penryn, Dunnington, Nehalem, Opteron, Opteron_SSE3,
 *    Barcelona, Nano, Bobcat, Sandybridge, Bulldozer, Piledriver,
 *    Steamroller, Excavator, Haswell, Zen, SkylakeX, Cooperlake), refused
 *    when the CPU or its OS lacks a feature it needs; or, under auto and
 *    keep, OPENBLAS_CORETYPE already in the environment;
 *  - keep: never change;
 *  - auto: rank the kernels (SSE-class < Sandybridge < Haswell/Zen <
 *    SkylakeX < Cooperlake), take the best one cpuid and XGETBV show the CPU
 *    runs, and re-execute only when OpenBLAS's own pick ranks lower.
 * A guard variable (PS_BLAS_REEXEC, holding the pid) makes sure a process
 * re-executes at most once; if the kernel after it is still not the chosen
 * one, a warning is logged and the program goes on. */
#ifndef PS_BLAS_KERNEL_H
#define PS_BLAS_KERNEL_H

#include <stddef.h>

#include "ps.h"

#ifdef __cplusplus
extern "C" {
#endif

/* What runs, and why; filled by ps_blas_select. */
typedef struct {
  char blas[64];   /* "OpenBLAS 0.3.21" (openblas_get_config), or "no OpenBLAS loaded" */
  char kernel[32]; /* openblas_get_corename(), or "none" */
  char why[16];    /* user, auto, keep, default (OpenBLAS's own pick), none (no OpenBLAS) */
  char was[32];    /* after a re-execution, the kernel OpenBLAS had picked before; else "" */
  char cpu[64];    /* "GenuineIntel family 6 model 207" */
  /* sgemm 256x256x784 (the first layer's shape) through the program's
   * cblas_sgemm, best of the calls in about 50 ms; 0 = no cblas_sgemm. */
  double gflops;
} ps_blas_info;

/* Checks a choice: auto, keep, or a kernel name this CPU runs. PS_OK, or
 * PS_ERR_INVALID with the reason in err (errlen > 0): an unknown name
 * lists the valid ones, a kernel the CPU lacks features for names them. */
ps_status ps_blas_kernel_check(const char *choice, char *err, size_t errlen);

/* Selects the kernel for choice (see above) and measures it. Call it early
 * in main, before other threads start and before anything is written that
 * an exec would lose (stdio buffers are flushed): when a different kernel
 * must be loaded it re-executes /proc/self/exe with argv (main's, NULL-
 * terminated) and does not return. Logs a warning (and goes on) when the
 * exec fails or the kernel after it is not the chosen one. PS_ERR_INVALID
 * (reason in err) for a bad choice or a NULL argv or out. */
ps_status ps_blas_select(const char *choice, char *const *argv, ps_blas_info *out, char *err,
                         size_t errlen);

#ifdef __cplusplus
}
#endif

#endif
