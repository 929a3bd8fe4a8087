// Closes the target region opened by target_avx2_begin.hpp or
// target_avx512_begin.hpp. No include guard: it is a bracket.
#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif
