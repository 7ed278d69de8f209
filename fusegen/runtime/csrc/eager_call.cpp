// fusegen's eager call in C++: a generated op's forward and backward, for the call keys it
// has seen.
//
// The first call with each call key (shapes, strides, dtypes, device, 16-byte alignment, params)
// takes the Python path (fusegen.runtime.op): it checks the arguments, tunes and compiles
// the kernel, and then registers the call key here (PreparedCall.offer_native): the outputs to
// allocate and the kernel's launch, each parameter as Triton's own launcher passes it. A
// later call with that key is keyed, allocated, launched (cuLaunchKernelEx) and given its
// autograd node (autograd_node.cpp) here, without running Python; one with dropout takes
// the next seed of the device's batch (take_seed: the batches are this file's, and Python's
// eager calls take their seeds here too; Python checks an explicit seed). Likewise the first backward
// with each backward key (the gradients asked for, the incoming gradients' layout) registers its
// launch and where each gradient comes from (PreparedCall.offer_backward, after the Python
// backward ran), and later ones run in the node.
// Anything else returns None before doing anything, and the caller takes the Python path:
// a call key not registered, a tensor subclass or wrapper, a torch.func transform, a dispatch
// mode, torch.jit.trace, compiled autograd, forward-mode AD (Python calls in here only
// outside forward_ad.dual_level; with gradients on a tangent is checked here too), an explicit seed without
// dropout (Python checks it), a Triton launch hook (profilers), another device.
#include "fusegen_native.h"

#include <dlfcn.h>

// Triton's bundled copy: the driver API's types; its functions come through dlsym, so
// nothing links against libcuda and the file builds on machines without CUDA.
#include <cuda.h>

#include <ATen/ATen.h>
#include <ATen/Context.h>
#include <ATen/core/grad_mode.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/csrc/Dtype.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/jit/frontend/tracer.h>

#include <atomic>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <tuple>
#include <unordered_map>
#include <utility>
#include <vector>

namespace {

// -- the driver ------------------------------------------------------------------------

using LaunchEx = CUresult (*)(const CUlaunchConfig*, CUfunction, void**, void**);
using CtxGetCurrent = CUresult (*)(CUcontext*);
using CtxSetCurrent = CUresult (*)(CUcontext);
using DeviceGet = CUresult (*)(CUdevice*, int);
using PrimaryCtxRetain = CUresult (*)(CUcontext*, CUdevice);
using GetErrorString = CUresult (*)(CUresult, const char**);
using StreamIsCapturing = CUresult (*)(CUstream, CUstreamCaptureStatus*);

struct Driver {
  LaunchEx launch = nullptr;
  CtxGetCurrent ctx_get_current = nullptr;
  CtxSetCurrent ctx_set_current = nullptr;
  DeviceGet device_get = nullptr;
  PrimaryCtxRetain primary_ctx_retain = nullptr;
  GetErrorString error_string = nullptr;
  StreamIsCapturing stream_is_capturing = nullptr;
};

// Looked up once, on the first registration (a process that registers nothing never opens
// libcuda); torch has loaded it by then.
const Driver& driver() {
  static const Driver d = [] {
    Driver d;
    void* lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);
    if (lib == nullptr) {
      lib = dlopen("libcuda.so.1", RTLD_NOW);
    }
    if (lib == nullptr) {
      throw std::runtime_error("fusegen: libcuda.so.1 could not be opened");
    }
    d.launch = reinterpret_cast<LaunchEx>(dlsym(lib, "cuLaunchKernelEx"));
    d.ctx_get_current = reinterpret_cast<CtxGetCurrent>(dlsym(lib, "cuCtxGetCurrent"));
    d.ctx_set_current = reinterpret_cast<CtxSetCurrent>(dlsym(lib, "cuCtxSetCurrent"));
    d.device_get = reinterpret_cast<DeviceGet>(dlsym(lib, "cuDeviceGet"));
    d.primary_ctx_retain = reinterpret_cast<PrimaryCtxRetain>(dlsym(lib, "cuDevicePrimaryCtxRetain"));
    d.error_string = reinterpret_cast<GetErrorString>(dlsym(lib, "cuGetErrorString"));
    d.stream_is_capturing = reinterpret_cast<StreamIsCapturing>(dlsym(lib, "cuStreamIsCapturing"));
    if (!d.launch || !d.ctx_get_current || !d.ctx_set_current || !d.device_get || !d.primary_ctx_retain ||
        !d.error_string || !d.stream_is_capturing) {
      throw std::runtime_error("fusegen: libcuda.so.1 lacks cuLaunchKernelEx or the context calls");
    }
    return d;
  }();
  return d;
}

void check(CUresult result, const char* what) {
  if (result != CUDA_SUCCESS) {
    const char* text = nullptr;
    driver().error_string(result, &text);
    throw std::runtime_error(std::string("fusegen: ") + what + ": " + (text ? text : "unknown CUDA error"));
  }
}

// -- a registered call key -------------------------------------------------------------

// One kernel parameter as Triton's launcher passes it: the address of values[slot] (a
// tensor per call; null for None), or fixed bits packed as the parameter's type (little
// endian: a narrower type reads the low bytes of the 8).
struct Param {
  int slot;  // -1: fixed
  uint64_t bits;
};

struct Launch {
  CUfunction function = nullptr;
  unsigned grid[3] = {1, 1, 1};
  unsigned block = 32;
  unsigned shared = 0;
  unsigned num_ctas = 1;
  bool cooperative = false;
  bool pdl = false;
  std::vector<Param> params;
};

struct Buffer {
  std::vector<int64_t> shape;
  at::ScalarType dtype;
};

using Key = std::vector<int64_t>;

struct KeyHash {
  size_t operator()(const Key& key) const noexcept {
    uint64_t h = 1469598103934665603ULL;
    for (int64_t v : key) {
      h = (h ^ static_cast<uint64_t>(v)) * 1099511628211ULL;
    }
    return static_cast<size_t>(h);
  }
};

// Where the backward kernel writes one input's gradient (runtime.gradients.GradTarget):
// "full", the gradient itself; "rows", per-program column sums [R, N] that a second
// kernel (`sums`) adds up into the gradient.
struct Target {
  bool needed = false;
  bool summed = false;
  Buffer buffer;
  Buffer result;  // summed only
  Launch sums;    // summed only: values (buffer, result)
};

// Where one input's gradient comes from (FusedOp.gradient_sources).
struct Source {
  enum Kind { kNone, kKernel, kOutput, kInput } kind = kNone;
  int index = 0;  // the kernel's target, the output whose gradient passes through, the earlier input
};

// The backward of one call key for one backward key (the gradients asked for, the incoming
// gradients' layout).
struct PreparedBackward {
  bool launches = false;  // any gradient the kernel's
  Launch launch;  // values: *inputs, *grads, *buffers (one per target), statistics, seed
  std::vector<Target> targets;  // one per gradient the kernel computes
  std::vector<Source> sources;  // one per input, in order
};

// What a call's backward needs from Python, with the GIL: the current device and stream,
// Triton's launch hooks. Shared by an op's prepared calls, which may outlive its Calls.
struct Hooks {
  pybind11::object get_device;  // torch._C._cuda_getDevice
  pybind11::object get_stream;  // torch._C._cuda_getCurrentRawStream
  pybind11::object knobs;       // triton.knobs.runtime: its launch hooks send launches to Triton
  std::string name;             // the op's autograd node's, for errors
  std::atomic<uint64_t> backward_hits{0};  // backwards run here (for tests)
};

// The C++ half of a runtime.prepared.PreparedCall: one call key's launch, ready to go.
struct Prepared {
  int device = 0;
  std::vector<Buffer> outputs;
  bool has_statistics = false;
  Buffer statistics;  // each row's, kept for the backward
  Launch launch;
  // For a call that no gradient follows: a launch that keeps nothing (a gemm's product), where
  // the kernels have one (runtime.prepared.PreparedCall._bare); else `launch` serves.
  bool has_bare = false;
  Launch bare;
  // A launch not launched yet (the keeping one, or the bare one): the calls that take it return
  // to Python, which launches it and registers it then (register_pending).
  bool launch_pending = false;
  bool bare_pending = false;
  size_t values = 0;  // the launches' values: *inputs, *outputs, statistics, seed
  // The Python PreparedCall: the Python backward goes through it, and it holds the compiled
  // kernels whose handles the launches use.
  pybind11::object python;
  pybind11::object seed;  // draws this call's seed tensor (a dropout that draws), or None
  std::shared_ptr<Hooks> hooks;
  // Registered from Python (with the GIL), read by the engine's threads (without).
  std::mutex mutex;
  std::unordered_map<Key, PreparedBackward, KeyHash> backwards;
};

constexpr size_t kCacheSize = 1024;  // as the Python path's (runtime.prepared.CACHE_SIZE)
constexpr size_t kMaxParams = 128;

// One op's registered call keys, and what its calls need from Python.
struct FUSEGEN_HIDDEN Calls {
  Py_ssize_t inputs = 0;        // tensor arguments, first
  Py_ssize_t arguments = 0;     // all positional arguments
  Py_ssize_t seed_position = -1;  // the seed argument's, or -1 (no dropout)
  Py_ssize_t outputs = 0;
  pybind11::object op;          // the FusedOp
  pybind11::object backward;    // runtime.op._native_backward
  std::shared_ptr<Hooks> hooks;
  std::unordered_map<Key, std::shared_ptr<Prepared>, KeyHash> prepared;
  uint64_t hits = 0;              // forward calls taken (for tests)
  uint64_t seeds = 0;             // seeds taken by this op's eager call, not its Python path (for tests)
};

const c10::DispatchKeySet kNotPlain({
    c10::DispatchKey::Python,
    c10::DispatchKey::Functionalize,
    c10::DispatchKey::FuncTorchBatched,
    c10::DispatchKey::FuncTorchGradWrapper,
    c10::DispatchKey::Conjugate,
    c10::DispatchKey::Negative,
});

bool plain(const at::Tensor& t) {
  return t.defined() && t.layout() == at::kStrided && t.has_storage() && !t.key_set().has_any(kNotPlain);
}

// What a launch specializes on, of one tensor.
void add_tensor(Key& key, const at::Tensor& t) {
  const int64_t dim = t.dim();
  key.push_back(dim);
  for (int64_t d = 0; d < dim; ++d) {
    key.push_back(t.sizes()[d]);
    key.push_back(t.strides()[d]);
  }
  key.push_back(static_cast<int64_t>(t.scalar_type()));
  key.push_back(static_cast<int64_t>(t.device().type()));  // prepared calls are CUDA's only
  key.push_back(t.device().index());
  key.push_back(reinterpret_cast<uintptr_t>(t.data_ptr()) & 15);
}

