// The float32 loops of the Lazy Attention CPU ops: per-row Elastic-Softmax, the decode task, the causal row pass.
//
// No include guard on purpose: lazy_attention_cpu.cpp includes this file twice, once as `namespace scalar` (generic
// code, whatever the compiler vectorises for the baseline ISA) and once as `namespace avx2` under
// `#pragma GCC target("avx2,fma")` with LAZY_AVX2 defined (intrinsics for the scores, softmax and value sums); the
// op picks one at run time from the CPU it runs on. Everything here is float32; other dtypes are converted by the
// callers of the row loaders (`DecodeArgs::key_row`) on load.
//
// NaN and Inf follow the PyTorch reference: a NaN score makes its whole row of weights NaN (the softmax sum is
// NaN), so the head's output is NaN; the max ignores NaN, `lazy_exp` maps NaN to NaN without touching an integer
// conversion, and the ReLU keeps NaN (`a < 0 ? 0 : a`). A row whose scores are all -inf has no normaliser: 0.

namespace LAZY_ISA {

// exp(x) for x <= 0 (x = -inf gives 0, NaN gives NaN): 2^k * p(r), r = x - k ln2 in [-ln2/2, ln2/2], p of degree 6
// (relative error below 2e-7). x is clamped to [-87, 88] before the integer exponent is formed, so no float-to-int
// conversion ever sees NaN or a value out of range.
static inline float lazy_exp(float x) {
    const bool nan = x != x;
    const float zero = x < -87.0f ? 0.0f : 1.0f;  // exp(-87) ~ 1.6e-38: below it (and -inf), 0
    x = nan ? 0.0f : (x < -87.0f ? -87.0f : (x > 88.0f ? 88.0f : x));
    const float k = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;  // round to nearest: 1.5 * 2^23
    float r = x - k * 0.693145751953125f;
    r = r - k * 1.428606765330187045e-06f;
    float p = 1.0f / 720.0f;
    p = p * r + 1.0f / 120.0f;
    p = p * r + 1.0f / 24.0f;
    p = p * r + 1.0f / 6.0f;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    const uint32_t bits = static_cast<uint32_t>(static_cast<int32_t>(k) + 127) << 23;
    float scale;
    std::memcpy(&scale, &bits, sizeof(scale));
    return nan ? std::numeric_limits<float>::quiet_NaN() : p * scale * zero;
}

static inline float lazy_dot(const float *a, const float *b, int64_t n) {
    float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        for (int j = 0; j < 8; j++) acc[j] += a[i + j] * b[i + j];
    float sum = ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
    for (; i < n; i++) sum += a[i] * b[i];
    return sum;
}

#ifdef LAZY_AVX2
// out[0..7] = scale * q . k_j for the 8 key rows k_j (dim a multiple of 8): 8 accumulators, one transpose-add.
static inline void lazy_dot8(const float *q, const float *const *k, int64_t dim, float scale, float *out) {
    __m256 a[8];
    for (int j = 0; j < 8; j++) a[j] = _mm256_setzero_ps();
    for (int64_t d = 0; d < dim; d += 8) {
        const __m256 qd = _mm256_loadu_ps(q + d);
        for (int j = 0; j < 8; j++) a[j] = _mm256_fmadd_ps(qd, _mm256_loadu_ps(k[j] + d), a[j]);
    }
    const __m256 h01 = _mm256_hadd_ps(a[0], a[1]), h23 = _mm256_hadd_ps(a[2], a[3]);
    const __m256 h45 = _mm256_hadd_ps(a[4], a[5]), h67 = _mm256_hadd_ps(a[6], a[7]);
    const __m256 h03 = _mm256_hadd_ps(h01, h23), h47 = _mm256_hadd_ps(h45, h67);
    const __m256 sum = _mm256_add_ps(_mm256_permute2f128_ps(h03, h47, 0x20), _mm256_permute2f128_ps(h03, h47, 0x31));
    _mm256_storeu_ps(out, _mm256_mul_ps(sum, _mm256_set1_ps(scale)));
}

// acc[g][c0 .. c0 + 15] += sum_i w[i * groups + g] * rows[i][c0 .. c0 + 15] for GB (<= 4) heads g: registers only
template <int GB>
static inline void lazy_axpy16(const float *w, int64_t groups, const float *const *rows, int64_t m, int64_t c0,
                               float *acc, int64_t acc_stride) {
    __m256 a[GB][2];
    for (int g = 0; g < GB; g++) {
        a[g][0] = _mm256_loadu_ps(acc + g * acc_stride + c0);
        a[g][1] = _mm256_loadu_ps(acc + g * acc_stride + c0 + 8);
    }
    for (int64_t i = 0; i < m; i++) {
        const __m256 v0 = _mm256_loadu_ps(rows[i] + c0), v1 = _mm256_loadu_ps(rows[i] + c0 + 8);
        for (int g = 0; g < GB; g++) {
            const __m256 x = _mm256_broadcast_ss(w + i * groups + g);
            a[g][0] = _mm256_fmadd_ps(x, v0, a[g][0]);
            a[g][1] = _mm256_fmadd_ps(x, v1, a[g][1]);
        }
    }
    for (int g = 0; g < GB; g++) {
        _mm256_storeu_ps(acc + g * acc_stride + c0, a[g][0]);
        _mm256_storeu_ps(acc + g * acc_stride + c0 + 8, a[g][1]);
    }
}

// The same over 32 columns for GB <= 3 heads (12 accumulators; the value row is read from memory by each FMA)
template <int GB>
static inline void lazy_axpy32(const float *w, int64_t groups, const float *const *rows, int64_t m, int64_t c0,
                               float *acc, int64_t acc_stride) {
    __m256 a[GB][4];
    for (int g = 0; g < GB; g++)
        for (int j = 0; j < 4; j++) a[g][j] = _mm256_loadu_ps(acc + g * acc_stride + c0 + 8 * j);
    for (int64_t i = 0; i < m; i++) {
        const float *r = rows[i] + c0;
        for (int g = 0; g < GB; g++) {
            const __m256 x = _mm256_broadcast_ss(w + i * groups + g);
            for (int j = 0; j < 4; j++) a[g][j] = _mm256_fmadd_ps(x, _mm256_loadu_ps(r + 8 * j), a[g][j]);
        }
    }
    for (int g = 0; g < GB; g++)
        for (int j = 0; j < 4; j++) _mm256_storeu_ps(acc + g * acc_stride + c0 + 8 * j, a[g][j]);
}

// lazy_exp on 8 lanes (NaN lanes stay NaN: all bits set)
static inline __m256 lazy_exp8(__m256 x) {
    const __m256 low = _mm256_set1_ps(-87.0f);
    const __m256 nan = _mm256_cmp_ps(x, x, _CMP_UNORD_Q);
    const __m256 keep = _mm256_cmp_ps(x, low, _CMP_GE_OQ);  // below exp(-87) (and -inf): 0
    x = _mm256_min_ps(_mm256_max_ps(x, low), _mm256_set1_ps(88.0f));  // NaN lanes become -87 (max returns `low`)
    const __m256 k = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(k, _mm256_set1_ps(0.693145751953125f), x);
    r = _mm256_fnmadd_ps(k, _mm256_set1_ps(1.428606765330187045e-06f), r);
    __m256 p = _mm256_set1_ps(1.0f / 720.0f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 120.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 24.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 6.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(k), _mm256_set1_epi32(127)), 23);
    return _mm256_or_ps(_mm256_and_ps(_mm256_mul_ps(p, _mm256_castsi256_ps(e)), keep), nan);
}

static inline float lazy_hmax8(__m256 x) {
    __m128 y = _mm_max_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
    y = _mm_max_ps(y, _mm_movehl_ps(y, y));
    y = _mm_max_ss(y, _mm_shuffle_ps(y, y, 1));
    return _mm_cvtss_f32(y);
}

static inline float lazy_hsum8(__m256 x) {
    __m128 y = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
    y = _mm_add_ps(y, _mm_movehl_ps(y, y));
    y = _mm_add_ss(y, _mm_shuffle_ps(y, y, 1));
    return _mm_cvtss_f32(y);
}
#endif

// max_t x[t] over the scores that are not NaN (-inf when there is none)
static inline float lazy_max(const float *x, int64_t n) {
    float m = -INFINITY;
    int64_t t = 0;
#ifdef LAZY_AVX2
    __m256 lanes = _mm256_set1_ps(-INFINITY);
    // MAXPS returns its second operand when either is NaN: the lanes never take a NaN score
    for (; t + 8 <= n; t += 8) lanes = _mm256_max_ps(_mm256_loadu_ps(x + t), lanes);
    m = lazy_hmax8(lanes);
#endif
    for (; t < n; t++) m = x[t] > m ? x[t] : m;
    return m;
}

// x[t] = exp(x[t] - m) in place; returns the sum (NaN when some x[t] is NaN)
static inline float lazy_exp_sum(float *x, int64_t n, float m) {
    float z = 0.0f;
    int64_t t = 0;
#ifdef LAZY_AVX2
    __m256 lanes = _mm256_setzero_ps();
    const __m256 mv = _mm256_set1_ps(m);
    for (; t + 8 <= n; t += 8) {
        const __m256 e = lazy_exp8(_mm256_sub_ps(_mm256_loadu_ps(x + t), mv));
        _mm256_storeu_ps(x + t, e);
        lanes = _mm256_add_ps(lanes, e);
    }
    z = lazy_hsum8(lanes);
#endif
    for (; t < n; t++) {
        x[t] = lazy_exp(x[t] - m);
        z += x[t];
    }
    return z;
}

