/* test_blas_kernel: the pure kernel decision of psblas (blas_kernel_impl.h)
 * with fake CPUs and fake library states: the table's names and ranks, the
 * features each kernel needs (OS support included: a CPU whose OS does not
 * save ZMM has no AVX-512 here), the best kernel per CPU, the parser of
 * --blas-kernel (unknown names listed, kernels the CPU lacks features for
 * refused), and the plan: a generic fallback is replaced, a user's choice
 * (a name, or OPENBLAS_CORETYPE) always wins, keep keeps, and a process
 * that re-executed never does it again. Last, blas_cpu_detect is held
 * against the compiler's own cpuid reading on this machine. */
#include "blas_kernel_impl.h"

#include <errno.h>
#include <stdbool.h>
#include <stdio.h>
#include <string.h>

#include "check.h"

#define SSE3S (BLAS_SSE2 | BLAS_SSE3 | BLAS_SSSE3)
#define SSE42S (SSE3S | BLAS_SSE41 | BLAS_SSE42)
#define AVXS (SSE42S | BLAS_AVX)
#define HSWS (AVXS | BLAS_FMA3 | BLAS_AVX2)
#define SKXS (HSWS | BLAS_AVX512F | BLAS_AVX512DQ | BLAS_AVX512CD | BLAS_AVX512BW | BLAS_AVX512VL)

static const struct blas_cpu core2 = {true, BLAS_VENDOR_INTEL, SSE3S, 6, 15, "GenuineIntel"};
static const struct blas_cpu sandy = {true, BLAS_VENDOR_INTEL, AVXS, 6, 42, "GenuineIntel"};
/* a Sandy Bridge under an OS that does not save YMM: no AVX counted */
static const struct blas_cpu sandy_no_os = {true, BLAS_VENDOR_INTEL, SSE42S, 6, 42, "GenuineIntel"};
static const struct blas_cpu haswell = {true, BLAS_VENDOR_INTEL, HSWS, 6, 60, "GenuineIntel"};
static const struct blas_cpu zen2 = {true, BLAS_VENDOR_AMD, HSWS | BLAS_SSE4A, 23,
                                     49,   "AuthenticAMD"};
static const struct blas_cpu skx = {true, BLAS_VENDOR_INTEL, SKXS, 6, 85, "GenuineIntel"};
/* Xeon family 6 model 207, which OpenBLAS 0.3.21 does not know */
static const struct blas_cpu emr = {true, BLAS_VENDOR_INTEL, SKXS | BLAS_AVX512BF16, 6,
                                    207,  "GenuineIntel"};
static const struct blas_cpu zen4 = {true, BLAS_VENDOR_AMD, SKXS | BLAS_AVX512BF16 | BLAS_SSE4A, 25,
                                     17,   "AuthenticAMD"};
/* Knights Landing: AVX512F and CD, but no BW, DQ, VL */
static const struct blas_cpu knl = {true, BLAS_VENDOR_INTEL, HSWS | BLAS_AVX512F | BLAS_AVX512CD, 6,
                                    87,   "GenuineIntel"};
static const struct blas_cpu bulldozer = {true, BLAS_VENDOR_AMD, AVXS | BLAS_SSE4A | BLAS_FMA4, 21,
                                          1,    "AuthenticAMD"};
static const struct blas_cpu arm = {false, BLAS_VENDOR_OTHER, 0, 0, 0, ""};

static bool eq(const char *a, const char *b) {
  return (!a && !b) || (a && b && strcmp(a, b) == 0);
}

static void test_names_and_ranks(void) {
  CHECK(eq(blas_kernel_canonical("skylakex"), "SkylakeX"));
  CHECK(eq(blas_kernel_canonical("COOPERLAKE"), "Cooperlake"));
  CHECK(eq(blas_kernel_canonical("Opteron_SSE3"), "Opteron_SSE3"));
  CHECK(blas_kernel_canonical("Katmai") == NULL, "a 32-bit kernel is not in the x86_64 table");
  CHECK(blas_kernel_canonical("SapphireRapids") == NULL);
  CHECK(blas_kernel_canonical("Haswel") == NULL, "no prefix matching");
  CHECK(blas_kernel_rank("bogus") == -1);
  const char *ladder[] = {"Prescott", "Sandybridge", "Haswell", "SkylakeX", "Cooperlake"};
  for (int i = 0; i + 1 < 5; i++)
    CHECK(blas_kernel_rank(ladder[i]) < blas_kernel_rank(ladder[i + 1]), "%s < %s", ladder[i],
          ladder[i + 1]);
  CHECK(blas_kernel_rank("Haswell") == blas_kernel_rank("Zen"));
  const char *sse[] = {"Prescott", "Atom",         "Core2",     "Penryn", "Dunnington", "Nehalem",
                       "Opteron",  "Opteron_SSE3", "Barcelona", "Nano",   "Bobcat"};
  for (size_t i = 0; i < sizeof(sse) / sizeof(sse[0]); i++)
    CHECK(blas_kernel_rank(sse[i]) == blas_kernel_rank("Prescott"), "%s is SSE-class", sse[i]);
  CHECK(blas_kernel_rank("Bulldozer") == blas_kernel_rank("Sandybridge"));
  CHECK(eq(blas_feature_name(0), "SSE2"));
  CHECK(eq(blas_feature_name(15), "AVX512_BF16"));
}

