/* test_blas_select: the real ps-worker picks its OpenBLAS kernel
 * (--blas-kernel, psblas's blas_kernel.h, ps-worker/blas) and says so in its start line
 *   msg="blas" blas="OpenBLAS 0.3.21" kernel=K why=W [was=K0] gflops=G cpu="..."
 * Each case is one worker of a one-rank ring (no shards, no peers) that
 * trains two steps when Fashion-MNIST is installed, else stops at --data
 * right after the start line:
 *  1. default: the line names a kernel and a GFLOP/s > 0, why default or
 *     auto (auto: was= names the generic kernel replaced);
 *  2. --blas-kernel F, F = Haswell (Sandybridge if the default is Haswell,
 *     so the kernel must change): kernel=F why=user was=<the default's
 *     pick>: the process re-executed itself, exactly once (one start line),
 *     and still trains;
 *  3. OPENBLAS_CORETYPE=F in the environment with --blas-kernel auto: F is
 *     kept (the user wins), no re-execution;
 *  4. --blas-kernel keep: OpenBLAS's own pick, why=keep;
 *  5. a kernel this CPU lacks features for (SkylakeX without AVX-512, else
 *     Bulldozer without FMA4): exit 2 and a message naming the feature.
 * A case this CPU cannot run (no AVX for 2 and 3, every kernel of 5
 * supported) is skipped, and the test with it. The CPU is read with the
 * compiler's __builtin_cpu_supports, not with the code under test. */
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>

#include "harness.h"

struct run {
  int exit_code;
  char log[512], out[512];
  char line[2048]; /* the start line; "" if none */
  int lines;       /* how many start lines */
};

/* The value of key in a logfmt line (unquoted), "" if absent. */
static const char *field(const char *line, const char *key, char *buf, size_t len) {
  char pat[64];
  snprintf(pat, sizeof(pat), " %s=", key);
  const char *p = strstr(line, pat);
  buf[0] = '\0';
  if (!p) return buf;
  p += strlen(pat);
  size_t n = *p == '"' ? strcspn(++p, "\"") : strcspn(p, " \n");
  snprintf(buf, len, "%.*s", (int)(n < len ? n : len - 1), p);
  return buf;
}

/* Runs ps-worker with args (NULL-terminated) and OPENBLAS_CORETYPE=coretype
 * (NULL: unset) and reads its start line. */
static void run_worker(const char *name, const char *coretype, const char *const *args,
                       struct run *r) {
  char bin[512];
  const char *argv[32] = {harness_bin("ps-worker/ps-worker", bin, sizeof(bin)),
                          "--sync-mode",
                          "allreduce",
                          "--world-size",
                          "1",
                          "--epochs",
                          "1",
                          "--max-steps",
                          "2",
                          "--data",
                          harness_have_dataset() ? HARNESS_DATA_DIR : "/nonexistent"};
  int n = 11;
  for (int i = 0; args[i] && n < 31; i++) argv[n++] = args[i];
  argv[n] = NULL;
  memset(r, 0, sizeof(*r));
  snprintf(r->log, sizeof(r->log), "%s/%s.log", harness_dir(), name);
  snprintf(r->out, sizeof(r->out), "%s/%s.out", harness_dir(), name);
  if (coretype) setenv("OPENBLAS_CORETYPE", coretype, 1);
  pid_t pid = harness_spawn(argv, r->out, r->log);
  unsetenv("OPENBLAS_CORETYPE");
  int st = harness_wait(pid, 30000);
  REQUIRE(st >= 0 && WIFEXITED(st), "%s: ps-worker did not exit by itself (status %d)", name, st);
  r->exit_code = WEXITSTATUS(st);
  FILE *f = fopen(r->log, "r");
  REQUIRE(f, "%s: no log %s", name, r->log);
  char line[sizeof(r->line)];
  while (fgets(line, sizeof(line), f)) {
    if (!strstr(line, " msg=\"blas\" ")) continue;
    if (r->lines++ == 0) snprintf(r->line, sizeof(r->line), "%s", line);
  }
  fclose(f);
}

/* The run ended as the data allows: trained (exit 0, a summary) with the
 * dataset, else stopped at --data (exit 1). */
static void require_trained(const char *name, const struct run *r) {
  if (!harness_have_dataset()) {
    REQUIRE(r->exit_code == 1, "%s: exit %d, want 1 (no dataset: --data fails)", name,
            r->exit_code);
    return;
  }
  struct harness_summary s;
  REQUIRE(r->exit_code == 0, "%s: exit %d, want 0", name, r->exit_code);
  REQUIRE(harness_read_summary(r->out, &s) == 0, "%s: no summary line in %s", name, r->out);
}

