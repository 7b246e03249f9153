// A plain C ABI over FlashMLA's sm_90a decode kernels (deepseek-ai/FlashMLA csrc/), for the benchmark peer in
// perf/peers.py, which loads the library with ctypes and passes raw device pointers (torch's data_ptr()).
//
// What FlashMLA's torch interface (csrc/api/dense_decode.h, sparse_decode.h) does around its kernels is done here
// from plain arguments: the checks, the params structs, the scheduler-metadata kernel, the split kernel and the
// combine. The caller allocates every buffer (outputs, scheduler metadata, split accumulators), so the timed call
// costs what FlashMLA's own call costs. Layouts are the contiguous ones perf/peers.py passes:
//   q (b, s_q, h, d) bf16; out (b, s_q, h, 512) bf16; lse (b, s_q, h) fp32;
//   lse_acc ((b + parts) * s_q * h) fp32; o_acc ((b + parts) * s_q * h * 512) fp32;
//   meta (parts, 8) int32; splits (b + 1) int32;
//   dense: cache (num_blocks, 64, 1, 576) bf16 with the given strides (elements), table (b, *) int32, lengths (b);
//   sparse: cache (num_blocks, page, 1, token bytes) bytes with the given strides (bytes), indices (b, s_q, topk)
//   int32 physical slots (block * page + offset, -1 skips).
// Every function returns 0 on success, else non-zero with the reason in flashmla_last_error(); nothing here ends
// the process (FlashMLA's exit(1) checks are turned into exceptions by flashmla_host_checks.h).

#include <algorithm>
#include <climits>
#include <cmath>
#include <exception>
#include <stdexcept>
#include <string>

#include <cuda_runtime_api.h>

#include "params.h"
#include "sm90/decode/dense/splitkv_mla.h"
#include "sm90/decode/sparse_fp8/splitkv_mla.h"
#include "smxx/decode/combine/combine.h"
#include "smxx/decode/get_decoding_sched_meta/get_decoding_sched_meta.h"

namespace {

using bf16 = cutlass::bfloat16_t;

constexpr int kAbiVersion = 1;
constexpr int kHeadDimV = 512;          // FlashMLA decodes 512 value columns
constexpr int kDenseHeadDim = 576;      // its sm90 dense kernel: 512 latent + 64 RoPE
constexpr int kDensePage = 64;          // its sm90 dense kernel reads 64-token pages
constexpr int kSparseHeads = 128;       // the sparse instantiations built into this library
constexpr int kBlockN = 64;             // keys per scheduled block (dense page, sparse top-k block)
constexpr int kFixedOverheadBlocks = 5; // FlashMLA's per-request scheduling overhead, in blocks
constexpr int kMaxSmParts = 160;        // the combine kernel's largest split count
constexpr int kV32TokenBytes = 656;     // 512 fp8 + 4 fp32 scales + 64 bf16 RoPE
constexpr int kModel1TokenBytes = 584;  // 448 fp8 + 64 bf16 RoPE + 7 e8m0 scales + 1 pad
constexpr float kLog2e = 1.44269504f;

thread_local std::string g_last_error;

struct ArgumentError : std::invalid_argument {
    using std::invalid_argument::invalid_argument;
};

void require(bool ok, const std::string &why) {
    if (!ok) throw ArgumentError(why);
}

// Runs body; an exception becomes return code 1 and the message of flashmla_last_error().
template <typename Body>
int guarded(const char *fn, Body &&body) {
    try {
        body();
        g_last_error.clear();
        return 0;
    } catch (const std::exception &exc) {
        g_last_error = std::string(fn) + ": " + exc.what();
    } catch (...) {
        g_last_error = std::string(fn) + ": unknown exception";
    }
    return 1;
}

void require_sm90() {
    int dev = -1, major = 0, minor = 0;
    cudaError_t err = cudaGetDevice(&dev);
    if (err == cudaSuccess) err = cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev);
    if (err == cudaSuccess) err = cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev);
    if (err != cudaSuccess) {
        cudaGetLastError();  // leave no error behind for the caller's next CUDA call
        throw std::runtime_error(std::string("no usable CUDA device: ") + cudaGetErrorString(err));
    }
    require(major == 9 && minor == 0, "the library holds sm_90a kernels only; device " + std::to_string(dev) +
                                          " is sm_" + std::to_string(major) + std::to_string(minor));
}

