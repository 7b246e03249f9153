// Native replay of eager launch plans (dispatch/native_replay.py builds and drives it).
//
// One call from Python does what LaunchPlan.__call__ does: the call's signature key from the argument tuple
// (the fields of dispatch/ops/_common.py `_signature`), the plan lookup, the allocations, the pointer slots, one
// cuLaunchKernelEx per compiled kernel on the current stream with the parameters packed as Triton's launcher packs
// them, and the outputs (allocations, inputs or views of allocations). A call whose key has no plan returns the
// module's MISS object.
//
// Allocations: the plan's small ones share one block per call (one at::empty; each allocation a tensor of its own
// on the block's storage at the 256-byte aligned offset dispatch/native_replay.py `block_layout` gave it), the
// zero-filled ones first so that one driver memset zeroes them all; larger ones are allocated alone
// (at::empty_strided, zeroed by a driver memset). A copy from a dense view of an input is one driver memcpy
// (other copies stay ATen copies).
//
// The CUDA driver entry points and the parameter packing are in _replay_driver.h (no CUDA header or library is
// needed to build either file); calls of compiled CuTeDSL functions through the TVM-FFI C ABI in _replay_cute.h.

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_strided.h>
#include <c10/core/TensorImpl.h>
#include <torch/csrc/Dtype.h>
#include <torch/csrc/autograd/python_variable.h>

#include <unistd.h>

#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "_replay_driver.h"
#include "_replay_cute.h"

