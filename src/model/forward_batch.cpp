#include "model/forward_batch.h"

#include <algorithm>

#include "core/error.h"

namespace metrale {

int64_t fill_commit_parts(std::span<const int32_t> cu_q, std::span<const int32_t> kv_lens,
                          std::span<const int32_t> state_slots, std::span<const int32_t> kept, int32_t* cu_parts,
                          int32_t* part_kv_lens, int32_t* part_slots) {
  METRALE_CHECK(!cu_q.empty() && kv_lens.size() + 1 == cu_q.size() && kept.size() <= kv_lens.size() &&
                    (state_slots.empty() || state_slots.size() == kv_lens.size()),
                "commit: cu_q [{}], kv_lens [{}], state slots [{}], kept [{}]", cu_q.size(), kv_lens.size(),
                state_slots.size(), kept.size());
  const size_t seqs = kv_lens.size();
  int64_t max_rows = 0;
  cu_parts[0] = 0;
  for (size_t s = 0; s < seqs; ++s) {
    const int32_t begin = cu_q[s], q_len = cu_q[s + 1] - begin;
    const int32_t keep = s < kept.size() ? kept[s] : 1;
    if (keep < 1 || keep > q_len) {
      raise(ErrorCode::kInvalidArgument, "commit: sequence {} keeps {} of its {} rows (1..{} allowed)", s, keep, q_len,
            q_len);
    }
    cu_parts[2 * s + 1] = begin + keep;
    cu_parts[2 * s + 2] = begin + q_len;
    part_kv_lens[2 * s] = kv_lens[s] - q_len + keep;
    part_kv_lens[2 * s + 1] = q_len - keep;
    part_slots[2 * s] = state_slots.empty() ? 0 : state_slots[s];
    part_slots[2 * s + 1] = -1;
    max_rows = std::max<int64_t>(max_rows, q_len);
  }
  return max_rows;
}

}  // namespace metrale