static void test_supported(void) {
  char err[256];
  CHECK(blas_kernel_supported("Prescott", &core2, NULL, 0));
  CHECK(blas_kernel_supported("Haswell", &haswell, NULL, 0));
  CHECK(blas_kernel_supported("Zen", &haswell, NULL, 0), "Zen runs on any AVX2+FMA CPU");
  CHECK(!blas_kernel_supported("SkylakeX", &haswell, err, sizeof(err)));
  CHECK(strstr(err, "SkylakeX") && strstr(err, "AVX512F") && strstr(err, "AVX512BW") &&
            strstr(err, "AVX512VL") && !strstr(err, "AVX2,"),
        "names what is missing, only that: %s", err);
  CHECK(!blas_kernel_supported("SkylakeX", &knl, err, sizeof(err)));
  CHECK(strstr(err, "AVX512BW") && !strstr(err, "AVX512F,"), "%s", err);
  CHECK(!blas_kernel_supported("Cooperlake", &skx, err, sizeof(err)));
  CHECK(strstr(err, "AVX512_BF16") != NULL, "%s", err);
  CHECK(blas_kernel_supported("Cooperlake", &emr, NULL, 0));
  CHECK(!blas_kernel_supported("Sandybridge", &sandy_no_os, NULL, 0));
  CHECK(!blas_kernel_supported("Bulldozer", &zen4, err, sizeof(err)));
  CHECK(strstr(err, "FMA4") != NULL, "%s", err);
  CHECK(blas_kernel_supported("Bulldozer", &bulldozer, NULL, 0));
  CHECK(!blas_kernel_supported("Piledriver", &bulldozer, NULL, 0), "Piledriver needs FMA3 too");
  CHECK(!blas_kernel_supported("Barcelona", &skx, err, sizeof(err)));
  CHECK(strstr(err, "SSE4a") != NULL, "%s", err);
  CHECK(!blas_kernel_supported("Prescott", &arm, err, sizeof(err)));
  CHECK(strstr(err, "not x86_64") != NULL, "%s", err);
  CHECK(!blas_kernel_supported("bogus", &zen4, NULL, 0));
}

static void test_best(void) {
  CHECK(blas_kernel_best(&core2) == NULL, "below AVX OpenBLAS's pick stands");
  CHECK(blas_kernel_best(&sandy_no_os) == NULL);
  CHECK(eq(blas_kernel_best(&sandy), "Sandybridge"));
  CHECK(eq(blas_kernel_best(&haswell), "Haswell"));
  CHECK(eq(blas_kernel_best(&zen2), "Zen"), "AMD's AVX2 kernel on AMD");
  CHECK(eq(blas_kernel_best(&skx), "SkylakeX"));
  CHECK(eq(blas_kernel_best(&emr), "Cooperlake"));
  CHECK(eq(blas_kernel_best(&zen4), "Cooperlake"));
  CHECK(eq(blas_kernel_best(&knl), "Haswell"), "partial AVX-512 is not enough for SkylakeX");
  CHECK(eq(blas_kernel_best(&bulldozer), "Sandybridge"));
  CHECK(blas_kernel_best(&arm) == NULL);
}

static void test_parse(void) {
  const char *k = "x";
  bool keep = true;
  char err[400] = "";
  CHECK(blas_choice_parse("auto", &emr, &k, &keep, err, sizeof(err)) == 0 && !k && !keep);
  CHECK(blas_choice_parse("keep", &emr, &k, &keep, err, sizeof(err)) == 0 && !k && keep);
  CHECK(blas_choice_parse("haswell", &emr, &k, &keep, err, sizeof(err)) == 0 && eq(k, "Haswell") &&
        !keep);
  CHECK(blas_choice_parse("SkylakeX", &haswell, &k, &keep, err, sizeof(err)) == -EINVAL && !k);
  CHECK(strstr(err, "kernel SkylakeX needs AVX512F") != NULL, "%s", err);
  CHECK(blas_choice_parse("bogus", &emr, &k, &keep, err, sizeof(err)) == -EINVAL);
  CHECK(strstr(err, "expected auto, keep or an OpenBLAS x86_64 kernel: Prescott, Atom,") &&
            strstr(err, "SkylakeX, Cooperlake"),
        "every valid value named: %s", err);
  CHECK(blas_choice_parse("Katmai", &emr, &k, &keep, err, sizeof(err)) == -EINVAL);
  CHECK(blas_choice_parse("", &emr, &k, &keep, err, sizeof(err)) == -EINVAL);
  CHECK(blas_choice_parse("Auto", &emr, &k, &keep, err, sizeof(err)) == -EINVAL,
        "auto and keep are exact words, as every option's values");
  CHECK(blas_choice_parse("Zen", &arm, &k, &keep, err, sizeof(err)) == -EINVAL);
  CHECK(blas_choice_parse("auto", &arm, &k, &keep, err, sizeof(err)) == 0);
}