namespace {

// ------------------------------------------------------------------------------------------------ plans
struct Alloc {
  std::vector<int64_t> sizes, strides;
  at::ScalarType dtype;
  bool zero = false;
  int copy_input = -1;  // input index of the copied view, -1: none
  std::vector<int64_t> copy_sizes, copy_strides;
  int64_t copy_offset = 0;  // storage offset relative to the input's
  bool copy_flat = false;  // the copied view and the allocation are both dense in row-major order: one memcpy
  int64_t block_offset = -1;  // byte offset in the call's block, -1: allocated alone
  int64_t nbytes = 0;         // bytes it spans (what a zero-fill clears)
};

struct Slot {
  size_t param;
  bool from_input;
  int index;
  int64_t offset;
};

// A tensor descriptor parameter (kTma): the CUtensorMap Triton 3.6's launcher encodes (fillTMADescriptor), for
// the base address of input / allocation `index` plus `offset` bytes; everything else is fixed per signature.
struct TmaSlot {
  size_t param;
  bool from_input;
  int index;
  int64_t offset;
  int elem_type, swizzle, fill;
  unsigned rank;
  uint64_t dims[5], strides[5];  // innermost first; strides in bytes (rank - 1 of them)
  unsigned box[5];
};

struct Launch {
  CUfunction function;
  unsigned gx, gy, gz, num_warps, num_ctas, shared;
  bool pdl;
  std::vector<char> blob;  // every parameter at an 8-byte (a kTma 64-byte) aligned offset, the two scratch
                           // pointers last (null)
  std::vector<size_t> offsets;
  std::vector<Slot> slots;
  std::vector<TmaSlot> tma;
  std::shared_ptr<CuteCall> cute;  // a CuTe call instead (the fields above unused)
};

struct Out {
  enum Kind { kTuple, kConst, kInput, kAlloc, kView } kind;
  int index = 0;
  std::vector<int64_t> sizes, strides;
  int64_t offset = 0;
  at::ScalarType dtype = at::ScalarType::Undefined;
  PyObject* value = nullptr;  // kConst (a strong reference)
  std::vector<Out> children;
};

struct Plan {
  c10::Device device{c10::DeviceType::CPU};
  std::vector<Alloc> allocs;
  std::vector<Launch> launches;
  Out out;
  PyObject* keep = nullptr;  // strong reference: what the plan's constant pointers point into
  int64_t block_bytes = 0;   // the per-call block (0: none)
  int64_t block_zero = 0;    // bytes zeroed from the block's start
  bool needs_driver = false;  // launches or device memsets
  bool cute = false;          // CuTe calls: TVM-FFI's env stream is the current device's (another one: MISS)
};

std::unordered_map<std::string, std::unique_ptr<Plan>> g_plans;
// Ops with a registered plan: a call of any other op misses before its key is built (the Python path then keys it).
std::unordered_set<std::string> g_ops;
std::vector<std::string> g_env_names;  // eager_env.SELECT_ENV and the native knob; the last one set means: no key
PyObject* g_scope = nullptr;           // the backend-scope context variable (registry._scoped)
PyObject* g_miss = nullptr;            // returned when a call has no plan
PyObject* g_get_device = nullptr;      // torch._C._cuda_getDevice
PyObject* g_get_stream = nullptr;      // torch._C._cuda_getCurrentRawStream

template <typename T>
void put(std::string& key, const T& v) {
  key.append(reinterpret_cast<const char*>(&v), sizeof(T));
}

// The env names' part of the key (false: the last name is set, no key). Recomputed with getenv only when the
// process environment changed: the environ array and each of its entry pointers are compared with a snapshot
// (setenv / unsetenv / putenv, which os.environ uses, replace an entry's pointer or the array), ~100 pointer
// compares instead of a getenv scan per name.
struct EnvCache {
  bool valid = false, keyed = true;
  char** base = nullptr;
  std::vector<char*> entries;
  std::string part;
};
EnvCache g_env;

bool env_part(std::string& key) {
  bool same = g_env.valid && g_env.base == environ;
  size_t n = 0;
  for (char** e = environ; same && e && *e; ++e, ++n) same = n < g_env.entries.size() && g_env.entries[n] == *e;
  if (!same || n != g_env.entries.size()) {
    g_env.part.clear();
    g_env.keyed = true;
    for (size_t i = 0; i < g_env_names.size(); ++i) {
      const char* v = getenv(g_env_names[i].c_str());
      if (v && i + 1 == g_env_names.size()) g_env.keyed = false;
      if (v) {
        g_env.part.push_back('S');
        put(g_env.part, std::strlen(v));
        g_env.part.append(v);
      } else {
        g_env.part.push_back('N');
      }
    }
    g_env.base = environ;
    g_env.entries.clear();
    for (char** e = environ; e && *e; ++e) g_env.entries.push_back(*e);
    g_env.valid = true;
  }
  key.append(g_env.part);
  return g_env.keyed;
}

// The call's key: op name, env values, then per argument what `_signature` keeps. False: no key (a kind of
// argument or a state that always takes the checked path); a Python error may then be set only on failure.
bool make_key(PyObject* name, PyObject* args, std::string& key) {
  Py_ssize_t n;
  const char* s = PyUnicode_AsUTF8AndSize(name, &n);
  if (!s) return false;
  key.append(s, n);
  key.push_back('\0');
  if (!env_part(key)) return false;
  if (g_scope) {
    PyObject* scope = nullptr;
    if (PyContextVar_Get(g_scope, nullptr, &scope) < 0) return false;
    bool empty = scope && PyTuple_Check(scope) && PyTuple_GET_SIZE(scope) == 0;
    Py_XDECREF(scope);
    if (!empty) return false;
  }
  Py_ssize_t count = PyTuple_GET_SIZE(args);
  for (Py_ssize_t i = 0; i < count; ++i) {
    PyObject* a = PyTuple_GET_ITEM(args, i);
    if (a == Py_None) {
      key.push_back('n');
    } else if (PyBool_Check(a)) {
      key.push_back(a == Py_True ? 'T' : 'F');
    } else if (PyLong_CheckExact(a)) {
      int overflow = 0;
      long long v = PyLong_AsLongLongAndOverflow(a, &overflow);
      if (overflow || (v == -1 && PyErr_Occurred())) {
        PyErr_Clear();
        return false;
      }
      key.push_back('i');
      put(key, v);
    } else if (PyFloat_CheckExact(a)) {
      key.push_back('f');
      put(key, PyFloat_AS_DOUBLE(a));
    } else if (PyUnicode_CheckExact(a)) {
      Py_ssize_t len;
      const char* str = PyUnicode_AsUTF8AndSize(a, &len);
      if (!str) return false;
      key.push_back('s');
      put(key, len);
      key.append(str, len);
    } else if (Py_TYPE(a) == &THPDtypeType) {
      key.push_back('d');
      put(key, static_cast<int8_t>(reinterpret_cast<THPDtype*>(a)->scalar_type));
    } else if (THPVariable_Check(a)) {
      const at::Tensor& t = THPVariable_Unpack(a);
      if (t.requires_grad() || t.layout() != c10::kStrided || !t.has_storage()) return false;
      key.push_back('t');
      put(key, static_cast<int8_t>(t.scalar_type()));
      put(key, static_cast<int8_t>(t.device().type()));
      put(key, static_cast<int8_t>(t.device().index()));
      put(key, static_cast<int32_t>(t.dim()));
      for (int64_t d : t.sizes()) put(key, d);
      for (int64_t d : t.strides()) put(key, d);
      auto ptr = reinterpret_cast<uintptr_t>(t.data_ptr());
      put(key, static_cast<uint8_t>((t.storage_offset() & 15) << 4 | (ptr & 15)));
    } else {
      return false;
    }
  }
  return true;
}

// ------------------------------------------------------------------------------- plan description parsing
bool dtype_of(PyObject* obj, at::ScalarType& out) {
  if (Py_TYPE(obj) != &THPDtypeType) {
    PyErr_SetString(PyExc_TypeError, "expected a torch.dtype");
    return false;
  }
  out = reinterpret_cast<THPDtype*>(obj)->scalar_type;
  return true;
}

bool parse_alloc(PyObject* d, Alloc& a) {
  PyObject *sizes, *strides, *dtype, *copy;
  int zero;
  long long block_offset = -1, nbytes = 0;
  if (!PyArg_ParseTuple(d, "OOOpO|LL", &sizes, &strides, &dtype, &zero, &copy, &block_offset, &nbytes)) return false;
  a.zero = zero;
  a.block_offset = block_offset;
  a.nbytes = nbytes;
  if (!int_list(sizes, a.sizes) || !int_list(strides, a.strides) || !dtype_of(dtype, a.dtype)) return false;
  if (copy != Py_None) {
    PyObject *csizes, *cstrides;
    long long rel;
    if (!PyArg_ParseTuple(copy, "iOOL", &a.copy_input, &csizes, &cstrides, &rel)) return false;
    a.copy_offset = rel;
    if (!int_list(csizes, a.copy_sizes) || !int_list(cstrides, a.copy_strides)) return false;
  }
  return true;
}

// (param, from_input, index, offset, elem_type, swizzle, fill, dims, strides, box) -> a TmaSlot.
bool parse_tma(PyObject* d, Py_ssize_t n_params, const uint8_t* codes, TmaSlot& t) {
  Py_ssize_t param;
  int from_input;
  long long offset;
  PyObject *dims, *strides, *box;
  if (!PyArg_ParseTuple(d, "npiLiiiOOO", &param, &from_input, &t.index, &offset, &t.elem_type, &t.swizzle, &t.fill,
                        &dims, &strides, &box))
    return false;
  std::vector<int64_t> dv, sv, bv;
  if (!int_list(dims, dv) || !int_list(strides, sv) || !int_list(box, bv)) return false;
  if (param < 0 || param >= n_params || codes[param] != kTma || dv.empty() || dv.size() > 5 ||
      sv.size() + 1 != dv.size() || bv.size() != dv.size()) {
    PyErr_SetString(PyExc_ValueError, "a bad tensor-descriptor slot");
    return false;
  }
  t.param = static_cast<size_t>(param);
  t.from_input = from_input;
  t.offset = offset;
  t.rank = static_cast<unsigned>(dv.size());
  for (unsigned i = 0; i < t.rank; ++i) {
    t.dims[i] = static_cast<uint64_t>(dv[i]);
    t.box[i] = static_cast<unsigned>(bv[i]);
    t.strides[i] = i + 1 < t.rank ? static_cast<uint64_t>(sv[i]) : 0;
  }
  return true;
}

bool parse_launch(PyObject* d, Launch& l) {
  unsigned long long function;
  int pdl;
  PyObject *types, *values, *slots, *tma = nullptr;
  if (PyTuple_Check(d) && PyTuple_GET_SIZE(d) && PyUnicode_Check(PyTuple_GET_ITEM(d, 0))) {
    l.cute = std::make_shared<CuteCall>();
    return parse_cute(d, *l.cute);
  }
  if (!PyArg_ParseTuple(d, "KIIIIIIpSOO|O", &function, &l.gx, &l.gy, &l.gz, &l.num_warps, &l.num_ctas, &l.shared,
                        &pdl, &types, &values, &slots, &tma))
    return false;
  l.function = reinterpret_cast<CUfunction>(function);
  l.pdl = pdl;
  if (!pack_values(types, values, true, l.blob, l.offsets)) return false;
  Py_ssize_t n = PyBytes_GET_SIZE(types);
  const uint8_t* codes = reinterpret_cast<const uint8_t*>(PyBytes_AS_STRING(types));
  for (int i = 0; i < 2; ++i) {  // the global and profile scratch pointers: null
    l.offsets.push_back(l.blob.size());
    l.blob.resize(l.blob.size() + 8, 0);
  }
  PyObject* sfast = PySequence_Fast(slots, "expected a sequence of pointer slots");
  if (!sfast) return false;
  for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(sfast); ++i) {
    Slot s;
    Py_ssize_t param;
    int from_input;
    long long offset;
    if (!PyArg_ParseTuple(PySequence_Fast_GET_ITEM(sfast, i), "npiL", &param, &from_input, &s.index, &offset) ||
        param < 0 || param >= n || codes[param] != kPtr) {
      Py_DECREF(sfast);
      if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "a pointer slot on a non-pointer parameter");
      return false;
    }
    s.param = static_cast<size_t>(param);
    s.from_input = from_input;
    s.offset = offset;
    l.slots.push_back(s);
  }
  Py_DECREF(sfast);
  if (tma && tma != Py_None) {
    PyObject* tfast = PySequence_Fast(tma, "expected a sequence of tensor-descriptor slots");
    if (!tfast) return false;
    for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(tfast); ++i) {
      l.tma.emplace_back();
      if (!parse_tma(PySequence_Fast_GET_ITEM(tfast, i), n, codes, l.tma.back())) {
        Py_DECREF(tfast);
        return false;
      }
    }
    Py_DECREF(tfast);
  }
  return true;
}

