// The CUDA driver entry points, Triton's parameter packing and small parsing helpers of the native replay
// (included by _replay.cpp only): no CUDA header or library is needed to build it, the few driver prototypes and
// structs are declared here, and libcuda.so.1 is opened with dlopen on the first registered plan that launches a
// kernel or zeroes or copies device memory. The module functions `pack` and `memset` (for tests) are here too.

#pragma once

#include <Python.h>
#include <dlfcn.h>

#include <cstdint>
#include <cstring>
#include <vector>

namespace {

// ---------------------------------------------------------------------------------------- CUDA driver, by hand
using CUresult = int;
using CUcontext = void*;
using CUstream = void*;
using CUfunction = void*;
using CUdevice = int;

union LaunchAttrValue {  // CUlaunchAttributeValue: a 64-byte union
  char pad[64];
  struct { unsigned x, y, z; } cluster_dim;
  int i;
  void* align;
};
struct LaunchAttr {  // CUlaunchAttribute
  int id;
  char pad[4];
  LaunchAttrValue value;
};
struct LaunchConfig {  // CUlaunchConfig
  unsigned grid_x, grid_y, grid_z, block_x, block_y, block_z, shared;
  CUstream stream;
  LaunchAttr* attrs;
  unsigned num_attrs;
};
constexpr int kAttrCooperative = 2, kAttrClusterDim = 4, kAttrClusterPolicy = 5, kAttrPdl = 6;
constexpr int kClusterPolicySpread = 1, kFuncNonPortableCluster = 14;

struct Driver {
  CUresult (*launch_ex)(const LaunchConfig*, CUfunction, void**, void**) = nullptr;
  CUresult (*ctx_get_current)(CUcontext*) = nullptr;
  CUresult (*device_get)(CUdevice*, int) = nullptr;
  CUresult (*primary_ctx_retain)(CUcontext*, CUdevice) = nullptr;
  CUresult (*ctx_set_current)(CUcontext) = nullptr;
  CUresult (*func_set_attribute)(CUfunction, int, int) = nullptr;
  CUresult (*get_error_string)(CUresult, const char**) = nullptr;
  CUresult (*memset_d8)(uint64_t, unsigned char, size_t, CUstream) = nullptr;
  CUresult (*memset_d32)(uint64_t, unsigned int, size_t, CUstream) = nullptr;
  CUresult (*memcpy_async)(uint64_t, uint64_t, size_t, CUstream) = nullptr;
  // cuTensorMapEncodeTiled (optional: only plans with tensor descriptors need it)
  CUresult (*encode_tiled)(void*, int, unsigned, void*, const uint64_t*, const uint64_t*, const unsigned*,
                           const unsigned*, int, int, int, int) = nullptr;
  bool ok = false;
};
Driver g_driver;

template <typename F>
bool load_symbol(void* lib, const char* name, F& out) {
  out = reinterpret_cast<F>(dlsym(lib, name));
  return out != nullptr;
}

bool load_driver() {
  if (g_driver.ok) return true;
  void* lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_GLOBAL);
  if (!lib) return false;
  Driver d;
  d.ok = load_symbol(lib, "cuLaunchKernelEx", d.launch_ex) && load_symbol(lib, "cuCtxGetCurrent", d.ctx_get_current) &&
         load_symbol(lib, "cuDeviceGet", d.device_get) &&
         load_symbol(lib, "cuDevicePrimaryCtxRetain", d.primary_ctx_retain) &&
         load_symbol(lib, "cuCtxSetCurrent", d.ctx_set_current) &&
         load_symbol(lib, "cuFuncSetAttribute", d.func_set_attribute) &&
         load_symbol(lib, "cuGetErrorString", d.get_error_string) &&
         load_symbol(lib, "cuMemsetD8Async", d.memset_d8) && load_symbol(lib, "cuMemsetD32Async", d.memset_d32) &&
         load_symbol(lib, "cuMemcpyAsync", d.memcpy_async);
  if (d.ok) {
    load_symbol(lib, "cuTensorMapEncodeTiled", d.encode_tiled);
    g_driver = d;
  }
  return d.ok;
}