/* One plan: choice (NULL = auto, "keep", or a canonical kernel) under st. */
static struct blas_plan plan(const char *choice, const struct blas_cpu *cpu, const char *running,
                             bool dynamic, const char *env, enum blas_why reexec_why) {
  struct blas_state st = {running, dynamic, env, reexec_why};
  bool keep = choice && strcmp(choice, "keep") == 0;
  struct blas_plan p;
  blas_plan_make(keep ? NULL : choice, keep, cpu, &st, &p);
  return p;
}

static bool is(struct blas_plan p, bool reexec, const char *target, enum blas_why why,
               bool mismatch) {
  return p.reexec == reexec && eq(p.target, target) && p.why == why && p.mismatch == mismatch;
}

static void test_plan(void) {
  const enum blas_why N = BLAS_WHY_NONE;
  /* no OpenBLAS in the process: nothing, whatever the choice */
  CHECK(is(plan(NULL, &emr, NULL, true, NULL, N), false, NULL, BLAS_WHY_NONE, false));
  CHECK(is(plan("Haswell", &emr, NULL, true, "SkylakeX", N), false, NULL, BLAS_WHY_NONE, false));
  /* auto: the generic fallback on a CPU the library does not know is replaced */
  CHECK(is(plan(NULL, &emr, "Prescott", true, NULL, N), true, "Cooperlake", BLAS_WHY_AUTO, false));
  CHECK(is(plan(NULL, &skx, "Haswell", true, NULL, N), true, "SkylakeX", BLAS_WHY_AUTO, false));
  CHECK(is(plan(NULL, &zen2, "Sandybridge", true, NULL, N), true, "Zen", BLAS_WHY_AUTO, false));
  /* ... and OpenBLAS's own pick stays when nothing better is verifiably supported */
  CHECK(is(plan(NULL, &zen4, "Cooperlake", true, NULL, N), false, NULL, BLAS_WHY_DEFAULT, false));
  CHECK(is(plan(NULL, &zen2, "Zen", true, NULL, N), false, NULL, BLAS_WHY_DEFAULT, false));
  CHECK(is(plan(NULL, &zen2, "Haswell", true, NULL, N), false, NULL, BLAS_WHY_DEFAULT, false),
        "equal ranks: no exec");
  CHECK(
      is(plan(NULL, &bulldozer, "Bulldozer", true, NULL, N), false, NULL, BLAS_WHY_DEFAULT, false));
  CHECK(is(plan(NULL, &core2, "Core2", true, NULL, N), false, NULL, BLAS_WHY_DEFAULT, false));
  CHECK(is(plan(NULL, &emr, "SapphireRapids", true, NULL, N), false, NULL, BLAS_WHY_DEFAULT, false),
        "a kernel newer than the table is left alone");
  CHECK(is(plan(NULL, &arm, "NEOVERSEN1", true, NULL, N), false, NULL, BLAS_WHY_DEFAULT, false));
  /* without DYNAMIC_ARCH the kernel is fixed: no exec, but say so */
  CHECK(is(plan(NULL, &emr, "Prescott", false, NULL, N), false, "Cooperlake", BLAS_WHY_DEFAULT,
           true));
  /* the user's OPENBLAS_CORETYPE wins under auto and keep */
  CHECK(
      is(plan(NULL, &emr, "Haswell", true, "Haswell", N), false, "Haswell", BLAS_WHY_USER, false));
  CHECK(is(plan(NULL, &emr, "Prescott", true, "prescott", N), false, "prescott", BLAS_WHY_USER,
           false));
  CHECK(is(plan("keep", &emr, "Haswell", true, "Haswell", N), false, "Haswell", BLAS_WHY_USER,
           false));
  CHECK(is(plan(NULL, &emr, "Cooperlake", true, "bogus", N), false, "bogus", BLAS_WHY_USER, true),
        "an OPENBLAS_CORETYPE the library ignored is reported");
  /* keep never changes */
  CHECK(is(plan("keep", &emr, "Prescott", true, NULL, N), false, NULL, BLAS_WHY_KEEP, false));
  /* a named kernel: exec unless it runs; it beats OPENBLAS_CORETYPE (flag > env) */
  CHECK(is(plan("Haswell", &zen4, "Cooperlake", true, NULL, N), true, "Haswell", BLAS_WHY_USER,
           false));
  CHECK(
      is(plan("Haswell", &zen4, "Haswell", true, NULL, N), false, "Haswell", BLAS_WHY_USER, false));
  CHECK(is(plan("Prescott", &zen4, "Cooperlake", true, NULL, N), true, "Prescott", BLAS_WHY_USER,
           false),
        "a user may choose a lower kernel");
  CHECK(is(plan("Zen", &zen4, "Haswell", true, "Haswell", N), true, "Zen", BLAS_WHY_USER, false));
  CHECK(is(plan("Haswell", &zen4, "Cooperlake", false, NULL, N), false, "Haswell", BLAS_WHY_USER,
           true));
  /* after the exec: never again, and a kernel that did not load is reported */
  CHECK(is(plan(NULL, &emr, "Cooperlake", true, "Cooperlake", BLAS_WHY_AUTO), false, "Cooperlake",
           BLAS_WHY_AUTO, false));
  CHECK(is(plan(NULL, &emr, "Prescott", true, "Cooperlake", BLAS_WHY_AUTO), false, "Cooperlake",
           BLAS_WHY_AUTO, true),
        "no loop when the library ignored OPENBLAS_CORETYPE");
  CHECK(is(plan("Haswell", &zen4, "Haswell", true, "Haswell", BLAS_WHY_USER), false, "Haswell",
           BLAS_WHY_USER, false));
  CHECK(is(plan("Haswell", &zen4, "Cooperlake", true, "Haswell", BLAS_WHY_USER), false, "Haswell",
           BLAS_WHY_USER, true));

  CHECK(eq(blas_why_name(BLAS_WHY_NONE), "none") &&
        eq(blas_why_name(BLAS_WHY_DEFAULT), "default") &&
        eq(blas_why_name(BLAS_WHY_AUTO), "auto") && eq(blas_why_name(BLAS_WHY_USER), "user") &&
        eq(blas_why_name(BLAS_WHY_KEEP), "keep"));
}

