"""Builds torch_sac by driving CMake against the installed torch.

Install without build isolation so the build sees that torch (and pip never
installs another one):
    pip install --no-build-isolation -e .

The torch release it was built against is written to torch_sac/_build_info.py;
``import torch_sac`` refuses to load under any other release.
GoogleTest binaries are built only with TORCH_SAC_BUILD_TESTS=ON
(scripts/setup.sh sets it).
"""

import os
import subprocess
import sys
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).resolve().parent
# A fixed build tree: CTest runs the two GoogleTest binaries from here and
# rebuilds stay incremental.
BUILD_DIR = ROOT / "build" / "cmake"


class CMakeExtension(Extension):
    def __init__(self, name):
        super().__init__(name, sources=[])


class CMakeBuild(build_ext):
    def build_extension(self, ext):
        output = Path(self.get_ext_fullpath(ext.name)).resolve()
        output.parent.mkdir(parents=True, exist_ok=True)
        BUILD_DIR.mkdir(parents=True, exist_ok=True)
        import torch  # the installed torch: the one this build is for

        (ROOT / "torch_sac" / "_build_info.py").write_text(
            "# Written by setup.py at build time; not tracked.\n"
            f"BUILT_WITH_TORCH = {torch.__version__!r}\n"
        )
        build_tests = os.environ.get("TORCH_SAC_BUILD_TESTS", "OFF")
        configure = [
            "cmake",
            "-S",
            str(ROOT),
            "-B",
            str(BUILD_DIR),
            f"-DPython3_EXECUTABLE={sys.executable}",
            f"-DTORCH_SAC_EXTENSION_OUTPUT={output}",
            f"-DTORCH_SAC_BUILD_TESTS={build_tests}",
            # Explicit: a build tree configured C++-only before keeps its cache.
            "-DTORCH_SAC_BUILD_PYTHON=ON",
            "-DCMAKE_BUILD_TYPE=Release",
        ]
        subprocess.check_call(configure)
        jobs = str(os.cpu_count() or 2)
        subprocess.check_call(["cmake", "--build", str(BUILD_DIR), "-j", jobs])


setup(
    ext_modules=[CMakeExtension("torch_sac._C")],
    cmdclass={"build_ext": CMakeBuild},
)