int main(void) {
  /* what the user's shell may hold would change every case */
  unsetenv("OPENBLAS_CORETYPE");
  unsetenv("PS_BLAS_KERNEL");
  unsetenv("PS_BLAS_REEXEC");
  unsetenv("PS_CONFIG");
  __builtin_cpu_init();
  bool avx = __builtin_cpu_supports("avx"),
       avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  char kernel[64], why[32], was[64], gflops[32], blas[96];

  /* 1. default */
  struct run d;
  run_worker("default", NULL, (const char *const[]){NULL}, &d);
  REQUIRE(d.lines == 1, "default: %d start lines, want 1", d.lines);
  field(d.line, "kernel", kernel, sizeof(kernel));
  field(d.line, "why", why, sizeof(why));
  field(d.line, "was", was, sizeof(was));
  double g = atof(field(d.line, "gflops", gflops, sizeof(gflops)));
  field(d.line, "blas", blas, sizeof(blas));
  REQUIRE(strncmp(blas, "OpenBLAS ", 9) == 0, "default: blas=\"%s\", want OpenBLAS's version",
          blas);
  REQUIRE(kernel[0] && strcmp(kernel, "none") != 0, "default: no kernel named: %s", d.line);
  REQUIRE(g > 0, "default: gflops=%s, want > 0", gflops);
  REQUIRE(strcmp(why, "default") == 0 || (strcmp(why, "auto") == 0 && was[0]),
          "default: why=%s was=%s: want default, or auto with was=", why, was);
  require_trained("default", &d);
  char picked[64]; /* OpenBLAS's own pick */
  snprintf(picked, sizeof(picked), "%s", strcmp(why, "auto") == 0 ? was : kernel);
  printf("default: kernel=%s why=%s%s%s gflops=%.1f\n", kernel, why, was[0] ? " was=" : "", was, g);

  /* 2. a named kernel: re-executed, once */
  const char *forced = strcmp(picked, "Haswell") != 0 ? "Haswell" : "Sandybridge";
  if (strcmp(forced, "Haswell") == 0 ? !avx2 : !avx) {
    harness_skip("this CPU cannot run %s: no forced kernel nor OPENBLAS_CORETYPE case\n", forced);
  } else {
    char flag[64];
    snprintf(flag, sizeof(flag), "--blas-kernel=%s", forced);
    struct run f;
    run_worker("forced", NULL, (const char *const[]){flag, NULL}, &f);
    REQUIRE(f.lines == 1, "forced: %d start lines, want 1 (one re-execution)", f.lines);
    field(f.line, "kernel", kernel, sizeof(kernel));
    field(f.line, "why", why, sizeof(why));
    field(f.line, "was", was, sizeof(was));
    REQUIRE(strcmp(kernel, forced) == 0 && strcmp(why, "user") == 0,
            "forced: kernel=%s why=%s, want kernel=%s why=user", kernel, why, forced);
    REQUIRE(strcmp(was, picked) == 0, "forced: was=%s, want %s (OpenBLAS's pick before the exec)",
            was, picked);
    REQUIRE(atof(field(f.line, "gflops", gflops, sizeof(gflops))) > 0, "forced: gflops=%s", gflops);
    require_trained("forced", &f);
    printf("--blas-kernel %s: re-executed from %s, kernel=%s\n", forced, was, kernel);

    /* 3. OPENBLAS_CORETYPE wins under auto */
    struct run e;
    run_worker("env", forced, (const char *const[]){"--blas-kernel", "auto", NULL}, &e);
    REQUIRE(e.lines == 1, "env: %d start lines", e.lines);
    field(e.line, "kernel", kernel, sizeof(kernel));
    field(e.line, "why", why, sizeof(why));
    field(e.line, "was", was, sizeof(was));
    REQUIRE(strcmp(kernel, forced) == 0 && strcmp(why, "user") == 0 && !was[0],
            "env OPENBLAS_CORETYPE=%s: kernel=%s why=%s was=%s, want kernel=%s why=user, no "
            "re-execution",
            forced, kernel, why, was, forced);
    require_trained("env", &e);
    printf("OPENBLAS_CORETYPE=%s with --blas-kernel auto: kept\n", forced);
  }

  /* 4. keep */
  struct run k;
  run_worker("keep", NULL, (const char *const[]){"--blas-kernel", "keep", NULL}, &k);
  field(k.line, "kernel", kernel, sizeof(kernel));
  field(k.line, "why", why, sizeof(why));
  REQUIRE(k.lines == 1 && strcmp(kernel, picked) == 0 && strcmp(why, "keep") == 0,
          "keep: kernel=%s why=%s, want kernel=%s why=keep", kernel, why, picked);
  require_trained("keep", &k);

  /* 5. a kernel this CPU cannot run */
  const char *refused = !__builtin_cpu_supports("avx512f") ? "SkylakeX"
                        : !__builtin_cpu_supports("fma4")  ? "Bulldozer"
                                                           : NULL;
  if (!refused) {
    harness_skip("this CPU runs SkylakeX and Bulldozer: no kernel to refuse\n");
  } else {
    struct run x;
    run_worker("refused", NULL, (const char *const[]){"--blas-kernel", refused, NULL}, &x);
    char want[160];
    const char *feature = strcmp(refused, "SkylakeX") == 0 ? "AVX512F" : "FMA4";
    snprintf(want, sizeof(want), "ps-worker: option --blas-kernel: \"%s\": kernel %s needs ",
             refused, refused);
    REQUIRE(x.exit_code == 2, "--blas-kernel %s: exit %d, want 2", refused, x.exit_code);
    REQUIRE(harness_grep(x.log, want) == 1 && harness_grep(x.log, feature) == 1 && x.lines == 0,
            "--blas-kernel %s: stderr lacks \"%s...%s\" (or the worker started)", refused, want,
            feature);
    printf("--blas-kernel %s refused: %s\n", refused, want);
  }
  return harness_status();
}