// Biased scores x[0 .. n - 1] become the weights a_t = max(0, softmax(x)_t + shift) in place; a row without a
// finite (or +inf) score gets 0, or NaN when one of its scores is NaN (the reference's softmax of that row is NaN).
static inline void lazy_elastic_softmax(float *x, int64_t n, float shift) {
    const float m = lazy_max(x, n);
    if (m == -INFINITY) {
        bool nan = false;
        for (int64_t t = 0; t < n; t++) nan |= x[t] != x[t];
        const float fill = nan ? std::numeric_limits<float>::quiet_NaN() : 0.0f;
        for (int64_t t = 0; t < n; t++) x[t] = fill;
        return;
    }
    const float inv_z = 1.0f / lazy_exp_sum(x, n, m);
    for (int64_t t = 0; t < n; t++) {
        const float a = x[t] * inv_z + shift;
        x[t] = a < 0.0f ? 0.0f : a;  // NaN stays NaN
    }
}

// Scores s[g * n + t] = scale * q_g . k_t of the G query heads `q` for keys t in [lo, hi) of the sequence's n keys
// (key t is cache row first + t), plus the distance bias of keys at distance d = n - 1 - t < W. Each key row is read
// once for the G heads; `converted` holds half-precision rows as float32 (indexed by t).
static void decode_scores(const DecodeArgs &a, int64_t b, int64_t h, int64_t first, int64_t n, int64_t lo, int64_t hi,
                          const float *q, float *s, float *converted) {
    const int64_t groups = a.heads / a.kv_heads, dim = a.dim;
    int64_t t = lo;
#ifdef LAZY_AVX2
    if (dim % 8 == 0)
        for (; t + 8 <= hi; t += 8) {
            const float *k8[8];
            for (int j = 0; j < 8; j++) k8[j] = a.key_row(b, h, first + t + j, converted + (t + j) * dim);
            for (int64_t g = 0; g < groups; g++) lazy_dot8(q + g * dim, k8, dim, a.scale, s + g * n + t);
        }
#endif
    for (; t < hi; t++) {
        const float *kt = a.key_row(b, h, first + t, converted + t * dim);
        for (int64_t g = 0; g < groups; g++) s[g * n + t] = lazy_dot(q + g * dim, kt, dim) * a.scale;
    }
    const int64_t near_lo = n - 1 - (hi - 1), near_hi = (n - 1 - lo) + 1;  // distances of keys hi - 1 .. lo
    const int64_t d_hi = near_hi < a.window ? near_hi : a.window;
    for (int64_t g = 0; g < groups; g++) {
        float *sg = s + g * n;
        const float *bg = a.bias + (h * groups + g) * a.window;
        for (int64_t d = near_lo; d < d_hi; d++) sg[n - 1 - d] += bg[d];
    }
}