// The key of a call (as runtime.prepared.call_key sees it), with its tensors; false: a call
// this path does not take.
bool make_key(const Calls& calls, PyObject* args, Key& key, std::vector<at::Tensor>& tensors) {
  if (!PyTuple_CheckExact(args) || PyTuple_GET_SIZE(args) != calls.arguments) {
    return false;
  }
  key.clear();
  tensors.clear();
  for (Py_ssize_t i = 0; i < calls.inputs; ++i) {
    PyObject* obj = PyTuple_GET_ITEM(args, i);
    if (!THPVariable_CheckExact(obj)) {  // torch.Tensor or Parameter, no subclass
      return false;
    }
    const at::Tensor& t = THPVariable_Unpack(obj);
    if (!plain(t)) {
      return false;
    }
    add_tensor(key, t);
    tensors.push_back(t);
  }
  for (Py_ssize_t i = calls.inputs; i < calls.arguments; ++i) {
    PyObject* obj = PyTuple_GET_ITEM(args, i);
    if (i == calls.seed_position) {
      key.push_back(obj == Py_None ? 7 : 8);
    } else if (obj == Py_None) {
      key.push_back(1);
    } else if (PyBool_Check(obj)) {
      key.push_back(obj == Py_True ? 3 : 2);
    } else if (PyFloat_CheckExact(obj)) {
      double value = PyFloat_AS_DOUBLE(obj);
      int64_t bits;
      std::memcpy(&bits, &value, sizeof bits);
      key.push_back(4);
      key.push_back(bits);
    } else if (PyLong_CheckExact(obj)) {
      int overflow = 0;
      long long value = PyLong_AsLongLongAndOverflow(obj, &overflow);
      if (overflow != 0 || (value == -1 && PyErr_Occurred())) {
        PyErr_Clear();
        return false;
      }
      key.push_back(5);
      key.push_back(value);
    } else if (PyUnicode_CheckExact(obj)) {
      Py_ssize_t size = 0;
      const char* text = PyUnicode_AsUTF8AndSize(obj, &size);
      if (text == nullptr) {
        PyErr_Clear();
        return false;
      }
      key.push_back(6);
      key.push_back(size);
      for (Py_ssize_t at = 0; at < size; at += 8) {
        int64_t chunk = 0;
        std::memcpy(&chunk, text + at, std::min<Py_ssize_t>(8, size - at));
        key.push_back(chunk);
      }
    } else {
      return false;  // a tensor or numpy param, say: the full path
    }
  }
  return true;
}

// A hook chain's list of calls is not empty (triton.knobs.runtime.launch_*_hook.calls).
bool hooked(PyObject* runtime, const char* name) {
  PyObject* chain = PyObject_GetAttrString(runtime, name);
  if (chain == nullptr) {
    PyErr_Clear();
    return false;
  }
  bool result = false;
  if (chain != Py_None) {
    PyObject* calls = PyObject_GetAttrString(chain, "calls");
    if (calls == nullptr) {
      PyErr_Clear();
      result = PyCallable_Check(chain);  // a plain function set as the hook
    } else {
      result = PyObject_IsTrue(calls) == 1;
      Py_DECREF(calls);
    }
  }
  Py_DECREF(chain);
  return result;
}

// runtime.op._compiled_autograd_enabled, without its Python: compiled autograd takes the
// Python Function, not this node.
bool compiled_autograd_enabled() {
  PyObject* modules = PyImport_GetModuleDict();
  const char* places[2][2] = {{"torch._dynamo.config", "compiled_autograd"},
                              {"torch._dynamo.compiled_autograd", "compiled_autograd_enabled"}};
  for (auto& place : places) {
    PyObject* module = PyDict_GetItemString(modules, place[0]);  // borrowed
    if (module == nullptr) {
      continue;
    }
    PyObject* value = PyObject_GetAttrString(module, place[1]);
    if (value == nullptr) {
      PyErr_Clear();
      continue;
    }
    int on = PyObject_IsTrue(value);
    Py_DECREF(value);
    if (on != 0) {
      PyErr_Clear();
      return true;  // on, or unknown: the Python path decides
    }
  }
  return false;
}

void ensure_context(int device) {
  const Driver& d = driver();
  CUcontext context = nullptr;
  check(d.ctx_get_current(&context), "cuCtxGetCurrent");
  if (context == nullptr) {
    CUdevice handle;
    check(d.device_get(&handle, device), "cuDeviceGet");
    check(d.primary_ctx_retain(&context, handle), "cuDevicePrimaryCtxRetain");
    check(d.ctx_set_current(context), "cuCtxSetCurrent");
  }
}

// As Triton's launcher (triton/backends/nvidia/driver.py, _launch) does it.
void launch(const Launch& l, const uint64_t* addresses, CUstream stream, const std::string& name) {
  if (l.grid[0] == 0 || l.grid[1] == 0 || l.grid[2] == 0) {
    return;
  }
  uint64_t storage[kMaxParams + 2];
  void* params[kMaxParams + 2];
  const size_t count = l.params.size();
  for (size_t i = 0; i < count; ++i) {
    const Param& p = l.params[i];
    storage[i] = p.slot >= 0 ? addresses[p.slot] : p.bits;
    params[i] = &storage[i];
  }
  storage[count] = 0;  // the global and profile scratch pointers: none
  storage[count + 1] = 0;
  params[count] = &storage[count];
  params[count + 1] = &storage[count + 1];
  CUlaunchAttribute attributes[4];
  unsigned count_attributes = 0;
  if (l.pdl) {
    attributes[count_attributes].id = CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
    attributes[count_attributes++].value.programmaticStreamSerializationAllowed = 1;
  }
  if (l.cooperative) {
    attributes[count_attributes].id = CU_LAUNCH_ATTRIBUTE_COOPERATIVE;
    attributes[count_attributes++].value.cooperative = 1;
  }
  if (l.num_ctas != 1) {
    attributes[count_attributes].id = CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION;
    attributes[count_attributes].value.clusterDim.x = l.num_ctas;
    attributes[count_attributes].value.clusterDim.y = 1;
    attributes[count_attributes++].value.clusterDim.z = 1;
    attributes[count_attributes].id = CU_LAUNCH_ATTRIBUTE_CLUSTER_SCHEDULING_POLICY_PREFERENCE;
    attributes[count_attributes++].value.clusterSchedulingPolicyPreference = CU_CLUSTER_SCHEDULING_POLICY_SPREAD;
  }
  CUlaunchConfig config;
  std::memset(&config, 0, sizeof config);
  config.gridDimX = l.grid[0] * l.num_ctas;
  config.gridDimY = l.grid[1];
  config.gridDimZ = l.grid[2];
  config.blockDimX = l.block;
  config.blockDimY = 1;
  config.blockDimZ = 1;
  config.sharedMemBytes = l.shared;
  config.hStream = stream;
  config.attrs = attributes;
  config.numAttrs = count_attributes;
  CUresult result = driver().launch(&config, l.function, params, nullptr);
  if (result != CUDA_SUCCESS) {
    check(result, ("launching " + name).c_str());
  }
}

