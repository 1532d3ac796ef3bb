// The depth-bounded suffix trie of suffix_index.py in C++: the same nodes, counts, links, best
// children, node ids and version, so either one may serve the suffix proposer and the tests hold
// both to the same brute-force checks. suffix_index.py documents the structure and its costs.
#include <cstdint>
#include <map>
#include <stdexcept>
#include <string>
#include <tuple>
#include <vector>

#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

namespace {

constexpr int64_t kRoot = 0;
constexpr int64_t kNone = -1;
using Ids = std::vector<int64_t>;

// One node's fields side by side: a token appended touches about three nodes per window (the
// new one, its parent, the parent's best child), each one cache miss here rather than one per
// field. After a target forward pass has flushed the caches, misses are what indexing costs.
struct Node {
  int64_t stamp;    // recency of the last increment (ties of ``best``)
  int32_t count;    // occurrences
  int32_t out;      // occurrences followed by a token (sum of children's counts)
  int32_t depth;
  int32_t link;     // node of s[1:]
  int32_t parent;
  uint32_t token;
  int32_t best;     // child with the largest count, or -1
  int32_t first;    // first child, or -1
  int32_t next;     // next sibling, or -1
  int32_t prev;     // previous sibling, or -1
};

struct Sequence {
  Ids ends;             // per position: the node of the longest window ending there
  int64_t head = kRoot;  // node of the last min(D - 1, len) tokens
};

inline uint64_t edge_key(int64_t parent, int64_t token) {
  return (static_cast<uint64_t>(parent) << 32) | static_cast<uint64_t>(token);
}

// Edges (parent << 32 | token) -> child, open addressing with linear probing: a lookup is one
// cache line where a node-based hash map costs two or three. Load factor at most 1/2;
// deletion shifts the following run back (no tombstones).
class EdgeTable {
 public:
  EdgeTable() { rehash(64); }

  int64_t find(uint64_t key) const {
    for (size_t i = slot(key);; i = (i + 1) & mask_) {
      if (keys_[i] == key) return vals_[i];
      if (keys_[i] == kEmpty) return kNone;
    }
  }

  void insert(uint64_t key, int32_t val) {
    if (2 * (size_ + 1) > keys_.size()) rehash(2 * keys_.size());
    size_t i = slot(key);
    while (keys_[i] != kEmpty && keys_[i] != key) i = (i + 1) & mask_;
    if (keys_[i] == kEmpty) ++size_;
    keys_[i] = key;
    vals_[i] = val;
  }

  void erase(uint64_t key) {
    size_t i = slot(key);
    while (keys_[i] != key) {
      if (keys_[i] == kEmpty) return;
      i = (i + 1) & mask_;
    }
    --size_;
    for (size_t j = (i + 1) & mask_; keys_[j] != kEmpty; j = (j + 1) & mask_) {
      const size_t home = slot(keys_[j]);
      if (((j - home) & mask_) >= ((j - i) & mask_)) {  // home is not in (i, j]: the entry may move to i
        keys_[i] = keys_[j];
        vals_[i] = vals_[j];
        i = j;
      }
    }
    keys_[i] = kEmpty;
  }

  size_t size() const { return size_; }
  size_t nbytes() const { return keys_.capacity() * sizeof(uint64_t) + vals_.capacity() * sizeof(int32_t); }

  std::map<uint64_t, int64_t> items() const {
    std::map<uint64_t, int64_t> out;
    for (size_t i = 0; i < keys_.size(); ++i)
      if (keys_[i] != kEmpty) out[keys_[i]] = vals_[i];
    return out;
  }

 private:
  static constexpr uint64_t kEmpty = ~uint64_t{0};  // never a key: parent ids are below 2**31

  size_t slot(uint64_t key) const { return static_cast<size_t>((key * 0x9E3779B97F4A7C15ull) >> shift_); }

  void rehash(size_t capacity) {
    std::vector<uint64_t> keys(capacity, kEmpty);
    std::vector<int32_t> vals(capacity, 0);
    keys.swap(keys_);
    vals.swap(vals_);
    mask_ = capacity - 1;
    shift_ = 64 - __builtin_ctzll(capacity);
    size_ = 0;
    for (size_t i = 0; i < keys.size(); ++i)
      if (keys[i] != kEmpty) insert(keys[i], vals[i]);
  }

