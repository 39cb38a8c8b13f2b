"""Package discovery for a layout setuptools cannot find on its own: the repository root is the package
``tidal`` (``package-dir`` in pyproject.toml), so every folder below it holding an ``__init__.py`` is the
subpackage ``tidal.<folder>``, and this file is not a module of it. Everything else is in pyproject.toml."""

from setuptools import find_packages, setup
from setuptools.command.build_py import build_py


class BuildPy(build_py):
    def find_package_modules(self, package, package_dir):
        modules = super().find_package_modules(package, package_dir)
        return [m for m in modules if (m[0], m[1]) != ("tidal", "setup")]


setup(packages=["tidal", *(f"tidal.{name}" for name in find_packages(exclude=["tests", "tests.*"]))],
      cmdclass={"build_py": BuildPy})
