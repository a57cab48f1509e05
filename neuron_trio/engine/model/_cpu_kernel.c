/* Weight-only 4-bit matrix product for CPU decode: y = x · Wᵀ, W in groups of 32 inputs.

   Why: torch's int4 CPU kernel (`_weight_int4pack_mm_for_cpu`) multiplies in bfloat16/float
   and was the largest share of a decode step (about 60% on 2 cores). This kernel does what
   llama.cpp does on the same CPU (Q4_1 weights times Q8 activations): each row of x is
   quantised to int8 per group of 32 (one scale each), and each group's dot product is one
   integer instruction (AVX-512 VNNI `vpdpbusd`, or AVX2 `vpmaddubsw`, its int16 sums widened
   by `vpmaddwd` once a group: groupk_avx2), scaled in float. The group's minimum term uses
   the exact float sum of x over the group.

   Weights: w = scale · q + minimum with q in 0..15, per row and group of 32 (packing.pack_q4),
   scale and minimum in float16 (as Q4_1 keeps them: a Q4_1 weight comes back exactly), laid
   out in tiles of 8 rows by packing.tile_q4 (see the kernel below). With a fifth bit (`high`,
   packing.tile_high) q is 0..31: Q5_0 and Q5_1 weights, exactly, at the same speed as 4 bits
   plus 4 bytes a row and group (their files' own size, where int8 would read ~1.5x more).

   Threads: OpenMP over output rows. Built with -fopenmp and imported after torch, so the
   libgomp.so.1 torch already loaded is the one used: one thread pool, no oversubscription.
   The GIL is released while it computes. Each thread takes one contiguous run of the tiles
   (TILES_SHARED below says why).

   int8 weights (with their own scale per row, or FLAG_GROUPED's per row and group of 32)
   take the same activations; see "int8 weights" below.

   The module exposes `matmul`, `attend`, `rope_write` and `refine` (pointers and strides as
   ints, from engine/model's linear.py (Q4Linear, Q8Linear, RefinedHead), attention.py and
   rope.py), `norm_add` and `decode_layers` (_cpu_layers.c, included below: every layer of a
   decode step, from native_decode.py), `isa()`: "avx512vnni", "avx2" or "" (a CPU it cannot
   use), and `use(name)` for tests (which also takes "avx2-int8": see groupk_avx2).
   Both instruction sets give the same bits (the integers are exact, and the float operations
   run in the same order), and so do all batch sizes: batching never changes a sequence's
   tokens. */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define GROUP 32
#define FLAG_X_BF16 1
#define FLAG_Y_BF16 2
#define FLAG_CENTRED 4 /* 5-bit weights of Q5_0: minimum = -16 · scale, not read (saves its bytes) */
#define FLAG_ONE_PASS 8 /* 4-bit weights: one int8 pass of the activations, no residual pass
                           (the head's coarse pass, whose best candidates are recomputed
                           exactly anyway: half its dot products) */
#define FLAG_COARSE 32 /* the output head's coarse pass (with FLAG_ONE_PASS): symmetric 4-bit
                         weights, w = scale · (q - 8), no minimum read, times int8 activations
                         with one scale per row, so that a group costs the dot products, one
                         integer correction and one multiply-add (not four float operations):
                         Qwen2.5's coarse pass at batch 8, 5.1 -> 4.5 ms */
#define FLAG_GLU_ROUNDED 16 /* SwiGLU of a bfloat16 x rounds SiLU(gate) and its product with up
                               to bfloat16, as torch does in that dtype (the int8 layers: their
                               GLU ran in torch first; see linear.py's _Q8_FLAGS) */
#define FLAG_GROUPED 64 /* int8 weights with a float16 scale per row and group of 32 (`scale` in
                          the tiles' layout [tiles, groups, 8], as the 4-bit weights' scales),
                          not one float32 per row: the formats whose values are integers times
                          a scale per 32 or 16 (Q8_0, IQ4_NL, IQ4_XS, Q3_K), kept exactly, and
                          Q2_K/Q6_K on an 8-bit grid per 32. Two int8 passes of the
                          activations, as the 4-bit weights take, unless FLAG_ONE_PASS. */
/* The 4-bit tiles' variants (`kind`), each compiled on its own so that no loop tests them */
#define KIND_FIVE 1 /* 5-bit codes (j->high) */
#define KIND_ONE 2  /* no residual pass (j->qlo is NULL) */
#define KIND_COARSE 4 /* FLAG_COARSE (always with KIND_ONE, never with KIND_FIVE) */

/* How the threads share a product's tiles: each a contiguous run of them. Dealt out in
   dynamic chunks instead, the threads' reads interleaved and each thread's stream through
   memory broke up: on 2 cores a 135M model's products took ~1.4x as long at batch 1 (2.9 vs
   2.1 ms a step) and ~1.1x at batch 8. Runs that a thread done early takes over from the
   other's end (a claim per chunk, each a quarter of what was left) cut the wait at the end
   of a product (5.7-7.5 -> 1.3-1.7 us at batch 8) but not a step's time: SmolLM2 9.60 vs
   9.67 ms at batch 8, 4.12 vs 4.13 at batch 1, medians of 8 rounds alternated in one
   process, and no clear gain with a third of a core taken by another process either. */
#define TILES_SHARED "omp for schedule(static)"
#define TARGET_AVX2 __attribute__((target("avx2,fma,f16c")))
#define TARGET_VNNI __attribute__((target("avx2,fma,f16c,avx512f,avx512vl,avx512bw,avx512vnni")))

static inline uint16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40); /* quiet NaN */
    u += 0x7fffu + ((u >> 16) & 1u); /* round to nearest even, as torch does */
    return (uint16_t)(u >> 16);
}

/* One value of a float32 or bfloat16 array, as float32; and back (rounded as above). */
static inline float load_f(const void *p, int bf16, size_t i) {
    if (!bf16) return ((const float *)p)[i];
    uint32_t u = (uint32_t)((const uint16_t *)p)[i] << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline void store_f(void *p, int bf16, size_t i, float f) {
    if (bf16)
        ((uint16_t *)p)[i] = f32_to_bf16(f);
    else
        ((float *)p)[i] = f;
}

/* ---- activations: int8 per group of 32, with each group's scale and exact float sum ---- */

TARGET_AVX2 static inline __m256 load8(const void *x, int bf16, size_t i) {
    if (bf16) {
        __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)x + i));
        return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    }
    return _mm256_loadu_ps((const float *)x + i);
}

/* 8 floats to bfloat16, rounded as f32_to_bf16 (to nearest even; NaN stays a quiet NaN) */
TARGET_AVX2 static inline void store8_f(void *p, int bf16, size_t i, __m256 v) {
    if (!bf16) {
        _mm256_storeu_ps((float *)p + i, v);
        return;
    }
    const __m256i u = _mm256_castps_si256(v);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff)));
    r = _mm256_srli_epi32(r, 16);
    const __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(u, _mm256_set1_epi32(0x7fffffff)),
                                           _mm256_set1_epi32(0x7f800000));
    const __m256i quiet = _mm256_or_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(0x40));
    r = _mm256_blendv_epi8(r, quiet, nan);
    const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0x08);
    _mm_storeu_si128((__m128i *)((uint16_t *)p + i), _mm256_castsi256_si128(packed));
}

TARGET_AVX2 static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

TARGET_AVX2 static inline float hmax8(__m256 v) {
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    s = _mm_max_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

TARGET_AVX2 static inline __m256i pack32(__m256 v0, __m256 v1, __m256 v2, __m256 v3,
                                         __m256 inv) {
    /* round to nearest (MXCSR default), then 4 x 8 int32 to 32 int8 in order */
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    __m256i i0 = _mm256_cvtps_epi32(_mm256_mul_ps(v0, inv));
    __m256i i1 = _mm256_cvtps_epi32(_mm256_mul_ps(v1, inv));
    __m256i i2 = _mm256_cvtps_epi32(_mm256_mul_ps(v2, inv));
    __m256i i3 = _mm256_cvtps_epi32(_mm256_mul_ps(v3, inv));
    __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(i0, i1), _mm256_packs_epi32(i2, i3));
    return _mm256_permutevar8x32_epi32(p, order);
}

TARGET_AVX2 static inline float amax32(__m256 v0, __m256 v1, __m256 v2, __m256 v3) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    __m256 m = _mm256_max_ps(_mm256_andnot_ps(sign, v0), _mm256_andnot_ps(sign, v1));
    m = _mm256_max_ps(m, _mm256_andnot_ps(sign, v2));
    return hmax8(_mm256_max_ps(m, _mm256_andnot_ps(sign, v3)));
}

/* Each group of 32: int8 qx with scale dx, the exact float sum sx, and with `qlo` the int8
   residual x - dx · qx in steps of dx / LOW_STEPS (two int8 passes: ~15 bits; one int8 pass
   cost 4-bit decode several points of top-1 agreement with float32). The residual is at most
   half a step of qx, so it fits in int8 at 256 steps (its rare 128 saturates to 127).
   A fixed ratio of the two scales lets the product join the passes' integer sums exactly,
   qx's times 256 plus qlo's, and scale them once. */
#define LOW_BITS 8
#define LOW_STEPS ((float)(1 << LOW_BITS))
TARGET_AVX2 static void quantize_rows(const void *x, int bf16, int batch, int in, int8_t *qx,
                                      float *dx, float *sx, int8_t *qlo, int signed_lo) {
    const int groups = in / GROUP;
    for (int b = 0; b < batch; b++) {
        for (int g = 0; g < groups; g++) {
            const size_t at = (size_t)b * in + (size_t)g * GROUP, gi = (size_t)b * groups + g;
            __m256 v0 = load8(x, bf16, at), v1 = load8(x, bf16, at + 8);
            __m256 v2 = load8(x, bf16, at + 16), v3 = load8(x, bf16, at + 24);
            const float m = amax32(v0, v1, v2, v3);
            const float d = m / 127.0f;
            sx[gi] = hsum8(_mm256_add_ps(_mm256_add_ps(v0, v1), _mm256_add_ps(v2, v3)));
            dx[gi] = d;
            const __m256 inv = _mm256_set1_ps(m > 0.0f ? 127.0f / m : 0.0f);
            const __m256i q = pack32(v0, v1, v2, v3, inv);
            _mm256_storeu_si256((__m256i *)(qx + at), q);
            if (qlo == NULL) continue;
            /* the residual: x minus what q keeps of it */
            const __m256 dv = _mm256_set1_ps(d);
            __m128i q0 = _mm256_castsi256_si128(q), q1 = _mm256_extracti128_si256(q, 1);
            v0 = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q0)), dv, v0);
            v1 = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(q0, 8))), dv, v1);
            v2 = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q1)), dv, v2);
            v3 = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(q1, 8))), dv, v3);
            const __m256 rinv = _mm256_set1_ps(d > 0.0f ? LOW_STEPS / d : 0.0f);
            __m256i lo = pack32(v0, v1, v2, v3, rinv);
            /* int8 weights (`signed_lo`) take x with their sign (sign_epi8), which cannot
               negate -128: its rare -128 becomes -127 (1/256 of a step) */
            if (signed_lo) lo = _mm256_max_epi8(lo, _mm256_set1_epi8(-127));
            _mm256_storeu_si256((__m256i *)(qlo + at), lo);
        }
    }
}

/* FLAG_COARSE: row x as int8 qx with one scale dx (its largest magnitude / 127), and each
   group's integer sum of qx in xsum. */
TARGET_AVX2 static void quantize_row_scaled(const void *x, int bf16, int in, int8_t *qx, float *dx,
                                            int32_t *xsum) {
    float top = 0.0f;
    for (int at = 0; at < in; at += GROUP) {
        const float m = amax32(load8(x, bf16, at), load8(x, bf16, at + 8),
                               load8(x, bf16, at + 16), load8(x, bf16, at + 24));
        top = m > top ? m : top;
    }
    *dx = top / 127.0f;
    const __m256 inv = _mm256_set1_ps(top > 0.0f ? 127.0f / top : 0.0f);
    for (int g = 0; g < in / GROUP; g++) {
        const size_t at = (size_t)g * GROUP;
        const __m256i q = pack32(load8(x, bf16, at), load8(x, bf16, at + 8),
                                 load8(x, bf16, at + 16), load8(x, bf16, at + 24), inv);
        _mm256_storeu_si256((__m256i *)(qx + at), q);
        /* 1 x each byte, pairs summed to int16, then to int32 */
        const __m256i pairs = _mm256_maddubs_epi16(_mm256_set1_epi8(1), q);
        const __m256i quads = _mm256_madd_epi16(pairs, _mm256_set1_epi16(1));
        int32_t lanes[8];
        _mm256_storeu_si256((__m256i *)lanes, quads);
        xsum[g] = lanes[0] + lanes[1] + lanes[2] + lanes[3] + lanes[4] + lanes[5] + lanes[6] + lanes[7];
    }
}

/* ---- prologues: what the layer did to its input before the product, fused here so that a
   decode step does not pay torch's per-op overhead for them (~2 us an op, ~16 ops a layer) --

   PRO_RMSNORM: x is the float32 residual stream; x / rms(x) · weight (RMSNorm, eps).
   PRO_SILU / PRO_GELU: x is [batch, 2 · in], gate then up; act(gate) · up (SwiGLU, GeGLU
   with tanh). Each writes float32 rows `in` long. */

#define PRO_NONE 0
#define PRO_RMSNORM 1
#define PRO_SILU 2
#define PRO_GELU 3

TARGET_AVX2 static inline __m256 exp256(__m256 x) {
    /* e^x = 2^n · e^r, |r| <= ln2 / 2, e^r by a degree-6 polynomial (float32 accurate) */
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.0f)), _mm256_set1_ps(88.0f));
    __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

/* v rounded to bfloat16's precision (to nearest even), still as floats */
TARGET_AVX2 static inline __m256 round_bf16(__m256 v) {
    uint16_t h[8];
    store8_f(h, 1, 0, v);
    return load8(h, 1, 0);
}

