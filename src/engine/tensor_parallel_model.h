// TensorParallelModel: the model of an engine whose tensor-parallel ranks are threads of this
// process, one per device (model/tensor_parallel.h says what each rank holds). The engine sees one
// Model and keeps one scheduler, one batch builder and one CacheManager whose tensors exist once per
// rank (CacheManager's rank devices); every Model call runs on every rank with the same batch:
// rank 0 on the caller's thread with the caller's tensors, ranks 1.. on their own threads with their
// own caches (bind_caches), workspace, outputs and, on other devices, copies of the batch's device
// tensors. Rank 0's logits and hidden states are the step's result (every rank computes the same).
//
// Why threads of one process: one scheduler and one cache book-keeping serve every rank without a
// second copy of the engine's state to keep in step, the CPU tests run the same code with ranks as
// threads (InProcessGroup), and NCCL's single-process initialisation (ncclCommInitAll) needs no
// rendezvous.
//
// A rank that fails aborts the group (every rank's collectives raise instead of waiting) and the
// call rethrows its error; the group is then unusable, so the engine reports the step failed and
// the process should end (its /health says so).
//
// Steps run eagerly: the wrapper declares graph_safe = false at more than one rank (capturing every
// rank's stream in graphs of their own is not built yet).
#pragma once

#include <condition_variable>
#include <exception>
#include <filesystem>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "model/model.h"
#include "model/registry.h"
#include "runtime/arena.h"
#include "runtime/communicator.h"

namespace metrale {

class CacheManager;

class TensorParallelModel final : public Model {
 public:
  // Loads `dir` once per device (rank r on devices[r]: all CPU, with an in-process group, or
  // distinct GPUs, with an NCCL group) with `options` (its tensor_parallel is set per rank).
  static std::unique_ptr<TensorParallelModel> load(const std::filesystem::path& dir, std::vector<Device> devices,
                                                   const LoadOptions& options = {});
  // The same from random weights (benchmarks).
  static std::unique_ptr<TensorParallelModel> random(const ModelConfig& config, std::vector<Device> devices,
                                                     uint64_t seed, const LoadOptions& options = {});
  ~TensorParallelModel() override;

  int size() const { return static_cast<int>(ranks_.size()); }
  const std::vector<Device>& devices() const { return devices_; }
  Model& rank(int r) { return *ranks_.at(static_cast<size_t>(r))->model; }
  // The engine's cache (rank devices = devices()): rank r reads cache->block_caches(r). Calls whose
  // caches are not the bound cache's rank 0 (a scratch cache) give the other ranks scratch copies of
  // the same shapes.
  void bind_caches(const CacheManager* cache);

  const ModelConfig& config() const override { return rank0().config(); }
  Device device() const override { return devices_.front(); }
  DType activation_dtype() const override { return rank0().activation_dtype(); }
  ModelCapabilities capabilities() const override;
  std::vector<CacheSpec> cache_specs() const override { return rank0().cache_specs(); }
  std::vector<StepInputSpec> step_input_specs() const override { return rank0().step_input_specs(); }
  void prestage(const PrestageRows& rows, std::span<const Tensor> host_inputs) const override {
    rank0().prestage(rows, host_inputs);
  }
  void forward(const ForwardBatch& batch, const ModelCaches& caches, const Tensor& logits, Arena& workspace) override;
  double routed_weight_bytes(int64_t rows) const override { return rank0().routed_weight_bytes(rows); }
  size_t verify_scratch_bytes(int64_t num_tokens, int64_t num_seqs) const override {
    return rank0().verify_scratch_bytes(num_tokens, num_seqs);
  }
  void commit_verified(const ForwardBatch& batch, std::span<const int32_t> kept_rows, const ModelCaches& caches,
                       Arena& workspace) override;
  void commit_kept_rows(const ForwardBatch& batch, const VerifyCommit& kept, const ModelCaches& caches,
                        Arena& workspace) override;
  bool has_mtp() const override { return rank0().has_mtp(); }
  int64_t num_mtp_layers() const override { return rank0().num_mtp_layers(); }
  std::vector<CacheSpec> mtp_cache_specs() const override { return rank0().mtp_cache_specs(); }
  void mtp_forward(const ForwardBatch& batch, const ModelCaches& caches, const Tensor& hidden, const Tensor& logits,
                   Arena& workspace, int64_t mtp_layer) override;
  void mtp_write_keys(const ForwardBatch& batch, const ModelCaches& caches, const Tensor& hidden, Arena& workspace,
                      int64_t mtp_layer) override;

 private:
  // What rank r >= 1 keeps: its thread, workspace, outputs and verify scratch (which lives from a
  // verify forward to its commit).
  struct Rank {
    std::unique_ptr<Model> model;
    Device device;
    std::unique_ptr<Arena> workspace;
    OwnedTensor verify_scratch;
    size_t verify_scratch_bytes = 0;
    std::vector<Tensor> step_inputs;          // this call's step inputs on the rank's device
    std::vector<OwnedTensor> scratch_caches;  // a scratch call's caches of this rank
    std::vector<BlockCache> scratch_blocks, scratch_mtp;
    // The worker: runs `task` when one is posted, stores what it threw.
    std::thread thread;
    std::function<void()> task;
    std::exception_ptr error;
    bool done = true, stop = false;
  };
  // A rank's view of one call: its batch (device tensors on its device) and its caches.
  struct RankCall {
    ForwardBatch batch;
    ModelCaches caches;
  };

  TensorParallelModel(std::vector<std::unique_ptr<Model>> models, std::vector<Device> devices,
                      std::unique_ptr<InProcessGroup> cpu_group, std::shared_ptr<void> gpu_group);
  // Builds every rank with make_rank(its device, options with its TensorParallel) in its group.
  static std::unique_ptr<TensorParallelModel> build(
      std::vector<Device> devices, const LoadOptions& options,
      const std::function<std::unique_ptr<Model>(Device, const LoadOptions&)>& make_rank);
  const Model& rank0() const { return *ranks_.front()->model; }
  // Runs `call(r, rank model, its view)` on every rank at once (rank 0 here, the others on their
  // threads) and waits for all; the first error aborts the group and is rethrown.
  void on_every_rank(const ForwardBatch& batch, const ModelCaches& caches,
                     const std::function<void(int, Model&, const RankCall&)>& call);
  // Rank r's view of the batch and caches (r >= 1): device tensors copied to its device when it
  // has another, outputs of its own.
  RankCall rank_call(int r, const ForwardBatch& batch, const ModelCaches& caches);
  ModelCaches rank_caches(int r, const ModelCaches& caches);
  void worker_loop(Rank& rank);

  std::vector<Device> devices_;
  std::vector<std::unique_ptr<Rank>> ranks_;
  std::unique_ptr<InProcessGroup> cpu_group_;  // CPU ranks
  std::shared_ptr<void> gpu_group_;            // GPU ranks: the NcclGroup (runtime/cuda/nccl_group.h)
  std::vector<Communicator*> communicators_;   // per rank
  const CacheManager* cache_ = nullptr;
  std::mutex mutex_;
  std::condition_variable changed_;
};

}  // namespace metrale
