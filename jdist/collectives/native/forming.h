// Exchanges the local devices are still posting (engine.cc): each device's
// part, collected under the exchange's ordinal and the device's call count
// of that ordinal, until every local device has posted. Not locked: the
// engine's lock guards it.
#ifndef JDIST_COLLECTIVES_NATIVE_FORMING_H_
#define JDIST_COLLECTIVES_NATIVE_FORMING_H_

#include <cstdint>
#include <map>
#include <memory>
#include <utility>
#include <vector>

#include "engine.h"
#include "exchange.h"
#include "flight.h"
#include "reduce.h"

namespace jdist {

class Forming {
 public:
  void Reset(int devices) {
    devices_ = devices;
    next_seq_.assign(devices, {});
    forming_.clear();
  }

  // Records one device's part; sets `ready` when it completes the local
  // group. Returns an error message, or null.
  const char* Admit(int device, int64_t ordinal, int kind, int elem, int64_t count,
                    const Part& part, FlightRecorder* flight, std::shared_ptr<Exchange>* ready) {
    if (device < 0 || device >= devices_) return "device index out of range";
    uint64_t seq = next_seq_[device][ordinal]++;
    auto key = std::make_pair(ordinal, seq);
    auto& slot = forming_[key];
    if (!slot) {
      slot = std::make_shared<Exchange>();
      slot->ordinal = ordinal;
      slot->seq = seq;
      slot->kind = kind;
      slot->elem = elem;
      slot->count = count;
      slot->parts.resize(devices_);
      slot->present.assign(devices_, false);
      slot->since = Clock::now();
      const int64_t unit = kind == JDIST_SUM16 ? 2 : static_cast<int64_t>(ElemSize(elem));
      slot->flight_id = flight->Posted(ordinal, seq, kind, count * unit, slot->since);
    } else if (slot->count != count || slot->elem != elem || slot->kind != kind ||
               slot->present[device]) {
      // The devices disagree on what exchange this is: a program error
      // that would otherwise mix unrelated buffers.
      return "local devices posted different exchanges under one ordinal";
    }
    slot->parts[device] = part;
    slot->present[device] = true;
    if (++slot->arrived == devices_) {
      *ready = slot;
      forming_.erase(key);
    }
    return nullptr;
  }

  // Exchanges still forming, keyed by (ordinal, call count).
  const std::map<std::pair<int64_t, uint64_t>, std::shared_ptr<Exchange>>& exchanges() const {
    return forming_;
  }

  // Removes and returns every exchange still forming (at stop: some local
  // device never posted it).
  std::vector<std::shared_ptr<Exchange>> TakeAll() {
    std::vector<std::shared_ptr<Exchange>> all;
    for (auto& entry : forming_) all.push_back(entry.second);
    forming_.clear();
    return all;
  }

 private:
  int devices_ = 1;
  std::vector<std::map<int64_t, uint64_t>> next_seq_;
  std::map<std::pair<int64_t, uint64_t>, std::shared_ptr<Exchange>> forming_;
};

}  // namespace jdist

#endif  // JDIST_COLLECTIVES_NATIVE_FORMING_H_
