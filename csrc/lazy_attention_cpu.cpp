// LazyLlama's native CPU ops, registered with PyTorch's dispatcher as `torch.ops.lazy_llama.cpu_*` (CPU key only:
// tensors of another device get the dispatcher's error). Built at install time by setup.py as the Python module
// `lazy_llama_cpu`; `modeling_lazy/lazy_attention_cpu.py` imports it and holds the fake (meta) implementations.
//
// cpu_decode          one decode row per sequence, Lazy Attention over a contiguous `[B, Hkv, T, D]` cache (each
//                     sequence's keys may start after left padding) or vLLM's paged cache through a block table;
//                     float32, bfloat16 or float16 (converted on load, accumulated in float32, written in the query
//                     dtype).
// cpu_elastic_rows_   Elastic-Softmax in place on one causal chunk of float32 scores (the prefill's row pass).
// cpu_cache_write_    K/V rows of new tokens into their paged-cache slots.
// cpu_vector_isa      the vector code the ops run on this CPU ("avx2+fma" or "scalar").
//
// The loops live in lazy_attention_cpu_kernels.h, compiled twice: generic and with AVX2 + FMA enabled for those
// functions only (no -march=native: the module runs on any x86-64 and picks the AVX2 variant where the CPU has it;
// LAZY_LLAMA_CPU_ISA=scalar forces the generic one). Threads come from at::parallel_for (torch.set_num_threads).

#include <Python.h>

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <algorithm>
#include <cstring>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define LAZY_HAVE_AVX2_VARIANT 1
#endif

namespace {

// Reads one row of `dim` elements as float32: the row itself for a float32 tensor, else converted into `dst`.
inline const float *load_row(const char *base, int64_t offset, at::ScalarType dtype, int64_t dim, float *dst) {
    switch (dtype) {
    case at::kFloat: return reinterpret_cast<const float *>(base) + offset;
    case at::kBFloat16: {
        const c10::BFloat16 *src = reinterpret_cast<const c10::BFloat16 *>(base) + offset;
        for (int64_t i = 0; i < dim; i++) dst[i] = static_cast<float>(src[i]);
        return dst;
    }
    default: {
        const c10::Half *src = reinterpret_cast<const c10::Half *>(base) + offset;
        for (int64_t i = 0; i < dim; i++) dst[i] = static_cast<float>(src[i]);
        return dst;
    }
    }
}

inline void store_row(char *base, int64_t offset, at::ScalarType dtype, int64_t dim, const float *src) {
    switch (dtype) {
    case at::kFloat:
        if (src) std::memcpy(reinterpret_cast<float *>(base) + offset, src, dim * sizeof(float));
        else std::memset(reinterpret_cast<float *>(base) + offset, 0, dim * sizeof(float));
        return;
    case at::kBFloat16: {
        c10::BFloat16 *dst = reinterpret_cast<c10::BFloat16 *>(base) + offset;
        for (int64_t i = 0; i < dim; i++) dst[i] = c10::BFloat16(src ? src[i] : 0.0f);
        return;
    }
    default: {
        c10::Half *dst = reinterpret_cast<c10::Half *>(base) + offset;
        for (int64_t i = 0; i < dim; i++) dst[i] = c10::Half(src ? src[i] : 0.0f);
    }
    }
}

// Everything one decode call reads, with element strides; rows are addressed as in `row_offset`.
struct DecodeArgs {
    at::ScalarType dtype;
    const char *q, *k, *v;
    char *out;
    int64_t q_sb, q_sh, o_sb, o_sh;
    int64_t k_s0, k_s1, k_s2, v_s0, v_s1, v_s2;  // (block or sequence, head, row) strides of the caches
    const int32_t *table;  // [B, table_stride] block ids, or null: dim 0 of the caches is the sequence
    int64_t table_stride, block_size, num_blocks;
    const int32_t *seq_lens;  // [B] key counts, or null: every sequence has seq_len keys
    int64_t seq_len;
    const int32_t *key_starts;  // [B] first key each sequence sees (left padding before it), or null: 0
    const int64_t *positions;  // [B] query positions, or null: position n - 1 (n: the keys it sees)
    const float *tau, *bias;
    int64_t window;
    float scale;
    int64_t heads, kv_heads, dim, dim_v;

