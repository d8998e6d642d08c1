// RX_HD marks the small inline functions that the CUDA kernels and their CPU twins share,
// so both run the very same code (bit-identical by construction).
#pragma once

#if defined(__CUDACC__)
#define RX_HD __host__ __device__ __forceinline__
#else
#define RX_HD inline
#endif
