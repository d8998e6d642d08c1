#include "common/dtype.h"

#define RX_DTYPE_COUNT_(e, code, bytes, name, is_float) +1
static_assert(RX_NUM_DTYPES == 0 RX_DTYPE_TABLE(RX_DTYPE_COUNT_), "RX_DTYPE_TABLE codes must be 0..N-1 in order");
#undef RX_DTYPE_COUNT_

extern "C" int32_t rx_dtype_size(int32_t dtype) { return rx::dtype_size(dtype); }

extern "C" int32_t rx_dtype_castable(int32_t src, int32_t dst) { return rx::dtype_castable(src, dst) ? 1 : 0; }

namespace rx {

#define RX_DTYPE_NAME_CASE_(e, code, bytes, name, is_float) case code: return name;
const char* dtype_name(int32_t dtype) { switch (dtype) { RX_DTYPE_TABLE(RX_DTYPE_NAME_CASE_) default: return "unknown"; } }
#undef RX_DTYPE_NAME_CASE_

}  // namespace rx