bool parse_out(PyObject* d, Out& o) {
  if (!PyTuple_Check(d) || PyTuple_GET_SIZE(d) < 2) {
    PyErr_SetString(PyExc_ValueError, "bad output spec");
    return false;
  }
  const char* kind = PyUnicode_AsUTF8(PyTuple_GET_ITEM(d, 0));
  if (!kind) return false;
  PyObject* a1 = PyTuple_GET_ITEM(d, 1);
  if (!std::strcmp(kind, "tuple")) {
    o.kind = Out::kTuple;
    PyObject* fast = PySequence_Fast(a1, "expected a sequence of output specs");
    if (!fast) return false;
    for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(fast); ++i) {
      o.children.emplace_back();
      if (!parse_out(PySequence_Fast_GET_ITEM(fast, i), o.children.back())) {
        Py_DECREF(fast);
        return false;
      }
    }
    Py_DECREF(fast);
    return true;
  }
  if (!std::strcmp(kind, "const")) {
    o.kind = Out::kConst;
    Py_INCREF(a1);
    o.value = a1;
    return true;
  }
  o.index = static_cast<int>(PyLong_AsLong(a1));
  if (!std::strcmp(kind, "input")) {
    o.kind = Out::kInput;
  } else if (!std::strcmp(kind, "alloc")) {
    o.kind = Out::kAlloc;
  } else if (!std::strcmp(kind, "view") && PyTuple_GET_SIZE(d) == 6) {
    o.kind = Out::kView;
    o.offset = PyLong_AsLongLong(PyTuple_GET_ITEM(d, 4));
    if (!int_list(PyTuple_GET_ITEM(d, 2), o.sizes) || !int_list(PyTuple_GET_ITEM(d, 3), o.strides) ||
        !dtype_of(PyTuple_GET_ITEM(d, 5), o.dtype))
      return false;
  } else {
    PyErr_Format(PyExc_ValueError, "bad output spec kind %s", kind);
    return false;
  }
  return PyErr_Occurred() == nullptr;
}

