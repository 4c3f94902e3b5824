"""The compiled parts of edgerun: the tensor-parallel exchange's native data path (edgerun/net/fastpath.c) and a
batched Q4_1 product for ggml graphs (edgerun/model/kernels.c), plain C libraries loaded with ctypes (no Python
API, so one build serves every Python version). Optional: where no C compiler builds them, the install goes on, the
exchange runs on its Python path and products are ggml's own. Everything else is declared in pyproject.toml."""

from setuptools import Extension, setup

setup(ext_modules=[Extension("edgerun.net._fastpath", ["edgerun/net/fastpath.c"], optional=True,
                             extra_compile_args=["-O2", "-fno-fast-math"], libraries=["dl", "m"]),
                   # -ffp-contract=off: the kernel's multiplies and adds are exactly those it writes (its fused
                   # ones explicit), so its bits are ggml's
                   Extension("edgerun.model._kernels", ["edgerun/model/kernels.c"], optional=True,
                             extra_compile_args=["-O2", "-fno-fast-math", "-ffp-contract=off"], libraries=["m"])])
