// x @ W.T for a weight W stored in blocks of 32 inputs with a scale and a minimum each (GGUF's Q4_0, Q4_1
// and Q8_0 read straight in), multiplied on AVX-512 VNNI in 8-bit integers: the activations are rounded
// to 8 bits per block of 32 on the fly (as llama.cpp does), each block's products summed exactly in int32
// and scaled in float32. Why, the layout and the arithmetic: gracelm/model/block_linear.py. On a CPU with
// AMX, calls of 16 rows or more of bfloat16 activations by 4-bit weights go to block_matmul_amx.cpp.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <immintrin.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>

#include "block_records.h"

namespace {

using namespace gracelm::blocks;

// From this many rows on, two tiles are computed together, 6 rows at a time; below, one tile, 8 rows at a
// time (all their sums stay in registers). Two tiles share each broadcast of 4 activations: faster at 24 rows
// and more, slower at 16 (bench/RESULTS.md, "Weight kernels").
constexpr int64_t kWideRows = 24;

#define GRACELM_VNNI __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx512vnni,f16c,fma")))

GRACELM_VNNI inline __m512 load16(const float* x) { return _mm512_loadu_ps(x); }

GRACELM_VNNI inline __m512 load16(const c10::BFloat16* x) {  // bfloat16 is float32's upper half
  const __m256i half = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(half), 16));
}

// The activations of `rows` rows, rounded to 8 bits per block: q = round(x / d) with d = max|x| / 127
// (to nearest even, as the CPU rounds by default), and per block d and d * sum(q), the factor of the
// weights' minimums.
template <typename T>
GRACELM_VNNI void quantize_rows(const T* x, int64_t rows, int64_t k, int8_t* q, float* d, float* dsum) {
  const int64_t blocks = k / kBlock;
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t g = 0; g < blocks; ++g) {
      const int64_t at = r * k + g * kBlock;
      const __m512 low = load16(x + at), high = load16(x + at + 16);
      const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(low), _mm512_abs_ps(high)));
      const __m512 inverse = _mm512_set1_ps(amax > 0.f ? 127.f / amax : 0.f);
      const __m512i qlow = _mm512_cvtps_epi32(_mm512_mul_ps(low, inverse));
      const __m512i qhigh = _mm512_cvtps_epi32(_mm512_mul_ps(high, inverse));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(q + at), _mm512_cvtepi32_epi8(qlow));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(q + at + 16), _mm512_cvtepi32_epi8(qhigh));
      d[r * blocks + g] = amax / 127.f;
      dsum[r * blocks + g] = amax / 127.f * static_cast<float>(_mm512_reduce_add_epi32(_mm512_add_epi32(qlow, qhigh)));
    }
  }
}

// 4 activation bytes read as one integer (aliasing them is allowed).
typedef int32_t Int32 __attribute__((may_alias, aligned(1)));

struct Activations {
  const int8_t* q;   // [rows, k]
  const float* d;    // [rows, blocks]
  const float* dsum; // [rows, blocks]
  int64_t k, blocks;
};