    int64_t keys(int64_t b) const { return seq_lens ? static_cast<int64_t>(seq_lens[b]) : seq_len; }
    int64_t first_key(int64_t b) const { return key_starts ? static_cast<int64_t>(key_starts[b]) : 0; }

    // Row t of sequence b, head h: block table[b][t / block_size] (or b itself without a table), row t % block_size.
    int64_t row_offset(int64_t b, int64_t h, int64_t t, int64_t s0, int64_t s1, int64_t s2) const {
        if (!table) return b * s0 + h * s1 + t * s2;
        const int64_t block = table[b * table_stride + t / block_size];
        return block * s0 + h * s1 + (t % block_size) * s2;
    }

    // Every block sequence b reads lies in the cache (checked once per task, before any row is read).
    void check_blocks(int64_t b, int64_t n) const {
        if (!table) return;
        for (int64_t i = 0; i < (n + block_size - 1) / block_size; i++) {
            const int64_t block = table[b * table_stride + i];
            TORCH_CHECK(block >= 0 && block < num_blocks, "lazy_llama::cpu_decode: block_table[", b, ", ", i, "] = ",
                        block, " is outside the cache's ", num_blocks, " blocks");
        }
    }

    bool converts() const { return dtype != at::kFloat; }
    int64_t convert_key_floats(int64_t n) const { return converts() ? n * dim : 0; }
    int64_t convert_floats(int64_t n) const { return converts() ? n * (dim + dim_v) : 0; }
    const float *key_row(int64_t b, int64_t h, int64_t t, float *dst) const {
        return load_row(k, row_offset(b, h, t, k_s0, k_s1, k_s2), dtype, dim, dst);
    }
    const float *value_row(int64_t b, int64_t h, int64_t t, float *dst) const {
        return load_row(v, row_offset(b, h, t, v_s0, v_s1, v_s2), dtype, dim_v, dst);
    }
    void load_query(int64_t b, int64_t head, float *dst) const {
        const float *row = load_row(q, b * q_sb + head * q_sh, dtype, dim, dst);
        if (row != dst) std::memcpy(dst, row, dim * sizeof(float));
    }
    void store_out(int64_t b, int64_t head, const float *row) const {  // row null: zeros
        store_row(out, b * o_sb + head * o_sh, dtype, dim_v, row);
    }
};

// Per-thread buffers reused across the tasks of one parallel chunk (grown, never zero-filled: every task writes
// what it reads).
struct DecodeScratch {
    std::unique_ptr<float[]> buffer;
    std::unique_ptr<const float *[]> row_pointers;
    int64_t buffer_size = 0, rows_size = 0;
    float *floats(int64_t count) {
        if (buffer_size < count) buffer.reset(new float[buffer_size = count]);
        return buffer.get();
    }
    const float **rows(int64_t count) {
        if (rows_size < count) row_pointers.reset(new const float *[rows_size = count]);
        return row_pointers.get();
    }
};

// Split-K decode buffers: the scores of a whole task live here between the steps of lazy_attention_cpu_kernels.h.
struct SplitArgs {
    int64_t splits;
    float *scores;   // [tasks, G, max_n]: biased scores, then exp(s - m_slice) in place, then the weights
    float *stats;    // [tasks, splits, G, 2]: the slice's max m and sum z of exp(s - m)
    float *partial;  // [tasks, splits, G, Dv]: the slice's share of the output
    int64_t max_n;
};

struct RowsArgs {
    float *scores;  // [batch, heads, rows, keys] contiguous
    int64_t heads, rows, keys, i0, row0, window, q_pos_stride;
    const float *tau, *bias;
    const int64_t *q_pos;
};

}  // namespace