void release_out(Out& o) {
  Py_XDECREF(o.value);
  o.value = nullptr;
  for (auto& c : o.children) release_out(c);
}

void release(Plan* p) {
  release_out(p->out);
  Py_XDECREF(p->keep);
  p->keep = nullptr;
}

// ------------------------------------------------------------------------------------------------ replay
// A tensor of its own (own TensorImpl, version counter and metadata) on `root`'s storage, `byte_offset` bytes into
// it: what at::empty or a view makes, without a dispatcher call or an allocator call of its own.
at::Tensor tensor_on(const at::Tensor& root, at::ScalarType dtype, const std::vector<int64_t>& sizes,
                     const std::vector<int64_t>& strides, int64_t byte_offset) {
  c10::DispatchKeySet keys(root.is_cuda() ? c10::DispatchKey::CUDA : c10::DispatchKey::CPU);
  auto impl = c10::make_intrusive<c10::TensorImpl>(c10::Storage(root.storage()), keys,
                                                   caffe2::TypeMeta::fromScalarType(dtype));
  impl->set_sizes_and_strides(sizes, strides, byte_offset / static_cast<int64_t>(c10::elementSize(dtype)));
  return at::Tensor(std::move(impl));
}

PyObject* build_out(const Out& o, PyObject* args, const std::vector<at::Tensor>& allocs) {
  switch (o.kind) {
    case Out::kTuple: {
      PyObject* t = PyTuple_New(static_cast<Py_ssize_t>(o.children.size()));
      if (!t) return nullptr;
      for (size_t i = 0; i < o.children.size(); ++i) {
        PyObject* c = build_out(o.children[i], args, allocs);
        if (!c) {
          Py_DECREF(t);
          return nullptr;
        }
        PyTuple_SET_ITEM(t, static_cast<Py_ssize_t>(i), c);
      }
      return t;
    }
    case Out::kConst:
      Py_INCREF(o.value);
      return o.value;
    case Out::kInput: {
      PyObject* a = PyTuple_GET_ITEM(args, o.index);
      Py_INCREF(a);
      return a;
    }
    case Out::kAlloc:
      return THPVariable_Wrap(allocs[o.index]);
    case Out::kView: {
      // o.offset (elements of o.dtype) is relative to the allocation's start (a block member starts at its own
      // storage offset, a multiple of 256 bytes)
      const at::Tensor& root = allocs[o.index];
      int64_t start = root.storage_offset() * static_cast<int64_t>(root.element_size());
      return THPVariable_Wrap(tensor_on(root, o.dtype, o.sizes, o.strides,
                                        start + o.offset * static_cast<int64_t>(c10::elementSize(o.dtype))));
    }
  }
  return nullptr;
}

