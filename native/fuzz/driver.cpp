// kvevents-native: a self-contained fuzz driver for the wire parser, for sanitizer runs.
//
// One job: feed the parser (and the content-key chain over what it accepts) the golden
// payloads, deterministic mutations of them and random bytes, with no Python in the
// process, so AddressSanitizer and UndefinedBehaviorSanitizer see every read.  Usage:
//   driver GOLDEN.jsonl [ITERATIONS] [SEED]
// Prints how many inputs were read natively and how many were left to Python; any
// sanitizer report aborts with a non-zero status.
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <string>
#include <vector>

#include "keys.hpp"
#include "wire.hpp"

namespace {

struct Rng {
  uint64_t s;
  uint64_t next() {
    s ^= s << 13;
    s ^= s >> 7;
    s ^= s << 17;
    return s;
  }
  size_t below(size_t n) { return n ? static_cast<size_t>(next() % n) : 0; }
};

std::vector<std::vector<uint8_t>> load(const char* path) {
  std::vector<std::vector<uint8_t>> out;
  std::ifstream in(path);
  std::string line;
  const std::string key = "\"payload_hex\":\"";
  while (std::getline(in, line)) {
    size_t at = line.find(key);
    if (at == std::string::npos) continue;
    at += key.size();
    size_t end = line.find('"', at);
    std::vector<uint8_t> p;
    for (size_t i = at; i + 1 < end; i += 2) p.push_back(static_cast<uint8_t>(std::stoul(line.substr(i, 2), nullptr, 16)));
    out.push_back(std::move(p));
  }
  return out;
}

void mutate(std::vector<uint8_t>& b, Rng& r) {
  static const uint8_t special[] = {0xc1, 0xdd, 0xdf, 0xcf, 0xdb, 0xff, 0x00, 0xc0, 0xc6, 0x9f};
  switch (r.below(6)) {
    case 0:
      if (!b.empty()) b[r.below(b.size())] ^= static_cast<uint8_t>(1u << r.below(8));
      break;
    case 1:
      if (!b.empty()) b[r.below(b.size())] = special[r.below(sizeof special)];
      break;
    case 2: b.resize(r.below(b.size() + 1)); break;
    case 3: {
      size_t at = r.below(b.size() + 1), n = 1 + r.below(8);
      std::vector<uint8_t> ins(n);
      for (auto& x : ins) x = static_cast<uint8_t>(r.next());
      b.insert(b.begin() + static_cast<long>(at), ins.begin(), ins.end());
      break;
    }
    case 4:
      if (b.size() >= 4) {
        size_t at = r.below(b.size() - 3);
        b[at] = 0xff;
        b[at + 1] = 0xff;
        b[at + 2] = 0xff;
        b[at + 3] = 0xff;
      }
      break;
    default: {
      size_t a = r.below(b.size() + 1), c = r.below(b.size() + 1);
      if (a > c) std::swap(a, c);
      std::vector<uint8_t> dup(b.begin() + static_cast<long>(a), b.begin() + static_cast<long>(c));
      b.insert(b.begin() + static_cast<long>(a), dup.begin(), dup.end());
    }
  }
}

// Parse one input from an exactly-sized heap copy (so ASan sees reads past its end),
// and chain the content keys of what it accepts.
bool run(const std::vector<uint8_t>& in, kvn::Batch& b, uint64_t& sink) {
  uint8_t* buf = static_cast<uint8_t*>(std::malloc(in.size() ? in.size() : 1));
  if (!in.empty()) std::memcpy(buf, in.data(), in.size());
  bool ok = kvn::parse(buf, in.size(), b) == kvn::Result::Ok;
  if (ok) {
    for (const kvn::Event& e : b.events) {
      if (e.kind != kvn::Kind::Stored || e.block_size <= 0) continue;
      if (static_cast<uint64_t>(e.nt) != static_cast<uint64_t>(e.nh) * static_cast<uint64_t>(e.block_size)) continue;
      sink ^= kvn::chain_units(0, b.tokens.data() + e.t0, e.nt, 1);
      for (uint32_t j = 0; j < e.nh; ++j) sink += b.hashes[e.h0 + j].v;
      if (e.has_extra) sink += buf[e.extra.off + e.extra.len - 1];
      if (e.medium.has && e.medium.s.len) sink += buf[e.medium.s.off + e.medium.s.len - 1];
    }
  }
  std::free(buf);
  return ok;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) {
    std::fprintf(stderr, "usage: %s GOLDEN.jsonl [ITERATIONS] [SEED]\n", argv[0]);
    return 2;
  }
  auto corpus = load(argv[1]);
  long iters = argc > 2 ? std::atol(argv[2]) : 200000;
  Rng r{argc > 3 ? std::strtoull(argv[3], nullptr, 10) | 1 : 33};
  if (corpus.empty()) {
    std::fprintf(stderr, "no payloads in %s\n", argv[1]);
    return 2;
  }
  kvn::Batch b;
  uint64_t sink = 0;
  long native = 0, fallback = 0, golden_native = 0;
  for (const auto& p : corpus) golden_native += run(p, b, sink);
  for (long i = 0; i < iters; ++i) {
    std::vector<uint8_t> p;
    if (i % 10 == 9) {  // random bytes
      p.resize(r.below(256));
      for (auto& x : p) x = static_cast<uint8_t>(r.next());
    } else {
      p = corpus[r.below(corpus.size())];
      for (size_t k = 1 + r.below(3); k; --k) mutate(p, r);
    }
    (run(p, b, sink) ? native : fallback) += 1;
  }
  std::printf("golden %ld/%zu native; %ld mutated/random inputs: %ld native, %ld left to Python (%llx)\n",
              golden_native, corpus.size(), iters, native, fallback,
              static_cast<unsigned long long>(sink & 0xff));
  return golden_native == static_cast<long>(corpus.size()) ? 0 : 1;
}