  std::vector<uint64_t> keys_;
  std::vector<int32_t> vals_;
  size_t mask_ = 0, size_ = 0;
  int shift_ = 64;
};

class SuffixTrie {
 public:
  explicit SuffixTrie(int64_t max_depth) : max_depth_(max_depth) {
    if (max_depth < 2) throw std::invalid_argument("max_depth must be >= 2, got " + std::to_string(max_depth));
    push_node(kNone, kNone, 0);  // the root: the empty string
  }

  int64_t max_depth() const { return max_depth_; }
  int64_t version() const { return version_; }
  int64_t num_tokens() const { return num_tokens_; }
  int64_t num_nodes() const { return static_cast<int64_t>(nodes_.size() - free_.size()); }

  int64_t nbytes() const {
    int64_t n = static_cast<int64_t>(nodes_.capacity() * sizeof(Node) + free_.capacity() * sizeof(int32_t));
    n += static_cast<int64_t>(edges_.nbytes());
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
        int64_t v = edges_.find(key);
        if (v == kNone) v = new_node(u, c, key);
        Node& nv = nodes_[v];
        Node& nu = nodes_[u];
        nv.count += 1;
        nv.stamp = tick;
        nu.out += 1;
        const int64_t b = nu.best;
        if (b != v && (b == kNone || nv.count >= nodes_[b].count)) nu.best = static_cast<int32_t>(v);
        if (prev != kNone) nodes_[prev].link = static_cast<int32_t>(v); else deepest = v;
        if (head == kNone && nv.depth < max_depth_) head = v;
        prev = v;
        if (u == kRoot) break;
        u = nu.link;
      }
      nodes_[prev].link = kRoot;  // the one-token window
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
        const int64_t u = nodes_[v].parent, nxt = nodes_[v].link;
        nodes_[v].count -= 1;
        nodes_[u].out -= 1;
        if (nodes_[v].count == 0) {
          free_node(v);
          if (nodes_[u].best == v) rescan_best(u);
        } else if (nodes_[u].best == v) {
          rescan_best(u);
        }
        v = nxt;
      }
      --num_tokens_;
    }
  }

  int64_t child(int64_t u, int64_t token) const { return edges_.find(edge_key(u, token)); }

  Ids children(int64_t u) const {
    Ids out;
    for (int64_t v = node(u).first; v != kNone; v = nodes_[v].next) out.push_back(v);
    return out;
  }

  int64_t advance(int64_t node_id, int64_t token) const {
    int64_t u = node_id;
    node(u);
    while (true) {
      if (nodes_[u].depth < max_depth_) {
        const int64_t v = edges_.find(edge_key(u, token));
        if (v != kNone) return v;
      }
      if (u == kRoot) return kRoot;
      u = nodes_[u].link;
    }
  }

  int64_t match(const Ids& tokens) const {
    int64_t u = kRoot;
    const size_t n = tokens.size(), D = static_cast<size_t>(max_depth_);
    for (size_t i = n > D ? n - D : 0; i < n; ++i) u = advance(u, tokens[i]);
    return u;
  }

  std::tuple<Ids, Ids, Ids, Ids> draft(int64_t node_id, int64_t k, int64_t min_depth) const {
    Ids toks, counts, totals, depths;
    int64_t u = node_id;
    node(u);
    for (int64_t i = 0; i < k; ++i) {
      while (nodes_[u].depth >= min_depth && (nodes_[u].depth >= max_depth_ || nodes_[u].best == kNone))
        u = nodes_[u].link;
      if (nodes_[u].depth < min_depth || u == kRoot) break;
      const Node& b = nodes_[nodes_[u].best];
      toks.push_back(b.token);
      counts.push_back(b.count);
      totals.push_back(nodes_[u].out);
      depths.push_back(nodes_[u].depth);
      u = nodes_[u].best;
    }
    return {toks, counts, totals, depths};
  }

  Ids node_string(int64_t node_id) const {
    Ids out;
    for (int64_t u = node_id; u != kRoot; u = node(u).parent) out.push_back(nodes_[u].token);
    return Ids(out.rbegin(), out.rend());
  }

  std::map<uint64_t, int64_t> edges() const { return edges_.items(); }

  // one field of every node, as the Python index's arrays (tests and debugging)
  template <typename F>
  Ids field(F get) const {
    Ids out;
    out.reserve(nodes_.size());
    for (const Node& n : nodes_) out.push_back(get(n));
    return out;
  }
  Ids count() const { return field([](const Node& n) { return int64_t{n.count}; }); }
  Ids out() const { return field([](const Node& n) { return int64_t{n.out}; }); }
  Ids depth() const { return field([](const Node& n) { return int64_t{n.depth}; }); }
  Ids link() const { return field([](const Node& n) { return int64_t{n.link}; }); }
  Ids parent() const { return field([](const Node& n) { return int64_t{n.parent}; }); }
  Ids token() const { return field([](const Node& n) { return n.parent == kNone ? kNone : int64_t{n.token}; }); }
  Ids best() const { return field([](const Node& n) { return int64_t{n.best}; }); }

 private:
  const Node& node(int64_t u) const {
    if (u < 0 || u >= static_cast<int64_t>(nodes_.size())) throw std::out_of_range("no node " + std::to_string(u));
    return nodes_[u];
  }

  const Sequence& seq(int64_t sid) const {
    auto it = seqs_.find(sid);
    if (it == seqs_.end()) throw pybind11::key_error(std::to_string(sid));
    return it->second;
  }
  Sequence& seq(int64_t sid) { return const_cast<Sequence&>(static_cast<const SuffixTrie*>(this)->seq(sid)); }

  int64_t push_node(int64_t parent, int64_t token, int64_t depth) {
    if (nodes_.size() >= static_cast<size_t>(INT32_MAX)) throw std::length_error("suffix trie: 2**31 nodes");
    const int64_t v = static_cast<int64_t>(nodes_.size());
    Node n{};
    n.depth = static_cast<int32_t>(depth);
    n.link = kRoot;
    n.parent = static_cast<int32_t>(parent);
    n.token = static_cast<uint32_t>(token);
    n.best = n.first = n.next = n.prev = kNone;
    nodes_.push_back(n);
    return v;
  }

  int64_t new_node(int64_t u, int64_t c, uint64_t key) {
    int64_t v;
    if (!free_.empty()) {
      v = free_.back();
      free_.pop_back();
      Node& n = nodes_[v];
      n.count = n.out = 0;
      n.stamp = 0;
      n.depth = nodes_[u].depth + 1;
      n.parent = static_cast<int32_t>(u);
      n.token = static_cast<uint32_t>(c);
      n.link = kRoot;
      n.best = n.first = n.next = n.prev = kNone;
    } else {
      v = push_node(u, c, nodes_[u].depth + 1);
    }
    edges_.insert(key, static_cast<int32_t>(v));
    const int32_t f = nodes_[u].first;
    nodes_[v].next = f;
    if (f != kNone) nodes_[f].prev = static_cast<int32_t>(v);
    nodes_[u].first = static_cast<int32_t>(v);
    return v;
  }

  void free_node(int64_t v) {
    Node& n = nodes_[v];
    const int64_t u = n.parent;
    edges_.erase(edge_key(u, n.token));
    const int32_t p = n.prev, x = n.next;
    if (p != kNone) nodes_[p].next = x; else nodes_[u].first = x;
    if (x != kNone) nodes_[x].prev = p;
    n.count = 0;
    free_.push_back(static_cast<int32_t>(v));
  }

  void rescan_best(int64_t u) {
    int64_t b = kNone, best_count = 0, best_stamp = -1;
    for (int64_t v = nodes_[u].first; v != kNone; v = nodes_[v].next) {
      const Node& n = nodes_[v];
      if (n.count > 0 && (n.count > best_count || (n.count == best_count && n.stamp > best_stamp))) {
        b = v;
        best_count = n.count;
        best_stamp = n.stamp;
      }
    }
    nodes_[u].best = static_cast<int32_t>(b);
  }

  int64_t max_depth_;
  std::vector<Node> nodes_;
  EdgeTable edges_;
  std::vector<int32_t> free_;
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
