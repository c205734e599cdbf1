#include "cache/host_tier.h"

#include <xxhash.h>

#include <algorithm>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "core/checked_math.h"
#include "core/error.h"
#include "runtime/stream.h"

namespace metrale {

std::byte* HostTier::Area::data() const {
  return static_cast<std::byte*>(pinned.data() != nullptr ? pinned.data() : plain.data());
}

HostTier::HostTier(Device device, std::vector<size_t> block_bytes, std::vector<size_t> slot_bytes, int32_t num_blocks,
                   int32_t num_slots)
    : HostTier(std::span<const Device>(&device, 1), std::move(block_bytes), std::move(slot_bytes), num_blocks,
               num_slots) {}

HostTier::HostTier(std::span<const Device> devices, std::vector<size_t> block_bytes, std::vector<size_t> slot_bytes,
                   int32_t num_blocks, int32_t num_slots)
    : device_(devices.empty() ? Device::cpu() : devices.front()),
      devices_(devices.begin(), devices.end()),
      blocks_(std::max(num_blocks, 0)),
      slots_(0, std::max(num_slots, 0)) {
  if (num_blocks < 0 || num_slots < 0)
    raise(ErrorCode::kInvalidArgument, "negative host tier size ({} blocks, {} slots)", num_blocks, num_slots);
  const auto allocate = [&](std::span<const size_t> unit_bytes, int32_t count, std::vector<Area>& areas) {
    areas.resize(unit_bytes.size());
    for (size_t i = 0; i < unit_bytes.size(); ++i) {
      Area& area = areas[i];
      area.unit_bytes = unit_bytes[i];
      const size_t bytes = checked_mul<size_t>(unit_bytes[i], static_cast<size_t>(count), "host tier bytes",
                                               ErrorCode::kOutOfMemory);
      if (bytes == 0) continue;
      if (device_.is_cuda()) {
        area.pinned = PinnedBuffer(bytes);
      } else {
        area.plain = Buffer(Device::cpu(), bytes);
      }
    }
  };
  allocate(block_bytes, num_blocks, block_areas_);
  allocate(slot_bytes, num_slots, slot_areas_);
  block_seals_.checksum.assign(static_cast<size_t>(std::max(num_blocks, 0)), 0);
  block_seals_.sealed.assign(static_cast<size_t>(std::max(num_blocks, 0)), 0);
  slot_seals_.checksum.assign(static_cast<size_t>(std::max(num_slots, 0)), 0);
  slot_seals_.sealed.assign(static_cast<size_t>(std::max(num_slots, 0)), 0);
}

uint64_t HostTier::memory_bytes() const {
  uint64_t bytes = 0;
  for (const Area& area : block_areas_) bytes += area.unit_bytes * static_cast<uint64_t>(num_blocks());
  for (const Area& area : slot_areas_) bytes += area.unit_bytes * static_cast<uint64_t>(num_slots());
  return bytes;
}

std::byte* HostTier::device_unit(const Tensor& tensor, const Area& area, int32_t device_index) {
  METRALE_CHECK(device_index >= 0 && device_index < tensor.size(0), "device index {} outside [0, {})", device_index,
                tensor.size(0));
  METRALE_CHECK(tensor.nbytes() == area.unit_bytes * static_cast<size_t>(tensor.size(0)),
                "host area holds units of {} bytes, the device tensor {}", area.unit_bytes, tensor.describe());
  return static_cast<std::byte*>(tensor.data()) + static_cast<size_t>(device_index) * area.unit_bytes;
}

void HostTier::copy_unit(std::span<const OwnedTensor> device_tensors, std::vector<Area>& areas, int32_t device_index,
                         int32_t host_index, bool to_host) {
  METRALE_CHECK(device_tensors.size() == areas.size(), "{} device tensors for {} host areas", device_tensors.size(),
                areas.size());
  // One batch per device for the unit's segments (one per layer and cache tensor: a copy call each
  // made evicting a Qwen3-8B block 72 calls); with tensor parallelism each rank's tensors sit on
  // their own GPU, and their copies queue on that GPU's stream.
  std::vector<std::pair<Device, std::vector<CopySegment>>> batches;
  for (size_t i = 0; i < areas.size(); ++i) {
    const Tensor& tensor = device_tensors[i].tensor;
    const Area& area = areas[i];
    std::byte* on_device = device_unit(tensor, area, device_index);
    std::byte* host_unit = area.data() + static_cast<size_t>(host_index) * area.unit_bytes;
    auto batch = std::find_if(batches.begin(), batches.end(), [&](const auto& b) { return b.first == tensor.device(); });
    if (batch == batches.end()) batch = batches.insert(batches.end(), {tensor.device(), {}});
    if (to_host) {
      batch->second.push_back({host_unit, on_device, area.unit_bytes});
    } else {
      batch->second.push_back({on_device, host_unit, area.unit_bytes});
    }
  }
  for (const auto& [device, segments] : batches) copy_segments_async(device, segments);
}

void HostTier::enable_staging(std::span<const OwnedTensor> paged, int32_t num_staging) {
  METRALE_CHECK(paged.size() == block_areas_.size(), "{} paged tensors for {} host areas", paged.size(),
                block_areas_.size());
  lanes_.clear();
  if (!device_.is_cuda() || num_staging <= 0 || num_blocks() == 0) return;
  for (const Device& device : devices_) {
    Lane lane;
    lane.device = device;
    lane.num_slots = num_staging;
    lane.area_offset.assign(block_areas_.size(), std::string::npos);
    for (size_t i = 0; i < paged.size(); ++i) {
      if (paged[i].tensor.device() != device || block_areas_[i].unit_bytes == 0) continue;
      lane.area_offset[i] = lane.unit_bytes;
      lane.unit_bytes += block_areas_[i].unit_bytes;
    }
    if (lane.unit_bytes == 0) continue;
    lane.staging = Buffer(device, checked_mul<size_t>(lane.unit_bytes, static_cast<size_t>(num_staging),
                                                      "host tier staging bytes", ErrorCode::kOutOfMemory));
    lane.slot_ticket.assign(static_cast<size_t>(num_staging), 0);
    lane.lane = CopyLane(device);
    lanes_.push_back(std::move(lane));
  }
  block_seals_.ticket.assign(static_cast<size_t>(num_blocks()) * lanes_.size(), 0);
}

void HostTier::store_block_staged(std::span<const OwnedTensor> paged, int32_t block, int32_t host_block) {
  for (size_t l = 0; l < lanes_.size(); ++l) {
    Lane& lane = lanes_[l];
    const int32_t slot = lane.next_slot;
    lane.next_slot = (slot + 1) % lane.num_slots;
    lane.lane.hold_current_until(lane.slot_ticket[static_cast<size_t>(slot)]);  // its last copy out has run
    std::byte* unit = static_cast<std::byte*>(lane.staging.data()) + static_cast<size_t>(slot) * lane.unit_bytes;
    std::vector<CopySegment> in, out;
    for (size_t i = 0; i < block_areas_.size(); ++i) {
      if (lane.area_offset[i] == std::string::npos) continue;
      const Area& area = block_areas_[i];
      in.push_back({unit + lane.area_offset[i], device_unit(paged[i].tensor, area, block), area.unit_bytes});
      out.push_back({area.data() + static_cast<size_t>(host_block) * area.unit_bytes, unit + lane.area_offset[i],
                     area.unit_bytes});
    }
    copy_segments_async(lane.device, in);  // on the current stream: the forward may overwrite the block after it
    const CopyLane::Ticket ticket = lane.lane.copy_after_current(out);
    lane.slot_ticket[static_cast<size_t>(slot)] = ticket;
    ticket_of(block_seals_, host_block, l) = ticket;
  }
}

bool HostTier::lanes_done(const Seals& seals, int32_t host_index) {
  if (seals.ticket.empty()) return true;
  for (size_t l = 0; l < lanes_.size(); ++l)
    if (!lanes_[l].lane.done(ticket_of(seals, host_index, l))) return false;
  return true;
}

void HostTier::store_block(std::span<const OwnedTensor> paged, int32_t block, int32_t host_block) {
  METRALE_CHECK(host_block >= 0 && host_block < num_blocks() && blocks_.ref_count(host_block) > 0,
                "host block {} is not allocated", host_block);
  if (lanes_.empty()) {
    copy_unit(paged, block_areas_, block, host_block, true);
  } else {
    store_block_staged(paged, block, host_block);
  }
  mark_stored(block_seals_, block_areas_, host_block);
}

void HostTier::load_block(std::span<const OwnedTensor> paged, int32_t host_block, int32_t block) {
  METRALE_CHECK(holds_block(host_block), "host block {} holds nothing", host_block);
  for (size_t l = 0; l < lanes_.size(); ++l)  // an entry still on its way to the host
    lanes_[l].lane.hold_current_until(ticket_of(block_seals_, host_block, l));
  copy_unit(paged, block_areas_, block, host_block, false);
}

void HostTier::store_slot(std::span<const OwnedTensor> slots, int32_t slot, int32_t host_slot) {
  METRALE_CHECK(is_slot_allocated(host_slot), "host slot {} is not allocated", host_slot);
  copy_unit(slots, slot_areas_, slot, host_slot, true);
  mark_stored(slot_seals_, slot_areas_, host_slot);
}

void HostTier::load_slot(std::span<const OwnedTensor> slots, int32_t host_slot, int32_t slot) {
  METRALE_CHECK(is_slot_allocated(host_slot), "host slot {} is not allocated", host_slot);
  copy_unit(slots, slot_areas_, slot, host_slot, false);
}

size_t HostTier::packed_block_bytes() const {
  size_t bytes = 0;
  for (const Area& area : block_areas_) bytes += area.unit_bytes;
  return bytes;
}

size_t HostTier::packed_slot_bytes() const {
  size_t bytes = 0;
  for (const Area& area : slot_areas_) bytes += area.unit_bytes;
  return bytes;
}

uint64_t HostTier::checksum_of(const std::vector<Area>& areas, int32_t host_index) const {
  XXH3_state_t* state = XXH3_createState();
  METRALE_CHECK(state != nullptr, "XXH3 state allocation failed");
  XXH3_64bits_reset(state);
  for (const Area& area : areas) {
    if (area.unit_bytes == 0) continue;
    const std::byte* unit = area.data() + static_cast<size_t>(host_index) * area.unit_bytes;
    // The first kSealSampleBytes of every kSealStrideBytes and the unit's last ones: a block
    // overwritten, misplaced or half-copied changes them; a full hash of every entry stored and
    // every hit cost the scheduler ~150 us per Qwen3-8B block (XXH3 at ~15 GB/s), seconds per
    // minute of a multi-turn workload, more than the recompute the hits saved.
    for (size_t offset = 0; offset < area.unit_bytes; offset += kSealStrideBytes)
      XXH3_64bits_update(state, unit + offset, std::min(kSealSampleBytes, area.unit_bytes - offset));
    if (area.unit_bytes > kSealSampleBytes)
      XXH3_64bits_update(state, unit + area.unit_bytes - kSealSampleBytes, kSealSampleBytes);
  }
  const uint64_t digest = XXH3_64bits_digest(state);
  XXH3_freeState(state);
  return digest;
}

void HostTier::mark_stored(Seals& seals, const std::vector<Area>& areas, int32_t host_index) {
  const auto index = static_cast<size_t>(host_index);
  if (device_.is_cpu()) {  // the copy has landed already
    seals.checksum[index] = checksum_of(areas, host_index);
    seals.sealed[index] = 1;
    return;
  }
  seals.sealed[index] = 0;
  seals.pending.push_back(host_index);
}

void HostTier::seal_pending() {
  if (block_seals_.pending.empty() && slot_seals_.pending.empty()) return;
  for (const Device& device : devices_) synchronize(device);
  for (auto [seals, areas] : {std::pair{&block_seals_, &block_areas_}, std::pair{&slot_seals_, &slot_areas_}}) {
    std::erase_if(seals->pending, [&](int32_t index) {
      if (!lanes_done(*seals, index)) return false;  // still on a copy lane: sealed by a later call
      seals->checksum[static_cast<size_t>(index)] = checksum_of(*areas, index);
      seals->sealed[static_cast<size_t>(index)] = 1;
      return true;
    });
  }
}

bool HostTier::verify(const Seals& seals, const std::vector<Area>& areas, int32_t host_index) const {
  const auto index = static_cast<size_t>(host_index);
  return seals.sealed[index] == 0 || seals.checksum[index] == checksum_of(areas, host_index);
}

bool HostTier::verify_block(int32_t host_block) const {
  METRALE_CHECK(holds_block(host_block), "host block {} holds nothing", host_block);
  return verify(block_seals_, block_areas_, host_block);
}

bool HostTier::verify_slot(int32_t host_slot) const {
  METRALE_CHECK(is_slot_allocated(host_slot), "host slot {} is not allocated", host_slot);
  return verify(slot_seals_, slot_areas_, host_slot);
}

std::vector<std::span<const std::byte>> HostTier::pieces(Seals& seals, const std::vector<Area>& areas,
                                                         int32_t host_index) {
  if (seals.sealed[static_cast<size_t>(host_index)] == 0) {
    if (!seals.ticket.empty())
      for (size_t l = 0; l < lanes_.size(); ++l)
        lanes_[l].lane.wait(ticket_of(seals, host_index, l));
    seal_pending();
  }
  std::vector<std::span<const std::byte>> result;
  result.reserve(areas.size());
  for (const Area& area : areas) {
    if (area.unit_bytes == 0) continue;
    result.emplace_back(area.data() + static_cast<size_t>(host_index) * area.unit_bytes, area.unit_bytes);
  }
  return result;
}

std::vector<std::byte> HostTier::pack(Seals& seals, const std::vector<Area>& areas, int32_t host_index) {
  const std::vector<std::span<const std::byte>> parts = pieces(seals, areas, host_index);
  size_t total = 0;
  for (const auto& part : parts) total += part.size();
  std::vector<std::byte> packed(total);
  size_t offset = 0;
  for (const auto& part : parts) {
    std::memcpy(packed.data() + offset, part.data(), part.size());
    offset += part.size();
  }
  return packed;
}

std::vector<std::span<const std::byte>> HostTier::block_pieces(int32_t host_block) {
  METRALE_CHECK(holds_block(host_block), "host block {} holds nothing", host_block);
  return pieces(block_seals_, block_areas_, host_block);
}

std::span<std::byte> HostTier::block_bytes(size_t area, int32_t host_block) {
  METRALE_CHECK(area < block_areas_.size() && holds_block(host_block), "host block {} of area {} holds nothing",
                host_block, area);
  return {block_areas_[area].data() + static_cast<size_t>(host_block) * block_areas_[area].unit_bytes,
          block_areas_[area].unit_bytes};
}

std::vector<std::byte> HostTier::pack_block(int32_t host_block) {
  METRALE_CHECK(holds_block(host_block), "host block {} holds nothing", host_block);
  return pack(block_seals_, block_areas_, host_block);
}

std::vector<std::byte> HostTier::pack_slot(int32_t host_slot) {
  METRALE_CHECK(is_slot_allocated(host_slot), "host slot {} is not allocated", host_slot);
  return pack(slot_seals_, slot_areas_, host_slot);
}

void HostTier::copy_packed(std::span<const OwnedTensor> device_tensors, const std::vector<Area>& areas,
                           std::span<const std::byte> packed, int32_t device_index) const {
  METRALE_CHECK(device_tensors.size() == areas.size(), "{} device tensors for {} host areas", device_tensors.size(),
                areas.size());
  size_t offset = 0;
  for (size_t i = 0; i < areas.size(); ++i) {
    const Tensor& tensor = device_tensors[i].tensor;
    const size_t unit = areas[i].unit_bytes;
    METRALE_CHECK(device_index >= 0 && device_index < tensor.size(0) && offset + unit <= packed.size(),
                  "packed entry of {} bytes for device index {} of {}", packed.size(), device_index, tensor.describe());
    auto* device_unit = static_cast<std::byte*>(tensor.data()) + static_cast<size_t>(device_index) * unit;
    copy_bytes_async(device_unit, device_, packed.data() + offset, Device::cpu(), unit);
    offset += unit;
  }
  METRALE_CHECK(offset == packed.size(), "packed entry of {} bytes, the areas hold {}", packed.size(), offset);
}

void HostTier::load_packed_block(std::span<const OwnedTensor> paged, std::span<const std::byte> packed,
                                 int32_t block) const {
  copy_packed(paged, block_areas_, packed, block);
}

void HostTier::load_packed_slot(std::span<const OwnedTensor> slots, std::span<const std::byte> packed,
                                int32_t slot) const {
  copy_packed(slots, slot_areas_, packed, slot);
}

}  // namespace metrale