bool current_stream(CUstream& stream, long& device) {
  PyObject* dev = PyObject_CallNoArgs(g_get_device);
  if (!dev) return false;
  device = PyLong_AsLong(dev);
  PyObject* s = PyObject_CallOneArg(g_get_stream, dev);
  Py_DECREF(dev);
  if (!s) return false;
  stream = reinterpret_cast<CUstream>(PyLong_AsUnsignedLongLong(s));
  Py_DECREF(s);
  return PyErr_Occurred() == nullptr;
}

bool launch_one(const Launch& l, CUstream stream, PyObject* args, const std::vector<at::Tensor>& allocs) {
  if (static_cast<uint64_t>(l.gx) * l.gy * l.gz == 0) return true;  // Triton skips empty grids
  // The parameter block: the packed constants, then the pointer slots filled for this call.
  void* params[64];
  std::vector<void*> big;
  void** p = params;
  if (l.offsets.size() > 64) {
    big.resize(l.offsets.size());
    p = big.data();
  }
  alignas(64) char local[1024];
  std::vector<char> heap;
  char* blob = local;
  if (l.blob.size() > sizeof(local)) {  // 64-byte aligned, as the tensor maps in it must be
    heap.resize(l.blob.size() + 64);
    blob = heap.data() + (64 - reinterpret_cast<uintptr_t>(heap.data()) % 64) % 64;
  }
  std::memcpy(blob, l.blob.data(), l.blob.size());
  for (const Slot& s : l.slots) {
    const at::Tensor& t = s.from_input ? THPVariable_Unpack(PyTuple_GET_ITEM(args, s.index)) : allocs[s.index];
    uint64_t ptr = reinterpret_cast<uint64_t>(t.data_ptr()) + static_cast<uint64_t>(s.offset);
    std::memcpy(blob + l.offsets[s.param], &ptr, 8);
  }
  static const unsigned kElementStrides[5] = {1, 1, 1, 1, 1};
  for (const TmaSlot& s : l.tma) {  // interleave none, L2 promotion 128 B: as Triton's fillTMADescriptor
    const at::Tensor& t = s.from_input ? THPVariable_Unpack(PyTuple_GET_ITEM(args, s.index)) : allocs[s.index];
    char* base = static_cast<char*>(t.data_ptr()) + s.offset;
    if (!cuda_check(g_driver.encode_tiled(blob + l.offsets[s.param], s.elem_type, s.rank, base, s.dims, s.strides,
                                          s.box, kElementStrides, 0, s.swizzle, 2, s.fill)))
      return false;
  }
  for (size_t i = 0; i < l.offsets.size(); ++i) p[i] = blob + l.offsets[i];
  LaunchAttr attrs[4];
  std::memset(attrs, 0, sizeof(attrs));
  unsigned n = 0;
  if (l.pdl) {
    attrs[n].id = kAttrPdl;
    attrs[n++].value.i = 1;
  }
  if (l.num_ctas != 1) {
    attrs[n].id = kAttrClusterDim;
    attrs[n++].value.cluster_dim = {l.num_ctas, 1, 1};
    attrs[n].id = kAttrClusterPolicy;
    attrs[n++].value.i = kClusterPolicySpread;
    if (l.num_ctas == 16 && !cuda_check(g_driver.func_set_attribute(l.function, kFuncNonPortableCluster, 1)))
      return false;
  }
  LaunchConfig config{l.gx * l.num_ctas, l.gy, l.gz, 32 * l.num_warps, 1, 1, l.shared, stream, attrs, n};
  return cuda_check(g_driver.launch_ex(&config, l.function, p, nullptr));
}

