/* clones: the function multi-versioning of the -O3 kernels (tensor_math,
 * dtype): CLONES builds a function for AVX-512, AVX2 and plain x86-64 and
 * picks one when the program loads, so one binary runs everywhere at the
 * speed of the CPU it finds (docs/ARCHITECTURE.md, Pitfalls). FMA_CLONES does the same by
 * architecture level, for kernels that need fused multiply-add. Elsewhere
 * (other CPUs, old clang) they are nothing and the plain loop is built. */
#ifndef PS_CLONES_H
#define PS_CLONES_H

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#elif defined(__x86_64__) && defined(__clang__) && __clang_major__ >= 18
/* clang before 18 names the dispatcher of an exported clone "X.ifunc" and
 * never defines X (llvm-project PR 71706): nothing calling X would link */
#define CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define CLONES
#endif

/* The x86-64-v3/v4 clones have FMA (and F16C); the default one calls libm. */
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define FMA_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define FMA_CLONES
#endif

#endif
