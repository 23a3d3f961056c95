"""Builds LazyLlama's native CPU ops (`csrc/`) into the module `lazy_llama_cpu` at install time.

The project metadata lives in pyproject.toml; this file only adds the C++ extension. It needs the torch it will run
with at build time (`pip install --no-build-isolation`, as the Makefile does) and a C++ compiler. Without either the
project still installs, with one line saying so, and the model runs its PyTorch path on CPU.
"""

import sys

from setuptools import setup
from setuptools.command.build_ext import build_ext

NAME = "lazy_llama_cpu"
SOURCES = ["csrc/lazy_attention_cpu.cpp"]


def _skip(reason: str) -> None:
    print(f"lazyllama: the native CPU op ({NAME}) is not built: {reason}; the PyTorch CPU path is used instead.",
          file=sys.stderr)


class _OptionalBuildExt(build_ext):
    """A failed compile is reported in one line and skipped, not an install failure."""

    def run(self):
        try:
            super().run()
        except Exception as error:  # noqa: BLE001 - any compiler or toolchain failure
            _skip(f"{type(error).__name__}: {error}")

    def build_extension(self, ext):
        try:
            super().build_extension(ext)
        except Exception as error:  # noqa: BLE001
            _skip(f"{type(error).__name__}: {error}")


def _extensions():
    try:
        from torch.utils.cpp_extension import BuildExtension, CppExtension
    except ImportError:
        _skip("torch is not importable at build time (install torch first, then pip install --no-build-isolation)")
        return [], {}
    openmp = ["-fopenmp"] if sys.platform.startswith("linux") else []
    extension = CppExtension(
        NAME, SOURCES, py_limited_api=False,
        extra_compile_args=["-O3", "-fno-math-errno", *openmp], extra_link_args=openmp)

    class _Build(_OptionalBuildExt, BuildExtension.with_options(use_ninja=False)):
        pass

    return [extension], {"build_ext": _Build}


extensions, commands = _extensions()
setup(ext_modules=extensions, cmdclass=commands)
