"""Build of the native drain loop (runtime/proxy/native); all other metadata is in pyproject.toml.

The extension links nothing but libc/libdl: CUDA entry points are looked up at run time
(runtime/proxy/native/cuda_api.cpp), so building needs gcc and pybind11 only, no CUDA toolkit.
"""

from __future__ import annotations

from pathlib import Path

from pybind11.setup_helpers import Pybind11Extension, build_ext
from setuptools import setup

NATIVE = Path("runtime/proxy/native")

setup(
    ext_modules=[
        Pybind11Extension(
            "mgraph.runtime.proxy.native._drain",
            sources=[
                str(NATIVE / f) for f in ("module.cpp", "drain.cpp", "mover.cpp", "raise.cpp",
                                             "cuda_api.cpp", "copy_kernel.cpp", "verbs.cpp",
                                             "verbs_api.cpp")
            ],
            depends=[str(p) for p in sorted([*NATIVE.glob("*.h"), *NATIVE.glob("*.cpp")])],
            cxx_std=17,
            extra_compile_args=["-O2"],
            libraries=["dl"],
        )
    ],
    cmdclass={"build_ext": build_ext},
)
