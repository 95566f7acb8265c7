// hyperparallel._C: the extension module. Errors of the library (hp::Error: a bad input or
// configuration, named with its fix) become ValueError; a collective that failed (dead peer,
// timeout) RuntimeError; c10 errors RuntimeError without their C++ backtrace.
#include <pybind11/pybind11.h>

#include <c10/util/Exception.h>

#include "bindings.h"
#include "hp/common/check.h"
#include "hp/common/host_allocator.h"

namespace py = pybind11;

PYBIND11_MODULE(_C, m) {
  m.doc() = "hyperparallel: context-parallel attention over torch.distributed process groups";
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const hp::CommError& e) {
      PyErr_SetString(PyExc_RuntimeError, e.what());
    } catch (const hp::Error& e) {
      PyErr_SetString(PyExc_ValueError, e.what());
    } catch (const c10::Error& e) {
      PyErr_SetString(PyExc_RuntimeError, e.what_without_backtrace());
    }
  });
  hp::python::bind_group(m);
  hp::python::bind_attention(m);
  hp::python::bind_plan(m);
  m.def("use_caching_host_allocator", [] { hp::common::install_caching_host_allocator(); });
  m.def("host_cache_stats", []() -> py::object {
    const auto* c = hp::common::installed_host_cache();
    if (c == nullptr) return py::none();
    const auto s = c->stats();
    py::dict d;
    d["live_bytes"] = s.live_bytes;
    d["cached_bytes"] = s.cached_bytes;
    d["arena_bytes"] = s.arena_bytes;
    d["budget_bytes"] = s.budget_bytes;
    d["system_bytes"] = s.system_bytes;
    d["hits"] = s.hits;
    d["misses"] = s.misses;
    d["evictions"] = s.evictions;
    return d;
  });
  m.def("release_host_cache", [] { hp::common::release_host_cache(); });
}
