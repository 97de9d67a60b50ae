// Fused paged attention of decode tokens on the CPU: `torch.ops.gracelm.paged_decode_attention`.
//
// One query token per sequence attends its sequence's cached context, read block by block straight from the
// paged KV cache (no gathered copy of the keys or values), with the scores and the weighted sum of values
// accumulated in float32. One task per (sequence, KV head) computes all the query heads that share that KV
// head (GQA): each key and value row is read once for all of them. Why a hand-written kernel, and what it
// is measured against: docs/performance.md, "Decode attention".
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include <immintrin.h>

namespace {

inline float to_float(float x) { return x; }

inline float to_float(c10::BFloat16 x) {
  // bfloat16 is the high half of a float32: a shift the compiler vectorises.
  uint32_t bits = static_cast<uint32_t>(x.x) << 16;
  float out;
  std::memcpy(&out, &bits, sizeof(out));
  return out;
}

// exp(x) for x <= 0 (softmax arguments), in a form the compiler vectorises (libm's expf is a call per value):
// x = n ln 2 + r with |r| <= ln 2 / 2, e^r by its degree-6 Taylor polynomial (relative error < 2e-7), 2^n by
// the float's exponent bits. Below -87 the result underflows to 0.
inline __attribute__((always_inline)) float exp_nonpositive(float x) {
  x = std::max(x, -87.f);
  const float n = std::nearbyint(x * 1.44269504088896341f);
  const float r = x - n * 0.693145751953125f - n * 1.428606765330187045e-06f;
  float p = 1.f / 720.f;
  p = p * r + 1.f / 120.f;
  p = p * r + 1.f / 24.f;
  p = p * r + 1.f / 6.f;
  p = p * r + 0.5f;
  p = p * r + 1.f;
  p = p * r + 1.f;
  const uint32_t bits = static_cast<uint32_t>(static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

// Sixteen floats, one AVX-512 register (two AVX2 ones): the lanes of a dot product's partial sums.
typedef float Lanes __attribute__((vector_size(64)));
constexpr int64_t kLanes = 16;

// The sum of the lanes as a tree (a sum left to the compiler is a serial chain of scalar additions, which
// was half of the kernel's time).
inline __attribute__((always_inline)) float lane_sum(Lanes v) {
  typedef float Half __attribute__((vector_size(32)));
  typedef float Quarter __attribute__((vector_size(16)));
  const Half h = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
                 __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
  const Quarter q = __builtin_shufflevector(h, h, 0, 1, 2, 3) + __builtin_shufflevector(h, h, 4, 5, 6, 7);
  return (q[0] + q[2]) + (q[1] + q[3]);
}

// a . b over `dim` floats (kDim when known at compile time), in float32.
template <int64_t kDim>
inline __attribute__((always_inline)) float dot(const float* __restrict__ a, const float* __restrict__ b,
                                                int64_t dim) {
  dim = kDim ? kDim : dim;
  const int64_t whole = dim - dim % kLanes;
  Lanes sum = {};
  for (int64_t d = 0; d < whole; d += kLanes) {
    Lanes x, y;
    std::memcpy(&x, a + d, sizeof(x));
    std::memcpy(&y, b + d, sizeof(y));
    sum += x * y;
  }
  float tail = 0.f;
  for (int64_t d = whole; d < dim; ++d) tail += a[d] * b[d];
  return lane_sum(sum) + tail;
}

// How many blocks ahead of their use their cache lines are asked for (1 was 6-9 % slower at 32 sequences,
// 4 no faster than 2).
constexpr int64_t kAhead = 2;

// Asks for the cache lines of block `id` (of `size` elements) ahead of their use: a sequence's blocks lie
// anywhere in the cache, where the hardware's prefetcher cannot guess the next one.
template <typename T>
inline __attribute__((always_inline)) void prefetch_block(const T* base, int64_t id, int64_t size) {
  const char* first = reinterpret_cast<const char*>(base + id * size);
  for (int64_t byte = 0; byte < size * static_cast<int64_t>(sizeof(T)); byte += 64)
    __builtin_prefetch(first + byte);
}

// The lane sums of four vectors at once, [sum(a), sum(b), sum(c), sum(d)]: a transposing tree that needs
// about half the shuffles and additions of four `lane_sum`s.
inline __attribute__((always_inline)) void lane_sums4(Lanes a, Lanes b, Lanes c, Lanes d, float* out) {
  typedef float Half __attribute__((vector_size(32)));
  typedef float Quarter __attribute__((vector_size(16)));
  const Lanes ab =
      __builtin_shufflevector(a, b, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
      __builtin_shufflevector(a, b, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
  const Lanes cd =
      __builtin_shufflevector(c, d, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
      __builtin_shufflevector(c, d, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
  // [a a a a | b b b b | c c c c | d d d d], each a quarter of its vector's sum
  const Lanes abcd =
      __builtin_shufflevector(ab, cd, 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) +
      __builtin_shufflevector(ab, cd, 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
  const Half pairs = __builtin_shufflevector(abcd, abcd, 0, 1, 4, 5, 8, 9, 12, 13) +
                     __builtin_shufflevector(abcd, abcd, 2, 3, 6, 7, 10, 11, 14, 15);
  const Quarter sums =
      __builtin_shufflevector(pairs, pairs, 0, 2, 4, 6) + __builtin_shufflevector(pairs, pairs, 1, 3, 5, 7);
  std::memcpy(out, &sums, sizeof(sums));
}

// out[t] = q . block[t] for t < rows (block: rows of `dim` floats), four rows at a time where the head size
// is a whole number of lanes known at compile time.
template <int64_t kDim>
inline __attribute__((always_inline)) void score_block(const float* __restrict__ q,
                                                       const float* __restrict__ block, int64_t rows,
                                                       int64_t dim, float* __restrict__ out) {
  int64_t t = 0;
  if constexpr (kDim > 0 && kDim % kLanes == 0) {
    for (; t + 4 <= rows; t += 4) {
      Lanes sum[4] = {}, x, y;
      for (int64_t c = 0; c < kDim; c += kLanes) {
        std::memcpy(&x, q + c, sizeof(x));
        for (int64_t i = 0; i < 4; ++i) {
          std::memcpy(&y, block + (t + i) * kDim + c, sizeof(y));
          sum[i] += x * y;
        }
      }
      lane_sums4(sum[0], sum[1], sum[2], sum[3], out + t);
    }
  }
  for (; t < rows; ++t) out[t] = dot<kDim>(q, block + t * dim, dim);
}

// A bfloat16 cache on a CPU that multiplies bfloat16 pairs (AVX512_BF16; head sizes 64 and 128): the keys
// and values are read straight from the cache, with no float32 copy of each block. vdpbf16ps adds two exact
// products of bfloat16 values to a float32 sum per lane, so the scores are the same float32 sums up to
// their order; the values are widened to float32 as they are loaded. These functions are compiled for that
// instruction set alone and called at the level `kAvx512Bf16`, which `isa_served()` grants such a CPU only.
#define GRACELM_BF16DOT __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx512bf16,fma")))

// out[t] = scale * (q . key[t]) for t < rows, q and the keys in bfloat16, four keys at a time.
template <int64_t kDim>
GRACELM_BF16DOT void score_block_bf16(const c10::BFloat16* q, const c10::BFloat16* key, int64_t rows,
                                      float scale, float* __restrict__ out) {
  constexpr int64_t kVectors = kDim / 32;
  __m512bh qv[kVectors];
  for (int64_t c = 0; c < kVectors; ++c) qv[c] = (__m512bh)_mm512_loadu_si512(q + 32 * c);
  int64_t t = 0;
  for (; t + 4 <= rows; t += 4) {
    __m512 sum[4];
    for (int64_t i = 0; i < 4; ++i) {
      sum[i] = _mm512_setzero_ps();
      for (int64_t c = 0; c < kVectors; ++c)
        sum[i] =
            _mm512_dpbf16_ps(sum[i], (__m512bh)_mm512_loadu_si512(key + (t + i) * kDim + 32 * c), qv[c]);
    }
    lane_sums4((Lanes)sum[0], (Lanes)sum[1], (Lanes)sum[2], (Lanes)sum[3], out + t);
    for (int64_t i = 0; i < 4; ++i) out[t + i] *= scale;
  }
  for (; t < rows; ++t) {
    __m512 sum = _mm512_setzero_ps();
    for (int64_t c = 0; c < kVectors; ++c)
      sum = _mm512_dpbf16_ps(sum, (__m512bh)_mm512_loadu_si512(key + t * kDim + 32 * c), qv[c]);
    out[t] = lane_sum((Lanes)sum) * scale;
  }
}

// Sixteen bfloat16 values as float32 (their upper halves).
GRACELM_BF16DOT inline __attribute__((always_inline)) Lanes widened(const c10::BFloat16* x) {
  const __m256i half = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x));
  return (Lanes)_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(half), 16));
}

// add_values over a block of bfloat16 values read straight from the cache: the same float32 sums in the
// same order. Its own loop, not add_values over a generic widening load: GCC 12 compiles that load to two
// half-width conversions and an insert (3-12 % slower), and this one's intrinsics cannot be inlined into a
// function compiled for the baseline.
template <int64_t kDim>
GRACELM_BF16DOT void add_values_bf16(const float* __restrict__ p, const c10::BFloat16* __restrict__ block,
                                     int64_t rows, float* __restrict__ acc) {
  constexpr int64_t kChunks = kDim / kLanes;
  Lanes even[kChunks], odd[kChunks];
  for (int64_t c = 0; c < kChunks; ++c) {
    std::memcpy(&even[c], acc + c * kLanes, sizeof(Lanes));
    odd[c] = Lanes{};
  }
  int64_t t = 0;
  for (; t + 1 < rows; t += 2) {
    for (int64_t c = 0; c < kChunks; ++c) {
      even[c] += p[t] * widened(block + t * kDim + c * kLanes);
      odd[c] += p[t + 1] * widened(block + (t + 1) * kDim + c * kLanes);
    }
  }
  for (int64_t c = 0; c < kChunks; ++c) {
    if (t < rows) even[c] += p[t] * widened(block + t * kDim + c * kLanes);
    even[c] += odd[c];
    std::memcpy(acc + c * kLanes, &even[c], sizeof(Lanes));
  }
}

// acc[0, dim) += sum over t < rows of p[t] * block[t][0, dim). With the head size known at compile time the
// sums stay in registers, two sets of them (even and odd rows): a single chain of dependent additions
// waits on each one's latency, which was most of the kernel's time.
template <int64_t kDim>
inline __attribute__((always_inline)) void add_values(const float* __restrict__ p,
                                                      const float* __restrict__ block, int64_t rows,
                                                      int64_t dim, float* __restrict__ acc) {
  if constexpr (kDim > 0 && kDim % kLanes == 0) {
    constexpr int64_t kChunks = kDim / kLanes;
    Lanes even[kChunks], odd[kChunks], v;
    for (int64_t c = 0; c < kChunks; ++c) {
      std::memcpy(&even[c], acc + c * kLanes, sizeof(Lanes));
      odd[c] = Lanes{};
    }
    int64_t t = 0;
    for (; t + 1 < rows; t += 2) {
      for (int64_t c = 0; c < kChunks; ++c) {
        std::memcpy(&v, block + t * kDim + c * kLanes, sizeof(v));
        even[c] += p[t] * v;
        std::memcpy(&v, block + (t + 1) * kDim + c * kLanes, sizeof(v));
        odd[c] += p[t + 1] * v;
      }
    }
    for (int64_t c = 0; c < kChunks; ++c) {
      if (t < rows) {
        std::memcpy(&v, block + t * kDim + c * kLanes, sizeof(v));
        even[c] += p[t] * v;
      }
      even[c] += odd[c];
      std::memcpy(acc + c * kLanes, &even[c], sizeof(Lanes));
    }
  } else {
    for (int64_t t = 0; t < rows; ++t)
      for (int64_t d = 0; d < dim; ++d) acc[d] += p[t] * block[t * dim + d];
  }
}

// The shape of one call, shared by its tasks.
struct Shape {
  int64_t heads, dim, per_kv, block_size, table_width, head_stride, values_offset;
};

// One task: the `per_kv` query heads of sequence `b` that read KV head `kvh`, over `len` tokens of context
// in the blocks of `table`. Two passes over the context, block by block: the scores, then (after the
// softmax) the probability-weighted sum of the values. Every sum is in float32.
template <int64_t kDim, typename T, bool kBf16Dot = false>
inline __attribute__((always_inline)) void attend_task_body(
    const Shape& s, const T* __restrict__ q_data, const T* __restrict__ cache,
    const int64_t* __restrict__ table, int64_t len, int64_t b, int64_t kvh, float scale,
    float* __restrict__ qf, float* __restrict__ acc, float* __restrict__ block, float* __restrict__ scores,
    float* __restrict__ out_data) {
  const int64_t dim = kDim ? kDim : s.dim, heads = s.per_kv, first = (b * s.heads + kvh * heads) * dim;
  if constexpr (!kBf16Dot)
    for (int64_t i = 0; i < heads * dim; ++i) qf[i] = to_float(q_data[first + i]) * scale;
  const T* keys = cache + kvh * s.head_stride;
  const T* values = cache + s.values_offset + kvh * s.head_stride;
  const int64_t size = s.block_size * dim, blocks = (len + s.block_size - 1) / s.block_size;
  // The blocks are read as one stream, the keys' then the values': each asks for the one kAhead further on.
  for (int64_t i = 0; i < kAhead && i < blocks; ++i) prefetch_block(keys, table[i], size);
  for (int64_t start = 0; start < len; start += s.block_size) {
    const T* key = keys + table[start / s.block_size] * size;
    const int64_t rows = std::min(s.block_size, len - start), ahead = start / s.block_size + kAhead;
    if (ahead < blocks)
      prefetch_block(keys, table[ahead], size);
    else if (ahead - blocks < blocks)
      prefetch_block(values, table[ahead - blocks], size);
    if constexpr (kBf16Dot) {
      for (int64_t h = 0; h < heads; ++h)
        score_block_bf16<kDim>(q_data + first + h * dim, key, rows, scale, scores + h * len + start);
    } else {
      for (int64_t i = 0; i < rows * dim; ++i) block[i] = to_float(key[i]);
      for (int64_t h = 0; h < heads; ++h)
        score_block<kDim>(qf + h * dim, block, rows, dim, scores + h * len + start);
    }
  }
  for (int64_t h = 0; h < heads; ++h) {  // softmax in place
    float* p = scores + h * len;
    const float top = *std::max_element(p, p + len);
    float sum = 0.f;
#pragma omp simd reduction(+ : sum)
    for (int64_t t = 0; t < len; ++t) sum += (p[t] = exp_nonpositive(p[t] - top));
    const float inverse = 1.f / sum;
    for (int64_t t = 0; t < len; ++t) p[t] *= inverse;
  }
  std::fill(acc, acc + heads * dim, 0.f);
  for (int64_t start = 0; start < len; start += s.block_size) {
    const T* value = values + table[start / s.block_size] * size;
    const int64_t rows = std::min(s.block_size, len - start), ahead = start / s.block_size + kAhead;
    if (ahead < blocks) prefetch_block(values, table[ahead], size);
    if constexpr (kBf16Dot) {
      for (int64_t h = 0; h < heads; ++h)
        add_values_bf16<kDim>(scores + h * len + start, value, rows, acc + h * dim);
    } else {
      for (int64_t i = 0; i < rows * dim; ++i) block[i] = to_float(value[i]);
      for (int64_t h = 0; h < heads; ++h)
        add_values<kDim>(scores + h * len + start, block, rows, dim, acc + h * dim);
    }
  }
  std::copy(acc, acc + heads * dim, out_data + first);
}

// The body with the common head sizes known to the compiler (fully unrolled loops), any other at run time.
template <typename T>
inline __attribute__((always_inline)) void dispatch_dim(const Shape& s, const T* q, const T* cache,
                                                        const int64_t* table, int64_t len, int64_t b,
                                                        int64_t kvh, float scale, float* qf, float* acc,
                                                        float* block, float* scores, float* out) {
  switch (s.dim) {
    case 64:
      return attend_task_body<64>(s, q, cache, table, len, b, kvh, scale, qf, acc, block, scores, out);
    case 128:
      return attend_task_body<128>(s, q, cache, table, len, b, kvh, scale, qf, acc, block, scores, out);
    default:
      return attend_task_body<0>(s, q, cache, table, len, b, kvh, scale, qf, acc, block, scores, out);
  }
}

// The task compiled for AVX-512, AVX2 and the baseline, one function each: the caller picks the level
// (`Isa`), so that a CPU's lesser paths can run, and be tested, on a CPU that has more.
enum Isa : int64_t { kBaseline = 0, kAvx2 = 1, kAvx512 = 2, kAvx512Bf16 = 3 };

#define GRACELM_TASK(NAME, TARGET)                                                                              \
  template <typename T>                                                                                         \
  TARGET void NAME(const Shape& s, const T* q, const T* cache, const int64_t* table, int64_t len, int64_t b,   \
                   int64_t kvh, float scale, float* qf, float* acc, float* block, float* scores, float* out) { \
    dispatch_dim(s, q, cache, table, len, b, kvh, scale, qf, acc, block, scores, out);                         \
  }
GRACELM_TASK(attend_task_avx512, __attribute__((target("arch=x86-64-v4"))))
GRACELM_TASK(attend_task_avx2, __attribute__((target("arch=x86-64-v3"))))
GRACELM_TASK(attend_task_baseline, )
#undef GRACELM_TASK

GRACELM_BF16DOT void attend_task_bf16(const Shape& s, const c10::BFloat16* q, const c10::BFloat16* cache,
                                      const int64_t* table, int64_t len, int64_t b, int64_t kvh, float scale,
                                      float* qf, float* acc, float* block, float* scores, float* out) {
  if (s.dim == 64)
    return attend_task_body<64, c10::BFloat16, true>(s, q, cache, table, len, b, kvh, scale, qf, acc, block,
                                                     scores, out);
  return attend_task_body<128, c10::BFloat16, true>(s, q, cache, table, len, b, kvh, scale, qf, acc, block,
                                                    scores, out);
}

// The most this CPU runs of `Isa`.
Isa isa_served() {
  __builtin_cpu_init();
  const bool avx512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
                      __builtin_cpu_supports("avx512cd");
  if (avx512 && __builtin_cpu_supports("avx512bf16")) return kAvx512Bf16;
  if (avx512) return kAvx512;
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("bmi2"))
    return kAvx2;
  return kBaseline;
}

template <typename T>
void attend(const at::Tensor& q, const at::Tensor& kv_cache, const at::Tensor& block_tables,
            const at::Tensor& seq_lens, double scale, Isa isa, at::Tensor& out) {
  const int64_t batch = q.size(0), heads = q.size(1), dim = q.size(2), kv_heads = kv_cache.size(1);
  const int64_t head_stride = kv_cache.size(2) * kv_cache.size(3) * dim;  // one KV head of K (or V)
  const Shape s{heads,
                dim,
                heads / kv_heads,
                kv_cache.size(3),
                block_tables.size(1),
                head_stride,
                kv_heads * head_stride};
  const T* q_data = q.data_ptr<T>();
  const T* cache = kv_cache.data_ptr<T>();
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  const int64_t* lens = seq_lens.data_ptr<int64_t>();
  float* out_data = out.data_ptr<float>();
  if (batch == 0) return;
  const int64_t longest = *std::max_element(lens, lens + batch);
  const bool bf16_dot = isa == kAvx512Bf16 && (dim == 64 || dim == 128);
  auto* task = isa >= kAvx512 ? attend_task_avx512<T> : isa == kAvx2 ? attend_task_avx2<T> : attend_task_baseline<T>;
  at::parallel_for(0, batch * kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(s.per_kv * dim), acc(s.per_kv * dim), block(s.block_size * dim),
        scores(s.per_kv * longest);
    for (int64_t t = begin; t < end; ++t) {
      const int64_t b = t / kv_heads;
      if constexpr (std::is_same_v<T, c10::BFloat16>) {
        if (bf16_dot) {
          attend_task_bf16(s, q_data, cache, tables + b * s.table_width, lens[b], b, t % kv_heads,
                           static_cast<float>(scale), qf.data(), acc.data(), block.data(), scores.data(),
                           out_data);
          continue;
        }
      }
      task(s, q_data, cache, tables + b * s.table_width, lens[b], b, t % kv_heads, static_cast<float>(scale),
           qf.data(), acc.data(), block.data(), scores.data(), out_data);
    }
  });
}

// Every block the lengths reach lies in the cache: the kernel reads raw memory.
void check_tables(const at::Tensor& block_tables, const at::Tensor& seq_lens, int64_t num_blocks,
                  int64_t block_size) {
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  const int64_t* lens = seq_lens.data_ptr<int64_t>();
  const int64_t width = block_tables.size(1);
  for (int64_t b = 0; b < seq_lens.size(0); ++b) {
    TORCH_CHECK(lens[b] >= 1 && lens[b] <= width * block_size, "paged_decode_attention: sequence ", b,
                " has length ", lens[b], ", outside 1..", width * block_size,
                " (its block table's capacity)");
    for (int64_t i = 0; i < (lens[b] + block_size - 1) / block_size; ++i) {
      const int64_t id = tables[b * width + i];
      TORCH_CHECK(id >= 0 && id < num_blocks, "paged_decode_attention: block ", id, " of sequence ", b,
                  " is outside the cache's ", num_blocks, " blocks");
    }
  }
}

// `isa`: the most of `Isa` the caller lets it use (a masked CPU feature lowers it); never more than the CPU runs.
at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& kv_cache,
                                  const at::Tensor& block_tables, const at::Tensor& seq_lens, double scale,
                                  int64_t isa) {
  TORCH_CHECK(q.dim() == 3 && kv_cache.dim() == 5 && kv_cache.size(0) == 2,
              "paged_decode_attention: q [B, heads, dim], kv_cache [2, kv_heads, blocks, block_size, dim]");
  TORCH_CHECK(q.scalar_type() == kv_cache.scalar_type(),
              "paged_decode_attention: q and kv_cache dtypes differ");
  TORCH_CHECK(q.size(1) % kv_cache.size(1) == 0 && q.size(2) == kv_cache.size(4),
              "paged_decode_attention: head counts or head_dim do not match");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && seq_lens.scalar_type() == at::kLong,
              "paged_decode_attention: block_tables and seq_lens must be int64");
  TORCH_CHECK(block_tables.dim() == 2 && seq_lens.dim() == 1 && block_tables.size(0) == q.size(0) &&
                  seq_lens.size(0) == q.size(0),
              "paged_decode_attention: one block table and one length per query");
  TORCH_CHECK(q.is_contiguous() && kv_cache.is_contiguous() && block_tables.is_contiguous() &&
                  seq_lens.is_contiguous(),
              "paged_decode_attention: contiguous tensors only");
  check_tables(block_tables, seq_lens, kv_cache.size(2), kv_cache.size(3));
  at::Tensor out = at::empty(q.sizes(), q.options().dtype(at::kFloat));
  static const Isa served = isa_served();
  const Isa level = static_cast<Isa>(std::clamp<int64_t>(isa, kBaseline, served));
  if (q.scalar_type() == at::kBFloat16) {
    attend<c10::BFloat16>(q, kv_cache, block_tables, seq_lens, scale, level, out);
  } else {
    TORCH_CHECK(q.scalar_type() == at::kFloat, "paged_decode_attention: bfloat16 or float32 only");
    attend<float>(q, kv_cache, block_tables, seq_lens, scale, level, out);
  }
  return out;
}

}  // namespace

TORCH_LIBRARY(gracelm, m) {
  m.def(
      "paged_decode_attention(Tensor q, Tensor kv_cache, Tensor block_tables, Tensor seq_lens, "
      "float scale, int isa) -> Tensor");
  m.def("paged_decode_attention_isa() -> int", []() -> int64_t { return isa_served(); });
}

TORCH_LIBRARY_IMPL(gracelm, CPU, m) { m.impl("paged_decode_attention", &paged_decode_attention); }
