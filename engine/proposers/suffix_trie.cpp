// The depth-bounded suffix trie of suffix_index.py in C++: the same nodes, counts, links, best
// children, node ids and version, so either one may serve the suffix proposer and the tests hold
// both to the same brute-force checks. suffix_index.py documents the structure and its costs.
#include <cstdint>
#include <map>
#include <stdexcept>
#include <string>
#include <tuple>
#include <unordered_map>
#include <vector>

#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

namespace {

constexpr int64_t kRoot = 0;
constexpr int64_t kNone = -1;
using Ids = std::vector<int64_t>;

struct Sequence {
  Ids ends;             // per position: the node of the longest window ending there
  int64_t head = kRoot;  // node of the last min(D - 1, len) tokens
};

inline uint64_t edge_key(int64_t parent, int64_t token) {
  return (static_cast<uint64_t>(parent) << 32) | static_cast<uint64_t>(token);
}

class SuffixTrie {
 public:
  explicit SuffixTrie(int64_t max_depth) : max_depth_(max_depth) {
    if (max_depth < 2) throw std::invalid_argument("max_depth must be >= 2, got " + std::to_string(max_depth));
    push_node(kNone, kNone, 0);  // the root: the empty string
  }

  int64_t max_depth() const { return max_depth_; }
  int64_t version() const { return version_; }
  int64_t num_tokens() const { return num_tokens_; }
  int64_t num_nodes() const { return static_cast<int64_t>(count_.size() - free_.size()); }

  int64_t nbytes() const {
    int64_t n = static_cast<int64_t>(11 * count_.capacity() * sizeof(int64_t) + free_.capacity() * sizeof(int64_t));
    n += static_cast<int64_t>(edges_.size() * (sizeof(uint64_t) + sizeof(int64_t) + 2 * sizeof(void*)) +
                              edges_.bucket_count() * sizeof(void*));
    for (const auto& kv : seqs_) n += static_cast<int64_t>(kv.second.ends.capacity() * sizeof(int64_t));
    return n;
  }

  int64_t add_sequence(const Ids& tokens) {
    int64_t sid = next_seq_++;
    seqs_[sid];
    extend(sid, tokens);
    return sid;
  }

  int64_t sequence_length(int64_t sid) const { return static_cast<int64_t>(seq(sid).ends.size()); }

  Ids sequence_ids() const {
    Ids out;
    for (const auto& kv : seqs_) out.push_back(kv.first);
    return out;
  }

  int64_t last_node(int64_t sid) const {
    const Sequence& s = seq(sid);
    return s.ends.empty() ? kRoot : s.ends.back();
  }

  void extend(int64_t sid, const Ids& tokens) {
    Sequence& s = seq(sid);
    ++version_;
    for (int64_t c : tokens) {
      if (c < 0 || c >= (int64_t{1} << 32))
        throw std::invalid_argument("token ids must lie in [0, 2**32), got " + std::to_string(c));
      const int64_t tick = ++tick_;
      int64_t u = s.head, prev = kNone, head = kNone, deepest = kNone;
      while (true) {  // the windows ending at c: (suffixes of head) + c, longest first
        const uint64_t key = edge_key(u, c);
        auto it = edges_.find(key);
        int64_t v = it == edges_.end() ? new_node(u, c, key) : it->second;
        count_[v] += 1;
        stamp_[v] = tick;
        out_[u] += 1;
        const int64_t b = best_[u];
        if (b != v && (b == kNone || count_[v] >= count_[b])) best_[u] = v;
        if (prev != kNone) link_[prev] = v; else deepest = v;
        if (head == kNone && depth_[v] < max_depth_) head = v;
        prev = v;
        if (u == kRoot) break;
        u = link_[u];
      }
      link_[prev] = kRoot;  // the one-token window
      s.head = head;
      s.ends.push_back(deepest);
      ++num_tokens_;
    }
  }

  void remove(int64_t sid) {
    auto it = seqs_.find(sid);
    if (it == seqs_.end()) throw pybind11::key_error(std::to_string(sid));
    Sequence s = std::move(it->second);
    seqs_.erase(it);
    ++version_;
    for (auto e = s.ends.rbegin(); e != s.ends.rend(); ++e) {
      int64_t v = *e;
      while (v != kRoot) {
        const int64_t u = parent_[v], nxt = link_[v];
        count_[v] -= 1;
        out_[u] -= 1;
        if (count_[v] == 0) {
          free_node(v);
          if (best_[u] == v) rescan_best(u);
        } else if (best_[u] == v) {
          rescan_best(u);
        }
        v = nxt;
      }
      --num_tokens_;
    }
  }

  int64_t child(int64_t u, int64_t token) const {
    auto it = edges_.find(edge_key(u, token));
    return it == edges_.end() ? kNone : it->second;
  }

  Ids children(int64_t u) const {
    Ids out;
    for (int64_t v = first_.at(u); v != kNone; v = next_[v]) out.push_back(v);
    return out;
  }

  int64_t advance(int64_t node, int64_t token) const {
    while (true) {
      if (depth_.at(node) < max_depth_) {
        auto it = edges_.find(edge_key(node, token));
        if (it != edges_.end()) return it->second;
      }
      if (node == kRoot) return kRoot;
      node = link_[node];
    }
  }

  int64_t match(const Ids& tokens) const {
    int64_t node = kRoot;
    const size_t n = tokens.size(), D = static_cast<size_t>(max_depth_);
    for (size_t i = n > D ? n - D : 0; i < n; ++i) node = advance(node, tokens[i]);
    return node;
  }

