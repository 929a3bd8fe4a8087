// Opens an AVX2 + FMA + F16C target region; close it with target_end.hpp.
//
// NOTE: a target region instead of -mavx2 on the command line: every function
// defined between the two includes (including the templates instantiated there)
// gets these target attributes, everything else in the module stays baseline
// x86-64. A kernel's math and Ops backend headers must be included inside the
// region and nowhere before in that file. No include guard: it is a bracket.
#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx2,fma,f16c"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
#endif
