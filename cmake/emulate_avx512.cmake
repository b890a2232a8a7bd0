# Test builds only: run the AVX-512 kernel body on a host without AVX-512 by compiling it for AVX2
# against SIMDe's portable AVX-512 intrinsics (Debian: libsimde-dev) and reporting "avx512" as
# available. Slow, never for wheels; tools/emulate_avx512.sh builds it and runs the tests. Included by
# CMakeLists.txt with PYATTN_EMULATE_AVX512=ON, after the per-ISA flags are set: it replaces the
# avx512 and avx512bf16 objects' flags and tells dispatch.cpp to report both wherever AVX2 runs.
if(MSVC)
  message(WARNING "PYATTN_EMULATE_AVX512 needs GCC or Clang: ignored")
  return()
endif()
# -Wno-psabi: SIMDe's 64-byte vector types passed by value on AVX2 draw GCC's ABI-change note.
set(PYATTN_FLAGS_avx512 -mavx2 -mfma -mf16c -Wno-psabi -DPYATTN_EMULATE_AVX512=1)
set(PYATTN_FLAGS_avx512bf16 ${PYATTN_FLAGS_avx512})
add_compile_definitions(PYATTN_EMULATE_AVX512=1)
message(STATUS "pyattn: AVX-512 kernels emulated with SIMDe (test build)")
