// Runtime dispatch of the CPU backend's hot loops: GCC builds each marked function for AVX-512
// (F), AVX2 and the baseline, and the loader picks the best the CPU has (an ifunc). The
// clones are named by instruction-set feature, not by CPU model: an "arch=haswell" clone is taken
// only on CPUs the compiler identifies as Intel Haswell or later, never on an AMD EPYC, which
// then ran the baseline clone although it has AVX-512. The loops are
// written so that the compiler vectorises them; every clone computes the same bits (no
// reassociation: -ffast-math is never on, and the loops either do element-wise work or keep a
// fixed order).
// Off in sanitizer builds, where the loader runs the resolver before the sanitizer runtime is up,
// and with clang (the fuzz build), which spells the attribute differently.
#pragma once

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && \
    !defined(__SANITIZE_THREAD__) && !defined(__SANITIZE_ADDRESS__)
#define GRADWIRE_VECTOR_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define GRADWIRE_VECTOR_CLONES
#endif
