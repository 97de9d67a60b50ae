// A GGUF matrix's stored blocks (Q4_0, Q4_1, Q8_0) packed into the records block_matmul reads
// (block_records.h), in one pass over the file's bytes: a cold start packs every matrix of the model once,
// straight into the cache entry's file (block_pack_into; a stack's parts each into its range of tiles).
// The layout and the arithmetic (w = scale * q + minimum): gracelm/model/block_linear.py and
// gracelm/model/gguf_int4.py.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "block_records.h"

namespace {

using namespace gracelm::blocks;

// GGUF's type codes (ggml.h) of the blocks packed here.
constexpr int64_t kQ4_0 = 2;
constexpr int64_t kQ4_1 = 3;
constexpr int64_t kQ8_0 = 8;

struct BlockType {
  int64_t bits;
  int64_t header;  // bytes before the q: d, or d and m (float16 each)
  int64_t bytes;   // of a block
};

BlockType block_type(int64_t ggml_type) {
  switch (ggml_type) {
    case kQ4_0: return {4, 2, 18};
    case kQ4_1: return {4, 4, 20};
    case kQ8_0: return {8, 2, 34};
    default: TORCH_CHECK(false, "block_pack: GGUF type ", ggml_type, " is not Q4_0, Q4_1 or Q8_0");
  }
}

// The block's minimum: Q4_1 stores it, Q4_0's is -8d and Q8_0's -128d (exact in float16 unless it
// overflows, which is refused).
inline c10::Half minimum_of(const uint8_t* block, int64_t ggml_type, c10::Half d) {
  c10::Half m;
  if (ggml_type == kQ4_1) {
    std::memcpy(&m, block + 2, 2);
    return m;
  }
  m = c10::Half(static_cast<float>(d) * (ggml_type == kQ4_0 ? -8.0f : -128.0f));
  TORCH_CHECK(std::isfinite(static_cast<float>(m)),
              "block_pack: a block's minimum overflows float16 (a Q8_0 scale above 511?)");
  return m;
}

// The weights of one output in a record, 4 bytes (its 4 inputs of vector j) at a time: vector j holds inputs
// 4j..4j+3 of each of the 16 outputs. 8-bit: the signed q + 128 (its top bit flipped). 4-bit: a file's byte
// k holds inputs k (low nibble) and k + 16 (high), and a record's byte holds vectors 2h and 2h + 1 as its
// low and high nibbles, so vectors 0/1 take the low nibbles of bytes 0-3 and 4-7, 2/3 those of bytes 8-15,
// 4/5 and 6/7 the high nibbles of the same bytes.
template <int64_t kBits>
inline void pack_output(const uint8_t* qs, int64_t o, uint8_t* record) {
  constexpr uint32_t kLow = 0x0F0F0F0Fu, kHigh = 0xF0F0F0F0u;
  auto word = [qs](int64_t at) {
    uint32_t w;
    std::memcpy(&w, qs + at, 4);
    return w;
  };
  auto put = [record, o](int64_t vector, uint32_t w) { std::memcpy(record + vector * kLanes * 4 + o * 4, &w, 4); };
  if constexpr (kBits == 8) {
    for (int64_t j = 0; j < kBlock / 4; ++j) put(j, word(4 * j) ^ 0x80808080u);
  } else {
    const uint32_t w0 = word(0), w1 = word(4), w2 = word(8), w3 = word(12);
    put(0, (w0 & kLow) | ((w1 & kLow) << 4));
    put(1, (w2 & kLow) | ((w3 & kLow) << 4));
    put(2, ((w0 >> 4) & kLow) | (w1 & kHigh));
    put(3, ((w2 >> 4) & kLow) | (w3 & kHigh));
  }
}

// One record: the weights of `lanes` rows, then their scales and minimums. The lanes of a last partial tile
// beyond them are written as zeros (a weight, scale and minimum of 0 add nothing to a sum): the destination
// may hold anything, a cache file's fresh pages or a reused buffer.
template <int64_t kBits>
void pack_record(const uint8_t* rows, int64_t row_bytes, int64_t lanes, int64_t block, int64_t ggml_type,
                 const BlockType& type, uint8_t* record) {
  c10::Half* tails = reinterpret_cast<c10::Half*>(record + weight_bytes(kBits));
  for (int64_t o = 0; o < lanes; ++o) {
    const uint8_t* src = rows + o * row_bytes + block * type.bytes;
    c10::Half d;
    std::memcpy(&d, src, 2);
    tails[o] = d;
    tails[kLanes + o] = minimum_of(src, ggml_type, d);
    pack_output<kBits>(src + type.header, o, record);
  }
  if (lanes == kLanes) return;
  constexpr int64_t kVectors = weight_bytes(kBits) / (kLanes * 4);
  for (int64_t j = 0; j < kVectors; ++j) {
    std::memset(record + j * kLanes * 4 + lanes * 4, 0, (kLanes - lanes) * 4);
  }
  std::memset(tails + lanes, 0, (kLanes - lanes) * sizeof(c10::Half));
  std::memset(tails + kLanes + lanes, 0, (kLanes - lanes) * sizeof(c10::Half));
}

// Writes into `out` [tiles, K / 32, record bytes] (every byte of it) the records of `raw`, a matrix's stored
// bytes [rows, bytes per row]: `out` may be a part of a larger buffer (a stack's, a cache file's mapping).
void block_pack_into(const at::Tensor& raw, int64_t ggml_type, const at::Tensor& out) {
  const BlockType type = block_type(ggml_type);
  TORCH_CHECK(raw.dim() == 2 && raw.is_contiguous() && raw.scalar_type() == at::kByte,
              "block_pack: raw must be contiguous uint8 [rows, bytes per row]");
  TORCH_CHECK(raw.size(1) % type.bytes == 0, "block_pack: rows of ", raw.size(1), " bytes are not whole blocks");
  const int64_t rows = raw.size(0), row_bytes = raw.size(1), blocks = row_bytes / type.bytes;
  const int64_t tiles = (rows + kLanes - 1) / kLanes, record = record_bytes(type.bits);
  TORCH_CHECK(out.is_contiguous() && out.scalar_type() == at::kByte && out.device().is_cpu() &&
                  out.sizes() == at::IntArrayRef({tiles, blocks, record}),
              "block_pack: out must be contiguous uint8 [", tiles, ", ", blocks, ", ", record, "], not ",
              out.scalar_type(), " ", out.sizes());
  const uint8_t* src = raw.data_ptr<uint8_t>();
  uint8_t* dst = out.data_ptr<uint8_t>();
  at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t lanes = std::min(kLanes, rows - t * kLanes);
      for (int64_t b = 0; b < blocks; ++b) {
        uint8_t* out_record = dst + (t * blocks + b) * record;
        const uint8_t* rows_of_tile = src + t * kLanes * row_bytes;
        if (type.bits == 8) {
          pack_record<8>(rows_of_tile, row_bytes, lanes, b, ggml_type, type, out_record);
        } else {
          pack_record<4>(rows_of_tile, row_bytes, lanes, b, ggml_type, type, out_record);
        }
      }
    }
  });
}

// packed [tiles, K / 32, record bytes] of `raw`, in a tensor of its own.
at::Tensor block_pack(const at::Tensor& raw, int64_t ggml_type) {
  const BlockType type = block_type(ggml_type);
  TORCH_CHECK(raw.dim() == 2, "block_pack: raw must be contiguous uint8 [rows, bytes per row]");
  const int64_t tiles = (raw.size(0) + kLanes - 1) / kLanes;
  at::Tensor packed = at::empty({tiles, raw.size(1) / type.bytes, record_bytes(type.bits)},
                                raw.options().dtype(at::kByte));
  block_pack_into(raw, ggml_type, packed);
  return packed;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(gracelm, m) {
  m.def("block_pack(Tensor raw, int ggml_type) -> Tensor");
  m.def("block_pack_into(Tensor raw, int ggml_type, Tensor(a!) out) -> ()");
}

TORCH_LIBRARY_IMPL(gracelm, CPU, m) {
  m.impl("block_pack", &block_pack);
  m.impl("block_pack_into", &block_pack_into);
}