TARGET_AVX2 static void prologue(const void *x, int bf16, int mode, const float *weight, float eps,
                                 int batch, int in, float *out, int rounded) {
    const __m256 one = _mm256_set1_ps(1.0f);
    for (int b = 0; b < batch; b++) {
        float *o = out + (size_t)b * in;
        if (mode == PRO_RMSNORM) {
            const size_t at = (size_t)b * in;
            __m256 ss = _mm256_setzero_ps();
            for (int i = 0; i < in; i += 8) {
                __m256 v = load8(x, bf16, at + i);
                ss = _mm256_fmadd_ps(v, v, ss);
            }
            const __m256 inv = _mm256_set1_ps(1.0f / sqrtf(hsum8(ss) / (float)in + eps));
            for (int i = 0; i < in; i += 8) {
                __m256 v = _mm256_mul_ps(load8(x, bf16, at + i), inv);
                _mm256_storeu_ps(o + i, _mm256_mul_ps(v, _mm256_loadu_ps(weight + i)));
            }
        } else {
            const size_t gate = (size_t)b * 2 * in, up = gate + in;
            for (int i = 0; i < in; i += 8) {
                __m256 g = load8(x, bf16, gate + i), act;
                if (mode == PRO_SILU) { /* g / (1 + e^-g) */
                    __m256 e = exp256(_mm256_sub_ps(_mm256_setzero_ps(), g));
                    act = _mm256_div_ps(g, _mm256_add_ps(one, e));
                } else { /* 0.5 g (1 + tanh(u)), tanh(u) = 1 - 2 / (1 + e^2u) */
                    __m256 g3 = _mm256_mul_ps(_mm256_mul_ps(g, g), g);
                    __m256 u = _mm256_mul_ps(_mm256_set1_ps(0.7978845608028654f),
                                             _mm256_fmadd_ps(_mm256_set1_ps(0.044715f), g3, g));
                    __m256 e = exp256(_mm256_add_ps(u, u));
                    __m256 t = _mm256_sub_ps(one, _mm256_div_ps(_mm256_set1_ps(2.0f),
                                                                _mm256_add_ps(one, e)));
                    act = _mm256_mul_ps(_mm256_mul_ps(_mm256_set1_ps(0.5f), g),
                                        _mm256_add_ps(one, t));
                }
                if (rounded) act = round_bf16(act);
                __m256 y = _mm256_mul_ps(act, load8(x, bf16, up + i));
                _mm256_storeu_ps(o + i, rounded ? round_bf16(y) : y);
            }
        }
    }
}

/* ---- the product: tiles of 8 output rows, so that no horizontal sum is ever needed ----

   Lane r of a 256-bit vector holds 4 consecutive weights of row r; the 4 matching int8
   activations are broadcast to every lane, and one dot instruction adds row r's 4 products
   into lane r. Eight such steps cover a group of 32; its int32 sums are then scaled in float
   by the 8 rows' scales at once. Per tile and group the kernel reads 128 bytes of nibbles
   (4 x 32: step k's bytes in the low nibbles, step k + 4's in the high ones), 8 scales and 8
   minimums. */

typedef struct {
    const uint8_t *qs;
    const void *scale, *minimum; /* 4-bit: float16 per row and group; int8: float32 per row */
    const int8_t *qx, *qlo; /* qlo: the residual pass (4-bit weights), or NULL (int8) */
    const float *dx, *sx; /* FLAG_COARSE: dx one scale per row, and sx unused */
    const int32_t *xsum;  /* FLAG_COARSE: the integer sum of qx over each row's groups */
    uint8_t *qxu;         /* int8 weights: room for qx + 128 (vnni16_run fills it) */
    uint8_t *qlou;        /* int8 weights with FLAG_GROUPED in two passes: qlo + 128 */
    const int32_t *wsum;  /* int8 weights: 128 x each row's group sums, in tiles [.., groups, 8] */
    const uint32_t *high; /* 5-bit weights: the fifth bits, per tile and group 8 steps x 32 bits
                             (bit 4 r + i: row r's weight i of the step), or NULL (4 bits) */
    int batch, in, out, flags;
    void *y;
    size_t ystride; /* y's row stride in elements: `out`, or more when y is a slice of wider rows */
} job_t;

/* The 4-bit tiles' variant of a job (KIND_*). */
static inline int job_kind(const job_t *j) {
    if (j->flags & FLAG_COARSE) return KIND_COARSE | KIND_ONE;
    return (j->high != NULL ? KIND_FIVE : 0) | (j->qlo == NULL ? KIND_ONE : 0);
}

TARGET_AVX2 static inline void store8(const job_t *j, int b, int r0, const float *v) {
    store8_f(j->y, j->flags & FLAG_Y_BF16, (size_t)b * j->ystride + r0, _mm256_loadu_ps(v));
}

/* w (a step's 8 rows x 4 weights, 0..15) plus 16 where the step's bit 4 r + i is set. */
TARGET_VNNI static inline __m256i fifth_vnni(__m256i w, uint32_t bits) {
    return _mm256_mask_add_epi8(w, (__mmask32)bits, w, _mm256_set1_epi8(16));
}

TARGET_AVX2 static inline __m256i fifth_avx2(__m256i w, uint32_t bits) {
    /* byte n gets byte n / 8 of the bits, keeps bit n % 8 of it, and that becomes 16 */
    const __m256i spread = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1,
                                            2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3);
    const __m256i select = _mm256_set1_epi64x((long long)0x8040201008040201ULL);
    const __m256i b = _mm256_shuffle_epi8(_mm256_set1_epi32((int)bits), spread);
    const __m256i set = _mm256_cmpeq_epi8(_mm256_and_si256(b, select), select);
    return _mm256_or_si256(w, _mm256_and_si256(set, _mm256_set1_epi8(16)));
}

/* The most groups of 32 inputs whose unpacked 5-bit weights a thread keeps for a tile's row
   blocks (NAME##_rows): 256 x 8 vectors, 64 KiB of its stack; wider inputs unpack per block. */
#define UNPACKED_GROUPS 256

#define TILE_KERNEL(NAME, TARGET, DOT, BUFFERED)                                               \
    /* tile t's group g of weights, one vector a step (0..15, or 0..31 with `five`) */         \
    TARGET static inline __attribute__((always_inline)) void NAME##_unpack(                    \
        const job_t *j, int t, int g, const int five, __m256i *w) {                            \
        const int groups = j->in / GROUP;                                                      \
        const uint8_t *wt = j->qs + (size_t)t * groups * 128;                                  \
        const __m256i low = _mm256_set1_epi8(0x0F);                                            \
        /* the next tile's group g: its read from memory overlaps this tile's maths */         \
        const char *next = (const char *)wt + (size_t)(groups + g) * 128;                      \
        _mm_prefetch(next, _MM_HINT_T0);                                                       \
        _mm_prefetch(next + 64, _MM_HINT_T0);                                                  \
        for (int k = 0; k < 4; k++) {                                                          \
            __m256i v = _mm256_loadu_si256((const __m256i *)(wt + (size_t)g * 128 + k * 32));  \
            w[k] = _mm256_and_si256(v, low);                                                   \
            w[k + 4] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);                         \
        }                                                                                      \
        if (five) {                                                                            \
            const uint32_t *h = j->high + ((size_t)t * groups + g) * 8;                        \
            for (int k = 0; k < 8; k++) w[k] = fifth_##NAME(w[k], h[k]);                       \
        }                                                                                      \
    }                                                                                          \
    /* `unpacked`: the tile's weights already unpacked (NAME##_rows), or NULL */               \
    TARGET static inline __attribute__((always_inline)) void NAME##_tile_from(                 \
        const job_t *j, int t, int b0, const int nb, const int kind,                           \
        const __m256i *unpacked) {                                                             \
        const int groups = j->in / GROUP, five = kind & KIND_FIVE, two = !(kind & KIND_ONE);   \
        const int coarse = kind & KIND_COARSE;                                                 \
        const uint16_t *st = (const uint16_t *)j->scale + (size_t)t * groups * 8;              \
        const uint16_t *mt = (const uint16_t *)j->minimum + (size_t)t * groups * 8;            \
        __m256 acc[4];                                                                         \
        for (int k = 0; k < nb; k++) acc[k] = _mm256_setzero_ps();                             \
        for (int g = 0; g < groups; g++) {                                                     \
            __m256i w[8];                                                                      \
            if (unpacked != NULL)                                                              \
                for (int k = 0; k < 8; k++) w[k] = _mm256_load_si256(unpacked + (size_t)g * 8 + k); \
            else                                                                               \
                NAME##_unpack(j, t, g, five, w);                                               \
            /* two passes: the scales in steps of 1 / LOW_STEPS (exact: a power of two) */     \
            const __m256 sc = _mm256_mul_ps(                                                   \
                _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(st + (size_t)g * 8))),       \
                _mm256_set1_ps(two ? 1.0f / LOW_STEPS : 1.0f));                                \
            const __m256 mn = coarse ? sc                                                      \
                : j->flags & FLAG_CENTRED                                                      \
                ? _mm256_mul_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(st + (size_t)g * 8))), \
                                _mm256_set1_ps(-16.0f))                                        \
                : _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(mt + (size_t)g * 8)));     \
            for (int k = 0; k < nb; k++) {                                                     \
                const size_t xg = (size_t)(b0 + k) * groups + g;                               \
                __m256i sum = groupk_##NAME(w, (const int32_t *)(j->qx + xg * GROUP), five);   \
                if (coarse) { /* q - 8: the weights' offset out through qx's group sum */      \
                    sum = _mm256_sub_epi32(sum, _mm256_set1_epi32(8 * j->xsum[xg]));           \
                    acc[k] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum), sc, acc[k]);             \
                    continue;                                                                  \
                }                                                                              \
                if (two)                                                                       \
                    sum = _mm256_add_epi32(_mm256_slli_epi32(sum, LOW_BITS),                   \
                                           groupk_##NAME(w, (const int32_t *)(j->qlo + xg * GROUP), five)); \
                const __m256 f = _mm256_cvtepi32_ps(sum);                                      \
                acc[k] = _mm256_fmadd_ps(f, _mm256_mul_ps(sc, _mm256_set1_ps(j->dx[xg])), acc[k]); \
                acc[k] = _mm256_fmadd_ps(mn, _mm256_set1_ps(j->sx[xg]), acc[k]);               \
            }                                                                                  \
        }                                                                                      \
        for (int k = 0; k < nb; k++) {                                                         \
            float v[8];                                                                        \
            if (coarse) acc[k] = _mm256_mul_ps(acc[k], _mm256_set1_ps(j->dx[b0 + k]));         \
            _mm256_storeu_ps(v, acc[k]);                                                       \
            store8(j, b0 + k, t * 8, v);                                                       \
        }                                                                                      \
    }                                                                                          \
    TARGET static inline __attribute__((always_inline)) void NAME##_tile(                      \
        const job_t *j, int t, int b0, const int nb, const int kind) {                         \
        NAME##_tile_from(j, t, b0, nb, kind, NULL);                                            \
    }                                                                                          \
    TARGET static inline __attribute__((always_inline)) void NAME##_blocks(                    \
        const job_t *j, int t, const int kind, const __m256i *unpacked) {                      \
        int b = 0;                                                                             \
        for (; b + 4 <= j->batch; b += 4) NAME##_tile_from(j, t, b, 4, kind, unpacked);        \
        for (; b + 2 <= j->batch; b += 2) NAME##_tile_from(j, t, b, 2, kind, unpacked);        \
        for (; b < j->batch; b++) NAME##_tile_from(j, t, b, 1, kind, unpacked);                \
    }                                                                                          \
    /* Rows in blocks of 4 (then 2, then 1), each block a pass over the tile's weights. With   \
       BUFFERED, 5-bit weights that more than one block reads are unpacked once into `room`    \
       (the tile's groups x 8 vectors: at most UNPACKED_GROUPS groups) and read back from      \
       there: the fifth bits cost ~6 vector ops a step and tile to spread, ~3x the nibbles'.   \
       The same weights, so the same bits. */                                                  \
    TARGET static inline __attribute__((always_inline)) void NAME##_rows(                      \
        const job_t *j, int t, const int kind, __m256i *room) {                                \
        const int groups = j->in / GROUP;                                                      \
        if (BUFFERED && (kind & KIND_FIVE) && j->batch > 4 && groups <= UNPACKED_GROUPS) {     \
            for (int g = 0; g < groups; g++) NAME##_unpack(j, t, g, 1, room + (size_t)g * 8);  \
            NAME##_blocks(j, t, kind, room);                                                   \
        } else {                                                                               \
            NAME##_blocks(j, t, kind, NULL);                                                   \
        }                                                                                      \
    }                                                                                          \
    TARGET static void NAME##_run(const job_t *j) {                                            \
        const int tiles = j->out / 8;                                                          \
        /* this thread's room for a tile's unpacked weights (NAME##_rows) */                   \
        __m256i room[BUFFERED ? UNPACKED_GROUPS * 8 : 1] __attribute__((aligned(32)));         \
        /* a copy of the loop per variant, so that none tests for the fifth bit or the pass */ \
        switch (job_kind(j)) {                                                                 \
        case 0:                                                                                \
            _Pragma(TILES_SHARED) for (int t = 0; t < tiles; t++)                              \
                NAME##_rows(j, t, 0, room);                                                    \
            break;                                                                             \
        case KIND_FIVE:                                                                        \
            _Pragma(TILES_SHARED) for (int t = 0; t < tiles; t++)                              \
                NAME##_rows(j, t, KIND_FIVE, room);                                            \
            break;                                                                             \
        case KIND_ONE:                                                                         \
            _Pragma(TILES_SHARED) for (int t = 0; t < tiles; t++)                              \
                NAME##_rows(j, t, KIND_ONE, room);                                             \
            break;                                                                             \
        case KIND_COARSE | KIND_ONE:                                                           \
            _Pragma(TILES_SHARED) for (int t = 0; t < tiles; t++)                              \
                NAME##_rows(j, t, KIND_COARSE | KIND_ONE, room);                               \
            break;                                                                             \
        default:                                                                               \
            _Pragma(TILES_SHARED) for (int t = 0; t < tiles; t++)                              \
                NAME##_rows(j, t, KIND_FIVE | KIND_ONE, room);                                 \
        }                                                                                      \
    }

TARGET_VNNI static inline __m256i dot_vnni(__m256i acc, __m256i w, __m256i x) {
    return _mm256_dpbusd_epi32(acc, w, x); /* u8 weights x s8 activations, 4 to a lane */
}

