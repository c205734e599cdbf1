#include "engine/tensor_parallel_model.h"

#include <fmt/format.h>

#include "cache/cache_manager.h"
#include "core/error.h"
#include "core/log.h"
#include "runtime/buffer.h"
#include "runtime/stream.h"

#if METRALE_WITH_NCCL
#include "runtime/cuda/nccl_group.h"
#endif

namespace metrale {
namespace {

// The ranks' group for `devices`: all CPU (threads), or distinct GPUs (NCCL).
struct Group {
  std::unique_ptr<InProcessGroup> cpu;
  std::shared_ptr<void> gpu;
  std::vector<Communicator*> communicators;
};

Group make_group(const std::vector<Device>& devices) {
  if (devices.empty()) raise(ErrorCode::kInvalidArgument, "tensor parallelism needs at least one device");
  Group group;
  const auto size = static_cast<int>(devices.size());
  if (devices.front().is_cpu()) {
    for (const Device& device : devices) {
      if (!device.is_cpu())
        raise(ErrorCode::kInvalidArgument, "tensor-parallel ranks on {} and {}", devices.front().to_string(),
              device.to_string());
    }
    group.cpu = std::make_unique<InProcessGroup>(size);
    for (int r = 0; r < size; ++r) group.communicators.push_back(&group.cpu->communicator(r));
    return group;
  }
#if METRALE_WITH_NCCL
  std::vector<int> indices;
  for (const Device& device : devices) {
    if (!device.is_cuda())
      raise(ErrorCode::kInvalidArgument, "tensor-parallel ranks on a GPU and {}", device.to_string());
    for (const int seen : indices)
      if (seen == device.index)
        raise(ErrorCode::kInvalidArgument, "two tensor-parallel ranks on {}", device.to_string());
    indices.push_back(device.index);
  }
  auto nccl = std::make_shared<NcclGroup>(indices);
  for (int r = 0; r < size; ++r) group.communicators.push_back(&nccl->communicator(r));
  group.gpu = nccl;
  return group;
#else
  raise(ErrorCode::kUnsupported, "tensor parallelism over GPUs: this build has no NCCL (nccl.h was not found)");
#endif
}

// `source` [..] on `device`, in `arena` (or `source` itself when it is there already or empty).
Tensor on_device(const Tensor& source, Device device, Arena& arena) {
  if (source.empty() || source.device() == device) return source;
  METRALE_CHECK(source.is_contiguous(), "tensor parallelism: a batch tensor {} is not contiguous", source.describe());
  const Tensor copy = arena.alloc(source.dtype(), source.shape());
  copy_bytes_async(copy.data(), device, source.data(), source.device(), source.nbytes());
  return copy;
}

}  // namespace

std::unique_ptr<TensorParallelModel> TensorParallelModel::build(
    std::vector<Device> devices, const LoadOptions& options,
    const std::function<std::unique_ptr<Model>(Device, const LoadOptions&)>& make_rank) {
  Group group = make_group(devices);
  std::vector<std::unique_ptr<Model>> models;
  for (size_t r = 0; r < devices.size(); ++r) {
    LoadOptions rank = options;
    rank.tensor_parallel = {static_cast<int>(r), static_cast<int>(devices.size()),
                            devices.size() > 1 ? group.communicators[r] : nullptr};
    set_current_device(devices[r]);
    models.push_back(make_rank(devices[r], rank));
  }
  set_current_device(devices.front());
  auto model = std::unique_ptr<TensorParallelModel>(
      new TensorParallelModel(std::move(models), std::move(devices), std::move(group.cpu), std::move(group.gpu)));
  model->communicators_ = std::move(group.communicators);
  return model;
}

std::unique_ptr<TensorParallelModel> TensorParallelModel::load(const std::filesystem::path& dir,
                                                               std::vector<Device> devices,
                                                               const LoadOptions& options) {
  return build(std::move(devices), options,
               [&](Device device, const LoadOptions& rank) { return load_model(dir, device, rank); });
}

std::unique_ptr<TensorParallelModel> TensorParallelModel::random(const ModelConfig& config, std::vector<Device> devices,
                                                                 uint64_t seed, const LoadOptions& options) {
  return build(std::move(devices), options,
               [&](Device device, const LoadOptions& rank) { return make_random_model(config, device, seed, rank); });
}

TensorParallelModel::TensorParallelModel(std::vector<std::unique_ptr<Model>> models, std::vector<Device> devices,
                                         std::unique_ptr<InProcessGroup> cpu_group, std::shared_ptr<void> gpu_group)
    : devices_(std::move(devices)), cpu_group_(std::move(cpu_group)), gpu_group_(std::move(gpu_group)) {
  const std::vector<CacheSpec> specs = models.front()->cache_specs(), mtp_specs = models.front()->mtp_cache_specs();
  const auto same_specs = [](const std::vector<CacheSpec>& a, const std::vector<CacheSpec>& b) {
    if (a.size() != b.size()) return false;
    for (size_t i = 0; i < a.size(); ++i) {
      if (a[i].tensors.size() != b[i].tensors.size()) return false;
      for (size_t j = 0; j < a[i].tensors.size(); ++j) {
        const CacheTensorSpec &x = a[i].tensors[j], &y = b[i].tensors[j];
        if (x.name != y.name || x.indexing != y.indexing || x.shape != y.shape || x.dtype != y.dtype ||
            x.group_size != y.group_size)
          return false;
      }
    }
    return true;
  };
  for (size_t r = 0; r < models.size(); ++r) {
    if (!same_specs(models[r]->cache_specs(), specs) || !same_specs(models[r]->mtp_cache_specs(), mtp_specs)) {
      raise(ErrorCode::kUnsupported,
            "tensor parallelism: rank {} declares other cache shapes than rank 0 (the ranks share one cache layout)",
            r);
    }
    auto rank = std::make_unique<Rank>();
    rank->model = std::move(models[r]);
    rank->device = devices_[r];
    ranks_.push_back(std::move(rank));
  }
  for (size_t r = 1; r < ranks_.size(); ++r) {
    Rank& rank = *ranks_[r];
    rank.workspace = std::make_unique<Arena>(rank.device, size_t{1} << 20);
    rank.thread = std::thread([this, &rank] { worker_loop(rank); });
  }
  METRALE_LOG_INFO("tensor parallelism: {} ranks on {}", ranks_.size(),
                   fmt::join(
                       [&] {
                         std::vector<std::string> names;
                         for (const Device& device : devices_) names.push_back(device.to_string());
                         return names;
                       }(),
                       ", "));
}

TensorParallelModel::~TensorParallelModel() {
  {
    const std::lock_guard lock(mutex_);
    for (auto& rank : ranks_) rank->stop = true;
  }
  changed_.notify_all();
  for (auto& rank : ranks_)
    if (rank->thread.joinable()) rank->thread.join();
}

void TensorParallelModel::worker_loop(Rank& rank) {
  set_current_device(rank.device);
  std::unique_lock lock(mutex_);
  while (true) {
    changed_.wait(lock, [&] { return rank.stop || !rank.done; });
    if (rank.stop) return;
    std::function<void()> task = std::move(rank.task);
    lock.unlock();
    std::exception_ptr error;
    try {
      task();
    } catch (...) {
      error = std::current_exception();
    }
    lock.lock();
    rank.error = error;
    rank.done = true;
    changed_.notify_all();
  }
}

void TensorParallelModel::bind_caches(const CacheManager* cache) {
  if (cache != nullptr && cache->num_ranks() != size()) {
    raise(ErrorCode::kInvalidArgument, "a cache of {} ranks for a model of {}", cache->num_ranks(), size());
  }
  cache_ = cache;
}

ModelCapabilities TensorParallelModel::capabilities() const {
  ModelCapabilities capabilities = rank0().capabilities();
  if (size() > 1) capabilities.graph_safe = false;
  return capabilities;
}

ModelCaches TensorParallelModel::rank_caches(int r, const ModelCaches& caches) {
  Rank& rank = *ranks_[static_cast<size_t>(r)];
  const bool bound = cache_ != nullptr && !caches.blocks.empty() && !cache_->block_caches().empty() &&
                     caches.blocks.data() == cache_->block_caches().data();
  const bool no_blocks = caches.blocks.empty() && caches.mtp.empty();
  if (bound) {
    // The engine's cache holds the trunk's caches and then the MTP layers' for every rank.
    const std::span<const BlockCache> all = cache_->block_caches(r);
    const size_t trunk = caches.blocks.size();
    return {all.first(trunk), all.subspan(trunk, std::min(caches.mtp.size(), all.size() - trunk))};
  }
  if (no_blocks) return {};
  // A scratch cache (the workspace plan's largest step): this rank gets zeroed copies of its shapes.
  rank.scratch_caches.clear();
  rank.scratch_blocks.assign(caches.blocks.size(), {});
  rank.scratch_mtp.assign(caches.mtp.size(), {});
  const auto mirror = [&](std::span<const BlockCache> from, std::vector<BlockCache>& to) {
    for (size_t i = 0; i < from.size(); ++i) {
      for (const Tensor& tensor : from[i].tensors) {
        rank.scratch_caches.emplace_back(tensor.dtype(), tensor.shape(), rank.device);
        rank.scratch_caches.back().buffer.zero();
        to[i].tensors.push_back(rank.scratch_caches.back().tensor);
      }
    }
  };
  mirror(caches.blocks, rank.scratch_blocks);
  mirror(caches.mtp, rank.scratch_mtp);
  return {rank.scratch_blocks, rank.scratch_mtp};
}

TensorParallelModel::RankCall TensorParallelModel::rank_call(int r, const ForwardBatch& batch,
                                                             const ModelCaches& caches) {
  Rank& rank = *ranks_[static_cast<size_t>(r)];
  rank.workspace->reset();
  RankCall call{batch, rank_caches(r, caches)};
  ForwardBatch& own = call.batch;
  Arena& arena = *rank.workspace;
  for (Tensor* tensor : {&own.token_ids, &own.positions, &own.cu_q, &own.kv_lens, &own.block_tables, &own.slot_mapping,
                         &own.logit_rows, &own.state_slots}) {
    *tensor = on_device(*tensor, rank.device, arena);
  }
  if (!batch.step_inputs.empty()) {
    rank.step_inputs.clear();
    for (const Tensor& input : batch.step_inputs) rank.step_inputs.push_back(on_device(input, rank.device, arena));
    own.step_inputs = rank.step_inputs;
  }
  // Outputs of its own: the final hidden states and, on a verify step, the scratch its commit reads.
  if (!batch.hidden_out.empty()) own.hidden_out = arena.alloc(batch.hidden_out.dtype(), batch.hidden_out.shape());
  if (!batch.verify_scratch.empty()) {
    const size_t bytes = std::max<size_t>(rank.model->verify_scratch_bytes(batch.num_tokens, batch.num_seqs), 1);
    if (rank.verify_scratch_bytes < bytes) {
      rank.verify_scratch = OwnedTensor(DType::kU8, {static_cast<int64_t>(bytes)}, rank.device);
      rank.verify_scratch_bytes = bytes;
    }
    own.verify_scratch = *rank.verify_scratch;
  }
  return call;
}

void TensorParallelModel::on_every_rank(const ForwardBatch& batch, const ModelCaches& caches,
                                        const std::function<void(int, Model&, const RankCall&)>& call) {
  if (size() == 1) {
    call(0, *ranks_.front()->model, RankCall{batch, caches});
    return;
  }
  // The other ranks copy what rank 0's stream wrote (the batch's uploads) only once it is there.
  if (devices_.front().is_cuda()) synchronize(devices_.front());
  {
    const std::lock_guard lock(mutex_);
    for (int r = 1; r < size(); ++r) {
      Rank& rank = *ranks_[static_cast<size_t>(r)];
      rank.task = [this, r, &batch, &caches, &call, &rank] {
        const RankCall own = rank_call(r, batch, caches);
        call(r, *rank.model, own);
        synchronize(rank.device);
      };
      rank.error = nullptr;
      rank.done = false;
    }
  }
  changed_.notify_all();
  std::exception_ptr first_error;
  try {
    call(0, *ranks_.front()->model, RankCall{batch, caches});
  } catch (const std::exception& error) {
    first_error = std::current_exception();
    communicators_.front()->abort(error.what());
  }
  std::unique_lock lock(mutex_);
  changed_.wait(lock, [&] {
    for (size_t r = 1; r < ranks_.size(); ++r)
      if (!ranks_[r]->done) return false;
    return true;
  });
  for (size_t r = 1; r < ranks_.size() && !first_error; ++r) first_error = ranks_[r]->error;
  lock.unlock();
  if (first_error) {
    try {
      std::rethrow_exception(first_error);
    } catch (const std::exception& error) {
      communicators_.front()->abort(error.what());  // the group cannot be trusted after a failed rank
      throw;
    }
  }
}

void TensorParallelModel::forward(const ForwardBatch& batch, const ModelCaches& caches, const Tensor& logits,
                                  Arena& workspace) {
  on_every_rank(batch, caches, [&](int r, Model& model, const RankCall& own) {
    if (r == 0) {
      model.forward(own.batch, own.caches, logits, workspace);
    } else {
      Rank& rank = *ranks_[static_cast<size_t>(r)];
      const Tensor rank_logits = rank.workspace->alloc(logits.dtype(), logits.shape());
      model.forward(own.batch, own.caches, rank_logits, *rank.workspace);
    }
  });
}

void TensorParallelModel::commit_verified(const ForwardBatch& batch, std::span<const int32_t> kept_rows,
                                          const ModelCaches& caches, Arena& workspace) {
  on_every_rank(batch, caches, [&](int r, Model& model, const RankCall& own) {
    model.commit_verified(own.batch, kept_rows, own.caches,
                          r == 0 ? workspace : *ranks_[static_cast<size_t>(r)]->workspace);
  });
}

void TensorParallelModel::commit_kept_rows(const ForwardBatch& batch, const VerifyCommit& kept,
                                           const ModelCaches& caches, Arena& workspace) {
  on_every_rank(batch, caches, [&](int r, Model& model, const RankCall& own) {
    if (r == 0) {
      model.commit_kept_rows(own.batch, kept, own.caches, workspace);
      return;
    }
    Rank& rank = *ranks_[static_cast<size_t>(r)];
    VerifyCommit copy = kept;
    copy.cu_parts = on_device(kept.cu_parts, rank.device, *rank.workspace);
    copy.kv_lens = on_device(kept.kv_lens, rank.device, *rank.workspace);
    copy.slots = on_device(kept.slots, rank.device, *rank.workspace);
    model.commit_kept_rows(own.batch, copy, own.caches, *rank.workspace);
  });
}

void TensorParallelModel::mtp_forward(const ForwardBatch& batch, const ModelCaches& caches, const Tensor& hidden,
                                      const Tensor& logits, Arena& workspace, int64_t mtp_layer) {
  on_every_rank(batch, caches, [&](int r, Model& model, const RankCall& own) {
    if (r == 0) {
      model.mtp_forward(own.batch, own.caches, hidden, logits, workspace, mtp_layer);
      return;
    }
    Rank& rank = *ranks_[static_cast<size_t>(r)];
    const Tensor rank_hidden = on_device(hidden, rank.device, *rank.workspace);
    const Tensor rank_logits = rank.workspace->alloc(logits.dtype(), logits.shape());
    model.mtp_forward(own.batch, own.caches, rank_hidden, rank_logits, *rank.workspace, mtp_layer);
  });
}

void TensorParallelModel::mtp_write_keys(const ForwardBatch& batch, const ModelCaches& caches, const Tensor& hidden,
                                         Arena& workspace, int64_t mtp_layer) {
  on_every_rank(batch, caches, [&](int r, Model& model, const RankCall& own) {
    if (r == 0) {
      model.mtp_write_keys(own.batch, own.caches, hidden, workspace, mtp_layer);
      return;
    }
    Rank& rank = *ranks_[static_cast<size_t>(r)];
    model.mtp_write_keys(own.batch, own.caches, on_device(hidden, rank.device, *rank.workspace), *rank.workspace,
                         mtp_layer);
  });
}

}  // namespace metrale
