// forge_torch's native host path: a managed weight's update repeating its
// plan, the Python path of forge_torch/optim.py (_forge_fused_update's
// plan branch: _forge_run_plan, _bridge.relaunch and _launch_on,
// _forge_advance_step), and a managed layer's forward count
// (_forge_before_forward), done in C++ where they hold.
//
// run_plan(optimizer, weight, grad_output, input, config) returns True once
// it has launched the update and done its bookkeeping, exactly as the Python
// path would have; False, having done nothing, wherever any check fails or
// a case is not one it takes (the first update of a param group in a step,
// the DLPack path, a step count it does not store, inference-tensor state,
// a lock held elsewhere): the Python path then runs, from its own checks.
// before_forward(optimizer, weight, input, amp) likewise returns the step
// the forward is counted in, None (a recomputation), or NotImplemented.
// Both read every object the Python path reads, live, and cache nothing
// between calls. forge_torch/_hot.py builds this file
// (torch.utils.cpp_extension) and hands it the modules whose objects it
// reads (setup(), with what the forge_torch package binds).
#include <Python.h>

#include <torch/csrc/DynamicTypes.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/autograd/variable.h>

#include <cstdint>

#ifndef TORCH_EXTENSION_NAME
#define TORCH_EXTENSION_NAME forge_torch_hot
#endif
#define FORGE_STR2(x) #x
#define FORGE_STR(x) FORGE_STR2(x)
#define FORGE_CONCAT2(a, b) a##b
#define FORGE_CONCAT(a, b) FORGE_CONCAT2(a, b)

