// Shared by block_copy.cpp (checks, CPU ops, schemas) and block_copy.cu (CUDA ops).
//
// Every op views each KV layer, a contiguous tensor whose dimension `block_dim`
// indexes blocks, as bytes:
//
//   layer   uint8 [outer, num_blocks, inner]
//           outer = prod(shape[:block_dim]), inner = prod(shape[block_dim+1:]) * itemsize
//   buffer  uint8 [num_ids, num_layers, outer, inner]   (gather output, scatter input)
//
// One (listed block, layer, outer index) triple is one contiguous `inner`-byte chunk
// on both sides, so every op is a set of independent chunk copies.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/macros/Macros.h>

#include <cstdint>
#include <string>

namespace kvbackend {

struct BlockLayout {
  int64_t num_layers;
  int64_t outer;       // product of the dims before block_dim
  int64_t num_blocks;  // size of block_dim
  int64_t inner;       // bytes of one (outer index, block) chunk

  // Bytes of one block over all layers: one row of the buffer.
  C10_HOST_DEVICE int64_t block_nbytes() const { return num_layers * outer * inner; }
  // Byte offset of chunk (o, block) inside a layer.
  C10_HOST_DEVICE int64_t layer_offset(int64_t block, int64_t o) const {
    return (o * num_blocks + block) * inner;
  }
  // Byte offset of chunk (i, l, o) inside the buffer.
  C10_HOST_DEVICE int64_t buffer_offset(int64_t i, int64_t l, int64_t o) const {
    return ((i * num_layers + l) * outer + o) * inner;
  }
};

// An integer and a shape as text for check messages, formatted with std::to_string rather
// than std::ostream's number formatting: on one CUDA image (torch 2.11.0+cu130, extension
// built by Ubuntu's g++ 13.3) streaming an integer from an extension crashed the process
// with SIGSEGV inside ostream::operator<<(long), a 6-line op without kvbackend code too.
std::string num(int64_t value);
std::string shape(at::IntArrayRef sizes);

// Checks the layers, `block_ids` and `buffer` (named `buffer_name` in messages) of
// gather_blocks / scatter_blocks; raises ValueError on misuse. `distinct_ids` (scatter)
// also forbids repeated ids, which would make the result depend on the copy order.
BlockLayout check_transfer(at::TensorList kv_layers, const at::Tensor& block_ids,
                           const at::Tensor& buffer, const char* buffer_name, int64_t block_dim,
                           bool distinct_ids);

// Checks the layers and the (src[k], dst[k]) pairs of copy_blocks: same lengths,
// dst ids distinct and none of them a src id, so the pairs can run in any order.
BlockLayout check_copy(at::TensorList kv_layers, const at::Tensor& src, const at::Tensor& dst,
                       int64_t block_dim);

}  // namespace kvbackend
