// Small command-line helpers shared by dear-sim and dear-train.
#pragma once

#include <filesystem>
#include <sstream>
#include <string>
#include <vector>

namespace dear::tools {

// A model argument is a profile file when one exists at that path, else a name looked up as
// DIR/NAME.json (the profiles shipped with dear).
inline std::string profile_path(const std::string& model, const std::string& dir) {
  if (std::filesystem::exists(model)) return model;
  return (std::filesystem::path(dir) / (model + ".json")).string();
}

// "a,b,,c" -> {"a", "b", "c"}.
inline std::vector<std::string> split(const std::string& list) {
  std::vector<std::string> out;
  std::stringstream in(list);
  for (std::string item; std::getline(in, item, ',');) {
    if (!item.empty()) out.push_back(item);
  }
  return out;
}

}  // namespace dear::tools
