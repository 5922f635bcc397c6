#include "dear/scheduler/model.h"

#include <algorithm>
#include <cmath>
#include <fstream>
#include <nlohmann/json.hpp>
#include <numeric>
#include <sstream>

#include "dear/error.h"

namespace dear::scheduler {
namespace {

using nlohmann::json;

[[noreturn]] void bad(const std::string& what) {
  throw Error(ErrorCode::kInvalidArgument, "model profile: " + what);
}

template <typename T>
T field(const json& object, const char* key, const std::string& where) {
  auto it = object.find(key);
  if (it == object.end()) bad(where + ": missing \"" + key + "\"");
  try {
    return it->get<T>();
  } catch (const json::exception& e) {
    bad(where + ": \"" + key + "\" has the wrong type (" + e.what() + ")");
  }
}

}  // namespace

std::int64_t Layer::params() const {
  return std::accumulate(tensors.begin(), tensors.end(), std::int64_t{0});
}

std::int64_t Model::params() const {
  std::int64_t total = 0;
  for (const auto& l : layers) total += l.params();
  return total;
}

double Model::forward_s() const {
  double total = 0;
  for (const auto& l : layers) total += l.forward_s;
  return total;
}

double Model::backward_s() const {
  double total = 0;
  for (const auto& l : layers) total += l.backward_s;
  return total;
}

std::int64_t Model::layer_bytes(std::size_t layer) const {
  return layers.at(layer).params() * element_bytes;
}

std::vector<std::int64_t> layer_offsets(const Model& model) {
  std::vector<std::int64_t> out(model.layers.size() + 1, 0);
  for (std::size_t l = 0; l < model.layers.size(); ++l) {
    out[l + 1] = out[l] + model.layers[l].params();
  }
  return out;
}

Model scale_model(const Model& model, double time_scale, double param_scale) {
  if (!(time_scale > 0) || !(param_scale > 0)) {
    throw Error(ErrorCode::kInvalidArgument, "scale_model: time_scale and param_scale must be > 0");
  }
  Model m = model;
  for (auto& l : m.layers) {
    l.forward_s *= time_scale;
    l.backward_s *= time_scale;
    for (auto& t : l.tensors) {
      t = std::max<std::int64_t>(1, std::llround(static_cast<double>(t) * param_scale));
    }
  }
  return m;
}

Model parse_model(std::string_view json_text) {
  json doc;
  try {
    doc = json::parse(json_text);
  } catch (const json::exception& e) {
    bad(std::string("not JSON: ") + e.what());
  }
  if (!doc.is_object()) bad("top level is not an object");
  Model m;
  m.name = field<std::string>(doc, "name", "profile");
  m.batch_size = doc.value("batch_size", 1);
  m.element_bytes = doc.value("element_bytes", 4);
  if (m.batch_size < 1 || m.element_bytes < 1) bad("batch_size and element_bytes must be >= 1");
  const auto& layers = doc.find("layers");
  if (layers == doc.end() || !layers->is_array() || layers->empty()) {
    bad("\"layers\" must be a non-empty array");
  }
  for (std::size_t i = 0; i < layers->size(); ++i) {
    const json& jl = (*layers)[i];
    const std::string where = "layer " + std::to_string(i);
    Layer l;
    l.name = field<std::string>(jl, "name", where);
    l.tensors = field<std::vector<std::int64_t>>(jl, "params", where);
    // Profiles are written in milliseconds, the unit people read; seconds inside.
    l.forward_s = field<double>(jl, "fwd_ms", where) * 1e-3;
    l.backward_s = field<double>(jl, "bwd_ms", where) * 1e-3;
    for (auto t : l.tensors) {
      if (t <= 0) bad(where + " (" + l.name + "): tensor sizes must be positive");
    }
    if (l.tensors.empty()) bad(where + " (" + l.name + "): no parameter tensors");
    if (l.forward_s < 0 || l.backward_s < 0) bad(where + ": negative time");
    m.layers.push_back(std::move(l));
  }
  return m;
}

std::string model_to_json(const Model& model) {
  json doc;
  doc["name"] = model.name;
  doc["batch_size"] = model.batch_size;
  doc["element_bytes"] = model.element_bytes;
  doc["total_params"] = model.params();
  json layers = json::array();
  for (const auto& l : model.layers) {
    layers.push_back({{"name", l.name},
                      {"params", l.tensors},
                      {"fwd_ms", l.forward_s * 1e3},
                      {"bwd_ms", l.backward_s * 1e3}});
  }
  doc["layers"] = std::move(layers);
  return doc.dump(1) + "\n";
}

Model load_model(const std::string& path) {
  std::ifstream in(path);
  if (!in) throw Error(ErrorCode::kInvalidArgument, "cannot open model profile " + path);
  std::stringstream text;
  text << in.rdbuf();
  try {
    return parse_model(text.str());
  } catch (const Error& e) {
    throw Error(ErrorCode::kInvalidArgument, path + ": " + e.cause());
  }
}

void save_model(const Model& model, const std::string& path) {
  std::ofstream out(path);
  out << model_to_json(model);
  if (!out) throw Error(ErrorCode::kSystem, "cannot write model profile " + path);
}

}  // namespace dear::scheduler