#define LAZY_ISA scalar
#include "lazy_attention_cpu_kernels.h"
#undef LAZY_ISA

#ifdef LAZY_HAVE_AVX2_VARIANT
#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx2,fma"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx2,fma")
#endif
#define LAZY_AVX2 1
#define LAZY_ISA avx2
#include "lazy_attention_cpu_kernels.h"
#undef LAZY_ISA
#undef LAZY_AVX2
#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif
#endif

namespace {

// True when the AVX2 variant runs here: the CPU has AVX2 and FMA and LAZY_LLAMA_CPU_ISA is not "scalar".
bool use_avx2() {
#ifdef LAZY_HAVE_AVX2_VARIANT
    static const bool cpu_has = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    const char *forced = std::getenv("LAZY_LLAMA_CPU_ISA");
    return cpu_has && !(forced && std::string(forced) == "scalar");
#else
    return false;
#endif
}

std::string cpu_vector_isa() { return use_avx2() ? "avx2+fma" : "scalar"; }

void check_cpu(const at::Tensor &t, const char *op, const char *name) {
    TORCH_CHECK(t.device().is_cpu(), "lazy_llama::", op, ": ", name, " is on ", t.device(),
                "; this op runs on CPU tensors only");
}

void check_float_table(const at::Tensor &t, const char *op, const char *name) {
    check_cpu(t, op, name);
    TORCH_CHECK(t.scalar_type() == at::kFloat && t.is_contiguous(), "lazy_llama::", op, ": ", name,
                " must be a contiguous float32 tensor; got ", t.scalar_type(), " with strides ", t.strides());
}

// Slices per task for split-K decoding: 1 (one task per item) unless there are too few tasks to keep every thread
// busy, then the fewest slices of at least SPLIT_MIN_KEYS keys that give each thread the same number of items
// (at least 4 per thread, so that uneven slices even out). 3 KV heads of one sequence on 2 threads: 4 slices each.
constexpr int64_t SPLIT_MIN_KEYS = 512;

int64_t decode_splits(int64_t tasks, int64_t longest, int64_t threads) {
    if (threads <= 1 || tasks <= 0 || tasks >= 4 * threads || longest < 2 * SPLIT_MIN_KEYS) return 1;
    const int64_t most = longest / SPLIT_MIN_KEYS;
    for (int64_t splits = 2; splits <= most; splits++)
        if (tasks * splits >= 4 * threads && (tasks * splits) % threads == 0) return splits;
    return most;
}

at::Tensor cpu_decode(const at::Tensor &query, const at::Tensor &key, const at::Tensor &value, const at::Tensor &tau,
                      const at::Tensor &distance_bias, double scale, int64_t seq_len,
                      const std::optional<at::Tensor> &seq_lens, const std::optional<at::Tensor> &block_table,
                      const std::optional<at::Tensor> &positions, const std::optional<at::Tensor> &key_starts,
                      int64_t num_splits) {
    const char *op = "cpu_decode";
    for (auto [t, name] : {std::pair{&query, "query"}, {&key, "key"}, {&value, "value"}}) {
        check_cpu(*t, op, name);
        TORCH_CHECK(t->stride(-1) == 1, "lazy_llama::cpu_decode: ", name, " needs a unit last stride; got strides ",
                    t->strides(), " (call .contiguous())");
    }
    const at::ScalarType dtype = query.scalar_type();
    TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf,
                "lazy_llama::cpu_decode: query must be float32, bfloat16 or float16; got ", dtype);
    TORCH_CHECK(key.scalar_type() == dtype && value.scalar_type() == dtype,
                "lazy_llama::cpu_decode: query, key and value must share one dtype; got ", dtype, ", ",
                key.scalar_type(), ", ", value.scalar_type());
    TORCH_CHECK(query.dim() == 3 && key.dim() == 4 && value.dim() == 4,
                "lazy_llama::cpu_decode: expects query [B, Hq, D] and key/value [B or blocks, Hkv, T or block_size, D]; "
                "got ", query.sizes(), ", ", key.sizes(), ", ", value.sizes());
    const int64_t batch = query.size(0), heads = query.size(1), dim = query.size(2);
    const int64_t kv_heads = key.size(1), dim_v = value.size(3);
    TORCH_CHECK(key.size(3) == dim && value.sizes().slice(0, 3) == key.sizes().slice(0, 3),
                "lazy_llama::cpu_decode: key ", key.sizes(), " and value ", value.sizes(),
                " must match each other and the query's head size ", dim);
    TORCH_CHECK(kv_heads > 0 && heads % kv_heads == 0, "lazy_llama::cpu_decode: ", heads,
                " query heads are not a multiple of ", kv_heads, " key/value heads");
    check_float_table(tau, op, "tau");
    check_float_table(distance_bias, op, "distance_bias");
    TORCH_CHECK(tau.dim() == 1 && tau.size(0) == heads && distance_bias.dim() == 2 && distance_bias.size(0) == heads,
                "lazy_llama::cpu_decode: tau must be [Hq] and distance_bias [Hq, W] with Hq = ", heads, "; got ",
                tau.sizes(), " and ", distance_bias.sizes());

    DecodeArgs a{};
    a.dtype = dtype;
    if (block_table.has_value()) {
        const at::Tensor &table = *block_table;
        check_cpu(table, op, "block_table");
        TORCH_CHECK(seq_lens.has_value(), "lazy_llama::cpu_decode: a block_table needs seq_lens");
        TORCH_CHECK(table.scalar_type() == at::kInt && table.dim() == 2 && table.size(0) == batch &&
                        table.stride(1) == 1,
                    "lazy_llama::cpu_decode: block_table must be int32 [B, max_blocks] with a unit last stride; got ",
                    table.scalar_type(), " ", table.sizes(), " strides ", table.strides());
        a.table = table.data_ptr<int32_t>();
        a.table_stride = table.stride(0);
        a.block_size = key.size(2);
        a.num_blocks = key.size(0);
        TORCH_CHECK(a.block_size > 0, "lazy_llama::cpu_decode: the cache has an empty block size");
    } else {
        TORCH_CHECK(key.size(0) == batch, "lazy_llama::cpu_decode: a contiguous cache needs key/value [B, Hkv, T, D] "
                    "with B = ", batch, "; got ", key.sizes());
    }
    const int64_t capacity = block_table.has_value() ? block_table->size(1) * a.block_size : key.size(2);
    if (seq_lens.has_value()) {
        const at::Tensor &lens = *seq_lens;
        check_cpu(lens, op, "seq_lens");
        TORCH_CHECK(lens.scalar_type() == at::kInt && lens.dim() == 1 && lens.size(0) == batch && lens.is_contiguous(),
                    "lazy_llama::cpu_decode: seq_lens must be contiguous int32 [B]; got ", lens.scalar_type(), " ",
                    lens.sizes());
        a.seq_lens = lens.data_ptr<int32_t>();
        for (int64_t b = 0; b < batch; b++)
            TORCH_CHECK(a.seq_lens[b] <= capacity, "lazy_llama::cpu_decode: seq_lens[", b, "] = ", a.seq_lens[b],
                        " exceeds the ", capacity, " key rows the cache holds for it");
    } else {
        TORCH_CHECK(seq_len >= 0 && seq_len <= capacity, "lazy_llama::cpu_decode: seq_len ", seq_len,
                    " is outside the cache's ", capacity, " rows");
    }
    if (key_starts.has_value()) {
        const at::Tensor &starts = *key_starts;
        check_cpu(starts, op, "key_starts");
        TORCH_CHECK(starts.scalar_type() == at::kInt && starts.dim() == 1 && starts.size(0) == batch &&
                        starts.is_contiguous(),
                    "lazy_llama::cpu_decode: key_starts must be contiguous int32 [B]; got ", starts.scalar_type(), " ",
                    starts.sizes());
        a.key_starts = starts.data_ptr<int32_t>();
        for (int64_t b = 0; b < batch; b++) {
            const int64_t n = a.seq_lens ? a.seq_lens[b] : seq_len;
            TORCH_CHECK(a.key_starts[b] >= 0 && a.key_starts[b] <= n, "lazy_llama::cpu_decode: key_starts[", b,
                        "] = ", a.key_starts[b], " is outside the sequence's ", n, " keys");
        }
    }
    if (positions.has_value()) {
        const at::Tensor &pos = *positions;
        check_cpu(pos, op, "positions");
        TORCH_CHECK(pos.scalar_type() == at::kLong && pos.dim() == 1 && pos.size(0) == batch && pos.is_contiguous(),
                    "lazy_llama::cpu_decode: positions must be contiguous int64 [B]; got ", pos.scalar_type(), " ",
                    pos.sizes());
        a.positions = pos.data_ptr<int64_t>();
    }

    at::Tensor out = at::empty({batch, heads, dim_v}, query.options());
    a.q = static_cast<const char *>(query.const_data_ptr());
    a.k = static_cast<const char *>(key.const_data_ptr());
    a.v = static_cast<const char *>(value.const_data_ptr());
    a.out = static_cast<char *>(out.data_ptr());
    a.q_sb = query.stride(0), a.q_sh = query.stride(1), a.o_sb = out.stride(0), a.o_sh = out.stride(1);
    a.k_s0 = key.stride(0), a.k_s1 = key.stride(1), a.k_s2 = key.stride(2);
    a.v_s0 = value.stride(0), a.v_s1 = value.stride(1), a.v_s2 = value.stride(2);
    a.seq_len = seq_len;
    a.tau = tau.data_ptr<float>(), a.bias = distance_bias.data_ptr<float>(), a.window = distance_bias.size(1);
    a.scale = static_cast<float>(scale);
    a.heads = heads, a.kv_heads = kv_heads, a.dim = dim, a.dim_v = dim_v;

    const int64_t tasks = batch * kv_heads;
    int64_t longest = 0;
    for (int64_t b = 0; b < batch; b++) longest = std::max(longest, a.keys(b) - a.first_key(b));
    TORCH_CHECK(num_splits >= 0, "lazy_llama::cpu_decode: num_splits must be >= 0 (0: automatic); got ", num_splits);
    const int64_t splits = num_splits > 0 ? std::min(num_splits, std::max<int64_t>(1, (longest + 7) / 8))
                                          : decode_splits(tasks, longest, at::get_num_threads());
    if (splits <= 1) {
        auto task = use_avx2() ?
#ifdef LAZY_HAVE_AVX2_VARIANT
            &avx2::decode_task :
#endif
            &scalar::decode_task;
        at::parallel_for(0, tasks, 1, [&](int64_t begin, int64_t end) {
            DecodeScratch scratch;
            for (int64_t i = begin; i < end; i++) task(a, i, scratch);
        });
        return out;
    }
    // split-K: every (task, slice) is a parallel item; the three steps are three parallel regions
    const int64_t groups = heads / kv_heads;
    at::Tensor scores = at::empty({tasks * groups * longest}, query.options().dtype(at::kFloat));
    at::Tensor stats = at::empty({tasks * splits * groups * 2}, scores.options());
    at::Tensor partial = at::empty({tasks * splits * groups * dim_v}, scores.options());
    SplitArgs sp{splits, scores.data_ptr<float>(), stats.data_ptr<float>(), partial.data_ptr<float>(), longest};
    const bool avx2 = use_avx2();
    auto step1 = avx2 ?
#ifdef LAZY_HAVE_AVX2_VARIANT
        &avx2::decode_split_scores :
#endif
        &scalar::decode_split_scores;
    auto step2 = avx2 ?
#ifdef LAZY_HAVE_AVX2_VARIANT
        &avx2::decode_split_values :
#endif
        &scalar::decode_split_values;
    for (auto step : {step1, step2})
        at::parallel_for(0, tasks * splits, 1, [&](int64_t begin, int64_t end) {
            DecodeScratch scratch;
            for (int64_t i = begin; i < end; i++) step(a, sp, i, scratch);
        });
    for (int64_t t = 0; t < tasks; t++) scalar::decode_split_sum(a, sp, t);
    return out;
}

