# The `layers` test: the include graph agrees with the layer list of docs/architecture.md
# (scripts/check-layers.py), and the checker itself catches an upward include (its self-test).
# Included from tests/CMakeLists.txt.
find_package(Python3 COMPONENTS Interpreter)
if(Python3_Interpreter_FOUND)
  add_test(NAME layers COMMAND ${Python3_EXECUTABLE} ${PROJECT_SOURCE_DIR}/scripts/check-layers.py
                               --root ${PROJECT_SOURCE_DIR})
  add_test(NAME layers_self_test
           COMMAND ${Python3_EXECUTABLE} ${PROJECT_SOURCE_DIR}/scripts/check-layers.py --self-test)
  set_tests_properties(layers layers_self_test PROPERTIES LABELS unit TIMEOUT 60)
else()
  add_test(NAME layers COMMAND ${CMAKE_COMMAND} -E echo "layer check skipped: no python3")
  set_tests_properties(layers PROPERTIES LABELS unit SKIP_REGULAR_EXPRESSION "layer check skipped:")
endif()
