/* Every layer of a decode step in one call: `decode_layers`, and `norm_add` (a residual add,
   after RMSNorm where the family has post-norms). Included by _cpu_kernel.c, whose products,
   RoPE and attention it calls (engine/model/native_decode.py builds its plan).

   Why: between the kernels of a decode step, Python and torch spent ~80 us a layer (the
   block's method calls, the outputs' allocations, the argument checks, two residual adds):
   on 2 cores that was a third of a batch-1 step of a 135M model. Here the same calls run back
   to back, on buffers allocated once a step.

   The arithmetic is the Python path's (Block.steps with the kernel), call for call: the same
   products with the same prologues, output dtypes and roundings, QK-norm inside RoPE, the same
   attention, the residual adds in float32. So a step gives the same bits either way, and the
   tests hold the two paths to that.

   The plan: per layer LAYER_FIELDS int64, its projections' parts (PART_FIELDS each: a fused
   Q/K/V may be two parts, 4-bit and int8), its norms' and the cache's addresses, and two
   floats as their bits (RMSNorm's eps, the attention scale). */

enum { P_QS, P_SCALE, P_MINIMUM, P_HIGH, P_SUMS, P_OUT, P_FLAGS, PART_FIELDS };
enum { PART_QKV, PART_QKV2, PART_WO, PART_GATE_UP, PART_DOWN, PARTS };
enum {
    L_ATTN_NORM = PARTS * PART_FIELDS, /* float32 [dim] */
    L_FFN_NORM,                        /* float32 [dim] */
    L_QKV_BIAS,                        /* in the activations' dtype [(H + 2KV) · D], or 0 */
    L_QK_NORM,                         /* float32 [H + KV, D], or 0 */
    L_POST_ATTN,                       /* float32 [dim], or 0 */
    L_POST_FFN,                        /* float32 [dim], or 0 */
    L_CACHE,                           /* the layer's pool [2KV, pool tokens, D] */
    L_COS,                             /* float32 RoPE tables [P, D] (the layer's: local or global) */
    L_SIN,
    L_GELU,    /* 1: GELU-tanh, else SiLU */
    L_SLIDING, /* 1: a sliding-window layer (it takes the window mask when there is one) */
    L_EPS,     /* double, as its bits */
    L_SCALE,   /* double, as its bits: the attention's score scale */
    LAYER_FIELDS
};

/* out[t] = x[t] + src[t], or with `w` x[t] + RMSNorm(src[t]) · w; float32 x and out (which
   may be x), src float32 or bfloat16, width a multiple of 8. Without x (NULL): no add, out[t]
   = RMSNorm(src[t]) · w (the model's final norm). */
TARGET_AVX2 static void norm_add_rows(const float *x, const void *src, int src_bf16, int n,
                                      int width, const float *w, float eps, float *out) {
    for (int t = 0; t < n; t++) {
        const size_t at = (size_t)t * width;
        __m256 inv = _mm256_set1_ps(1.0f);
        if (w != NULL) {
            __m256 ss = _mm256_setzero_ps();
            for (int i = 0; i < width; i += 8) {
                const __m256 v = load8(src, src_bf16, at + i);
                ss = _mm256_fmadd_ps(v, v, ss);
            }
            inv = _mm256_set1_ps(1.0f / sqrtf(hsum8(ss) / (float)width + eps));
        }
        for (int i = 0; i < width; i += 8) {
            __m256 v = load8(src, src_bf16, at + i);
            if (w != NULL) v = _mm256_mul_ps(_mm256_mul_ps(v, inv), _mm256_loadu_ps(w + i));
            _mm256_storeu_ps(out + at + i, x == NULL ? v : _mm256_add_ps(_mm256_loadu_ps(x + at + i), v));
        }
    }
}

/* norm_add(x, src, src_bf16, n, width, weight, eps, out): see norm_add_rows; weight 0: a
   plain add; x 0: RMSNorm alone. Pointers as ints. */
