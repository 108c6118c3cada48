// moerun._layer: one MoE layer of a Hugging Face checkpoint, computed in this process by moerun's
// CPU kernels (runtime/layer/moe_layer.h), as `moerun forward --model DIR` computes it: the same
// loader, the same kernels, the same bits. Python sees it as moerun.Layer
// (python/moerun/__init__.py).
//
// Errors come back as Python exceptions carrying the C++ message: kInvalidArgument -> ValueError,
// kNotFound -> FileNotFoundError, every other code -> RuntimeError. The GIL is released while a
// layer loads and while it computes, so other Python threads (and other Layers) run meanwhile;
// one Layer computes one batch at a time (MoeLayer::Forward is not reentrant: a mutex per Layer).
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "base/status.h"
#include "base/thread_pool.h"
#include "experts/cpu/isa.h"
#include "experts/cpu/kernels.h"
#include "experts/cpu/packed_matrix.h"
#include "moerun/build_info.h"
#include "runtime/layer/moe_layer.h"
#include "runtime/model/checkpoint.h"
#include "runtime/model/layer_loader.h"
#include "runtime/model/model_spec.h"

namespace py = pybind11;

namespace moerun {
namespace {

// Raises the Python exception that matches `s` (which must not be ok).
[[noreturn]] void Raise(const Status& s) {
  switch (s.code()) {
    case StatusCode::kInvalidArgument:
      throw py::value_error(s.message());
    case StatusCode::kNotFound:
      PyErr_SetString(PyExc_FileNotFoundError, s.message().c_str());
      throw py::error_already_set();
    default:
      throw std::runtime_error(std::string(StatusCodeName(s.code())) + ": " + s.message());
  }
}

// `isa` as `moerun forward --isa` takes it: empty picks the best this CPU runs (lowered by
// MOERUN_ISA; a bad MOERUN_ISA falls back with a warning, here a Python RuntimeWarning).
Result<Isa> ResolveIsa(const std::string& name, std::string* warning) {
  if (name.empty()) return DefaultIsa(warning);
  const auto isa = ParseIsa(name);
  if (!isa)
    return Status::InvalidArgument("isa must be scalar, avx2 or avx512, not '" + name + "'");
  if (*isa > BestIsa()) {
    return Status::InvalidArgument("isa " + name + ": this CPU supports up to " +
                                   IsaName(BestIsa()));
  }
  return *isa;
}

// The first value of x[n] that is not finite, as its index; n when all are (NaN and Inf are
// rejected, as `moerun forward` and the serving endpoint reject them).
size_t FirstNonFinite(const float* x, size_t n) {
  for (size_t i = 0; i < n; ++i) {
    uint32_t bits;
    std::memcpy(&bits, &x[i], sizeof(bits));
    if ((bits & 0x7f800000u) == 0x7f800000u) return i;
  }
  return n;
}

class PyLayer {
 public:
  PyLayer(std::string model_dir, int layer, int threads, const std::string& isa)
      : model_dir_(std::move(model_dir)) {
    if (threads < 0 || threads > 1024) {
      throw py::value_error("threads must be in 0..1024 (0: one per core), not " +
                            std::to_string(threads));
    }
    if (layer < -1) {
      throw py::value_error("layer must be -1 (the first MoE layer) or a layer index, not " +
                            std::to_string(layer));
    }
    std::string warning;
    Status s;
    {
      py::gil_scoped_release release;
      s = Load(layer, threads, isa, &warning);
    }
    if (!warning.empty() && PyErr_WarnEx(PyExc_RuntimeWarning, warning.c_str(), 1) != 0) {
      throw py::error_already_set();
    }
    if (!s.ok()) Raise(s);
  }