PyObject* execute(const Plan& plan, PyObject* args) {
  bool cuda = plan.device.is_cuda();
  CUstream stream = nullptr;
  long device = -1;
  if (plan.needs_driver && (!ensure_context() || !current_stream(stream, device))) return nullptr;
  if (plan.cute && cuda && device != plan.device.index()) {
    Py_INCREF(g_miss);
    return g_miss;
  }
  auto options = at::TensorOptions().device(plan.device);
  at::Tensor block;
  if (plan.block_bytes) {
    block = at::empty({plan.block_bytes}, options.dtype(at::kByte));
    if (!zero_bytes(cuda, block.data_ptr(), static_cast<size_t>(plan.block_zero), stream)) return nullptr;
  }
  std::vector<at::Tensor> allocs;
  allocs.reserve(plan.allocs.size());
  for (const Alloc& a : plan.allocs) {
    at::Tensor t;
    if (a.block_offset >= 0) {
      t = tensor_on(block, a.dtype, a.sizes, a.strides, a.block_offset);  // zeroed with the prefix where a.zero
    } else {
      t = at::empty_strided(a.sizes, a.strides, options.dtype(a.dtype));
      if (a.zero && !zero_bytes(cuda, t.data_ptr(), static_cast<size_t>(a.nbytes), stream)) return nullptr;
    }
    if (a.copy_input >= 0) {
      const at::Tensor& x = THPVariable_Unpack(PyTuple_GET_ITEM(args, a.copy_input));
      if (a.copy_flat) {  // a driver copy (no ATen op, no kernel of its own)
        const char* src = static_cast<const char*>(x.data_ptr()) + a.copy_offset * x.element_size();
        if (!copy_bytes(cuda, t.data_ptr(), src, static_cast<size_t>(t.numel() * t.element_size()), stream))
          return nullptr;
      } else {
        t.copy_(x.as_strided(a.copy_sizes, a.copy_strides, x.storage_offset() + a.copy_offset));
      }
    }
    allocs.push_back(std::move(t));
  }
  for (const Launch& l : plan.launches) {
    if (!(l.cute ? cute_call(*l.cute, plan.device, stream, args, allocs) : launch_one(l, stream, args, allocs)))
      return nullptr;
  }
  return build_out(plan.out, args, allocs);
}

// ---------------------------------------------------------------------------------------- module functions
// init(env_names, scope_contextvar, get_device, get_stream): what keys read, and how the stream is found.
PyObject* py_init(PyObject*, PyObject* args) {
  PyObject *names, *scope, *get_device, *get_stream;
  if (!PyArg_ParseTuple(args, "OOOO", &names, &scope, &get_device, &get_stream)) return nullptr;
  PyObject* fast = PySequence_Fast(names, "expected a sequence of env names");
  if (!fast) return nullptr;
  g_env_names.clear();
  g_env.valid = false;
  for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(fast); ++i) {
    const char* s = PyUnicode_AsUTF8(PySequence_Fast_GET_ITEM(fast, i));
    if (!s) {
      Py_DECREF(fast);
      return nullptr;
    }
    g_env_names.emplace_back(s);
  }
  Py_DECREF(fast);
  Py_XDECREF(g_scope);
  Py_XDECREF(g_get_device);
  Py_XDECREF(g_get_stream);
  g_scope = scope == Py_None ? nullptr : scope;
  Py_XINCREF(g_scope);
  Py_INCREF(get_device);
  Py_INCREF(get_stream);
  g_get_device = get_device;
  g_get_stream = get_stream;
  Py_RETURN_NONE;
}

// call(name, args): the op's outputs from its plan, or MISS.
PyObject* py_call(PyObject*, PyObject* const* argv, Py_ssize_t argc) {
  if (argc != 2 || !PyTuple_Check(argv[1])) {
    PyErr_SetString(PyExc_TypeError, "call(name, args: tuple)");
    return nullptr;
  }
  Py_ssize_t name_len = 0;
  const char* name = PyUnicode_AsUTF8AndSize(argv[0], &name_len);
  if (name == nullptr) return nullptr;
  if (g_ops.find(std::string(name, name_len)) == g_ops.end()) {
    Py_INCREF(g_miss);
    return g_miss;
  }
  std::string key;
  key.reserve(256);
  bool keyed;
  try {
    keyed = make_key(argv[0], argv[1], key);
  } catch (const std::exception&) {  // e.g. a tensor subclass without data: the Python path decides
    keyed = false;
  }
  if (!keyed) {
    if (PyErr_Occurred()) return nullptr;
    Py_INCREF(g_miss);
    return g_miss;
  }
  try {
    auto it = g_plans.find(key);
    if (it == g_plans.end()) {
      Py_INCREF(g_miss);
      return g_miss;
    }
    return execute(*it->second, argv[1]);
  } catch (const std::exception& e) {
    PyErr_SetString(PyExc_RuntimeError, e.what());
    return nullptr;
  }
}