  std::tuple<Ids, Ids, Ids, Ids> draft(int64_t node, int64_t k, int64_t min_depth) const {
    Ids toks, counts, totals, depths;
    depth_.at(node);
    for (int64_t i = 0; i < k; ++i) {
      while (depth_[node] >= min_depth && (depth_[node] >= max_depth_ || best_[node] == kNone)) node = link_[node];
      if (depth_[node] < min_depth || node == kRoot) break;
      const int64_t b = best_[node];
      toks.push_back(token_[b]);
      counts.push_back(count_[b]);
      totals.push_back(out_[node]);
      depths.push_back(depth_[node]);
      node = b;
    }
    return {toks, counts, totals, depths};
  }

  Ids node_string(int64_t node) const {
    Ids out;
    for (; node != kRoot; node = parent_.at(node)) out.push_back(token_[node]);
    return Ids(out.rbegin(), out.rend());
  }

  std::map<uint64_t, int64_t> edges() const { return {edges_.begin(), edges_.end()}; }
  const Ids& count() const { return count_; }
  const Ids& out() const { return out_; }
  const Ids& depth() const { return depth_; }
  const Ids& link() const { return link_; }
  const Ids& parent() const { return parent_; }
  const Ids& token() const { return token_; }
  const Ids& best() const { return best_; }

 private:
  const Sequence& seq(int64_t sid) const {
    auto it = seqs_.find(sid);
    if (it == seqs_.end()) throw pybind11::key_error(std::to_string(sid));
    return it->second;
  }
  Sequence& seq(int64_t sid) { return const_cast<Sequence&>(static_cast<const SuffixTrie*>(this)->seq(sid)); }

  int64_t push_node(int64_t parent, int64_t token, int64_t depth) {
    const int64_t v = static_cast<int64_t>(count_.size());
    count_.push_back(0);
    out_.push_back(0);
    depth_.push_back(depth);
    link_.push_back(kRoot);
    parent_.push_back(parent);
    token_.push_back(token);
    best_.push_back(kNone);
    stamp_.push_back(0);
    first_.push_back(kNone);
    next_.push_back(kNone);
    prev_.push_back(kNone);
    return v;
  }

  int64_t new_node(int64_t u, int64_t c, uint64_t key) {
    int64_t v;
    if (!free_.empty()) {
      v = free_.back();
      free_.pop_back();
      count_[v] = out_[v] = stamp_[v] = 0;
      depth_[v] = depth_[u] + 1;
      parent_[v] = u;
      token_[v] = c;
      link_[v] = kRoot;
      best_[v] = first_[v] = next_[v] = prev_[v] = kNone;
    } else {
      v = push_node(u, c, depth_[u] + 1);
    }
    edges_[key] = v;
    const int64_t f = first_[u];
    next_[v] = f;
    if (f != kNone) prev_[f] = v;
    first_[u] = v;
    return v;
  }

  void free_node(int64_t v) {
    const int64_t u = parent_[v];
    edges_.erase(edge_key(u, token_[v]));
    const int64_t p = prev_[v], n = next_[v];
    if (p != kNone) next_[p] = n; else first_[u] = n;
    if (n != kNone) prev_[n] = p;
    count_[v] = 0;
    free_.push_back(v);
  }

  void rescan_best(int64_t u) {
    int64_t b = kNone, best_count = 0, best_stamp = -1;
    for (int64_t v = first_[u]; v != kNone; v = next_[v]) {
      if (count_[v] > 0 && (count_[v] > best_count || (count_[v] == best_count && stamp_[v] > best_stamp))) {
        b = v;
        best_count = count_[v];
        best_stamp = stamp_[v];
      }
    }
    best_[u] = b;
  }

  int64_t max_depth_;
  Ids count_, out_, depth_, link_, parent_, token_, best_, stamp_, first_, next_, prev_;
  std::unordered_map<uint64_t, int64_t> edges_;
  Ids free_;
  std::map<int64_t, Sequence> seqs_;  // by id: oldest first
  int64_t next_seq_ = 0, tick_ = 0, version_ = 0, num_tokens_ = 0;
};

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  pybind11::class_<SuffixTrie>(m, "SuffixTrie")
      .def(pybind11::init<int64_t>(), pybind11::arg("max_depth") = 24)
      .def_property_readonly("max_depth", &SuffixTrie::max_depth)
      .def_property_readonly("version", &SuffixTrie::version)
      .def_property_readonly("num_tokens", &SuffixTrie::num_tokens)
      .def_property_readonly("num_nodes", &SuffixTrie::num_nodes)
      .def_property_readonly("sequence_ids", &SuffixTrie::sequence_ids)
      .def_property_readonly("edges", &SuffixTrie::edges)
      .def_property_readonly("count", &SuffixTrie::count)
      .def_property_readonly("out", &SuffixTrie::out)
      .def_property_readonly("depth", &SuffixTrie::depth)
      .def_property_readonly("link", &SuffixTrie::link)
      .def_property_readonly("parent", &SuffixTrie::parent)
      .def_property_readonly("token", &SuffixTrie::token)
      .def_property_readonly("best", &SuffixTrie::best)
      .def("nbytes", &SuffixTrie::nbytes)
      .def("add_sequence", &SuffixTrie::add_sequence, pybind11::arg("tokens") = Ids{})
      .def("sequence_length", &SuffixTrie::sequence_length)
      .def("last_node", &SuffixTrie::last_node)
      .def("extend", &SuffixTrie::extend)
      .def("remove", &SuffixTrie::remove)
      .def("child", &SuffixTrie::child)
      .def("children", &SuffixTrie::children)
      .def("advance", &SuffixTrie::advance)
      .def("match", &SuffixTrie::match)
      .def("draft", &SuffixTrie::draft, pybind11::arg("node"), pybind11::arg("k"), pybind11::arg("min_depth") = 1)
      .def("node_string", &SuffixTrie::node_string);
}