uint64_t address(const at::Tensor& t) {
  return t.defined() ? reinterpret_cast<uint64_t>(t.data_ptr()) : 0;
}

// -- the eager seeds ----------------------------------------------------------------------
// Seeds for eager calls with dropout, drawn a batch at a time per device: this file owns the
// batches wherever the extension is built, and Python's eager calls take their seeds here
// too (runtime.dropout._EagerSeeds.take), so that no seed is handed out twice and the C++
// and Python paths draw the same seeds. A batch stands while the device's generator is where
// the batch left it (same seed, same Philox offset): torch.manual_seed, or any other random
// op in between, starts a new batch, so a program draws the same seeds run after run.
struct SeedBatch {
  uint64_t seed = 0;    // the generator's seed and offset just after the draw
  uint64_t offset = 0;
  at::Tensor drawn;     // [batch, 2] int64: every other element, so each seed is 16-byte aligned
  int64_t taken = 0;
};

struct Seeds {
  std::mutex mutex;  // taken with the GIL held (every caller holds it): no lock-order cycle
  std::unordered_map<int, SeedBatch> batches;
  int64_t batch = 0;  // seeds per batch and their exclusive upper bound: runtime.dropout's,
  int64_t high = 0;   // set once by configure_seeds when the extension is loaded
};

Seeds& eager_seeds() {
  static Seeds* seeds = new Seeds();  // never destroyed: tensors must not outlive CUDA at exit
  return *seeds;
}

void configure_seeds(int64_t batch, int64_t high) {
  TORCH_CHECK(batch > 0 && high > 0, "fusegen: seed batches need a positive size and bound");
  Seeds& seeds = eager_seeds();
  std::lock_guard<std::mutex> lock(seeds.mutex);
  seeds.batch = batch;
  seeds.high = high;
}

std::pair<uint64_t, uint64_t> generator_state(at::Generator& generator) {
  std::lock_guard<std::mutex> lock(generator.mutex());
  return {generator.current_seed(), generator.get_offset()};
}

// The device's next seed: a one-element view into its standing batch, drawn anew (one
// torch.randint on the current stream, as Python's torch.randint would) where none stands.
at::Tensor next_seed(int device) {
  Seeds& seeds = eager_seeds();
  at::Generator generator = at::globalContext().defaultGenerator(at::Device(at::kCUDA, device));
  std::lock_guard<std::mutex> lock(seeds.mutex);
  TORCH_CHECK(seeds.batch > 0, "fusegen: the eager seeds were not configured (runtime.native.load does it)");
  SeedBatch& batch = seeds.batches[device];
  const auto [seed, offset] = generator_state(generator);
  if (!batch.drawn.defined() || batch.seed != seed || batch.offset != offset || batch.taken == batch.drawn.size(0)) {
    batch.drawn = at::randint(0, seeds.high, {seeds.batch, 2},
                              at::TensorOptions().dtype(at::kLong).device(at::kCUDA, device));
    std::tie(batch.seed, batch.offset) = generator_state(generator);
    batch.taken = 0;
  }
  const int64_t taken = batch.taken++;
  return batch.drawn.as_strided({1}, {1}, batch.drawn.storage_offset() + taken * batch.drawn.stride(0));
}

// For tests: the device's standing batch and how many of its seeds are taken, or None.
pybind11::object standing_seeds(int device) {
  Seeds& seeds = eager_seeds();
  std::lock_guard<std::mutex> lock(seeds.mutex);
  auto found = seeds.batches.find(device);
  if (found == seeds.batches.end() || !found->second.drawn.defined()) {
    return pybind11::none();
  }
  pybind11::object drawn = pybind11::reinterpret_steal<pybind11::object>(THPVariable_Wrap(found->second.drawn));
  return pybind11::make_tuple(drawn, found->second.taken);
}

// An eager call's seed; false while the stream is being captured (the Python path draws it
// in the graph then, so that each replay draws anew).
bool take_seed(Calls& calls, int device, CUstream stream, at::Tensor& out) {
  CUstreamCaptureStatus status = CU_STREAM_CAPTURE_STATUS_NONE;
  if (driver().stream_is_capturing(stream, &status) != CUDA_SUCCESS || status != CU_STREAM_CAPTURE_STATUS_NONE) {
    return false;
  }
  out = next_seed(device);
  ++calls.seeds;
  return true;
}

PyObject* call_python(PyObject* fn, PyObject* arg) {
  PyObject* result = PyObject_CallOneArg(fn, arg);
  if (result == nullptr) {
    throw python_error();
  }
  return result;
}

