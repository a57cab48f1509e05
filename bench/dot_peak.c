/* The CPU's peak rate of the integer dot instruction that neuron's decode kernel is built on
   (engine/model/_cpu_kernel.c): 512-bit `vpdpbusd` (AVX-512 VNNI: 64 u8 x s8 products each)
   where the CPU has it, else AVX2's `vpmaddubsw` (32 products) with int16 sums widened once a
   group of 8 steps, as the kernel's two paths compute them. Independent accumulators hide the
   instructions' latency, so the loop runs at their throughput. bench/batch_ceiling.py
   compiles and runs it.

       cc -O2 -fopenmp dot_peak.c -o dot_peak && ./dot_peak THREADS

   Prints the products per second of all THREADS threads together, and the instruction set. */

#include <immintrin.h>
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#define ROUNDS 20000000L

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

/* Each returns the products it computed; the sums are kept so the loop is not optimised out. */
__attribute__((target("avx512f,avx512bw,avx512vnni"))) static long vnni(long rounds, int *sink) {
    __m512i acc[12];
    const __m512i w = _mm512_set1_epi8(7), x = _mm512_set1_epi8(3);
    for (int i = 0; i < 12; i++) acc[i] = _mm512_setzero_si512();
    for (long r = 0; r < rounds; r++)
#pragma GCC unroll 12 /* the accumulators then stay in registers */
        for (int i = 0; i < 12; i++) acc[i] = _mm512_dpbusd_epi32(acc[i], w, x);
    __m512i s = acc[0];
    for (int i = 1; i < 12; i++) s = _mm512_add_epi32(s, acc[i]);
    *sink += _mm512_reduce_add_epi32(s);
    return rounds * 12 * 64;
}

/* The AVX2 kernel's dot for 4-bit weights (groupk_avx2): each step's `vpmaddubsw` pairs (32
   products) added as int16 over 8 steps, then one `vpmaddwd` widens them to int32. */
#define AVX2_STEP(acc, w, x) acc = _mm256_add_epi16(acc, _mm256_maddubs_epi16(w, x))
__attribute__((target("avx2"))) static long avx2(long rounds, int *sink) {
    const __m256i w = _mm256_set1_epi8(7), one = _mm256_set1_epi16(1);
    __m256i a0 = _mm256_setzero_si256(), a1 = a0;
    __m256i x0 = _mm256_set1_epi8(3), x1 = _mm256_set1_epi8(4), x2 = _mm256_set1_epi8(5),
            x3 = _mm256_set1_epi8(6);
    for (long r = 0; r < rounds; r++) {
        __m256i s0 = _mm256_setzero_si256(), s1 = s0, s2 = s0, s3 = s0;
        for (int step = 0; step < 2; step++) { /* 4 chains x 2 = a group's 8 steps */
            /* the inputs "change" every step (an empty asm), so the compiler cannot compute
               the products once, outside the loop, and time the additions alone */
            __asm__("" : "+x"(x0), "+x"(x1), "+x"(x2), "+x"(x3));
            AVX2_STEP(s0, w, x0);
            AVX2_STEP(s1, w, x1);
            AVX2_STEP(s2, w, x2);
            AVX2_STEP(s3, w, x3);
        }
        a0 = _mm256_add_epi32(a0, _mm256_madd_epi16(_mm256_add_epi16(s0, s1), one));
        a1 = _mm256_add_epi32(a1, _mm256_madd_epi16(_mm256_add_epi16(s2, s3), one));
    }
    int lanes[8];
    _mm256_storeu_si256((__m256i *)lanes, _mm256_add_epi32(a0, a1));
    for (int i = 0; i < 8; i++) *sink += lanes[i];
    return rounds * 8 * 32;
}

int main(int argc, char **argv) {
    const int threads = argc > 1 ? atoi(argv[1]) : 1;
    __builtin_cpu_init();
    const int has_vnni = __builtin_cpu_supports("avx512vnni");
    if (!has_vnni && !__builtin_cpu_supports("avx2")) {
        printf("0 none 0\n");
        return 0;
    }
    double best = 0.0;
    int sink = 0;
    for (int repeat = 0; repeat < 3; repeat++) {
        long products = 0;
        const double start = now();
#pragma omp parallel num_threads(threads) reduction(+ : products, sink)
        products += has_vnni ? vnni(ROUNDS / 4, &sink) : avx2(ROUNDS / 4, &sink);
        const double rate = (double)products / (now() - start);
        best = rate > best ? rate : best;
    }
    printf("%.6g %s %d\n", best, has_vnni ? "avx512vnni" : "avx2", sink & 1);
    return 0;
}
