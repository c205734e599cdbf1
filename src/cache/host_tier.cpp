#include "cache/host_tier.h"

#include <algorithm>

#include "core/checked_math.h"
#include "core/error.h"

namespace metrale {

std::byte* HostTier::Area::data() const {
  return static_cast<std::byte*>(pinned.data() != nullptr ? pinned.data() : plain.data());
}

HostTier::HostTier(Device device, std::vector<size_t> block_bytes, std::vector<size_t> slot_bytes, int32_t num_blocks,
                   int32_t num_slots)
    : device_(device), blocks_(std::max(num_blocks, 0)), slots_(0, std::max(num_slots, 0)) {
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
      if (device.is_cuda()) {
        area.pinned = PinnedBuffer(bytes);
      } else {
        area.plain = Buffer(Device::cpu(), bytes);
      }
    }
  };
  allocate(block_bytes, num_blocks, block_areas_);
  allocate(slot_bytes, num_slots, slot_areas_);
}

uint64_t HostTier::memory_bytes() const {
  uint64_t bytes = 0;
  for (const Area& area : block_areas_) bytes += area.unit_bytes * static_cast<uint64_t>(num_blocks());
  for (const Area& area : slot_areas_) bytes += area.unit_bytes * static_cast<uint64_t>(num_slots());
  return bytes;
}

void HostTier::copy_unit(std::span<const OwnedTensor> device_tensors, std::vector<Area>& areas, int32_t device_index,
                         int32_t host_index, bool to_host) {
  METRALE_CHECK(device_tensors.size() == areas.size(), "{} device tensors for {} host areas", device_tensors.size(),
                areas.size());
  for (size_t i = 0; i < areas.size(); ++i) {
    const Tensor& tensor = device_tensors[i].tensor;
    const Area& area = areas[i];
    METRALE_CHECK(device_index >= 0 && device_index < tensor.size(0), "device index {} outside [0, {})", device_index,
                  tensor.size(0));
    METRALE_CHECK(tensor.nbytes() == area.unit_bytes * static_cast<size_t>(tensor.size(0)),
                  "host area {} holds units of {} bytes, the device tensor {}", i, area.unit_bytes, tensor.describe());
    auto* device_unit = static_cast<std::byte*>(tensor.data()) + static_cast<size_t>(device_index) * area.unit_bytes;
    std::byte* host_unit = area.data() + static_cast<size_t>(host_index) * area.unit_bytes;
    if (to_host) {
      copy_bytes_async(host_unit, Device::cpu(), device_unit, device_, area.unit_bytes);
    } else {
      copy_bytes_async(device_unit, device_, host_unit, Device::cpu(), area.unit_bytes);
    }
  }
}

void HostTier::store_block(std::span<const OwnedTensor> paged, int32_t block, int32_t host_block) {
  METRALE_CHECK(host_block >= 0 && host_block < num_blocks() && blocks_.ref_count(host_block) > 0,
                "host block {} is not allocated", host_block);
  copy_unit(paged, block_areas_, block, host_block, true);
}

void HostTier::load_block(std::span<const OwnedTensor> paged, int32_t host_block, int32_t block) {
  METRALE_CHECK(holds_block(host_block), "host block {} holds nothing", host_block);
  copy_unit(paged, block_areas_, block, host_block, false);
}

void HostTier::store_slot(std::span<const OwnedTensor> slots, int32_t slot, int32_t host_slot) {
  METRALE_CHECK(is_slot_allocated(host_slot), "host slot {} is not allocated", host_slot);
  copy_unit(slots, slot_areas_, slot, host_slot, true);
}

void HostTier::load_slot(std::span<const OwnedTensor> slots, int32_t host_slot, int32_t slot) {
  METRALE_CHECK(is_slot_allocated(host_slot), "host slot {} is not allocated", host_slot);
  copy_unit(slots, slot_areas_, slot, host_slot, false);
}

}  // namespace metrale