void require_pointers(std::initializer_list<std::pair<const void *, const char *>> ptrs) {
    for (const auto &[ptr, name] : ptrs) require(ptr != nullptr, std::string(name) + " is null");
}

void require_sched(int parts) {
    require(parts >= 1 && parts <= kMaxSmParts,
            "num_sm_parts " + std::to_string(parts) + " outside [1, " + std::to_string(kMaxSmParts) + "]");
}

int as_int(long long v, const char *name) {
    require(v > 0 && v <= INT_MAX, std::string(name) + " " + std::to_string(v) + " must be in [1, INT_MAX]");
    return static_cast<int>(v);
}

int dense_parts(int s_q, int h, int h_k, int num_sms) {
    require(s_q > 0 && h > 0 && h_k > 0 && num_sms > 0 && h % h_k == 0,
            "s_q, h, h_k, num_sms must be positive with h_k dividing h");
    const int m_blocks = (s_q * (h / h_k) + kBlockN - 1) / kBlockN;
    return std::max(num_sms / h_k / m_blocks, 1);
}

int sparse_parts(int s_q, int h, int num_sms) {
    require(s_q > 0 && num_sms > 0, "s_q, num_sms must be positive");
    require(h == kSparseHeads, "h must be 128 (the sparse kernels built here)");
    return std::max(num_sms / s_q / (h / 64), 1);
}

void combine(int b, int s_q, int h, float *lse, void *out, float *lse_acc, float *o_acc, DecodingSchedMeta *meta,
             int *splits, int parts, cudaStream_t stream) {
    // out (b, s_q, h, 512), lse (b, s_q, h) and the accumulators (split, s_q, h[, 512]) are all contiguous.
    CombineParams p = {
        b, s_q, h, kHeadDimV,
        lse, out,
        s_q * h, h,
        s_q * h * kHeadDimV, h * kHeadDimV, kHeadDimV,
        lse_acc, o_acc,
        s_q * h, h,
        s_q * h * kHeadDimV, h * kHeadDimV, kHeadDimV,
        meta, splits, parts,
        nullptr,
        stream,
    };
    smxx::decode::run_flash_mla_combine_kernel<bf16>(p);
}

}  // namespace