// o_g += sum_t w_gt v_t over the keys t in [lo, hi) that some head of the group weights (a NaN weight counts): the
// value rows are gathered with their weights as [m, G], then summed in register tiles.
static void decode_values(const DecodeArgs &a, int64_t b, int64_t h, int64_t first, int64_t n, int64_t lo, int64_t hi,
                          const float *s, float *w, const float **rows, float *v_converted, float *acc) {
    const int64_t groups = a.heads / a.kv_heads, dim_v = a.dim_v;
    int64_t m = 0, t0 = lo;
#ifdef LAZY_AVX2
    for (; t0 + 8 <= hi; t0 += 8) {  // 8 keys at a time: a bit per key that some head weights
        __m256 any = _mm256_setzero_ps();
        for (int64_t g = 0; g < groups; g++)
            any = _mm256_or_ps(any, _mm256_cmp_ps(_mm256_loadu_ps(s + g * n + t0), _mm256_setzero_ps(), _CMP_NEQ_UQ));
        for (unsigned bits = static_cast<unsigned>(_mm256_movemask_ps(any)); bits; bits &= bits - 1) {
            const int64_t tb = t0 + __builtin_ctz(bits);
            for (int64_t g = 0; g < groups; g++) w[m * groups + g] = s[g * n + tb];
            rows[m] = a.value_row(b, h, first + tb, v_converted + m * dim_v);
            m++;
        }
    }
#endif
    for (int64_t tb = t0; tb < hi; tb++) {
        bool any = false;
        for (int64_t g = 0; g < groups; g++) any |= s[g * n + tb] != 0.0f;  // true for NaN
        if (!any) continue;
        for (int64_t g = 0; g < groups; g++) w[m * groups + g] = s[g * n + tb];
        rows[m] = a.value_row(b, h, first + tb, v_converted + m * dim_v);
        m++;
    }
#ifdef LAZY_AVX2
    if (dim_v % 16 == 0) {  // tiles of 64 rows (in L1) x 16 or 32 columns x up to 4 or 3 heads in registers
        for (int64_t i0 = 0; i0 < m; i0 += 64) {
            const int64_t rows_in = m - i0 < 64 ? m - i0 : 64;
            const float *wi = w + i0 * groups, *const *ri = rows + i0;
            if (dim_v % 32 == 0) {
                for (int64_t g0 = 0; g0 < groups; g0 += 3)
                    for (int64_t c0 = 0; c0 < dim_v; c0 += 32) {
                        float *ag = acc + g0 * dim_v;
                        switch (groups - g0 < 3 ? groups - g0 : 3) {
                        case 1: lazy_axpy32<1>(wi + g0, groups, ri, rows_in, c0, ag, dim_v); break;
                        case 2: lazy_axpy32<2>(wi + g0, groups, ri, rows_in, c0, ag, dim_v); break;
                        default: lazy_axpy32<3>(wi + g0, groups, ri, rows_in, c0, ag, dim_v);
                        }
                    }
                continue;
            }
            for (int64_t g0 = 0; g0 < groups; g0 += 4)
                for (int64_t c0 = 0; c0 < dim_v; c0 += 16) {
                    float *ag = acc + g0 * dim_v;
                    switch (groups - g0 < 4 ? groups - g0 : 4) {
                    case 1: lazy_axpy16<1>(wi + g0, groups, ri, rows_in, c0, ag, dim_v); break;
                    case 2: lazy_axpy16<2>(wi + g0, groups, ri, rows_in, c0, ag, dim_v); break;
                    case 3: lazy_axpy16<3>(wi + g0, groups, ri, rows_in, c0, ag, dim_v); break;
                    default: lazy_axpy16<4>(wi + g0, groups, ri, rows_in, c0, ag, dim_v);
                    }
                }
        }
        return;
    }
#endif
    for (int64_t i = 0; i < m; i++)
        for (int64_t g = 0; g < groups; g++) {
            const float wg = w[i * groups + g];
            float *ag = acc + g * dim_v;
            for (int64_t c = 0; c < dim_v; c++) ag[c] += wg * rows[i][c];
        }
}