namespace {

// A new reference, released at scope exit.
struct Ref {
  PyObject* o;
  explicit Ref(PyObject* o = nullptr) : o(o) {}
  Ref(const Ref&) = delete;
  Ref& operator=(const Ref&) = delete;
  ~Ref() { Py_XDECREF(o); }
  PyObject* get() const { return o; }
  explicit operator bool() const { return o != nullptr; }
};

// Bound by setup(): the modules whose attributes the Python path reads at
// each call (read here at each call too: tests stand them in), the ring
// class served in C++, and the attribute names, interned.
PyObject* g_clip = nullptr;    // forge_torch._clip
PyObject* g_bridge = nullptr;  // forge_torch._bridge
PyObject* g_direct = nullptr;  // forge_torch._direct
PyObject* g_optim = nullptr;   // forge_torch.optim
PyObject* g_ring_type = nullptr;  // _bridge._HparamsRing
PyObject* g_one = nullptr;        // the int 1

#define NAMES(X)                                                         \
  X(RUNNING) X(_forge_plans) X(_values) X(_refs) X(config)               \
  X(_forge_updated) X(_forge_plans_checked) X(_forge_generation) X(index) \
  X(seen) X(param_groups) X(state) X(step) X(record) X(slots) X(rule)    \
  X(_forge_steps) X(version) X(value) X(ptr) X(array) X(dtype)           \
  X(_forge_scalars) X(device) X(names) X(options) X(_forge_used)         \
  X(scalars) X(_packed) X(launch) X(unavailable) X(ring_key)             \
  X(_current_device) X(_stream_capturing) X(_raw_stream) X(key) X(ring)  \
  X(_LOCK) X(acquire) X(release) X(last_row) X(last_vec) X(keys)         \
  X(last_key) X(launches) X(last_use) X(ptrs) X(get) X(kernel)           \
  X(c_launch) X(launch_ptrs) X(STATS) X(calls) X(direct) X(in_place)     \
  X(n_state) X(native) X(_forge_pending_steps) X(_defers_step)          \
  X(_forge_groups_seen) X(_forge_members_checked) X(_forge_managed)      \
  X(SUPPORTED_DTYPES) X(_GRAPH_TASK_ID) X(_forge_calls)                  \
  X(_forge_accumulate_steps)

#define DECLARE(n) PyObject* s_##n = nullptr;
NAMES(DECLARE)
#undef DECLARE

inline PyObject* attr(PyObject* o, PyObject* name) {
  return PyObject_GetAttr(o, name);
}

// object.__hash__(o): the identity key of forge_torch's WeakIdMap.
inline PyObject* id_key(PyObject* o) {
  return PyLong_FromSsize_t(PyBaseObject_Type.tp_hash(o));
}

// dict.get(key) of a dict (or subclass): borrowed, nullptr if absent; -1 in
// *err on an error.
inline PyObject* dget(PyObject* d, PyObject* key, int* err) {
  PyObject* v = PyDict_GetItemWithError(d, key);
  if (v == nullptr && PyErr_Occurred()) *err = 1;
  return v;
}

inline bool is_none(PyObject* o) { return o == Py_None; }

// obj.<name>._values: the dict of one of the optimizer's WeakIdMaps (a new
// reference, or nullptr with an error set).
PyObject* map_values(PyObject* obj, PyObject* name) {
  PyObject* map = attr(obj, name);
  if (map == nullptr) return nullptr;
  PyObject* values = attr(map, s__values);
  Py_DECREF(map);
  return values;
}

// An int object equal to v (False where o is not an int).
inline int int_equals(PyObject* o, long long v) {
  if (!PyLong_Check(o)) return 0;
  int overflow = 0;
  long long got = PyLong_AsLongLongAndOverflow(o, &overflow);
  if (got == -1 && PyErr_Occurred()) return -1;
  return !overflow && got == v;
}

// A tuple (torch.Size among them) of ints equal to v.
int shape_equals(PyObject* o, c10::IntArrayRef v) {
  if (!PyTuple_Check(o) || PyTuple_GET_SIZE(o) != (Py_ssize_t)v.size())
    return 0;
  for (size_t i = 0; i < v.size(); ++i) {
    int r = int_equals(PyTuple_GET_ITEM(o, i), v[i]);
    if (r != 1) return r;
  }
  return 1;
}

// _bridge._rows_shape(t) equal to the key's entry o: t's shape where 2-d,
// else (numel / n, n); a tensor without a last dimension, or with an empty
// one, is left to the Python path (0).
int rows_equal(PyObject* o, const at::Tensor& t) {
  if (t.dim() == 0 || t.size(-1) == 0) return 0;
  int64_t n = t.size(-1);
  int64_t rows[2] = {t.numel() / n, n};
  return shape_equals(o, c10::IntArrayRef(rows, 2));
}

inline PyObject* dtype_of(const at::Tensor& t) {
  return reinterpret_cast<PyObject*>(torch::getTHPDtype(t.scalar_type()));
}

// A call of a no-argument function, or with one argument.
inline PyObject* call0(PyObject* f) { return PyObject_CallNoArgs(f); }
inline PyObject* call1(PyObject* f, PyObject* a) {
  return PyObject_CallOneArg(f, a);
}

// obj.<name> += delta (an int attribute).
int add_to(PyObject* obj, PyObject* name, PyObject* delta) {
  Ref v(attr(obj, name));
  if (!v) return -1;
  Ref sum(PyNumber_Add(v.get(), delta));
  if (!sum) return -1;
  return PyObject_SetAttr(obj, name, sum.get());
}

constexpr int kMaxSlots = 8;

// The bridge's lock, acquired: released by release() or, on any other way
// out (a C++ exception), when it goes out of scope. An error raised before
// the release is kept, and chained to the release's own if it fails (as a
// `with` block's would be).
struct LockHeld {
  PyObject* lock;  // (held by the caller)
  bool held = true;
  int release() {
    if (!held) return 0;
    held = false;
    PyObject* pending = PyErr_GetRaisedException();
    PyObject* done = PyObject_CallMethodNoArgs(lock, s_release);
    if (done == nullptr) {
      if (pending != nullptr) {
        PyObject* now = PyErr_GetRaisedException();
        PyException_SetContext(now, pending);  // (steals pending)
        PyErr_SetRaisedException(now);
      }
      return -1;
    }
    Py_DECREF(done);
    if (pending != nullptr) PyErr_SetRaisedException(pending);
    return 0;
  }
  ~LockHeld() { release(); }
};

// 1: done; 0: not taken (nothing done); -1: a Python error is set.
int run(PyObject* opt, PyObject* p, PyObject* grad_output, PyObject* input,
        PyObject* config) {
  int err = 0;
  // Inside a clipped step's closure: the Python path (which refuses
  // another optimizer's layer).
  {
    Ref running(attr(g_clip, s_RUNNING));
    if (!running) return -1;
    int r = PyObject_IsTrue(running.get());
    if (r != 0) return r < 0 ? -1 : 0;
  }
  if (!THPVariable_Check(p) || !THPVariable_Check(grad_output) ||
      !THPVariable_Check(input))
    return 0;
  Ref pk(id_key(p));
  if (!pk) return -1;
  Ref plans(map_values(opt, s__forge_plans));
  if (!plans) return -1;
  if (!PyDict_Check(plans.get())) return 0;
  PyObject* plan_b = dget(plans.get(), pk.get(), &err);
  if (err) return -1;
  if (plan_b == nullptr) return 0;
  Py_INCREF(plan_b);
  Ref plan(plan_b);
  // --- _forge_run_plan ---
  Ref plan_config(attr(plan.get(), s_config));
  if (!plan_config) return -1;
  if (plan_config.get() != config) return 0;
  Ref updated_map(attr(opt, s__forge_updated));
  if (!updated_map) return -1;
  Ref updated(attr(updated_map.get(), s__values));
  if (!updated) return -1;
  Ref updated_refs(attr(updated_map.get(), s__refs));
  if (!updated_refs) return -1;
  if (!PyDict_Check(updated.get()) || !PyDict_Check(updated_refs.get()))
    return 0;
  int r = PyDict_Contains(updated.get(), pk.get());
  if (r != 0) return r < 0 ? -1 : 0;
  // (Marked updated at the end without a new weak reference: one exists.)
  r = PyDict_Contains(updated_refs.get(), pk.get());
  if (r != 1) return r < 0 ? -1 : 0;
  {  // the optimizer's modes, checked once per step in Python
    Ref checked(attr(opt, s__forge_plans_checked));
    if (!checked) return -1;
    Ref generation(attr(opt, s__forge_generation));
    if (!generation) return -1;
    r = PyObject_RichCompareBool(checked.get(), generation.get(), Py_EQ);
    if (r != 1) return r < 0 ? -1 : 0;
  }
  Ref index_o(attr(plan.get(), s_index));
  if (!index_o) return -1;
  Py_ssize_t index = PyLong_AsSsize_t(index_o.get());
  if (index == -1 && PyErr_Occurred()) return -1;
  Ref seen(attr(plan.get(), s_seen));
  if (!seen) return -1;
  if (!PyList_Check(seen.get()) || index < 0 ||
      index >= PyList_GET_SIZE(seen.get()))
    return 0;
  // (Held: Python code runs below, the stand-ins' and Tensor.__hash__.)
  Ref group_ref(PyList_GET_ITEM(seen.get(), index));
  Py_INCREF(group_ref.get());
  PyObject* group = group_ref.get();
  Ref groups(attr(opt, s_param_groups));
  if (!groups) return -1;
  if (!PyList_Check(groups.get()) || index >= PyList_GET_SIZE(groups.get()) ||
      PyList_GET_ITEM(groups.get(), index) != group || !PyDict_Check(group))
    return 0;
  Ref state(attr(plan.get(), s_state));
  if (!state) return -1;
  Ref step(attr(plan.get(), s_step));
  if (!step) return -1;
  Ref record(attr(plan.get(), s_record));
  if (!record) return -1;
  {
    Ref all_state(attr(opt, s_state));
    if (!all_state) return -1;
    if (!PyDict_Check(all_state.get()) || !PyDict_Check(state.get()))
      return 0;
    PyObject* s = dget(all_state.get(), p, &err);  // Tensor.__hash__
    if (err) return -1;
    if (s != state.get()) return 0;
  }
  PyObject* state_step = dget(state.get(), s_step, &err);
  if (err) return -1;
  if ((state_step ? state_step : Py_None) != step.get()) return 0;
  // A family without a step count (step None): no "step" entry at all.
  if (is_none(step.get()) && state_step != nullptr) return 0;
  Ref slots(attr(plan.get(), s_slots));
  if (!slots) return -1;
  Ref rule(attr(plan.get(), s_rule));
  if (!rule) return -1;
  Ref slot_names(attr(rule.get(), s_slots));
  if (!slot_names) return -1;
  if (!PyTuple_Check(slots.get()) || !PyTuple_Check(slot_names.get()) ||
      PyTuple_GET_SIZE(slots.get()) != PyTuple_GET_SIZE(slot_names.get()) ||
      PyTuple_GET_SIZE(slots.get()) > kMaxSlots)
    return 0;
  const Py_ssize_t n_slots = PyTuple_GET_SIZE(slots.get());
  for (Py_ssize_t i = 0; i < n_slots; ++i) {
    PyObject* s = dget(state.get(), PyTuple_GET_ITEM(slot_names.get(), i),
                       &err);
    if (err) return -1;
    if (s != PyTuple_GET_ITEM(slots.get(), i)) return 0;
    if (!THPVariable_Check(s)) return 0;
  }
  // The step count: its record this optimizer wrote, still current.
  Ref t;
  bool deferred = false;  // the count advanced at the step's end
  Ref record_array;
  if (!is_none(step.get())) {
    if (!THPVariable_Check(step.get())) return 0;
    const at::Tensor& st = THPVariable_Unpack(step.get());
    Ref steps(map_values(opt, s__forge_steps));
    if (!steps) return -1;
    Ref step_key(id_key(step.get()));
    if (!step_key) return -1;
    if (!PyDict_Check(steps.get())) return 0;
    PyObject* rec = dget(steps.get(), step_key.get(), &err);
    if (err) return -1;
    if (rec != record.get()) return 0;
    Ref version(attr(record.get(), s_version));
    if (!version) return -1;
    r = int_equals(version.get(), st._version());
    if (r != 1) return r;
    Ref value(attr(record.get(), s_value));
    if (!value) return -1;
    if (is_none(value.get())) return 0;
    Ref ptr(attr(record.get(), s_ptr));
    if (!ptr) return -1;
    r = int_equals(ptr.get(), reinterpret_cast<intptr_t>(st.data_ptr()));
    if (r != 1) return r;
    t.o = PyNumber_Add(value.get(), g_one);
    if (!t) return -1;
    // How _forge_advance_step will store it, decided before the launch:
    // deferred to the step's end (on a GPU: optim._defers_step); else
    // through its record's NumPy view (the tensor's memory and dtype still
    // the record's); any other way (fill_) is the Python path's.
    {
      Ref defers_fn(attr(g_optim, s__defers_step));
      if (!defers_fn) return -1;
      Ref defers(call1(defers_fn.get(), step.get()));
      if (!defers) return -1;
      r = PyObject_IsTrue(defers.get());
      if (r < 0) return -1;
      deferred = r == 1;
    }
    if (!deferred) {
      record_array.o = attr(record.get(), s_array);
      if (!record_array) return -1;
      if (is_none(record_array.get())) return 0;
      Ref dtype(attr(record.get(), s_dtype));
      if (!dtype) return -1;
      if (dtype.get() != dtype_of(st)) return 0;
    }
  } else {
    Py_INCREF(Py_None);
    t.o = Py_None;
  }
  // The group's rule and scalars, valid for the group's options.
  Ref shared;
  {
    Ref all_scalars(attr(opt, s__forge_scalars));
    if (!all_scalars) return -1;
    if (!PyDict_Check(all_scalars.get())) return 0;
    PyObject* sh = dget(all_scalars.get(), index_o.get(), &err);
    if (err) return -1;
    if (sh == nullptr || is_none(sh)) return 0;
    Py_INCREF(sh);
    shared.o = sh;
  }
  {  // _SharedScalars.valid_for(group, plan.device)
    Ref device(attr(shared.get(), s_device));
    if (!device) return -1;
    Ref plan_device(attr(plan.get(), s_device));
    if (!plan_device) return -1;
    r = PyObject_RichCompareBool(device.get(), plan_device.get(), Py_EQ);
    if (r != 1) return r < 0 ? -1 : 0;
    Ref names(attr(shared.get(), s_names));
    if (!names) return -1;
    Ref options(attr(shared.get(), s_options));
    if (!options) return -1;
    if (!PyTuple_Check(names.get()) || !PyTuple_Check(options.get()))
      return 0;
    Py_ssize_t n = PyDict_Size(group);
    if (n != PyTuple_GET_SIZE(names.get()) ||
        n != PyTuple_GET_SIZE(options.get()))
      return 0;
    Py_ssize_t pos = 0, i = 0;
    PyObject *k, *v;
    while (PyDict_Next(group, &pos, &k, &v)) {
      if (PyTuple_GET_ITEM(options.get(), i) != v) return 0;
      PyObject* name = PyTuple_GET_ITEM(names.get(), i);
      if (name != k) {
        r = PyObject_RichCompareBool(name, k, Py_EQ);
        if (r != 1) return r < 0 ? -1 : 0;
      }
      ++i;
    }
  }
  {
    Ref shared_rule(attr(shared.get(), s_rule));
    if (!shared_rule) return -1;
    if (shared_rule.get() != rule.get()) return 0;
    Ref used(attr(opt, s__forge_used));
    if (!used) return -1;
    if (!PyDict_Check(used.get())) return 0;
    r = PyDict_Contains(used.get(), index_o.get());
    if (r != 1) return r < 0 ? -1 : 0;
  }
  Ref vec;
  {
    Ref by_step(attr(shared.get(), s_scalars));
    if (!by_step) return -1;
    if (!PyDict_Check(by_step.get())) return 0;
    Ref scalars_key(PyTuple_Pack(2, t.get(), Py_False));
    if (!scalars_key) return -1;
    PyObject* scalars = dget(by_step.get(), scalars_key.get(), &err);
    if (err) return -1;
    if (scalars == nullptr || is_none(scalars)) return 0;
    vec.o = attr(scalars, s__packed);
    if (!vec) return -1;
    if (is_none(vec.get())) return 0;
  }
  Ref launch(attr(plan.get(), s_launch));
  if (!launch) return -1;
  if (is_none(launch.get())) return 0;  // the DLPack path
  // --- _bridge.relaunch ---
  {
    Ref unavailable_fn(attr(g_direct, s_unavailable));
    if (!unavailable_fn) return -1;
    Ref why(call0(unavailable_fn.get()));
    if (!why) return -1;
    if (!is_none(why.get())) return 0;
  }
  Ref ring_key(attr(launch.get(), s_ring_key));
  if (!ring_key) return -1;
  if (!PyTuple_Check(ring_key.get()) || PyTuple_GET_SIZE(ring_key.get()) < 1)
    return 0;
  PyObject* device_index_o = PyTuple_GET_ITEM(ring_key.get(), 0);
  long long device_index = PyLong_AsLongLong(device_index_o);
  if (device_index == -1 && PyErr_Occurred()) return -1;
  // The kernel's operands x and dy (G = x^T dy): grad_output and input, as
  // _forge_run_plan passes them to _bridge.relaunch.
  const at::Tensor& x = THPVariable_Unpack(grad_output);
  const at::Tensor& dy = THPVariable_Unpack(input);
  const at::Tensor& w = THPVariable_Unpack(p);
  {
    Ref current_fn(attr(g_bridge, s__current_device));
    if (!current_fn) return -1;
    Ref current(call0(current_fn.get()));
    if (!current) return -1;
    r = int_equals(current.get(), device_index);
    if (r != 1) return r;
  }
  if (x.get_device() != device_index || dy.get_device() != device_index)
    return 0;
  {
    Ref capturing_fn(attr(g_bridge, s__stream_capturing));
    if (!capturing_fn) return -1;
    Ref capturing(call0(capturing_fn.get()));
    if (!capturing) return -1;
    r = PyObject_IsTrue(capturing.get());
    if (r != 0) return r < 0 ? -1 : 0;
  }
  Ref stream;
  {
    Ref stream_fn(attr(g_bridge, s__raw_stream));
    if (!stream_fn) return -1;
    stream.o = call1(stream_fn.get(), device_index_o);
    if (!stream) return -1;
  }
  // launch.key == _launch_key(x, dy, w, slots, device_index, stream,
  // len(vec), rule, config), element by element.
  {
    Ref key(attr(launch.get(), s_key));
    if (!key) return -1;
    if (!PyTuple_Check(key.get()) ||
        PyTuple_GET_SIZE(key.get()) != 7 + n_slots + 5)
      return 0;
    PyObject** k = &PyTuple_GET_ITEM(key.get(), 0);
    if ((r = rows_equal(k[0], x)) != 1) return r;
    if ((r = rows_equal(k[1], dy)) != 1) return r;
    if (k[2] != dtype_of(x) || k[3] != dtype_of(dy)) return 0;
    if ((r = shape_equals(k[4], w.sizes())) != 1) return r;
    if ((r = shape_equals(k[5], w.strides())) != 1) return r;
    if (k[6] != dtype_of(w)) return 0;
    for (Py_ssize_t i = 0; i < n_slots; ++i) {
      PyObject* e = k[7 + i];
      const at::Tensor& s =
          THPVariable_Unpack(PyTuple_GET_ITEM(slots.get(), i));
      if (!PyTuple_Check(e) || PyTuple_GET_SIZE(e) != 4) return 0;
      if ((r = shape_equals(PyTuple_GET_ITEM(e, 0), s.sizes())) != 1)
        return r;
      if ((r = shape_equals(PyTuple_GET_ITEM(e, 1), s.strides())) != 1)
        return r;
      if (PyTuple_GET_ITEM(e, 2) != dtype_of(s)) return 0;
      if ((r = int_equals(PyTuple_GET_ITEM(e, 3), s.get_device())) != 1)
        return r;
    }
    PyObject** tail = k + 7 + n_slots;
    if ((r = int_equals(tail[0], device_index)) != 1) return r;
    r = PyObject_RichCompareBool(tail[1], stream.get(), Py_EQ);
    if (r != 1) return r < 0 ? -1 : 0;
    Py_ssize_t n_hparams = PyObject_Length(vec.get());
    if (n_hparams < 0) return -1;
    if ((r = int_equals(tail[2], n_hparams)) != 1) return r;
    if (tail[3] != rule.get() || tail[4] != config) return 0;
  }
  // --- _launch_on ---
  Ref ring(attr(launch.get(), s_ring));
  if (!ring) return -1;
  if (is_none(ring.get())) return 0;  // (made by the Python path)
  Ref kernel(attr(launch.get(), s_kernel));
  if (!kernel) return -1;
  Ref n_state(attr(launch.get(), s_n_state));
  if (!n_state) return -1;
  // The kernel's launch as addresses (DirectKernel.c_launch), or None (or
  // none at all): a kernel launched through its launch_ptrs method.
  Ref c_launch(attr(kernel.get(), s_c_launch));
  if (!c_launch) {
    if (!PyErr_ExceptionMatches(PyExc_AttributeError)) return -1;
    PyErr_Clear();
    Py_INCREF(Py_None);
    c_launch.o = Py_None;
  }
  // torch._C._increment_version, the Python path's, skips inference
  // tensors, which impl::bump_version refuses: such state is left to it.
  if (w.is_inference()) return 0;
  for (Py_ssize_t i = 0; i < n_slots; ++i)
    if (THPVariable_Unpack(PyTuple_GET_ITEM(slots.get(), i)).is_inference())
      return 0;
  if (!is_none(step.get()) && THPVariable_Unpack(step.get()).is_inference())
    return 0;
  // The operands made contiguous (copied on the stream, before the launch).
  at::Tensor xc = x.contiguous(), dyc = dy.contiguous();
  uintptr_t ptrs[4 + kMaxSlots];
  ptrs[0] = reinterpret_cast<uintptr_t>(xc.data_ptr());
  ptrs[1] = reinterpret_cast<uintptr_t>(dyc.data_ptr());
  ptrs[2] = 0;
  ptrs[3] = reinterpret_cast<uintptr_t>(w.data_ptr());
  uintptr_t any = ptrs[0] | ptrs[1] | ptrs[3];
  for (Py_ssize_t i = 0; i < n_slots; ++i) {
    ptrs[4 + i] = reinterpret_cast<uintptr_t>(
        THPVariable_Unpack(PyTuple_GET_ITEM(slots.get(), i)).data_ptr());
    any |= ptrs[4 + i];
  }
  if (any & 15) return 0;  // a misaligned operand: the Python path stages it
  const Py_ssize_t n_ptrs = 4 + n_slots;
  Ref lock(attr(g_bridge, s__LOCK));
  if (!lock) return -1;
  {
    Ref got(PyObject_CallMethodOneArg(lock.get(), s_acquire, Py_False));
    if (!got) return -1;
    r = PyObject_IsTrue(got.get());
    if (r != 1) return r < 0 ? -1 : 0;  // held elsewhere: Python waits
  }
  LockHeld held{lock.get()};
  int result = -1;
  do {
    // ring.get(vec, fixed=True): the row that served this vector last, in
    // C++ while it still holds it; else the ring's own method.
    PyObject* addr_o = nullptr;
    Ref addr;
    bool served = false;
    if (Py_TYPE(ring.get()) == (PyTypeObject*)g_ring_type) {
      Ref last_row(attr(ring.get(), s_last_row));
      if (!last_row) break;
      Ref last_vec(attr(ring.get(), s_last_vec));
      if (!last_vec) break;
      Ref keys(attr(ring.get(), s_keys));
      if (!keys) break;
      Ref last_key(attr(ring.get(), s_last_key));
      if (!last_key) break;
      Py_ssize_t i = PyLong_AsSsize_t(last_row.get());
      if (i == -1 && PyErr_Occurred()) break;
      if (last_vec.get() == vec.get() && PyList_Check(keys.get()) &&
          i >= 0 && i < PyList_GET_SIZE(keys.get()) &&
          PyList_GET_ITEM(keys.get(), i) == last_key.get()) {
        Ref launches(attr(ring.get(), s_launches));
        if (!launches) break;
        Ref next(PyNumber_Add(launches.get(), g_one));
        if (!next) break;
        if (PyObject_SetAttr(ring.get(), s_launches, next.get()) < 0) break;
        Ref last_use(attr(ring.get(), s_last_use));
        if (!last_use) break;
        if (PyObject_SetItem(last_use.get(), last_row.get(), next.get()) < 0)
          break;
        Ref row_ptrs(attr(ring.get(), s_ptrs));
        if (!row_ptrs) break;
        addr.o = PyObject_GetItem(row_ptrs.get(), last_row.get());
        if (!addr) break;
        served = true;
      }
    }
    if (!served) {
      Ref get(attr(ring.get(), s_get));
      if (!get) break;
      PyObject* args[2] = {vec.get(), Py_True};
      addr.o = PyObject_Vectorcall(get.get(), args, 2, nullptr);
      if (!addr) break;
    }
    addr_o = addr.get();
    ptrs[2] = static_cast<uintptr_t>(PyLong_AsUnsignedLongLong(addr_o));
    if (PyErr_Occurred()) break;
    if (!is_none(c_launch.get())) {
      // (launch, abi_v2, kernel, function, device, order): the runtime's
      // launch function and its leading arguments (DirectKernel.c_launch).
      PyObject* c = c_launch.get();
      if (!PyTuple_Check(c) || PyTuple_GET_SIZE(c) != 6) {
        PyErr_SetString(PyExc_TypeError, "forge_torch: malformed c_launch");
        break;
      }
      void* fn = PyLong_AsVoidPtr(PyTuple_GET_ITEM(c, 0));
      int abi_v2 = PyObject_IsTrue(PyTuple_GET_ITEM(c, 1));
      void* kern = is_none(PyTuple_GET_ITEM(c, 2))
                       ? nullptr : PyLong_AsVoidPtr(PyTuple_GET_ITEM(c, 2));
      void* function = PyLong_AsVoidPtr(PyTuple_GET_ITEM(c, 3));
      long dev = PyLong_AsLong(PyTuple_GET_ITEM(c, 4));
      PyObject* order = PyTuple_GET_ITEM(c, 5);
      if (PyErr_Occurred() || abi_v2 < 0) break;
      if (!PyTuple_Check(order) || PyTuple_GET_SIZE(order) > 4 * kMaxSlots) {
        PyErr_SetString(PyExc_TypeError, "forge_torch: malformed order");
        break;
      }
      void* buffers[4 * kMaxSlots];
      Py_ssize_t n_buffers = PyTuple_GET_SIZE(order);
      bool bad = false;
      for (Py_ssize_t j = 0; j < n_buffers; ++j) {
        Py_ssize_t a = PyLong_AsSsize_t(PyTuple_GET_ITEM(order, j));
        if (a < 0 || a >= n_ptrs) { bad = true; break; }
        buffers[j] = reinterpret_cast<void*>(ptrs[a]);
      }
      if (bad) {
        if (!PyErr_Occurred())
          PyErr_SetString(PyExc_ValueError, "forge_torch: bad order");
        break;
      }
      void* raw_stream = PyLong_AsVoidPtr(stream.get());
      if (PyErr_Occurred()) break;
      // (Without the GIL, as ctypes calls it: a launch may wait for room
      // in the GPU's queue.)
      Py_BEGIN_ALLOW_THREADS
      if (abi_v2) {
        using Fn = void (*)(void*, void*, void*, void**, int);
        reinterpret_cast<Fn>(fn)(kern, function, raw_stream, buffers,
                                 static_cast<int>(dev));
      } else {
        using Fn = void (*)(void*, void*, void**);
        reinterpret_cast<Fn>(fn)(function, raw_stream, buffers);
      }
      Py_END_ALLOW_THREADS
    } else {
      Ref list(PyList_New(n_ptrs));
      if (!list) break;
      bool bad = false;
      for (Py_ssize_t j = 0; j < n_ptrs; ++j) {
        PyObject* v = PyLong_FromUnsignedLongLong(ptrs[j]);
        if (!v) { bad = true; break; }
        PyList_SET_ITEM(list.get(), j, v);
      }
      if (bad) break;
      Ref done(PyObject_CallMethodObjArgs(kernel.get(), s_launch_ptrs,
                                          stream.get(), list.get(), nullptr));
      if (!done) break;
    }
    Ref stats(attr(g_bridge, s_STATS));
    if (!stats) break;
    if (add_to(stats.get(), s_calls, g_one) < 0 ||
        add_to(stats.get(), s_direct, g_one) < 0 ||
        add_to(stats.get(), s_native, g_one) < 0 ||
        add_to(stats.get(), s_in_place, n_state.get()) < 0)
      break;
    result = 1;
  } while (false);
  if (held.release() < 0 || result != 1) return -1;
  // --- _forge_advance_step ---
  if (!is_none(step.get())) {
    const at::Tensor& st = THPVariable_Unpack(step.get());
    if (deferred) {
      Ref pending(attr(opt, s__forge_pending_steps));
      if (!pending) return -1;
      Ref entry(PyTuple_Pack(2, step.get(), record.get()));
      if (!entry) return -1;
      if (PyList_Append(pending.get(), entry.get()) < 0) return -1;
    } else {
      Ref index_unit(PyTuple_New(0));
      if (!index_unit) return -1;
      if (PyObject_SetItem(record_array.get(), index_unit.get(), t.get()) < 0)
        return -1;
    }
    torch::autograd::impl::bump_version(w);
    for (Py_ssize_t i = 0; i < n_slots; ++i)
      torch::autograd::impl::bump_version(
          THPVariable_Unpack(PyTuple_GET_ITEM(slots.get(), i)));
    if (!deferred) torch::autograd::impl::bump_version(st);
    Ref version(PyLong_FromLongLong(st._version()));
    if (!version) return -1;
    if (PyObject_SetAttr(record.get(), s_version, version.get()) < 0 ||
        PyObject_SetAttr(record.get(), s_value, t.get()) < 0)
      return -1;
  } else {
    torch::autograd::impl::bump_version(w);
    for (Py_ssize_t i = 0; i < n_slots; ++i)
      torch::autograd::impl::bump_version(
          THPVariable_Unpack(PyTuple_GET_ITEM(slots.get(), i)));
  }
  if (PyDict_SetItem(updated.get(), pk.get(), Py_True) < 0) return -1;
  return 1;
}

// _ForgeOptimizer._forge_before_forward(w, x, autocast_dtype=amp) where
// the forward is one it counts plainly: its checks passed and the weight's
// use counted, returns the step's generation; inside a backward (a
// recomputation, not counted) None; anything else (a check that fails, the
// param groups or their members to check again, a use beyond the step's,
// a weight counted for the first time) NotImplemented, having done nothing:
// the Python method then runs.
PyObject* before(PyObject* opt, PyObject* w_o, PyObject* x_o, PyObject* amp) {
  int err = 0, r;
  if (!THPVariable_Check(w_o) || !THPVariable_Check(x_o))
    Py_RETURN_NOTIMPLEMENTED;
  Ref wk(id_key(w_o));
  if (!wk) return nullptr;
  {  // the param groups as last checked, their members this step
    Ref seen(attr(opt, s__forge_groups_seen));
    if (!seen) return nullptr;
    Ref groups(attr(opt, s_param_groups));
    if (!groups) return nullptr;
    if (is_none(seen.get())) Py_RETURN_NOTIMPLEMENTED;
    Py_ssize_t a = PyObject_Length(seen.get());
    if (a < 0) return nullptr;
    Py_ssize_t b = PyObject_Length(groups.get());
    if (b < 0) return nullptr;
    if (a != b) Py_RETURN_NOTIMPLEMENTED;
    Ref checked(attr(opt, s__forge_members_checked));
    if (!checked) return nullptr;
    Ref generation(attr(opt, s__forge_generation));
    if (!generation) return nullptr;
    r = PyObject_RichCompareBool(checked.get(), generation.get(), Py_EQ);
    if (r < 0) return nullptr;
    if (r == 0) Py_RETURN_NOTIMPLEMENTED;
  }
  {
    Ref managed(map_values(opt, s__forge_managed));
    if (!managed) return nullptr;
    r = PySequence_Contains(managed.get(), wk.get());
    if (r < 0) return nullptr;
    if (r == 0) Py_RETURN_NOTIMPLEMENTED;
  }
  const at::Tensor& w = THPVariable_Unpack(w_o);
  const at::Tensor& x = THPVariable_Unpack(x_o);
  {
    Ref supported(attr(g_bridge, s_SUPPORTED_DTYPES));
    if (!supported) return nullptr;
    r = PySequence_Contains(supported.get(), dtype_of(w));
    if (r < 0) return nullptr;
    if (r == 0) Py_RETURN_NOTIMPLEMENTED;
  }
  if (!w.is_contiguous() || x.device() != w.device())
    Py_RETURN_NOTIMPLEMENTED;
  if (dtype_of(x) != (is_none(amp) ? dtype_of(w) : amp))
    Py_RETURN_NOTIMPLEMENTED;
  {  // inside a backward: a recomputation (activation checkpointing)
    Ref task_fn(attr(g_optim, s__GRAPH_TASK_ID));
    if (!task_fn) return nullptr;
    if (!is_none(task_fn.get())) {
      Ref task(call0(task_fn.get()));
      if (!task) return nullptr;
      r = int_equals(task.get(), -1);
      if (r < 0) return nullptr;
      if (r == 0) Py_RETURN_NONE;
    }
  }
  Ref calls_map(attr(opt, s__forge_calls));
  if (!calls_map) return nullptr;
  Ref calls(attr(calls_map.get(), s__values));
  if (!calls) return nullptr;
  Ref calls_refs(attr(calls_map.get(), s__refs));
  if (!calls_refs) return nullptr;
  if (!PyDict_Check(calls.get()) || !PyDict_Check(calls_refs.get()))
    Py_RETURN_NOTIMPLEMENTED;
  // (Counted without a new weak reference: the weight has one.)
  r = PyDict_Contains(calls_refs.get(), wk.get());
  if (r < 0) return nullptr;
  if (r == 0) Py_RETURN_NOTIMPLEMENTED;
  Ref n(dget(calls.get(), wk.get(), &err));
  if (err) return nullptr;
  if (!n) n.o = PyLong_FromLong(0);  // (absent: no use counted yet)
  else Py_INCREF(n.get());
  if (!n) return nullptr;
  Ref k(attr(opt, s__forge_accumulate_steps));
  if (!k) return nullptr;
  // n < k: else refused (Python says why); with the weight updated in this
  // step already, Python's check.
  r = PyObject_RichCompareBool(n.get(), k.get(), Py_LT);
  if (r < 0) return nullptr;
  if (r == 0) Py_RETURN_NOTIMPLEMENTED;
  {
    Ref updated(map_values(opt, s__forge_updated));
    if (!updated) return nullptr;
    r = PySequence_Contains(updated.get(), wk.get());
    if (r < 0) return nullptr;
    if (r == 1) Py_RETURN_NOTIMPLEMENTED;
  }
  Ref next(PyNumber_Add(n.get(), g_one));
  if (!next) return nullptr;
  if (PyDict_SetItem(calls.get(), wk.get(), next.get()) < 0) return nullptr;
  return attr(opt, s__forge_generation);
}

// An entry point's call of body(args): its argument count checked (usage
// says what it takes), setup() done, a C++ exception raised as a
// RuntimeError.
template <typename Body>
PyObject* entry(PyObject* const* args, Py_ssize_t nargs, Py_ssize_t n,
                const char* usage, Body body) {
  if (nargs != n) {
    PyErr_SetString(PyExc_TypeError, usage);
    return nullptr;
  }
  if (g_optim == nullptr) {
    PyErr_SetString(PyExc_RuntimeError, "forge_torch: setup() not called");
    return nullptr;
  }
  try {
    return body(args);
  } catch (const std::exception& e) {
    PyErr_SetString(PyExc_RuntimeError, e.what());
    return nullptr;
  }
}

PyObject* before_forward(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  return entry(args, nargs, 4, "before_forward(optimizer, weight, input, amp)",
               [](PyObject* const* a) {
                 return before(a[0], a[1], a[2], a[3]);
               });
}

PyObject* run_plan(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  return entry(args, nargs, 5,
               "run_plan(optimizer, weight, grad_output, input, config)",
               [](PyObject* const* a) -> PyObject* {
                 int r = run(a[0], a[1], a[2], a[3], a[4]);
                 return r < 0 ? nullptr : PyBool_FromLong(r);
               });
}

void set(PyObject** slot, PyObject* v) {
  Py_XINCREF(v);
  Py_XSETREF(*slot, v);
}

PyObject* setup(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 5) {
    PyErr_SetString(PyExc_TypeError,
                    "setup(clip_module, bridge_module, direct_module, "
                    "optim_module, ring_type)");
    return nullptr;
  }
  set(&g_clip, args[0]);
  set(&g_bridge, args[1]);
  set(&g_direct, args[2]);
  set(&g_optim, args[3]);
  set(&g_ring_type, args[4]);
  Py_RETURN_NONE;
}