extern "C" {

int flashmla_abi_version() { return kAbiVersion; }

const char *flashmla_last_error() { return g_last_error.c_str(); }

int flashmla_sched_meta_ints() { return static_cast<int>(sizeof(DecodingSchedMeta) / sizeof(int)); }

// Scheduler partitions (rows of the metadata) for a dense call: FlashMLA's dense_decode.h formula. 0 on bad input.
int flashmla_dense_num_sm_parts(int s_q, int h, int h_k, int num_sms) {
    int parts = 0;
    return guarded(__func__, [&] { parts = dense_parts(s_q, h, h_k, num_sms); }) ? 0 : parts;
}

// Scheduler partitions for a sparse call: FlashMLA's sm90 sparse_decode.h formula. 0 on bad input.
int flashmla_sparse_num_sm_parts(int s_q, int h, int num_sms) {
    int parts = 0;
    return guarded(__func__, [&] { parts = sparse_parts(s_q, h, num_sms); }) ? 0 : parts;
}

// FlashMLA's get_mla_metadata: fills meta (parts, 8) and splits (b + 1). topk == 0: dense, the work of request i
// is seqlens_k[i] keys; topk > 0: sparse, topk keys per request (seqlens_k unused).
int flashmla_get_metadata(int b, int s_q, int topk, const int *seqlens_k, int *meta, int *splits, int parts,
                          void *stream) {
    return guarded(__func__, [&] {
        require(b > 0 && s_q > 0 && topk >= 0, "b, s_q must be positive and topk >= 0");
        require_sched(parts);
        require(topk > 0 || seqlens_k != nullptr, "seqlens_k is null: dense scheduling needs the key lengths");
        require_pointers({{meta, "meta"}, {splits, "splits"}});
        require_sm90();
        GetDecodeSchedMetaParams p = {
            b, s_q, kBlockN, kFixedOverheadBlocks,
            topk > 0 ? topk : -1, topk > 0 ? 0 : -1,  // no extra cache; -1: dense
            nullptr, nullptr,
            topk > 0 ? nullptr : const_cast<int *>(seqlens_k),
            reinterpret_cast<DecodingSchedMeta *>(meta), splits, parts,
            static_cast<cudaStream_t>(stream),
        };
        smxx::decode::run_get_decoding_sched_meta_kernel(p);
    });
}

// FlashMLA's dense sm90 decode (flash_mla_with_kvcache without indices): split kernel + combine.
// k strides in elements: k_batch (per page), k_row (per token), k_head (per KV head); table_stride per request.
int flashmla_decode_bf16(const void *q, const void *k, void *out, float *lse, const int *seqlens_k,
                         const int *block_table, int b, int s_q, int h, int h_k, int d, int d_v, int num_blocks,
                         int page, int table_stride, long long k_batch_stride, long long k_row_stride,
                         long long k_head_stride, float scale, int causal, const int *meta, const int *splits,
                         int parts, float *lse_acc, float *o_acc, void *stream) {
    return guarded(__func__, [&] {
        require(b > 0 && s_q > 0 && h > 0 && num_blocks > 0, "b, s_q, h, num_blocks must be positive");
        require(h_k == 1, "h_k must be 1 (one latent KV head; q is read as (b, s_q, h, d))");
        require(d == kDenseHeadDim, "d must be 576 (FlashMLA's sm90 dense kernel)");
        require(d_v == kHeadDimV, "d_v must be 512");
        require(page == kDensePage, "page must be 64 (FlashMLA's sm90 dense kernel)");
        require(table_stride > 0, "table_stride must be positive");
        require(k_batch_stride > 0 && k_row_stride > 0 && k_head_stride > 0, "cache strides must be positive");
        require_sched(parts);
        require_pointers({{q, "q"}, {k, "k_cache"}, {out, "out"}, {lse, "lse"}, {seqlens_k, "seqlens_k"},
                          {block_table, "block_table"}, {meta, "meta"}, {splits, "splits"}, {lse_acc, "lse_acc"},
                          {o_acc, "o_acc"}});
        require_sm90();

        const int rows = s_q * h;  // q_seq_per_hk: with one KV head, the (s_q, h) rows of a request
        DenseAttnDecodeParams p{};
        p.b = b;
        p.s_q = s_q;
        p.q_seq_per_hk = rows;
        p.d = d;
        p.d_v = d_v;
        p.h_q = h;
        p.h_k = h_k;
        p.num_blocks = num_blocks;
        p.q_head_per_hk = h;
        p.is_causal = causal != 0 && s_q > 1;  // one query sees the whole sequence either way
        p.scale_softmax = scale;
        p.scale_softmax_log2 = static_cast<float>(scale * M_LOG2E);
        p.q_ptr = const_cast<void *>(q);
        p.k_ptr = const_cast<void *>(k);
        p.o_ptr = out;
        p.softmax_lse_ptr = lse;
        p.q_batch_stride = static_cast<int64_t>(rows) * d;
        p.q_row_stride = d;
        p.q_head_stride = d;
        p.k_batch_stride = k_batch_stride;
        p.k_row_stride = k_row_stride;
        p.k_head_stride = k_head_stride;
        p.o_batch_stride = static_cast<int64_t>(rows) * d_v;
        p.o_row_stride = d_v;
        p.o_head_stride = static_cast<int64_t>(rows) * d_v;
        p.block_table = const_cast<int *>(block_table);
        p.block_table_batch_stride = table_stride;
        p.page_block_size = page;
        p.seqlens_k_ptr = const_cast<int *>(seqlens_k);
        p.tile_scheduler_metadata_ptr = reinterpret_cast<DecodingSchedMeta *>(const_cast<int *>(meta));
        p.num_sm_parts = parts;
        p.num_splits_ptr = const_cast<int *>(splits);
        p.total_num_splits = b + parts;
        p.softmax_lseaccum_ptr = lse_acc;
        p.oaccum_ptr = o_acc;
        p.stream = static_cast<cudaStream_t>(stream);
        sm90::run_flash_splitkv_mla_kernel<bf16>(p);
        combine(b, s_q, h, lse, out, lse_acc, o_acc, p.tile_scheduler_metadata_ptr, p.num_splits_ptr, parts,
                p.stream);
    });
}

// FlashMLA's sparse FP8 sm90 decode (flash_mla_with_kvcache with indices, is_fp8_kvcache): split kernel + combine.
// d 576: the V3.2 cache (656-byte tokens); d 512: the MODEL1 / V4 cache (584-byte tokens). kv strides in bytes.
int flashmla_decode_sparse_fp8(const void *q, const void *kv, const int *indices, void *out, float *lse, int b,
                               int s_q, int h, int d, int d_v, int num_blocks, int page, int topk,
                               long long kv_block_stride, long long kv_row_stride, float scale, const int *meta,
                               const int *splits, int parts, float *lse_acc, float *o_acc, void *stream) {
    return guarded(__func__, [&] {
        require(b > 0 && s_q > 0 && num_blocks > 0 && page > 0, "b, s_q, num_blocks, page must be positive");
        require(h == kSparseHeads, "h must be 128 (the sparse kernels built here)");
        require(d == 576 || d == 512, "d must be 576 (V3.2 cache) or 512 (MODEL1 / V4 cache)");
        require(d_v == kHeadDimV, "d_v must be 512");
        require(topk > 0 && topk % kBlockN == 0, "topk " + std::to_string(topk) + " must be a multiple of 64");
        const int token_bytes = d == 576 ? kV32TokenBytes : kModel1TokenBytes;
        require(kv_row_stride == token_bytes, "kv row stride must be " + std::to_string(token_bytes) +
                                                  " bytes (each page contiguous)");
        require(kv_block_stride >= static_cast<long long>(page) * token_bytes,
                "kv block stride must hold a page of tokens");
        const int block_stride = as_int(kv_block_stride, "kv block stride");
        require_sched(parts);
        require_pointers({{q, "q"}, {kv, "kv_cache"}, {indices, "indices"}, {out, "out"}, {lse, "lse"},
                          {meta, "meta"}, {splits, "splits"}, {lse_acc, "lse_acc"}, {o_acc, "o_acc"}});
        require_sm90();

        SparseAttnDecodeParams p{};
        p.b = b;
        p.s_q = s_q;
        p.h_q = h;
        p.h_kv = 1;
        p.d_qk = d;
        p.d_v = d_v;
        p.sm_scale = scale;
        p.sm_scale_div_log2 = scale * kLog2e;
        p.num_blocks = num_blocks;
        p.page_block_size = page;
        p.topk = topk;
        p.model_type = d == 576 ? ModelType::V32 : ModelType::MODEL1;
        p.q = reinterpret_cast<bf16 *>(const_cast<void *>(q));
        p.kv = reinterpret_cast<bf16 *>(const_cast<void *>(kv));
        p.indices = const_cast<int *>(indices);
        p.lse = lse;
        p.out = reinterpret_cast<bf16 *>(out);
        p.stride_q_b = as_int(static_cast<long long>(s_q) * h * d, "q batch stride");
        p.stride_q_s_q = h * d;
        p.stride_q_h_q = d;
        p.stride_kv_block = block_stride;
        p.stride_kv_row = token_bytes;
        p.stride_indices_b = as_int(static_cast<long long>(s_q) * topk, "indices batch stride");
        p.stride_indices_s_q = topk;
        p.stride_lse_b = s_q * h;
        p.stride_lse_s_q = h;
        p.stride_o_b = as_int(static_cast<long long>(s_q) * h * d_v, "out batch stride");
        p.stride_o_s_q = h * d_v;
        p.stride_o_h_q = d_v;
        p.stream = static_cast<cudaStream_t>(stream);
        p.lse_accum = lse_acc;
        p.o_accum = o_acc;
        p.stride_lse_accum_split = s_q * h;
        p.stride_lse_accum_s_q = h;
        p.stride_o_accum_split = p.stride_o_b;
        p.stride_o_accum_s_q = h * d_v;
        p.stride_o_accum_h_q = d_v;
        p.tile_scheduler_metadata_ptr = reinterpret_cast<DecodingSchedMeta *>(const_cast<int *>(meta));
        p.num_splits_ptr = const_cast<int *>(splits);
        p.num_sm_parts = parts;
        if (p.model_type == ModelType::V32) {
            sm90::decode::sparse_fp8::run_flash_splitkv_mla_fp8_sparse_kernel<ModelType::V32, kSparseHeads>(p);
        } else {
            sm90::decode::sparse_fp8::run_flash_splitkv_mla_fp8_sparse_kernel<ModelType::MODEL1, kSparseHeads>(p);
        }
        combine(b, s_q, h, lse, out, lse_acc, o_acc, p.tile_scheduler_metadata_ptr, p.num_splits_ptr, parts,
                p.stream);
    });
}

}  // extern "C"