// One (sequence b, key/value head h) task of the decode op: the G query heads of the group against the sequence's
// keys first .. first + n - 1 (first: 0, or the row after its left padding); key t of them is at distance n - 1 - t.
static void decode_task(const DecodeArgs &a, int64_t task, DecodeScratch &scratch) {
    const int64_t groups = a.heads / a.kv_heads, dim = a.dim, dim_v = a.dim_v;
    const int64_t b = task / a.kv_heads, h = task % a.kv_heads;
    const int64_t first = a.first_key(b), n = a.keys(b) - first;
    if (n <= 0) {
        for (int64_t g = 0; g < groups; g++) a.store_out(b, h * groups + g, nullptr);
        return;
    }
    a.check_blocks(b, first + n);
    float *const s = scratch.floats(2 * groups * n + groups * dim_v + groups * dim + a.convert_floats(n));
    float *const w = s + groups * n, *const acc = w + groups * n, *const q = acc + groups * dim_v;
    float *const converted = q + groups * dim;  // key then value rows of a half-precision cache, as float32
    for (int64_t g = 0; g < groups; g++) a.load_query(b, h * groups + g, q + g * dim);
    // 1. biased scores, each key row read once for the G heads
    decode_scores(a, b, h, first, n, 0, n, q, s, converted);
    // 2. a = max(0, softmax + tau / n) per head
    const float inv_n = 1.0f / static_cast<float>(a.positions ? a.positions[b] + 1 : n);
    for (int64_t g = 0; g < groups; g++) lazy_elastic_softmax(s + g * n, n, a.tau[h * groups + g] * inv_n);
    // 3. o_g = sum_t a_gt v_t over the value rows some head weights
    std::memset(acc, 0, groups * dim_v * sizeof(float));
    decode_values(a, b, h, first, n, 0, n, s, w, scratch.rows(n), converted + a.convert_key_floats(n), acc);
    for (int64_t g = 0; g < groups; g++) a.store_out(b, h * groups + g, acc + g * dim_v);
}

// Split-K decode (fewer tasks than threads, long sequences): the keys of a task are cut into `splits` slices, each
// its own parallel item, in three steps (`SplitArgs`).
static void split_range(int64_t n, int64_t splits, int64_t k, int64_t &lo, int64_t &hi) {
    const int64_t per = ((n + splits - 1) / splits + 7) / 8 * 8;  // slices of whole 8-key groups
    lo = k * per < n ? k * per : n;
    hi = lo + per < n ? lo + per : n;
}

// Step 1 of item (task, slice k): biased scores of its keys, then per head the slice's max m and sum z of
// exp(s - m) (s becomes exp(s - m)). A slice without a finite score keeps m = -inf, z = 0 (NaN when it holds a
// NaN score) and sets its finite-less scores to 0 (their softmax weight once the row's normaliser is known).
static void decode_split_scores(const DecodeArgs &a, const SplitArgs &sp, int64_t item, DecodeScratch &scratch) {
    const int64_t groups = a.heads / a.kv_heads, dim = a.dim;
    const int64_t task = item / sp.splits, k = item % sp.splits;
    const int64_t b = task / a.kv_heads, h = task % a.kv_heads;
    const int64_t first = a.first_key(b), n = a.keys(b) - first;
    int64_t lo, hi;
    split_range(n, sp.splits, k, lo, hi);
    float *stats = sp.stats + (task * sp.splits + k) * groups * 2;
    if (hi <= lo) {
        for (int64_t g = 0; g < groups; g++) stats[2 * g] = -INFINITY, stats[2 * g + 1] = 0.0f;
        return;
    }
    a.check_blocks(b, first + hi);
    float *const q = scratch.floats(groups * dim + a.convert_key_floats(n));
    float *const converted = q + groups * dim;
    for (int64_t g = 0; g < groups; g++) a.load_query(b, h * groups + g, q + g * dim);
    float *const s = sp.scores + task * groups * sp.max_n;  // row g at s + g * n, as decode_scores writes it
    decode_scores(a, b, h, first, n, lo, hi, q, s, converted);
    for (int64_t g = 0; g < groups; g++) {
        float *x = s + g * n + lo;
        const float m = lazy_max(x, hi - lo);
        float z;
        if (m == -INFINITY) {
            bool nan = false;
            for (int64_t t = 0; t < hi - lo; t++) {
                nan |= x[t] != x[t];
                x[t] = x[t] != x[t] ? x[t] : 0.0f;
            }
            z = nan ? std::numeric_limits<float>::quiet_NaN() : 0.0f;
        } else {
            z = lazy_exp_sum(x, hi - lo, m);
        }
        stats[2 * g] = m, stats[2 * g + 1] = z;
    }
}