// The current stream of `device` in `stream`; false where the launch belongs to Triton's
// path (a launch hook) or to another device (Triton launches on the current one). With
// the GIL.
bool current_stream(const Hooks& hooks, int device, CUstream& stream) {
  if (hooked(hooks.knobs.ptr(), "launch_enter_hook") || hooked(hooks.knobs.ptr(), "launch_exit_hook")) {
    return false;
  }
  pybind11::object current = pybind11::reinterpret_steal<pybind11::object>(PyObject_CallNoArgs(hooks.get_device.ptr()));
  if (!current) {
    throw python_error();
  }
  if (PyLong_AsLong(current.ptr()) != device) {
    return false;
  }
  pybind11::object raw = pybind11::reinterpret_steal<pybind11::object>(
      PyObject_CallOneArg(hooks.get_stream.ptr(), current.ptr()));
  if (!raw) {
    throw python_error();
  }
  stream = reinterpret_cast<CUstream>(PyLong_AsUnsignedLongLong(raw.ptr()));
  return true;
}

// A call's backward without Python, where its backward key is registered.
struct FUSEGEN_HIDDEN PreparedNode : fusegen::FastBackward {
  PreparedNode(std::shared_ptr<Prepared> call, at::Tensor seed) : prepared_(std::move(call)), seed_(std::move(seed)) {}

  bool run(const torch::autograd::variable_list& grads, const torch::autograd::variable_list& saved,
           const std::vector<bool>& needs, torch::autograd::variable_list& out) override {
    if (at::GradMode::is_enabled()) {
      return false;  // create_graph: the library op's autograd must be recorded (Python)
    }
    const size_t inputs = needs.size();
    Key key;
    for (bool need : needs) {
      key.push_back(need);
    }
    for (const auto& g : grads) {
      if (!plain(g)) {
        return false;  // an unused output's (undefined) gradient, a subclass: Python
      }
      add_tensor(key, g);
    }
    const PreparedBackward* found = nullptr;
    {
      std::lock_guard<std::mutex> lock(prepared_->mutex);
      auto it = prepared_->backwards.find(key);
      if (it == prepared_->backwards.end()) {
        return false;
      }
      found = &it->second;  // entries are never erased while the prepared call lives
    }
    const PreparedBackward& b = *found;
    CUstream stream = nullptr;
    {
      pybind11::gil_scoped_acquire gil;
      if (!current_stream(*prepared_->hooks, prepared_->device, stream)) {
        return false;
      }
    }
    const auto options = at::TensorOptions().device(at::kCUDA, prepared_->device);
    std::vector<at::Tensor> results(b.targets.size());
    if (b.launches) {
      std::vector<at::Tensor> buffers(b.targets.size());
      for (size_t k = 0; k < b.targets.size(); ++k) {
        if (b.targets[k].needed) {
          buffers[k] = at::empty(b.targets[k].buffer.shape, options.dtype(b.targets[k].buffer.dtype));
        }
      }
      uint64_t addresses[kMaxParams];
      size_t n = 0;
      for (size_t i = 0; i < inputs; ++i) {
        addresses[n++] = address(saved[i]);
      }
      for (const auto& g : grads) {
        addresses[n++] = address(g);
      }
      for (const auto& buffer : buffers) {
        addresses[n++] = address(buffer);
      }
      addresses[n++] = saved.size() > inputs ? address(saved[inputs]) : 0;  // the statistics, if kept
      addresses[n++] = address(seed_);
      ensure_context(prepared_->device);
      launch(b.launch, addresses, stream, prepared_->hooks->name);
      for (size_t k = 0; k < b.targets.size(); ++k) {
        const Target& t = b.targets[k];
        if (!t.needed) {
          continue;
        }
        if (!t.summed) {
          results[k] = buffers[k];
          continue;
        }
        results[k] = at::empty(t.result.shape, options.dtype(t.result.dtype));
        uint64_t pair[2] = {address(buffers[k]), address(results[k])};
        launch(t.sums, pair, stream, prepared_->hooks->name);
      }
    }
    out.assign(inputs, at::Tensor());
    for (size_t i = 0; i < inputs; ++i) {
      const Source& source = b.sources[i];
      switch (source.kind) {
        case Source::kKernel:
          out[i] = results[source.index];
          break;
        case Source::kOutput:
          out[i] = grads[source.index];  // passes through as it is (its shape is the input's)
          break;
        case Source::kInput:
          out[i] = out[source.index];  // one gradient for both (x + residual)
          break;
        case Source::kNone:
          break;
      }
    }
    ++prepared_->hooks->backward_hits;
    return true;
  }

  std::shared_ptr<Prepared> prepared_;
  at::Tensor seed_;
};

Calls* calls_of(PyObject* capsule) {
  return static_cast<Calls*>(PyCapsule_GetPointer(capsule, "fusegen.Calls"));
}

