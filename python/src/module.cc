// _dear: the compiled half of the `dear` Python package.
//
// It binds the public C++ API (dear/communicator.h and the threshold fusion planner) and nothing
// else. It does not know torch: the Python half (dear/__init__.py) checks each tensor (CPU,
// contiguous, a supported dtype) and passes its data pointer, element count and dtype. Keeping
// libtorch out of the link lets the module build against any Python that has pybind11, and a
// torch upgrade cannot break its ABI.
//
// CUDA tensors (builds with CUDA only; HAVE_CUDA says which): the Python half passes the device
// pointer and the tensor's current stream (torch.cuda.current_stream().cuda_stream) as an
// integer. The communicator finds device buffers itself and stages them through pinned host
// memory, ordered on that stream (OpOptions::cuda_stream, collectives/device_staging.h).
//
// Threading: operations are issued with the GIL held (issuing never blocks); everything that
// can block (rendezvous, Work::wait, tearing the engine down) releases it, so other Python
// threads, and autograd's, keep running while a rank waits for its peers.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <chrono>
#include <cmath>
#include <cstdint>
#include <exception>
#include <limits>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "dear/bootstrap.h"
#include "dear/communicator.h"
#include "dear/error.h"
#include "dear/scheduler/fusion.h"
#include "dear/scheduler/model.h"
#include "dear/scheduler/policy.h"
#include "dear/scheduler/tuner.h"
#include "dear/types.h"

namespace py = pybind11;

namespace {

// dear.Error, created once and never freed: the translator may run until the interpreter's
// very end, after module globals are gone.
PyObject* g_error_type = nullptr;

// Raises dear.Error with what() as its message and the error's fields as attributes, so that
// Python code can branch on `e.code` or `e.peer` instead of parsing text.
void raise_dear_error(const dear::Error& e) {
  py::object type = py::reinterpret_borrow<py::object>(g_error_type);
  py::object instance = type(e.what());
  instance.attr("code") = std::string(dear::to_string(e.code()));
  instance.attr("rank") = e.rank();
  instance.attr("peer") = e.peer();
  instance.attr("op") = e.op();
  instance.attr("seq") = e.seq();
  instance.attr("cause") = e.cause();
  PyErr_SetObject(g_error_type, instance.ptr());
}

std::chrono::milliseconds to_timeout(std::optional<double> seconds) {
  if (!seconds) return std::chrono::milliseconds::max();
  if (!std::isfinite(*seconds) || *seconds < 0) {
    throw dear::Error(dear::ErrorCode::kInvalidArgument,
                      "timeout must be a finite number of seconds >= 0");
  }
  return std::chrono::milliseconds(static_cast<std::int64_t>(std::ceil(*seconds * 1000.0)));
}

// `stream` is a cudaStream_t as an integer (0: none), used by builds with CUDA only.
dear::OpOptions op_options(int priority, std::uintptr_t stream) {
  dear::OpOptions o;
  o.priority = priority;
  o.cuda_stream = reinterpret_cast<void*>(stream);
  return o;
}

// Python ints carry the tensors' data pointers (tensor.data_ptr()).
void* as_ptr(std::uintptr_t address) { return reinterpret_cast<void*>(address); }

// The communicator behind dear.init(). close() tears it down explicitly so that the engine
// thread is joined while the interpreter is still alive (from atexit), not during static
// destruction.
class PyCommunicator {
 public:
  PyCommunicator(std::unique_ptr<dear::Communicator> comm, std::string advertise_host)
      : comm_(std::move(comm)), advertise_host_(std::move(advertise_host)) {}

  static std::unique_ptr<PyCommunicator> from_env() {
    py::gil_scoped_release release;  // rendezvous waits for every rank
    auto bootstrap = dear::Bootstrap::from_env();
    std::string host = bootstrap->advertise_host();
    return std::make_unique<PyCommunicator>(
        dear::Communicator::create_from_env(std::move(bootstrap)), std::move(host));
  }

