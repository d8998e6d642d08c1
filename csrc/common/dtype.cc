#include "common/dtype.h"

#define RX_DTYPE_COUNT_(e, code, bytes, name, is_float) +1
static_assert(RX_NUM_DTYPES == 0 RX_DTYPE_TABLE(RX_DTYPE_COUNT_), "RX_DTYPE_TABLE codes must be 0..N-1 in order");
#undef RX_DTYPE_COUNT_

namespace rx {

#define RX_DTYPE_NAME_CASE_(e, code, bytes, name, is_float) case code: return name;
const char* dtype_name(int32_t dtype) { switch (dtype) { RX_DTYPE_TABLE(RX_DTYPE_NAME_CASE_) default: return "unknown"; } }
#undef RX_DTYPE_NAME_CASE_

}  // namespace rx
