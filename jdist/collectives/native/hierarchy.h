// The groups a sum crosses processes in (point_to_point.h runs them): flat,
// one group of every process; or node-aware, two levels. A node-aware sum of
// a segment is a reduce-scatter within the node (shared memory), a
// reduce-scatter and an all-gather of this process's node-chunk among the
// processes of the same local rank on the other nodes (the only bytes on the
// node's link: the segment once in each direction per node, striped over the
// node's processes, where a flat exchange sends it (processes per node)
// times), then an all-gather within the node.
#ifndef JDIST_COLLECTIVES_NATIVE_HIERARCHY_H_
#define JDIST_COLLECTIVES_NATIVE_HIERARCHY_H_

#include <algorithm>
#include <cstdint>
#include <utility>
#include <vector>

namespace jdist {

// Processes that reduce-scatter (then all-gather) a range among themselves.
struct Group {
  std::vector<int> ranks;  // communicator ranks, in the same order on every member
  int me = 0;              // this process's index in `ranks`
  int size() const { return static_cast<int>(ranks.size()); }
};

// Elements [first, second) of the range [begin, begin + count) that member
// `index` of `parts` reduces (even chunks, the last ones shorter or empty).
inline std::pair<int64_t, int64_t> ChunkOf(int64_t begin, int64_t count, int parts,
                                           int index) {
  int64_t per = (count + parts - 1) / parts;
  int64_t first = std::min<int64_t>(count, per * index);
  return {begin + first, begin + std::min<int64_t>(count, first + per)};
}

// One group of every process: the flat exchange.
inline std::vector<Group> FlatLevels(int rank, int size) {
  Group all;
  for (int p = 0; p < size; ++p) all.ranks.push_back(p);
  all.me = rank;
  return {all};
}

// The node-aware levels for `nodes` (each rank's node index, `size` of them):
// this process's node, then the processes of its local rank (its index among
// its node's processes, in rank order) on every node, in node order. Returns
// an error message, or null; every node must hold as many processes.
inline const char* NodeLevels(int rank, int size, const int* nodes, std::vector<Group>* levels) {
  for (int p = 0; p < size; ++p) {
    if (nodes[p] < 0 || nodes[p] >= size) return "node index out of range in the node map";
  }
  const int node_count = *std::max_element(nodes, nodes + size) + 1;
  std::vector<std::vector<int>> members(node_count);
  for (int p = 0; p < size; ++p) members[nodes[p]].push_back(p);
  for (const auto& node : members) {
    if (node.size() != members[0].size()) {
      return "node-aware sums need the same number of processes on every node";
    }
  }
  Group node, cross;
  node.ranks = members[nodes[rank]];
  node.me = static_cast<int>(std::find(node.ranks.begin(), node.ranks.end(), rank) -
                             node.ranks.begin());
  for (int n = 0; n < node_count; ++n) cross.ranks.push_back(members[n][node.me]);
  cross.me = nodes[rank];
  *levels = {node, cross};
  return nullptr;
}

}  // namespace jdist

#endif  // JDIST_COLLECTIVES_NATIVE_HIERARCHY_H_