  // A communicator of its own for `size` ranks that share `id` (new_unique_id()'s text, made by
  // the one of rank 0 and passed on by the caller, e.g. through a torch store).
  static std::unique_ptr<PyCommunicator> from_id(const std::string& id, int rank, int size,
                                                 const std::string& name) {
    py::gil_scoped_release release;
    auto bootstrap = dear::Bootstrap::create(dear::UniqueId::parse(id), rank, size);
    std::string host = bootstrap->advertise_host();
    dear::CommOptions options;
    options.name = name;
    return std::make_unique<PyCommunicator>(
        dear::Communicator::create_from_env(std::move(bootstrap), std::move(options)),
        std::move(host));
  }

  // Communicator::split; None where this rank joins no child.
  std::unique_ptr<PyCommunicator> split(int color, int key) {
    dear::Communicator& parent = get();
    std::unique_ptr<dear::Communicator> child;
    {
      py::gil_scoped_release release;
      child = parent.split(color, key);
    }
    if (!child) return nullptr;
    return std::make_unique<PyCommunicator>(std::move(child), advertise_host_);
  }

  [[nodiscard]] const std::string& advertise_host() const { return advertise_host_; }

  dear::Communicator& get() const {
    if (!comm_) {
      throw dear::Error(dear::ErrorCode::kInvalidArgument,
                        "the communicator is closed; call dear.init() again");
    }
    return *comm_;
  }

  void close() {
    std::unique_ptr<dear::Communicator> comm = std::move(comm_);
    py::gil_scoped_release release;
    comm.reset();
  }

  [[nodiscard]] bool closed() const { return comm_ == nullptr; }

 private:
  std::unique_ptr<dear::Communicator> comm_;
  std::string advertise_host_;  // where this rank's listeners are reached
};

// A model of "layers" given as lists of tensor element counts, in forward order.
dear::scheduler::Model layer_model(const std::vector<std::vector<std::int64_t>>& layers,
                                   int element_bytes) {
  dear::scheduler::Model model;
  model.element_bytes = element_bytes;
  for (std::size_t i = 0; i < layers.size(); ++i) {
    dear::scheduler::Layer layer;
    layer.name = std::to_string(i);
    layer.tensors = layers[i];
    model.layers.push_back(std::move(layer));
  }
  return model;
}

std::vector<std::pair<int, int>> ranges(const dear::scheduler::FusionPlan& plan) {
  std::vector<std::pair<int, int>> groups;
  for (const auto& g : plan) groups.emplace_back(g.first, g.last);
  return groups;
}

// Fusion plans as (first, last) layer ranges, inclusive, one per group.
std::vector<std::pair<int, int>> plan_threshold(
    const std::vector<std::vector<std::int64_t>>& layers, int ranks, std::int64_t threshold_bytes,
    int element_bytes) {
  if (layers.empty()) return {};
  return ranges(
      dear::scheduler::plan_threshold(layer_model(layers, element_bytes), ranks, threshold_bytes));
}

std::vector<std::pair<int, int>> plan_nearby(const std::vector<std::vector<std::int64_t>>& layers,
                                             int ranks, int layers_per_group, int element_bytes) {
  if (layers.empty()) return {};
  return ranges(
      dear::scheduler::plan_nearby(layer_model(layers, element_bytes), ranks, layers_per_group));
}

}  // namespace

