// benchmarks/plan_checks.py's C++ arm: an update plan's per-update checks
// (forge_torch/optim.py, _forge_run_plan) in C++, the launch stood in.
// A measurement of such a path, not a product path.
#include <torch/extension.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/autograd/variable.h>

namespace py = pybind11;

struct Plan {
  py::object config, groups_owner, group, state_map, state, step, updated;
  py::tuple names, options;     // the group's keys and values when formed
  std::vector<py::object> slot_names;
  std::vector<py::object> slots; // slot tensors
  int64_t index;
  int64_t rows_x = -1, rows_dy = -1;
  int64_t n_in, n_out;
  c10::ScalarType op_dtype;
  int64_t step_version = -1, step_value = 0;
  void* step_ptr = nullptr;
  int64_t launches = 0;
};

static inline const at::Tensor& T(PyObject* o) {
  return THPVariable_Unpack(o);
}

// Returns true where the plan held and the (stood-in) launch ran.
bool run_plan(Plan& plan, py::object opt, py::object p, py::object pk,
              py::object grad_output, py::object input, py::object config,
              py::object generation_obj) {
  if (config.ptr() != plan.config.ptr()) return false;
  PyObject* updated = plan.updated.ptr();  // WeakIdMap._values (a dict)
  if (PyDict_Contains(updated, pk.ptr())) return false;
  // the param_groups list and the group dict at its index
  PyObject* groups = PyObject_GetAttrString(opt.ptr(), "param_groups");
  if (!groups) throw py::error_already_set();
  bool ok = PyList_Check(groups) && plan.index < PyList_GET_SIZE(groups) &&
            PyList_GET_ITEM(groups, plan.index) == plan.group.ptr();
  Py_DECREF(groups);
  if (!ok) return false;
  // state identity: self.state.get(p) (Tensor.__hash__ runs, as in Python)
  PyObject* st = PyObject_GetAttrString(opt.ptr(), "state");
  if (!st) throw py::error_already_set();
  PyObject* s = PyDict_GetItemWithError(st, p.ptr());
  Py_DECREF(st);
  if (s != plan.state.ptr()) { PyErr_Clear(); return false; }
  PyObject* sd = plan.state.ptr();
  if (PyDict_GetItemString(sd, "step") != plan.step.ptr()) return false;
  for (size_t i = 0; i < plan.slots.size(); ++i)
    if (PyDict_GetItem(sd, plan.slot_names[i].ptr()) != plan.slots[i].ptr())
      return false;
  const at::Tensor& stp = T(plan.step.ptr());
  if (stp._version() != plan.step_version || stp.data_ptr() != plan.step_ptr)
    return false;
  int64_t t = plan.step_value + 1;
  // the group's options: the same objects under the same names
  PyObject* g = plan.group.ptr();
  if (PyDict_Size(g) != PyTuple_GET_SIZE(plan.options.ptr())) return false;
  Py_ssize_t pos = 0, i = 0; PyObject *k, *v;
  while (PyDict_Next(g, &pos, &k, &v)) {
    if (PyTuple_GET_ITEM(plan.options.ptr(), i) != v) return false;
    PyObject* name = PyTuple_GET_ITEM(plan.names.ptr(), i);
    if (name != k && PyObject_RichCompareBool(name, k, Py_EQ) != 1)
      return false;
    ++i;
  }
  // the launch key: operands' rows, columns, dtypes; weight and slots'
  // shapes, strides, dtypes
  const at::Tensor& x = T(input.ptr());
  const at::Tensor& dy = T(grad_output.ptr());
  const at::Tensor& w = T(p.ptr());
  if (x.size(-1) != plan.n_in || dy.size(-1) != plan.n_out) return false;
  int64_t rx = x.numel() / plan.n_in, rdy = dy.numel() / plan.n_out;
  if (rx != plan.rows_x || rdy != plan.rows_dy) return false;
  if (x.scalar_type() != plan.op_dtype || dy.scalar_type() != plan.op_dtype)
    return false;
  auto check_state = [&](const at::Tensor& a) {
    return a.dim() == 2 && a.size(0) == plan.n_out && a.size(1) == plan.n_in
        && a.is_contiguous() && a.scalar_type() == w.scalar_type();
  };
  if (!check_state(w)) return false;
  for (auto& so : plan.slots) if (!check_state(T(so.ptr()))) return false;
  // pointers (contiguous operands), alignment
  at::Tensor xc = x.contiguous(), dyc = dy.contiguous();
  uintptr_t ptrs[8];
  int n = 0;
  ptrs[n++] = (uintptr_t)xc.data_ptr(); ptrs[n++] = (uintptr_t)dyc.data_ptr();
  ptrs[n++] = 4096; ptrs[n++] = (uintptr_t)w.data_ptr();
  for (auto& so : plan.slots) ptrs[n++] = (uintptr_t)T(so.ptr()).data_ptr();
  uintptr_t all = 0; for (int j = 0; j < n; ++j) all |= ptrs[j];
  if (all & 15) return false;
  plan.launches++;  // the launch, stood in
  // version bumps, step record, the updated mark
  torch::autograd::impl::bump_version(w);
  for (auto& so : plan.slots) torch::autograd::impl::bump_version(T(so.ptr()));
  torch::autograd::impl::bump_version(stp);
  plan.step_version = stp._version();
  plan.step_value = t;
  if (PyDict_SetItem(updated, pk.ptr(), Py_True) < 0)
    throw py::error_already_set();
  return true;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  py::class_<Plan>(m, "Plan")
      .def(py::init<>())
      .def_readwrite("config", &Plan::config)
      .def_readwrite("group", &Plan::group)
      .def_readwrite("state", &Plan::state)
      .def_readwrite("step", &Plan::step)
      .def_readwrite("updated", &Plan::updated)
      .def_readwrite("names", &Plan::names)
      .def_readwrite("options", &Plan::options)
      .def_readwrite("slot_names", &Plan::slot_names)
      .def_readwrite("slots", &Plan::slots)
      .def_readwrite("index", &Plan::index)
      .def_readwrite("rows_x", &Plan::rows_x)
      .def_readwrite("rows_dy", &Plan::rows_dy)
      .def_readwrite("n_in", &Plan::n_in)
      .def_readwrite("n_out", &Plan::n_out)
      .def_readwrite("step_version", &Plan::step_version)
      .def_readwrite("step_value", &Plan::step_value)
      .def_readwrite("launches", &Plan::launches)
      .def("set_dtype", [](Plan& pl, py::object t) {
        pl.op_dtype = T(t.ptr()).scalar_type(); })
      .def("set_step_ptr", [](Plan& pl) {
        pl.step_ptr = T(pl.step.ptr()).data_ptr(); });
  m.def("run_plan", &run_plan);
}