/* blas_cpu_detect against GCC's own reading (which checks XCR0 as well). */
static void test_detect(void) {
  struct blas_cpu cpu;
  blas_cpu_detect(&cpu);
#if defined(__x86_64__)
  __builtin_cpu_init();
  CHECK(cpu.x86_64 && (cpu.features & BLAS_SSE2) && cpu.vendor_id[0]);
  const struct {
    const char *gcc;
    uint32_t bit;
  } pairs[] = {{"sse3", BLAS_SSE3},
               {"ssse3", BLAS_SSSE3},
               {"sse4.1", BLAS_SSE41},
               {"sse4.2", BLAS_SSE42},
               {"avx", BLAS_AVX},
               {"fma", BLAS_FMA3},
               {"avx2", BLAS_AVX2},
               {"avx512f", BLAS_AVX512F},
               {"avx512dq", BLAS_AVX512DQ},
               {"avx512cd", BLAS_AVX512CD},
               {"avx512bw", BLAS_AVX512BW},
               {"avx512vl", BLAS_AVX512VL},
               {"avx512bf16", BLAS_AVX512BF16}};
  int have[] = {__builtin_cpu_supports("sse3"),      __builtin_cpu_supports("ssse3"),
                __builtin_cpu_supports("sse4.1"),    __builtin_cpu_supports("sse4.2"),
                __builtin_cpu_supports("avx"),       __builtin_cpu_supports("fma"),
                __builtin_cpu_supports("avx2"),      __builtin_cpu_supports("avx512f"),
                __builtin_cpu_supports("avx512dq"),  __builtin_cpu_supports("avx512cd"),
                __builtin_cpu_supports("avx512bw"),  __builtin_cpu_supports("avx512vl"),
                __builtin_cpu_supports("avx512bf16")};
  for (size_t i = 0; i < sizeof(pairs) / sizeof(pairs[0]); i++)
    CHECK(!(cpu.features & pairs[i].bit) == !have[i], "%s: blas_cpu_detect %d, gcc %d",
          pairs[i].gcc, !!(cpu.features & pairs[i].bit), !!have[i]);
  const char *best = blas_kernel_best(&cpu);
  printf("this CPU: %s family %d model %d, features 0x%x, best kernel %s\n", cpu.vendor_id,
         cpu.family, cpu.model, cpu.features, best ? best : "(OpenBLAS's own)");
#else
  CHECK(!cpu.x86_64 && cpu.features == 0);
#endif
}

int main(void) {
  test_names_and_ranks();
  test_supported();
  test_best();
  test_parse();
  test_plan();
  test_detect();
  if (failures) fprintf(stderr, "%d check(s) failed\n", failures);
  return failures ? 1 : 0;
}
