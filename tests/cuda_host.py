"""The CUDA backend's launcher and kernels run on the CPU, for tests on a machine without a GPU.

The generated source is compiled by g++ with its `__global__` kernels as host functions that a
loop calls for every block and thread of the grid (blockIdx, blockDim, threadIdx and gridDim are
host variables); the launcher (fusegen.backends.cuda.launch) runs unchanged but for its two
GPU-bound calls, which `on_the_host` replaces: loading a kernel (here: the host build of its
expression) and launching it (here: cuda-core's own ParamHolder packs the arguments, as a launch
does, and the loop runs the kernel over the grid). So the arguments' order and types, the views,
the grid, the index arithmetic and the gradients' sums are the ones a GPU launch takes. A row
kernel's block runs one thread, or (`row_threads`) up to that many as host threads that run
together, its block reductions by a barrier and a slot a thread (_HOST)."""
from __future__ import annotations

import contextlib
import ctypes
import hashlib
import subprocess
from pathlib import Path

import torch

from fusegen.backends.cuda import compiler
from fusegen.backends.cuda import launch as cuda_launch
from fusegen.backends.cuda import row_launch

_HOST = r'''
#include <barrier>
#include <cstddef>
#include <cstdio>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>
struct FusegenDim3 { unsigned x = 0, y = 0, z = 0; };
static thread_local FusegenDim3 blockIdx, threadIdx;  // a block's threads may run as host threads
static FusegenDim3 blockDim, gridDim;
#define __global__
#define __shared__
#define __launch_bounds__(...)
// A block's reduction where its threads run as host threads: each thread's value in a slot,
// every thread combining all slots in order once all have arrived.
static std::barrier<>* fusegen_block_barrier;
static double fusegen_block_slots[1024];
#define FUSEGEN_HOST_BLOCK_REDUCE
// A block's dynamic shared memory: the launch's size, the blocks run one after another.
static std::vector<unsigned char> fusegen_dynamic_bytes;
#define FUSEGEN_HOST_DYNAMIC_SHARED
namespace fusegen {
inline unsigned char* dynamic_shared() { return fusegen_dynamic_bytes.data(); }
template <typename T, typename Op>
inline T block_reduce(T value, T*, T neutral, Op op) {
  if (blockDim.x == 1) return value;
  fusegen_block_slots[threadIdx.x] = double(value);
  fusegen_block_barrier->arrive_and_wait();
  T total = neutral;
  for (unsigned t = 0; t < blockDim.x; ++t) total = op(total, T(fusegen_block_slots[t]));
  fusegen_block_barrier->arrive_and_wait();  // every thread has read the slots
  return total;
}
}  // namespace fusegen
'''
_RUN = r'''
template <typename... P, size_t... I>
static void fusegen_call(void (*f)(P...), void** args, std::index_sequence<I...>) {
  f(*static_cast<std::remove_cv_t<std::remove_reference_t<P>>*>(args[I])...);
}
// Every block of the grid in turn; its threads one after another, or (threaded) as host threads
// that run together (a block's reductions wait for all of them).
template <typename... P>
static int fusegen_run(void (*f)(P...), void** args, int count, unsigned gx, unsigned gy, unsigned bx, bool threaded,
                       unsigned shared) {
  if (count != (int)sizeof...(P)) return 1;  // the launcher's arguments and the kernel's parameters disagree
  fusegen_dynamic_bytes.assign(shared, 0xff);  // poisoned: a kernel reads only what it wrote
  gridDim.x = gx; gridDim.y = gy; gridDim.z = 1; blockDim.x = bx; blockDim.y = blockDim.z = 1;
  for (unsigned y = 0; y < gy; ++y)
    for (unsigned x = 0; x < gx; ++x) {
      if (!threaded) {
        for (unsigned t = 0; t < bx; ++t) {
          blockIdx.x = x; blockIdx.y = y; threadIdx.x = t;
          fusegen_call(f, args, std::index_sequence_for<P...>{});
        }
        continue;
      }
      std::barrier<> barrier(bx);
      fusegen_block_barrier = &barrier;
      std::vector<std::thread> threads;
      for (unsigned t = 0; t < bx; ++t)
        threads.emplace_back([=] {
          blockIdx.x = x; blockIdx.y = y; threadIdx.x = t;
          fusegen_call(f, args, std::index_sequence_for<P...>{});
        });
      for (auto& thread : threads) thread.join();
    }
  return 0;
}
'''