// register(name, args, (device_type, device_index, allocs, launches, outputs, keep[, block_bytes, block_zero]))
// -> whether it was kept.
PyObject* py_register(PyObject*, PyObject* args) {
  PyObject *name, *call_args, *desc;
  if (!PyArg_ParseTuple(args, "UO!O!", &name, &PyTuple_Type, &call_args, &PyTuple_Type, &desc)) return nullptr;
  try {
    std::string key;
    if (!make_key(name, call_args, key)) {
      if (PyErr_Occurred()) return nullptr;
      Py_RETURN_FALSE;
    }
    const char* device_type;
    int device_index;
    PyObject *allocs, *launches, *outputs, *keep;
    long long block_bytes = 0, block_zero = 0;
    if (!PyArg_ParseTuple(desc, "siOOOO|LL", &device_type, &device_index, &allocs, &launches, &outputs, &keep,
                          &block_bytes, &block_zero))
      return nullptr;
    auto plan = std::make_unique<Plan>();
    plan->block_bytes = block_bytes;
    plan->block_zero = block_zero;
    bool cuda = !std::strcmp(device_type, "cuda");
    plan->device = cuda ? c10::Device(c10::DeviceType::CUDA, static_cast<c10::DeviceIndex>(device_index))
                        : c10::Device(c10::DeviceType::CPU);
    bool ok = true;
    PyObject* fa = PySequence_Fast(allocs, "allocs");
    if (!fa) return nullptr;
    for (Py_ssize_t i = 0; ok && i < PySequence_Fast_GET_SIZE(fa); ++i) {
      plan->allocs.emplace_back();
      ok = parse_alloc(PySequence_Fast_GET_ITEM(fa, i), plan->allocs.back());
    }
    Py_DECREF(fa);
    PyObject* fl = ok ? PySequence_Fast(launches, "launches") : nullptr;
    ok = ok && fl;
    for (Py_ssize_t i = 0; ok && i < PySequence_Fast_GET_SIZE(fl); ++i) {
      plan->launches.emplace_back();
      ok = parse_launch(PySequence_Fast_GET_ITEM(fl, i), plan->launches.back());
    }
    Py_XDECREF(fl);
    ok = ok && parse_out(outputs, plan->out);
    for (const Alloc& a : plan->allocs) {
      if (!ok) break;
      ok = a.block_offset < 0 ||
           (a.block_offset % 256 == 0 && a.block_offset + a.nbytes <= block_bytes &&
            (!a.zero || a.block_offset + a.nbytes <= block_zero));
      if (!ok) PyErr_SetString(PyExc_ValueError, "an allocation outside the call's block or misaligned in it");
      plan->needs_driver = plan->needs_driver || (cuda && a.zero && a.block_offset < 0 && a.nbytes > 0);
    }
    for (Alloc& a : plan->allocs) {  // dense copies become one memcpy (the source has the allocation's dtype)
      a.copy_flat = a.copy_input >= 0 && dense(a.sizes, a.strides) && dense(a.copy_sizes, a.copy_strides) &&
                    a.sizes == a.copy_sizes;
      plan->needs_driver = plan->needs_driver || (cuda && a.copy_flat);
    }
    if (ok && !(block_zero >= 0 && block_zero <= block_bytes)) {
      PyErr_SetString(PyExc_ValueError, "the zeroed prefix exceeds the call's block");
      ok = false;
    }
    plan->needs_driver = plan->needs_driver || (cuda && (!plan->launches.empty() || block_zero > 0));
    bool triton = false;
    for (const Launch& l : plan->launches) (l.cute ? plan->cute : triton) = true;
    if (ok && triton && !cuda) {
      PyErr_SetString(PyExc_RuntimeError, "kernel launches need a CUDA device");
      ok = false;
    } else if (ok && plan->needs_driver && !load_driver()) {
      PyErr_SetString(PyExc_RuntimeError, "libcuda.so.1 or a driver symbol is unavailable");
      ok = false;
    }
    for (const Launch& l : plan->launches) {
      if (ok && !l.tma.empty() && !g_driver.encode_tiled) {
        PyErr_SetString(PyExc_RuntimeError, "the driver has no cuTensorMapEncodeTiled");
        ok = false;
      }
    }
    if (!ok) {
      release(plan.get());
      return nullptr;
    }
    Py_INCREF(keep);
    plan->keep = keep;
    auto it = g_plans.find(key);
    if (it != g_plans.end()) release(it->second.get());
    g_plans[key] = std::move(plan);
    g_ops.emplace(PyUnicode_AsUTF8(name));
    Py_RETURN_TRUE;
  } catch (const std::exception& e) {
    PyErr_SetString(PyExc_RuntimeError, e.what());
    return nullptr;
  }
}

