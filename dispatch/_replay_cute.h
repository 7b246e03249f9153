// CuTe calls in a native replay (included by _replay.cpp): a compiled CuTeDSL function (`cute.compile(...,
// options="--enable-tvm-ffi")`, a tvm_ffi.Function) called through the TVM-FFI C ABI, as TVM-FFI's Python binding
// calls it, without Python: each tensor argument a DLTensor built here (the data pointer of an input or allocation
// plus a byte offset; shape, strides and dtype fixed by the plan), None / int / bool / float arguments as TVMFFIAny
// values, and, on CUDA, the replay's stream set as TVM-FFI's environment stream of the tensors' device for the call
// (TVMFFIEnvSetStream; the compiled host code reads it with TVMFFIEnvGetStream) and the previous one restored.
//
// libtvm_ffi is the one TVM-FFI's Python package loaded (its path from dispatch/native_replay.py, opened with
// dlopen: the same library, so the same environment streams and error state); the few C ABI structs and entry
// points used are declared here (no TVM-FFI or DLPack header is needed to build).

#pragma once

#include <dlfcn.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace {

struct FfiDevice {
  int32_t type, id;  // kDLCPU = 1, kDLCUDA = 2
};
struct FfiDType {
  uint8_t code, bits;
  uint16_t lanes;
};
struct FfiDLTensor {  // DLPack's DLTensor
  void* data;
  FfiDevice device;
  int32_t ndim;
  FfiDType dtype;
  int64_t* shape;
  int64_t* strides;
  uint64_t byte_offset;
};
struct FfiAny {  // TVMFFIAny
  int32_t type_index;
  uint32_t zero_padding;
  union {
    int64_t v_int64;
    double v_float64;
    void* v_ptr;
  };
};
struct FfiObjectHeader {  // TVMFFIObject
  uint64_t combined_ref_count;
  int32_t type_index;
  uint32_t padding;
  void* deleter;
};
struct FfiByteArray {
  const char* data;
  size_t size;
};
struct FfiErrorCell {  // follows the object header of an Error
  FfiByteArray kind, message;
};
// TVMFFITypeIndex values of the arguments passed here; objects (results to release) start at 64.
enum : int32_t { kFfiNone = 0, kFfiInt = 1, kFfiBool = 2, kFfiFloat = 3, kFfiDLTensorPtr = 7, kFfiObjectBegin = 64 };
constexpr int32_t kDLCPUType = 1, kDLCUDAType = 2;

struct TvmFfi {
  int (*function_call)(void*, FfiAny*, int32_t, FfiAny*) = nullptr;
  int (*env_set_stream)(int32_t, int32_t, void*, void**) = nullptr;
  void (*error_move_from_raised)(void**) = nullptr;
  int (*object_dec_ref)(void*) = nullptr;
};
TvmFfi g_ffi;

struct CuteArg {
  int32_t kind = kFfiNone;  // a kFfi* type index
  bool from_input = false;  // kFfiDLTensorPtr: input / allocation `index` plus `offset` bytes
  int index = 0;
  int64_t offset = 0;
  std::vector<int64_t> shape, strides;
  FfiDType dtype{0, 0, 1};
  int64_t v_int = 0;
  double v_float = 0;
};

struct CuteCall {
  void* function = nullptr;  // the TVMFFIObjectHandle (the plan keeps the Python function alive)
  std::vector<CuteArg> args;
};

// init_tvm_ffi(path): open libtvm_ffi (the loaded one) and take its entry points; False where it cannot.
PyObject* py_init_tvm_ffi(PyObject*, PyObject* args) {
  const char* path;
  if (!PyArg_ParseTuple(args, "s", &path)) return nullptr;
  void* lib = dlopen(path, RTLD_NOW | RTLD_NOLOAD);
  if (!lib) lib = dlopen(path, RTLD_NOW | RTLD_GLOBAL);
  if (!lib) Py_RETURN_FALSE;
  TvmFfi f;
  f.function_call = reinterpret_cast<decltype(f.function_call)>(dlsym(lib, "TVMFFIFunctionCall"));
  f.env_set_stream = reinterpret_cast<decltype(f.env_set_stream)>(dlsym(lib, "TVMFFIEnvSetStream"));
  f.error_move_from_raised = reinterpret_cast<decltype(f.error_move_from_raised)>(dlsym(lib, "TVMFFIErrorMoveFromRaised"));
  f.object_dec_ref = reinterpret_cast<decltype(f.object_dec_ref)>(dlsym(lib, "TVMFFIObjectDecRef"));
  if (!f.function_call || !f.env_set_stream || !f.error_move_from_raised || !f.object_dec_ref) Py_RETURN_FALSE;
  g_ffi = f;
  Py_RETURN_TRUE;
}