TARGET_AVX2 static inline __m256i dot_avx2(__m256i acc, __m256i w, __m256i x) {
    /* pairs of u8 x s8 summed to int16 (at most 2 x 15 x 128: no saturation), then to int32 */
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(w, x),
                                                   _mm256_set1_epi16(1)));
}

/* One group's 8 steps (weights w, 4 activations x4[s] each) in two chains (steps 0..3 and
   4..7), their integer sum. */
#define GROUP8(NAME, TARGET, DOT)                                                              \
    TARGET static inline __m256i group8_##NAME(const __m256i *w, const int32_t *x4) {          \
        __m256i a = _mm256_setzero_si256(), c = _mm256_setzero_si256();                        \
        for (int s = 0; s < 4; s++) {                                                          \
            a = DOT(a, w[s], _mm256_set1_epi32(x4[s]));                                        \
            c = DOT(c, w[s + 4], _mm256_set1_epi32(x4[s + 4]));                                \
        }                                                                                      \
        return _mm256_add_epi32(a, c);                                                         \
    }

GROUP8(vnni, TARGET_VNNI, dot_vnni)
GROUP8(avx2, TARGET_AVX2, dot_avx2)

/* The same sum for 4-bit weights (0..15, or 0..31 with `five`). VNNI: group8. AVX2: the
   pairs' int16 sums (`vpmaddubsw`) are added as int16 over several steps before one widening
   `vpmaddwd`: 9 multiplies instead of 16 (10 with five). Exact: an int8 activation is at
   least -128 (the residual pass's rare -128) and at most 127, so a lane of 8 steps adds 16
   products of at most 15 x 128, 30,720 < 32,768; 5-bit weights add 4 steps at a time (8
   products of at most 31 x 128, 31,744). */
TARGET_VNNI static inline __m256i groupk_vnni(const __m256i *w, const int32_t *x4, const int five) {
    (void)five;
    return group8_vnni(w, x4);
}

TARGET_AVX2 static inline __m256i groupk_avx2(const __m256i *w, const int32_t *x4, const int five) {
    __m256i a = _mm256_setzero_si256(), c = _mm256_setzero_si256();
    for (int s = 0; s < 4; s++) {
        a = _mm256_add_epi16(a, _mm256_maddubs_epi16(w[s], _mm256_set1_epi32(x4[s])));
        c = _mm256_add_epi16(c, _mm256_maddubs_epi16(w[s + 4], _mm256_set1_epi32(x4[s + 4])));
    }
    const __m256i ones = _mm256_set1_epi16(1);
    if (five) return _mm256_add_epi32(_mm256_madd_epi16(a, ones), _mm256_madd_epi16(c, ones));
    return _mm256_madd_epi16(_mm256_add_epi16(a, c), ones);
}

/* "avx2-int8" (for tests: `use`): AVX2 with each step's pairs widened to int32 at once
   (group8), as before groupk_avx2; the bits must be the same. */
#define fifth_avx2i8 fifth_avx2
#define groupk_avx2i8(w, x4, five) group8_avx2(w, x4)
/* BUFFERED: the AVX2 path only (the 512-bit tiles share 8 rows' unpacking already); avx2-int8
   stays unbuffered, so that the tests hold the buffered path to its bits too */
TILE_KERNEL(vnni, TARGET_VNNI, dot_vnni, 0)
TILE_KERNEL(avx2, TARGET_AVX2, dot_avx2, 1)
TILE_KERNEL(avx2i8, TARGET_AVX2, dot_avx2, 0)

/* ---- AVX-512 VNNI: two tiles (16 rows) per 512-bit vector, up to 8 input rows at once ----

   The same arithmetic as the tiles above, lane for lane and in the same order (so the two
   paths agree bit for bit); a 512-bit vector holds tile t's 8 rows in its low half and tile
   t + 1's in its high half, so each broadcast activation and each instruction serves twice
   the rows, and 8 input rows share each unpacked group of weights. */

#define NEAR_BYTES 8192 /* how many bytes ahead the L1 prefetch reads, at most (see near_ahead) */
#define FAR_PAIRS 4 /* how many pairs of tiles ahead the L2 prefetch reads, at most... */
#define FAR_BYTES 65536 /* ...and how many bytes, at most (at least one pair) */

/* How far ahead (bytes) the L1 prefetch reads, for tiles of `span` bytes: the next pair's same
   lines, or where the pairs are wider than NEAR_BYTES, the lines that far on (in the same pair,
   then the next). Why: lines fetched a whole wide pair ahead (Qwen2.5's 4,864 inputs: 39 KB in
   5 bits, 78 KB in int8) left the 32 KB L1 before their turn came: its batch-8 step took ~0.5
   ms (~2%) less with the cap, every one of 8 rounds alternated in one process; SmolLM2 and
   Gemma 3 (their widest pairs 12 and 16 KB) within noise. A cap of 2 or 4 KB, which also
   reaches the narrow pairs, was ~0.1-0.3 ms faster still on Qwen2.5 but ~0.1 ms slower on the
   other two. */
static inline size_t near_ahead(size_t span) {
    return 2 * span < NEAR_BYTES ? 2 * span : NEAR_BYTES;
}

/* How far ahead (bytes) the L2 prefetch reads, for tiles of `span` bytes. Why a cap in bytes:
   a wide input makes large pairs (Qwen2.5 0.5B's MLP down projection, 4,864 inputs: 39 KB a
   pair in 5 bits, 78 KB in int8), and 4 of them ahead per thread crowded L2; capped at 64 KB,
   its batch-8 decode step took 0.6 ms less (~2-3%), every one of 8 rounds alternated in one
   process (32 KB or 128 KB: no better). Narrower pairs keep FAR_PAIRS. */
static inline size_t far_ahead(size_t span) {
    size_t pairs = FAR_BYTES / (2 * span);
    pairs = pairs < 1 ? 1 : pairs > FAR_PAIRS ? FAR_PAIRS : pairs;
    return 2 * pairs * span;
}

TARGET_VNNI static inline __m512i join256(const void *lo, const void *hi) {
    return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)lo)),
                              _mm256_loadu_si256((const __m256i *)hi), 1);
}

TARGET_VNNI static inline __m512 join_ph(const uint16_t *lo, const uint16_t *hi) {
    __m256i h = _mm256_inserti128_si256(
        _mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)lo)),
        _mm_loadu_si128((const __m128i *)hi), 1);
    return _mm512_cvtph_ps(h);
}

TARGET_VNNI static inline void store16(const job_t *j, int b, int r0, __m512 v) {
    float f[16];
    _mm512_storeu_ps(f, v);
    store8(j, b, r0, f);
    store8(j, b, r0 + 8, f + 8);
}

/* acc += w (u8) . the 4 int8 at x, which the instruction broadcasts to every lane from memory
   itself (GCC does not fold _mm512_set1_epi32 into it; a separate broadcast was ~5% slower) */
#define DOT16(acc, w, x) __asm__("vpdpbusd %1%{1to16%}, %2, %0" : "+v"(acc) : "m"(x), "v"(w))

/* group8 on a pair of tiles: the same chains, lane for lane. */
TARGET_VNNI static inline __m512i group16(const __m512i *w, const int32_t *x4) {
    __m512i a = _mm512_setzero_si512(), c = _mm512_setzero_si512();
    for (int s = 0; s < 4; s++) {
        DOT16(a, w[s], x4[s]);
        DOT16(c, w[s + 4], x4[s + 4]);
    }
    return _mm512_add_epi32(a, c);
}

TARGET_VNNI static inline __attribute__((always_inline)) void vnni16_tile(const job_t *j, int t,
                                                                          int b0, const int nb,
                                                                          const int kind) {
    const int groups = j->in / GROUP, five = kind & KIND_FIVE, two = !(kind & KIND_ONE);
    const int coarse = kind & KIND_COARSE;
    const size_t span = (size_t)groups * 128;
    const size_t ahead = far_ahead(span), near = near_ahead(span);
    const uint8_t *w0 = j->qs + (size_t)t * span, *w1 = w0 + span;
    const uint16_t *s0 = (const uint16_t *)j->scale + (size_t)t * groups * 8, *s1 = s0 + groups * 8;
    const uint16_t *m0 = (const uint16_t *)j->minimum + (size_t)t * groups * 8, *m1 = m0 + groups * 8;
    const __m512i low = _mm512_set1_epi8(0x0F);
    __m512 acc[8];
    for (int k = 0; k < nb; k++) acc[k] = _mm512_setzero_ps();
    for (int g = 0; g < groups; g++) {
        __m512i w[8];
        { /* the next pair's group g (2 x 2 lines; near_ahead): its DRAM read overlaps this
             pair's maths (~25% off a decode step's products at batch 1 and 8; past the end:
             harmless); and up to 4 pairs on into L2 (far_ahead: ~5% off at batch 4) */
            const char *next = (const char *)w0 + near + (size_t)g * 128;
            const char *far = (const char *)w0 + ahead + (size_t)g * 128;
            _mm_prefetch(next, _MM_HINT_T0);
            _mm_prefetch(next + 64, _MM_HINT_T0);
            _mm_prefetch(next + span, _MM_HINT_T0);
            _mm_prefetch(next + span + 64, _MM_HINT_T0);
            _mm_prefetch(far, _MM_HINT_T1);
            _mm_prefetch(far + 64, _MM_HINT_T1);
            _mm_prefetch(far + span, _MM_HINT_T1);
            _mm_prefetch(far + span + 64, _MM_HINT_T1);
            /* and that pair's scales, minimums (16 bytes a tile and group each) and fifth bits
               (32), which the hardware's prefetch alone left the maths waiting on: one line
               every 4 groups (every 2 for the fifth bits), the decode layers at batch 8 ~1.6%
               faster on SmolLM2 and Gemma 3, ~3-4% on Qwen2.5 (alternated call by call in one
               process; a version that tested each address for a line's start was ~3% slower) */
            const size_t small = (ahead / span) * (size_t)groups * 8 + (size_t)g * 8;
            if ((g & 3) == 0) {
                _mm_prefetch((const char *)(s0 + small), _MM_HINT_T1);
                _mm_prefetch((const char *)(s1 + small), _MM_HINT_T1);
                if (!coarse && !(j->flags & FLAG_CENTRED)) {
                    _mm_prefetch((const char *)(m0 + small), _MM_HINT_T1);
                    _mm_prefetch((const char *)(m1 + small), _MM_HINT_T1);
                }
            }
            if (five && (g & 1) == 0) {
                const uint32_t *h = j->high + (size_t)t * groups * 8 + small;
                _mm_prefetch((const char *)h, _MM_HINT_T1);
                _mm_prefetch((const char *)(h + (size_t)groups * 8), _MM_HINT_T1);
            }
        }
        for (int k = 0; k < 4; k++) {
            __m512i v = join256(w0 + (size_t)g * 128 + k * 32, w1 + (size_t)g * 128 + k * 32);
            w[k] = _mm512_and_si512(v, low);
            w[k + 4] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
        }
        if (five) { /* tile t's bits in the low half, tile t + 1's in the high half */
            const uint32_t *h0 = j->high + ((size_t)t * groups + g) * 8, *h1 = h0 + groups * 8;
            for (int k = 0; k < 8; k++) {
                const __mmask64 m = (__mmask64)h0[k] | (__mmask64)h1[k] << 32;
                w[k] = _mm512_mask_add_epi8(w[k], m, w[k], _mm512_set1_epi8(16));
            }
        }
        const __m512 sc = _mm512_mul_ps(join_ph(s0 + (size_t)g * 8, s1 + (size_t)g * 8),
                                        _mm512_set1_ps(two ? 1.0f / LOW_STEPS : 1.0f)); /* as in the tiles */
        const __m512 mn = coarse ? sc
            : j->flags & FLAG_CENTRED /* as in the tiles */
            ? _mm512_mul_ps(join_ph(s0 + (size_t)g * 8, s1 + (size_t)g * 8), _mm512_set1_ps(-16.0f))
            : join_ph(m0 + (size_t)g * 8, m1 + (size_t)g * 8);
        /* unrolled: the 8 rows' sums stay in registers (a loop kept them on the stack, a load
           and a store per row and group: ~3-5% of the products at batch 8) */
#pragma GCC unroll 8
        for (int k = 0; k < nb; k++) {
            const size_t xg = (size_t)(b0 + k) * groups + g;
            __m512i sum = group16(w, (const int32_t *)(j->qx + xg * GROUP));
            if (coarse) { /* as in the tiles */
                sum = _mm512_sub_epi32(sum, _mm512_set1_epi32(8 * j->xsum[xg]));
                acc[k] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), sc, acc[k]);
                continue;
            }
            if (two)
                sum = _mm512_add_epi32(_mm512_slli_epi32(sum, LOW_BITS),
                                       group16(w, (const int32_t *)(j->qlo + xg * GROUP)));
            const __m512 f = _mm512_cvtepi32_ps(sum);
            acc[k] = _mm512_fmadd_ps(f, _mm512_mul_ps(sc, _mm512_set1_ps(j->dx[xg])), acc[k]);
            acc[k] = _mm512_fmadd_ps(mn, _mm512_set1_ps(j->sx[xg]), acc[k]);
        }
    }
    for (int k = 0; k < nb; k++)
        store16(j, b0 + k, t * 8, coarse ? _mm512_mul_ps(acc[k], _mm512_set1_ps(j->dx[b0 + k])) : acc[k]);
}

/* ---- int8 weights: one scale per row (the output head's coarse pass, float weights), or a
   float16 scale per row and group of 32 (FLAG_GROUPED: Q8_0, IQ4_NL, IQ4_XS, Q3_K, Q2_K,
   Q6_K files, which before took one scale a row, ~0.8% off every product) ----

   The same tiles of 8 rows, 8 steps of 4 bytes per group (256 bytes). u8 x s8 dot
   instructions take one unsigned operand: |w| times x with w's sign (ggml's trick), which
   also keeps AVX2's pairwise int16 sums below saturation (2 x 128 x 127). The grouped kind
   scales each group's integer sum as the 4-bit tiles do (scale · dx, or with the residual
   pass the two sums joined, qx's x 256 plus qlo's, at scale / 256 · dx: ~15 bits of x),
   in the same order on every path, so its bits too are the same at any batch and on either
   instruction set. */

