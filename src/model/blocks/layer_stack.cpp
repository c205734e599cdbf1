#include "model/blocks/layer_stack.h"

#include <algorithm>

#include "core/error.h"
#include "runtime/communicator.h"

namespace metrale {
namespace {

// Regions of the verify scratch start on 256-byte boundaries (vectorised device access).
constexpr size_t kVerifyRegionAlignment = 256;

// A tensor-parallel block's partial site output [T, H] becomes the sum over the group.
void sum_partial_output(const StepContext& step, const Tensor& out) {
  METRALE_CHECK(step.communicator != nullptr, "a tensor-parallel share of a block ran without its group");
  step.communicator->all_reduce_sum(out);
}

}  // namespace

LayerStack::LayerStack(std::vector<DecoderLayer> layers, std::unique_ptr<ResidualScheme> residual, std::string label)
    : layers_(std::move(layers)), residual_(std::move(residual)), label_(std::move(label)) {
  METRALE_CHECK(residual_ != nullptr, "{}s without a residual scheme", label_);
  METRALE_CHECK(residual_->num_sites() == 2 * num_layers(), "residual scheme with {} sites for {} {}s",
                residual_->num_sites(), num_layers(), label_);
  layer_first_block_.push_back(0);
  block_first_input_.push_back(0);
  for (size_t i = 0; i < layers_.size(); ++i) {
    DecoderLayer& layer = layers_[i];
    METRALE_CHECK(layer.mixer != nullptr && layer.ffn != nullptr, "{} {} lacks its mixer or feed-forward", label_, i);
    for (auto& stream_block : layer.stream_blocks) {
      METRALE_CHECK(stream_block != nullptr, "{} {}: empty stream block", label_, i);
      blocks_.push_back(stream_block.get());
    }
    blocks_.push_back(layer.mixer.get());
    block_layer_.resize(blocks_.size(), static_cast<int64_t>(i));
    layer_first_block_.push_back(blocks_.size());
  }
  for (const StatefulBlock* block : blocks_) {
    const size_t inputs = block->step_input_specs().size();
    METRALE_CHECK(inputs == 0 || block->capabilities().needs_prestage,
                  "a block of {} {} reads step inputs but does not declare needs_prestage", label_,
                  block_layer_[block_first_input_.size() - 1]);
    block_first_input_.push_back(block_first_input_.back() + inputs);
    block_has_slots_.push_back(block->cache_spec().has_slots() ? 1 : 0);
  }
}

std::pair<size_t, size_t> LayerStack::layer_blocks(int64_t layer) const {
  METRALE_CHECK(layer >= 0 && layer < num_layers(), "{} {} of {}", label_, layer, num_layers());
  return {layer_first_block_[static_cast<size_t>(layer)], layer_first_block_[static_cast<size_t>(layer) + 1]};
}

std::vector<CacheSpec> LayerStack::cache_specs() const {
  std::vector<CacheSpec> specs;
  specs.reserve(blocks_.size());
  for (const StatefulBlock* block : blocks_) specs.push_back(block->cache_spec());
  return specs;
}

BlockCapabilities LayerStack::capabilities() const {
  BlockCapabilities all;
  for (const StatefulBlock* block : blocks_) {
    const BlockCapabilities one = block->capabilities();
    all.graph_safe = all.graph_safe && one.graph_safe;
    all.needs_prestage = all.needs_prestage || one.needs_prestage;
    all.supports_verify = all.supports_verify && one.supports_verify;
  }
  return all;
}

bool LayerStack::needs_commit() const {
  return std::any_of(block_has_slots_.begin(), block_has_slots_.end(), [](uint8_t slots) { return slots != 0; });
}

double LayerStack::routed_weight_bytes(int64_t rows) const {
  double bytes = 0.0;
  for (const DecoderLayer& layer : layers_) bytes += layer.ffn->routed_weight_bytes(rows);
  return bytes;
}

std::vector<StepInputSpec> LayerStack::step_input_specs() const {
  std::vector<StepInputSpec> specs;
  for (const StatefulBlock* block : blocks_) {
    std::vector<StepInputSpec> own = block->step_input_specs();
    specs.insert(specs.end(), own.begin(), own.end());
  }
  return specs;
}

void LayerStack::prestage(const PrestageRows& rows, std::span<const Tensor> host_inputs) const {
  METRALE_CHECK(host_inputs.size() == block_first_input_.back(), "prestage: {} host inputs for {} step inputs",
                host_inputs.size(), block_first_input_.back());
  for (size_t b = 0; b < blocks_.size(); ++b) {
    const size_t first = block_first_input_[b], count = block_first_input_[b + 1] - first;
    if (count == 0) continue;
    try {
      blocks_[b]->prestage(rows, host_inputs.subspan(first, count));
    } catch (const Error& e) {
      rethrow_with_context(e, "{} {} (prestage)", label_, block_layer_[b]);
    }
  }
}

size_t LayerStack::scratch_bytes(const ForwardBatch& batch, Device device, int64_t first, int64_t last) const {
  size_t bytes = 0;
  for (int64_t i = first; i < last; ++i) {
    const DecoderLayer& layer = layers_.at(static_cast<size_t>(i));
    bytes = std::max(bytes, layer.mixer->scratch_bytes(batch, device));
    for (const auto& stream_block : layer.stream_blocks)
      bytes = std::max(bytes, stream_block->scratch_bytes(batch, device));
  }
  return bytes;
}

std::vector<size_t> LayerStack::verify_scratch_offsets(int64_t num_tokens, int64_t num_seqs, DType activation) const {
  std::vector<size_t> offsets{0};
  offsets.reserve(blocks_.size() + 1);
  for (const StatefulBlock* block : blocks_) {
    size_t bytes = block->verify_scratch_bytes(num_tokens, num_seqs, activation);
    bytes = (bytes + kVerifyRegionAlignment - 1) / kVerifyRegionAlignment * kVerifyRegionAlignment;
    offsets.push_back(offsets.back() + bytes);
  }
  return offsets;
}

StepContext LayerStack::block_step(const StepContext& step, size_t b, std::span<const size_t> verify_offsets,
                                   std::span<const Tensor> step_outputs) const {
  StepContext own = step;
  if (!step_outputs.empty()) own.step_output = step_outputs[b];
  if (!verify_offsets.empty()) {
    own.verify_scratch = step.batch.verify_scratch.slice(0, static_cast<int64_t>(verify_offsets[b]),
                                                         static_cast<int64_t>(verify_offsets[b + 1]));
  }
  const size_t first = block_first_input_[b], count = block_first_input_[b + 1] - first;
  // A commit's batch carries no step inputs (commit reads only its verify scratch): the block sees none.
  if (count == 0 || step.batch.step_inputs.empty()) {
    own.step_inputs = {};
  } else {
    METRALE_CHECK(first + count <= step.batch.step_inputs.size(), "{} step inputs for block {} (needs {})",
                  step.batch.step_inputs.size(), b, first + count);
    own.step_inputs = step.batch.step_inputs.subspan(first, count);
  }
  return own;
}

void LayerStack::check_caches(std::span<const BlockCache> caches) const {
  METRALE_CHECK(caches.size() == blocks_.size(), "{} block caches for the {} stateful blocks of {} {}s", caches.size(),
                blocks_.size(), num_layers(), label_);
}

void LayerStack::run_stream_blocks(const StepContext& step, std::span<const BlockCache> caches,
                                   const ResidualStreams& streams, int64_t layer,
                                   std::span<const size_t> verify_offsets) {
  const size_t first = layer_first_block_[static_cast<size_t>(layer)];
  const auto& stream_blocks = layers_[static_cast<size_t>(layer)].stream_blocks;
  for (size_t j = 0; j < stream_blocks.size(); ++j) {
    const size_t b = first + j;
    stream_blocks[j]->forward(block_step(step, b, verify_offsets), caches[b], streams.streams);
  }
}

void LayerStack::forward(const StepContext& step, std::span<const BlockCache> caches, const ResidualStreams& streams,
                         int64_t first, int64_t last, const Tensor& x, const Tensor& out, const Tensor& hidden,
                         std::span<const size_t> verify_offsets) {
  check_caches(caches);
  METRALE_CHECK(first >= 0 && first < last && last <= num_layers(), "{}s [{}, {}) of {}", label_, first, last,
                num_layers());
  if (block_first_input_.back() > 0 && step.batch.step_inputs.size() != block_first_input_.back()) {
    raise(ErrorCode::kInvalidArgument, "the batch has {} step inputs, the model declares {}",
          step.batch.step_inputs.size(), block_first_input_.back());
  }
  METRALE_CHECK(verify_offsets.empty() || verify_offsets.size() == blocks_.size() + 1,
                "{} verify offsets for {} blocks", verify_offsets.size(), blocks_.size());
  const ResidualScheme& scheme = *residual_;
  // What blocks publish to later blocks of this forward, carved before the per-layer temporaries.
  std::vector<Tensor> step_outputs(blocks_.size());
  for (size_t b = layer_first_block_[static_cast<size_t>(first)]; b < layer_first_block_[static_cast<size_t>(last)];
       ++b) {
    const size_t bytes = blocks_[b]->step_output_bytes(step.batch.num_tokens);
    if (bytes > 0) step_outputs[b] = step.workspace.alloc(DType::kU8, {static_cast<int64_t>(bytes)});
  }
  for (int64_t i = first; i < last; ++i) {
    DecoderLayer& layer = layers_[static_cast<size_t>(i)];
    const Arena::Scope layer_temporaries(step.workspace);
    try {
      // The previous layer's post map fused this layer's first pre map unless stream blocks sit
      // between them.
      if (i == first || !layer.stream_blocks.empty()) {
        run_stream_blocks(step, caches, streams, i, verify_offsets);
        scheme.pre(step, streams, 2 * i, x);
      }
      const size_t mixer_block = layer_first_block_[static_cast<size_t>(i) + 1] - 1;
      layer.mixer->forward(block_step(step, mixer_block, verify_offsets, step_outputs), caches[mixer_block], x, out);
      if (layer.mixer->output_is_partial()) sum_partial_output(step, out);
      scheme.post_pre(step, streams, 2 * i, out, x);
      layer.ffn->forward(step, x, out);
      if (layer.ffn->output_is_partial()) sum_partial_output(step, out);
      if (i + 1 == last) {
        scheme.post_finish(step, streams, 2 * i + 1, out, hidden);
      } else if (layers_[static_cast<size_t>(i) + 1].stream_blocks.empty()) {
        scheme.post_pre(step, streams, 2 * i + 1, out, x);
      } else {
        scheme.post(step, streams, 2 * i + 1, out);
      }
    } catch (const Error& e) {
      rethrow_with_context(e, "{} {}", label_, i);
    }
  }
}

void LayerStack::write_keys(const StepContext& step, std::span<const BlockCache> caches, const ResidualStreams& streams,
                            int64_t layer, const Tensor& x) {
  check_caches(caches);
  const auto [first_block, end_block] = layer_blocks(layer);
  static_cast<void>(first_block);
  try {
    run_stream_blocks(step, caches, streams, layer, {});
    residual_->pre(step, streams, 2 * layer, x);
    const size_t mixer_block = end_block - 1;
    layers_[static_cast<size_t>(layer)].mixer->write_keys(block_step(step, mixer_block, {}), caches[mixer_block], x);
  } catch (const Error& e) {
    rethrow_with_context(e, "{} {} (keys)", label_, layer);
  }
}

void LayerStack::commit(const StepContext& step, std::span<const BlockCache> caches, const VerifyCommit& kept,
                        std::span<const size_t> verify_offsets) {
  check_caches(caches);
  METRALE_CHECK(verify_offsets.size() == blocks_.size() + 1, "{} verify offsets for {} blocks", verify_offsets.size(),
                blocks_.size());
  for (size_t b = 0; b < blocks_.size(); ++b) {
    if (block_has_slots_[b] == 0) continue;  // paged tensors: the engine truncates
    const Arena::Scope block_temporaries(step.workspace);
    try {
      blocks_[b]->commit(block_step(step, b, verify_offsets), caches[b], kept);
    } catch (const Error& e) {
      rethrow_with_context(e, "{} {} (commit)", label_, block_layer_[b]);
    }
  }
}

}  // namespace metrale
