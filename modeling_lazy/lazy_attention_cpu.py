"""Fused CPU kernels (C, compiled on first use) for Lazy Attention inference in float32.

PyTorch computes a decode row of Lazy Attention in five or more ops (scores, bias, softmax, `+ tau / n` and the
ReLU, the value product), each a dispatch and a full pass over the row; SDPA does softmax attention in one. The
decode kernel (`lazy_decode_f32`) does the whole row in one call, per (sequence, key/value head) task:

1. scores `s_gt = scale * q_g . k_t + b_h(n - 1 - t)` for the G query heads g of the group, reading each key
   row once (the bias only for distances below the window W);
2. per head, `a_gt = max(0, exp(s_gt - m_g) / Z_g + tau_g / n)`, `n` the query's position + 1 (the key count);
3. `o_g = sum_t a_gt v_t`, skipping every value row that no head of the group weights (with tau < 0 most of
   them): exactly the dense sum, reading a fraction of V.

Keys and values are addressed through an optional block table, so the same kernel reads the model's contiguous
cache (`[B, Hkv, T, D]`, any strides with unit last stride) and vLLM's paged cache in place. Two smaller functions
share the library: `lazy_elastic_rows_f32` turns a causal prefill chunk's scores into weights in one pass per row
(bias, causal limit, softmax, shift, ReLU), and `lazy_cache_write_f32` writes K/V rows into vLLM's pages. float32
only; the callers keep their PyTorch paths for other dtypes, for autograd and under torch.compile.

The source below is compiled with the system C compiler (`cc`, `-O3 -march=native`, OpenMP when available) into
a per-user cache (`$LAZY_LLAMA_KERNEL_DIR`, default `~/.cache/lazy_llama/kernels`) keyed by the source, the flags
and the CPU, and loaded with ctypes. No compiler, a failed build (one warning) or `LAZY_ATTENTION_CPU_KERNEL=0`
make the `*_kernel()` getters return None and leave the PyTorch paths in charge. `exp` is a branch-free polynomial
(relative error below 2e-7, in the float32 rounding noise) so that the compiler vectorizes it; with AVX2 and FMA
(`LAZY_AVX2`) the scores, softmax and value sums use intrinsics, scalar loops otherwise.
"""

import array
import ctypes
import hashlib
import os
import platform
import subprocess
import tempfile
import warnings
from pathlib import Path

import torch