/* `mode` (TILE8_*): one float32 scale per row, applied at the end; or FLAG_GROUPED's float16
   scale per row and group (in one or two passes), applied per group: the 4-bit tiles' sc. */
#define TILE8_ROW 0
#define TILE8_GROUPED 1
#define TILE8_TWO 2 /* with TILE8_GROUPED: the residual pass */

static inline int tile8_mode(const job_t *j) {
    if (!(j->flags & FLAG_GROUPED)) return TILE8_ROW;
    return TILE8_GROUPED | (j->qlo != NULL ? TILE8_TWO : 0);
}

#define TILE8_KERNEL(NAME, TARGET, DOT)                                                        \
    /* row x4's dot product with the group's weights (w, |w| in aw), with w's sign on x */      \
    TARGET static inline __m256i NAME##_dot8(const __m256i *w, const __m256i *aw,              \
                                             const int32_t *x4) {                              \
        __m256i a = _mm256_setzero_si256(), c = _mm256_setzero_si256();                        \
        for (int s = 0; s < 8; s += 2) {                                                       \
            a = DOT(a, aw[s], _mm256_sign_epi8(_mm256_set1_epi32(x4[s]), w[s]));               \
            c = DOT(c, aw[s + 1], _mm256_sign_epi8(_mm256_set1_epi32(x4[s + 1]), w[s + 1]));   \
        }                                                                                      \
        return _mm256_add_epi32(a, c);                                                         \
    }                                                                                          \
    TARGET static inline __attribute__((always_inline)) void NAME##_tile8(                     \
        const job_t *j, int t, int b0, const int nb, const int mode) {                         \
        const int groups = j->in / GROUP;                                                      \
        const int8_t *wt = (const int8_t *)j->qs + (size_t)t * groups * 256;                   \
        const uint16_t *st = (const uint16_t *)j->scale + (size_t)t * groups * 8;              \
        __m256 acc[4];                                                                         \
        for (int k = 0; k < nb; k++) acc[k] = _mm256_setzero_ps();                             \
        for (int g = 0; g < groups; g++) {                                                     \
            __m256i w[8], aw[8];                                                               \
            for (int k = 0; k < 8; k++) {                                                      \
                w[k] = _mm256_loadu_si256((const __m256i *)(wt + (size_t)g * 256 + k * 32));   \
                aw[k] = _mm256_abs_epi8(w[k]);                                                 \
            }                                                                                  \
            __m256 sc = _mm256_setzero_ps();                                                   \
            if (mode & TILE8_GROUPED) /* as the 4-bit tiles: in steps of 1 / LOW_STEPS */      \
                sc = _mm256_mul_ps(                                                            \
                    _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(st + (size_t)g * 8))),   \
                    _mm256_set1_ps(mode & TILE8_TWO ? 1.0f / LOW_STEPS : 1.0f));               \
            for (int k = 0; k < nb; k++) {                                                     \
                const size_t xg = (size_t)(b0 + k) * groups + g;                               \
                __m256i sum = NAME##_dot8(w, aw, (const int32_t *)(j->qx + xg * GROUP));       \
                if (mode & TILE8_TWO)                                                          \
                    sum = _mm256_add_epi32(_mm256_slli_epi32(sum, LOW_BITS),                   \
                                           NAME##_dot8(w, aw, (const int32_t *)(j->qlo + xg * GROUP))); \
                const __m256 f = _mm256_cvtepi32_ps(sum);                                      \
                if (mode & TILE8_GROUPED)                                                      \
                    acc[k] = _mm256_fmadd_ps(f, _mm256_mul_ps(sc, _mm256_set1_ps(j->dx[xg])), acc[k]); \
                else                                                                           \
                    acc[k] = _mm256_fmadd_ps(f, _mm256_set1_ps(j->dx[xg]), acc[k]);            \
            }                                                                                  \
        }                                                                                      \
        const __m256 rs = mode & TILE8_GROUPED ? _mm256_set1_ps(1.0f)                          \
            : _mm256_loadu_ps((const float *)j->scale + (size_t)t * 8);                        \
        for (int k = 0; k < nb; k++) {                                                         \
            float v[8];                                                                        \
            _mm256_storeu_ps(v, (mode & TILE8_GROUPED) ? acc[k] : _mm256_mul_ps(acc[k], rs));  \
            store8(j, b0 + k, t * 8, v);                                                       \
        }                                                                                      \
    }                                                                                          \
    TARGET static inline __attribute__((always_inline)) void NAME##_rows8(                     \
        const job_t *j, int t, const int mode) {                                               \
        int b = 0;                                                                             \
        for (; b + 4 <= j->batch; b += 4) NAME##_tile8(j, t, b, 4, mode);                      \
        for (; b + 2 <= j->batch; b += 2) NAME##_tile8(j, t, b, 2, mode);                      \
        for (; b < j->batch; b++) NAME##_tile8(j, t, b, 1, mode);                              \
    }                                                                                          \
    TARGET static void NAME##_run8(const job_t *j) {                                           \
        const int tiles = j->out / 8;                                                          \
        switch (tile8_mode(j)) { /* a copy of the loop per mode, as NAME##_run */              \
        case TILE8_ROW:                                                                        \
            _Pragma(TILES_SHARED) for (int t = 0; t < tiles; t++) NAME##_rows8(j, t, TILE8_ROW); \
            break;                                                                             \
        case TILE8_GROUPED:                                                                    \
            _Pragma(TILES_SHARED) for (int t = 0; t < tiles; t++)                              \
                NAME##_rows8(j, t, TILE8_GROUPED);                                             \
            break;                                                                             \
        default:                                                                               \
            _Pragma(TILES_SHARED) for (int t = 0; t < tiles; t++)                              \
                NAME##_rows8(j, t, TILE8_GROUPED | TILE8_TWO);                                 \
        }                                                                                      \
    }

TILE8_KERNEL(vnni, TARGET_VNNI, dot_vnni)
TILE8_KERNEL(avx2, TARGET_AVX2, dot_avx2)

/* AVX-512 VNNI: the int8 weights' tiles in pairs (16 rows a vector), as vnni16_tile. Here the
   weights are the signed operand and the activations the unsigned one, x + 128 (`qxu`: qx with
   its sign bit flipped, see vnni16_run): the dot instruction then needs no sign trick, and
   128 x each row's group sum of weights (`wsum`, from Q8Linear) takes the offset back out.
   The integers are exact, so the floats match the AVX2 path's bit for bit. */

/* row x4's (unsigned: x + 128) dot products with a pair of tiles' group, less the offset */
TARGET_VNNI static inline __m512i dot16u(const __m512i *w, const int32_t *x4, __m512i offset) {
    __m512i a = _mm512_setzero_si512(), c = _mm512_setzero_si512();
    for (int s = 0; s < 8; s += 2) {
        a = _mm512_dpbusd_epi32(a, _mm512_set1_epi32(x4[s]), w[s]);
        c = _mm512_dpbusd_epi32(c, _mm512_set1_epi32(x4[s + 1]), w[s + 1]);
    }
    return _mm512_sub_epi32(_mm512_add_epi32(a, c), offset);
}

TARGET_VNNI static inline __attribute__((always_inline)) void vnni16_tile8(const job_t *j, int t,
                                                                           int b0, const int nb,
                                                                           const int mode) {
    const int groups = j->in / GROUP;
    const size_t span = (size_t)groups * 256;
    const size_t ahead = far_ahead(span), near = near_ahead(span);
    const int8_t *w0 = (const int8_t *)j->qs + (size_t)t * span, *w1 = w0 + span;
    const int32_t *c0 = j->wsum + (size_t)t * groups * 8, *c1 = c0 + groups * 8;
    const uint16_t *s0 = (const uint16_t *)j->scale + (size_t)t * groups * 8, *s1 = s0 + groups * 8;
    __m512 acc[8];
    for (int k = 0; k < nb; k++) acc[k] = _mm512_setzero_ps();
    for (int g = 0; g < groups; g++) {
        __m512i w[8];
        { /* as vnni16_tile: near_ahead into L1, far_ahead into L2 (the head's 28 MB
             stream from memory at about the rate the maths reads them: batch 8, 1.8 -> 1.5 ms) */
            const char *next = (const char *)w0 + near + (size_t)g * 256;
            const char *far = (const char *)w0 + ahead + (size_t)g * 256;
            for (int i = 0; i < 256; i += 64) {
                _mm_prefetch(next + i, _MM_HINT_T0);
                _mm_prefetch(next + span + i, _MM_HINT_T0);
                _mm_prefetch(far + i, _MM_HINT_T1);
                _mm_prefetch(far + span + i, _MM_HINT_T1);
            }
            if ((mode & TILE8_GROUPED) && (g & 3) == 0) { /* the pair's scales, as vnni16_tile */
                const size_t small = (ahead / span) * (size_t)groups * 8 + (size_t)g * 8;
                _mm_prefetch((const char *)(s0 + small), _MM_HINT_T1);
                _mm_prefetch((const char *)(s1 + small), _MM_HINT_T1);
            }
        }
        for (int s = 0; s < 8; s++) w[s] = join256(w0 + (size_t)g * 256 + s * 32, w1 + (size_t)g * 256 + s * 32);
        const __m512i offset = join256(c0 + (size_t)g * 8, c1 + (size_t)g * 8);
        __m512 sc = _mm512_setzero_ps();
        if (mode & TILE8_GROUPED) /* as the 256-bit tiles */
            sc = _mm512_mul_ps(join_ph(s0 + (size_t)g * 8, s1 + (size_t)g * 8),
                               _mm512_set1_ps(mode & TILE8_TWO ? 1.0f / LOW_STEPS : 1.0f));
#pragma GCC unroll 8
        for (int k = 0; k < nb; k++) {
            const size_t xg = (size_t)(b0 + k) * groups + g;
            __m512i sum = dot16u(w, (const int32_t *)(j->qxu + xg * GROUP), offset);
            if (mode & TILE8_TWO)
                sum = _mm512_add_epi32(_mm512_slli_epi32(sum, LOW_BITS),
                                       dot16u(w, (const int32_t *)(j->qlou + xg * GROUP), offset));
            const __m512 f = _mm512_cvtepi32_ps(sum);
            if (mode & TILE8_GROUPED)
                acc[k] = _mm512_fmadd_ps(f, _mm512_mul_ps(sc, _mm512_set1_ps(j->dx[xg])), acc[k]);
            else
                acc[k] = _mm512_fmadd_ps(f, _mm512_set1_ps(j->dx[xg]), acc[k]);
        }
    }
    if (mode & TILE8_GROUPED) {
        for (int k = 0; k < nb; k++) store16(j, b0 + k, t * 8, acc[k]);
        return;
    }
    const float *rs = (const float *)j->scale + (size_t)t * 8;
    const __m512 scale = _mm512_loadu_ps(rs); /* tiles t and t + 1: 16 consecutive rows */
    for (int k = 0; k < nb; k++) store16(j, b0 + k, t * 8, _mm512_mul_ps(acc[k], scale));
}

/* Both kinds of weights on AVX-512 VNNI: pairs of tiles from batch 2, up to 8 rows at once.
   A batch of one is bound by reading the weights from memory, not by the maths: there the
   256-bit tiles, read in one stream, beat a pair's two streams (~1.5x on the head, whose
   28 MB do not stay in cache). The same bits either way. */

/* one call per variant (literal kinds: each compiled without tests in its loops) */
#define BY_KIND(F, NB)                                                                         \
    do {                                                                                       \
        switch (kind) {                                                                        \
        case 0: F(j, 2 * p, b, NB, 0); break;                                                  \
        case KIND_FIVE: F(j, 2 * p, b, NB, KIND_FIVE); break;                                  \
        case KIND_ONE: F(j, 2 * p, b, NB, KIND_ONE); break;                                    \
        case KIND_COARSE | KIND_ONE: F(j, 2 * p, b, NB, KIND_COARSE | KIND_ONE); break;        \
        default: F(j, 2 * p, b, NB, KIND_FIVE | KIND_ONE);                                     \
        }                                                                                      \
    } while (0)
/* int8 weights: the same per mode (TILE8_*) */
#define BY_MODE(F, NB)                                                                         \
    do {                                                                                       \
        switch (mode8) {                                                                       \
        case TILE8_ROW: F(j, 2 * p, b, NB, TILE8_ROW); break;                                  \
        case TILE8_GROUPED: F(j, 2 * p, b, NB, TILE8_GROUPED); break;                          \
        default: F(j, 2 * p, b, NB, TILE8_GROUPED | TILE8_TWO);                                \
        }                                                                                      \
    } while (0)
#define PAIR_TILE(NB)                                                                          \
    do {                                                                                       \
        if (int8) BY_MODE(vnni16_tile8, NB);                                                   \
        else BY_KIND(vnni16_tile, NB);                                                         \
    } while (0)
#define ONE_TILE(NB)                                                                           \
    do {                                                                                       \
        if (int8) BY_MODE(vnni_tile8, NB);                                                     \
        else BY_KIND(vnni_tile, NB);                                                           \
    } while (0)

TARGET_VNNI static void vnni16_run(const job_t *j) {
    const int int8 = j->minimum == NULL, kind = job_kind(j), mode8 = tile8_mode(j);
    if (j->batch == 1) {
        (int8 ? vnni_run8 : vnni_run)(j);
        return;
    }
    const int tiles = j->out / 8, pairs = tiles / 2;
    _Pragma(TILES_SHARED)
    for (int p = 0; p < pairs + (tiles & 1); p++) {
        int b = 0;
        if (p == pairs) { /* an odd last tile: 256 bits (signed activations) */
            for (; b + 4 <= j->batch; b += 4) ONE_TILE(4);
            for (; b < j->batch; b++) ONE_TILE(1);
            continue;
        }
        for (; b + 8 <= j->batch; b += 8) PAIR_TILE(8);
        for (; b + 4 <= j->batch; b += 4) PAIR_TILE(4);
        for (; b + 2 <= j->batch; b += 2) PAIR_TILE(2);
        for (; b < j->batch; b++) PAIR_TILE(1);
    }
}

