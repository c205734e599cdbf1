// The batch builder (engine/batch_builder.h): every step kind's host arrays from row groups, the
// commit parts of a verify, the fixed layout of the MTP catch-up and chain, MTP key rows, and the
// per-row step inputs a model declares, filled by the prestage hook and uploaded with the step at
// fixed addresses. Expected arrays are written out by hand from the layouts' definitions.
#include "engine/batch_builder.h"

#include <gtest/gtest.h>

#include <vector>

namespace metrale {
namespace {

std::vector<int32_t> ints(const Tensor& tensor) {
  const auto* data = tensor.data_as<const int32_t>();
  return std::vector<int32_t>(data, data + tensor.numel());
}

std::vector<int32_t> ints(std::span<const int32_t> span) { return {span.begin(), span.end()}; }

BatchLimits limits(int64_t rows = 32, int64_t seqs = 4) {
  BatchLimits batch;
  batch.max_rows = rows;
  batch.max_seqs = seqs;
  batch.max_stride = 8;
  batch.block_size = 4;
  batch.max_drafts = 3;
  return batch;
}

// A mixed step: a prefill chunk (prompt positions 2..4 of a 5-token prompt, the last one's logits),
// a verify of one known token and two drafts, and a padding sequence.
TEST(BatchBuilder, MixedVerifyAndPaddingRows) {
  BatchBuilder builder(limits(), Device::cpu());
  const std::vector<int32_t> prompt = {11, 12, 13, 14, 15}, table_a = {7, 3};
  const std::vector<int32_t> known = {21, 22, 23, 24, 25, 26}, drafts = {40, 41}, table_b = {5, 6};
  std::vector<RowGroup> groups(3);
  groups[0].first_position = 2;
  groups[0].rows = groups[0].real_rows = 3;
  groups[0].tokens = std::span<const int32_t>(prompt).subspan(2);
  groups[0].block_table = table_a;
  groups[0].state_slot = 9;
  groups[0].logits_begin = 2;
  groups[0].logits_end = 3;
  groups[1].first_position = 5;
  groups[1].rows = 4;  // one padding row after the two drafts
  groups[1].real_rows = 3;
  groups[1].tokens = std::span<const int32_t>(known).subspan(5);
  groups[1].drafts = drafts;
  groups[1].block_table = table_b;
  groups[1].state_slot = 4;
  groups[1].logits_end = 4;
  groups[2].rows = 2;  // a padding sequence
  groups[2].state_slot = 1;
  groups[2].logits_end = 2;
  BatchBuilder::StepOptions options;
  options.state_slots = true;
  const BatchBuilder::Built built = builder.build_step(groups, options);
  const ForwardBatch& batch = built.batch;
  EXPECT_EQ(batch.num_tokens, 9);
  EXPECT_EQ(batch.num_seqs, 3);
  EXPECT_EQ(batch.max_q_len, 4);
  EXPECT_EQ(batch.max_kv_len, 9);  // the verify: 5 + 4 rows
  EXPECT_EQ(ints(batch.token_ids), (std::vector<int32_t>{13, 14, 15, 26, 40, 41, 0, 0, 0}));
  EXPECT_EQ(ints(batch.positions), (std::vector<int32_t>{2, 3, 4, 5, 6, 7, 5, 0, 0}));
  // Slots through the tables (block size 4): position 2..4 of [7, 3] -> 30, 31, 12; 5..7 of [5, 6] -> 25, 26, 27.
  EXPECT_EQ(ints(batch.slot_mapping), (std::vector<int32_t>{30, 31, 12, 25, 26, 27, -1, -1, -1}));
  EXPECT_EQ(ints(batch.cu_q), (std::vector<int32_t>{0, 3, 7, 9}));
  EXPECT_EQ(ints(batch.kv_lens), (std::vector<int32_t>{5, 9, 2}));
  EXPECT_EQ(ints(batch.logit_rows), (std::vector<int32_t>{2, 3, 4, 5, 6, 7, 8}));
  EXPECT_EQ(ints(batch.state_slots), (std::vector<int32_t>{9, 4, 1}));
  // The verify's padding row reaches position 8: three blocks, the third read as block 0.
  ASSERT_EQ(batch.block_tables.size(1), 3);
  EXPECT_EQ(ints(batch.block_tables), (std::vector<int32_t>{7, 3, 0, 5, 6, 0, 0, 0, 0}));
  EXPECT_EQ(ints(batch.host_cu_q), ints(batch.cu_q));
  EXPECT_EQ(ints(batch.host_kv_lens), ints(batch.kv_lens));
}

TEST(BatchBuilder, FixedStrideAndBoundsForGraphs) {
  BatchBuilder builder(limits(), Device::cpu());
  const std::vector<int32_t> tokens = {5}, table = {2};
  std::vector<RowGroup> groups(2);
  groups[0].first_position = 0;
  groups[0].rows = groups[0].real_rows = 1;
  groups[0].tokens = tokens;
  groups[0].block_table = table;
  groups[0].logits_end = 1;
  groups[1].rows = 1;
  groups[1].logits_end = 1;
  BatchBuilder::StepOptions options;
  options.stride = 8;
  options.max_kv_len = 32;
  const ForwardBatch batch = builder.build_step(groups, options).batch;
  EXPECT_EQ(batch.block_tables.size(1), 8);
  EXPECT_EQ(batch.max_kv_len, 32);
  EXPECT_TRUE(batch.state_slots.empty());
  // The step buffer does not move between steps (what graphs replay).
  const void* tokens_at = batch.token_ids.data();
  EXPECT_EQ(builder.build_step(groups, options).batch.token_ids.data(), tokens_at);
}

TEST(BatchBuilder, RejectsRowsWithoutBlocks) {
  BatchBuilder builder(limits(), Device::cpu());
  const std::vector<int32_t> tokens = {1, 2, 3, 4, 5}, table = {1};
  RowGroup group;
  group.rows = group.real_rows = 5;  // position 4 needs a second block
  group.tokens = tokens;
  group.block_table = table;
  EXPECT_THROW(builder.build_step({&group, 1}, {}), Error);
}

TEST(BatchBuilder, CommitPartsKeepTheAcceptedRows) {
  // Two sequences of a verify: rows [0, 3) and [3, 7), kv 10 and 20, slots 4 and 6; a padding third.
  const std::vector<int32_t> cu_q = {0, 3, 7, 9}, kv_lens = {10, 20, 2}, slots = {4, 6, 0}, kept = {1, 3};
  std::vector<int32_t> cu_parts(7), part_kv(6), part_slots(6);
  fill_commit_parts(cu_q, kv_lens, slots, kept, cu_parts.data(), part_kv.data(), part_slots.data());
  EXPECT_EQ(cu_parts, (std::vector<int32_t>{0, 1, 3, 6, 7, 8, 9}));
  EXPECT_EQ(part_kv, (std::vector<int32_t>{8, 2, 19, 1, 1, 1}));
  EXPECT_EQ(part_slots, (std::vector<int32_t>{4, -1, 6, -1, 0, -1}));
  const std::vector<int32_t> too_many = {4};
  EXPECT_THROW(fill_commit_parts(cu_q, kv_lens, slots, too_many, cu_parts.data(), part_kv.data(), part_slots.data()),
               Error);
}

// The MTP steps after a fixed-layout verify of two sequences with k = 2: the first accepted one
// draft at t = 6 and has room for one chained row; the second finished (padding).
TEST(BatchBuilder, FixedLayoutMtpCatchUpAndChain) {
  BatchBuilder builder(limits(), Device::cpu());
  builder.reserve_fixed(4, 3);
  const FixedLayout layout = builder.fixed_layout(2, 2);
  EXPECT_EQ(builder.fixed_layout(2, 2).catch_up.positions, layout.catch_up.positions);  // one layout per shape
  const std::vector<int32_t> next = {31, 32}, table = {1, 2, 3};
  std::vector<RowGroup> catch_up(2), chain(4);  // drafts = 3: chained steps 1 and 2
  catch_up[0].first_position = 6;
  catch_up[0].rows = 3;
  catch_up[0].real_rows = 2;
  catch_up[0].tokens = next;
  catch_up[0].block_table = table;
  catch_up[0].logits_begin = 1;
  catch_up[0].logits_end = 2;
  catch_up[1].rows = 3;
  catch_up[1].logits_end = 1;
  for (RowGroup& group : chain) {
    group.rows = 1;
    group.logits_end = 1;
  }
  chain[0].first_position = 8;  // step 1, sequence 0: room
  chain[0].real_rows = 1;
  chain[0].block_table = table;
  chain[2].first_position = 7;  // step 2, sequence 0: no room (a padding row at t + a)
  chain[2].block_table = table;
  const int64_t longest = builder.stage_mtp(layout, catch_up, chain);
  EXPECT_EQ(longest, 9);
  const ForwardBatch b0 = builder.mtp_view(layout, 0, longest);
  EXPECT_EQ(b0.num_tokens, 6);
  EXPECT_EQ(ints(b0.token_ids), (std::vector<int32_t>{31, 32, 0, 0, 0, 0}));
  EXPECT_EQ(ints(b0.positions), (std::vector<int32_t>{6, 7, 6, 0, 0, 0}));
  EXPECT_EQ(ints(b0.slot_mapping), (std::vector<int32_t>{10, 11, -1, -1, -1, -1}));
  EXPECT_EQ(ints(b0.cu_q), (std::vector<int32_t>{0, 3, 6}));
  EXPECT_EQ(ints(b0.kv_lens), (std::vector<int32_t>{9, 3}));
  EXPECT_EQ(ints(b0.logit_rows), (std::vector<int32_t>{1, 3}));
  ASSERT_EQ(b0.block_tables.size(1), 8);  // the fixed stride
  EXPECT_EQ(ints(b0.block_tables.slice(0, 0, 1)), (std::vector<int32_t>{1, 2, 3, 0, 0, 0, 0, 0}));
  const ForwardBatch b1 = builder.mtp_view(layout, 1, longest), b2 = builder.mtp_view(layout, 2, longest);
  EXPECT_TRUE(b1.token_ids.empty());  // the previous step's drafts, on the device
  EXPECT_EQ(ints(b1.positions), (std::vector<int32_t>{8, 0}));
  EXPECT_EQ(ints(b1.slot_mapping), (std::vector<int32_t>{12, -1}));
  EXPECT_EQ(ints(b1.kv_lens), (std::vector<int32_t>{9, 1}));
  EXPECT_EQ(ints(b2.positions), (std::vector<int32_t>{7, 0}));
  EXPECT_EQ(ints(b2.slot_mapping), (std::vector<int32_t>{-1, -1}));
  EXPECT_EQ(ints(b2.kv_lens), (std::vector<int32_t>{8, 1}));
  EXPECT_EQ(ints(b2.cu_q), (std::vector<int32_t>{0, 1, 2}));
  EXPECT_EQ(ints(b2.logit_rows), (std::vector<int32_t>{0, 1}));
  EXPECT_EQ(b2.block_tables.data(), b0.block_tables.data());  // shared with the catch-up
}

TEST(BatchBuilder, KeyRowsArePaddedRowsWithoutSequences) {
  BatchBuilder builder(limits(), Device::cpu());
  builder.reserve_key_rows(32);
  const std::vector<int32_t> table = {4, 5}, next = {70, 71};
  std::vector<RowGroup> groups(3);
  for (int i = 0; i < 2; ++i) {
    groups[static_cast<size_t>(i)].first_position = 3 + i;
    groups[static_cast<size_t>(i)].rows = groups[static_cast<size_t>(i)].real_rows = 1;
    groups[static_cast<size_t>(i)].tokens = std::span<const int32_t>(next).subspan(static_cast<size_t>(i), 1);
    groups[static_cast<size_t>(i)].block_table = table;
    groups[static_cast<size_t>(i)].hidden_row = 10 + i;
  }
  groups[2].rows = 2;  // padding to four rows
  const BatchBuilder::Built built = builder.build_key_rows(groups);
  EXPECT_EQ(built.batch.num_tokens, 4);
  EXPECT_EQ(built.batch.num_seqs, 0);
  EXPECT_EQ(ints(built.batch.token_ids), (std::vector<int32_t>{70, 71, 0, 0}));
  EXPECT_EQ(ints(built.batch.positions), (std::vector<int32_t>{3, 4, 0, 0}));
  EXPECT_EQ(ints(built.batch.slot_mapping), (std::vector<int32_t>{19, 20, -1, -1}));
  EXPECT_EQ(ints(built.hidden_rows), (std::vector<int32_t>{10, 11, 0, 0}));
}

// The prestage mechanism driven by a hook in place of a model: it sees the step's host arrays and
// each sequence's history, fills the inputs' host rows, and the step's inputs come back at fixed
// addresses with those contents.
TEST(BatchBuilder, StepInputsArePrestagedBeforeUpload) {
  BatchBuilder builder(limits(), Device::cpu());
  std::vector<PrestageRows> seen;
  std::vector<std::vector<int32_t>> histories;
  builder.set_step_inputs({{"rows", DType::kI32, 2}, {"scale", DType::kF32, 1}},
                          [&](const PrestageRows& rows, std::span<const Tensor> inputs) {
                            ASSERT_EQ(inputs.size(), 2u);
                            ASSERT_EQ(inputs[0].size(0), rows.num_tokens);
                            ASSERT_EQ(inputs[0].size(1), 2);
                            auto* ids = inputs[0].data_as<int32_t>();
                            auto* scale = inputs[1].data_as<float>();
                            for (int64_t t = 0; t < rows.num_tokens; ++t) {
                              ids[2 * t] = rows.token_ids[static_cast<size_t>(t)];
                              ids[2 * t + 1] = rows.positions[static_cast<size_t>(t)];
                              scale[t] = 0.5f * static_cast<float>(t);
                            }
                            seen.push_back(rows);
                            histories.clear();
                            for (const auto& history : rows.history) histories.emplace_back(history.begin(), history.end());
                          });
  const std::vector<int32_t> tokens = {1, 2, 3, 4, 5, 6}, table = {0, 1};
  std::vector<RowGroup> groups(2);
  groups[0].first_position = 4;
  groups[0].rows = groups[0].real_rows = 2;
  groups[0].tokens = std::span<const int32_t>(tokens).subspan(4);
  groups[0].history = std::span<const int32_t>(tokens).first(4);
  groups[0].block_table = table;
  groups[1].rows = 1;  // padding: empty history
  BatchBuilder::StepOptions options;
  options.prestage = true;
  const BatchBuilder::Built built = builder.build_step(groups, options);
  ASSERT_EQ(seen.size(), 1u);
  EXPECT_EQ(seen[0].num_tokens, 3);
  EXPECT_EQ(seen[0].num_seqs, 2);
  EXPECT_EQ(ints(seen[0].cu_q), (std::vector<int32_t>{0, 2, 3}));
  ASSERT_EQ(histories.size(), 2u);
  EXPECT_EQ(histories[0], (std::vector<int32_t>{1, 2, 3, 4}));
  EXPECT_TRUE(histories[1].empty());
  ASSERT_EQ(built.step_inputs.size(), 2u);
  EXPECT_EQ(ints(built.step_inputs[0]), (std::vector<int32_t>{5, 4, 6, 5, 0, 0}));
  EXPECT_FLOAT_EQ(built.step_inputs[1].data_as<const float>()[2], 1.0f);
  // Fixed addresses; steps that are not trunk steps (eager MTP) are not prestaged.
  const void* at = built.step_inputs[0].data();
  EXPECT_EQ(builder.build_step(groups, options).step_inputs[0].data(), at);
  EXPECT_EQ(seen.size(), 2u);
  options.prestage = false;
  EXPECT_TRUE(builder.build_step(groups, options).step_inputs.empty());
  EXPECT_EQ(seen.size(), 2u);
}

}  // namespace
}  // namespace metrale