_SOURCE = r"""
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* exp(x) for x <= 0 (x = -inf gives 0): 2^k * p(r), r = x - k ln2 in [-ln2/2, ln2/2], p of degree 6. */
static inline float lazy_exp(float x) {
    const float zero = x < -87.0f ? 0.0f : 1.0f;  /* exp(-87) ~ 1.6e-38: below it (and -inf), 0 */
    x = x < -87.0f ? -87.0f : x;
    float k = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;  /* round to nearest: 1.5 * 2^23 */
    float r = x - k * 0.693145751953125f;
    r = r - k * 1.428606765330187045e-06f;
    float p = 1.0f / 720.0f;
    p = p * r + 1.0f / 120.0f;
    p = p * r + 1.0f / 24.0f;
    p = p * r + 1.0f / 6.0f;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    union { float f; int32_t i; } scale;
    scale.i = ((int32_t)k + 127) << 23;
    return p * scale.f * zero;
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

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
/* out[0..7] = scale * q . k_j for the 8 key rows k_j (dim a multiple of 8): 8 accumulators, one transpose-add. */
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

/* acc[g][c0 .. c0 + 15] += sum_i w[i * groups + g] * rows[i][c0 .. c0 + 15], gb (<= 4) heads g: registers only */
static inline void lazy_axpy16(const int gb, const float *w, int64_t groups, const float *const *rows, int64_t m,
                               int64_t c0, float *acc, int64_t acc_stride) {
    __m256 a[4][2];
    for (int g = 0; g < gb; g++) {
        a[g][0] = _mm256_loadu_ps(acc + g * acc_stride + c0);
        a[g][1] = _mm256_loadu_ps(acc + g * acc_stride + c0 + 8);
    }
    for (int64_t i = 0; i < m; i++) {
        const __m256 v0 = _mm256_loadu_ps(rows[i] + c0), v1 = _mm256_loadu_ps(rows[i] + c0 + 8);
        for (int g = 0; g < gb; g++) {
            const __m256 x = _mm256_broadcast_ss(w + i * groups + g);
            a[g][0] = _mm256_fmadd_ps(x, v0, a[g][0]);
            a[g][1] = _mm256_fmadd_ps(x, v1, a[g][1]);
        }
    }
    for (int g = 0; g < gb; g++) {
        _mm256_storeu_ps(acc + g * acc_stride + c0, a[g][0]);
        _mm256_storeu_ps(acc + g * acc_stride + c0 + 8, a[g][1]);
    }
}

/* lazy_exp on 8 lanes */
static inline __m256 lazy_exp8(__m256 x) {
    const __m256 low = _mm256_set1_ps(-87.0f);
    const __m256 keep = _mm256_cmp_ps(x, low, _CMP_GE_OQ);  /* below exp(-87) (and -inf): 0 */
    x = _mm256_max_ps(x, low);
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
    return _mm256_and_ps(_mm256_mul_ps(p, _mm256_castsi256_ps(e)), keep);
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

/* The same over 32 columns for gb <= 3 heads (12 accumulators; the value row is read from memory by each FMA) */
static inline void lazy_axpy32(const int gb, const float *w, int64_t groups, const float *const *rows, int64_t m,
                               int64_t c0, float *acc, int64_t acc_stride) {
    __m256 a[3][4];
    for (int g = 0; g < gb; g++)
        for (int j = 0; j < 4; j++) a[g][j] = _mm256_loadu_ps(acc + g * acc_stride + c0 + 8 * j);
    for (int64_t i = 0; i < m; i++) {
        const float *r = rows[i] + c0;
        for (int g = 0; g < gb; g++) {
            const __m256 x = _mm256_broadcast_ss(w + i * groups + g);
            for (int j = 0; j < 4; j++) a[g][j] = _mm256_fmadd_ps(x, _mm256_loadu_ps(r + 8 * j), a[g][j]);
        }
    }
    for (int g = 0; g < gb; g++)
        for (int j = 0; j < 4; j++) _mm256_storeu_ps(acc + g * acc_stride + c0 + 8 * j, a[g][j]);
}
#define LAZY_AVX2 1
#endif

/* max_t x[t] */
static inline float lazy_max(const float *x, int64_t n) {
    float m = -INFINITY;
    int64_t t = 0;
#ifdef LAZY_AVX2
    __m256 lanes = _mm256_set1_ps(-INFINITY);
    for (; t + 8 <= n; t += 8) lanes = _mm256_max_ps(lanes, _mm256_loadu_ps(x + t));
    m = lazy_hmax8(lanes);
#endif
    for (; t < n; t++) m = x[t] > m ? x[t] : m;
    return m;
}

/* x[t] = exp(x[t] - m) in place; returns the sum */
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

/* Row t of sequence b, head h: block table[b][t / block_size] (or b itself without a table), row t % block_size. */
static inline int64_t lazy_row(const int32_t *table, int64_t table_stride, int64_t block_size, int64_t b,
                               int64_t t, int64_t s_block, int64_t s_head, int64_t s_token, int64_t h) {
    if (!table) return b * s_block + h * s_head + t * s_token;
    const int64_t blocks = (block_size & (block_size - 1)) == 0 ? t >> __builtin_ctzll(block_size) : t / block_size;
    const int64_t block = table[b * table_stride + blocks], row = t - blocks * block_size;
    return block * s_block + h * s_head + row * s_token;
}

int lazy_decode_f32(
    const float *q, int64_t q_sb, int64_t q_sh,
    const float *k, int64_t k_sblock, int64_t k_shead, int64_t k_stoken,
    const float *v, int64_t v_sblock, int64_t v_shead, int64_t v_stoken,
    const int32_t *table, int64_t table_stride, int64_t block_size, const int32_t *seq_lens, int64_t seq_len,
    const int64_t *positions, const float *tau, const float *bias, int64_t window, float scale,
    int64_t batch, int64_t heads, int64_t kv_heads, int64_t dim, int64_t dim_v,
    float *out, int64_t o_sb, int64_t o_sh, int threads)
{
    const int64_t groups = heads / kv_heads;
    int failed = 0;
#pragma omp parallel for schedule(dynamic) num_threads(threads) if (threads > 1 && batch * kv_heads > 1)
    for (int64_t task = 0; task < batch * kv_heads; task++) {
        const int64_t b = task / kv_heads, h = task % kv_heads;
        const int64_t n = seq_lens ? (int64_t)seq_lens[b] : seq_len;
        float *o0 = out + b * o_sb + h * groups * o_sh;
        if (n <= 0) {
            for (int64_t g = 0; g < groups; g++) memset(o0 + g * o_sh, 0, dim_v * sizeof(float));
            continue;
        }
        /* scores then weights [groups, n]; weights of the needed rows [m, groups]; output rows; row pointers */
        float *s = (float *)malloc((size_t)(2 * groups * n + groups * dim_v) * sizeof(float) + n * sizeof(float *));
        if (!s) { failed = 1; continue; }
        float *w = s + groups * n, *acc = w + groups * n;
        const float **rows = (const float **)(acc + groups * dim_v);
        const float *q0 = q + b * q_sb + h * groups * q_sh;
        int64_t t = 0;
#ifdef LAZY_AVX2
        if (dim % 8 == 0)
            for (; t + 8 <= n; t += 8) {
                const float *rows[8];
                for (int j = 0; j < 8; j++)
                    rows[j] = k + lazy_row(table, table_stride, block_size, b, t + j, k_sblock, k_shead, k_stoken, h);
                for (int64_t g = 0; g < groups; g++) lazy_dot8(q0 + g * q_sh, rows, dim, scale, s + g * n + t);
            }
#endif
        for (; t < n; t++) {
            const float *kt = k + lazy_row(table, table_stride, block_size, b, t, k_sblock, k_shead, k_stoken, h);
            for (int64_t g = 0; g < groups; g++) s[g * n + t] = lazy_dot(q0 + g * q_sh, kt, dim) * scale;
        }
        const int64_t near = n < window ? n : window;  /* keys at distance d = n - 1 - t < W carry the bias */
        for (int64_t g = 0; g < groups; g++) {
            float *sg = s + g * n;
            const float *bg = bias + (h * groups + g) * window;
            for (int64_t d = 0; d < near; d++) sg[n - 1 - d] += bg[d];
            const float m = lazy_max(sg, n);
            if (m == -INFINITY) {  /* no visible finite score: no normaliser, the weights are 0 */
                memset(sg, 0, n * sizeof(float));
                continue;
            }
            const float z = lazy_exp_sum(sg, n, m);
            const float inv_z = 1.0f / z, shift = tau[h * groups + g] / (float)(positions ? positions[b] + 1 : n);
            for (int64_t t = 0; t < n; t++) {
                float a = sg[t] * inv_z + shift;
                sg[t] = a > 0.0f ? a : 0.0f;
            }
        }
        /* the value rows some head of the group weights, with their weights as [m, groups] */
        int64_t m = 0;
        int64_t t0 = 0;
#ifdef LAZY_AVX2
        for (; t0 + 8 <= n; t0 += 8) {  /* 8 keys at a time: a bit per key that some head weights */
            __m256 any = _mm256_setzero_ps();
            for (int64_t g = 0; g < groups; g++)
                any = _mm256_or_ps(any, _mm256_cmp_ps(_mm256_loadu_ps(s + g * n + t0), _mm256_setzero_ps(),
                                                      _CMP_NEQ_OQ));
            for (unsigned bits = (unsigned)_mm256_movemask_ps(any); bits; bits &= bits - 1) {
                const int64_t t = t0 + __builtin_ctz(bits);
                for (int64_t g = 0; g < groups; g++) w[m * groups + g] = s[g * n + t];
                rows[m++] = v + lazy_row(table, table_stride, block_size, b, t, v_sblock, v_shead, v_stoken, h);
            }
        }
#endif
        for (int64_t t = t0; t < n; t++) {  /* written for every t, kept (m advanced) only when some weight is > 0 */
            int any = 0;
            for (int64_t g = 0; g < groups; g++) {
                const float a = s[g * n + t];
                w[m * groups + g] = a;
                any |= a != 0.0f;
            }
            rows[m] = v + lazy_row(table, table_stride, block_size, b, t, v_sblock, v_shead, v_stoken, h);
            m += any;
        }
#ifdef LAZY_AVX2
        if (dim_v % 16 == 0) {  /* tiles of 64 rows (in L1) x 16 columns x up to 4 heads in registers */
            memset(acc, 0, groups * dim_v * sizeof(float));
            for (int64_t i0 = 0; i0 < m; i0 += 64) {
                const int64_t rows_in = m - i0 < 64 ? m - i0 : 64;
                const float *wi = w + i0 * groups, *const *ri = rows + i0;
                if (dim_v % 32 == 0) {
                    for (int64_t g0 = 0; g0 < groups; g0 += 3)
                        for (int64_t c0 = 0; c0 < dim_v; c0 += 32)
                            switch (groups - g0 < 3 ? groups - g0 : 3) {  /* constant head counts: registers only */
                            case 1: lazy_axpy32(1, wi + g0, groups, ri, rows_in, c0, acc + g0 * dim_v, dim_v); break;
                            case 2: lazy_axpy32(2, wi + g0, groups, ri, rows_in, c0, acc + g0 * dim_v, dim_v); break;
                            default: lazy_axpy32(3, wi + g0, groups, ri, rows_in, c0, acc + g0 * dim_v, dim_v);
                            }
                    continue;
                }
                for (int64_t g0 = 0; g0 < groups; g0 += 4)
                    for (int64_t c0 = 0; c0 < dim_v; c0 += 16)
                        switch (groups - g0 < 4 ? groups - g0 : 4) {  /* constant head counts: registers only */
                        case 1: lazy_axpy16(1, wi + g0, groups, ri, rows_in, c0, acc + g0 * dim_v, dim_v); break;
                        case 2: lazy_axpy16(2, wi + g0, groups, ri, rows_in, c0, acc + g0 * dim_v, dim_v); break;
                        case 3: lazy_axpy16(3, wi + g0, groups, ri, rows_in, c0, acc + g0 * dim_v, dim_v); break;
                        default: lazy_axpy16(4, wi + g0, groups, ri, rows_in, c0, acc + g0 * dim_v, dim_v);
                        }
            }
        } else
#endif
        {
            memset(acc, 0, groups * dim_v * sizeof(float));
            for (int64_t i = 0; i < m; i++)
                for (int64_t g = 0; g < groups; g++) {
                    const float a = w[i * groups + g];
                    float *ag = acc + g * dim_v;
                    for (int64_t c = 0; c < dim_v; c++) ag[c] += a * rows[i][c];
                }
        }
        for (int64_t g = 0; g < groups; g++) memcpy(o0 + g * o_sh, acc + g * dim_v, dim_v * sizeof(float));
        free(s);
    }
    return failed;
}

/* Elastic-Softmax in place on one causal chunk of scaled scores `s [batch, heads, rows, keys]` (contiguous): row r
   of (b, h) has key index i = i0 + r and sees keys 0 .. i; add bias[h][i - j] where i - j < window, take the
   softmax over 0 .. i, then a = max(0, p + tau[h] / n) with n = q_pos[b * q_pos_stride + row0 + r] + 1; keys past i
   and rows without a finite score get 0. One pass per row where PyTorch makes four (bias, softmax, shift, ReLU). */
int lazy_elastic_rows_f32(float *s, int64_t batch, int64_t heads, int64_t rows, int64_t keys, int64_t i0,
                          const float *tau, const float *bias, int64_t window, const int64_t *q_pos,
                          int64_t q_pos_stride, int64_t row0, int threads)
{
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
    for (int64_t task = 0; task < batch * heads * rows; task++) {
        const int64_t r = task % rows, h = (task / rows) % heads, b = task / (rows * heads);
        float *x = s + task * keys;
        const int64_t last = i0 + r, seen = last + 1 < keys ? last + 1 : keys;
        const int64_t near = seen < window ? seen : window;
        const float *bh = bias + h * window;
        for (int64_t d = 0; d < near; d++) x[last - d] += bh[d];
        if (seen < keys) memset(x + seen, 0, (keys - seen) * sizeof(float));
        const float m = lazy_max(x, seen);
        if (m == -INFINITY) {  /* no visible finite score: no normaliser, the weights are 0 */
            memset(x, 0, seen * sizeof(float));
            continue;
        }
        const float inv_z = 1.0f / lazy_exp_sum(x, seen, m);
        const float shift = tau[h] / (float)(q_pos[b * q_pos_stride + row0 + r] + 1);
        for (int64_t t = 0; t < seen; t++) {
            const float a = x[t] * inv_z + shift;
            x[t] = a > 0.0f ? a : 0.0f;
        }
    }
    return 0;
}

/* Cache write of a paged cache: token i's key rows key[i, h] (value rows value[i, h]) go to slot slots[i] (skipped
   when negative), i.e. block slot / block_size, row slot % block_size, at the given element strides. */
void lazy_cache_write_f32(const int64_t *a) {
    const float *key = (const float *)a[0], *value = (const float *)a[3];
    const int64_t k_si = a[1], k_sh = a[2], v_si = a[4], v_sh = a[5];
    const int64_t *slots = (const int64_t *)a[6];
    float *k_cache = (float *)a[8], *v_cache = (float *)a[12];
    const int64_t count = a[7], kc_block = a[9], kc_head = a[10], kc_token = a[11];
    const int64_t vc_block = a[13], vc_head = a[14], vc_token = a[15];
    const int64_t block_size = a[16], heads = a[17], dim = a[18], dim_v = a[19];
    for (int64_t i = 0; i < count; i++) {
        const int64_t slot = slots[i];
        if (slot < 0) continue;  /* a padded token */
        const int64_t block = slot / block_size, row = slot % block_size;
        for (int64_t h = 0; h < heads; h++) {
            memcpy(k_cache + block * kc_block + h * kc_head + row * kc_token, key + i * k_si + h * k_sh,
                   dim * sizeof(float));
            memcpy(v_cache + block * vc_block + h * vc_head + row * vc_token, value + i * v_si + h * v_sh,
                   dim_v * sizeof(float));
        }
    }
}

/* The same with every argument but `scale` in one int64 array (one ctypes argument instead of 29: microseconds) */
int lazy_decode_f32_packed(const int64_t *a, float scale) {
    return lazy_decode_f32(
        (const float *)a[0], a[1], a[2], (const float *)a[3], a[4], a[5], a[6], (const float *)a[7], a[8], a[9], a[10],
        (const int32_t *)a[11], a[12], a[13], (const int32_t *)a[14], a[15], (const int64_t *)a[16],
        (const float *)a[17], (const float *)a[18], a[19], scale, a[20], a[21], a[22], a[23], a[24], (float *)a[25],
        a[26], a[27], (int)a[28]);
}
"""