void cpu_elastic_rows_(const at::Tensor &scores, int64_t i0, const at::Tensor &tau, const at::Tensor &distance_bias,
                       const at::Tensor &q_pos, int64_t row0) {
    const char *op = "cpu_elastic_rows_";
    check_float_table(scores, op, "scores");
    check_float_table(tau, op, "tau");
    check_float_table(distance_bias, op, "distance_bias");
    check_cpu(q_pos, op, "q_pos");
    TORCH_CHECK(scores.dim() == 4, "lazy_llama::cpu_elastic_rows_: scores must be [B, H, rows, keys]; got ",
                scores.sizes());
    const int64_t batch = scores.size(0), heads = scores.size(1), rows = scores.size(2), keys = scores.size(3);
    TORCH_CHECK(i0 >= 0 && row0 >= 0 && i0 + rows <= keys, "lazy_llama::cpu_elastic_rows_: rows ", i0, " .. ",
                i0 + rows - 1, " need keys 0 .. ", i0 + rows - 1, " but the chunk has ", keys);
    TORCH_CHECK(tau.dim() == 1 && tau.size(0) == heads && distance_bias.dim() == 2 && distance_bias.size(0) == heads,
                "lazy_llama::cpu_elastic_rows_: tau must be [H] and distance_bias [H, W] with H = ", heads, "; got ",
                tau.sizes(), " and ", distance_bias.sizes());
    TORCH_CHECK(q_pos.scalar_type() == at::kLong && q_pos.dim() == 2 && q_pos.size(0) == batch &&
                    q_pos.size(1) >= row0 + rows && (q_pos.stride(1) == 1 || q_pos.size(1) == 1),
                "lazy_llama::cpu_elastic_rows_: q_pos must be int64 [B, >= row0 + rows] with a unit last stride; got ",
                q_pos.scalar_type(), " ", q_pos.sizes(), " strides ", q_pos.strides());
    RowsArgs a{scores.data_ptr<float>(), heads, rows, keys, i0, row0, distance_bias.size(1), q_pos.stride(0),
               tau.data_ptr<float>(), distance_bias.data_ptr<float>(), q_pos.data_ptr<int64_t>()};
    auto row = use_avx2() ?
#ifdef LAZY_HAVE_AVX2_VARIANT
        &avx2::elastic_row :
#endif
        &scalar::elastic_row;
    at::parallel_for(0, batch * heads * rows, 1, [&](int64_t begin, int64_t end) {
        for (int64_t i = begin; i < end; i++) row(a, i);
    });
}