PYBIND11_MODULE(_dear, m) {
  m.doc() = "dear's compiled bindings; use the `dear` package instead.";

  g_error_type = PyErr_NewException("dear.Error", PyExc_RuntimeError, nullptr);
  m.add_object("Error", py::handle(g_error_type));
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const dear::Error& e) {
      raise_dear_error(e);
    }
  });

  py::enum_<dear::DataType>(m, "DataType")
      .value("int8", dear::DataType::kInt8)
      .value("uint8", dear::DataType::kUint8)
      .value("int32", dear::DataType::kInt32)
      .value("int64", dear::DataType::kInt64)
      .value("float16", dear::DataType::kFloat16)
      .value("bfloat16", dear::DataType::kBFloat16)
      .value("float32", dear::DataType::kFloat32)
      .value("float64", dear::DataType::kFloat64);

  py::enum_<dear::ReduceOp>(m, "ReduceOp")
      .value("sum", dear::ReduceOp::kSum)
      .value("prod", dear::ReduceOp::kProd)
      .value("min", dear::ReduceOp::kMin)
      .value("max", dear::ReduceOp::kMax)
      .value("avg", dear::ReduceOp::kAvg);

  py::class_<dear::Work>(m, "Work")
      .def("test", &dear::Work::test, "True once the operation has completed; never blocks.")
      .def(
          "wait",
          [](const dear::Work& w, std::optional<double> timeout_s) {
            const auto timeout = to_timeout(timeout_s);
            py::gil_scoped_release release;
            return w.wait(timeout);
          },
          py::arg("timeout") = py::none(),
          "Waits (GIL released); True on success, False on timeout, raises dear.Error on "
          "failure.")
      .def_property_readonly("seq", &dear::Work::seq)
      .def_property_readonly("source", &dear::Work::source,
                             "A receive's sender once it has completed (the rank a receive "
                             "from any source took its message from); -1 otherwise.");

  py::class_<PyCommunicator>(m, "Communicator")
      .def_static("from_env", &PyCommunicator::from_env,
                  "Rendezvous from the launcher's environment (dear-run, torchrun, Open MPI, "
                  "Slurm).")
      .def_property_readonly("rank", [](const PyCommunicator& c) { return c.get().rank(); })
      .def_property_readonly("size", [](const PyCommunicator& c) { return c.get().size(); })
      .def_static("from_id", &PyCommunicator::from_id, py::arg("id"), py::arg("rank"),
                  py::arg("size"), py::arg("name") = "",
                  "A communicator of `size` ranks that rendezvous at `id` (new_unique_id()), "
                  "with the DEAR_* options of the environment.")
      .def("split", &PyCommunicator::split, py::arg("color"), py::arg("key"),
           "Communicator::split: collective; None for a color of -1.")
      .def_property_readonly("advertise_host", &PyCommunicator::advertise_host)
      .def_property_readonly("name", [](const PyCommunicator& c) { return c.get().options().name; })
      .def_property_readonly("closed", &PyCommunicator::closed)
      .def("close", &PyCommunicator::close)
      .def(
          "all_reduce",
          [](PyCommunicator& c, std::uintptr_t in, std::uintptr_t out, std::size_t count,
             dear::DataType dtype, dear::ReduceOp op, int priority, std::uintptr_t stream) {
            return c.get().all_reduce(as_ptr(in), as_ptr(out), count, dtype, op,
                                      op_options(priority, stream));
          },
          py::arg("in_ptr"), py::arg("out_ptr"), py::arg("count"), py::arg("dtype"), py::arg("op"),
          py::arg("priority") = 0, py::arg("cuda_stream") = 0)
      .def(
          "reduce_scatter",
          [](PyCommunicator& c, std::uintptr_t in, std::uintptr_t out, std::size_t recv_count,
             dear::DataType dtype, dear::ReduceOp op, int priority, std::uintptr_t stream) {
            return c.get().reduce_scatter(as_ptr(in), as_ptr(out), recv_count, dtype, op,
                                          op_options(priority, stream));
          },
          py::arg("in_ptr"), py::arg("out_ptr"), py::arg("recv_count"), py::arg("dtype"),
          py::arg("op"), py::arg("priority") = 0, py::arg("cuda_stream") = 0)
      .def(
          "all_gather",
          [](PyCommunicator& c, std::uintptr_t in, std::uintptr_t out, std::size_t send_count,
             dear::DataType dtype, int priority, std::uintptr_t stream) {
            return c.get().all_gather(as_ptr(in), as_ptr(out), send_count, dtype,
                                      op_options(priority, stream));
          },
          py::arg("in_ptr"), py::arg("out_ptr"), py::arg("send_count"), py::arg("dtype"),
          py::arg("priority") = 0, py::arg("cuda_stream") = 0)
      .def(
          "broadcast",
          [](PyCommunicator& c, std::uintptr_t in, std::uintptr_t out, std::size_t count,
             dear::DataType dtype, int root, int priority, std::uintptr_t stream) {
            return c.get().broadcast(as_ptr(in), as_ptr(out), count, dtype, root,
                                     op_options(priority, stream));
          },
          py::arg("in_ptr"), py::arg("out_ptr"), py::arg("count"), py::arg("dtype"),
          py::arg("root"), py::arg("priority") = 0, py::arg("cuda_stream") = 0)
      .def(
          "reduce",
          [](PyCommunicator& c, std::uintptr_t in, std::uintptr_t out, std::size_t count,
             dear::DataType dtype, dear::ReduceOp op, int root, int priority,
             std::uintptr_t stream) {
            return c.get().reduce(as_ptr(in), as_ptr(out), count, dtype, op, root,
                                  op_options(priority, stream));
          },
          py::arg("in_ptr"), py::arg("out_ptr"), py::arg("count"), py::arg("dtype"), py::arg("op"),
          py::arg("root"), py::arg("priority") = 0, py::arg("cuda_stream") = 0)
      .def(
          "scatter",
          [](PyCommunicator& c, std::uintptr_t in, std::uintptr_t out, std::size_t recv_count,
             dear::DataType dtype, int root, int priority, std::uintptr_t stream) {
            return c.get().scatter(as_ptr(in), as_ptr(out), recv_count, dtype, root,
                                   op_options(priority, stream));
          },
          py::arg("in_ptr"), py::arg("out_ptr"), py::arg("recv_count"), py::arg("dtype"),
          py::arg("root"), py::arg("priority") = 0, py::arg("cuda_stream") = 0)
      .def(
          "gather",
          [](PyCommunicator& c, std::uintptr_t in, std::uintptr_t out, std::size_t send_count,
             dear::DataType dtype, int root, int priority, std::uintptr_t stream) {
            return c.get().gather(as_ptr(in), as_ptr(out), send_count, dtype, root,
                                  op_options(priority, stream));
          },
          py::arg("in_ptr"), py::arg("out_ptr"), py::arg("send_count"), py::arg("dtype"),
          py::arg("root"), py::arg("priority") = 0, py::arg("cuda_stream") = 0)
      .def(
          "all_to_all",
          [](PyCommunicator& c, std::uintptr_t in, std::uintptr_t out, std::size_t count,
             dear::DataType dtype, int priority, std::uintptr_t stream) {
            return c.get().all_to_all(as_ptr(in), as_ptr(out), count, dtype,
                                      op_options(priority, stream));
          },
          py::arg("in_ptr"), py::arg("out_ptr"), py::arg("count"), py::arg("dtype"),
          py::arg("priority") = 0, py::arg("cuda_stream") = 0)
      .def(
          "all_to_all_v",
          [](PyCommunicator& c, std::uintptr_t in, const std::vector<std::size_t>& send_counts,
             const std::vector<std::size_t>& send_displs, std::uintptr_t out,
             const std::vector<std::size_t>& recv_counts,
             const std::vector<std::size_t>& recv_displs, dear::DataType dtype, int priority,
             std::uintptr_t stream) {
            return c.get().all_to_all_v(as_ptr(in), send_counts, send_displs, as_ptr(out),
                                        recv_counts, recv_displs, dtype,
                                        op_options(priority, stream));
          },
          py::arg("in_ptr"), py::arg("send_counts"), py::arg("send_displs"), py::arg("out_ptr"),
          py::arg("recv_counts"), py::arg("recv_displs"), py::arg("dtype"), py::arg("priority") = 0,
          py::arg("cuda_stream") = 0)
      .def(
          "all_gather_v",
          [](PyCommunicator& c, std::uintptr_t in, std::size_t send_count, std::uintptr_t out,
             const std::vector<std::size_t>& recv_counts,
             const std::vector<std::size_t>& recv_displs, dear::DataType dtype, int priority,
             std::uintptr_t stream) {
            return c.get().all_gather_v(as_ptr(in), send_count, as_ptr(out), recv_counts,
                                        recv_displs, dtype, op_options(priority, stream));
          },
          py::arg("in_ptr"), py::arg("send_count"), py::arg("out_ptr"), py::arg("recv_counts"),
          py::arg("recv_displs"), py::arg("dtype"), py::arg("priority") = 0,
          py::arg("cuda_stream") = 0)
      .def(
          "gather_v",
          [](PyCommunicator& c, std::uintptr_t in, std::size_t send_count, std::uintptr_t out,
             const std::vector<std::size_t>& recv_counts,
             const std::vector<std::size_t>& recv_displs, dear::DataType dtype, int root,
             int priority, std::uintptr_t stream) {
            return c.get().gather_v(as_ptr(in), send_count, as_ptr(out), recv_counts, recv_displs,
                                    dtype, root, op_options(priority, stream));
          },
          py::arg("in_ptr"), py::arg("send_count"), py::arg("out_ptr"), py::arg("recv_counts"),
          py::arg("recv_displs"), py::arg("dtype"), py::arg("root"), py::arg("priority") = 0,
          py::arg("cuda_stream") = 0)
      .def(
          "send",
          [](PyCommunicator& c, std::uintptr_t buf, std::size_t count, dear::DataType dtype,
             int peer, std::uintptr_t stream, int tag) {
            dear::OpOptions o = op_options(0, stream);
            o.tag = tag;
            return c.get().send(as_ptr(buf), count, dtype, peer, o);
          },
          py::arg("buf_ptr"), py::arg("count"), py::arg("dtype"), py::arg("peer"),
          py::arg("cuda_stream") = 0, py::arg("tag") = 0)
      .def(
          "recv",
          [](PyCommunicator& c, std::uintptr_t buf, std::size_t count, dear::DataType dtype,
             int peer, std::uintptr_t stream, int tag) {
            dear::OpOptions o = op_options(0, stream);
            o.tag = tag;
            return c.get().recv(as_ptr(buf), count, dtype, peer, o);
          },
          py::arg("buf_ptr"), py::arg("count"), py::arg("dtype"), py::arg("peer"),
          py::arg("cuda_stream") = 0, py::arg("tag") = 0)
      .def(
          "barrier",
          [](PyCommunicator& c, int priority) { return c.get().barrier(op_options(priority, 0)); },
          py::arg("priority") = 0)
      .def("abort", [](PyCommunicator& c, const std::string& reason) { c.get().abort(reason); })
      .def(
          "forget_memory",
          [](PyCommunicator& c, std::uintptr_t ptr, std::size_t bytes) {
            c.get().forget_memory(as_ptr(ptr), bytes);
          },
          py::arg("ptr"), py::arg("bytes"));

  m.def(
      "new_unique_id",
      [](const std::string& host) { return dear::UniqueId::create(host).to_string(); },
      py::arg("host"),
      "A rendezvous id on `host` whose listener this process keeps for its rank 0 (from_id).");
  m.def("plan_threshold", &plan_threshold, py::arg("layers"), py::arg("ranks"),
        py::arg("threshold_bytes"), py::arg("element_bytes"),
        "DeAR's threshold fusion (dear::scheduler::plan_threshold): (first, last) layer ranges.");
  m.def("plan_nearby", &plan_nearby, py::arg("layers"), py::arg("ranks"),
        py::arg("layers_per_group"), py::arg("element_bytes"),
        "Every layers_per_group neighbouring layers form a group (dear::scheduler::plan_nearby): "
        "(first, last) layer ranges.");
  py::class_<dear::scheduler::ThresholdTuner>(
      m, "ThresholdTuner",
      "Bayesian optimisation of DeAR's fusion threshold (dear::scheduler::ThresholdTuner).")
      .def(py::init([](std::int64_t min_bytes, std::int64_t max_bytes, int trials,
                       std::int64_t middle_bytes) {
             dear::scheduler::TunerOptions o;
             o.min_bytes = min_bytes;
             o.max_bytes = max_bytes;
             o.trials = trials;
             o.middle_bytes = middle_bytes;
             return dear::scheduler::ThresholdTuner(o);
           }),
           py::arg("min_bytes"), py::arg("max_bytes"), py::arg("trials"),
           py::arg("middle_bytes") = 0)
      .def("next", &dear::scheduler::ThresholdTuner::next)
      .def("report", &dear::scheduler::ThresholdTuner::report, py::arg("threshold_bytes"),
           py::arg("iter_ms"))
      .def("done", &dear::scheduler::ThresholdTuner::done)
      .def("best", &dear::scheduler::ThresholdTuner::best)
      .def("trials", [](const dear::scheduler::ThresholdTuner& t) {
        std::vector<std::pair<std::int64_t, double>> v;
        for (const auto& x : t.trials()) v.emplace_back(x.threshold_bytes, x.iter_ms);
        return v;
      });
  m.attr("ALL_GATHER_PRIORITY") = dear::scheduler::kAllGatherPriority;
  m.attr("ANY_SOURCE") = dear::Communicator::kAnySource;
#ifdef DEAR_HAVE_CUDA
  // Device pointers are accepted (docs/cuda.md says how each call takes them).
  m.attr("HAVE_CUDA") = true;
#else
  m.attr("HAVE_CUDA") = false;
#endif
}