  py::array_t<float> Forward(const py::object& obj) {
    if (!py::isinstance<py::array>(obj)) {
      throw py::type_error("x must be a numpy.ndarray of float32 [..., " +
                           std::to_string(hidden()) + "], not " +
                           std::string(py::str(py::type::of(obj).attr("__name__"))));
    }
    py::array x = py::reinterpret_borrow<py::array>(obj);
    if (!py::isinstance<py::array_t<float>>(x)) {
      throw py::value_error("x must be float32 (native byte order), not " +
                            std::string(py::str(x.dtype())));
    }
    if (x.ndim() == 0) {
      throw py::value_error("x must have shape [..., " + std::to_string(hidden()) +
                            "], not a 0-d array");
    }
    const int64_t last = static_cast<int64_t>(x.shape(x.ndim() - 1));
    if (last != hidden()) {
      throw py::value_error("x has last dimension " + std::to_string(last) +
                            "; this layer's hidden size is " + std::to_string(hidden()) +
                            " (expected shape [..., " + std::to_string(hidden()) + "])");
    }
    std::vector<py::ssize_t> shape(x.shape(), x.shape() + x.ndim());
    int64_t tokens = 1;
    for (py::ssize_t i = 0; i + 1 < x.ndim(); ++i) tokens *= static_cast<int64_t>(shape[i]);
    // A copy only when the kernels cannot read the array as it is (strided, or unaligned).
    const int need = static_cast<int>(py::detail::npy_api::NPY_ARRAY_C_CONTIGUOUS_) |
                     static_cast<int>(py::detail::npy_api::NPY_ARRAY_ALIGNED_);
    if ((x.flags() & need) != need) {
      py::array_t<float> copy(shape);
      copy[py::ellipsis()] = x;
      x = std::move(copy);
    }
    py::array_t<float> out(shape);
    const float* in = static_cast<const float*>(x.data());
    float* dst = out.mutable_data();
    Status s;
    {
      py::gil_scoped_release release;
      s = Compute(in, tokens, dst);
    }
    if (!s.ok()) Raise(s);
    return out;
  }

  int64_t hidden() const { return weights_->spec.hidden; }
  int num_experts() const { return weights_->spec.num_experts; }
  int top_k() const { return weights_->spec.top_k; }
  int layer() const { return weights_->layer; }
  std::string family() const { return FamilyName(weights_->spec.family); }
  std::string weight_dtype() const { return HeldTypeName(weights_->dtype); }
  std::string isa() const { return IsaName(isa_); }
  int threads() const { return pool_->size(); }
  const std::string& model_dir() const { return model_dir_; }

  std::string Repr() const {
    return "<moerun.Layer " + family() + " layer " + std::to_string(layer()) + ": " +
           std::to_string(num_experts()) + " experts top-" + std::to_string(top_k()) + ", hidden " +
           std::to_string(hidden()) + ", " + weight_dtype() + " weights | cpu " + isa() + " x" +
           std::to_string(threads()) + " threads | " + model_dir_ + ">";
  }

 private:
  // As LoadLayerFromFlags (launch/layer_flags.cc) loads --model DIR, for RunLocal's kernels.
  Status Load(int layer, int threads, const std::string& isa_name, std::string* warning) {
    MOERUN_ASSIGN_OR_RETURN(isa_, ResolveIsa(isa_name, warning));
    const CpuKernels& kernels = KernelsFor(isa_);
    pool_ = std::make_unique<ThreadPool>(threads);
    MOERUN_ASSIGN_OR_RETURN(ModelSpec spec, LoadModelSpec(model_dir_));
    MOERUN_ASSIGN_OR_RETURN(auto ckpt, Checkpoint::Open(model_dir_));
    LoadOptions opts;
    opts.layer = layer;
    opts.threads = pool_->size();
    MOERUN_ASSIGN_OR_RETURN(MoeLayerWeights w, LoadLayer(*ckpt, spec, kernels, opts));
    weights_ = std::make_shared<const MoeLayerWeights>(std::move(w));
    layer_ = std::make_unique<MoeLayer>(weights_, kernels, pool_.get());
    return Status::Ok();
  }

  // Runs without the GIL: checks the values, then one batch under the Layer's mutex.
  Status Compute(const float* x, int64_t tokens, float* out) {
    const size_t n = static_cast<size_t>(tokens * hidden());
    if (const size_t bad = FirstNonFinite(x, n); bad < n) {
      const size_t h = static_cast<size_t>(hidden());
      return Status::InvalidArgument("input is not finite at token " + std::to_string(bad / h) +
                                     ", column " + std::to_string(bad % h) + " (value " +
                                     std::to_string(x[bad]) + "; NaN and Inf are rejected)");
    }
    if (tokens == 0) return Status::Ok();
    std::lock_guard<std::mutex> lock(mu_);
    return layer_->Forward(x, tokens, out);
  }

  std::string model_dir_;
  Isa isa_ = Isa::kScalar;
  std::unique_ptr<ThreadPool> pool_;
  std::shared_ptr<const MoeLayerWeights> weights_;
  std::unique_ptr<MoeLayer> layer_;
  std::mutex mu_;  // one Forward at a time
};

py::dict BuildInfo() {
  py::dict d;
  d["version"] = MOERUN_VERSION;
  py::list isas;
  for (Isa i : SupportedIsas()) isas.append(IsaName(i));
  d["isa"] = isas;
  d["best_isa"] = IsaName(BestIsa());
  d["default_isa"] = IsaName(DefaultIsa());
  d["cpu"] = DetectCpu().brand;
  d["build_type"] = MOERUN_BUILD_TYPE;
  d["compiler"] = MOERUN_CXX_COMPILER;
  return d;
}

}  // namespace
}  // namespace moerun

