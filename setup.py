"""The one compiled part of edgerun: the tensor-parallel exchange's native data path (edgerun/net/fastpath.c), a
plain C library loaded with ctypes (no Python API, so one build serves every Python version). Optional: where no C
compiler builds it, the install goes on and the exchange runs on its Python path. Everything else is declared in
pyproject.toml."""

from setuptools import Extension, setup

setup(ext_modules=[Extension("edgerun.net._fastpath", ["edgerun/net/fastpath.c"], optional=True,
                             extra_compile_args=["-O2", "-fno-fast-math"], libraries=["dl", "m"])])
