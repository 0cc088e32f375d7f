"""Build hook: cffi_modules is a setup() keyword, so it cannot live in pyproject.toml."""

from setuptools import setup

setup(cffi_modules=["rdmaio/_ffi/build.py:ffibuilder"])
