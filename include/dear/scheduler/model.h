// The training step as the scheduler sees it: layers in forward order, each with its parameter
// tensors and its forward and backward compute times.
//
// Profiles are JSON files (profiles/*.json, made by profiles/make_profiles.py):
//   {"name": "resnet50", "batch_size": 64, "element_bytes": 4,
//    "layers": [{"name": "conv1", "params": [9408], "fwd_ms": 2.06, "bwd_ms": 4.12}, …]}
// Unknown keys are kept out of the model and ignored, so profiles may carry provenance.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace dear::scheduler {

struct Layer {
  std::string name;
  std::vector<std::int64_t> tensors;  // element count of each parameter tensor
  double forward_s = 0;
  double backward_s = 0;

  [[nodiscard]] std::int64_t params() const;
};

struct Model {
  std::string name;
  int batch_size = 1;         // samples per worker per iteration
  int element_bytes = 4;      // gradient element size (fp32)
  std::vector<Layer> layers;  // forward order

  [[nodiscard]] std::int64_t params() const;
  [[nodiscard]] double forward_s() const;
  [[nodiscard]] double backward_s() const;
  [[nodiscard]] std::int64_t layer_bytes(std::size_t layer) const;
};

// offsets[l] is where layer l's parameters start when the model's tensors are laid out flat in
// forward order; offsets[layers] is the total. Size layers + 1.
[[nodiscard]] std::vector<std::int64_t> layer_offsets(const Model& model);

// The model with every compute time multiplied by `time_scale` and every tensor's element
// count by `param_scale` (rounded, at least 1): a smaller stand-in that keeps the model's
// shape, for short runs. Throws dear::Error(kInvalidArgument) unless both are > 0.
[[nodiscard]] Model scale_model(const Model& model, double time_scale, double param_scale);

// Parse / print a profile. Throws dear::Error(kInvalidArgument) naming the offending field.
[[nodiscard]] Model parse_model(std::string_view json_text);
[[nodiscard]] std::string model_to_json(const Model& model);
[[nodiscard]] Model load_model(const std::string& path);
void save_model(const Model& model, const std::string& path);

}  // namespace dear::scheduler
