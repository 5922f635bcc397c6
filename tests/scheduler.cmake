# The scheduler layer's tests (fusion planners, policies, simulator); included from
# tests/CMakeLists.txt.
dear_test(test_scheduler SOURCES test_scheduler.cc LIBS dear_scheduler nlohmann_json::nlohmann_json
          LABELS unit)
# Profile replay on real collectives (ranks as threads over loopback).
dear_test(test_replay SOURCES test_replay.cc LIBS dear_scheduler dear_collectives LABELS unit
          PROPERTIES TIMEOUT 300)
