# The shared benchmark report library (bench/report.h); included from tests/CMakeLists.txt.
dear_test(test_report SOURCES test_report.cc LIBS dear_bench_report LABELS unit)
