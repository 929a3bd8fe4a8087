// Opens an AVX-512 (F + BW + VL, with AVX2, FMA and F16C) target region; close it
// with target_end.hpp. See target_avx2_begin.hpp for why a region.
#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx512f,avx512bw,avx512vl,avx2,fma,f16c"))), \
                             apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx2,fma,f16c")
#endif