_FLAGS = ["-O3", "-march=native", "-fPIC", "-shared", "-fno-math-errno"]
_LIBRARY: list = []  # [the ctypes library, or None] once built or refused


def _cpu_signature() -> str:
    try:
        flags = next((line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")), "")
    except OSError:
        flags = ""
    return f"{platform.machine()} {flags}"


def _build(directory: Path) -> Path:
    """Compile `_SOURCE` into `directory` (atomically: a temporary file renamed into place) and return the path."""
    openmp = ["-fopenmp"]
    key = hashlib.sha256("\n".join([_SOURCE, *_FLAGS, *openmp, _cpu_signature()]).encode()).hexdigest()[:16]
    target = directory / f"lazy_attention_cpu_{key}.so"
    if target.is_file():
        return target
    directory.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=directory) as scratch:
        source = Path(scratch) / "lazy_attention_cpu.c"
        source.write_text(_SOURCE)
        built = Path(scratch) / target.name
        compiler = os.environ.get("CC", "cc")
        command = [compiler, *_FLAGS, *openmp, str(source), "-o", str(built), "-lm"]
        done = subprocess.run(command, capture_output=True, text=True, timeout=120)
        if done.returncode != 0:  # a compiler without OpenMP: the kernel runs its tasks on one thread
            done = subprocess.run([c for c in command if c != "-fopenmp"], capture_output=True, text=True,
                                  timeout=120)
        if done.returncode != 0:
            raise RuntimeError(done.stderr.strip().splitlines()[-1] if done.stderr.strip() else "compiler failed")
        os.replace(built, target)
    return target


def _library():
    """The compiled library (ctypes), or None where it cannot be built or is switched off (then warned once)."""
    if os.environ.get("LAZY_ATTENTION_CPU_KERNEL", "1") == "0":
        return None
    if not _LIBRARY:
        library = None
        try:
            # torch is imported first, so the kernel's OpenMP runtime (libgomp.so.1) is the one torch already loaded
            directory = Path(os.environ.get("LAZY_LLAMA_KERNEL_DIR",
                                            Path.home() / ".cache" / "lazy_llama" / "kernels"))
            library = ctypes.CDLL(str(_build(directory)))
            library.lazy_decode_f32_packed.argtypes = [ctypes.c_void_p, ctypes.c_float]
            library.lazy_decode_f32_packed.restype = ctypes.c_int
            library.lazy_elastic_rows_f32.argtypes = [ctypes.c_void_p, *[ctypes.c_int64] * 5, ctypes.c_void_p,
                                                      ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p,
                                                      ctypes.c_int64, ctypes.c_int64, ctypes.c_int]
            library.lazy_elastic_rows_f32.restype = ctypes.c_int
            library.lazy_cache_write_f32.argtypes = [ctypes.c_void_p]
            library.lazy_cache_write_f32.restype = None
        except (OSError, RuntimeError, subprocess.SubprocessError) as error:
            warnings.warn(f"LazyLlama's CPU kernels could not be built ({error}); using the PyTorch path. "
                          "Install a C compiler (cc) or set LAZY_ATTENTION_CPU_KERNEL=0 to silence this.",
                          stacklevel=3)
            library = None
        _LIBRARY.append(library)
    return _LIBRARY[0]


def decode_kernel():
    """The compiled decode kernel (ctypes), or None where it cannot be built or is switched off."""
    library = _library()
    return None if library is None else library.lazy_decode_f32_packed


def elastic_rows_kernel():
    """The compiled in-place Elastic-Softmax of a causal score chunk (ctypes), or None (see `decode_kernel`)."""
    library = _library()
    return None if library is None else library.lazy_elastic_rows_f32


def cache_write_kernel():
    """The compiled paged-cache write (ctypes), or None (see `decode_kernel`)."""
    library = _library()
    return None if library is None else library.lazy_cache_write_f32


def lazy_cache_write(kernel, key, value, slots, key_cache, value_cache, key_strides, value_strides, block_size):
    """Write `key [T, Hkv, D]` and `value [T, Hkv, Dv]` (float32, unit last stride) to the slots `slots [T]` (int64,
    contiguous; -1 skips a token) of a paged cache: row `slot % block_size` of block `slot // block_size`, with
    element strides `(s_block, s_head, s_token)` from the data pointers of `key_cache` / `value_cache`."""
    args = array.array("q", (key.data_ptr(), *key.stride()[:2], value.data_ptr(), *value.stride()[:2],
                             slots.data_ptr(), slots.shape[0], key_cache.data_ptr(), *key_strides,
                             value_cache.data_ptr(), *value_strides, block_size, key.shape[1], key.shape[2],
                             value.shape[2]))
    kernel(args.buffer_info()[0])


def lazy_elastic_rows(kernel, scores, i0, tau, distance_bias, q_pos, row0):
    """`scores [B, H, rows, keys]` (contiguous float32, already scaled) become the chunk's Lazy Attention weights in
    place: row r is key index `i0 + r` and sees keys `0 .. i0 + r` (see `lazy_elastic_rows_f32` in the source);
    `q_pos [B, Tq]` int64 with unit last stride, the chunk's first row being query `row0`. Returns `scores`."""
    batch, heads, rows, keys = scores.shape
    kernel(scores.data_ptr(), batch, heads, rows, keys, i0, tau.data_ptr(), distance_bias.data_ptr(),
           distance_bias.shape[-1], q_pos.data_ptr(), q_pos.stride(0), row0, torch.get_num_threads())
    return scores


def lazy_decode_cpu(kernel, query, key, value, tau, distance_bias, scaling, out, kv_heads, *, seq_len=0,
                    seq_lens=None, block_table=None, block_size=0, key_strides=None, value_strides=None,
                    positions=None):
    """One decode row per sequence: `out [B, Hq, Dv] = LazyAttention(query [B, Hq, D], keys 0 .. n - 1)`.

    Without `block_table`, `key`/`value` are `[B, Hkv, T, D]` caches (unit last stride) and every sequence has
    `seq_len` keys. With it, `key`/`value` are base tensors whose row t of sequence b and head h starts at
    `table[b, t // block_size] * s_block + h * s_head + (t % block_size) * s_token` elements, the strides given as
    `key_strides`/`value_strides` `(s_block, s_head, s_token)`, and sequence b has `seq_lens[b]` keys (int32).
    All tensors float32 (tables int32) with unit last strides; `tau [Hq]` and `distance_bias [Hq, W]`
    contiguous. The query of a sequence with n keys sits at position n - 1 unless `positions [B]`
    (int64, contiguous) says otherwise (`n = position + 1` divides tau; the distances stay `n_keys - 1 - t`).
    """
    batch, heads, dim = query.shape
    if block_table is None:
        key_strides, value_strides = key.stride()[:3], value.stride()[:3]
    args = array.array("q", (
        query.data_ptr(), query.stride(0), query.stride(1),
        key.data_ptr(), *key_strides, value.data_ptr(), *value_strides,
        0 if block_table is None else block_table.data_ptr(), 0 if block_table is None else block_table.stride(0),
        block_size, 0 if seq_lens is None else seq_lens.data_ptr(), seq_len,
        0 if positions is None else positions.data_ptr(), tau.data_ptr(), distance_bias.data_ptr(),
        distance_bias.shape[-1], batch, heads, kv_heads, dim, out.shape[-1], out.data_ptr(), out.stride(0),
        out.stride(1), torch.get_num_threads()))
    failed = kernel(args.buffer_info()[0], scaling)
    if failed:
        raise MemoryError("LazyLlama's CPU decode kernel could not allocate its score rows")
    return out
