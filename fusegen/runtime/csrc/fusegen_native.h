// What fusegen's two C++ files share: the autograd node (autograd_node.cpp) and the eager
// call (eager_call.cpp, which defines the module).
#pragma once

#include <Python.h>

#include <torch/csrc/autograd/function.h>
#include <torch/csrc/utils/pybind.h>

#include <memory>
#include <string>
#include <vector>

#if defined(_MSC_VER)
#define FUSEGEN_HIDDEN
#else
// Its types hold pybind11 objects, which pybind11 declares hidden.
#define FUSEGEN_HIDDEN __attribute__((visibility("hidden")))
#endif

namespace fusegen {

// A backward the node may run without Python (eager_call.cpp's, for a call with a registered
// call key): true with one gradient per input in `out` (undefined where not needed), or false,
// touching nothing: the Python backward then runs.
struct FUSEGEN_HIDDEN FastBackward {
  virtual ~FastBackward() = default;
  virtual bool run(const torch::autograd::variable_list& grads, const torch::autograd::variable_list& saved,
                   const std::vector<bool>& needs, torch::autograd::variable_list& out) = 0;
};

// Puts one fusegen autograd node behind `outputs` (fresh tensors the forward kernel wrote),
// with an edge to each input and `saved` kept as saved variables; its backward calls
// `backward(state, needs, saved, grads)` with the GIL. False, attaching nothing, where an
// input carries a forward-mode gradient: the node has no forward-mode rule, so the caller
// takes the Python Function, which says so. `fast`: tried before the Python backward.
FUSEGEN_HIDDEN bool attach(pybind11::object backward, pybind11::object state, std::string name,
                           const torch::autograd::variable_list& inputs,
                           const torch::autograd::variable_list& outputs,
                           const torch::autograd::variable_list& saved,
                           std::shared_ptr<FastBackward> fast = nullptr);

}  // namespace fusegen
