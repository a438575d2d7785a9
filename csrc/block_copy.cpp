// Input checks, the CPU ops and the op schemas of the kvbackend block-copy extension.
// Layout of layers and buffer: see block_copy.h.
#include "block_copy.h"

#include <ATen/Parallel.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>
#include <string>
#include <vector>

namespace kvbackend {
namespace {

BlockLayout check_layers(at::TensorList kv_layers, int64_t block_dim) {
  TORCH_CHECK_VALUE(!kv_layers.empty(), "kv_layers must hold at least one layer");
  const at::Tensor& first = kv_layers[0];
  TORCH_CHECK_VALUE(block_dim >= 0 && block_dim < first.dim(), "block_dim must be in [0, ",
                    num(first.dim()), ") for layers of shape ", shape(first.sizes()), ", got ",
                    num(block_dim));
  for (size_t l = 0; l < kv_layers.size(); ++l) {
    const at::Tensor& layer = kv_layers[l];
    TORCH_CHECK_VALUE(layer.device() == first.device(), "layer ", num(l), " is on ", layer.device(),
                      ", layer 0 on ", first.device());
    TORCH_CHECK_VALUE(layer.scalar_type() == first.scalar_type(), "layer ", num(l), " has dtype ",
                      layer.scalar_type(), ", layer 0 has ", first.scalar_type());
    TORCH_CHECK_VALUE(layer.sizes() == first.sizes(), "layer ", num(l), " has shape ",
                      shape(layer.sizes()), ", layer 0 has ", shape(first.sizes()));
    TORCH_CHECK_VALUE(layer.is_contiguous(), "layer ", num(l), " is not contiguous");
  }
  const auto sizes = first.sizes();
  int64_t outer = 1;
  int64_t inner = static_cast<int64_t>(first.element_size());
  for (int64_t d = 0; d < block_dim; ++d) outer *= sizes[d];
  for (int64_t d = block_dim + 1; d < first.dim(); ++d) inner *= sizes[d];
  return {static_cast<int64_t>(kv_layers.size()), outer, sizes[block_dim], inner};
}

// Ids must be a CPU int64 vector (reading them on the host is then free) in [0, num_blocks).
void check_ids(const at::Tensor& ids, const char* name, int64_t num_blocks) {
  TORCH_CHECK_VALUE(ids.scalar_type() == at::kLong, name, " must be int64, got ",
                    ids.scalar_type());
  TORCH_CHECK_VALUE(ids.device().is_cpu(), name, " must be on the CPU, got ", ids.device());
  TORCH_CHECK_VALUE(ids.dim() == 1 && ids.is_contiguous(), name,
                    " must be a contiguous 1-D tensor, got shape ", shape(ids.sizes()));
  const int64_t* data = ids.data_ptr<int64_t>();  // [num_ids]
  for (int64_t k = 0; k < ids.numel(); ++k) {
    TORCH_CHECK_VALUE(data[k] >= 0 && data[k] < num_blocks, name, " holds block id ", num(data[k]),
                      " out of range [0, ", num(num_blocks), ")");
  }
}

// Marks the ids in `seen` (one flag per block); fails on an id already marked.
void mark_distinct(const at::Tensor& ids, const char* what, std::vector<char>& seen) {
  const int64_t* data = ids.data_ptr<int64_t>();  // [num_ids], already range-checked
  for (int64_t k = 0; k < ids.numel(); ++k) {
    TORCH_CHECK_VALUE(!seen[data[k]], what, " block id ", num(data[k]));
    seen[data[k]] = 1;
  }
}

}  // namespace

std::string num(int64_t value) { return std::to_string(value); }

std::string shape(at::IntArrayRef sizes) {
  std::string text = "[";
  for (size_t d = 0; d < sizes.size(); ++d) {
    text += (d ? ", " : "") + std::to_string(sizes[d]);
  }
  return text + "]";
}

BlockLayout check_transfer(at::TensorList kv_layers, const at::Tensor& block_ids,
                           const at::Tensor& buffer, const char* buffer_name, int64_t block_dim,
                           bool distinct_ids) {
  const BlockLayout g = check_layers(kv_layers, block_dim);
  check_ids(block_ids, "block_ids", g.num_blocks);
  if (distinct_ids) {
    std::vector<char> seen(g.num_blocks, 0);
    mark_distinct(block_ids, "block_ids repeats", seen);
  }
  TORCH_CHECK_VALUE(buffer.device() == kv_layers[0].device(), buffer_name, " is on ",
                    buffer.device(), ", the layers on ", kv_layers[0].device());
  TORCH_CHECK_VALUE(buffer.is_contiguous(), buffer_name, " is not contiguous");
  const int64_t expected = block_ids.numel() * g.block_nbytes();
  TORCH_CHECK_VALUE(static_cast<int64_t>(buffer.nbytes()) == expected, buffer_name, " has ",
                    num(buffer.nbytes()), " bytes, expected ", num(block_ids.numel()),
                    " blocks x ", num(g.block_nbytes()), " bytes = ", num(expected));
  return g;
}

BlockLayout check_copy(at::TensorList kv_layers, const at::Tensor& src, const at::Tensor& dst,
                       int64_t block_dim) {
  const BlockLayout g = check_layers(kv_layers, block_dim);
  check_ids(src, "src", g.num_blocks);
  check_ids(dst, "dst", g.num_blocks);
  TORCH_CHECK_VALUE(src.numel() == dst.numel(), "src has ", num(src.numel()), " ids, dst has ",
                    num(dst.numel()));
  std::vector<char> seen(g.num_blocks, 0);
  mark_distinct(dst, "dst repeats", seen);
  const int64_t* src_ids = src.data_ptr<int64_t>();  // [num_pairs]
  for (int64_t k = 0; k < src.numel(); ++k) {
    TORCH_CHECK_VALUE(!seen[src_ids[k]], "block id ", num(src_ids[k]), " is both a src and a dst");
  }
  return g;
}

namespace {

// Below this many bytes per task at::parallel_for runs the whole range inline.
constexpr int64_t kMinBytesPerTask = int64_t{1} << 20;

// Calls copy_chunk(i, l, o) for every chunk of every listed block: i in [0, num_ids),
// l in [0, num_layers), o in [0, outer). Parallel over (i, l); the chunks are disjoint.
template <typename F>
void for_each_chunk(int64_t num_ids, const BlockLayout& g, const F& copy_chunk) {
  const int64_t item_bytes = std::max<int64_t>(1, g.outer * g.inner);
  const int64_t grain = std::max<int64_t>(1, kMinBytesPerTask / item_bytes);
  at::parallel_for(0, num_ids * g.num_layers, grain, [&](int64_t begin, int64_t end) {
    for (int64_t k = begin; k < end; ++k) {
      for (int64_t o = 0; o < g.outer; ++o) copy_chunk(k / g.num_layers, k % g.num_layers, o);
    }
  });
}

std::vector<uint8_t*> layer_bytes(at::TensorList kv_layers) {
  std::vector<uint8_t*> ptrs;  // [num_layers], each uint8 [outer, num_blocks, inner]
  ptrs.reserve(kv_layers.size());
  for (const at::Tensor& layer : kv_layers) ptrs.push_back(static_cast<uint8_t*>(layer.data_ptr()));
  return ptrs;
}

void check_cpu(at::TensorList kv_layers) {
  TORCH_CHECK_VALUE(kv_layers[0].device().is_cpu(), "CPU op got layers on ",
                    kv_layers[0].device());
}

void gather_blocks_cpu(at::TensorList kv_layers, const at::Tensor& block_ids,
                       const at::Tensor& out, int64_t block_dim) {
  const BlockLayout g = check_transfer(kv_layers, block_ids, out, "out", block_dim, false);
  check_cpu(kv_layers);
  const std::vector<uint8_t*> layers = layer_bytes(kv_layers);
  const int64_t* ids = block_ids.data_ptr<int64_t>();  // [num_ids]
  uint8_t* buf = static_cast<uint8_t*>(out.data_ptr());  // [num_ids, num_layers, outer, inner]
  for_each_chunk(block_ids.numel(), g, [&](int64_t i, int64_t l, int64_t o) {
    std::memcpy(buf + g.buffer_offset(i, l, o), layers[l] + g.layer_offset(ids[i], o), g.inner);
  });
}

void scatter_blocks_cpu(const at::Tensor& buffer, at::TensorList kv_layers,
                        const at::Tensor& block_ids, int64_t block_dim) {
  const BlockLayout g = check_transfer(kv_layers, block_ids, buffer, "buffer", block_dim, true);
  check_cpu(kv_layers);
  const std::vector<uint8_t*> layers = layer_bytes(kv_layers);
  const int64_t* ids = block_ids.data_ptr<int64_t>();  // [num_ids]
  // [num_ids, num_layers, outer, inner]
  const uint8_t* buf = static_cast<const uint8_t*>(buffer.data_ptr());
  for_each_chunk(block_ids.numel(), g, [&](int64_t i, int64_t l, int64_t o) {
    std::memcpy(layers[l] + g.layer_offset(ids[i], o), buf + g.buffer_offset(i, l, o), g.inner);
  });
}

void copy_blocks_cpu(at::TensorList kv_layers, const at::Tensor& src, const at::Tensor& dst,
                     int64_t block_dim) {
  const BlockLayout g = check_copy(kv_layers, src, dst, block_dim);
  check_cpu(kv_layers);
  const std::vector<uint8_t*> layers = layer_bytes(kv_layers);
  const int64_t* src_ids = src.data_ptr<int64_t>();  // [num_pairs]
  const int64_t* dst_ids = dst.data_ptr<int64_t>();  // [num_pairs]
  for_each_chunk(src.numel(), g, [&](int64_t k, int64_t l, int64_t o) {
    std::memcpy(layers[l] + g.layer_offset(dst_ids[k], o),
                layers[l] + g.layer_offset(src_ids[k], o), g.inner);
  });
}

}  // namespace

TORCH_LIBRARY(kvbackend, m) {
  // out[i, l] = bytes of block block_ids[i] in layer l.
  m.def("gather_blocks(Tensor[] kv_layers, Tensor block_ids, Tensor(a!) out, int block_dim) -> ()");
  // Block block_ids[i] of layer l = buffer[i, l]; block_ids must be distinct.
  m.def(
      "scatter_blocks(Tensor buffer, Tensor(a!)[] kv_layers, Tensor block_ids, int block_dim)"
      " -> ()");
  // Block dst[k] = block src[k] in every layer; dst distinct and disjoint from src.
  m.def("copy_blocks(Tensor(a!)[] kv_layers, Tensor src, Tensor dst, int block_dim) -> ()");
}

TORCH_LIBRARY_IMPL(kvbackend, CPU, m) {
  m.impl("gather_blocks", &gather_blocks_cpu);
  m.impl("scatter_blocks", &scatter_blocks_cpu);
  m.impl("copy_blocks", &copy_blocks_cpu);
}

}  // namespace kvbackend