class HostKernels:
    """Host builds of kernels, one shared library an expression, in `folder`."""

    def __init__(self, folder: Path):
        self.folder, self._libraries = folder, {}

    def library(self, source: str, expression: str):
        key = hashlib.sha256((source + expression).encode()).hexdigest()[:16]
        library = self._libraries.get(key)
        if library is None:
            text = _HOST + source.replace("#ifdef __CUDACC__", "#if 1") + _RUN
            text += (f'extern "C" int run(void** a, int n, unsigned gx, unsigned gy, unsigned bx, bool threaded, '
                     f"unsigned shared) {{ return fusegen_run(&{expression}, a, n, gx, gy, bx, threaded, shared); }}\n")
            cpp, so = self.folder / f"{key}.cpp", self.folder / f"{key}.so"
            cpp.write_text(text)
            subprocess.run(["g++", "-std=c++20", "-O1", "-shared", "-fPIC", "-w", "-pthread", f"-I{compiler.HEADER.parent}",
                            str(cpp), "-o", str(so)], check=True,
                           capture_output=True)
            library = self._libraries[key] = ctypes.CDLL(str(so))
            library.run.restype = ctypes.c_int
            library.run.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_uint, ctypes.c_uint, ctypes.c_uint, ctypes.c_bool,
                                    ctypes.c_uint]
        return library


class _Properties:  # an H100's: the backward's blocks of rows and the rows held as there
    multi_processor_count = 132
    shared_memory_per_multiprocessor = 233472
    major, minor = 9, 0  # on a GPU machine torch's lazy CUDA init asks these (Dynamo saves the RNG state)
    name = "NVIDIA H100 80GB HBM3"


@contextlib.contextmanager
def on_the_host(folder: Path, monkeypatch, row_threads: int = 1):
    """The CUDA backend's ops run their kernels on the CPU (module docstring) while inside; a row
    kernel's block `row_threads` threads at most (more than one: run as host threads)."""
    from cuda.core._kernel_arg_handler import ParamHolder

    kernels = HostKernels(folder)
    launches = []

    def kernel(self, device, expression):
        return self.kernels.source, expression

    def launch(kernel, device, config, arguments):  # the config: (grid, block, shared), cuda_launch._config's stand-in
        source, expression = kernel
        (grid, block, shared) = config
        launches.append((expression, grid))
        holder = ParamHolder(arguments)
        threaded = 1 < block <= row_threads  # a row kernel's block (a pointwise one's is cuda_launch.BLOCK)
        if kernels.library(source, expression).run(holder.ptr, len(arguments), grid[0], grid[1], block, threaded, shared):
            raise AssertionError(f"{expression}: the launcher's {len(arguments)} arguments are not the kernel's")

    monkeypatch.setattr(cuda_launch._BoundCuda, "kernel", kernel)
    monkeypatch.setattr(cuda_launch._BoundCuda, "compile_together", lambda self, device, expressions: None)  # kernel's
    monkeypatch.setattr(cuda_launch, "_launch", launch)
    monkeypatch.setattr(cuda_launch, "_config", lambda grid, block=cuda_launch.BLOCK, shared=0, cluster=1: (grid, block, shared))
    monkeypatch.setattr(cuda_launch, "_allow", lambda kernel, device, shared, cluster=1: None)
    # A row backward: a block an SM.
    monkeypatch.setattr(cuda_launch, "_resident", lambda kernel, device, threads, shared, cluster=1: 1)
    monkeypatch.setattr(row_launch, "MAX_CLUSTER", 1)  # clusters run on the GPU only
    # A row kernel's block reductions need its threads to run together: as many as the host runs so.
    monkeypatch.setattr(row_launch, "MAX_THREADS", row_threads)
    monkeypatch.setattr(row_launch, "MIN_THREADS", min(row_threads, row_launch.MIN_THREADS))
    monkeypatch.setattr(cuda_launch._BoundCuda, "check_device", lambda self, device: None)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device=None: _Properties())
    yield launches