PYBIND11_MODULE(_layer, m) {
  using moerun::PyLayer;
  m.doc() =
      "One MoE layer of a Hugging Face checkpoint, computed in this process by moerun's CPU "
      "kernels: bitwise what `moerun forward` (and a `moerun serve` job on the same kernels) "
      "computes. Use it as moerun.Layer.";
  m.def("build_info", &moerun::BuildInfo,
        "What this build of moerun holds: {'version', 'isa' (the kernel variants this CPU runs, "
        "scalar first), 'best_isa', 'default_isa' (best, lowered by MOERUN_ISA), 'cpu', "
        "'build_type', 'compiler'}.");
  py::class_<PyLayer>(m, "Layer",
                      "One MoE layer (gate, top-k, the experts, combine, shared expert) loaded "
                      "from a Hugging Face checkpoint folder into moerun's packed CPU form.")
      .def(py::init<std::string, int, int, const std::string&>(), py::arg("model_dir"),
           py::arg("layer") = -1, py::arg("threads") = 0, py::arg("isa") = "",
           "Layer(model_dir, layer=-1, threads=0, isa='')\n\n"
           "Loads one MoE layer from a Hugging Face checkpoint folder (config.json and "
           "safetensors: one file or an index of shards) exactly as `moerun forward --model "
           "DIR --layer N --threads T --isa I` does. The weights are held in the checkpoint's "
           "type (f32, bf16, f16; fp8 and mxfp4 stay quantized).\n\n"
           "layer: the decoder layer's index; -1 (default) takes the first MoE layer.\n"
           "threads: worker threads for this layer (0: one per core).\n"
           "isa: CPU kernels 'scalar', 'avx2' or 'avx512' ('': the best this CPU runs, lowered "
           "by MOERUN_ISA); every variant gives the same bits.\n\n"
           "Raises FileNotFoundError (no config.json or checkpoint), ValueError (bad "
           "arguments, a config that makes no sense, a layer that is not an MoE layer), "
           "RuntimeError (corrupt or unsupported tensors, I/O errors). The GIL is released "
           "while the weights load.")
      .def("forward", &PyLayer::Forward, py::arg("x"),
           "forward(x) -> numpy.ndarray\n\n"
           "The layer's output for x, a numpy float32 array of shape [..., hidden] (any "
           "leading dimensions; strided arrays are copied first): a new float32 array of the "
           "same shape. Each token's output bits do not depend on the other tokens in the "
           "batch, the thread count or the ISA.\n\n"
           "Raises TypeError when x is not a numpy array, ValueError when it is not float32, "
           "is 0-d, its last dimension is not hidden, or it holds NaN or Inf (as the serving "
           "endpoint rejects them). The GIL is released during the compute; calls on one Layer "
           "run one at a time, calls on different Layers in parallel.")
      .def("__call__", &PyLayer::Forward, py::arg("x"), "The same as forward(x).")
      .def_property_readonly("hidden", &PyLayer::hidden, "The hidden size (x's last dimension).")
      .def_property_readonly("num_experts", &PyLayer::num_experts, "Routed experts of the layer.")
      .def_property_readonly("top_k", &PyLayer::top_k, "Experts each token is routed to.")
      .def_property_readonly("layer", &PyLayer::layer, "The decoder layer's index.")
      .def_property_readonly("family", &PyLayer::family,
                             "The model family, as config.json's model_type: 'mixtral', "
                             "'qwen2_moe', 'qwen3_moe', 'deepseek_v3', 'gpt_oss', 'step3p5'.")
      .def_property_readonly("weight_dtype", &PyLayer::weight_dtype,
                             "The type the experts are held in: 'f32', 'bf16', 'f16', 'fp8' "
                             "(e4m3, 128x128 blocks) or 'mxfp4'.")
      .def_property_readonly("isa", &PyLayer::isa,
                             "The CPU kernels in use: 'scalar', 'avx2' or 'avx512'.")
      .def_property_readonly("threads", &PyLayer::threads, "Threads computing this layer.")
      .def_property_readonly("model_dir", &PyLayer::model_dir, "The checkpoint folder given.")
      .def("__repr__", &PyLayer::Repr);
}