// ("cute", function handle, [argument]) with each argument (kFfiNone,) / (kFfiInt | kFfiBool, int) /
// (kFfiFloat, float) / (kFfiDLTensorPtr, from_input, index, byte offset, shape, strides, dl code, dl bits).
bool parse_cute(PyObject* d, CuteCall& c) {
  const char* kind;
  unsigned long long function;
  PyObject* args;
  if (!PyArg_ParseTuple(d, "sKO", &kind, &function, &args)) return false;
  if (!g_ffi.function_call) {
    PyErr_SetString(PyExc_RuntimeError, "libtvm_ffi is not loaded (init_tvm_ffi)");
    return false;
  }
  c.function = reinterpret_cast<void*>(function);
  PyObject* fast = PySequence_Fast(args, "expected a sequence of CuTe call arguments");
  if (!fast) return false;
  bool ok = true;
  for (Py_ssize_t i = 0; ok && i < PySequence_Fast_GET_SIZE(fast); ++i) {
    PyObject* a = PySequence_Fast_GET_ITEM(fast, i);
    CuteArg arg;
    ok = PyTuple_Check(a) && PyTuple_GET_SIZE(a) >= 1;
    if (ok) arg.kind = static_cast<int32_t>(PyLong_AsLong(PyTuple_GET_ITEM(a, 0)));
    if (!ok || PyErr_Occurred()) {
      ok = false;
    } else if (arg.kind == kFfiNone) {
    } else if (arg.kind == kFfiInt || arg.kind == kFfiBool) {
      ok = PyArg_ParseTuple(a, "iL", &arg.kind, &arg.v_int);
    } else if (arg.kind == kFfiFloat) {
      ok = PyArg_ParseTuple(a, "id", &arg.kind, &arg.v_float);
    } else if (arg.kind == kFfiDLTensorPtr) {
      int from_input, code, bits;
      long long offset;
      PyObject *shape, *strides;
      ok = PyArg_ParseTuple(a, "ipiLOOii", &arg.kind, &from_input, &arg.index, &offset, &shape, &strides, &code,
                            &bits) &&
           int_list(shape, arg.shape) && int_list(strides, arg.strides) && arg.shape.size() == arg.strides.size();
      arg.from_input = from_input;
      arg.offset = offset;
      arg.dtype = {static_cast<uint8_t>(ok ? code : 0), static_cast<uint8_t>(ok ? bits : 0), 1};
    } else {
      ok = false;
    }
    if (!ok && !PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "a bad CuTe call argument");
    if (ok) c.args.push_back(std::move(arg));
  }
  Py_DECREF(fast);
  return ok;
}

// The pending TVM-FFI error as a Python RuntimeError.
void raise_ffi_error() {
  void* err = nullptr;
  g_ffi.error_move_from_raised(&err);
  if (!err) {
    PyErr_SetString(PyExc_RuntimeError, "a TVM-FFI call failed without an error");
    return;
  }
  const auto* cell = reinterpret_cast<const FfiErrorCell*>(static_cast<const char*>(err) + sizeof(FfiObjectHeader));
  std::string text(cell->kind.data, cell->kind.size);
  text.append(": ").append(cell->message.data, cell->message.size);
  PyErr_SetString(PyExc_RuntimeError, text.c_str());
  g_ffi.object_dec_ref(err);
}

// One call of c.function with the tensors of this replay (`args`: the public call's argument tuple).
bool cute_call(const CuteCall& c, const c10::Device& device, void* stream, PyObject* args,
               const std::vector<at::Tensor>& allocs) {
  const size_t n = c.args.size();
  FfiAny local_any[24];
  FfiDLTensor local_dl[24];
  std::vector<FfiAny> heap_any;
  std::vector<FfiDLTensor> heap_dl;
  FfiAny* any = local_any;
  FfiDLTensor* dl = local_dl;
  if (n > 24) {
    heap_any.resize(n);
    heap_dl.resize(n);
    any = heap_any.data();
    dl = heap_dl.data();
  }
  const FfiDevice dev{device.is_cuda() ? kDLCUDAType : kDLCPUType, device.is_cuda() ? device.index() : 0};
  for (size_t i = 0; i < n; ++i) {
    const CuteArg& a = c.args[i];
    any[i].type_index = a.kind;
    any[i].zero_padding = 0;
    any[i].v_int64 = 0;
    if (a.kind == kFfiInt || a.kind == kFfiBool) {
      any[i].v_int64 = a.v_int;
    } else if (a.kind == kFfiFloat) {
      any[i].v_float64 = a.v_float;
    } else if (a.kind == kFfiDLTensorPtr) {
      const at::Tensor& t = a.from_input ? THPVariable_Unpack(PyTuple_GET_ITEM(args, a.index)) : allocs[a.index];
      dl[i] = {static_cast<char*>(t.data_ptr()) + a.offset, dev, static_cast<int32_t>(a.shape.size()), a.dtype,
               const_cast<int64_t*>(a.shape.data()), const_cast<int64_t*>(a.strides.data()), 0};
      any[i].v_ptr = &dl[i];
    }
  }
  void* previous = nullptr;
  const bool cuda = device.is_cuda();
  if (cuda && g_ffi.env_set_stream(kDLCUDAType, dev.id, stream, &previous) != 0) {
    raise_ffi_error();
    return false;
  }
  FfiAny result;
  result.type_index = kFfiNone;
  result.zero_padding = 0;
  result.v_int64 = 0;
  int rc = g_ffi.function_call(c.function, any, static_cast<int32_t>(n), &result);
  if (rc != 0) raise_ffi_error();  // before the restore below: it may raise an error of its own
  if (cuda && previous != stream) {
    void* ignored = nullptr;
    if (g_ffi.env_set_stream(kDLCUDAType, dev.id, previous, &ignored) != 0 && rc == 0) {
      raise_ffi_error();
      rc = -1;
    }
  }
  if (rc == 0 && result.type_index >= kFfiObjectBegin && result.v_ptr) g_ffi.object_dec_ref(result.v_ptr);
  return rc == 0;
}

}  // namespace