// The op's call: (args, inplace_backward) -> its output(s), or None (the Python path).
PyObject* eager_call(PyObject* capsule, PyObject* const* argv, Py_ssize_t argc) {
  HANDLE_TH_ERRORS
  Calls& calls = *calls_of(capsule);
  if (argc != 2 || (argv[1] != Py_True && argv[1] != Py_False) || calls.prepared.empty()) {
    Py_RETURN_NONE;
  }
  PyObject* args = argv[0];
  // Python may run inside a call (the stream's lookup, the seed drawer, a finalizer there)
  // and call an op again: that call takes the Python path, not this thread's key and tensors.
  thread_local bool inside = false;
  if (inside) {
    Py_RETURN_NONE;
  }
  thread_local Key key;
  thread_local std::vector<at::Tensor> tensors;
  // Left on every way out; the call's inputs must not outlive it here.
  struct Leave {
    std::vector<at::Tensor>& tensors;
    bool& inside;
    ~Leave() {
      tensors.clear();
      inside = false;
    }
  } leave{tensors, inside};
  inside = true;
  if (!make_key(calls, args, key, tensors)) {
    Py_RETURN_NONE;
  }
  auto found = calls.prepared.find(key);
  if (found == calls.prepared.end()) {
    Py_RETURN_NONE;
  }
  std::shared_ptr<Prepared> shared = found->second;
  Prepared& call = *shared;
  PyObject* seed_argument = calls.seed_position >= 0 ? PyTuple_GET_ITEM(args, calls.seed_position) : Py_None;
  if (seed_argument != Py_None && call.seed.is_none()) {
    Py_RETURN_NONE;  // without dropout the seed is never read, but Python checks it
  }
  if (c10::impl::tls_local_dispatch_key_set().included_.has_any(c10::DispatchKeySet({
          c10::DispatchKey::Python, c10::DispatchKey::FuncTorchDynamicLayerFrontMode}))) {
    Py_RETURN_NONE;  // a dispatch mode, a torch.func transform
  }
  if (torch::jit::tracer::isTracing()) {
    Py_RETURN_NONE;  // torch.jit.trace: Python refuses it
  }
  bool grad = false;
  if (at::GradMode::is_enabled()) {
    for (const auto& t : tensors) {
      grad = grad || t.requires_grad();
    }
  }
  if (grad) {
    if (compiled_autograd_enabled()) {
      Py_RETURN_NONE;
    }
    for (const auto& t : tensors) {
      if (t._fw_grad(/*level=*/0).defined()) {
        Py_RETURN_NONE;
      }
    }
  }
  CUstream stream = nullptr;
  if (!current_stream(*call.hooks, call.device, stream)) {
    Py_RETURN_NONE;
  }
  ensure_context(call.device);  // a thread's first call: take_seed asks the driver about the stream
  if (grad ? call.launch_pending : call.bare_pending) {
    Py_RETURN_NONE;
  }
  ++calls.hits;
  const bool bare = !grad && call.has_bare;

  // The outputs, the statistics kept for the backward, the seed.
  const auto options = at::TensorOptions().device(at::kCUDA, call.device);
  std::vector<at::Tensor> outputs;
  outputs.reserve(call.outputs.size());
  for (const Buffer& b : call.outputs) {
    outputs.push_back(at::empty(b.shape, options.dtype(b.dtype)));
  }
  at::Tensor statistics;
  if (call.has_statistics && !bare) {
    statistics = at::empty(call.statistics.shape, options.dtype(call.statistics.dtype));
  }
  pybind11::object seed = pybind11::none();
  at::Tensor seed_tensor;
  if (!call.seed.is_none() &&
      (seed_argument != Py_None || !take_seed(calls, call.device, stream, seed_tensor))) {
    seed = pybind11::reinterpret_steal<pybind11::object>(call_python(call.seed.ptr(), seed_argument));
    seed_tensor = THPVariable_Unpack(seed.ptr());
  }

  // Addresses in the order of the Python path's values: *tensors, *outputs, statistics, seed.
  uint64_t addresses[kMaxParams];
  size_t n = 0;
  for (const auto& t : tensors) {
    addresses[n++] = address(t);
  }
  for (const auto& t : outputs) {
    addresses[n++] = address(t);
  }
  addresses[n++] = address(statistics);  // 0 for a bare launch, which does not read it
  addresses[n++] = address(seed_tensor);
  launch(bare ? call.bare : call.launch, addresses, stream, call.hooks->name);

  if (grad) {
    const bool in_place = argv[1] == Py_True;
    pybind11::tuple params = pybind11::reinterpret_steal<pybind11::tuple>(
        PyTuple_GetSlice(args, calls.inputs, calls.arguments));
    if (seed_tensor.defined() && seed.is_none()) {
      seed = pybind11::reinterpret_steal<pybind11::object>(THPVariable_Wrap(seed_tensor));
    }
    pybind11::tuple state = pybind11::make_tuple(calls.op, call.python, pybind11::bool_(in_place), params, seed);
    torch::autograd::variable_list inputs(tensors.begin(), tensors.end());
    torch::autograd::variable_list kept(tensors.begin(), tensors.end());
    if (statistics.defined()) {
      kept.push_back(statistics);
    }
    std::shared_ptr<fusegen::FastBackward> fast;
    if (!in_place) {
      fast = std::make_shared<PreparedNode>(shared, seed_tensor);
    }
    fusegen::attach(calls.backward, state, call.hooks->name, inputs, outputs, kept, std::move(fast));
  }
  if (outputs.size() == 1) {
    return THPVariable_Wrap(outputs[0]);
  }
  PyObject* result = PyTuple_New(static_cast<Py_ssize_t>(outputs.size()));
  if (result == nullptr) {
    return nullptr;
  }
  for (size_t i = 0; i < outputs.size(); ++i) {
    PyTuple_SET_ITEM(result, static_cast<Py_ssize_t>(i), THPVariable_Wrap(outputs[i]));
  }
  return result;
  END_HANDLE_TH_ERRORS
}

PyMethodDef kCallDef = {"eager_call", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(eager_call)),
                        METH_FASTCALL, "A fusegen op's call with a registered call key, or None (see eager_call.cpp)."};

void release(PyObject* capsule) {
  Calls* calls = calls_of(capsule);
  if (calls != nullptr) {
    delete calls;
  }
}

// A new op's calls: a function (args, inplace_backward) -> outputs or None.
pybind11::object new_calls(Py_ssize_t inputs, Py_ssize_t arguments, Py_ssize_t seed_position, Py_ssize_t outputs,
                           std::string name, pybind11::object op, pybind11::object backward,
                           pybind11::object get_device, pybind11::object get_stream, pybind11::object knobs) {
  auto* calls = new Calls();
  calls->inputs = inputs;
  calls->arguments = arguments;
  calls->seed_position = seed_position;
  calls->outputs = outputs;
  calls->op = std::move(op);
  calls->backward = std::move(backward);
  calls->hooks = std::make_shared<Hooks>();
  calls->hooks->get_device = std::move(get_device);
  calls->hooks->get_stream = std::move(get_stream);
  calls->hooks->knobs = std::move(knobs);
  calls->hooks->name = std::move(name);
  PyObject* capsule = PyCapsule_New(calls, "fusegen.Calls", release);
  if (capsule == nullptr) {
    delete calls;
    throw python_error();
  }
  PyObject* function = PyCFunction_New(&kCallDef, capsule);
  Py_DECREF(capsule);  // the function holds it
  if (function == nullptr) {
    throw python_error();
  }
  return pybind11::reinterpret_steal<pybind11::object>(function);
}