// Rows r0..r0+Rows-1 of Tiles adjacent tiles of 16 outputs, over all blocks of the tiles' records, to out's
// rows 0..Rows-1 (`ld` apart). A record's weights are 8 vectors of unsigned bytes: vector j holds, for each
// of the 16 outputs, its inputs 4j..4j+3 (the layout vpdpbusd multiplies); 4-bit records hold vectors 2h
// and 2h+1 as the low and high nibbles of the same 64 bytes. Each row's 4 inputs are broadcast once for all
// the tiles, and each tile's vectors unpacked once for all the rows.
template <int Bits, int Rows, int Tiles, typename T>
GRACELM_VNNI void tile_rows(const uint8_t* tile, int64_t tile_bytes, const Activations& a, int64_t r0, T* out,
                            int64_t ld) {
  __m512 sums[Rows][Tiles];
  for (int r = 0; r < Rows; ++r)
    for (int t = 0; t < Tiles; ++t) sums[r][t] = _mm512_setzero_ps();
  for (int64_t g = 0; g < a.blocks; ++g) {
    const uint8_t* records[Tiles];
    for (int t = 0; t < Tiles; ++t) {
      records[t] = tile + t * tile_bytes + g * record_bytes(Bits);
      // The records a few blocks on: a tile's first rows read them from memory.
      for (int64_t line = 0; line < record_bytes(Bits); line += 64)
        _mm_prefetch(reinterpret_cast<const char*>(records[t] + kAhead * record_bytes(Bits) + line),
                     _MM_HINT_T0);
    }
    // Rows x Tiles independent chains of vpdpbusd keep its pipes busy.
    __m512i dots[Rows][Tiles];
    for (int r = 0; r < Rows; ++r)
      for (int t = 0; t < Tiles; ++t) dots[r][t] = _mm512_setzero_si512();
    const int8_t* q = a.q + r0 * a.k + g * kBlock;
    for (int h = 0; h < 4; ++h) {
      __m512i even[Tiles], odd[Tiles];  // vectors 2h and 2h+1
      for (int t = 0; t < Tiles; ++t) {
        if constexpr (Bits == 4) {
          const __m512i packed = _mm512_loadu_si512(records[t] + 64 * h);
          even[t] = _mm512_and_si512(packed, _mm512_set1_epi8(0x0F));
          odd[t] = _mm512_and_si512(_mm512_srli_epi16(packed, 4), _mm512_set1_epi8(0x0F));
        } else {
          even[t] = _mm512_loadu_si512(records[t] + 128 * h);
          odd[t] = _mm512_loadu_si512(records[t] + 128 * h + 64);
        }
      }
      // All rows of vector 2h, then of 2h+1: a row's two products are not adjacent (its chain's latency).
      for (int r = 0; r < Rows; ++r) {
        const __m512i inputs = _mm512_set1_epi32(reinterpret_cast<const Int32*>(q + r * a.k)[2 * h]);
        for (int t = 0; t < Tiles; ++t) dots[r][t] = _mm512_dpbusd_epi32(dots[r][t], even[t], inputs);
      }
      for (int r = 0; r < Rows; ++r) {
        const __m512i inputs = _mm512_set1_epi32(reinterpret_cast<const Int32*>(q + r * a.k)[2 * h + 1]);
        for (int t = 0; t < Tiles; ++t) dots[r][t] = _mm512_dpbusd_epi32(dots[r][t], odd[t], inputs);
      }
    }
    for (int t = 0; t < Tiles; ++t) {
      const uint8_t* tail = records[t] + weight_bytes(Bits);
      const __m512 scale = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(tail)));
      const __m512 minimum = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(tail + 32)));
      for (int r = 0; r < Rows; ++r) {
        const int64_t at = (r0 + r) * a.blocks + g;
        sums[r][t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dots[r][t]),
                                     _mm512_mul_ps(scale, _mm512_set1_ps(a.d[at])), sums[r][t]);
        sums[r][t] = _mm512_fmadd_ps(minimum, _mm512_set1_ps(a.dsum[at]), sums[r][t]);
      }
    }
  }
  for (int r = 0; r < Rows; ++r)
    for (int t = 0; t < Tiles; ++t) store_row(sums[r][t], out + r * ld + t * kLanes);
}

template <int Bits, int Tiles, typename T, int Rows>
GRACELM_VNNI void tile_rows_of(int rows, const uint8_t* tile, int64_t tile_bytes, const Activations& a,
                               int64_t r0, T* out, int64_t ld) {
  if constexpr (Rows > 1) {
    if (rows < Rows) return tile_rows_of<Bits, Tiles, T, Rows - 1>(rows, tile, tile_bytes, a, r0, out, ld);
  }
  tile_rows<Bits, Rows, Tiles>(tile, tile_bytes, a, r0, out, ld);
}

// Tiles begin..end, Tiles at a time while that many whole tiles remain (then one at a time), every row in
// chunks of at most Rows; the tiles' records stay in the L1 cache between chunks.
template <int Bits, int Tiles, int Rows, typename T>
GRACELM_VNNI void tiles(const uint8_t* packed, int64_t begin, int64_t end, const Activations& a, int64_t rows,
                        T* out, int64_t n) {
  const int64_t tile_bytes = a.blocks * record_bytes(Bits);
  const int64_t whole = std::min(end, n / kLanes);  // the tiles below it hold 16 outputs each
  alignas(64) T last[Rows * kLanes];  // the last tile of a width that is not a multiple of 16
  for (int64_t t = begin; t < end;) {
    const bool together = t + Tiles <= whole;
    const uint8_t* first = packed + t * tile_bytes;
    for (int64_t r0 = 0; r0 < rows; r0 += Rows) {
      const int chunk = static_cast<int>(std::min<int64_t>(Rows, rows - r0));
      T* to = out + r0 * n + t * kLanes;
      if (together) {
        tile_rows_of<Bits, Tiles, T, Rows>(chunk, first, tile_bytes, a, r0, to, n);
      } else if (t < whole) {
        tile_rows_of<Bits, 1, T, Rows>(chunk, first, tile_bytes, a, r0, to, n);
      } else {
        tile_rows_of<Bits, 1, T, Rows>(chunk, first, tile_bytes, a, r0, last, kLanes);
        for (int r = 0; r < chunk; ++r)
          std::copy(last + r * kLanes, last + r * kLanes + (n - t * kLanes), to + r * n);
      }
    }
    t += together ? Tiles : 1;
  }
}