PyMethodDef kMethods[] = {
    {"run_plan", reinterpret_cast<PyCFunction>(reinterpret_cast<void*>(
                     run_plan)),
     METH_FASTCALL, "A managed weight's update by its plan, or False."},
    {"before_forward", reinterpret_cast<PyCFunction>(reinterpret_cast<void*>(
                           before_forward)),
     METH_FASTCALL, "A managed layer's forward counted, or NotImplemented."},
    {"setup", reinterpret_cast<PyCFunction>(reinterpret_cast<void*>(setup)),
     METH_FASTCALL, "Binds the modules the plan path reads."},
    {nullptr, nullptr, 0, nullptr}};

PyModuleDef kModule = {PyModuleDef_HEAD_INIT, FORGE_STR(TORCH_EXTENSION_NAME),
                       nullptr, -1, kMethods};

}  // namespace

PyMODINIT_FUNC FORGE_CONCAT(PyInit_, TORCH_EXTENSION_NAME)(void) {
#define INTERN(n)                                      \
  s_##n = PyUnicode_InternFromString(#n);              \
  if (s_##n == nullptr) return nullptr;
  NAMES(INTERN)
#undef INTERN
  g_one = PyLong_FromLong(1);
  if (g_one == nullptr) return nullptr;
  return PyModule_Create(&kModule);
}
