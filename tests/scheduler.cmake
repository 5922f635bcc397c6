# The scheduler layer's tests (fusion planners, policies, simulator); included from
# tests/CMakeLists.txt.
dear_test(test_scheduler SOURCES test_scheduler.cc LIBS dear_scheduler nlohmann_json::nlohmann_json
          LABELS unit)