// Step 2 of item (task, slice k): the row's max M and normaliser L from all slices' (m, z), the slice's weights
// a = max(0, exp(s - M) / L + tau / n) (0 for every key when the row has no finite score, NaN when it holds a NaN),
// then the slice's share of o_g from the value rows some head weights.
static void decode_split_values(const DecodeArgs &a, const SplitArgs &sp, int64_t item, DecodeScratch &scratch) {
    const int64_t groups = a.heads / a.kv_heads, dim_v = a.dim_v;
    const int64_t task = item / sp.splits, k = item % sp.splits;
    const int64_t b = task / a.kv_heads, h = task % a.kv_heads;
    const int64_t first = a.first_key(b), n = a.keys(b) - first;
    float *acc = sp.partial + (task * sp.splits + k) * groups * dim_v;
    std::memset(acc, 0, groups * dim_v * sizeof(float));
    int64_t lo, hi;
    split_range(n, sp.splits, k, lo, hi);
    if (hi <= lo) return;
    const float *stats = sp.stats + task * sp.splits * groups * 2;
    float *const s = sp.scores + task * groups * sp.max_n;
    const float inv_n = 1.0f / static_cast<float>(a.positions ? a.positions[b] + 1 : n);
    for (int64_t g = 0; g < groups; g++) {
        float big = -INFINITY;
        for (int64_t j = 0; j < sp.splits; j++) big = stats[(j * groups + g) * 2] > big ? stats[(j * groups + g) * 2] : big;
        float total = 0.0f;
        for (int64_t j = 0; j < sp.splits; j++) {
            const float m = stats[(j * groups + g) * 2], z = stats[(j * groups + g) * 2 + 1];
            total += m == -INFINITY ? z : z * lazy_exp(m - big);  // z: 0 or NaN for a slice without a finite score
        }
        float *x = s + g * n;
        if (big == -INFINITY) {  // no normaliser: weights 0 (NaN when a score is NaN)
            const float fill = total != total ? std::numeric_limits<float>::quiet_NaN() : 0.0f;
            for (int64_t t = lo; t < hi; t++) x[t] = fill;
            continue;
        }
        const float m = stats[(k * groups + g) * 2];
        const float factor = (m == -INFINITY ? 0.0f : lazy_exp(m - big)) / total;
        const float shift = a.tau[h * groups + g] * inv_n;
        for (int64_t t = lo; t < hi; t++) {
            const float w = x[t] * factor + shift;
            x[t] = w < 0.0f ? 0.0f : w;  // NaN stays NaN
        }
    }
    float *const w = scratch.floats(2 * groups * (hi - lo) + a.convert_floats(hi - lo));
    float *const v_converted = w + groups * (hi - lo);
    // decode_values indexes w and v_converted from 0 and rows by slot; the slice's rows are its keys' value rows
    decode_values(a, b, h, first, n, lo, hi, s, w, scratch.rows(hi - lo), v_converted, acc);
}

// Step 3 of task: o_g = the sum of its slices' shares.
static void decode_split_sum(const DecodeArgs &a, const SplitArgs &sp, int64_t task) {
    const int64_t groups = a.heads / a.kv_heads, dim_v = a.dim_v;
    const int64_t b = task / a.kv_heads, h = task % a.kv_heads;
    float *acc = sp.partial + task * sp.splits * groups * dim_v;
    for (int64_t j = 1; j < sp.splits; j++)
        for (int64_t i = 0; i < groups * dim_v; i++) acc[i] += acc[j * groups * dim_v + i];
    if (a.keys(b) - a.first_key(b) <= 0) {
        for (int64_t g = 0; g < groups; g++) a.store_out(b, h * groups + g, nullptr);
        return;
    }
    for (int64_t g = 0; g < groups; g++) a.store_out(b, h * groups + g, acc + g * dim_v);
}

// Row r of (b, h) in a causal chunk of scaled scores: key index i = i0 + r sees keys 0 .. i; bias, softmax over
// them, shift tau[h] / n (n = q_pos + 1) and ReLU in one pass; keys past i get 0.
static void elastic_row(const RowsArgs &a, int64_t task) {
    const int64_t r = task % a.rows, h = (task / a.rows) % a.heads, b = task / (a.rows * a.heads);
    float *x = a.scores + task * a.keys;
    const int64_t last = a.i0 + r, seen = last + 1 < a.keys ? last + 1 : a.keys;
    const int64_t near = seen < a.window ? seen : a.window;
    const float *bh = a.bias + h * a.window;
    for (int64_t d = 0; d < near; d++) x[last - d] += bh[d];
    if (seen < a.keys) std::memset(x + seen, 0, (a.keys - seen) * sizeof(float));
    const float n = static_cast<float>(a.q_pos[b * a.q_pos_stride + a.row0 + r] + 1);
    lazy_elastic_softmax(x, seen, a.tau[h] / n);
}

}  // namespace LAZY_ISA