#undef PAIR_TILE
#undef ONE_TILE
#undef BY_KIND
#undef BY_MODE

/* ---- decode attention: one query token per row, grouped query heads, float32 maths ----

   torch's SDPA spent ~45 us a layer at batch 1 and ~300 us at batch 8 on these tiny shapes
   (L of a few hundred, D = 64): mostly its own set-up. Per row and KV head: the scores of
   its G query heads against each key (each key read once), a softmax (a key whose additive
   mask is -inf gets exactly 0), then the value rows weighted. Keys, values and queries are
   strided views (bfloat16 or float32, D contiguous); the output is [B, KV, G, D] contiguous.
   With `rows` ([B, L] int64), key/value position l of row b is the pool's token row
   rows[b, l] (the paged cache's blocks, read in place instead of gathered first). */

typedef struct {
    const char *q, *k, *v, *mask;
    const long long *rows; /* [B, L] token rows of K/V, or NULL: position l is row l */
    long long rows_stride; /* rows' row stride: L, or more when the keys start past position 0 */
    const long long *ends; /* [B] each row's end (its keys' position limit), or NULL: L each */
    long long ends_from;   /* the position of key 0 (ends are positions) */
    long long qs[3], ks[3], vs[3], mask_stride; /* element strides: row, head, (group | pos) */
    int batch, kv, groups, length, dim, bf16, mask_bf16;
    float scale;
    void *out;
    float *scratch; /* per (row, head): groups x length scores + groups x dim sums */
} attn_t;

TARGET_AVX2 static inline __m256 load8s(const char *base, int bf16, long long at) {
    return load8(base, bf16, (size_t)at);
}

/* Each query head's scores [G, L] in place: softmax over the keys (a key masked with -inf
   gets exactly 0; every key masked: zeros, not NaN). The total runs in chunks of 8 keys from
   key 0, a last partial chunk padded with zeros, so that masked keys after a row's own
   (however many) change no bit of it. */
TARGET_AVX2 static void softmax_scores(float *scores, int G, int L) {
    const __m256 ninf = _mm256_set1_ps(-INFINITY);
    for (int g = 0; g < G; g++) {
        float *s = scores + (size_t)g * L;
        float top = -INFINITY;
        for (int l = 0; l < L; l++) top = s[l] > top ? s[l] : top;
        if (top == -INFINITY) top = 0.0f;
        const __m256 t = _mm256_set1_ps(top);
        float total = 0.0f;
        int l = 0;
        for (; l + 8 <= L; l += 8) {
            __m256 x = _mm256_loadu_ps(s + l);
            __m256 e = exp256(_mm256_sub_ps(x, t));
            e = _mm256_andnot_ps(_mm256_cmp_ps(x, ninf, _CMP_EQ_OQ), e);
            _mm256_storeu_ps(s + l, e);
            total += hsum8(e);
        }
        if (l < L) { /* the last keys as a chunk of 8 padded with masked ones (-inf: weight
                        0), summed as a whole chunk: the same total as a row reading more keys
                        whose keys past this row's end are masked (a decode row beside longer
                        ones, as a speculative verification's rows are): one key at a time,
                        the total's rounding depended on how many masked keys followed */
            float x[8], e[8];
            for (int j = 0; j < 8; j++) x[j] = l + j < L ? s[l + j] : -INFINITY;
            const __m256 xv = _mm256_loadu_ps(x);
            __m256 ev = exp256(_mm256_sub_ps(xv, t));
            ev = _mm256_andnot_ps(_mm256_cmp_ps(xv, ninf, _CMP_EQ_OQ), ev);
            _mm256_storeu_ps(e, ev);
            for (int j = 0; l + j < L; j++) s[l + j] = e[j];
            total += hsum8(ev);
        }
        const float inv = total > 0.0f ? 1.0f / total : 0.0f;
        for (l = 0; l < L; l++) s[l] *= inv;
    }
}

/* Row b, KV head h's output [G, D] from its float32 sums. */
TARGET_AVX2 static void store_sums(const attn_t *a, int b, int h, const float *sums) {
    const int n = a->groups * a->dim; /* dim: a multiple of 8 */
    const size_t base = ((size_t)b * a->kv + h) * n;
    for (int i = 0; i < n; i += 8) store8_f(a->out, a->bf16, base + i, _mm256_loadu_ps(sums + i));
}

/* The additive mask of row b's keys l0 .. l0 + n - 1 (n <= 4) into m (0 without a mask). */
TARGET_AVX2 static inline void key_masks(const attn_t *a, int b, int l0, int n, float *m) {
    for (int j = 0; j < 4; j++) m[j] = 0.0f;
    if (a->mask == NULL) return;
    for (int j = 0; j < n; j++)
        m[j] = load_f(a->mask, a->mask_bf16, (size_t)(b * a->mask_stride + l0 + j));
}

/* Keys j = 0..3's dot products, each 8 partial sums folded once (x01: keys 0 | 1 in 128-bit
   halves, x23: keys 2 | 3), finished in hsum8's order ((t0 + t2) + (t1 + t3)), scaled and
   masked into out[0 .. n - 1]. */
TARGET_AVX2 static inline void put_scores(float *out, int n, __m256 x01, __m256 x23, float scale,
                                          const float *m) {
    const __m256 c = _mm256_add_ps(_mm256_shuffle_ps(x01, x23, _MM_SHUFFLE(1, 0, 1, 0)),
                                   _mm256_shuffle_ps(x01, x23, _MM_SHUFFLE(3, 2, 3, 2)));
    float r[8]; /* keys 0, 2, 0, 2 | 1, 3, 1, 3 */
    _mm256_storeu_ps(r, _mm256_hadd_ps(c, c));
    const float dots[4] = {r[0], r[4], r[1], r[5]};
    for (int j = 0; j < n; j++) out[j] = dots[j] * scale + m[j];
}

/* Software prefetch of the K/V rows that the loops read AHEAD keys on (KEYS_AHEAD for K in
   the scores, VALUES_AHEAD for V in the value sums): the rows jump from block to block, and
   the K/V that 8 rows read over 30 layers does not stay in cache. At B = 8, L = 100..300,
   ~40% off the attention; fetching V during the scores instead was slower (it evicted K). */
#define KEYS_AHEAD 32
#define VALUES_AHEAD 16
static inline void prefetch_row(const char *base, int bf16, long long at, int dim) {
    const char *p = base + at * (bf16 ? 2 : 4);
    for (int i = 0; i < dim * (bf16 ? 2 : 4); i += 64) _mm_prefetch(p + i, _MM_HINT_T0);
}

/* How many keys row b reads: up to its end rounded up to a multiple of 8, at most L. Why:
   decode rows of different lengths share one L (the longest row's end), and the keys past a
   row's end are masked: a row 50 tokens long beside one of 2,000 read 2,000 keys for nothing.
   The rounding keeps the bits: past the end a key's weight is exactly 0, and the softmax's
   sums run in chunks of 8 from key 0, so dropping whole chunks of zeros changes no sum. */
static inline int row_keys(const attn_t *a, int b) {
    if (a->ends == NULL) return a->length;
    const long long keys = (a->ends[b] - a->ends_from + 7) / 8 * 8;
    return keys < 1 || keys > a->length ? a->length : (int)keys;
}

/* The K rows of keys from .. to - 1 (those below L), as prefetch_row. */
static inline void prefetch_keys(const attn_t *a, const long long *rows, long long kbase,
                                 int from, int to, int L) {
    for (int l = from; l < to && l < L; l++)
        prefetch_row(a->k, a->bf16, kbase + (rows ? rows[l] : l) * a->ks[2], a->dim);
}

TARGET_AVX2 static void attend_one(const attn_t *a, int b, int h) {
    const int G = a->groups, L = row_keys(a, b), D = a->dim;
    float *scores = a->scratch + (size_t)(b * a->kv + h) * (size_t)G * (a->length + D);
    float *sums = scores + (size_t)G * L;
    float qf[16 * 256], kf[4 * 256];
    for (int g = 0; g < G; g++)
        for (int d = 0; d < D; d += 8) {
            long long at = b * a->qs[0] + h * a->qs[1] + g * a->qs[2] + d;
            _mm256_storeu_ps(qf + g * D + d, load8s(a->q, a->bf16, at));
        }
    const long long *rows = a->rows ? a->rows + (size_t)b * a->rows_stride : NULL;
    const long long kbase = (rows ? 0 : b * a->ks[0]) + h * a->ks[1];
    const long long vbase = (rows ? 0 : b * a->vs[0]) + h * a->vs[1];
    /* Scores, 4 keys at a time: each key's row converted to float once, then per query head
       4 independent FMA chains (one per key) and one horizontal-add tree for the 4 sums (one
       chain per head left the loop waiting on FMA latency). */
    prefetch_keys(a, rows, kbase, 0, KEYS_AHEAD, L);
    for (int l0 = 0; l0 < L; l0 += 4) {
        const int n = L - l0 < 4 ? L - l0 : 4;
        prefetch_keys(a, rows, kbase, l0 + KEYS_AHEAD, l0 + KEYS_AHEAD + 4, L);
        for (int j = 0; j < 4; j++) {
            const int l = l0 + (j < n ? j : 0); /* past the end: any real key, then dropped */
            const long long kat = kbase + (rows ? rows[l] : l) * a->ks[2];
            for (int d = 0; d < D; d += 8) _mm256_storeu_ps(kf + j * D + d, load8s(a->k, a->bf16, kat + d));
        }
        float m[4];
        key_masks(a, b, l0, n, m);
        for (int g = 0; g < G; g++) {
            const float *qg = qf + g * D;
            __m256 s0 = _mm256_setzero_ps(), s1 = s0, s2 = s0, s3 = s0;
            for (int d = 0; d < D; d += 8) {
                const __m256 qv = _mm256_loadu_ps(qg + d);
                s0 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(kf + d), s0);
                s1 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(kf + D + d), s1);
                s2 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(kf + 2 * D + d), s2);
                s3 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(kf + 3 * D + d), s3);
            }
            /* The 4 sums in hsum8's order, so that the scores keep their bits whatever the
               loop's shape: halves first (t = lo + hi, keys 0 | 1 and 2 | 3 side by side),
               then (t0 + t2) + (t1 + t3). */
            const __m256 x01 = _mm256_add_ps(_mm256_permute2f128_ps(s0, s1, 0x20),
                                             _mm256_permute2f128_ps(s0, s1, 0x31));
            const __m256 x23 = _mm256_add_ps(_mm256_permute2f128_ps(s2, s3, 0x20),
                                             _mm256_permute2f128_ps(s2, s3, 0x31));
            put_scores(scores + (size_t)g * L + l0, n, x01, x23, a->scale, m);
        }
    }
    softmax_scores(scores, G, L);
    /* Values: the sums of up to 4 query heads x 16 dimensions stay in registers over all the
       keys (through memory, each key's update waited on the previous one's store). */
    for (int g0 = 0; g0 < G; g0 += 4) {
        const int ng = G - g0 < 4 ? G - g0 : 4;
        for (int d = 0; d < D; d += 16) {
            const int two = d + 16 <= D; /* D = 8 mod 16: a last half block */
            __m256 o[4][2];
            for (int g = 0; g < 4; g++) o[g][0] = o[g][1] = _mm256_setzero_ps();
            for (int l = 0; l < L; l++) {
                const long long vat = vbase + (rows ? rows[l] : l) * a->vs[2] + d;
                if (d == 0 && l + VALUES_AHEAD < L) { /* the whole row: the next d find it */
                    const int ahead = l + VALUES_AHEAD;
                    prefetch_row(a->v, a->bf16, vbase + (rows ? rows[ahead] : ahead) * a->vs[2], D);
                }
                const __m256 v0 = load8s(a->v, a->bf16, vat);
                const __m256 v1 = two ? load8s(a->v, a->bf16, vat + 8) : v0;
                for (int g = 0; g < ng; g++) {
                    const __m256 p = _mm256_set1_ps(scores[(size_t)(g0 + g) * L + l]);
                    o[g][0] = _mm256_fmadd_ps(p, v0, o[g][0]);
                    o[g][1] = _mm256_fmadd_ps(p, v1, o[g][1]);
                }
            }
            for (int g = 0; g < ng; g++) {
                _mm256_storeu_ps(sums + (g0 + g) * D + d, o[g][0]);
                if (two) _mm256_storeu_ps(sums + (g0 + g) * D + d + 8, o[g][1]);
            }
        }
    }
    store_sums(a, b, h, sums);
}

/* AVX-512: the same attention, lane for lane and in the same order, so both instruction sets
   give the same bits. In the scores a 512-bit vector holds two keys' 8 dimensions side by
   side (the 256-bit chains, two per instruction) and two query heads run together (4
   chains); the value sums hold 16 dimensions a vector, 4 heads x 64 dimensions in registers.
   About half the instructions of the 256-bit version at D = 64. */

TARGET_VNNI static inline __m512 join_ps(__m256 lo, __m256 hi) { /* AVX-512F only, no DQ */
    return _mm512_castpd_ps(_mm512_insertf64x4(_mm512_castps_pd(_mm512_castps256_ps512(lo)),
                                               _mm256_castps_pd(hi), 1));
}

TARGET_VNNI static inline __m512 load2x8(const char *base, int bf16, long long i0, long long i1) {
    if (bf16) { /* two keys' 8 bfloat16 values, widened to float32 */
        const uint16_t *p = (const uint16_t *)base;
        __m256i h = _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)(p + i0))),
                                            _mm_loadu_si128((const __m128i *)(p + i1)), 1);
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    }
    const float *p = (const float *)base;
    return join_ps(_mm256_loadu_ps(p + i0), _mm256_loadu_ps(p + i1));
}

TARGET_VNNI static inline __m512 load16m(const char *base, int bf16, long long i, __mmask16 k) {
    if (bf16) {
        __m256i h = _mm256_maskz_loadu_epi16(k, (const uint16_t *)base + i);
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    }
    return _mm512_maskz_loadu_ps(k, (const float *)base + i);
}

/* Query heads g .. g + NG - 1 (NG 1 or 2) against 4 keys: kp holds the keys in pairs
   ([k0 | k1] then [k2 | k3], 16 floats per 8 dimensions), qp each head's [q | q]. */
TARGET_VNNI static inline __attribute__((always_inline)) void scores512(
    const attn_t *a, const float *qp, const float *kp, int g, const int NG, float *scores, int L,
    int l0, int n, const float *m) {
    const int D = a->dim, steps = D / 8;
    __m512 s[2][2];
    for (int i = 0; i < NG; i++) s[i][0] = s[i][1] = _mm512_setzero_ps();
    for (int d = 0; d < steps; d++) {
        const __m512 k01 = _mm512_loadu_ps(kp + d * 16), k23 = _mm512_loadu_ps(kp + (steps + d) * 16);
        for (int i = 0; i < NG; i++) {
            const __m512 q = _mm512_loadu_ps(qp + ((size_t)(g + i) * steps + d) * 16);
            s[i][0] = _mm512_fmadd_ps(q, k01, s[i][0]);
            s[i][1] = _mm512_fmadd_ps(q, k23, s[i][1]);
        }
    }
    for (int i = 0; i < NG; i++) {
        /* 128-bit quarters [k0 lo, k0 hi, k1 lo, k1 hi] | [k2 ...]: each key's halves added */
        const __m512 lo = _mm512_shuffle_f32x4(s[i][0], s[i][1], _MM_SHUFFLE(2, 0, 2, 0));
        const __m512 hi = _mm512_shuffle_f32x4(s[i][0], s[i][1], _MM_SHUFFLE(3, 1, 3, 1));
        const __m512 x = _mm512_add_ps(lo, hi);
        const __m256 x01 = _mm512_castps512_ps256(x);
        const __m256 x23 = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(x), 1));
        put_scores(scores + (size_t)(g + i) * L + l0, n, x01, x23, a->scale, m);
    }
}

/* Query heads g0 .. g0 + NG - 1 (NG 1..4) x dimensions d0 .. d0 + 63 of the value sums. */
TARGET_VNNI static inline __attribute__((always_inline)) void values512(
    const attn_t *a, const float *scores, float *sums, const long long *rows, long long vbase,
    int L, int g0, const int NG, int d0) {
    const int D = a->dim;
    __mmask16 k[4];
    for (int c = 0; c < 4; c++) {
        const int left = D - d0 - 16 * c; /* a multiple of 8 */
        k[c] = left >= 16 ? 0xFFFF : left > 0 ? 0x00FF : 0;
    }
    __m512 o[4][4];
    for (int g = 0; g < NG; g++)
        for (int c = 0; c < 4; c++) o[g][c] = _mm512_setzero_ps();
    for (int l = 0; l < L; l++) {
        const long long vat = vbase + (rows ? rows[l] : l) * a->vs[2] + d0;
        if (l + VALUES_AHEAD < L) {
            const int ahead = l + VALUES_AHEAD;
            prefetch_row(a->v, a->bf16, vbase + (rows ? rows[ahead] : ahead) * a->vs[2] + d0, D - d0 < 64 ? D - d0 : 64);
        }
        __m512 v[4];
        for (int c = 0; c < 4; c++) v[c] = load16m(a->v, a->bf16, vat + 16 * c, k[c]);
        for (int g = 0; g < NG; g++) {
            const __m512 p = _mm512_set1_ps(scores[(size_t)(g0 + g) * L + l]);
            for (int c = 0; c < 4; c++) o[g][c] = _mm512_fmadd_ps(p, v[c], o[g][c]);
        }
    }
    for (int g = 0; g < NG; g++)
        for (int c = 0; c < 4; c++)
            _mm512_mask_storeu_ps(sums + (size_t)(g0 + g) * D + d0 + 16 * c, k[c], o[g][c]);
}

TARGET_VNNI static void attend_one512(const attn_t *a, int b, int h) {
    const int G = a->groups, L = row_keys(a, b), D = a->dim, steps = D / 8;
    float *scores = a->scratch + (size_t)(b * a->kv + h) * (size_t)G * (a->length + D);
    float *sums = scores + (size_t)G * L;
    float qp[16 * 256 * 2], kp[4 * 256];
    for (int g = 0; g < G; g++)
        for (int d = 0; d < steps; d++) {
            const long long at = b * a->qs[0] + h * a->qs[1] + g * a->qs[2] + d * 8;
            const __m256 q = load8s(a->q, a->bf16, at);
            _mm512_storeu_ps(qp + ((size_t)g * steps + d) * 16,
                             join_ps(q, q));
        }
    const long long *rows = a->rows ? a->rows + (size_t)b * a->rows_stride : NULL;
    const long long kbase = (rows ? 0 : b * a->ks[0]) + h * a->ks[1];
    const long long vbase = (rows ? 0 : b * a->vs[0]) + h * a->vs[1];
    prefetch_keys(a, rows, kbase, 0, KEYS_AHEAD, L);
    for (int l0 = 0; l0 < L; l0 += 4) {
        const int n = L - l0 < 4 ? L - l0 : 4;
        long long kat[4];
        for (int j = 0; j < 4; j++) {
            const int l = l0 + (j < n ? j : 0); /* past the end: any real key, then dropped */
            kat[j] = kbase + (rows ? rows[l] : l) * a->ks[2];
        }
        prefetch_keys(a, rows, kbase, l0 + KEYS_AHEAD, l0 + KEYS_AHEAD + 4, L);
        for (int p = 0; p < 2; p++)
            for (int d = 0; d < steps; d++)
                _mm512_storeu_ps(kp + ((size_t)p * steps + d) * 16,
                                 load2x8(a->k, a->bf16, kat[2 * p] + d * 8, kat[2 * p + 1] + d * 8));
        float m[4];
        key_masks(a, b, l0, n, m);
        int g = 0;
        for (; g + 2 <= G; g += 2) scores512(a, qp, kp, g, 2, scores, L, l0, n, m);
        if (g < G) scores512(a, qp, kp, g, 1, scores, L, l0, n, m);
    }
    softmax_scores(scores, G, L);
    for (int g0 = 0; g0 < G; g0 += 4)
        for (int d0 = 0; d0 < D; d0 += 64) {
            switch (G - g0 < 4 ? G - g0 : 4) {
            case 1: values512(a, scores, sums, rows, vbase, L, g0, 1, d0); break;
            case 2: values512(a, scores, sums, rows, vbase, L, g0, 2, d0); break;
            case 3: values512(a, scores, sums, rows, vbase, L, g0, 3, d0); break;
            default: values512(a, scores, sums, rows, vbase, L, g0, 4, d0); break;
            }
        }
    store_sums(a, b, h, sums);
}

typedef void (*attend_fn)(const attn_t *, int, int);
static attend_fn ATTEND = NULL;

TARGET_AVX2 static void attend_all(const attn_t *a) {
    const int n = a->batch * a->kv;
    const attend_fn one = ATTEND;
    /* Taken one (row, head) at a time: rows read their own number of keys (row_keys), and
       in halves a long row's heads all fell to one thread (one row of 1,500 tokens beside 7
       short ones, the built-in model at batch 8: the decode layers 11.8 -> 10.5 ms; rows of
       one length: no change) */
#pragma omp parallel for schedule(dynamic, 1) if (n > 1)
    for (int i = 0; i < n; i++) one(a, i / a->kv, i % a->kv);
}

/* attend(q, q_strides x3, k, k_strides x3, v, v_strides x3, mask, mask_stride, flags,
          batch, kv, groups, length, dim, out, scale, rows); flags: 1 bfloat16 q/k/v/out,
          2 bfloat16 mask (else float32; pointer 0: no mask). Pointers and strides (in
          elements: row, head, then group for q, position for k and v) as ints. rows: 0, or
          an int64 [batch, length] of K/V token rows (then k's and v's row stride is unused). */
static const char *ISA; /* defined below: "" on a CPU without AVX2 */

/* The calls' common start: `nargs` must be `want`, the CPU usable, and the first `count`
   arguments ints (pointers, strides, sizes), into v. 0 on success, -1 with an exception. */
static int take_ints(PyObject *const *args, Py_ssize_t nargs, Py_ssize_t want, int count,
                     long long *v, const char *name) {
    if (nargs != want) {
        PyErr_Format(PyExc_TypeError, "%s takes %zd arguments", name, want);
        return -1;
    }
    if (ISA[0] == 0) {
        PyErr_SetString(PyExc_RuntimeError, "this CPU has neither AVX2 nor AVX-512 VNNI");
        return -1;
    }
    for (int i = 0; i < count; i++) {
        v[i] = PyLong_AsLongLong(args[i]);
        if (v[i] == -1 && PyErr_Occurred()) return -1;
    }
    return 0;
}

static PyObject *q4_attend(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    long long v[21];
    if (take_ints(args, nargs, 23, 21, v, "attend") < 0) return NULL;
    const double scale = PyFloat_AsDouble(args[21]);
    if (scale == -1.0 && PyErr_Occurred()) return NULL;
    const long long rows = PyLong_AsLongLong(args[22]);
    if (rows == -1 && PyErr_Occurred()) return NULL;
    attn_t a;
    a.q = (const char *)(intptr_t)v[0];
    a.k = (const char *)(intptr_t)v[4];
    a.v = (const char *)(intptr_t)v[8];
    a.mask = (const char *)(intptr_t)v[12];
    a.rows = (const long long *)(intptr_t)rows;
    a.rows_stride = v[18]; /* the length */
    a.ends = NULL; /* every row reads all `length` keys (the mask decides) */
    a.ends_from = 0;
    for (int i = 0; i < 3; i++) {
        a.qs[i] = v[1 + i];
        a.ks[i] = v[5 + i];
        a.vs[i] = v[9 + i];
    }
    a.mask_stride = v[13];
    a.bf16 = (int)(v[14] & 1);
    a.mask_bf16 = (int)((v[14] >> 1) & 1);
    a.batch = (int)v[15];
    a.kv = (int)v[16];
    a.groups = (int)v[17];
    a.length = (int)v[18];
    a.dim = (int)v[19];
    a.scale = (float)scale;
    if (a.batch < 1 || a.kv < 1 || a.groups < 1 || a.groups > 16 || a.length < 1 ||
        a.dim < 8 || a.dim > 256 || a.dim % 8) {
        PyErr_SetString(PyExc_ValueError, "attend: bad shape (1..16 groups, dim 8..256 by 8)");
        return NULL;
    }
    a.out = (void *)(intptr_t)v[20];
    const size_t per = (size_t)a.groups * ((size_t)a.length + a.dim);
    a.scratch = malloc((size_t)a.batch * a.kv * per * sizeof(float));
    if (a.scratch == NULL) return PyErr_NoMemory();
    Py_BEGIN_ALLOW_THREADS
    attend_all(&a);
    Py_END_ALLOW_THREADS
    free(a.scratch);
    Py_RETURN_NONE;
}

/* ---- RoPE and the K/V write of a forward's rows (model.Block), one call a layer ----

   qkv [N, H + 2KV, D] contiguous (float32 or bfloat16): the Q and K heads rotated the
   rotate-half way, x · cos + roll(x, D / 2) · sin (sin signed: -sin | +sin), cos and sin from
   float32 tables [P, D] at each row's position; Q into q_out [N, H, D], K and V into the
   layer's pool [2KV, pool tokens, D] at each row's token row. Float32 maths, one rounding to
   each output's dtype. In torch this was ~10 small ops a layer (roll, mul, addcmul, the
   transposed copy, the dtype cast, index_copy_, the query's copy): ~25 us a layer. */

typedef struct {
    const void *qkv;
    const long long *pos, *rows;
    const float *cos, *sin;
    const float *norm; /* QK-norm: each Q and K head's RMSNorm weight [heads + kv, dim], or NULL */
    float eps;
    void *pool, *q;
    long long pool_tokens;
    int n, heads, kv, dim, x_bf16, pool_bf16, q_bf16;
} rope_t;

/* Where head h of row n goes: Q out, or the pool (K heads, then V heads: its order). */
static inline void *rope_dest(const rope_t *r, int n, int h, int *bf16, size_t *to) {
    if (h < r->heads) {
        *bf16 = r->q_bf16;
        *to = ((size_t)n * r->heads + h) * r->dim;
        return r->q;
    }
    *bf16 = r->pool_bf16;
    *to = ((size_t)(h - r->heads) * r->pool_tokens + (size_t)r->rows[n]) * r->dim;
    return r->pool;
}

/* out = x · cos + other · sin, as fmaf(x, cos, other · sin) in both versions (same bits) */
static void rope_rows_scalar(const rope_t *r) {
    const int D = r->dim, half = D / 2, all = r->heads + 2 * r->kv;
    float x[256];
    for (int n = 0; n < r->n; n++) {
        const float *c = r->cos + (size_t)r->pos[n] * D, *s = r->sin + (size_t)r->pos[n] * D;
        for (int h = 0; h < all; h++) {
            const size_t at = ((size_t)n * all + h) * D;
            for (int i = 0; i < D; i++) x[i] = load_f(r->qkv, r->x_bf16, at + i);
            int bf16;
            size_t to;
            void *out = rope_dest(r, n, h, &bf16, &to);
            const int rotate = h < r->heads + r->kv; /* Q and K rotate; V does not */
            if (rotate && r->norm != NULL) {
                float ss = 0.0f;
                for (int i = 0; i < D; i++) ss += x[i] * x[i];
                const float inv = 1.0f / sqrtf(ss / (float)D + r->eps);
                for (int i = 0; i < D; i++) x[i] = x[i] * inv * r->norm[(size_t)h * D + i];
            }
            for (int i = 0; i < D; i++) {
                const float other = x[i < half ? i + half : i - half];
                store_f(out, bf16, to + i, rotate ? fmaf(x[i], c[i], other * s[i]) : x[i]);
            }
        }
    }
}