// lookup(name, args) -> whether a call with these arguments has a plan; drop(name, args): the same, and the plan
// is dropped.
PyObject* find_plan(PyObject* args, bool drop) {
  PyObject *name, *call_args;
  if (!PyArg_ParseTuple(args, "UO!", &name, &PyTuple_Type, &call_args)) return nullptr;
  try {
    std::string key;
    if (!make_key(name, call_args, key)) {
      if (PyErr_Occurred()) return nullptr;
      Py_RETURN_FALSE;
    }
    auto it = g_plans.find(key);
    if (it == g_plans.end()) Py_RETURN_FALSE;
    if (drop) {
      release(it->second.get());
      g_plans.erase(it);
    }
    Py_RETURN_TRUE;
  } catch (const std::exception& e) {
    PyErr_SetString(PyExc_RuntimeError, e.what());
    return nullptr;
  }
}

PyObject* py_lookup(PyObject*, PyObject* args) { return find_plan(args, false); }

PyObject* py_drop(PyObject*, PyObject* args) { return find_plan(args, true); }

PyObject* py_clear(PyObject*, PyObject*) {
  for (auto& kv : g_plans) release(kv.second.get());
  g_plans.clear();
  g_ops.clear();
  Py_RETURN_NONE;
}

// key(name, args) -> the key bytes, or None (for tests).
PyObject* py_key(PyObject*, PyObject* args) {
  PyObject *name, *call_args;
  if (!PyArg_ParseTuple(args, "UO!", &name, &PyTuple_Type, &call_args)) return nullptr;
  std::string key;
  if (!make_key(name, call_args, key)) {
    if (PyErr_Occurred()) return nullptr;
    Py_RETURN_NONE;
  }
  return PyBytes_FromStringAndSize(key.data(), static_cast<Py_ssize_t>(key.size()));
}

PyMethodDef kMethods[] = {
    {"init", py_init, METH_VARARGS, "init(env_names, scope_var, get_device, get_stream)"},
    {"call", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(py_call)), METH_FASTCALL,
     "call(name, args) -> outputs or MISS"},
    {"register", py_register, METH_VARARGS, "register(name, args, plan_description) -> bool"},
    {"lookup", py_lookup, METH_VARARGS, "lookup(name, args) -> bool"},
    {"drop", py_drop, METH_VARARGS, "drop(name, args) -> whether a plan was dropped"},
    {"clear", py_clear, METH_NOARGS, "drop every plan"},
    {"pack", py_pack, METH_VARARGS, "pack(type_codes, values) -> bytes"},
    {"key", py_key, METH_VARARGS, "key(name, args) -> bytes or None"},
    {"init_tvm_ffi", py_init_tvm_ffi, METH_VARARGS, "init_tvm_ffi(libtvm_ffi path) -> whether it loaded"},
    {"memset", py_memset, METH_VARARGS, "memset(ptr, nbytes, stream): zero device memory with the driver"},
    {nullptr, nullptr, 0, nullptr}};

PyModuleDef kModule = {PyModuleDef_HEAD_INIT, "lowbit_replay", nullptr, -1, kMethods};

}  // namespace

#define LOWBIT_CAT2(a, b) a##b
#define LOWBIT_CAT(a, b) LOWBIT_CAT2(a, b)

PyMODINIT_FUNC LOWBIT_CAT(PyInit_, TORCH_EXTENSION_NAME)(void) {
  PyObject* m = PyModule_Create(&kModule);
  if (!m) return nullptr;
  g_miss = PyObject_CallNoArgs(reinterpret_cast<PyObject*>(&PyBaseObject_Type));
  if (!g_miss) {
    Py_DECREF(m);
    return nullptr;
  }
  Py_INCREF(g_miss);
  if (PyModule_AddObject(m, "MISS", g_miss) < 0) {
    Py_DECREF(g_miss);
    Py_DECREF(m);
    return nullptr;
  }
  return m;
}
