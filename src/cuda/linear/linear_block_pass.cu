// The block/tile loop of the vocabulary-blocked ∂W pass (linear_block_pass.hpp). Every launch is
// on the caller's stream, in the order the tile's data flow needs: logits product, the loss's
// block gradient, narrowing, ∂W product (and the ∂h product of schedule (d)); the block's
// write-back after its last tile.
#include "cuda/linear/linear_block_pass.hpp"

#include <algorithm>
#include <cstdlib>

#include "cuda/linear/linear_support.hpp"
#include "cuda/test_hook.hpp"

namespace xent::cuda {

namespace {

// How many of the tile's first rows the cache holds (it holds rows [0, R)).
int64_t cached_tile_rows(const BlockPassInputs& pass, int64_t first_row, int64_t rows) {
  if (!pass.logits_cache.present()) return 0;
  return std::clamp<int64_t>(pass.logits_cache.rows - first_row, 0, rows);
}

// The tile's logits: read from the cache where it holds them all, else h·W_blockᵀ (+ bias) by
// cuBLASLt into the tile buffer, after the rows the cache holds (copied there from it).
void form_block_logits(const BlockPassInputs& pass, BlockTile& block_tile,
                       const GemmMatrix& hidden_rows, const GemmMatrix& weight_block,
                       cudaStream_t stream) {
  const TensorView& cache = pass.logits_cache;
  const std::size_t element = dtype_size(pass.logits_dtype);
  const int64_t first_column = block_tile.gradient.first_column;
  const int64_t columns = block_tile.gradient.columns;
  const int64_t rows = block_tile.gradient.rows;
  const int64_t held = cached_tile_rows(pass, block_tile.first_row, rows);
  const void* cached = nullptr;
  if (held > 0) {
    const std::size_t offset = static_cast<std::size_t>(block_tile.first_row) *
                                   static_cast<std::size_t>(cache.row_stride) +
                               static_cast<std::size_t>(first_column);
    cached = static_cast<const char*>(cache.data) + offset * element;
  }
  if (held == rows) {
    block_tile.logits = cached;
    block_tile.logits_stride = cache.row_stride;
    return;
  }
  const std::size_t row_bytes = static_cast<std::size_t>(columns) * element;
  if (held > 0) {
    XENT_CUDA_CHECK(cudaMemcpy2DAsync(block_tile.gradient.grad, row_bytes, cached,
                                      static_cast<std::size_t>(cache.row_stride) * element,
                                      row_bytes, static_cast<std::size_t>(held),
                                      cudaMemcpyDeviceToDevice, stream));
  }
  GemmProduct forward;
  forward.a = gemm_rows(hidden_rows, held, rows - held);
  forward.b = weight_block;
  forward.b_transposed = true;
  forward.c = GemmMatrix{
      static_cast<char*>(block_tile.gradient.grad) + static_cast<std::size_t>(held) * row_bytes,
      pass.logits_dtype, rows - held, columns, columns};
  if (pass.bias.present()) {
    forward.bias = static_cast<const char*>(pass.bias.data) +
                   static_cast<std::size_t>(first_column) * dtype_size(pass.bias.dtype);
  }
  gemm(forward, pass.scratch, stream);
  block_tile.logits = block_tile.gradient.grad;
  block_tile.logits_stride = columns;
}

// The tile's gradient by the fused gradient product, in the operand dtype; false, having
// launched nothing, when it declines. A tile across the cache's last row forms its cached rows'
// gradient from the cache (the block-gradient step writes them in the operand dtype too when the
// logits have it) and its other rows by the product, which would form them again.
bool fused_tile(const BlockPassInputs& pass, const BlockTile& block_tile,
                const GemmMatrix& hidden_rows, const GemmMatrix& weight_block,
                const BlockGradientStep& block_gradient, cudaStream_t stream) {
  if (!pass.fused_gradient) return false;
  const int64_t rows = block_tile.gradient.rows;
  const int64_t held = cached_tile_rows(pass, block_tile.first_row, rows);
  if (held == 0) return pass.fused_gradient(block_tile, stream);
  if (held == rows || pass.logits_dtype != pass.hidden.dtype) return false;
  BlockTile after = block_tile;
  after.first_row += held;
  after.gradient.rows = rows - held;
  after.gradient.grad = static_cast<char*>(block_tile.gradient.grad) +
                        static_cast<std::size_t>(held) *
                            static_cast<std::size_t>(block_tile.gradient.columns) *
                            dtype_size(pass.logits_dtype);
  if (!pass.fused_gradient(after, stream)) return false;
  BlockTile before = block_tile;
  before.gradient.rows = held;
  form_block_logits(pass, before, gemm_rows(hidden_rows, 0, held), weight_block, stream);
  block_gradient(before, stream);
  return true;
}

// Where the fp32 ∂h sums of each row are: rows [0, head_rows) from the start of the ∂h output,
// the others in `tail` (rows from head_rows on).
struct HiddenSumsPlace {
  float* head = nullptr;
  float* tail = nullptr;
  int64_t head_rows = 0;
  int64_t hidden = 0;
  float* row(int64_t r) const {
    return r < head_rows ? head + r * hidden : tail + (r - head_rows) * hidden;
  }
};

HiddenSumsPlace hidden_sums_place(const BlockPassInputs& pass) {
  HiddenSumsPlace place;
  place.hidden = pass.hidden.cols;
  place.tail = pass.hidden_accumulator;
  if (pass.chunks.hidden_sums_head_rows > 0) {  // only with the other rows' sums in ∂W
    place.head = static_cast<float*>(pass.hidden_grad.data);
    place.head_rows = pass.chunks.hidden_sums_head_rows;
  }
  return place;
}

// ∂h from its fp32 sums. Rows held in the ∂h output itself are narrowed in place: the first ones
// through a copy in the chunk region (free once the blocks are done), the rest in ranges whose
// reads and writes do not overlap (in_place_narrowing_ranges); then the other rows from `tail`,
// whose 16-bit rows overlie the head's fp32 rows and so come last.
void write_hidden_grad(const BlockPassInputs& pass, const HiddenSumsPlace& sums,
                       cudaStream_t stream) {
  const int64_t hidden = sums.hidden, rows = pass.hidden.rows;
  auto rows_of = [&](int64_t first, int64_t last) {
    return view_rows(pass.hidden_grad, first, last - first);
  };
  if (sums.head_rows > 0) {
    const std::size_t row_bytes = static_cast<std::size_t>(hidden) * sizeof(float);
    int64_t staged = std::min<int64_t>(
        sums.head_rows, static_cast<int64_t>(chunk_region_bytes(pass.chunks) / row_bytes));
    // The tests stage fewer rows so that their small shapes run the in-place ranges too.
    if (const int64_t limit = test_hook().hidden_sums_staged_rows; limit > 0) {
      staged = std::clamp<int64_t>(limit, 1, staged);
    }
    XENT_CUDA_CHECK(cudaMemcpyAsync(pass.region, sums.head,
                                    static_cast<std::size_t>(staged) * row_bytes,
                                    cudaMemcpyDeviceToDevice, stream));
    write_from_fp32(static_cast<const float*>(pass.region), hidden, rows_of(0, staged), stream);
    for (const auto& [first, last] : in_place_narrowing_ranges(staged, sums.head_rows)) {
      write_from_fp32(sums.head + first * hidden, hidden, rows_of(first, last), stream);
    }
  }
  if (rows > sums.head_rows) {
    write_from_fp32(sums.tail, hidden, rows_of(sums.head_rows, rows), stream);
  }
}

}  // namespace

void weight_gradient_by_blocks(const BlockPassInputs& pass, const BlockGradientStep& block_gradient,
                               cudaStream_t stream) {
  const ChunkPlan& chunks = pass.chunks;
  const int64_t rows = pass.hidden.rows, hidden = pass.hidden.cols, vocab = pass.weight.rows;
  const DType logits_dtype = pass.logits_dtype, operand_dtype = pass.hidden.dtype;
  const std::size_t element = dtype_size(logits_dtype);
  char* tile = static_cast<char*>(pass.region);
  char* second_tile = tile + align_up(static_cast<std::size_t>(chunks.tile_rows) *
                                      static_cast<std::size_t>(chunks.block_columns) * element);
  float* accumulator = reinterpret_cast<float*>(tile + align_up(chunks.tile_buffer_bytes));
  // Tiles of fewer than N rows accumulate ∂W of the block: in place for an fp32 ∂W, else in the
  // fp32 block accumulator, written back once per block.
  const bool accumulate = chunks.tile_count > 1;
  const bool in_accumulator = accumulate && pass.weight_grad.dtype != DType::f32;
  const bool sum_hidden = pass.hidden_accumulator != nullptr;
  const HiddenSumsPlace sums = hidden_sums_place(pass);
  // Blocks whose ∂W rows hold the ∂h sums write their ∂W in a second sweep, after ∂h.
  const int64_t deferred_first = sum_hidden && chunks.hidden_sums_in_weight_grad
                                     ? chunks.deferred_first_block
                                     : chunks.block_count;

  // One block: every tile's gradient, then ∂W of the tile (with_weight), its ∂h sums
  // (with_hidden) and its ∂bias (with_bias: once per block, in the block's first sweep).
  auto run_block = [&](int64_t block, bool with_weight, bool with_hidden, bool with_bias) {
    const int64_t first_column = block * chunks.block_columns;
    const int64_t columns = std::min(chunks.block_columns, vocab - first_column);
    const GemmMatrix weight_block = gemm_matrix(pass.weight, first_column, columns);
    const TensorView grad_block = view_rows(pass.weight_grad, first_column, columns);
    for (int64_t t = 0; t < chunks.tile_count; ++t) {
      const int64_t first = t * chunks.tile_rows;
      const int64_t count = std::min(chunks.tile_rows, rows - first);
      const GemmMatrix hidden_rows = gemm_matrix(pass.hidden, first, count);
      BlockTile block_tile;
      block_tile.gradient.grad = tile;
      block_tile.gradient.grad_stride = columns;
      block_tile.gradient.dtype = logits_dtype;
      block_tile.gradient.rows = count;
      block_tile.gradient.columns = columns;
      block_tile.gradient.first_column = first_column;
      block_tile.gradient.vocab = vocab;
      block_tile.first_row = first;
      block_tile.second_buffer = second_tile;
      GemmMatrix gradient{tile, logits_dtype, count, columns, columns};
      if (fused_tile(pass, block_tile, hidden_rows, weight_block, block_gradient, stream)) {
        gradient.dtype = operand_dtype;  // written as the products read it
      } else {
        form_block_logits(pass, block_tile, hidden_rows, weight_block, stream);
        block_gradient(block_tile, stream);
        if (logits_dtype != operand_dtype) {
          narrow_rows_in_place(tile, count, columns, columns, operand_dtype, stream);
          gradient.dtype = operand_dtype;
          gradient.stride = 2 * columns;
        }
      }
      if (with_bias) {
        accumulate_column_sums(gradient.data, gradient.dtype, count, columns, gradient.stride,
                               pass.bias_sums + first_column, t > 0, stream);
      }
      if (with_weight) {
        GemmProduct product;
        product.a = gradient;
        product.a_transposed = true;
        product.b = hidden_rows;
        product.c = in_accumulator ? GemmMatrix{accumulator, DType::f32, columns, hidden, hidden}
                                   : gemm_matrix(grad_block, 0, columns);
        product.beta = (accumulate && t > 0) || pass.add_to_weight_grad ? 1.0f : 0.0f;
        gemm(product, pass.scratch, stream);
      }
      if (with_hidden) {
        // One product per run of rows whose sums are contiguous (a tile across the head's end
        // takes two).
        for (int64_t part = first; part < first + count;) {
          const int64_t end =
              part < sums.head_rows ? std::min(first + count, sums.head_rows) : first + count;
          GemmProduct hidden_product;
          hidden_product.a = gemm_rows(gradient, part - first, end - part);
          hidden_product.b = weight_block;
          hidden_product.c = GemmMatrix{sums.row(part), DType::f32, end - part, hidden, hidden};
          hidden_product.beta = block > 0 ? 1.0f : 0.0f;
          gemm(hidden_product, pass.scratch, stream);
          part = end;
        }
      }
    }
    if (with_weight && in_accumulator) write_from_fp32(accumulator, hidden, grad_block, stream);
  };

  for (int64_t block = 0; block < chunks.block_count; ++block) {
    run_block(block, block < deferred_first, sum_hidden, pass.bias_sums != nullptr);
  }
  if (sum_hidden) write_hidden_grad(pass, sums, stream);
  for (int64_t block = deferred_first; block < chunks.block_count; ++block) {
    run_block(block, true, false, false);
  }
}

}  // namespace xent::cuda