template <int Bits, typename T>
void tiles_for_rows(const uint8_t* packed, int64_t begin, int64_t end, const Activations& a, int64_t rows,
                    T* out, int64_t n) {
  if (rows >= kWideRows) {
    tiles<Bits, 2, 6>(packed, begin, end, a, rows, out, n);
  } else {
    tiles<Bits, 1, 8>(packed, begin, end, a, rows, out, n);
  }
}

template <typename T>
void multiply(const at::Tensor& x, const at::Tensor& packed, int64_t n, int64_t bits, at::Tensor& out) {
  const int64_t rows = x.size(0), k = x.size(1), blocks = k / kBlock;
  at::Tensor q = at::empty({rows, k}, x.options().dtype(at::kChar));
  at::Tensor d = at::empty({2, rows, blocks}, x.options().dtype(at::kFloat));
  quantize_rows(x.data_ptr<T>(), rows, k, q.data_ptr<int8_t>(), d[0].data_ptr<float>(), d[1].data_ptr<float>());
  const Activations a{q.data_ptr<int8_t>(), d[0].data_ptr<float>(), d[1].data_ptr<float>(), k, blocks};
  const uint8_t* weights = packed.data_ptr<uint8_t>();
  T* o = out.data_ptr<T>();
  // A grain of a few tiles: a small matrix is not cut finer than the threads' start-up is worth.
  at::parallel_for(0, packed.size(0), 4, [&](int64_t begin, int64_t end) {
    if (bits == 4) {
      tiles_for_rows<4>(weights, begin, end, a, rows, o, n);
    } else {
      tiles_for_rows<8>(weights, begin, end, a, rows, o, n);
    }
  });
}

bool block_matmul_serves() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl") &&
         __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("f16c") &&
         __builtin_cpu_supports("fma");
}

// The least rows of a call that the AMX kernel serves (bfloat16 activations, 4-bit records); 0 where it does
// not serve (no AMX, or the OS refused its registers).
int64_t block_matmul_amx_rows() { return block_matmul_serves() && amx_serves() ? kAmxMinRows : 0; }

// `amx`: whether calls of enough rows may take the AMX kernel (the caller's choice, which a masked feature
// turns off); it takes them only where the CPU and the OS let it.
at::Tensor block_matmul(const at::Tensor& x, const at::Tensor& packed, int64_t out_features, int64_t bits,
                        bool amx) {
  TORCH_CHECK(block_matmul_serves(), "block_matmul: this CPU lacks AVX-512 VNNI");
  TORCH_CHECK(bits == 4 || bits == 8, "block_matmul: bits must be 4 or 8, not ", bits);
  TORCH_CHECK(x.dim() == 2 && packed.dim() == 3, "block_matmul: x [rows, K], packed [tiles, blocks, bytes]");
  TORCH_CHECK(x.is_contiguous() && packed.is_contiguous(), "block_matmul: contiguous tensors only");
  TORCH_CHECK(packed.scalar_type() == at::kByte, "block_matmul: packed must be uint8");
  TORCH_CHECK(x.size(1) == packed.size(1) * kBlock, "block_matmul: x has ", x.size(1), " inputs, the weight ",
              packed.size(1) * kBlock);
  TORCH_CHECK(packed.size(2) == record_bytes(bits), "block_matmul: records of ", packed.size(2),
              " bytes, not the ", record_bytes(bits), " of ", bits, "-bit weights");
  TORCH_CHECK(out_features > (packed.size(0) - 1) * kLanes && out_features <= packed.size(0) * kLanes,
              "block_matmul: ", out_features, " outputs do not fill ", packed.size(0), " tiles of ", kLanes);
  at::Tensor out = at::empty({x.size(0), out_features}, x.options());
  const bool tiles = amx && bits == 4 && x.scalar_type() == at::kBFloat16 && x.size(0) >= kAmxMinRows;
  if (tiles && amx_serves()) {  // block_matmul_serves was checked above
    amx_multiply(x, packed, out_features, out);
  } else if (x.scalar_type() == at::kBFloat16) {
    multiply<c10::BFloat16>(x, packed, out_features, bits, out);
  } else {
    TORCH_CHECK(x.scalar_type() == at::kFloat, "block_matmul: bfloat16 or float32 activations only");
    multiply<float>(x, packed, out_features, bits, out);
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(gracelm, m) {
  m.def("block_matmul(Tensor x, Tensor packed, int out_features, int bits, bool amx) -> Tensor");
  m.def("block_matmul_serves() -> bool", &block_matmul_serves);
  m.def("block_matmul_amx_rows() -> int", &block_matmul_amx_rows);
}

TORCH_LIBRARY_IMPL(gracelm, CPU, m) { m.impl("block_matmul", &block_matmul); }