void cpu_cache_write_(const at::Tensor &key, const at::Tensor &value, const at::Tensor &slots,
                      const at::Tensor &key_cache, const at::Tensor &value_cache) {
    const char *op = "cpu_cache_write_";
    for (auto [t, name] : {std::pair{&key, "key"}, {&value, "value"}, {&key_cache, "key_cache"},
                           {&value_cache, "value_cache"}}) {
        check_cpu(*t, op, name);
        TORCH_CHECK(t->stride(-1) == 1, "lazy_llama::cpu_cache_write_: ", name,
                    " needs a unit last stride; got strides ", t->strides());
        TORCH_CHECK(t->scalar_type() == key_cache.scalar_type(), "lazy_llama::cpu_cache_write_: ", name, " is ",
                    t->scalar_type(), " but the cache is ", key_cache.scalar_type());
    }
    check_cpu(slots, op, "slots");
    TORCH_CHECK(key.dim() == 3 && value.dim() == 3 && key_cache.dim() == 4 && value_cache.dim() == 4,
                "lazy_llama::cpu_cache_write_: expects key/value [T, Hkv, D] and caches [blocks, Hkv, block_size, D]; "
                "got ", key.sizes(), ", ", value.sizes(), ", ", key_cache.sizes(), ", ", value_cache.sizes());
    const int64_t count = key.size(0), heads = key.size(1), dim = key.size(2), dim_v = value.size(2);
    const int64_t blocks = key_cache.size(0), block_size = key_cache.size(2);
    TORCH_CHECK(value.size(0) == count && value.size(1) == heads && key_cache.size(1) == heads &&
                    key_cache.size(3) == dim && value_cache.size(3) == dim_v &&
                    value_cache.sizes().slice(0, 3) == key_cache.sizes().slice(0, 3),
                "lazy_llama::cpu_cache_write_: shapes do not match: key ", key.sizes(), ", value ", value.sizes(),
                ", key_cache ", key_cache.sizes(), ", value_cache ", value_cache.sizes());
    TORCH_CHECK(slots.scalar_type() == at::kLong && slots.dim() == 1 && slots.size(0) == count && slots.is_contiguous(),
                "lazy_llama::cpu_cache_write_: slots must be contiguous int64 [T] with T = ", count, "; got ",
                slots.scalar_type(), " ", slots.sizes());
    const int64_t item = key.element_size();
    const char *k = static_cast<const char *>(key.const_data_ptr()), *v = static_cast<const char *>(value.const_data_ptr());
    char *kc = static_cast<char *>(key_cache.data_ptr()), *vc = static_cast<char *>(value_cache.data_ptr());
    const int64_t *slot = slots.const_data_ptr<int64_t>();
    for (int64_t i = 0; i < count; i++) {
        if (slot[i] < 0) continue;  // a padded token
        TORCH_CHECK(slot[i] < blocks * block_size, "lazy_llama::cpu_cache_write_: slot ", slot[i], " of token ", i,
                    " is outside the cache's ", blocks * block_size, " slots");
        const int64_t block = slot[i] / block_size, row = slot[i] % block_size;
        for (int64_t h = 0; h < heads; h++) {
            std::memcpy(kc + (block * key_cache.stride(0) + h * key_cache.stride(1) + row * key_cache.stride(2)) * item,
                        k + (i * key.stride(0) + h * key.stride(1)) * item, dim * item);
            std::memcpy(
                vc + (block * value_cache.stride(0) + h * value_cache.stride(1) + row * value_cache.stride(2)) * item,
                v + (i * value.stride(0) + h * value.stride(1)) * item, dim_v * item);
        }
    }
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(lazy_llama, m) {
    m.def("cpu_decode(Tensor query, Tensor key, Tensor value, Tensor tau, Tensor distance_bias, float scale, "
          "int seq_len, Tensor? seq_lens, Tensor? block_table, Tensor? positions, Tensor? key_starts=None, "
          "int num_splits=0) -> Tensor");
    m.def("cpu_elastic_rows_(Tensor(a!) scores, int i0, Tensor tau, Tensor distance_bias, Tensor q_pos, "
          "int row0) -> ()");
    m.def("cpu_cache_write_(Tensor key, Tensor value, Tensor slots, Tensor(a!) key_cache, "
          "Tensor(b!) value_cache) -> ()");
    m.def("cpu_vector_isa() -> str", &cpu_vector_isa);
}

TORCH_LIBRARY_IMPL(lazy_llama, CPU, m) {
    m.impl("cpu_decode", &cpu_decode);
    m.impl("cpu_elastic_rows_", &cpu_elastic_rows_);
    m.impl("cpu_cache_write_", &cpu_cache_write_);
}

// An empty Python module: importing it runs the registrations above.
PyMODINIT_FUNC PyInit_lazy_llama_cpu(void) {
    static PyModuleDef module = {PyModuleDef_HEAD_INIT, "lazy_llama_cpu",
                                 "LazyLlama's native CPU ops, registered as torch.ops.lazy_llama.cpu_*", -1, nullptr};
    return PyModule_Create(&module);
}
