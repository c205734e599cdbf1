// A tiny qwen3 DecoderModel assembled block by block from a checkpoint, the way arch/qwen3.cpp
// assembles it, but with the residual scheme and the stream blocks a test chooses: the proof that a
// new scheme or stream block needs no change to the mixers and feed-forwards.
#pragma once

#include <filesystem>
#include <functional>
#include <memory>
#include <vector>

#include "model/blocks/layer.h"
#include "model/blocks/pre_norm.h"
#include "model/model.h"

namespace metrale::testing {

struct HandBuiltOptions {
  // The residual scheme, made from the checkpoint's pre-norm residual (its site norms and final
  // norm); empty: the pre-norm residual itself.
  std::function<std::unique_ptr<ResidualScheme>(std::unique_ptr<PreNormResidual>)> residual;
  // The stream blocks of layer `layer` (run before its first site); empty: none.
  std::function<std::vector<std::unique_ptr<StreamBlock>>(int64_t layer)> stream_blocks;
};

// `dir` holds a qwen3 checkpoint without sliding-window layers (tests/common/tiny_checkpoint.h).
std::unique_ptr<Model> build_qwen3_by_hand(const std::filesystem::path& dir, const HandBuiltOptions& options = {});

}  // namespace metrale::testing
