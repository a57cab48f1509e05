"""The optional native kernel (neuron_trio/engine/model/_cpu_kernel.c, which includes
_cpu_layers.c); everything else is in pyproject.toml.

`optional=True`: where it cannot be built (no C compiler, another architecture) the install
goes on without it and the engine uses torch's int4 kernel (see `native_kernel()` in
neuron_trio/engine/model/load/packing.py). It needs only Python's headers, never torch's, so
build isolation pulls nothing but setuptools.
"""

import platform

from setuptools import Extension, setup

x86 = platform.machine().lower() in ("x86_64", "amd64")
kernels = []
if x86:
    kernels.append(
        Extension(
            "neuron_trio.engine.model._cpu_kernel",
            ["neuron_trio/engine/model/_cpu_kernel.c"],
            depends=["neuron_trio/engine/model/_cpu_layers.c"],
            extra_compile_args=["-O3", "-fopenmp", "-std=c11"],
            extra_link_args=["-fopenmp"],
            optional=True,
        )
    )
setup(ext_modules=kernels)
