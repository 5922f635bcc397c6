# The `format` test: every C++ and CUDA source of the tree is formatted as .clang-format says
# (STYLE.md). Checked with Debian 12's clang-format (14), which scripts/test.sh installs; other
# major versions format some constructs differently, so with one of those, or none, the test
# skips and says why. Included from tests/CMakeLists.txt.
find_program(DEAR_CLANG_FORMAT NAMES clang-format-14 clang-format)
add_test(NAME format
         COMMAND ${CMAKE_COMMAND} "-DCLANG_FORMAT=${DEAR_CLANG_FORMAT}" "-DROOT=${PROJECT_SOURCE_DIR}"
                 -P ${CMAKE_CURRENT_LIST_DIR}/format_check.cmake)
set_tests_properties(format PROPERTIES LABELS unit TIMEOUT 300
                     SKIP_REGULAR_EXPRESSION "format check skipped:")
