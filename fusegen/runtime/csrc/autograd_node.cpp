// fusegen's autograd node in C++: what torch.autograd.Function does for a generated op,
// minus the Python it costs (fusegen.runtime.native builds this file when asked).
//
// attach(backward, state, name, inputs, outputs, saved) puts one node behind `outputs`
// (fresh tensors the forward kernel wrote), with an edge to each input and `saved` kept as
// saved variables (version-checked, released after the backward, saved-tensor hooks
// applied). Its backward first tries the C++ backward it was given (eager_call.cpp: a call
// whose call key and backward key are registered), else calls the Python `backward(state, needs,
// saved, grads)` once, with the GIL, and takes one gradient (or None) per input back. What
// is gone is the Python Function's context object, its argument processing and its
// wrapping of outputs and saved tensors.
#include "fusegen_native.h"

#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/utils.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/autograd/saved_variable.h>

#include <string>
#include <type_traits>
#include <utility>
#include <vector>

namespace {

using torch::autograd::Edge;
using torch::autograd::Node;
using torch::autograd::SavedVariable;
using torch::autograd::variable_list;

struct FUSEGEN_HIDDEN FusegenNode : public Node {
  FusegenNode(pybind11::object backward, pybind11::object state, std::string name)
      : backward_(std::move(backward)), state_(std::move(state)), name_(std::move(name)) {}

  ~FusegenNode() override {
    // The last reference may go on a thread without the GIL (the engine's), or after
    // the interpreter is gone: then the Python objects are left to the process's end.
    if (Py_IsInitialized()) {
      pybind11::gil_scoped_acquire gil;
      backward_ = pybind11::object();
      state_ = pybind11::object();
      fast_.reset();  // it may hold the last reference to Python objects too
    } else {
      backward_.release();
      state_.release();
      static_cast<void>(new std::shared_ptr<fusegen::FastBackward>(std::move(fast_)));
    }
  }

  std::string name() const override { return name_; }

  variable_list apply(variable_list&& grads) override {
    // Unpacked before the GIL: a saved tensor modified in place raises torch's own error.
    variable_list saved;
    saved.reserve(saved_.size());
    for (auto& s : saved_) {
      saved.push_back(s.unpack());
    }
    const size_t inputs = num_outputs();
    if (fast_) {
      std::vector<bool> wanted(inputs);
      for (size_t i = 0; i < inputs; ++i) {
        wanted[i] = task_should_compute_output(i);
      }
      variable_list out;
      if (fast_->run(grads, saved, wanted, out)) {
        return out;
      }
    }
    pybind11::gil_scoped_acquire gil;
    pybind11::tuple needs(inputs);
    for (size_t i = 0; i < inputs; ++i) {
      needs[i] = pybind11::bool_(task_should_compute_output(i));
    }
    pybind11::tuple saved_py(saved.size());
    for (size_t i = 0; i < saved.size(); ++i) {
      saved_py[i] = pybind11::reinterpret_steal<pybind11::object>(THPVariable_Wrap(saved[i]));
    }
    pybind11::tuple grads_py(grads.size());
    for (size_t i = 0; i < grads.size(); ++i) {  // an unused output's gradient: None
      grads_py[i] = pybind11::reinterpret_steal<pybind11::object>(THPVariable_Wrap(grads[i]));
    }
    PyObject* result = PyObject_CallFunctionObjArgs(
        backward_.ptr(), state_.ptr(), needs.ptr(), saved_py.ptr(), grads_py.ptr(), nullptr);
    if (result == nullptr) {
      // As torch's own Python nodes do: the engine re-raises it in the caller's thread.
      python_error error;
      error.persist();
      throw std::move(error);
    }
    pybind11::object owned = pybind11::reinterpret_steal<pybind11::object>(result);
    pybind11::sequence gradients = owned.cast<pybind11::sequence>();
    TORCH_CHECK(gradients.size() == inputs, name_, ": the backward returned ", gradients.size(),
                " gradients for ", inputs, " inputs");
    variable_list out(inputs);
    for (size_t i = 0; i < inputs; ++i) {
      PyObject* g = gradients[i].ptr();
      if (g != Py_None) {
        TORCH_CHECK(THPVariable_Check(g), name_, ": the backward returned a non-tensor gradient");
        out[i] = THPVariable_Unpack(g);
      }
    }
    return out;
  }

  // After a backward without retain_graph: the data goes, and a second backward's unpack
  // raises torch's "backward through the graph a second time".
  void release_variables() override {
    for (auto& s : saved_) {
      s.reset_data();
    }
  }

  pybind11::object backward_;
  pybind11::object state_;
  std::string name_;
  std::vector<SavedVariable> saved_;
  std::shared_ptr<fusegen::FastBackward> fast_;
};

// torch's nodes are held by std::shared_ptr up to some release and by c10::intrusive_ptr
// after it: made as the installed torch holds them (Edge::function's type says which).
using NodePtr = std::remove_cv_t<std::remove_reference_t<decltype(std::declval<Edge>().function)>>;

template <typename P, typename N>
P make_node(pybind11::object backward, pybind11::object state, std::string name) {
  if constexpr (std::is_same_v<P, std::shared_ptr<Node>>) {
    return P(new N(std::move(backward), std::move(state), std::move(name)));
  } else {
    return P(c10::make_intrusive<N>(std::move(backward), std::move(state), std::move(name)));
  }
}

}  // namespace

namespace fusegen {

bool attach(pybind11::object backward, pybind11::object state, std::string name,
            const variable_list& inputs, const variable_list& outputs, const variable_list& saved,
            std::shared_ptr<FastBackward> fast) {
  for (const auto& t : inputs) {
    if (t.defined() && t._fw_grad(/*level=*/0).defined()) {
      return false;
    }
  }
  NodePtr node = make_node<NodePtr, FusegenNode>(std::move(backward), std::move(state), std::move(name));
  auto* raw = static_cast<FusegenNode*>(node.get());
  raw->fast_ = std::move(fast);
  raw->set_next_edges(torch::autograd::collect_next_edges(inputs));
  raw->saved_.reserve(saved.size());
  for (const auto& t : saved) {
    raw->saved_.emplace_back(t, /*is_output=*/false);
  }
  for (const auto& t : outputs) {
    torch::autograd::set_history(t, node);
  }
  return true;
}

}  // namespace fusegen
