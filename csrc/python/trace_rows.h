// The executors' CUDA-event timelines (Executor, DirectExec) as Python rows.
#pragma once

#include <pybind11/pybind11.h>

#include <vector>

#include "comm/executor.h"

namespace rx::python {

// [(kind, index, begin ms, end ms)] of `timeline()` (a call that waits for the GPU: run
// without the GIL).
template <class Timeline>
pybind11::list trace_rows(Timeline&& timeline) {
  std::vector<TraceRow> rows;
  {
    pybind11::gil_scoped_release release;
    rows = timeline();
  }
  pybind11::list out;
  for (const TraceRow& r : rows) out.append(pybind11::make_tuple(r.kind, r.batch, r.begin_ms, r.end_ms));
  return out;
}

}  // namespace rx::python
