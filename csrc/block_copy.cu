// CUDA ops of the kvbackend block-copy extension; schemas and checks live in block_copy.cpp.
// Layout of layers and buffer: see block_copy.h. Built only against a CUDA torch.
//
// Host side: the layer addresses and the block ids (which must be CPU tensors, checked on
// the host without a sync) go to the device in one small table, then one kernel moves
// every layer on the current stream.
//
// Kernels copy in words of sizeof(Word) bytes: the widest of 16/8/4/2/1 that divides
// `inner` and every base address, so any dtype (fp32, bf16, fp16, fp8 ...) takes one path.
#include "block_copy.h"

#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <initializer_list>

namespace kvbackend {
namespace {

constexpr int kThreads = 256;

enum class Direction { kLayersToBuffer, kBufferToLayers };

/* One thread's walk over the words of one block of one layer: `outer` chunks of
 * `inner_words` words, word w = (o, j) = (w / inner_words, w % inner_words), for
 * w = threadIdx.x, threadIdx.x + blockDim.x, ... . (o, j) advance by a precomputed step,
 * so the loop does no 64-bit division per word (two divisions per thread in all). */
template <typename Word>
struct ChunkWalk {
  int64_t o, j;                  // the current word's chunk and word within the chunk
  int64_t outer, inner_words;
  int64_t step_o, step_j;        // blockDim.x words = step_o chunks + step_j words

