// MXFP8 scale-slice geometry: which scale columns a piece of the data owns.
#include "core/mxfp8.h"

#include "common/check.h"

namespace rx::mx {

std::string scale_runs(const Runs& runs, int64_t extent, Runs* out) {
  out->clear();
  // Index of the last non-empty run: only it may end inside a (partial) final block.
  int64_t last = -1;
  for (int64_t i = 0; i < static_cast<int64_t>(runs.size()); ++i)
    if (runs[i].len > 0) last = i;
  for (int64_t i = 0; i <= last; ++i) {
    const Run& r = runs[i];
    if (r.len == 0) continue;
    RX_HOST_ASSERT(r.start >= 0 && r.start + r.len <= extent, "run outside the dim");
    if (r.start % kBlock != 0)
      return detail::format("the piece starts at element ", r.start, " of the last dim, not on a ",
                            kBlock, "-element scale block boundary");
    const bool ends_at_extent = r.start + r.len == extent;
    if (r.len % kBlock != 0 && !(i == last && ends_at_extent))
      return detail::format("the piece covers elements [", r.start, ", ", r.start + r.len,
                            ") of the last dim, which is not made of whole ", kBlock,
                            "-element scale blocks");
    append_run(*out, Run{r.start / kBlock, scale_cols(r.len)});
  }
  return "";
}

}  // namespace rx::mx