/* D a multiple of 16: 8 dimensions of each half at a time. */
TARGET_AVX2 static void rope_rows_avx2(const rope_t *r) {
    const int D = r->dim, half = D / 2, all = r->heads + 2 * r->kv;
    for (int n = 0; n < r->n; n++) {
        const float *c = r->cos + (size_t)r->pos[n] * D, *s = r->sin + (size_t)r->pos[n] * D;
        for (int h = 0; h < all; h++) {
            const size_t at = ((size_t)n * all + h) * D;
            int bf16;
            size_t to;
            void *out = rope_dest(r, n, h, &bf16, &to);
            const int rotate = h < r->heads + r->kv;
            const float *w = rotate ? r->norm : NULL;
            __m256 inv = _mm256_set1_ps(1.0f);
            if (w != NULL) { /* QK-norm first: RMSNorm over the head, times its weight */
                __m256 ss = _mm256_setzero_ps();
                for (int i = 0; i < D; i += 8) {
                    const __m256 v = load8(r->qkv, r->x_bf16, at + i);
                    ss = _mm256_fmadd_ps(v, v, ss);
                }
                inv = _mm256_set1_ps(1.0f / sqrtf(hsum8(ss) / (float)D + r->eps));
                w += (size_t)h * D;
            }
            for (int i = 0; i < half; i += 8) {
                __m256 lo = load8(r->qkv, r->x_bf16, at + i);
                __m256 hi = load8(r->qkv, r->x_bf16, at + half + i);
                if (w != NULL) {
                    lo = _mm256_mul_ps(_mm256_mul_ps(lo, inv), _mm256_loadu_ps(w + i));
                    hi = _mm256_mul_ps(_mm256_mul_ps(hi, inv), _mm256_loadu_ps(w + half + i));
                }
                if (!rotate) {
                    store8_f(out, bf16, to + i, lo);
                    store8_f(out, bf16, to + half + i, hi);
                    continue;
                }
                const __m256 c_lo = _mm256_loadu_ps(c + i), c_hi = _mm256_loadu_ps(c + half + i);
                const __m256 s_lo = _mm256_loadu_ps(s + i), s_hi = _mm256_loadu_ps(s + half + i);
                store8_f(out, bf16, to + i, _mm256_fmadd_ps(lo, c_lo, _mm256_mul_ps(hi, s_lo)));
                store8_f(out, bf16, to + half + i,
                         _mm256_fmadd_ps(hi, c_hi, _mm256_mul_ps(lo, s_hi)));
            }
        }
    }
}

static void rope_write_rows(const rope_t *r) {
    /* The pool rows written are scattered over a pool that is mostly not in cache: fetching
       all their lines first lets the misses overlap (one after the other, they were most of
       the call's time at batch 8). */
    const size_t bytes = (size_t)r->dim * (r->pool_bf16 ? 2 : 4);
    for (int n = 0; n < r->n; n++)
        for (int h = 0; h < 2 * r->kv; h++) {
            const char *row = (const char *)r->pool +
                              ((size_t)h * r->pool_tokens + (size_t)r->rows[n]) * bytes;
            for (size_t b = 0; b < bytes; b += 64) __builtin_prefetch(row + b, 1);
        }
    if (r->dim % 16 == 0)
        rope_rows_avx2(r);
    else
        rope_rows_scalar(r);
}

/* rope_write(qkv, n, heads, kv, dim, flags, positions, cos, sin, pool, pool tokens, rows, q
   [, norm, eps]): flags: 1 bfloat16 qkv, 2 bfloat16 pool, 4 bfloat16 q (else float32).
   positions and rows: int64 [n]. norm: QK-norm's weights, float32 [heads + kv, dim] (0:
   none). Pointers as ints. */
static PyObject *q4_rope_write(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    long long v[14] = {0};
    if (take_ints(args, nargs, nargs == 15 ? 15 : 13, nargs == 15 ? 14 : 13, v, "rope_write") < 0)
        return NULL;
    double eps = 0.0;
    if (nargs == 15 && (eps = PyFloat_AsDouble(args[14])) == -1.0 && PyErr_Occurred()) return NULL;
    rope_t r;
    r.norm = (const float *)(intptr_t)v[13];
    r.eps = (float)eps;
    r.qkv = (const void *)(intptr_t)v[0];
    r.n = (int)v[1];
    r.heads = (int)v[2];
    r.kv = (int)v[3];
    r.dim = (int)v[4];
    r.x_bf16 = (int)(v[5] & 1);
    r.pool_bf16 = (int)((v[5] >> 1) & 1);
    r.q_bf16 = (int)((v[5] >> 2) & 1);
    r.pos = (const long long *)(intptr_t)v[6];
    r.cos = (const float *)(intptr_t)v[7];
    r.sin = (const float *)(intptr_t)v[8];
    r.pool = (void *)(intptr_t)v[9];
    r.pool_tokens = v[10];
    r.rows = (const long long *)(intptr_t)v[11];
    r.q = (void *)(intptr_t)v[12];
    if (r.n < 0 || r.heads < 1 || r.kv < 1 || r.dim < 2 || r.dim > 256 || r.dim % 2) {
        PyErr_SetString(PyExc_ValueError, "rope_write: bad shape (dim even, at most 256)");
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS
    rope_write_rows(&r);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

/* ---- the output head's refinement (linear.RefinedHead): each row's k best coarse logits
   recomputed exactly, in float32, from the dense table ----

   torch's topk, gather and bmm cost ~1 ms a decode step at batch 8 (mostly the topk over the
   vocabulary and the copy of the k table rows); here a min-heap of the k best is filled in
   one pass (blocks of 8 logits that cannot enter it are skipped with one compare), and each
   candidate's dot product reads its table row in place. */

TARGET_AVX2 static void heap_down(float *val, int *idx, int n, int at) {
    for (;;) {
        int low = at, l = 2 * at + 1, r = l + 1;
        if (l < n && (val[l] < val[low] || (val[l] == val[low] && idx[l] > idx[low]))) low = l;
        if (r < n && (val[r] < val[low] || (val[r] == val[low] && idx[r] > idx[low]))) low = r;
        if (low == at) return;
        float v = val[at];
        int i = idx[at];
        val[at] = val[low];
        idx[at] = idx[low];
        val[low] = v;
        idx[low] = i;
        at = low;
    }
}

#define REFINE_MAX 1024
#define ROWS_AHEAD 4

/* Every cache line of the bytes at p into L1. */
static inline void prefetch_bytes(const char *p, size_t bytes) {
    const char *end = p + bytes;
    for (p = (const char *)((uintptr_t)p & ~(uintptr_t)63); p < end; p += 64) _mm_prefetch(p, _MM_HINT_T0);
}

/* A Q8_0 block (the GGUF format): a float16 scale, then 32 int8; w = scale · q in float32,
   as quant.dequantize computes it (the same products, so the same bits). */
#define Q8_0_BYTES 34

TARGET_AVX2 static inline __m256 q8_0_load8(const uint8_t *row, int d) {
    const uint8_t *block = row + (size_t)(d / GROUP) * Q8_0_BYTES;
    uint16_t half;
    memcpy(&half, block, 2);
    const __m256 scale = _mm256_cvtph_ps(_mm_set1_epi16((short)half));
    const __m128i q = _mm_loadl_epi64((const __m128i *)(block + 2 + d % GROUP));
    return _mm256_mul_ps(scale, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q)));
}

/* The heap of the k best logits among logits[at[0..n-1]] (at: ascending indices, or NULL for
   0..n-1), in val/idx: for each its logit and index. */
TARGET_AVX2 static void best_k(const float *logits, const int *at, int n, int k, float *val,
                               int *idx) {
    /* the heap's root is its worst member: the lowest logit, the highest index on a tie. Fed
       in index order, a later equal logit never enters, so the k best are those of the order
       (logit descending, index ascending) whatever subset of the rest is fed. */
    for (int i = 0; i < k; i++) {
        idx[i] = at ? at[i] : i;
        val[i] = logits[idx[i]];
    }
    for (int i = k / 2 - 1; i >= 0; i--) heap_down(val, idx, k, i);
    int i = k;
    if (at == NULL) {
        for (; i < n && (i & 7); i++)
            if (logits[i] > val[0]) {
                val[0] = logits[i];
                idx[0] = i;
                heap_down(val, idx, k, 0);
            }
        for (; i + 8 <= n; i += 8) {
            const __m256 v = _mm256_loadu_ps(logits + i);
            if (!_mm256_movemask_ps(_mm256_cmp_ps(v, _mm256_set1_ps(val[0]), _CMP_GT_OQ))) continue;
            for (int j = i; j < i + 8; j++)
                if (logits[j] > val[0]) {
                    val[0] = logits[j];
                    idx[0] = j;
                    heap_down(val, idx, k, 0);
                }
        }
    }
    for (; i < n; i++) {
        const int j = at ? at[i] : i;
        if (logits[j] > val[0]) {
            val[0] = logits[j];
            idx[0] = j;
            heap_down(val, idx, k, 0);
        }
    }
}

/* Why a threshold first: over a whole vocabulary the heap above takes ~k · ln(vocab / k)
   entries (~1,300 at k = 256 and 49,152 logits, each a walk down 8 levels with unpredictable
   branches): ~0.15 ms a row, 4 rows a thread at batch 8. A threshold that at least k logits
   reach, taken from every SAMPLE_STRIDE-th logit, leaves ~1.5 k candidates after one
   vectorised pass, and the heap runs over those alone: the same k best (see best_k). Where
   the sample misleads (fewer than k reach it, too many tie at it, a NaN), the whole row. */
#define SAMPLE_STRIDE 16
#define CANDIDATES_MAX (4 * REFINE_MAX)

/* logits[0 .. vocab - 1]'s candidates at or above a threshold into at (ascending): their
   count, or -1 where the caller must take the whole row. */