bool cuda_check(CUresult r) {
  if (r == 0) return true;
  const char* msg = nullptr;
  if (g_driver.get_error_string) g_driver.get_error_string(r, &msg);
  PyErr_Format(PyExc_RuntimeError, "lowbit native replay [CUDA]: %s (%d)", msg ? msg : "unknown error", r);
  return false;
}

bool ensure_context() {  // as Triton's launcher: a context must be current (device 0's primary one otherwise)
  CUcontext ctx = nullptr;
  if (!cuda_check(g_driver.ctx_get_current(&ctx))) return false;
  if (ctx) return true;
  CUdevice dev;
  return cuda_check(g_driver.device_get(&dev, 0)) && cuda_check(g_driver.primary_ctx_retain(&ctx, dev)) &&
         cuda_check(g_driver.ctx_set_current(ctx));
}

// Zeroes n bytes at ptr: on the device with one asynchronous driver memset on `stream` (32-bit words where ptr
// and n allow, else bytes), on the host with memset. No ATen op and no kernel launch of its own.
bool zero_bytes(bool cuda, void* ptr, size_t n, CUstream stream) {
  if (n == 0) return true;
  if (!cuda) {
    std::memset(ptr, 0, n);
    return true;
  }
  auto p = reinterpret_cast<uint64_t>(ptr);
  if (p % 4 == 0 && n % 4 == 0) return cuda_check(g_driver.memset_d32(p, 0u, n / 4, stream));
  return cuda_check(g_driver.memset_d8(p, 0, n, stream));
}

// Copies n bytes from src to dst: on the device with one asynchronous driver copy on `stream` (unified
// addressing: any two device pointers), on the host with memcpy.
bool copy_bytes(bool cuda, void* dst, const void* src, size_t n, CUstream stream) {
  if (n == 0) return true;
  if (!cuda) {
    std::memcpy(dst, src, n);
    return true;
  }
  return cuda_check(g_driver.memcpy_async(reinterpret_cast<uint64_t>(dst), reinterpret_cast<uint64_t>(src), n, stream));
}

// ------------------------------------------------------------------------------------- small helpers
bool int_list(PyObject* seq, std::vector<int64_t>& out) {
  PyObject* fast = PySequence_Fast(seq, "expected a sequence of ints");
  if (!fast) return false;
  Py_ssize_t n = PySequence_Fast_GET_SIZE(fast);
  for (Py_ssize_t i = 0; i < n; ++i) {
    out.push_back(PyLong_AsLongLong(PySequence_Fast_GET_ITEM(fast, i)));
  }
  Py_DECREF(fast);
  return PyErr_Occurred() == nullptr;
}

// Row-major dense (strides of size-1 dimensions do not matter).
bool dense(const std::vector<int64_t>& sizes, const std::vector<int64_t>& strides) {
  int64_t expected = 1;
  for (size_t i = sizes.size(); i-- > 0;) {
    if (sizes[i] == 0) return true;
    if (sizes[i] != 1 && strides[i] != expected) return false;
    expected *= sizes[i];
  }
  return true;
}

// ------------------------------------------------------------------------------------- parameter packing
// Type codes: Triton 3.9's extractor indices (driver.c); Triton 3.6's generated launcher maps to the same sizes
// (dispatch/native_replay.py translates its signature strings).
// kTma: a CUtensorMap passed by value (128 bytes, 64-byte aligned), encoded per call (TmaSlot in _replay.cpp).
enum : uint8_t { kPtr = 1, kI8, kI16, kI32, kI64, kU8, kU16, kU32, kU64, kFp16, kBf16, kFp32, kFp64, kTma, kTypeEnd };

size_t param_size(uint8_t t) {
  switch (t) {
    case kTma: return 128;
    case kI8: case kU8: return 1;
    case kI16: case kU16: case kFp16: case kBf16: return 2;
    case kI32: case kU32: case kFp32: return 4;
    default: return 8;
  }
}