static PyObject *q4_norm_add(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    long long v[8];
    if (take_ints(args, nargs, 8, 6, v, "norm_add") < 0) return NULL;
    const double eps = PyFloat_AsDouble(args[6]);
    if (eps == -1.0 && PyErr_Occurred()) return NULL;
    v[7] = PyLong_AsLongLong(args[7]);
    if (v[7] == -1 && PyErr_Occurred()) return NULL;
    if (v[3] < 0 || v[4] < 8 || v[4] % 8) {
        PyErr_SetString(PyExc_ValueError, "norm_add: bad shape (width a multiple of 8)");
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS
    norm_add_rows((const float *)(intptr_t)v[0], (const void *)(intptr_t)v[1], (int)v[2],
                  (int)v[3], (int)v[4], (const float *)(intptr_t)v[5], (float)eps,
                  (float *)(intptr_t)v[7]);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

/* One step's rows and where they go (the same for every layer). */
typedef struct {
    float *x; /* the residual stream, float32 [n, dim], updated in place */
    int n, dim, heads, kv, head_dim, ffn, act_bf16, cache_bf16;
    long long pool_tokens;
    const long long *positions, *write_rows, *token_rows; /* [n], [n], [n, length] */
    const long long *ends; /* [n] each row's end position (the attention reads no key past it,
                              see row_keys), or NULL: all `length` */
    int length;
    int window_start; /* sliding layers with a window: the first position they attend */
    const void *mask, *window; /* additive, in the activations' dtype [n or 1, L], or NULL */
    long long mask_stride, window_stride;
} step_t;

static double plan_double(long long bits) {
    double d;
    memcpy(&d, &bits, sizeof d);
    return d;
}

/* A projection's part as a job: batch n, input `in` wide, output into y (row stride ystride). */
static void part_job(job_t *j, const long long *part, int n, int in, void *y, size_t ystride,
                     int flags) {
    memset(j, 0, sizeof *j);
    j->qs = (const uint8_t *)(intptr_t)part[P_QS];
    j->scale = (const void *)(intptr_t)part[P_SCALE];
    j->minimum = (const void *)(intptr_t)part[P_MINIMUM];
    j->high = (const uint32_t *)(intptr_t)part[P_HIGH];
    j->wsum = (const int32_t *)(intptr_t)part[P_SUMS];
    j->out = (int)part[P_OUT];
    j->flags = (int)part[P_FLAGS] | flags;
    j->batch = n;
    j->in = in;
    j->y = y;
    j->ystride = ystride;
}

static int run_part(const long long *part, int n, int in, const void *x, int x_bf16, int mode,
                    const float *norm, float eps, void *y, size_t ystride, int y_bf16) {
    product_t p;
    part_job(&p.j, part, n, in, y, ystride,
             (x_bf16 ? FLAG_X_BF16 : 0) | (y_bf16 ? FLAG_Y_BF16 : 0));
    p.x = x;
    p.mode = mode;
    p.norm = norm;
    p.eps = eps;
    return product(&p);
}

/* Every layer over the step's rows; 0, or -1 when memory runs out. Call without the GIL. */
static int decode_layers_run(const long long *plan, int layers, const step_t *s) {
    const int n = s->n, H = s->heads, KV = s->kv, D = s->head_dim, G = H / KV;
    const int width = (H + 2 * KV) * D, act = s->act_bf16;
    const size_t esz = act ? 2 : 4;
    /* the step's buffers: Q/K/V in float32, then Q, the attention's output, the attention
       projection's, the gate and up rows, the MLP's output; and the attention's scratch */
    const size_t sizes[6] = {(size_t)n * width * 4, (size_t)n * H * D * esz,
                             (size_t)n * H * D * esz, (size_t)n * s->dim * esz,
                             (size_t)n * 2 * s->ffn * esz, (size_t)n * s->dim * esz};
    const size_t att = (size_t)n * KV * G * ((size_t)s->length + D) * sizeof(float);
    size_t total = att;
    for (int i = 0; i < 6; i++) total += (sizes[i] + 63) & ~(size_t)63;
    char *base = malloc(total);
    if (base == NULL) return -1;
    char *buf[6], *at = base;
    for (int i = 0; i < 6; i++) {
        buf[i] = at;
        at += (sizes[i] + 63) & ~(size_t)63;
    }
    float *qkv = (float *)buf[0];
    void *q = buf[1], *attn = buf[2], *o = buf[3], *gate_up = buf[4], *y = buf[5];
    int failed = 0;
    for (int l = 0; l < layers && !failed; l++) {
        const long long *L = plan + (size_t)l * LAYER_FIELDS;
        const float eps = (float)plan_double(L[L_EPS]);
        const float *attn_norm = (const float *)(intptr_t)L[L_ATTN_NORM];
        /* Q, K and V in float32 (the native RoPE's input), each part into its columns */
        int col = 0;
        for (int part = PART_QKV; part <= PART_QKV2 && !failed; part++) {
            const long long *P = L + part * PART_FIELDS;
            if (P[P_QS] == 0) continue;
            failed = run_part(P, n, s->dim, s->x, 0, PRO_RMSNORM, attn_norm, eps, qkv + col,
                              (size_t)width, 0);
            col += (int)P[P_OUT];
        }
        if (failed) break;
        const void *bias = (const void *)(intptr_t)L[L_QKV_BIAS];
        if (bias != NULL)
            for (int t = 0; t < n; t++)
                for (int i = 0; i < width; i++) qkv[(size_t)t * width + i] += load_f(bias, act, i);
        rope_t r;
        r.qkv = qkv;
        r.pos = s->positions;
        r.rows = s->write_rows;
        r.cos = (const float *)(intptr_t)L[L_COS];
        r.sin = (const float *)(intptr_t)L[L_SIN];
        r.norm = (const float *)(intptr_t)L[L_QK_NORM];
        r.eps = eps;
        r.pool = (void *)(intptr_t)L[L_CACHE];
        r.q = q;
        r.pool_tokens = s->pool_tokens;
        r.n = n;
        r.heads = H;
        r.kv = KV;
        r.dim = D;
        r.x_bf16 = 0;
        r.pool_bf16 = s->cache_bf16;
        r.q_bf16 = act;
        rope_write_rows(&r);
        /* attention: Q [n, KV, G, D]; K and V read in place from the pool through the rows */
        attn_t a;
        const int window = L[L_SLIDING] && s->window != NULL;
        a.q = (const char *)q;
        a.qs[0] = (long long)KV * G * D;
        a.qs[1] = (long long)G * D;
        a.qs[2] = D;
        a.k = (const char *)r.pool;
        a.v = (const char *)r.pool + (size_t)KV * s->pool_tokens * D * esz;
        a.ks[0] = a.vs[0] = 2LL * KV * s->pool_tokens * D;
        a.ks[1] = a.vs[1] = s->pool_tokens * D;
        a.ks[2] = a.vs[2] = D;
        /* a sliding layer reads from window_start on: keys before it are outside every
           row's window (their scores would be -inf, their weights exactly 0) */
        const int start = window ? s->window_start : 0;
        a.rows = s->token_rows + start;
        a.rows_stride = s->length;
        a.ends = s->ends;
        a.ends_from = start;
        a.mask = (const char *)(window ? s->window : s->mask);
        a.mask_stride = window ? s->window_stride : s->mask_stride;
        a.bf16 = act;
        a.mask_bf16 = act;
        a.batch = n;
        a.kv = KV;
        a.groups = G;
        a.length = s->length - start;
        a.dim = D;
        const double scale = plan_double(L[L_SCALE]);
        a.scale = (float)(scale != 0.0 ? scale : 1.0 / sqrt((double)D));
        a.out = attn;
        a.scratch = (float *)at;
        attend_all(&a);
        const long long *wo = L + PART_WO * PART_FIELDS;
        failed = run_part(wo, n, H * D, attn, act, PRO_NONE, NULL, 0.0f, o, (size_t)s->dim, act);
        if (failed) break;
        norm_add_rows(s->x, o, act, n, s->dim, (const float *)(intptr_t)L[L_POST_ATTN], eps,
                      s->x);
        const long long *gu = L + PART_GATE_UP * PART_FIELDS;
        failed = run_part(gu, n, s->dim, s->x, 0, PRO_RMSNORM,
                          (const float *)(intptr_t)L[L_FFN_NORM], eps, gate_up,
                          (size_t)gu[P_OUT], act);
        if (failed) break;
        const long long *down = L + PART_DOWN * PART_FIELDS;
        failed = run_part(down, n, s->ffn, gate_up, act, L[L_GELU] ? PRO_GELU : PRO_SILU, NULL,
                          0.0f, y, (size_t)s->dim, act);
        if (failed) break;
        norm_add_rows(s->x, y, act, n, s->dim, (const float *)(intptr_t)L[L_POST_FFN], eps, s->x);
    }
    free(base);
    return failed ? -1 : 0;
}

/* decode_layers(plan, layers, x, n, dim, heads, kv, head_dim, ffn, flags, pool_tokens,
   positions, write_rows, token_rows, length, mask, mask_stride, window, window_stride,
   window_start, ends): flags 1: activations (and the additive masks) in bfloat16, 2: the pool in
   bfloat16. The pool must be in the activations' dtype (attention reads it in place).
   Pointers as ints; mask and window 0 when there is none. The window's columns are positions
   window_start .. length - 1 (its row stride: window_stride). ends: int64 [n], each row's end
   position (at most length; no key past it is read), or 0. */
static PyObject *q4_decode_layers(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    long long v[21];
    if (take_ints(args, nargs, 21, 21, v, "decode_layers") < 0) return NULL;
    step_t s;
    s.x = (float *)(intptr_t)v[2];
    s.n = (int)v[3];
    s.dim = (int)v[4];
    s.heads = (int)v[5];
    s.kv = (int)v[6];
    s.head_dim = (int)v[7];
    s.ffn = (int)v[8];
    s.act_bf16 = (int)(v[9] & 1);
    s.cache_bf16 = (int)((v[9] >> 1) & 1);
    s.pool_tokens = v[10];
    s.positions = (const long long *)(intptr_t)v[11];
    s.write_rows = (const long long *)(intptr_t)v[12];
    s.token_rows = (const long long *)(intptr_t)v[13];
    s.length = (int)v[14];
    s.mask = (const void *)(intptr_t)v[15];
    s.mask_stride = v[16];
    s.window = (const void *)(intptr_t)v[17];
    s.window_stride = v[18];
    s.window_start = (int)v[19];
    s.ends = (const long long *)(intptr_t)v[20];
    const int layers = (int)v[1];
    if (s.n < 1 || layers < 0 || s.kv < 1 || s.heads % s.kv || s.heads / s.kv > 16 ||
        s.head_dim < 16 || s.head_dim > 256 || s.head_dim % 16 || s.dim % GROUP ||
        s.ffn % GROUP || (s.heads * s.head_dim) % GROUP || s.length < 1 ||
        s.act_bf16 != s.cache_bf16 || s.token_rows == NULL || s.window_start < 0 ||
        s.window_start >= s.length) {
        PyErr_SetString(PyExc_ValueError, "decode_layers: shapes or dtypes it does not take");
        return NULL;
    }
    int failed;
    Py_BEGIN_ALLOW_THREADS
    failed = decode_layers_run((const long long *)(intptr_t)v[0], layers, &s);
    Py_END_ALLOW_THREADS
    if (failed) return PyErr_NoMemory();
    Py_RETURN_NONE;
}

static PyObject *q4_layer_fields(PyObject *self, PyObject *unused) {
    (void)self;
    (void)unused;
    return Py_BuildValue("(iii)", PART_FIELDS, PARTS, LAYER_FIELDS);
}