Calls& calls_from(const pybind11::object& function) {
  PyObject* f = function.ptr();
  if (!PyCFunction_Check(f) || PyCFunction_GET_FUNCTION(f) != kCallDef.ml_meth) {
    throw std::invalid_argument("fusegen: not a function made by new_calls");
  }
  return *calls_of(PyCFunction_GET_SELF(f));
}

Buffer buffer_of(const pybind11::handle& shape, const pybind11::handle& dtype) {
  if (!THPDtype_Check(dtype.ptr())) {
    throw std::invalid_argument("fusegen: a buffer's dtype must be a torch.dtype");
  }
  Buffer b;
  for (auto size : shape) {
    b.shape.push_back(size.cast<int64_t>());
  }
  b.dtype = reinterpret_cast<THPDtype*>(dtype.ptr())->scalar_type;
  return b;
}

// (function, (x, y, z), num_warps, num_ctas, shared, cooperative, pdl, [(slot, bits)]), as
// the Triton backend's native_form gives it; slots below `values`.
Launch launch_of(const pybind11::handle& form_handle, size_t values) {
  auto form = form_handle.cast<pybind11::tuple>();
  Launch l;
  l.function = reinterpret_cast<CUfunction>(form[0].cast<uint64_t>());
  auto grid = form[1].cast<pybind11::tuple>();
  for (int i = 0; i < 3; ++i) {
    l.grid[i] = grid[i].cast<unsigned>();
  }
  l.block = 32 * form[2].cast<unsigned>();
  l.num_ctas = form[3].cast<unsigned>();
  l.shared = form[4].cast<unsigned>();
  l.cooperative = form[5].cast<bool>();
  l.pdl = form[6].cast<bool>();
  for (auto entry : form[7].cast<pybind11::list>()) {
    auto pair = entry.cast<pybind11::tuple>();
    Param p{pair[0].cast<int>(), pair[1].cast<uint64_t>()};
    if (p.slot >= static_cast<int>(values)) {
      throw std::invalid_argument("fusegen: a launch parameter's slot is out of range");
    }
    l.params.push_back(p);
  }
  if (l.params.size() > kMaxParams || values > kMaxParams) {
    throw std::invalid_argument("fusegen: a launch with too many parameters");
  }
  return l;
}

// A call as Python holds it, to register its backwards: weakly, as the call holds the
// PreparedCall that holds this (a cycle Python's collector cannot see would keep both).
struct PlanRef {
  std::weak_ptr<Prepared> call;
};

// Registers the call key of `args`: outputs [(shape, dtype)], statistics (shape, dtype) or None, the
// launch (launch_of), the PreparedCall, the seed drawer or None, and the launch for calls that no
// gradient follows (keeping no statistics) or None. Returns the call's handle, or None where
// `args` is not a call this path would take.
pybind11::object register_call(const pybind11::object& function, const pybind11::tuple& args, int device,
                               const pybind11::list& outputs, const pybind11::object& statistics,
                               const pybind11::object& launch_form, pybind11::object prepared, pybind11::object seed,
                               const pybind11::object& bare_form) {
  Calls& calls = calls_from(function);
  Key key;
  std::vector<at::Tensor> tensors;
  if (!make_key(calls, args.ptr(), key, tensors)) {
    return pybind11::none();
  }
  driver();  // libcuda opens here, or the registration fails
  auto call = std::make_shared<Prepared>();
  call->device = device;
  for (auto output : outputs) {
    auto pair = output.cast<pybind11::tuple>();
    call->outputs.push_back(buffer_of(pair[0], pair[1]));
  }
  if (static_cast<Py_ssize_t>(call->outputs.size()) != calls.outputs) {
    throw std::invalid_argument("fusegen: register_call: wrong number of outputs");
  }
  if (!statistics.is_none()) {
    auto pair = statistics.cast<pybind11::tuple>();
    call->has_statistics = true;
    call->statistics = buffer_of(pair[0], pair[1]);
  }
  call->values = tensors.size() + call->outputs.size() + 2;
  if (launch_form.is_none()) {
    call->launch_pending = true;
  } else {
    call->launch = launch_of(launch_form, call->values);
  }
  if (bare_form.ptr() == Py_True) {
    call->bare_pending = true;
  } else if (!bare_form.is_none()) {
    call->has_bare = true;
    call->bare = launch_of(bare_form, call->values);
  }
  call->python = std::move(prepared);
  call->seed = std::move(seed);
  call->hooks = calls.hooks;
  if (calls.prepared.size() >= kCacheSize) {
    calls.prepared.clear();
  }
  calls.prepared[std::move(key)] = call;
  return pybind11::cast(PlanRef{call});
}

// Registers a launch of a call registered with it pending: the bare one (for calls that no
// gradient follows) or the keeping one; a launch form, or None (those calls then stay in Python).
void register_pending(const PlanRef& ref, const pybind11::object& form, bool bare) {
  std::shared_ptr<Prepared> call = ref.call.lock();
  if (!call || form.is_none()) {
    return;  // forgotten (its op's cache was full, or cleared), or no form the C++ call takes
  }
  if (bare) {
    call->bare = launch_of(form, call->values);
    call->has_bare = true;
    call->bare_pending = false;
  } else {
    call->launch = launch_of(form, call->values);
    call->launch_pending = false;
  }
}