// Writes v as a parameter of type t at dst (param_size(t) bytes); false with a Python error set otherwise.
bool pack_one(uint8_t t, PyObject* v, char* dst) {
  if (t == kTma) {  // encoded per call; zeros until then
    std::memset(dst, 0, 128);
  } else if (t == kPtr) {
    uint64_t p = v == Py_None ? 0 : PyLong_AsUnsignedLongLong(v);
    std::memcpy(dst, &p, 8);
  } else if (t >= kI8 && t <= kU64) {
    // Two's complement truncation to the parameter's width, as the launchers' C casts do.
    uint64_t u;
    if (t == kU64) {
      u = PyLong_AsUnsignedLongLong(v);
    } else {
      u = static_cast<uint64_t>(PyLong_AsLongLong(v));
    }
    std::memcpy(dst, &u, param_size(t));  // little-endian: the low bytes
  } else if (t >= kFp16 && t <= kFp64) {
    double d = PyFloat_AsDouble(v);
    if (t == kFp16) {
#if 0x030600B1 <= PY_VERSION_HEX && PY_VERSION_HEX <= 0x030B00A1
      _PyFloat_Pack2(d, reinterpret_cast<unsigned char*>(dst), 1);
#else
      PyFloat_Pack2(d, dst, 1);
#endif
    } else if (t == kBf16) {  // Triton truncates the fp32 value's low half
      float f = static_cast<float>(d);
      uint32_t u;
      std::memcpy(&u, &f, 4);
      uint16_t h = static_cast<uint16_t>(u >> 16);
      std::memcpy(dst, &h, 2);
    } else if (t == kFp32) {
      float f = static_cast<float>(d);
      std::memcpy(dst, &f, 4);
    } else {
      std::memcpy(dst, &d, 8);
    }
  } else {
    PyErr_Format(PyExc_ValueError, "unsupported parameter type code %d", static_cast<int>(t));
    return false;
  }
  return PyErr_Occurred() == nullptr;
}

// Packs values[i] as type types[i]: at 8-byte aligned offsets (aligned) or back to back; the offsets are appended.
bool pack_values(PyObject* types, PyObject* values, bool aligned, std::vector<char>& out, std::vector<size_t>& offsets) {
  Py_ssize_t n = PyBytes_GET_SIZE(types);
  const uint8_t* codes = reinterpret_cast<const uint8_t*>(PyBytes_AS_STRING(types));
  PyObject* fast = PySequence_Fast(values, "expected a sequence of parameter values");
  if (!fast) return false;
  bool ok = PySequence_Fast_GET_SIZE(fast) == n;
  if (!ok) PyErr_SetString(PyExc_ValueError, "parameter types and values differ in length");
  for (Py_ssize_t i = 0; ok && i < n; ++i) {
    size_t align = codes[i] == kTma ? 64 : 8;
    size_t at = aligned ? out.size() + (align - out.size() % align) % align : out.size();
    size_t size = param_size(codes[i]);
    out.resize(at + (aligned && size < 8 ? 8 : size), 0);
    offsets.push_back(at);
    alignas(64) char buf[128] = {0};
    ok = pack_one(codes[i], PySequence_Fast_GET_ITEM(fast, i), buf);
    std::memcpy(out.data() + at, buf, size);
  }
  Py_DECREF(fast);
  return ok;
}

// ------------------------------------------------------------------------- module functions for tests
// pack(type_codes: bytes, values) -> the parameters' bytes back to back, each param_size(code) long.
PyObject* py_pack(PyObject*, PyObject* args) {
  PyObject *types, *values;
  if (!PyArg_ParseTuple(args, "SO", &types, &values)) return nullptr;
  std::vector<char> out;
  std::vector<size_t> offsets;
  if (!pack_values(types, values, false, out, offsets)) return nullptr;
  return PyBytes_FromStringAndSize(out.data(), static_cast<Py_ssize_t>(out.size()));
}

// memset(ptr, nbytes, stream): the driver memset a zero-filled allocation gets (for tests with a stand-in driver).
PyObject* py_memset(PyObject*, PyObject* args) {
  unsigned long long ptr, stream;
  Py_ssize_t n;
  if (!PyArg_ParseTuple(args, "KnK", &ptr, &n, &stream)) return nullptr;
  if (!load_driver()) {
    PyErr_SetString(PyExc_RuntimeError, "libcuda.so.1 or a driver symbol is unavailable");
    return nullptr;
  }
  if (!zero_bytes(true, reinterpret_cast<void*>(ptr), static_cast<size_t>(n), reinterpret_cast<CUstream>(stream)))
    return nullptr;
  Py_RETURN_NONE;
}

}  // namespace
