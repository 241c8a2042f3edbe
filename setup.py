"""The one part of packaging pyproject.toml cannot say: which packages the wheel holds.

Three of plugintrain's packages live beside it (``strategies/`` installs as
``plugintrain.strategies``, and so do ``model_zoo/`` and ``precision_plugins/``), and
``[tool.setuptools.packages.find]`` cannot put a found folder under another name. So each
folder's packages are found here, under their installed names: a new subpackage is in the
wheel without being listed, and nothing else (tests/, benchmarks/) is. ``recipes/`` ships
as ``plugintrain.recipes`` (its YAML files as package data), so ``plugintrain fit --config
NAME`` works from a pip install. Everything else is in pyproject.toml.
"""

from setuptools import find_packages, setup

PACKAGE_DIR = {
    "plugintrain": "plugintrain",
    "plugintrain.strategies": "strategies",
    "plugintrain.model_zoo": "model_zoo",
    "plugintrain.precision_plugins": "precision_plugins",
    "plugintrain.recipes": "recipes",
}


def packages() -> list[str]:
    """Each folder of :data:`PACKAGE_DIR` and every package below it, as installed."""
    return [
        name
        for package, folder in PACKAGE_DIR.items()
        for name in (package, *(f"{package}.{sub}" for sub in find_packages(folder)))
    ]


setup(
    package_dir=PACKAGE_DIR,
    packages=packages(),
    package_data={"plugintrain.recipes": ["*.yaml"]},
)