TARGET_AVX2 static int candidates(const float *logits, int vocab, int k, int *at) {
    const int want = (3 * k + 2 * SAMPLE_STRIDE - 1) / (2 * SAMPLE_STRIDE); /* ~1.5 k reach it */
    const int samples = vocab / SAMPLE_STRIDE;
    if (want < 2 || samples < 8 * want) return -1;
    float low[REFINE_MAX];
    int unused[REFINE_MAX];
    for (int i = 0; i < want; i++) {
        low[i] = logits[i * SAMPLE_STRIDE];
        unused[i] = i;
    }
    for (int i = want / 2 - 1; i >= 0; i--) heap_down(low, unused, want, i);
    for (int i = want; i < samples; i++) {
        const float v = logits[(size_t)i * SAMPLE_STRIDE];
        if (v > low[0]) {
            low[0] = v;
            heap_down(low, unused, want, 0);
        }
    }
    const float t = low[0];
    if (t != t) return -1;
    const __m256 threshold = _mm256_set1_ps(t);
    __m256 nan = _mm256_setzero_ps();
    int n = 0, i = 0;
    for (; i + 8 <= vocab; i += 8) {
        const __m256 v = _mm256_loadu_ps(logits + i);
        nan = _mm256_or_ps(nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
        unsigned hit = (unsigned)_mm256_movemask_ps(_mm256_cmp_ps(v, threshold, _CMP_GE_OQ));
        if (hit == 0) continue;
        if (n + 8 > CANDIDATES_MAX) return -1;
        for (; hit; hit &= hit - 1) at[n++] = i + __builtin_ctz(hit);
    }
    for (; i < vocab; i++) {
        if (logits[i] != logits[i] || n + 1 > CANDIDATES_MAX) return -1;
        if (logits[i] >= t) at[n++] = i;
    }
    return _mm256_movemask_ps(nan) || n < k ? -1 : n;
}

TARGET_AVX2 static void refine_row(float *logits, int vocab, const void *x, int bf16,
                                   const void *table, int dim, int k, int q8) {
    float val[REFINE_MAX], xf[8192];
    int idx[REFINE_MAX], at[CANDIDATES_MAX];
    const int n = candidates(logits, vocab, k, at);
    if (n < 0)
        best_k(logits, NULL, vocab, k, val, idx);
    else
        best_k(logits, at, n, k, val, idx);
    for (int d = 0; d < dim; d += 8) _mm256_storeu_ps(xf + d, load8(x, bf16, (size_t)d));
    /* The candidates' rows are scattered over a table that the coarse pass has just pushed
       out of cache: each is read ROWS_AHEAD candidates early, so the reads overlap (Qwen2.5's
       151,936 rows at batch 8: the head's coarse pass and refine 6.2 -> 5.8-6.0 ms). */
    const size_t row_bytes = q8 ? (size_t)(dim / GROUP) * Q8_0_BYTES : (size_t)dim * 4;
    for (int c = 0; c < k && c < ROWS_AHEAD; c++)
        prefetch_bytes((const char *)table + (size_t)idx[c] * row_bytes, row_bytes);
    for (int c = 0; c < k; c++) {
        const char *row = (const char *)table + (size_t)idx[c] * row_bytes;
        if (c + ROWS_AHEAD < k)
            prefetch_bytes((const char *)table + (size_t)idx[c + ROWS_AHEAD] * row_bytes, row_bytes);
        __m256 s0 = _mm256_setzero_ps(), s1 = s0;
        int d = 0;
        if (q8) { /* rows of Q8_0 blocks (dim a multiple of 32): the float32 dot, lane for lane */
            for (; d < dim; d += 16) {
                s0 = _mm256_fmadd_ps(q8_0_load8((const uint8_t *)row, d), _mm256_loadu_ps(xf + d), s0);
                s1 = _mm256_fmadd_ps(q8_0_load8((const uint8_t *)row, d + 8), _mm256_loadu_ps(xf + d + 8), s1);
            }
        } else {
            const float *w = (const float *)row;
            for (; d + 16 <= dim; d += 16) {
                s0 = _mm256_fmadd_ps(_mm256_loadu_ps(w + d), _mm256_loadu_ps(xf + d), s0);
                s1 = _mm256_fmadd_ps(_mm256_loadu_ps(w + d + 8), _mm256_loadu_ps(xf + d + 8), s1);
            }
            if (d < dim) s0 = _mm256_fmadd_ps(_mm256_loadu_ps(w + d), _mm256_loadu_ps(xf + d), s0);
        }
        logits[idx[c]] = hsum8(_mm256_add_ps(s0, s1));
    }
}

/* refine(logits, rows, vocab, x, x_bf16, table, dim, k[, q8]): logits float32 [rows, vocab]
   in place; x [rows, dim] (bfloat16 if x_bf16, else float32); table float32 [vocab, dim], or
   with q8 the file's Q8_0 blocks [vocab, dim / 32 · 34] (a quarter of the memory, same bits). */
static PyObject *q4_refine(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    long long v[9] = {0};
    const Py_ssize_t want = nargs == 9 ? 9 : 8; /* q8 is optional */
    if (take_ints(args, nargs, want, (int)want, v, "refine") < 0) return NULL;
    float *logits = (float *)(intptr_t)v[0];
    const int rows = (int)v[1], vocab = (int)v[2], bf16 = (int)v[4], dim = (int)v[6], k = (int)v[7];
    const int q8 = v[8] != 0;
    const char *x = (const char *)(intptr_t)v[3];
    const void *table = (const void *)(intptr_t)v[5];
    if (rows < 1 || k < 1 || k > REFINE_MAX || k > vocab || dim < 8 || dim > 8192 || dim % 8 ||
        (q8 && dim % GROUP)) {
        PyErr_SetString(PyExc_ValueError,
                        "refine: bad shape (k 1..1024 and at most the vocabulary, dim 8..8192 by 8, "
                        "by 32 for Q8_0 rows)");
        return NULL;
    }
    const size_t x_row = (size_t)dim * (bf16 ? 2 : 4);
    Py_BEGIN_ALLOW_THREADS
#pragma omp parallel for schedule(static) if (rows > 1)
    for (int r = 0; r < rows; r++)
        refine_row(logits + (size_t)r * vocab, vocab, x + r * x_row, bf16, table, dim, k, q8);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

typedef void (*run_fn)(const job_t *);
static run_fn RUN = NULL, RUN8 = NULL;
static const char *ISA = "";

static PyObject *q4_isa(PyObject *self, PyObject *unused) {
    (void)self;
    (void)unused;
    return PyUnicode_FromString(ISA);
}

static PyObject *q4_use(PyObject *self, PyObject *arg) {
    /* for tests: force one instruction set this CPU has ("avx2" on a VNNI CPU) */
    (void)self;
    const char *name = PyUnicode_AsUTF8(arg);
    if (name == NULL) return NULL;
    __builtin_cpu_init();
    if (strcmp(name, "avx512vnni") == 0 && __builtin_cpu_supports("avx512vnni") &&
        __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("fma")) {
        RUN = vnni16_run;
        RUN8 = vnni16_run;
        ATTEND = attend_one512;
        ISA = "avx512vnni";
        Py_RETURN_TRUE;
    }
    const int narrow = strcmp(name, "avx2-int8") == 0; /* AVX2 without groupk's int16 sums */
    if ((narrow || strcmp(name, "avx2") == 0) && __builtin_cpu_supports("avx2") &&
        __builtin_cpu_supports("fma")) {
        RUN = narrow ? avx2i8_run : avx2_run;
        RUN8 = avx2_run8;
        ATTEND = attend_one;
        ISA = narrow ? "avx2-int8" : "avx2";
        Py_RETURN_TRUE;
    }
    Py_RETURN_FALSE;
}

/* One product, however it is called (matmul below, or the decode layers' loop): the job's
   weights and output, its input x (float32 or bfloat16: FLAG_X_BF16) and prologue (PRO_*,
   `norm`: RMSNorm's weight), and for int8 weights their group sums (`wsum`). Call without
   the GIL. 0, or -1 when the scratch cannot be had. */
typedef struct {
    job_t j;
    const void *x;
    int mode;
    const float *norm;
    float eps;
} product_t;

static int product(product_t *p) {
    job_t *jp = &p->j;
    const int int8 = jp->minimum == NULL;
    run_fn run = int8 ? RUN8 : RUN;
    const size_t groups = (size_t)jp->batch * (jp->in / GROUP);
    const size_t staged = p->mode == PRO_NONE ? 0 : (size_t)jp->batch * jp->in;
    /* 4-bit and grouped int8: two int8 passes (see quantize_rows), unless the caller asks
       for one */
    const int grouped = int8 && (jp->flags & FLAG_GROUPED);
    const int two = (!int8 || grouped) && !(jp->flags & FLAG_ONE_PASS);
    /* one allocation: the prologue's float32 rows, group scales and sums, int8 x (twice),
       and for int8 weights both again + 128 */
    const size_t xn = (size_t)jp->batch * jp->in;
    char *scratch = malloc((staged + 2 * groups) * sizeof(float) + (int8 ? 4 : 2) * xn);
    if (scratch == NULL) return -1;
    float *xf = (float *)scratch, *dx = xf + staged, *sx = dx + groups;
    int8_t *qx = (int8_t *)(sx + groups), *qlo = qx + (size_t)jp->batch * jp->in;
    jp->qx = qx;
    jp->dx = dx;
    jp->sx = sx;
    jp->qlo = two ? qlo : NULL;
    jp->qxu = int8 ? (uint8_t *)qlo + xn : NULL; /* int8 weights: qx + 128 */
    jp->qlou = int8 ? (uint8_t *)qlo + 2 * xn : NULL; /* and qlo + 128 */
    const int coarse = !int8 && (jp->flags & FLAG_COARSE);
    jp->xsum = coarse ? (const int32_t *)sx : NULL; /* sx's room: as many int32 */
    /* vnni16_tile8 (batch 2 and more) takes the activations unsigned: qx + 128 */
    const int flip = int8 && jp->batch > 1 && RUN8 == vnni16_run;
    const int bf16 = jp->flags & FLAG_X_BF16, mode = p->mode;
    /* the input's row: gate and up for the GLU prologues, else `in` values */
    const size_t row = (size_t)jp->in * (mode == PRO_SILU || mode == PRO_GELU ? 2 : 1);
    const size_t row_bytes = row * (bf16 ? 2 : 4);
    const int gpr = jp->in / GROUP;
    const job_t j = *jp;
    /* One parallel region: each thread prepares its rows (prologue, int8 quantisation), then
       the threads share the product (the run functions' `omp for`). Prepared before the
       region, the rows kept one core idle: ~0.5 ms a decode step at batch 8. */
#pragma omp parallel
    {
#pragma omp for schedule(static)
        for (int b = 0; b < j.batch; b++) {
            const void *xb = (const char *)p->x + (size_t)b * row_bytes;
            int xb_bf16 = bf16;
            if (mode != PRO_NONE) {
                float *out = xf + (size_t)b * j.in;
                prologue(xb, bf16, mode, p->norm, p->eps, 1, j.in, out,
                         bf16 && mode == PRO_SILU && (j.flags & FLAG_GLU_ROUNDED));
                xb = out;
                xb_bf16 = 0;
            }
            const size_t at = (size_t)b * j.in;
            if (coarse)
                quantize_row_scaled(xb, xb_bf16, j.in, qx + at, dx + b, (int32_t *)sx + (size_t)b * gpr);
            else
                quantize_rows(xb, xb_bf16, 1, j.in, qx + at, dx + (size_t)b * gpr,
                              sx + (size_t)b * gpr, two ? qlo + at : NULL, int8);
            if (flip)
                for (int i = 0; i < j.in; i++) j.qxu[at + i] = (uint8_t)(qx[at + i] ^ 0x80);
            if (flip && two)
                for (int i = 0; i < j.in; i++) j.qlou[at + i] = (uint8_t)(qlo[at + i] ^ 0x80);
        }
        run(&j);
    }
    free(scratch);
    return 0;
}

/* matmul(x, batch, in, weights, scale, minimum, out, y, flags, prologue, aux, eps[, high
   [, sums]]): 4-bit weights when `minimum` is non-zero (5-bit with `high`, their fifth bits),
   else int8 weights with one scale per row (float32 [out]), or with FLAG_GROUPED one per row
   and group of 32 (float16 in the tiles' layout [tiles, groups, 8]); `prologue` (PRO_*) first transforms x (`aux`:
   RMSNorm's weight, float32). int8 weights need their group sums x 128 (int32, in the tiles'
   layout [tiles, groups, 8]: packing.q8_group_sums): `sums`, or without a prologue `aux`. */
static PyObject *q4_matmul(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs < 12 || nargs > 14) {
        PyErr_SetString(PyExc_TypeError, "matmul takes 12 to 14 arguments");
        return NULL;
    }
    if (RUN == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "this CPU has neither AVX2 nor AVX-512 VNNI");
        return NULL;
    }
    long long v[11];
    for (int i = 0; i < 11; i++) {
        v[i] = PyLong_AsLongLong(args[i]);
        if (v[i] == -1 && PyErr_Occurred()) return NULL;
    }
    const double eps = PyFloat_AsDouble(args[11]);
    if (eps == -1.0 && PyErr_Occurred()) return NULL;
    long long extra[2] = {0, 0}; /* high, sums */
    for (Py_ssize_t i = 12; i < nargs; i++) {
        extra[i - 12] = PyLong_AsLongLong(args[i]);
        if (extra[i - 12] == -1 && PyErr_Occurred()) return NULL;
    }
    product_t p;
    job_t *j = &p.j;
    j->high = (const uint32_t *)(intptr_t)extra[0];
    p.x = (const void *)(intptr_t)v[0];
    j->batch = (int)v[1];
    j->in = (int)v[2];
    j->qs = (const uint8_t *)(intptr_t)v[3];
    j->scale = (const void *)(intptr_t)v[4];
    j->minimum = (const void *)(intptr_t)v[5];
    j->out = (int)v[6];
    j->y = (void *)(intptr_t)v[7];
    j->ystride = (size_t)j->out;
    j->flags = (int)v[8];
    p.mode = (int)v[9];
    const float *aux = (const float *)(intptr_t)v[10];
    p.eps = (float)eps;
    if (j->batch < 1 || j->in < GROUP || j->in % GROUP || j->out < 8 || j->out % 8) {
        PyErr_SetString(PyExc_ValueError,
                        "matmul: bad shape (in must be a multiple of 32, out of 8)");
        return NULL;
    }
    if (j->high != NULL && j->minimum == NULL) {
        PyErr_SetString(PyExc_ValueError, "matmul: fifth bits need 4-bit weights (a minimum)");
        return NULL;
    }
    if ((j->flags & FLAG_COARSE) &&
        (j->minimum == NULL || j->high != NULL || !(j->flags & FLAG_ONE_PASS))) {
        PyErr_SetString(PyExc_ValueError,
                        "matmul: the coarse kind is 4-bit weights in one pass, no fifth bits");
        return NULL;
    }
    if ((j->flags & FLAG_GROUPED) && j->minimum != NULL) {
        PyErr_SetString(PyExc_ValueError, "matmul: scales per group of 32 are for int8 weights");
        return NULL;
    }
    if (p.mode < PRO_NONE || p.mode > PRO_GELU || (p.mode == PRO_RMSNORM && aux == NULL)) {
        PyErr_SetString(PyExc_ValueError, "matmul: bad prologue");
        return NULL;
    }
    const int int8 = j->minimum == NULL;
    const int32_t *sums = (const int32_t *)(intptr_t)extra[1];
    p.norm = aux;
    j->wsum = NULL;
    if (int8) {
        j->wsum = sums != NULL ? sums : p.mode == PRO_NONE ? (const int32_t *)aux : NULL;
        if (j->wsum == NULL) {
            PyErr_SetString(PyExc_ValueError, "matmul: int8 weights need their group sums");
            return NULL;
        }
    }
    int failed;
    Py_BEGIN_ALLOW_THREADS
    failed = product(&p);
    Py_END_ALLOW_THREADS
    if (failed) return PyErr_NoMemory();
    Py_RETURN_NONE;
}

/* the decode layers' loop (decode_layers, norm_add): its own file, compiled as part of this one */
#include "_cpu_layers.c"

static PyMethodDef METHODS[] = {
    {"matmul", (PyCFunction)(void (*)(void))q4_matmul, METH_FASTCALL,
     "matmul(x, batch, in, w, scale, minimum, out, y, flags, prologue, aux, eps[, high]): y = x . W^T"},
    {"use", q4_use, METH_O, "use(name) -> bool: force an instruction set this CPU has (tests)"},
    {"attend", (PyCFunction)(void (*)(void))q4_attend, METH_FASTCALL,
     "attend(q, 3 strides, k, 3 strides, v, 3 strides, mask, mask stride, flags, batch, kv, "
     "groups, length, dim, out, scale, rows): decode attention"},
    {"refine", (PyCFunction)(void (*)(void))q4_refine, METH_FASTCALL,
     "refine(logits, rows, vocab, x, x_bf16, table, dim, k[, q8]): each row's k best logits exact"},
    {"rope_write", (PyCFunction)(void (*)(void))q4_rope_write, METH_FASTCALL,
     "rope_write(qkv, n, heads, kv, dim, flags, positions, cos, sin, pool, pool_tokens, rows, "
     "q): RoPE on the rows' Q and K heads; Q out, K and V into the pool"},
    {"norm_add", (PyCFunction)(void (*)(void))q4_norm_add, METH_FASTCALL,
     "norm_add(x, src, src_bf16, n, width, weight, eps, out): out = x + RMSNorm(src) · weight "
     "(weight 0: x + src)"},
    {"decode_layers", (PyCFunction)(void (*)(void))q4_decode_layers, METH_FASTCALL,
     "decode_layers(plan, layers, x, n, dim, heads, kv, head_dim, ffn, flags, pool_tokens, "
     "positions, write_rows, token_rows, length, mask, mask_stride, window, window_stride, "
     "window_start): "
     "every layer of a decode step"},
    {"layer_fields", q4_layer_fields, METH_NOARGS,
     "(fields a part, parts a layer, fields a layer) of decode_layers' plan"},
    {"isa", q4_isa, METH_NOARGS, "the instruction set used: avx512vnni, avx2, or '' (none)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef MODULE = {PyModuleDef_HEAD_INIT, "_cpu_kernel", NULL, -1, METHODS};

PyMODINIT_FUNC PyInit__cpu_kernel(void) {
    PyObject *module = PyModule_Create(&MODULE);
    if (module == NULL) return NULL;
    PyObject *name = PyUnicode_FromString("avx512vnni"), *ok = NULL;
    if (name != NULL) ok = q4_use(NULL, name);
    if (ok == Py_False) {
        Py_DECREF(name);
        name = PyUnicode_FromString("avx2");
        Py_DECREF(ok);
        ok = name == NULL ? NULL : q4_use(NULL, name);
    }
    Py_XDECREF(name);
    Py_XDECREF(ok);
    if (PyErr_Occurred()) {
        Py_DECREF(module);
        return NULL;
    }
    return module;
}
