"""Install hook: generate the gRPC code from proto/ before the packages are collected."""

import runpy
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py


class BuildPyWithProto(build_py):
    def run(self):
        runpy.run_path(str(Path(__file__).parent / "proto" / "generate.py"))["generate"]()
        super().run()


setup(cmdclass={"build_py": BuildPyWithProto})
