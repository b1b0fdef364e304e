"""Every refusal a user can act on is a MegamambaError, and there is one LayoutError."""

import importlib
import inspect
import pkgutil

import megamamba
import megamamba.kernels
import megamamba.pipelines
from megamamba.errors import LayoutError, MegamambaError

REFUSALS = ("Error", "NonFiniteSteps")


def _classes():
    """(module, name, class) of every exception class defined in megamamba, its pipelines and kernels."""
    packages = (megamamba, megamamba.pipelines, megamamba.kernels)
    modules = sorted(
        {info.name for package in packages for info in pkgutil.walk_packages(package.__path__, package.__name__ + ".")}
    )
    for module_name in modules:
        for name, value in vars(importlib.import_module(module_name)).items():
            if inspect.isclass(value) and issubclass(value, Exception) and value.__module__ == module_name:
                yield module_name, name, value


def test_every_error_class_of_the_package_is_a_megamamba_error():
    strays = [
        f"{module}.{name}"
        for module, name, cls in _classes()
        if name.endswith(REFUSALS) and not issubclass(cls, MegamambaError)
    ]
    assert not strays, f"user-facing errors outside MegamambaError: {strays}"


def test_one_layout_error_is_defined():
    defined = [f"{module}.{name}" for module, name, _ in _classes() if name == "LayoutError"]
    assert defined == ["megamamba.errors.LayoutError"], defined
    from megamamba.parallel.tensor.model_layout import LayoutError as model_layout_error
    from megamamba.pipelines.config.layout import LayoutError as run_layout_error

    assert model_layout_error is run_layout_error is LayoutError