  __device__ explicit ChunkWalk(const BlockLayout& g)
      : outer(g.outer), inner_words(g.inner / static_cast<int64_t>(sizeof(Word))) {
    o = threadIdx.x / inner_words;
    j = threadIdx.x % inner_words;
    step_o = blockDim.x / inner_words;
    step_j = blockDim.x % inner_words;
  }
  __device__ bool active() const { return o < outer; }
  __device__ void next() {
    o += step_o;
    j += step_j;
    if (j >= inner_words) {
      j -= inner_words;
      ++o;
    }
  }
};

/* Grid: (num_ids, num_layers). CTA (i, l) moves block table[num_layers + i] of layer l,
 * i.e. `outer` chunks of `inner` bytes, to or from buffer row (i, l); its threads stride
 * over the outer * inner / sizeof(Word) words. */
template <typename Word, Direction kDir>
__global__ void transfer_kernel(
    const int64_t* __restrict__ table,  // [num_layers + num_ids]: layer addresses, then block ids
    uint8_t* __restrict__ buffer,       // [num_ids, num_layers, outer, inner] bytes
    const BlockLayout g) {
  const int64_t i = blockIdx.x;
  const int64_t l = blockIdx.y;
  uint8_t* layer = reinterpret_cast<uint8_t*>(table[l]);  // [outer, num_blocks, inner] bytes
  const int64_t block = table[g.num_layers + i];
  for (ChunkWalk<Word> walk(g); walk.active(); walk.next()) {
    Word* cached = reinterpret_cast<Word*>(layer + g.layer_offset(block, walk.o)) + walk.j;
    Word* staged = reinterpret_cast<Word*>(buffer + g.buffer_offset(i, l, walk.o)) + walk.j;
    if constexpr (kDir == Direction::kLayersToBuffer) {
      *staged = *cached;
    } else {
      *cached = *staged;
    }
  }
}

/* Grid: (num_pairs, num_layers). CTA (k, l) copies block src[k] onto block dst[k] in
 * layer l, with src = table[num_layers + k] and dst = table[num_layers + num_pairs + k]. */
template <typename Word>
__global__ void copy_kernel(
    const int64_t* __restrict__ table,  // [num_layers + 2 * num_pairs]: layers, src ids, dst ids
    const BlockLayout g) {
  const int64_t k = blockIdx.x;
  const int64_t l = blockIdx.y;
  uint8_t* layer = reinterpret_cast<uint8_t*>(table[l]);  // [outer, num_blocks, inner] bytes
  const int64_t src = table[g.num_layers + k];
  const int64_t dst = table[g.num_layers + gridDim.x + k];
  for (ChunkWalk<Word> walk(g); walk.active(); walk.next()) {
    reinterpret_cast<Word*>(layer + g.layer_offset(dst, walk.o))[walk.j] =
        reinterpret_cast<const Word*>(layer + g.layer_offset(src, walk.o))[walk.j];
  }
}

// Widest word in {16, 8, 4, 2, 1} bytes that divides `bits` (inner | addresses ...).
int64_t word_bytes(uint64_t bits) {
  int64_t word = 16;
  while (word > 1 && bits % word != 0) word /= 2;
  return word;
}

// Calls f(Word{}) with the unsigned type of `word` bytes.
template <typename F>
void with_word_type(int64_t word, const F& f) {
  switch (word) {
    case 16: return f(uint4{});
    case 8: return f(uint64_t{});
    case 4: return f(uint32_t{});
    case 2: return f(uint16_t{});
    default: return f(uint8_t{});
  }
}

// Pinned CPU int64 [num_layers + sum(ids.numel())]: layer addresses then each id list,
// copied to the layers' device on the current stream. Returns the device copy; ORs the
// layer addresses into `address_bits` (for word_bytes).
at::Tensor device_table(at::TensorList kv_layers, std::initializer_list<at::Tensor> id_lists,
                        uint64_t& address_bits) {
  int64_t size = static_cast<int64_t>(kv_layers.size());
  for (const at::Tensor& ids : id_lists) size += ids.numel();
  at::Tensor table = at::empty({size}, at::TensorOptions().dtype(at::kLong).pinned_memory(true));
  int64_t* data = table.data_ptr<int64_t>();
  for (const at::Tensor& layer : kv_layers) {
    const auto address = reinterpret_cast<uint64_t>(layer.data_ptr());
    address_bits |= address;
    *data++ = static_cast<int64_t>(address);
  }
  for (const at::Tensor& ids : id_lists) {
    data = std::copy_n(ids.data_ptr<int64_t>(), ids.numel(), data);
  }
  return table.to(at::TensorOptions().device(kv_layers[0].device()), /*non_blocking=*/true);
}

void check_grid(int64_t num_items, const BlockLayout& g) {
  TORCH_CHECK_VALUE(num_items <= INT32_MAX, "at most 2^31 - 1 blocks per call, got ",
                    num(num_items));
  TORCH_CHECK_VALUE(g.num_layers <= 65535, "at most 65535 layers per call, got ",
                    num(g.num_layers));
}

template <Direction kDir>
void transfer_cuda(at::TensorList kv_layers, const at::Tensor& block_ids,
                   const at::Tensor& buffer, int64_t block_dim) {
  constexpr bool kScatter = kDir == Direction::kBufferToLayers;
  const BlockLayout g = check_transfer(kv_layers, block_ids, buffer, kScatter ? "buffer" : "out",
                                       block_dim, /*distinct_ids=*/kScatter);
  TORCH_CHECK_VALUE(kv_layers[0].is_cuda(), "CUDA op got layers on ", kv_layers[0].device());
  check_grid(block_ids.numel(), g);
  if (block_ids.numel() == 0 || g.outer * g.inner == 0) return;
  const c10::cuda::CUDAGuard guard(kv_layers[0].device());
  uint64_t bits = static_cast<uint64_t>(g.inner) | reinterpret_cast<uint64_t>(buffer.data_ptr());
  const at::Tensor table = device_table(kv_layers, {block_ids}, bits);
  const dim3 grid(static_cast<unsigned>(block_ids.numel()), static_cast<unsigned>(g.num_layers));
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  with_word_type(word_bytes(bits), [&](auto word) {
    using Word = decltype(word);
    transfer_kernel<Word, kDir><<<grid, kThreads, 0, stream>>>(
        table.data_ptr<int64_t>(), static_cast<uint8_t*>(buffer.data_ptr()), g);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

void gather_blocks_cuda(at::TensorList kv_layers, const at::Tensor& block_ids,
                        const at::Tensor& out, int64_t block_dim) {
  transfer_cuda<Direction::kLayersToBuffer>(kv_layers, block_ids, out, block_dim);
}

void scatter_blocks_cuda(const at::Tensor& buffer, at::TensorList kv_layers,
                         const at::Tensor& block_ids, int64_t block_dim) {
  transfer_cuda<Direction::kBufferToLayers>(kv_layers, block_ids, buffer, block_dim);
}

void copy_blocks_cuda(at::TensorList kv_layers, const at::Tensor& src, const at::Tensor& dst,
                      int64_t block_dim) {
  const BlockLayout g = check_copy(kv_layers, src, dst, block_dim);
  TORCH_CHECK_VALUE(kv_layers[0].is_cuda(), "CUDA op got layers on ", kv_layers[0].device());
  check_grid(src.numel(), g);
  if (src.numel() == 0 || g.outer * g.inner == 0) return;
  const c10::cuda::CUDAGuard guard(kv_layers[0].device());
  uint64_t bits = static_cast<uint64_t>(g.inner);
  const at::Tensor table = device_table(kv_layers, {src, dst}, bits);
  const dim3 grid(static_cast<unsigned>(src.numel()), static_cast<unsigned>(g.num_layers));
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  with_word_type(word_bytes(bits), [&](auto word) {
    using Word = decltype(word);
    copy_kernel<Word><<<grid, kThreads, 0, stream>>>(table.data_ptr<int64_t>(), g);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

}  // namespace

TORCH_LIBRARY_IMPL(kvbackend, CUDA, m) {
  m.impl("gather_blocks", &gather_blocks_cuda);
  m.impl("scatter_blocks", &scatter_blocks_cuda);
  m.impl("copy_blocks", &copy_blocks_cuda);
}

}  // namespace kvbackend
