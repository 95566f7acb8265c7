// Internal to attention/: HP_VECTOR_CLONES marks a hot leaf function for two builds, AVX2/FMA
// (x86-64-v3) and baseline x86-64, picked once at load time by the CPU it runs on (GCC
// target_clones). Elsewhere (other compilers, other architectures) it is empty. Helpers the
// marked function calls must be inlined into it (templates in the same file, always_inline)
// to be vectorised for the wider target as well.
#pragma once

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define HP_VECTOR_CLONES __attribute__((target_clones("arch=x86-64-v3", "default")))
// Also an AVX-512 (x86-64-v4) build, for loops that the compiler vectorises itself: the file
// that uses it is compiled with -mprefer-vector-width=512, so that build uses 16-float vectors.
#define HP_VECTOR_CLONES_512 \
  __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#define HP_ALWAYS_INLINE __attribute__((always_inline)) inline
#else
#define HP_VECTOR_CLONES
#define HP_VECTOR_CLONES_512
#define HP_ALWAYS_INLINE inline
#endif
