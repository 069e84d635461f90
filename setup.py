"""Build hook for the optional native ingest path; all metadata is in pyproject.toml.

The extension is optional: where no C compiler is available the build goes on
without it and the operator uses the pure-Python receive and decode (slower,
same results; see operator/stepscale_operator/fpm_native.py).
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "stepscale_operator._fpm_native",
            sources=["operator/stepscale_operator/_fpm_native.c"],
            extra_compile_args=["-O2", "-std=c11", "-Wall", "-Wextra"],
            libraries=["dl"],
            optional=True,
        )
    ]
)
