// SPDX-License-Identifier: MIT
// Runtime ISA dispatch: probe the CPU once, pick the best compiled kernel table, let PYATTN_ISA or
// the tests force another. The probe checks both the CPUID feature bits and that the OS saves the
// wider register state (XGETBV), since a CPU flag alone does not make AVX usable. The same probe
// gives the tuning module its CpuInfo (vendor, family and model, cache sizes).

#include "dispatch.h"

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>

#include "tuning.h"

#if defined(__x86_64__) || defined(_M_X64) || defined(__i386__) || defined(_M_IX86)
#define PYATTN_X86 1
#if defined(_MSC_VER)
#include <intrin.h>
#include <immintrin.h>
#else
#include <cpuid.h>
#endif
#endif

namespace pyattn {
namespace {

struct CpuFeatures {
  bool avx2 = false;        // AVX2 + FMA + F16C, with YMM state enabled by the OS
  bool avx512 = false;      // AVX-512F, with ZMM/opmask state enabled by the OS
  bool avx512bf16 = false;  // + AVX512-BF16 (vdpbf16ps)
};

#if defined(PYATTN_X86)
void cpuid(unsigned leaf, unsigned sub, unsigned regs[4]) {
#if defined(_MSC_VER)
  int r[4];
  __cpuidex(r, int(leaf), int(sub));
  for (int i = 0; i < 4; ++i) regs[i] = unsigned(r[i]);
#else
  __cpuid_count(leaf, sub, regs[0], regs[1], regs[2], regs[3]);
#endif
}

// The highest leaf of a CPUID range (0 for the basic leaves, 0x80000000 for the extended ones).
unsigned cpuid_max(unsigned range) {
  unsigned r[4];
  cpuid(range, 0, r);
  return r[0];
}

unsigned long long xgetbv0() {
#if defined(_MSC_VER)
  return _xgetbv(0);
#else
  unsigned lo, hi;
  __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
  return (static_cast<unsigned long long>(hi) << 32) | lo;
#endif
}
#endif

CpuFeatures probe() {
  CpuFeatures f;
#if defined(PYATTN_X86)
  if (cpuid_max(0) < 7) return f;
  unsigned r[4];
  cpuid(1, 0, r);
  const bool fma = (r[2] >> 12) & 1, osxsave = (r[2] >> 27) & 1, avx = (r[2] >> 28) & 1, f16c = (r[2] >> 29) & 1;
  if (!osxsave || !avx) return f;
  const unsigned long long xcr0 = xgetbv0();
  const bool ymm_state = (xcr0 & 0x6) == 0x6;    // SSE + AVX state
  const bool zmm_state = (xcr0 & 0xE6) == 0xE6;  // + opmask, ZMM_Hi256, Hi16_ZMM
  cpuid(7, 0, r);
  const bool avx2 = (r[1] >> 5) & 1, avx512f = (r[1] >> 16) & 1;
  f.avx2 = avx2 && fma && f16c && ymm_state;
  f.avx512 = f.avx2 && avx512f && zmm_state;
  const unsigned subleaves = r[0];
  if (subleaves >= 1) {
    cpuid(7, 1, r);
    f.avx512bf16 = f.avx512 && ((r[0] >> 5) & 1);
  }
#if defined(PYATTN_EMULATE_AVX512)
  f.avx512 = f.avx2;  // the AVX-512 body runs on SIMDe over AVX2 (test builds only, CMakeLists.txt)
  f.avx512bf16 = f.avx2;
#endif
#endif
  return f;
}

const CpuFeatures& features() {
  static const CpuFeatures f = probe();
  return f;
}

struct Entry {
  const char* name;
  const KernelTable* (*table)();
};

const KernelTable* generic_table() { return &generic::kernel_table(); }
#if defined(PYATTN_HAVE_AVX2)
const KernelTable* avx2_table() { return &avx2::kernel_table(); }
#endif
#if defined(PYATTN_HAVE_AVX512)
const KernelTable* avx512_table() { return &avx512::kernel_table(); }
#endif
#if defined(PYATTN_HAVE_AVX512BF16)
const KernelTable* avx512bf16_table() { return &avx512bf16::kernel_table(); }
#endif

// Compiled ISAs, worst to best.
const Entry kEntries[] = {
    {"generic", &generic_table},
#if defined(PYATTN_HAVE_AVX2)
    {"avx2", &avx2_table},
#endif
#if defined(PYATTN_HAVE_AVX512)
    {"avx512", &avx512_table},
#endif
#if defined(PYATTN_HAVE_AVX512BF16)
    {"avx512bf16", &avx512bf16_table},
#endif
};
constexpr int kNumEntries = int(sizeof(kEntries) / sizeof(kEntries[0]));

const Entry* find(const char* name) {
  for (const Entry& e : kEntries)
    if (std::strcmp(e.name, name) == 0) return &e;
  return nullptr;
}

// The best ISA this CPU runs, chosen once.
const KernelTable* best() {
  const KernelTable* t = nullptr;
  for (const Entry& e : kEntries)
    if (cpu_supports(e.name)) t = e.table();
  return t;
}

std::atomic<const KernelTable*> g_active{nullptr};

}  // namespace

bool cpu_supports(const char* name) {
  if (std::strcmp(name, "generic") == 0) return true;
  if (std::strcmp(name, "avx2") == 0) return features().avx2;
  if (std::strcmp(name, "avx512") == 0) return features().avx512;
  if (std::strcmp(name, "avx512bf16") == 0) return features().avx512bf16;
  return false;
}

bool isa_compiled(const char* name) { return find(name) != nullptr; }

namespace {
// Sizes of the data/unified caches per level from CPUID's deterministic cache parameters: leaf 4
// (Intel) or, where it reports nothing, 0x8000001D (AMD). Both give ways x partitions x line size x
// sets per cache (the size one core's data can use: an L3 shared by a core complex counts once).
struct CacheSizes {
  int64_t level[4] = {0, 0, 0, 0};
};

CacheSizes probe_caches() {
  CacheSizes c;
#if defined(PYATTN_X86)
  unsigned r[4];
  for (const unsigned leaf : {4u, 0x8000001Du}) {
    if (cpuid_max(leaf & 0x80000000u) < leaf) continue;
    bool any = false;
    for (unsigned sub = 0; sub < 16; ++sub) {
      cpuid(leaf, sub, r);
      const unsigned type = r[0] & 31, lvl = (r[0] >> 5) & 7;
      if (type == 0) break;
      any = true;
      if (type == 2 || lvl < 1 || lvl > 3) continue;  // instruction caches
      const int64_t size =
          int64_t((r[1] >> 22) + 1) * (((r[1] >> 12) & 0x3ff) + 1) * ((r[1] & 0xfff) + 1) * (int64_t(r[2]) + 1);
      if (size > c.level[lvl]) c.level[lvl] = size;
    }
    if (any) break;
  }
#endif
  return c;
}

CpuInfo probe_cpu() {
  CpuInfo c;
  const CacheSizes caches = probe_caches();
  c.l1d_bytes = caches.level[1];
  c.l2_bytes = caches.level[2];
  c.llc_bytes = std::max(caches.level[3], caches.level[2]);
  c.avx2 = features().avx2;
  c.avx512 = features().avx512;
#if defined(PYATTN_X86)
  unsigned r[4];
  cpuid(0, 0, r);
  char vendor[13] = {};
  std::memcpy(vendor, &r[1], 4);  // EBX, EDX, ECX spell the vendor string
  std::memcpy(vendor + 4, &r[3], 4);
  std::memcpy(vendor + 8, &r[2], 4);
  if (std::strcmp(vendor, "GenuineIntel") == 0) c.vendor = CpuVendor::intel;
  if (std::strcmp(vendor, "AuthenticAMD") == 0) c.vendor = CpuVendor::amd;
  cpuid(1, 0, r);
  // Display family and model: the extended fields count where the base family says so (0xf, and
  // for the model also 6).
  const int base_family = int((r[0] >> 8) & 0xf), base_model = int((r[0] >> 4) & 0xf);
  c.family = base_family == 0xf ? base_family + int((r[0] >> 20) & 0xff) : base_family;
  c.model = base_family == 0xf || base_family == 6 ? base_model + (int((r[0] >> 16) & 0xf) << 4) : base_model;
#endif
  return c;
}
}  // namespace

const CpuInfo& probed_cpu() {
  static const CpuInfo cpu = probe_cpu();
  return cpu;
}

const KernelTable& active_kernels() {
  const KernelTable* t = g_active.load(std::memory_order_acquire);
  if (!t) {
    t = best();
    g_active.store(t, std::memory_order_release);
  }
  return *t;
}

const char* active_isa() { return active_kernels().name; }

int available_isas(const char** names, int capacity) {
  int n = 0;
  for (int i = 0; i < kNumEntries && n < capacity; ++i)
    if (cpu_supports(kEntries[i].name)) names[n++] = kEntries[i].name;
  return n;
}

bool set_isa(const char* name) {
  const Entry* e = find(name);
  if (!e || !cpu_supports(name)) return false;
  g_active.store(e->table(), std::memory_order_release);
  return true;
}

}  // namespace pyattn