// Registers a backward of a call: for the gradients asked for (`needs`, one per input) and
// incoming gradients like `grads`, the backward kernel's launch (None: no gradient is the
// kernel's), its targets, one per gradient it computes: None or (summed, buffer shape,
// buffer dtype, gradient shape, gradient dtype, sums launch or None); and one source per
// input: None, ("kernel", target), ("output", output) or ("input", earlier input).
void register_backward(const PlanRef& ref, const std::vector<bool>& needs, const pybind11::tuple& grads,
                       const pybind11::object& launch_form, const pybind11::list& targets,
                       const pybind11::list& sources) {
  std::shared_ptr<Prepared> call = ref.call.lock();
  if (!call) {
    return;  // forgotten (its op's cache was full, or cleared)
  }
  if (sources.size() != needs.size()) {
    throw std::invalid_argument("fusegen: register_backward: one source per input");
  }
  Key key;
  for (bool need : needs) {
    key.push_back(need);
  }
  for (auto g : grads) {
    if (!THPVariable_Check(g.ptr())) {
      throw std::invalid_argument("fusegen: register_backward: a gradient is not a tensor");
    }
    add_tensor(key, THPVariable_Unpack(g.ptr()));
  }
  PreparedBackward b;
  b.launches = !launch_form.is_none();
  if (b.launches) {
    const size_t values = needs.size() + grads.size() + targets.size() + 2;
    b.launch = launch_of(launch_form, values);
  }
  for (auto entry : targets) {
    Target t;
    if (!entry.is_none()) {
      auto form = entry.cast<pybind11::tuple>();
      t.needed = true;
      t.summed = form[0].cast<bool>();
      t.buffer = buffer_of(form[1], form[2]);
      if (t.summed) {
        t.result = buffer_of(form[3], form[4]);
        t.sums = launch_of(form[5], 2);
      }
    }
    b.targets.push_back(std::move(t));
  }
  for (size_t i = 0; i < needs.size(); ++i) {
    Source source;
    pybind11::handle entry = sources[i];
    if (!entry.is_none()) {
      auto form = entry.cast<pybind11::tuple>();
      const auto kind = form[0].cast<std::string>();
      source.index = form[1].cast<int>();
      const bool in_range = kind == "kernel"   ? source.index >= 0 && source.index < static_cast<int>(b.targets.size()) &&
                                                    b.targets[source.index].needed
                            : kind == "output" ? source.index >= 0 && source.index < static_cast<int>(grads.size())
                            : kind == "input"  ? source.index >= 0 && source.index < static_cast<int>(i) &&
                                                    needs[source.index]
                                               : false;
      if (!in_range || (kind == "kernel" && !b.launches)) {
        throw std::invalid_argument("fusegen: register_backward: a gradient's source is out of range");
      }
      source.kind = kind == "kernel" ? Source::kKernel : kind == "output" ? Source::kOutput : Source::kInput;
    }
    if ((source.kind != Source::kNone) != needs[i]) {
      throw std::invalid_argument("fusegen: register_backward: sources and needs disagree");
    }
    b.sources.push_back(source);
  }
  std::lock_guard<std::mutex> lock(call->mutex);
  if (call->backwards.size() < kCacheSize) {  // never erased: a node may be reading one
    call->backwards.emplace(std::move(key), std::move(b));
  }
}

// For tests: the key of `args` as a tuple (None: not a call this path takes), and counts.
pybind11::object call_key(const pybind11::object& function, const pybind11::object& args) {
  Key key;
  std::vector<at::Tensor> tensors;
  if (!make_key(calls_from(function), args.ptr(), key, tensors)) {
    return pybind11::none();
  }
  return pybind11::tuple(pybind11::cast(key));
}

pybind11::tuple counts(const pybind11::object& function) {
  Calls& calls = calls_from(function);
  return pybind11::make_tuple(calls.prepared.size(), calls.hits, calls.hooks->backward_hits.load(), calls.seeds);
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def(
      "attach",
      [](pybind11::object backward, pybind11::object state, std::string name,
         const torch::autograd::variable_list& inputs, const torch::autograd::variable_list& outputs,
         const torch::autograd::variable_list& saved) {
        return fusegen::attach(std::move(backward), std::move(state), std::move(name), inputs, outputs, saved);
      },
      "Put a fusegen autograd node behind `outputs` (autograd_node.cpp).");
  pybind11::class_<PlanRef>(m, "PlanRef", "A registered call key's Prepared, held weakly (eager_call.cpp).");
  m.def("new_calls", &new_calls, "A new op's eager call (see eager_call.cpp's head).");
  m.def("register_call", &register_call, "Register the call key of `args` (see eager_call.cpp).");
  m.def("register_pending", &register_pending, "Register a call key's launch registered as pending.");
  m.def("register_backward", &register_backward, "Register a backward of a registered call key.");
  m.def("call_key", &call_key, "The key of a call, or None (for tests).");
  m.def("configure_seeds", &configure_seeds, "Seeds per batch and their exclusive bound (runtime.dropout's).");
  m.def("take_seed", [](int device) { return pybind11::reinterpret_steal<pybind11::object>(THPVariable_Wrap(next_seed(device))); },
        "The device's next eager seed, a one-element int64 tensor (see eager_call.cpp's eager seeds).");
  m.def("standing_seeds", &standing_seeds, "(batch, seeds taken) of the device's standing batch, or None (for tests).");
  m.def("counts", &counts, "(call keys registered, forward calls taken, backwards taken, seeds taken) of an op's eager call.");
}
