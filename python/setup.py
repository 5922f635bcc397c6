"""Builds the `_dear` native module for `pip install ./python`.

The module comes from the project's CMake build (target `_dear`, python/CMakeLists.txt):
- DEAR_BUILD_DIR=<a configured build tree, absolute path>: that tree's module is built (if out of date) and
  packaged, so an install after the test build costs no compilation;
- otherwise the project is configured in a build directory of setuptools' own, for the
  interpreter running pip, and only `_dear` and what it links are compiled.
DEAR_CMAKE_ARGS adds arguments to that configure step (e.g. "-DDEAR_CUDA=OFF").
"""
import os
import pathlib
import shlex
import shutil
import subprocess
import sys

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parent


class CMakeBuild(build_ext):
    def build_extension(self, ext):
        build_dir = os.environ.get("DEAR_BUILD_DIR")
        if build_dir:
            build = pathlib.Path(build_dir)
            if not build.is_absolute():
                sys.exit(f"setup.py: DEAR_BUILD_DIR={build_dir} must be an absolute path (pip runs"
                         " this from a directory of its own)")
        else:
            build = pathlib.Path(self.build_temp).resolve() / "cmake"
            build.mkdir(parents=True, exist_ok=True)
            args = ["cmake", "-S", str(ROOT), "-B", str(build), "-DCMAKE_BUILD_TYPE=Release",
                    f"-DPython_EXECUTABLE={sys.executable}", "-DDEAR_BUILD_TESTS=OFF",
                    "-DDEAR_BUILD_BENCH=OFF", "-DDEAR_BUILD_PEERS=OFF"]
            if shutil.which("ninja"):
                args += ["-G", "Ninja"]
            args += shlex.split(os.environ.get("DEAR_CMAKE_ARGS", ""))
            subprocess.check_call(args)
        subprocess.check_call(["cmake", "--build", str(build), "--target", "_dear", "-j",
                               str(os.cpu_count() or 1)])
        built = sorted((build / "python" / "dear").glob("_dear*.so"))
        if not built:
            sys.exit(f"setup.py: no _dear module in {build}/python/dear (was the build configured"
                     " with pybind11 and this interpreter's headers?)")
        target = pathlib.Path(self.get_ext_fullpath(ext.name))
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(built[0], target)


setup(ext_modules=[Extension("dear._dear", sources=[])], cmdclass={"build_ext": CMakeBuild})
