// The engine's reusable resources: staging memory and completion threads.
#ifndef JDIST_COLLECTIVES_NATIVE_POOLS_H_
#define JDIST_COLLECTIVES_NATIVE_POOLS_H_

#include <algorithm>
#include <condition_variable>
#include <cstddef>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <utility>

namespace jdist {

// Reusable staging memory: fresh multi-megabyte buffers page-fault on every
// touch (measured in benchmarks/allocator.py), so freed ones are kept.
class BufferPool {
 public:
  std::shared_ptr<char> Get(size_t bytes) {
    bytes = std::max<size_t>(bytes, 64);
    std::lock_guard<std::mutex> lock(mu_);
    for (auto it = free_.begin(); it != free_.end(); ++it) {
      if (it->second >= bytes && it->second <= 2 * bytes) {
        auto raw = it->first;
        size_t size = it->second;
        free_.erase(it);
        return Wrap(raw, size);
      }
    }
    return Wrap(new char[bytes], bytes);
  }

 private:
  std::shared_ptr<char> Wrap(char* raw, size_t size) {
    return std::shared_ptr<char>(raw, [this, size](char* p) { Put(p, size); });
  }
  void Put(char* raw, size_t size) {
    std::lock_guard<std::mutex> lock(mu_);
    free_.emplace_back(raw, size);
    if (free_.size() > 32) {  // keep the most recent ones
      delete[] free_.front().first;
      free_.pop_front();
    }
  }
  std::mutex mu_;
  std::deque<std::pair<char*, size_t>> free_;
};

// Threads for completions; one more is started whenever every thread is busy.
class Completions {
 public:
  void Run(std::function<void()> task) {
    std::lock_guard<std::mutex> lock(mu_);
    tasks_.push_back(std::move(task));
    if (static_cast<int>(tasks_.size()) > idle_ && threads_ < kMaxThreads) {
      ++threads_;
      std::thread([this] { Loop(); }).detach();
    }
    cv_.notify_one();
  }

 private:
  static constexpr int kMaxThreads = 256;
  void Loop() {
    std::unique_lock<std::mutex> lock(mu_);
    while (true) {
      ++idle_;
      cv_.wait(lock, [this] { return !tasks_.empty(); });
      --idle_;
      auto task = std::move(tasks_.front());
      tasks_.pop_front();
      lock.unlock();
      task();
      lock.lock();
    }
  }
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> tasks_;
  int idle_ = 0;
  int threads_ = 0;
};

}  // namespace jdist

#endif  // JDIST_COLLECTIVES_NATIVE_POOLS_H_
